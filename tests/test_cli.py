"""The CLI in-process: help on every command, one-line errors that name the problem and the fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import click
import polars as pl
import pytest
from click.testing import CliRunner

from dxr.cli import main
from tests.conftest import tiny_events, write_tiny_meds
from warehouse.store import Warehouse


def run(*args, data_dir=None):
    prefix = ["--data-dir", str(data_dir)] if data_dir else []
    return CliRunner().invoke(main, [*prefix, *map(str, args)], catch_exceptions=False)


def all_commands(group=main, prefix=()):
    for name, command in group.commands.items():
        yield prefix + (name,), command
        if hasattr(command, "commands"):
            yield from all_commands(command, prefix + (name,))


@pytest.mark.parametrize("path,command", list(all_commands()),
                         ids=lambda v: " ".join(v) if isinstance(v, tuple) else "")
def test_every_command_has_help_with_an_example(path, command):
    result = run(*path, "--help")
    assert result.exit_code == 0, result.output
    assert "Example:" in result.output and f"dxr {' '.join(path)}" in result.output


def test_python_dash_m_dxr_runs_the_same_command_line():
    result = subprocess.run([sys.executable, "-m", "dxr", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage: dxr ") and "Example:" in result.stdout


HOMES_IN_FORCE = ("import dxr, matplotlib; from prefect.settings import PREFECT_HOME; "
                  "print(PREFECT_HOME.value(), matplotlib.get_configdir(), sep='\\n')")


def test_prefect_and_matplotlib_move_to_the_temporary_directory_only_where_home_is_not_writable(tmp_path):
    # HOME=/dev/null stands for an unwritable HOME even for root: every flow command waited 120 s for a Prefect server
    # that could not open ~/.prefect/prefect.db, then failed with a traceback; matplotlib warned at every report.
    env = {name: value for name, value in os.environ.items()
           if name not in ("PREFECT_HOME", "MPLCONFIGDIR", "XDG_CONFIG_HOME")}
    homes = {}
    for home in ("/dev/null", str(tmp_path)):
        ran = subprocess.run([sys.executable, "-c", HOMES_IN_FORCE], env={**env, "HOME": home},
                             capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0 and "matplotlib" not in ran.stderr, ran.stderr
        homes[home] = ran.stdout.splitlines()
    temporary = Path(tempfile.gettempdir())
    assert homes == {"/dev/null": [str(temporary / f"dxr-prefect-{os.getuid()}"),
                                   str(temporary / f"dxr-matplotlib-{os.getuid()}")],
                     str(tmp_path): [str(tmp_path / ".prefect"), str(tmp_path / ".config" / "matplotlib")]}


def test_a_temporary_home_that_someone_else_could_have_made_is_not_used(tmp_path):
    # A shared /tmp lets anyone make `dxr-prefect-<uid>` first (the uid is no secret): Prefect followed a symlink to
    # their directory and kept its database and pickled task results there, where they could replace them.
    others = tmp_path / "someone else's"
    others.mkdir(mode=0o777)
    (tmp_path / f"dxr-prefect-{os.getuid()}").symlink_to(others)
    made_by_the_tool = tmp_path / f"dxr-matplotlib-{os.getuid()}"
    made_by_the_tool.mkdir()
    made_by_the_tool.chmod(0o777)  # as a tool makes it under umask 000
    env = {name: value for name, value in os.environ.items()
           if name not in ("PREFECT_HOME", "MPLCONFIGDIR", "XDG_CONFIG_HOME")}
    ran = subprocess.run([sys.executable, "-c", HOMES_IN_FORCE], capture_output=True, text=True, timeout=120,
                         env={**env, "HOME": "/dev/null", "TMPDIR": str(tmp_path)})
    assert ran.returncode == 0, ran.stderr
    prefect_home, matplotlib_home = map(Path, ran.stdout.splitlines())
    assert prefect_home.parent == tmp_path and prefect_home.name.startswith(f"dxr-prefect-{os.getuid()}-")
    assert matplotlib_home == made_by_the_tool
    for home in (prefect_home, matplotlib_home):
        status = home.lstat()
        assert home.is_dir() and not home.is_symlink() and status.st_uid == os.getuid()
        assert status.st_mode & 0o777 == 0o700
    assert not any(others.iterdir())


@pytest.mark.parametrize("args,escaped", [(["evaluate", "--help"], "config-\\u2026 id"),
                                          (["cohort", "build", "--help"], "vocabulary \\u03a9")])
def test_output_to_a_terminal_whose_encoding_lacks_a_character_escapes_it(args, escaped):
    # PYTHONIOENCODING=latin-1: Click trusts the encoding, and `…` or `Ω` raised UnicodeEncodeError part way through.
    result = CliRunner(charset="latin-1").invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert escaped in result.output and "Example:" in result.output


def one_line_error(result, exit_code: int = 1) -> str:
    assert result.exit_code == exit_code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


def usage_error(result) -> str:
    """The one line of a usage error (exit code 2)."""
    return one_line_error(result, exit_code=2)


@pytest.mark.parametrize(("args", "line"), [
    (["forecast", "--split", "bogus"], "Error: Invalid value for '--split': 'bogus' is not one of 'train', 'tuning', "
                                       "'held_out', 'all'. (usage: dxr forecast -h)"),
    (["forecast", "--cohrt", "x"], "Error: No such option '--cohrt'. Did you mean '--cohort'? "
                                   "(usage: dxr forecast -h)"),
    (["cohort", "build", "--dataset", "x"], "Error: Missing option '--name'. (usage: dxr cohort build -h)"),
    (["--bogus"], "Error: No such option '--bogus'. (usage: dxr -h)"),
    # An unknown system id is a value outside the option's choices in every command that takes one.
    (["forecast", "--cohort", "c", "--system", "ehr_prio"],
     "Error: Invalid value for '--system': unknown system 'ehr_prio'; available: dense_prior, direct, ehr_prior, "
     "global_frequency, gru, repeat_history, rrf_prior_direct, transition (usage: dxr forecast -h)"),
    (["prior", "train", "--cohort", "c", "--system", "ehr_prio"],
     "Error: Invalid value for '--system': 'ehr_prio' is not one of 'ehr_prior', 'dense_prior', 'gru'. "
     "(usage: dxr prior train -h)"),
    (["prior", "models", "--cohort", "c", "--system", "ehr_prio"],
     "Error: Invalid value for '--system': 'ehr_prio' is not one of 'ehr_prior', 'dense_prior', 'gru'. "
     "(usage: dxr prior models -h)"),
    (["prior", "promote", "--cohort", "c", "--system", "ehr_prio", "--version", "1"],
     "Error: Invalid value for '--system': 'ehr_prio' is not one of 'ehr_prior', 'dense_prior', 'gru'. "
     "(usage: dxr prior promote -h)"),
    # So is an id that names no system whose lists a run can hold, wherever dxr evaluate takes one.
    (["evaluate", "--run", "r1", "--systems", "repeat_history,ehr_prio"],
     "Error: Invalid value for '--systems': unknown system 'ehr_prio'; evaluable: dense_prior, direct, ehr_prior, "
     "global_frequency, gru, oracle, record_oracle, repeat_history, rrf_prior_direct, transition "
     "(usage: dxr evaluate -h)"),
    (["evaluate", "--run", "r1", "--pair", "oracle,ehr_prio"],
     "Error: Invalid value for '--pair': unknown system 'ehr_prio'; evaluable: dense_prior, direct, ehr_prior, "
     "global_frequency, gru, oracle, record_oracle, repeat_history, rrf_prior_direct, transition "
     "(usage: dxr evaluate -h)"),
    (["evaluate", "--run", "r1", "--pool", "ehr_prior+research_path"],
     "Error: Invalid value for '--pool': system 'research_path' is declared but not built yet, so no run has its "
     "lists; evaluable: dense_prior, direct, ehr_prior, global_frequency, gru, oracle, record_oracle, repeat_history, "
     "rrf_prior_direct, transition (usage: dxr evaluate -h)"),
    # A kind that no command records: the empty table it printed read as "no such run yet".
    (["run", "list", "--kind", "forecast:ehr_prio"],
     "Error: Invalid value for '--kind': no command records runs of kind 'forecast:ehr_prio'; the forecast kinds: "
     "forecast, forecast:dense_prior, forecast:direct, forecast:ehr_prior, forecast:global_frequency, forecast:gru, "
     "forecast:repeat_history, forecast:rrf_prior_direct, forecast:transition (usage: dxr run list -h)"),
    (["run", "list", "--kind", "forcast"],
     "Error: Invalid value for '--kind': no command records runs of kind 'forcast'; kinds: cohort, "
     "corpus[:ingest|build], evaluate, forecast[:dense_prior|direct|ehr_prior|global_frequency|gru|repeat_history|"
     "rrf_prior_direct|transition], ingest[:meds|mimic3|mimic4], promote[:ehr_prior|dense_prior|gru], synth, "
     "train[:ehr_prior|dense_prior|gru] (usage: dxr run list -h)"),
    (["nosuch"], "Error: No such command 'nosuch'. (usage: dxr -h)"),
    # --data-dir is the group's option: after the command it was refused like a typo, with no word of where it goes.
    (["cohort", "list", "--data-dir", "d"],
     "Error: No such option '--data-dir' here: it is an option of dxr itself, given before the command "
     "(dxr --data-dir DIR cohort list …), or set DXR_DATA_DIR (usage: dxr cohort list -h)"),
    (["sql", "--data-dir=d", "SELECT 1"],
     "Error: No such option '--data-dir' here: it is an option of dxr itself, given before the command "
     "(dxr --data-dir DIR sql …), or set DXR_DATA_DIR (usage: dxr sql -h)"),
])
def test_usage_errors_are_one_line_with_exit_code_2(args, line):
    result = CliRunner().invoke(main, args, prog_name="dxr")
    assert (result.exit_code, result.output.strip().splitlines()) == (2, [line])


UNSAFE_RUN_ID = "run id 'bad/x' has unsafe characters: use letters, digits and _.:-"
NAME_RULE = "use 1-64 lower-case letters, digits, '_' or '-', starting with a letter or digit"
NO_COHORT_KEY = ("cohort 'Bad/x' is no cohort name or id: names are 1-64 lower-case letters, digits, '_' or '-', "
                 "starting with a letter or digit, and ids c and 11 hex digits (`dxr cohort list` lists the cohorts)")
CORPUS_RULE = "use letters, digits and _.:- only (e.g. guidelines)"
INDEX_RULE = "use letters, digits and _.- only, not starting with a dot (it names a directory under the index root)"


@pytest.mark.parametrize(("args", "error"), [
    # Every option or argument naming a run, a dataset, a cohort, a corpus or an index checks its spelling...
    (["sql", "--run", "bad/x", "SELECT 1"], f"Invalid value for '--run': {UNSAFE_RUN_ID}"),
    (["synth", "--name", "Bad"], f"Invalid value for '--name': dataset name 'Bad' is not allowed: {NAME_RULE}"),
    (["synth", "--run-id", "bad/x"], f"Invalid value for '--run-id': {UNSAFE_RUN_ID}"),
    (["ingest", "mimic4", "{tmp}", "--name", "Bad"],
     f"Invalid value for '--name': dataset name 'Bad' is not allowed: {NAME_RULE}"),
    (["ingest", "meds", "{tmp}", "--name", "x", "--run-id", "bad/x"], f"Invalid value for '--run-id': {UNSAFE_RUN_ID}"),
    (["cohort", "build", "--dataset", "Bad", "--name", "x"],
     f"Invalid value for '--dataset': dataset name 'Bad' is not allowed: {NAME_RULE}"),
    (["cohort", "build", "--dataset", "d", "--name", "Bad"],
     f"Invalid value for '--name': cohort name 'Bad' is not allowed: {NAME_RULE}"),
    (["cohort", "delete", "Bad/x"], f"Invalid value for 'COHORT': {NO_COHORT_KEY}"),
    (["forecast", "--cohort", "Bad/x", "--system", "repeat_history"], f"Invalid value for '--cohort': {NO_COHORT_KEY}"),
    (["forecast", "--cohort", "c", "--system", "repeat_history", "--run-id", "bad/x"],
     f"Invalid value for '--run-id': {UNSAFE_RUN_ID}"),
    (["evaluate", "--run", "r1", "--run", "bad/x"], f"Invalid value for '--run': {UNSAFE_RUN_ID}"),
    (["evaluate", "--run", "r1", "--run", "r2", "--run-id", "config-x"],
     "Invalid value for '--run-id': run id 'config-x' starts with config-, as the ids a mean over repeated runs gets "
     "without --run-id (one per configuration) do: choose another"),
    (["report", "--run", "bad/x"], f"Invalid value for '--run': {UNSAFE_RUN_ID}"),
    (["run", "list", "--cohort", "Bad/x"], f"Invalid value for '--cohort': {NO_COHORT_KEY}"),
    (["run", "delete", "bad/x"], f"Invalid value for 'RUN_ID': {UNSAFE_RUN_ID}"),
    (["corpus", "ingest", "jsonl", "{tmp}", "--corpus", "bad/x"], f"Invalid value for '--corpus': corpus 'bad/x': "
                                                                  f"{CORPUS_RULE}"),
    (["corpus", "ingest", "jsonl", "{tmp}", "--corpus", "web"],
     "Invalid value for '--corpus': corpus 'web' is reserved for pages read by the web channel: choose another name"),
    (["corpus", "ingest", "jsonl", "{tmp}", "--run-id", "bad/x"], f"Invalid value for '--run-id': {UNSAFE_RUN_ID}"),
    (["corpus", "build", "--name", ".x"], f"Invalid value for '--name': index name '.x': {INDEX_RULE}"),
    (["corpus", "build", "--corpus", "pmc", "--corpus", "bad/x"],
     f"Invalid value for '--corpus': corpus 'bad/x': {CORPUS_RULE}"),
    (["corpus", "search", "q", "--name", ".x"], f"Invalid value for '--name': index name '.x': {INDEX_RULE}"),
    (["prior", "train", "--cohort", "c", "--run-id", "bad/x"], f"Invalid value for '--run-id': {UNSAFE_RUN_ID}"),
    (["prior", "models", "--cohort", "Bad/x"], f"Invalid value for '--cohort': {NO_COHORT_KEY}"),
    (["prior", "promote", "--cohort", "c", "--version", "abc"],
     "Invalid value for '--version': version 'abc' is no registered version: MLflow numbers them 1, 2, … "
     "(`dxr prior models` lists them)"),
    (["demo", "--run-id", "bad/x"], f"Invalid value for '--run-id': {UNSAFE_RUN_ID}"),
    # ... as do the lists of dxr evaluate and dxr prior, ...
    (["evaluate", "--run", "r1", "--k", ","],
     "Invalid value for '--k': ',' is not a list of comma-separated integers such as 10,20"),
    (["evaluate", "--run", "r1", "--k", "abc"],
     "Invalid value for '--k': 'abc' is not a list of comma-separated integers such as 10,20"),
    (["evaluate", "--run", "r1", "--k", "0"],
     "Invalid value for '--k': every K must be >= 1, got (0,); the variable-cardinality version is --natural"),
    (["evaluate", "--run", "r1", "--pair", "a"], "Invalid value for '--pair': 'a' is not two different systems as a,b"),
    (["evaluate", "--run", "r1", "--seed", "-1"], "Invalid value for '--seed': -1 is not in the range x>=0."),
    (["prior", "train", "--cohort", "c", "--seed", "-1"],
     "Invalid value for '--seed': -1 is not in the range 0<=x<=4294967295."),
    (["evaluate", "--run", "r1", "--systems", ","],
     "Invalid value for '--systems': ',' names no system: give a comma-separated list such as global_frequency,"
     "repeat_history, or leave the option out for every system of the run"),
    (["evaluate", "--run", "r1", "--pool", "a+"],
     "Invalid value for '--pool': 'a+' is not one or more systems joined by +, as a+b"),
    (["evaluate", "--run", "r1", "--pool", "repeat_history,transition"],
     "Invalid value for '--pool': 'repeat_history,transition' is not one or more systems joined by +, as a+b"),
    (["prior", "models", "--cohort", "c", "--system", "gru", "--system", "gru"],
     "Invalid value for '--system': gru is listed twice in systems: list each system once"),
    # ... and the paths of the ingests, ...
    (["ingest", "meds", "{tmp}/a_file", "--name", "x"],
     "Invalid value for 'PATH': {tmp}/a_file is a file, not a MEDS directory: pass the folder that holds data/ and "
     "metadata/"),
    (["ingest", "mimic3", "{tmp}/nope"],
     "Invalid value for 'PATH': MIMIC-III directory {tmp}/nope does not exist: check the path"),
    (["ingest", "mimic4", "{tmp}/a_file"],
     "Invalid value for 'PATH': {tmp}/a_file is a file: pass the MIMIC-IV directory that holds the CSV tables"),
    (["corpus", "ingest", "jsonl", "{tmp}/nope"],
     "Invalid value for '[PATH]': {tmp}/nope does not exist: give a jsonl file or a directory of them"),
    # ... while options that do not go together are usage errors too.
    (["evaluate", "--run", "r1", "--run-id", "mean"],
     "--run-id names the mean over several --run values; the evaluation of the one run r1 is stored under its own id: "
     "leave --run-id out, or add the runs to average"),
    (["evaluate", "--run", "r1", "--run", "r2", "--systems", "oracle"],
     "--systems oracle names only gold-side oracles, which are the same in every run: name a forecasting system to "
     "average over the runs"),
    (["corpus", "ingest", "jsonl", "{tmp}", "--corpus", "icd"],
     "--corpus icd is reserved for the ICD dictionary (dxr corpus ingest icd): choose another name"),
    (["corpus", "ingest", "jsonl", "{tmp}", "--fulltext-dir", "{tmp}"],
     "--fulltext-dir applies to FORMAT arxiv only, not jsonl: drop it"),
    (["corpus", "ingest", "icd", "{tmp}"], "FORMAT icd takes no PATH: it reads the ICD vocabulary tables"),
    (["corpus", "ingest", "jsonl"], "FORMAT jsonl needs a PATH (a file or a directory)"),
], ids=lambda v: " ".join(v[:3]) if isinstance(v, list) else "")
def test_malformed_option_values_are_usage_errors(tmp_path, args, error):
    # A malformed value exited 1 like an error found in the data, some only after the command had started
    # (a run id checked deep in the forecast, `--k 0` after the warehouse was opened). Each is now refused
    # while the command line is parsed: nothing is read or created.
    (tmp_path / "a_file").write_text("not a directory")
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    result = CliRunner().invoke(main, ["--data-dir", str(tmp_path / "wh"), *args], prog_name="dxr")
    command, words = main, []
    while isinstance(command, click.Group):  # the command's path, named in the line's pointer to its help
        command = command.commands[args[len(words)]]
        words.append(command.name)
    assert usage_error(result) == f"Error: {error.replace('{tmp}', str(tmp_path))} (usage: dxr {' '.join(words)} -h)"
    assert not (tmp_path / "wh").exists()


def test_a_bare_group_still_shows_its_help():
    result = CliRunner().invoke(main, ["cohort"], prog_name="dxr")
    assert result.output.startswith("Usage: dxr cohort [OPTIONS] COMMAND [ARGS]...") and "build" in result.output


def test_ingest_missing_path(tmp_path):
    line = usage_error(run("ingest", "meds", tmp_path / "nope", "--name", "x", data_dir=tmp_path / "wh"))
    assert line == (f"Error: Invalid value for 'PATH': MEDS directory {tmp_path / 'nope'} does not exist: check the "
                    "path (usage: main ingest meds -h)")
    assert not (tmp_path / "wh").exists()


def test_ingest_malformed_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    line = one_line_error(run("ingest", "meds", tmp_path / "empty", "--name", "x", data_dir=tmp_path / "wh"))
    assert "is not a MEDS directory: no Parquet shards" in line and "data/**/*.parquet" in line


def test_ingest_missing_column(tmp_path):
    root = write_tiny_meds(tmp_path / "m", tiny_events().drop("encounter_id"))
    line = one_line_error(run("ingest", "meds", root, "--name", "x", data_dir=tmp_path / "wh"))
    assert line == (f"Error: {root / 'data' / '0.parquet'}: missing column 'encounter_id' (int64): add the hospital "
                    "encounter (admission) id to every event, as encounter_id or as hadm_id (MEDS-Extract's MIMIC-IV "
                    "layout)")


def test_ingest_unknown_code_system(tmp_path):
    events = tiny_events().with_columns(pl.col("code").str.replace("DIAGNOSIS//ICD//10//J449",
                                                                   "DIAGNOSIS//ICD//11//CA22"))
    root = write_tiny_meds(tmp_path / "m", events)
    line = one_line_error(run("ingest", "meds", root, "--name", "x", data_dir=tmp_path / "wh"))
    assert "unknown code system in diagnosis code 'DIAGNOSIS//ICD//11//CA22'" in line
    assert "must be DIAGNOSIS//ICD//9//<code> or DIAGNOSIS//ICD//10//<code>" in line


def test_bad_dataset_name_and_unknown_cohort(tmp_path, tiny_meds):
    line = usage_error(run("ingest", "meds", tiny_meds, "--name", "Bad Name", data_dir=tmp_path / "wh"))
    assert "Invalid value for '--name': dataset name 'Bad Name' is not allowed" in line
    assert not (tmp_path / "wh").exists()  # the refusal made no warehouse: forecasting there says so
    assert one_line_error(run("forecast", "--cohort", "missing", "--system", "repeat_history",
                              data_dir=tmp_path / "wh")).startswith(f"Error: no warehouse at {tmp_path / 'wh'}:")
    assert run("ingest", "meds", tiny_meds, "--name", "tiny", data_dir=tmp_path / "wh").exit_code == 0
    line = one_line_error(run("forecast", "--cohort", "missing", "--system", "repeat_history",
                              data_dir=tmp_path / "wh"))
    assert line == (f"Error: cohort 'missing' not found in the warehouse at {tmp_path / 'wh'}; built cohorts: none "
                    "(list them with `dxr cohort list`, build one with `dxr cohort build`, or check --data-dir)")


@pytest.mark.parametrize("args, advice", [
    (["forecast", "--cohort", "mimic3dmo", "--system", "repeat_history"], ", build one with `dxr cohort build`"),
    (["prior", "train", "--cohort", "mimic3dmo"], ", build one with `dxr cohort build`"),
    # A new cohort has no registered model to list or promote, nor is it the one to delete or whose runs to list.
    (["prior", "models", "--cohort", "mimic3dmo"], ""),
    (["prior", "promote", "--cohort", "mimic3dmo", "--version", "1"], ""),
    (["cohort", "delete", "mimic3dmo"], ""),
    (["cohort", "delete", "mimic3dmo", "--dry-run"], ""),
    (["run", "list", "--cohort", "mimic3dmo"], ""),
], ids=lambda v: " ".join(v[:2]) if isinstance(v, list) else "")
def test_an_unknown_cohort_is_pointed_to_cohort_list_and_to_a_build_only_where_one_would_help(tmp_path, args, advice):
    (tmp_path / "forecast").mkdir()  # an empty warehouse
    assert one_line_error(run(*args, data_dir=tmp_path)) == (
        f"Error: cohort 'mimic3dmo' not found in the warehouse at {tmp_path}; built cohorts: none (list them with "
        f"`dxr cohort list`{advice}, or check --data-dir)")


def test_file_system_errors_and_a_missing_warehouse_are_one_line_naming_the_path(tmp_path, tiny_meds, monkeypatch):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    monkeypatch.setenv("DXR_DATA_DIR", str(a_file))  # the option checks its own value; env and config do not
    line = one_line_error(run("ingest", "meds", tiny_meds, "--name", "x"))
    assert line.startswith(f"Error: {a_file}/") and line.endswith(": Not a directory: a part of this path is a file; "
                                                                  "point to a directory")
    line = one_line_error(run("cohort", "list"))
    assert line == (f"Error: no warehouse at {a_file}: pass the right --data-dir (or DXR_DATA_DIR), or create one "
                    "with `dxr synth` or `dxr ingest`")
    monkeypatch.delenv("DXR_DATA_DIR")
    assert one_line_error(run("sql", "SELECT 1", data_dir=tmp_path / "typo")).startswith("Error: no warehouse at")
    assert not (tmp_path / "typo").exists()  # reading created nothing
    # A cohort needs a registered dataset: a mistyped --data-dir gets no new warehouse holding one failed run.
    line = one_line_error(run("cohort", "build", "--dataset", "synthetic", "--name", "default",
                              data_dir=tmp_path / "typo"))
    assert line.startswith(f"Error: no warehouse at {tmp_path / 'typo'}:")
    assert not (tmp_path / "typo").exists()
    # These said "cohort 'default' not found ...; built cohorts: none", as if the warehouse were there.
    for args in (["forecast", "--cohort", "default", "--system", "ehr_prior"], ["prior", "train", "--cohort", "default"],
                 ["prior", "models", "--cohort", "default"],
                 ["prior", "promote", "--cohort", "default", "--version", "1"]):
        line = one_line_error(run(*args, data_dir=tmp_path / "typo"))
        assert line.startswith(f"Error: no warehouse at {tmp_path / 'typo'}:"), (args, line)
    assert not (tmp_path / "typo").exists()


def test_sql_is_read_only_and_gold_needs_a_flag(tmp_path):
    (tmp_path / "forecast").mkdir()  # an empty warehouse
    # The refusal listed six of the eleven starts it accepts; each one it lists runs.
    assert one_line_error(run("sql", "DROP VIEW rankings", data_dir=tmp_path)) == (
        "Error: dxr sql runs read-only queries; 'drop' is not allowed: start with SELECT, WITH, FROM, DESCRIBE, SHOW, "
        "SUMMARIZE, PIVOT, UNPIVOT, EXPLAIN, VALUES or TABLE")
    for query in ("SELECT 1 AS a", "WITH t AS (SELECT 1 AS a) SELECT * FROM t", "FROM (SELECT 1 AS a)", "DESCRIBE runs",
                  "SHOW TABLES", "SUMMARIZE runs", "PIVOT (SELECT 'x' AS k, 1 AS v) ON k USING sum(v)",
                  "UNPIVOT (SELECT 1 AS a, 2 AS b) ON a, b INTO NAME k VALUE v", "EXPLAIN SELECT 1", "VALUES (1, 2)",
                  "TABLE runs"):
        assert run("sql", query, data_dir=tmp_path).exit_code == 0, query
    hidden_write = f"SELECT 1; COPY (SELECT 1 AS a) TO '{tmp_path / 'forecast' / 'leak.csv'}'"
    assert "exactly one read-only query" in one_line_error(run("sql", hidden_write, data_dir=tmp_path))
    assert not (tmp_path / "forecast" / "leak.csv").exists()
    assert "exactly one read-only query" in one_line_error(run("sql", "SELECT 1; SELECT 2", data_dir=tmp_path))
    assert one_line_error(run("sql", "SELECT * FROM targets", data_dir=tmp_path)) == (
        "Error: Catalog Error: Table with name targets does not exist! targets is a gold table: add --with-gold")
    # The connection has views of the tables a query names only, so DuckDB had no name to offer for a typo,
    # and every unknown name (a function's too) was said to need --with-gold.
    assert one_line_error(run("sql", "SELECT * FROM rankingz", data_dir=tmp_path)) == (
        "Error: Catalog Error: Table with name rankingz does not exist! Did you mean rankings or ranking_status? "
        "(SHOW TABLES lists the tables; gold ones need --with-gold)")
    assert one_line_error(run("sql", "SELECT * FROM targetz", data_dir=tmp_path)) == (
        "Error: Catalog Error: Table with name targetz does not exist! Did you mean targets (a gold table: add "
        "--with-gold)? (SHOW TABLES lists the tables; gold ones need --with-gold)")
    assert one_line_error(run("sql", "SELECT * FROM targetz", "--with-gold", data_dir=tmp_path)) == (
        "Error: Catalog Error: Table with name targetz does not exist! Did you mean targets? (SHOW TABLES lists the "
        "tables)")
    assert one_line_error(run("sql", "SELECT * FROM nothing_like_it", data_dir=tmp_path)) == (
        "Error: Catalog Error: Table with name nothing_like_it does not exist! (SHOW TABLES lists the tables; gold "
        "ones need --with-gold)")
    assert one_line_error(run("sql", "SELECT floorr(1.5)", data_dir=tmp_path)) == (
        'Error: Catalog Error: Scalar Function with name floorr does not exist! Did you mean "floor"?')
    result = run("sql", "SELECT count(*) AS n FROM targets", "--with-gold", "--format", "csv", data_dir=tmp_path)
    assert result.output == "n\n0\n"
    # EXPLAIN ANALYZE executes the statement it explains: a COPY inside it would write, with or without gold.
    for explain in ("EXPLAIN ANALYZE", "EXPLAIN /* plan */ (ANALYZE, FORMAT json)"):
        for gold in ((), ("--with-gold",)):
            copy = f"{explain} COPY (SELECT 1 AS a) TO '{tmp_path / 'forecast' / 'leak.csv'}'"
            assert "does not run EXPLAIN ANALYZE" in one_line_error(run("sql", copy, *gold, data_dir=tmp_path))
    assert not (tmp_path / "forecast" / "leak.csv").exists()
    assert run("sql", "EXPLAIN SELECT 1 AS analyzed", data_dir=tmp_path).exit_code == 0
    # JSON lines are JSON: no key is lost to a repeated column name, and NaN or infinity is null.
    result = run("sql", "SELECT 1 AS code, 2 AS code, 'nan'::DOUBLE AS x, 'inf'::DOUBLE AS y", "--format", "json",
                 data_dir=tmp_path)
    assert json.loads(result.output) == {"code": 1, "code_1": 2, "x": None, "y": None}
    # The gold connection reads the warehouse, not the rest of the machine.
    (tmp_path.parent / "outside.csv").write_text("secret\n1\n")
    outside = f"SELECT * FROM read_csv('{tmp_path.parent / 'outside.csv'}')"
    assert "reads outside the warehouse" in one_line_error(run("sql", outside, "--with-gold", data_dir=tmp_path))


def test_sql_errors_keep_duckdbs_hint_on_their_one_line(tmp_path):
    """The line kept only DuckDB's first line: a misspelt column (`config` for `runs.config_json`) lost the
    candidates DuckDB names, and a column missing from GROUP BY its fix. The echoed query and caret stay out."""
    (tmp_path / "forecast").mkdir()  # an empty warehouse
    assert one_line_error(run("sql", "SELECT run_id, config FROM runs", data_dir=tmp_path)).startswith(
        'Error: SQL error: Binder Error: Referenced column "config" not found in FROM clause! '
        'Candidate bindings: "config_json"')
    line = one_line_error(run("sql", "SELECT kind, count(*) FROM runs", data_dir=tmp_path))
    assert line.startswith('Error: SQL error: Binder Error: column "kind" must appear in the GROUP BY clause')
    assert line.endswith('Either add it to the GROUP BY list, or use ANY_VALUE("kind") if the exact value of "kind" '
                         'is not important.')
    assert one_line_error(run("sql", "SELEC 1", data_dir=tmp_path)) == (
        "Error: dxr sql runs read-only queries; 'selec' is not allowed: start with SELECT, WITH, FROM, DESCRIBE, "
        "SHOW, SUMMARIZE, PIVOT, UNPIVOT, EXPLAIN, VALUES or TABLE")
    assert one_line_error(run("sql", "SELECT 1 +", data_dir=tmp_path)) == (
        'Error: SQL error: Parser Error: syntax error at or near "+"')


def test_config_show_reports_file_and_env(tmp_path, monkeypatch):
    config = tmp_path / "dxr.toml"
    config.write_text('seed = 11\n[synth]\npatients = 300\n')
    monkeypatch.setenv("DXR_CONFIG", str(config))
    monkeypatch.setenv("DXR_SYNTH__SHARD_SIZE", "100")
    result = run("config", "show")
    assert result.exit_code == 0
    assert f"# config file: {config}" in result.output
    assert '"seed": 11' in result.output and '"patients": 300' in result.output and '"shard_size": 100' in result.output
    config.write_text("unknown_key = 1\n")
    line = one_line_error(run("config", "show"))
    assert "invalid setting 'unknown_key'" in line


def test_a_boolean_for_a_number_and_a_number_for_a_boolean_are_refused_in_the_file_and_variables(tmp_path, monkeypatch):
    # pydantic's lax mode reads true as 1: `seed = true` would have seeded with 1 unseen.
    config = tmp_path / "dxr.toml"
    monkeypatch.setenv("DXR_CONFIG", str(config))
    refusal = ("a boolean is not a number: write a number (true and false are not read as 1 and 0) (got {}); "
               "`dxr config show` lists the valid keys and defaults")
    monkeypatch.setenv("DXR_PRIOR__EPOCHS", "3")  # a variable of the same section, valid: the file is named
    for toml, key, value in (("seed = true", "seed", True), ("[prior]\nlr = false", "prior.lr", False),
                             ("[prior]\nmax_train_patients = true", "prior.max_train_patients", True),
                             ("[llm.prices.m]\ninput = true", "llm.prices.m.input", True)):
        config.write_text(f"{toml}\n")
        assert one_line_error(run("config", "show")) == (
            f"Error: invalid setting '{key}' (from {config}): " + refusal.format(value)), toml
    # And a number for a boolean: `refresh = 1` was read as true.
    for toml, key, value in (("[prior]\npromote = 1", "prior.promote", 1), ("[llm]\ncache = 0.0", "llm.cache", 0.0)):
        config.write_text(f"{toml}\n")
        assert one_line_error(run("config", "show")) == (
            f"Error: invalid setting '{key}' (from {config}): a number is not a boolean: write true or false (1 and 0 "
            f"are not read as true and false) (got {value}); `dxr config show` lists the valid keys and defaults"), toml
    # The file's numbers (an integer for a float too), its booleans and the variables' strings are read as before.
    config.write_text("seed = 11\n[prior]\nlr = 1\nkeep_best_epoch = false\n")
    shown = run("config", "show")
    assert shown.exit_code == 0, shown.output
    for pair in ('"seed": 11', '"lr": 1.0', '"keep_best_epoch": false', '"epochs": 3'):
        assert pair in shown.output, pair
    monkeypatch.setenv("DXR_LLM__CACHE", "0")  # a variable's text "0" or "false" is a boolean
    assert '"cache": false' in run("config", "show").output
    monkeypatch.delenv("DXR_LLM__CACHE")
    monkeypatch.setenv("DXR_PRIOR", '{"seed": true}')  # a JSON variable holds booleans as the file does
    assert one_line_error(run("config", "show")) == (
        f"Error: invalid setting 'prior.seed' (from DXR_PRIOR): " + refusal.format(True))
    monkeypatch.delenv("DXR_PRIOR")
    # A variable holds text, which pydantic reads as a number only when it spells one: "true" is refused as well.
    integer = "a valid integer, unable to parse string as an integer"
    number = "a valid number, unable to parse string as a number"
    for variable, key, expected in (("DXR_SEED", "seed", integer), ("DXR_SYNTH__PATIENTS", "synth.patients", integer),
                                    ("DXR_PRIOR__LR", "prior.lr", number)):
        monkeypatch.setenv(variable, "true")
        assert one_line_error(run("config", "show")) == (
            f"Error: invalid setting '{key}' (from {variable}): Input should be {expected} "
            "(got 'true'); `dxr config show` lists the valid keys and defaults"), variable
        monkeypatch.delenv(variable)


def test_a_decimal_for_an_integer_is_refused_in_the_file_and_variables(tmp_path, monkeypatch):
    # pydantic's lax mode reads 1.0 (a TOML or JSON float, or a variable's text "1.0") as the integer 1, and 1e3 as
    # 1000: a setting mistaken for a fraction passed unseen.
    config = tmp_path / "dxr.toml"
    monkeypatch.setenv("DXR_CONFIG", str(config))
    refusal = ("a decimal is not an integer: write a whole number without a decimal point (1.0 is not read as 1) "
               "(got {!r}); `dxr config show` lists the valid keys and defaults")
    backfill = 'name = "n"\ncohort = "c"\ncron = "0 2 * * *"\n'
    for toml, key, value in (("seed = 1.0", "seed", 1.0), ("[synth]\npatients = 1e3", "synth.patients", 1000.0),
                             ("[llm]\nseed = 3.0", "llm.seed", 3.0),
                             (f"[[backfills]]\n{backfill}k = 20.0", "backfills.0.k", 20.0)):
        config.write_text(f"{toml}\n")
        assert one_line_error(run("config", "show")) == (
            f"Error: invalid setting '{key}' (from {config}): " + refusal.format(value)), toml
    config.write_text("")
    for variable, text, key, value in (
            ("DXR_SEED", "1.0", "seed", "1.0"),
            ("DXR_PRIOR__MAX_TRAIN_PATIENTS", " 100.00 ", "prior.max_train_patients", " 100.00 "),
            ("DXR_LLM__SEED", "1.5", "llm.seed", "1.5"), ("DXR_LLM", '{"seed": 1.0}', "llm.seed", 1.0),
            ("DXR_BACKFILLS", '[{"name": "n", "cohort": "c", "cron": "0 2 * * *", "k": 20.0}]', "backfills.0.k", 20.0)):
        monkeypatch.setenv(variable, text)
        assert one_line_error(run("config", "show")) == (
            f"Error: invalid setting '{key}' (from {variable}): " + refusal.format(value)), variable
        monkeypatch.delenv(variable)
    # A decimal for a decimal setting, and an integer's text, are read as before.
    config.write_text("seed = 11\n[prior]\nlr = 1.0\n")
    monkeypatch.setenv("DXR_PRIOR__DROPOUT", "0.0")
    monkeypatch.setenv("DXR_SYNTH__PATIENTS", "300")
    shown = run("config", "show")
    assert shown.exit_code == 0, shown.output
    for pair in ('"seed": 11', '"lr": 1.0', '"dropout": 0.0', '"patients": 300'):
        assert pair in shown.output, pair


def test_a_settings_error_names_the_section_variable_only_for_the_keys_its_json_holds(tmp_path, monkeypatch):
    # pydantic-settings merges a section's JSON variable with the file's section key by key, so a bad value the file
    # gives stays the file's; a list's JSON replaces the file's list, so its entries' errors are the variable's.
    config = tmp_path / "dxr.toml"
    monkeypatch.setenv("DXR_CONFIG", str(config))
    config.write_text('[synth]\npatients = "many"\n[[backfills]]\ncohort = "x"\n')
    monkeypatch.setenv("DXR_SYNTH", '{"shard_size": 9}')
    assert one_line_error(run("config", "show")).startswith(f"Error: invalid setting 'synth.patients' (from {config}):")
    monkeypatch.setenv("DXR_SYNTH", '{"patients": "many"}')
    assert one_line_error(run("config", "show")).startswith("Error: invalid setting 'synth.patients' (from DXR_SYNTH):")
    monkeypatch.delenv("DXR_SYNTH")
    config.write_text('[[backfills]]\ncohort = "x"\n')  # a missing key: the list that lacks it is named
    assert one_line_error(run("config", "show")).startswith(
        f"Error: invalid setting 'backfills.0.name' (from {config}): Field required")
    monkeypatch.setenv("DXR_BACKFILLS", '[{"cohort": "y"}]')
    assert one_line_error(run("config", "show")).startswith(
        "Error: invalid setting 'backfills.0.name' (from DXR_BACKFILLS): Field required")


def test_a_settings_error_names_the_variables_under_the_setting_it_is_about(tmp_path, monkeypatch):
    # Variables under a setting make a table of it (pydantic-settings sets no list item by index): the file was named
    # for DXR_BACKFILLS__0's table where a list belongs, and for a check of a whole section fed by DXR_LLM__* keys.
    config = tmp_path / "dxr.toml"
    monkeypatch.setenv("DXR_CONFIG", str(config))
    config.write_text('[[backfills]]\nname = "n"\ncohort = "c"\ncron = "0 2 * * *"\n')
    monkeypatch.setenv("DXR_BACKFILLS__0", "{}")
    assert one_line_error(run("config", "show")).startswith("Error: invalid setting 'backfills' (from DXR_BACKFILLS__0):")
    monkeypatch.delenv("DXR_BACKFILLS__0")
    window = ("llm.context_window = 900 leaves no room for a prompt after llm.max_output_tokens = {}: raise the window "
              "(the model's context length) or lower the output tokens")
    monkeypatch.setenv("DXR_LLM__CONTEXT_WINDOW", "900")
    assert one_line_error(run("config", "show")).startswith(
        "Error: invalid setting 'llm' (from DXR_LLM__CONTEXT_WINDOW): " + window.format(1500))
    config.write_text("[llm]\nmax_output_tokens = 1000\n")  # the file's table is merged with the variables'
    assert one_line_error(run("config", "show")).startswith(
        f"Error: invalid setting 'llm' (from DXR_LLM__CONTEXT_WINDOW, {config}): " + window.format(1000))
    monkeypatch.setenv("DXR_LLM", '{"seed": 3}')  # so is the section's JSON, which then holds none of the two keys
    assert one_line_error(run("config", "show")).startswith(
        f"Error: invalid setting 'llm' (from DXR_LLM, DXR_LLM__CONTEXT_WINDOW, {config}): " + window.format(1000))


@pytest.mark.parametrize("variables, key, whole", [
    ({"DXR_BACKFILLS__0": '{"name": "n", "cohort": "c", "cron": "0 2 * * *"}'}, "backfills", "DXR_BACKFILLS"),
    ({"DXR_BACKFILLS__0__NAME": "n", "DXR_BACKFILLS__0__COHORT": "c"}, "backfills", "DXR_BACKFILLS"),
    ({"DXR_TOOLS__WEB__BLOCKED_DOMAINS__0": "example.com"}, "tools.web.blocked_domains",
     "DXR_TOOLS__WEB__BLOCKED_DOMAINS")])
def test_a_variable_setting_one_item_of_a_list_is_refused_naming_the_variable_for_the_whole_list(
        variables, key, whole, monkeypatch):
    # pydantic-settings sets no list item by index: it made a table of the variables, and the line was pydantic's
    # "Input should be a valid list (got {'0': ...})", which named neither the way to set a list nor why this failed.
    for variable, text in variables.items():
        monkeypatch.setenv(variable, text)
    assert one_line_error(run("config", "show")) == (
        f"Error: invalid setting '{key}' (from {', '.join(sorted(variables))}): a variable cannot set one item of a "
        f"list; give the whole list as JSON in {whole} (as `dxr config show` prints it) or in the TOML file")


def test_null_unsets_an_optional_setting_that_holds_no_text(tmp_path, monkeypatch):
    # llm.seed (7 by default) could be unset only by DXR_LLM='{"seed": null}': TOML has no null and DXR_LLM__SEED=null
    # was refused. A text or path setting keeps the text, as does a choice that is a word ("none").
    from dxr.config import load_settings

    config = tmp_path / "dxr.toml"
    monkeypatch.setenv("DXR_CONFIG", str(config))
    config.write_text('[llm]\nseed = "null"\n')
    assert load_settings().llm.seed is None
    config.write_text("[llm]\nseed = 3\n[prior]\nmax_train_patients = 100\n")
    for variable, text in (("DXR_LLM__SEED", "null"), ("DXR_PRIOR__MAX_TRAIN_PATIENTS", "null"),
                           ("DXR_LLM__RESPONSE_FORMAT", "none"), ("DXR_LLM__MODEL", "null"),
                           ("DXR_LLM__REPLAY_FILE", "null"), ("DXR_PRIOR__TRACKING_URI", "null")):
        monkeypatch.setenv(variable, text)
    settings = load_settings()
    assert (settings.llm.seed, settings.prior.max_train_patients, settings.llm.response_format, settings.llm.model,
            settings.llm.replay_file, settings.prior.tracking_uri) == (None, None, "none", "null", Path("null"), "null")
    monkeypatch.setenv("DXR_SEED", "null")  # a setting that cannot be null refuses it
    assert one_line_error(run("config", "show")) == (
        "Error: invalid setting 'seed' (from DXR_SEED): Input should be a valid integer, unable to parse string as an "
        "integer (got 'null'); `dxr config show` lists the valid keys and defaults")


def test_every_settings_model_refuses_a_boolean_for_a_number():
    # A section that derived from pydantic's BaseModel directly would read `= true` as 1 again.
    from typing import get_args

    from pydantic import BaseModel

    from dxr.config import Settings
    from dxr.settings_model import SettingsModel

    def models(annotation):
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield annotation
            for field in annotation.model_fields.values():
                yield from models(field.annotation)
        for member in get_args(annotation):
            yield from models(member)

    found = set(models(Settings))
    assert len(found) > 10 and [m.__name__ for m in found if not issubclass(m, SettingsModel)] == []


def test_settings_and_options_take_the_choices_the_stages_accept(tmp_path, monkeypatch):
    # One list per choice (warehouse.choices) serves the settings' patterns, the CLI's options and the stages.
    from warehouse.choices import FORECAST_SPLITS, HARMONIZATIONS, TARGET_RULES
    from warehouse.meds import SPLITS

    assert FORECAST_SPLITS == (*SPLITS, "all")  # the MEDS package's split names
    config = tmp_path / "dxr.toml"
    monkeypatch.setenv("DXR_CONFIG", str(config))
    for key, choices in (("cohort]\ntarget", TARGET_RULES), ("cohort]\nharmonize", HARMONIZATIONS)):
        for value in choices:
            config.write_text(f'[{key} = "{value}"\n')
            assert run("config", "show").exit_code == 0, value
        config.write_text(f'[{key} = "{choices[0]}x"\n')
        assert "invalid setting" in one_line_error(run("config", "show"))
    for split in FORECAST_SPLITS:
        config.write_text(f'[[backfills]]\nname = "n"\ncohort = "c"\ncron = "0 2 * * *"\nsplit = "{split}"\n')
        assert run("config", "show").exit_code == 0, split
    refused = run("forecast", "--cohort", "c", "--system", "repeat_history", "--split", "tuning_")
    assert refused.exit_code == 2 and "'tuning_' is not one of 'train', 'tuning', 'held_out', 'all'" in refused.output


def test_config_file_not_in_utf8_is_one_line_naming_it(tmp_path, monkeypatch):
    config = tmp_path / "dxr.toml"
    config.write_bytes(b"seed = 11 # \xff\n")  # saved in Latin-1, not UTF-8
    monkeypatch.setenv("DXR_CONFIG", str(config))
    assert one_line_error(run("config", "show")) == (f"Error: {config} is not UTF-8 text (invalid start byte at byte "
                                                     "12): save it as UTF-8")


def test_config_variable_naming_a_directory_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("DXR_CONFIG", str(tmp_path))
    assert one_line_error(run("config", "show")) == (f"Error: DXR_CONFIG points to {tmp_path}, which is a directory: "
                                                     "name the TOML file in it or unset DXR_CONFIG")


def test_variable_of_a_nested_setting_that_is_not_json_is_one_line_naming_it(monkeypatch):
    monkeypatch.setenv("DXR_TOOLS__EMBEDDING", "{kind: none}")
    assert one_line_error(run("config", "show")) == (
        "Error: invalid setting 'tools' (from DXR_TOOLS__EMBEDDING): not valid JSON (Expecting property name enclosed "
        "in double quotes: line 1 column 2 (char 1)); give a JSON value, or set one key as DXR_TOOLS__<KEY>=value")


def test_variable_that_sets_nothing_is_one_line_naming_it(monkeypatch):
    monkeypatch.setenv("DXR_PRIOR_EPOCHS", "2")  # one underscore: pydantic-settings would ignore it
    assert one_line_error(run("config", "show")) == (
        "Error: DXR_PRIOR_EPOCHS sets no setting (did you mean DXR_PRIOR__EPOCHS?): DXR_* variables name a setting, "
        "nested with __; `dxr config show` lists the valid keys")
    monkeypatch.delenv("DXR_PRIOR_EPOCHS")
    monkeypatch.setenv("DXR_DATADIR", "/tmp/wh")
    assert one_line_error(run("config", "show")) == (
        "Error: DXR_DATADIR sets no setting: DXR_* variables name a setting, nested with __; `dxr config show` lists "
        "the valid keys")
    # A variable the configuration names as holding a key is not a setting, and is no typo.
    monkeypatch.setenv("DXR_LLM__API_KEY_ENV", "DXR_OPENAI_KEY")
    monkeypatch.setenv("DXR_OPENAI_KEY", "sk-test")
    monkeypatch.delenv("DXR_DATADIR")
    assert run("config", "show").exit_code == 0


def test_ingest_meds_says_which_time_zone_the_wall_clock_times_are_in(tmp_path, tiny_meds):
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    assert "note: times" not in run("ingest", "meds", tiny_meds, "--name", "plain", data_dir=tmp_path / "wh").output
    shard = tiny_meds / "data" / "0.parquet"
    events = pq.read_table(shard)
    pq.write_table(events.set_column(1, "time", pc.assume_timezone(events["time"], "Asia/Kolkata")), shard)
    result = run("ingest", "meds", tiny_meds, "--name", "kolkata", data_dir=tmp_path / "wh")
    assert (result.exit_code, result.output.splitlines()) == (0, [
        "dataset kolkata: 4 patients, 60 events, ICD versions 10",
        "note: times are in Asia/Kolkata (UTC offset +05:30 throughout the data): kept as the wall-clock times they "
        "show there, without the zone"])
    # Recorded too, as the MIMIC imports record theirs: the copy's times no longer say which zone they were in.
    stored = run("sql", "SELECT dataset_id, time_zone, utc_offset FROM datasets ORDER BY 1", "--format", "csv",
                 data_dir=tmp_path / "wh")
    assert (stored.exit_code, stored.output) == (
        0, 'dataset_id,time_zone,utc_offset\nkolkata,Asia/Kolkata,+05:30\nplain,"",""\n')  # '' (none), not NULL


def test_producing_commands_register_their_runs(tmp_path, tiny_meds, wh_vocab):
    data_dir = wh_vocab.root
    assert run("ingest", "meds", tiny_meds, "--name", "tiny", "--run-id", "ing-1", data_dir=data_dir).exit_code == 0
    result = run("cohort", "build", "--dataset", "tiny", "--name", "default", "--run-id", "coh-1", data_dir=data_dir)
    assert result.exit_code == 0, result.output
    splits = Counter(wh_vocab.read("trajectories")["split"])
    assert "cohort default (c" in result.output and (
        f"3 trajectories (train {splits['train']}, tuning {splits['tuning']}, held_out {splits['held_out']})"
        in result.output)
    assert "note: no trajectory is in held_out" not in result.output
    refused = run("cohort", "build", "--dataset", "tiny", "--name", "x", "--min-history", "5", "--run-id", "coh-2",
                  data_dir=data_dir)
    # Without a terminal the steps the build finished are said before its one-line refusal, as a cron log shows them.
    assert (refused.exit_code, refused.stderr.splitlines()[-1][:7]) == (1, "Error: "), refused.output
    runs = run("sql", "SELECT run_id, kind, status, cohort_id IS NOT NULL AS has_cohort FROM runs ORDER BY run_id",
               "--format", "csv", data_dir=data_dir)
    assert runs.output.splitlines() == ["run_id,kind,status,has_cohort", "coh-1,cohort,finished,true",
                                        "coh-2,cohort,failed,false", "ing-1,ingest:meds,finished,false"]
    one_run = run("sql", "--run", "coh-2", "SELECT run_id, kind FROM runs", "--format", "csv", data_dir=data_dir)
    assert one_run.output.splitlines() == ["run_id,kind", "coh-2,cohort"]
    assert "no run 'coh-3' in the warehouse" in one_line_error(run("sql", "--run", "coh-3", "SELECT 1",
                                                                    data_dir=data_dir))
    assert "Invalid value for '--run': run id 'coh/*' has unsafe characters" in usage_error(
        run("sql", "--run", "coh/*", "SELECT 1", data_dir=data_dir))


def test_the_same_cohort_built_under_another_name_is_renamed_and_says_so(tiny_meds, wh_vocab):
    data_dir = wh_vocab.root
    assert run("ingest", "meds", tiny_meds, "--name", "tiny", data_dir=data_dir).exit_code == 0
    first = run("cohort", "build", "--dataset", "tiny", "--name", "native", data_dir=data_dir)
    assert first.exit_code == 0 and "note: these options" not in first.output, first.output
    again = run("cohort", "build", "--dataset", "tiny", "--name", "native", data_dir=data_dir)
    assert again.exit_code == 0 and "note: these options" not in again.output, again.output
    renamed = run("cohort", "build", "--dataset", "tiny", "--name", "mine", data_dir=data_dir)
    assert renamed.exit_code == 0, renamed.output
    cohort_id = Warehouse(data_dir).read("cohorts")["cohort_id"].item()
    assert renamed.stdout.splitlines()[1] == (
        f"note: these options of dataset tiny were cohort native, which is now named mine: a cohort's id is its "
        f"dataset, options and seed, so --cohort native no longer finds it (use the id or the new name)")
    assert Warehouse(data_dir).read("cohorts").select("cohort_id", "name").rows() == [(cohort_id, "mine")]
    listed = run("cohort", "list", data_dir=data_dir)
    assert listed.exit_code == 0 and listed.output.splitlines()[2].split() == [
        cohort_id, "mine", "tiny", "final", "native", "1", "3", str(Warehouse(data_dir).read("cohorts")
                                                                     ["vocabulary_size"].item()), "1"], listed.output


def test_patients_the_datasets_own_split_leaves_out_are_left_out_of_the_cohort(tmp_path, tiny_meds, wh_vocab):
    # Subject 4 (two encounters, held_out) is missing from subject_splits.parquet: the dataset's owners did not
    # assign it, so it is neither trained on nor forecast, and the build says so instead of failing.
    splits = tiny_meds / "metadata" / "subject_splits.parquet"
    pl.read_parquet(splits).filter(pl.col("subject_id") != 4).write_parquet(splits)
    data_dir = wh_vocab.root
    assert run("ingest", "meds", tiny_meds, "--name", "tiny", data_dir=data_dir).exit_code == 0
    result = run("cohort", "build", "--dataset", "tiny", "--name", "default", data_dir=data_dir)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == ("note: 1 patient(s) of the data have no split in "
                                              "metadata/subject_splits.parquet: they are left out of the cohort "
                                              "(neither trained on nor forecast)")
    trajectories = Warehouse(data_dir).read("trajectories").sort("subject_id")
    assert trajectories.select("subject_id", "target_encounter_id", "split").rows() == [(1, 103, "held_out"),
                                                                                       (2, 202, "train")]


def forecast_stopped_after_the_first_shard(monkeypatch, forecast: tuple, *options: str, data_dir) -> None:
    """Run `dxr <forecast> <options>` so that it fails after writing its first shard, as a stopped forecast does."""
    import flows.forecast

    run_shards = flows.forecast.run_shards

    def stopped_after_the_first_shard(task, shards, workers, limit):
        run_shards(task, shards[:1], workers, limit)
        raise RuntimeError("stopped")

    monkeypatch.setattr(flows.forecast, "run_shards", stopped_after_the_first_shard)
    with pytest.raises(RuntimeError, match="stopped"):
        run(*forecast, *options, data_dir=data_dir)
    monkeypatch.undo()


def test_a_failed_forecast_can_be_redone_with_other_options(tiny_meds, wh_vocab, monkeypatch):
    # Its options were recorded all the same, and a rerun with the corrected ones was refused as "other options",
    # leaving only a new --run-id.
    data_dir = wh_vocab.root
    assert run("ingest", "meds", tiny_meds, "--name", "tiny", data_dir=data_dir).exit_code == 0
    assert run("cohort", "build", "--dataset", "tiny", "--name", "default", data_dir=data_dir).exit_code == 0
    forecast = ("forecast", "--cohort", "default", "--system", "repeat_history", "--split", "all", "--run-id", "r1")
    forecast_stopped_after_the_first_shard(monkeypatch, forecast, "--limit", "1", data_dir=data_dir)
    registry = "SELECT status, json_extract(config_json, '$.limit') FROM runs WHERE run_id = 'r1'"
    assert run("sql", registry, "--format", "csv", data_dir=data_dir).output.splitlines()[1:] == ["failed,1"]
    assert run(*forecast, data_dir=data_dir).exit_code == 0
    assert run("sql", registry, "--format", "csv", data_dir=data_dir).output.splitlines()[1:] == ["finished,null"]
    status = "SELECT count(*), count(DISTINCT trajectory_id) FROM ranking_status WHERE run_id = 'r1'"
    assert run("sql", status, "--format", "csv", data_dir=data_dir).output.splitlines()[1:] == ["3,3"]
    # A finished forecast keeps its options: redone with others, the run would mix two configurations.
    line = one_line_error(run(*forecast, "--limit", "1", data_dir=data_dir))
    assert "run r1 already holds a forecast by repeat_history with other options (limit None -> 1)" in line


def test_a_forecast_killed_before_any_run_marked_it_can_be_redone_with_other_options(tiny_meds, wh_vocab,
                                                                                       monkeypatch):
    # A SIGKILL leaves the row `running` with its marker until the next registered run marks it `killed`; the
    # redo was refused as "other options" meanwhile, though the same command after any other run was accepted.
    # (A cohort named by its name looks for builds in progress, which marks killed runs first; by its id not.)
    from warehouse.runs import _write_marker

    data_dir = wh_vocab.root
    assert run("ingest", "meds", tiny_meds, "--name", "tiny", data_dir=data_dir).exit_code == 0
    assert run("cohort", "build", "--dataset", "tiny", "--name", "default", data_dir=data_dir).exit_code == 0
    cohort_id = Warehouse(data_dir).read("cohorts")["cohort_id"][0]
    forecast = ("forecast", "--cohort", cohort_id, "--system", "repeat_history", "--split", "all", "--run-id", "r1")
    forecast_stopped_after_the_first_shard(monkeypatch, forecast, "--limit", "1", data_dir=data_dir)
    wh = Warehouse(data_dir)  # what SIGKILL leaves instead of `failed`: the row `running`, its marker, no lock
    row = wh.read("runs", run_id="r1", kind="forecast:repeat_history")
    wh.write("runs", row.with_columns(status=pl.lit("running")), run_id="r1", kind="forecast:repeat_history")
    _write_marker(wh, "r1", "forecast:repeat_history")
    result = run(*forecast, data_dir=data_dir)
    assert result.exit_code == 0, result.output
    registry = "SELECT status, json_extract(config_json, '$.limit') FROM runs WHERE run_id = 'r1'"
    assert run("sql", registry, "--format", "csv", data_dir=data_dir).output.splitlines()[1:] == ["finished,null"]
    status = "SELECT count(*), count(DISTINCT trajectory_id) FROM ranking_status WHERE run_id = 'r1'"
    assert run("sql", status, "--format", "csv", data_dir=data_dir).output.splitlines()[1:] == ["3,3"]


def test_forecast_rerun_redoes_the_same_options_and_refuses_others(tmp_path, tiny_meds, wh_vocab, monkeypatch):
    data_dir = wh_vocab.root
    status_rows = "SELECT count(*) AS n, count(DISTINCT trajectory_id) AS d FROM ranking_status WHERE run_id = 'r1'"
    assert run("ingest", "meds", tiny_meds, "--name", "tiny", data_dir=data_dir).exit_code == 0
    monkeypatch.setenv("DXR_COHORT__SHARD_SIZE", "1")  # one trajectory per shard
    assert run("cohort", "build", "--dataset", "tiny", "--name", "default", data_dir=data_dir).exit_code == 0
    forecast = ("forecast", "--cohort", "default", "--system", "repeat_history", "--split", "all", "--run-id", "r1")
    assert run(*forecast, data_dir=data_dir).exit_code == 0
    assert run("sql", status_rows, "--format", "csv", data_dir=data_dir).output.splitlines()[1] == "3,3"

    line = one_line_error(run(*forecast, "--limit", "1", data_dir=data_dir))
    assert "run r1 already holds a forecast by repeat_history with other options (limit None -> 1)" in line
    assert "pass a new --run-id" in line

    # The same cohort re-sharded into one shard: the rerun must not keep the old shards' rows.
    monkeypatch.delenv("DXR_COHORT__SHARD_SIZE")
    assert run("cohort", "build", "--dataset", "tiny", "--name", "default", data_dir=data_dir).exit_code == 0
    assert run(*forecast, data_dir=data_dir).exit_code == 0
    assert run("sql", status_rows, "--format", "csv", data_dir=data_dir).output.splitlines()[1] == "3,3"

    # A report written below a file (unwritable --out) is one line naming the path, not a traceback.
    assert run("evaluate", "--run", "r1", data_dir=data_dir).exit_code == 0
    (tmp_path / "a_file").write_text("not a directory")
    line = one_line_error(run("report", "--run", "r1", "--out", tmp_path / "a_file" / "reports", data_dir=data_dir))
    assert line.startswith(f"Error: {tmp_path / 'a_file' / 'reports'}") and "Not a directory" in line

    # Redoing the forecast removes the evaluation of the old rankings; `dxr evaluate` makes it again.
    evaluated = ("SELECT (SELECT count(*) FROM metrics WHERE run_id = 'r1') "
                 "+ (SELECT count(*) FROM evaluation_coverage WHERE run_id = 'r1') "
                 "+ (SELECT count(*) FROM paired_comparisons WHERE run_id = 'r1') AS n")
    assert run(*forecast, data_dir=data_dir).exit_code == 0
    assert run("sql", evaluated, "--format", "csv", data_dir=data_dir).output.splitlines()[1] == "0"
    line = usage_error(run(*forecast[:-1], "demo[1]", data_dir=data_dir))
    assert line == ("Error: Invalid value for '--run-id': run id 'demo[1]' has unsafe characters: use letters, digits "
                    "and _.:- (usage: main forecast -h)")


def test_forecast_of_a_split_without_trajectories_is_one_line_and_registers_no_run(tiny_meds, wh_vocab):
    # The tiny cohort has no tuning trajectory, as the MIMIC-III demo has no held_out one: the forecast used
    # to finish as "wrote rankings" with none written, and `dxr evaluate` then said to run a forecast first.
    data_dir = wh_vocab.root
    assert run("ingest", "meds", tiny_meds, "--name", "tiny", data_dir=data_dir).exit_code == 0
    assert run("cohort", "build", "--dataset", "tiny", "--name", "default", data_dir=data_dir).exit_code == 0
    cohort_id = Warehouse(data_dir).read("cohorts")["cohort_id"][0]
    line = one_line_error(run("forecast", "--cohort", "default", "--system", "repeat_history", "--split", "tuning",
                              "--run-id", "r1", data_dir=data_dir))
    assert line == (f"Error: cohort {cohort_id} has no trajectory in split tuning (it has held_out 2, train 1): "
                    "forecast a split that has some (all covers every split)")
    assert not Warehouse(data_dir).has_rows("runs", run_id="r1")


def test_forecast_says_how_many_lists_are_short_or_failed(tiny_meds, wh_vocab):
    # The tiny cohort's records hold fewer than 20 diagnosis codes, so every list is short; the command
    # said only "wrote rankings", as if every list were whole.
    data_dir = wh_vocab.root
    assert run("ingest", "meds", tiny_meds, "--name", "tiny", data_dir=data_dir).exit_code == 0
    assert run("cohort", "build", "--dataset", "tiny", "--name", "default", data_dir=data_dir).exit_code == 0
    result = run("forecast", "--cohort", "default", "--system", "repeat_history", "--split", "all", "--run-id", "r1",
                 data_dir=data_dir)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == (
        "run r1: system repeat_history wrote rankings for cohort default (all): 3 trajectories, 3 short "
        "(ranking_status says why)")
    result = run("forecast", "--cohort", "default", "--system", "repeat_history", "--split", "all", "--k", "2",
                 "--run-id", "r2", data_dir=data_dir)
    assert result.stdout.splitlines()[-1] == (
        "run r2: system repeat_history wrote rankings for cohort default (all): 3 trajectories, 3 ok")


def test_evaluate_checks_every_run_before_evaluating_any(tiny_meds, wh_vocab):
    data_dir = wh_vocab.root
    assert run("ingest", "meds", tiny_meds, "--name", "tiny", data_dir=data_dir).exit_code == 0
    assert run("cohort", "build", "--dataset", "tiny", "--name", "default", data_dir=data_dir).exit_code == 0
    assert run("forecast", "--cohort", "default", "--system", "repeat_history", "--split", "all", "--run-id", "r1",
               data_dir=data_dir).exit_code == 0
    # A mistyped second run is reported before the first is evaluated, not after minutes of bootstrap.
    line = one_line_error(run("evaluate", "--run", "r1", "--run", "r2", data_dir=data_dir))
    assert line == (f"Error: run 'r2' has no rankings in the warehouse at {data_dir}: run a forecast first "
                    "(dxr forecast …), check --data-dir, or list the forecast runs with "
                    "`dxr run list --kind forecast`")
    assert not Warehouse(data_dir).has_rows("metrics", run_id="r1")
    # So is a pair or pool naming a system one of the runs lacks, before the bootstrap of any run.
    assert run("forecast", "--cohort", "default", "--system", "global_frequency", "--split", "all", "--run-id", "r2",
               data_dir=data_dir).exit_code == 0
    line = one_line_error(run("evaluate", "--run", "r1", "--run", "r2", "--pool", "repeat_history", data_dir=data_dir))
    assert line == ("Error: pool repeat_history names 'repeat_history', which has no rankings in run 'r2' (it has: "
                    "global_frequency): forecast it into the run (dxr forecast --system repeat_history --run-id r2, "
                    "with the options of the run's other systems), or find a run that has it with "
                    "`dxr run list --kind forecast:repeat_history`")
    # As is a system to evaluate (the line came after the first run's "evaluating", as a list of ids).
    line = one_line_error(run("evaluate", "--run", "r1", "--systems", "repeat_history,global_frequency",
                              data_dir=data_dir))
    assert line == ("Error: --systems repeat_history,global_frequency names 'global_frequency', which has no rankings "
                    "in run 'r1' (it has: repeat_history): forecast it into the run (dxr forecast --system "
                    "global_frequency --run-id r1, with the options of the run's other systems), or find a run that "
                    "has it with `dxr run list --kind forecast:global_frequency`")
    line = one_line_error(run("evaluate", "--run", "r1", "--systems", "repeat_history", "--pair",
                              "repeat_history,global_frequency", data_dir=data_dir))
    assert line == ("Error: pair repeat_history,global_frequency names 'global_frequency', not evaluated in run 'r1'; "
                    "evaluated: repeat_history")
    # The mean's --run-id must not be a forecast run's (here one of the averaged runs), nor name a mean of one run.
    line = one_line_error(run("evaluate", "--run", "r1", "--run", "r2", "--run-id", "r1", data_dir=data_dir))
    assert line == ("Error: --run-id r1 is a forecast:repeat_history run (see `runs`), not a mean over repeated runs: "
                    "pass a new --run-id for the mean")
    line = usage_error(run("evaluate", "--run", "r1", "--run", "r1", "--run-id", "mean", data_dir=data_dir))
    assert line == ("Error: --run-id names the mean over several --run values; the evaluation of the one run r1 is "
                    "stored under its own id: leave --run-id out, or add the runs to average (usage: main evaluate -h)")
    assert not Warehouse(data_dir).has_rows("metrics")
    # Option values are checked before the work starts, and a list option naming nothing is no silent default: each
    # a usage error (test_malformed_option_values_are_usage_errors has the lines).
    for option, value in [("--systems", ","), ("--k", ","), ("--k", "0,10"), ("--pair", "oracle"),
                          ("--pair", "oracle,oracle"), ("--pool", "oracle+")]:
        assert f"Invalid value for '{option}'" in usage_error(run("evaluate", "--run", "r1", option, value,
                                                                  data_dir=data_dir))
    result = run("evaluate", "--run", "r1", "--bootstrap", "-1", data_dir=data_dir)
    assert result.exit_code == 2 and "Invalid value for '--bootstrap': -1 is not in the range x>=0." in result.output
    assert not Warehouse(data_dir).has_rows("metrics", run_id="r1")

    # A repeat of r1's forecast: the mean of the two goes under the --run-id given, registered there.
    assert run("forecast", "--cohort", "default", "--system", "repeat_history", "--split", "all", "--run-id", "r3",
               data_dir=data_dir).exit_code == 0
    result = run("evaluate", "--run", "r1", "--run", "r3", "--run-id", "mean", "--k", "2", "--no-natural",
                 "--bootstrap", "0", "--systems", "repeat_history", data_dir=data_dir)
    assert result.exit_code == 0, result.output
    assert [line.split()[:5] for line in result.stdout.splitlines()[1:]] == [
        ["r1", "repeat_history", "2", "3", "1"], ["r3", "repeat_history", "2", "3", "1"],
        ["mean", "repeat_history", "2", "3", "2"]]
    registered = Warehouse(data_dir).read("runs", run_id="mean")
    assert registered.select("kind", "status").rows() == [("evaluate", "finished")]
    assert json.loads(registered["config_json"][0])["runs"] == ["r1", "r3"]
    # `dxr run list --kind` takes each kind the commands recorded, and a kind no run has yet lists none.
    recorded = Warehouse(data_dir).read("runs")
    for kind in set(recorded["kind"]):
        listed = run("run", "list", "--kind", kind, "--format", "csv", data_dir=data_dir)
        assert (listed.exit_code, len(listed.output.splitlines()) - 1) == (0, (recorded["kind"] == kind).sum()), kind
    assert run("run", "list", "--kind", "forecast:transition", "--format", "csv", data_dir=data_dir).output == (
        "run_id,kind,status,cohort,cohort_id,started_at,finished_at\n")


def test_report_and_evaluate_of_a_run_that_is_no_forecast_say_what_it_is(tmp_path):
    # `dxr report --run <a training>` said to run `dxr evaluate` first, which then said the run had no rankings.
    from datetime import datetime

    from warehouse.runs import record_run

    wh = Warehouse(tmp_path / "wh")
    record_run(wh, "t1", None, "train:ehr_prior", {}, "finished", datetime(2026, 1, 1), datetime(2026, 1, 1))
    for command in ("report", "evaluate"):
        assert one_line_error(run(command, "--run", "t1", data_dir=wh.root)) == (
            "Error: run 't1' is a train:ehr_prior run (see `dxr run list`), not a forecast: it has no rankings to "
            "evaluate or report; name a forecast run (`dxr run list --kind forecast` lists them)"), command


def test_evaluate_compares_the_means_of_repeated_runs_only_under_one_run_id(tiny_meds, wh_vocab):
    data_dir = wh_vocab.root
    assert run("ingest", "meds", tiny_meds, "--name", "tiny", data_dir=data_dir).exit_code == 0
    assert run("cohort", "build", "--dataset", "tiny", "--name", "default", data_dir=data_dir).exit_code == 0
    for run_id in ("r1", "r2"):
        for system in ("global_frequency", "repeat_history"):
            assert run("forecast", "--cohort", "default", "--system", system, "--split", "all", "--run-id", run_id,
                       data_dir=data_dir).exit_code == 0
    evaluate = ("evaluate", "--run", "r1", "--run", "r2", "--k", "2", "--no-natural", "--bootstrap", "20")
    paired = "SELECT DISTINCT run_id, system_a, system_b FROM paired_comparisons ORDER BY ALL"
    # Each system's mean goes under its own config-… id, so the pair of means is not compared, and a note says so.
    result = run(*evaluate, data_dir=data_dir)
    assert result.exit_code == 0, result.output
    assert ("note: no paired comparison of the means of global_frequency,repeat_history: each system's mean is "
            "stored under its own configuration's config-… id, and only means under one id are compared; pass "
            "--run-id to store them under one id with their paired comparisons") in result.stderr.splitlines()
    assert run("sql", paired, "--format", "csv", data_dir=data_dir).output.splitlines()[1:] == [
        "r1,global_frequency,repeat_history", "r2,global_frequency,repeat_history"]
    # Under one --run-id they are compared there, and no note is printed.
    result = run(*evaluate, "--run-id", "mean", data_dir=data_dir)
    assert result.exit_code == 0, result.output
    assert "paired comparison" not in result.stderr
    assert run("sql", paired, "--format", "csv", data_dir=data_dir).output.splitlines()[1:] == [
        "mean,global_frequency,repeat_history", "r1,global_frequency,repeat_history",
        "r2,global_frequency,repeat_history"]


def test_terminated_command_records_its_run_failed_and_leaves_no_staging(tmp_path):
    data_dir = tmp_path / "wh"
    dxr = Path(sys.executable).parent / "dxr"
    proc = subprocess.Popen([str(dxr), "--data-dir", str(data_dir), "synth", "--patients", "50000", "--run-id",
                             "killed"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    meds = data_dir / "gold" / "meds"

    def generating() -> bool:  # the run is registered and its staging directory is being written
        return meds.is_dir() and any(p.name.startswith(".") for p in meds.iterdir())

    deadline = time.monotonic() + 120
    while not generating() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert generating() and proc.poll() is None, "synth ended or never started writing"
    proc.send_signal(signal.SIGTERM)  # what a scheduler or `kill` sends
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert Warehouse(data_dir).read("runs", run_id="killed")["status"].to_list() == ["failed"]
    assert not list(meds.iterdir())  # the staging directory is gone and no dataset was swapped in


@pytest.mark.parametrize(("signum", "exit_code", "last_line"), [(signal.SIGTERM, 143, "dxr: stopped by SIGTERM"),
                                                               (signal.SIGINT, 130, "dxr: stopped by SIGINT")])
def test_a_signal_stops_a_long_duckdb_query_at_once(tmp_path, signum, exit_code, last_line):
    # A multi-threaded query kept running after Python's handler had raised (once for 96 s, until a
    # timeout killed it); the handlers now interrupt DuckDB's queries as well.
    dxr = Path(sys.executable).parent / "dxr"
    (tmp_path / "forecast").mkdir()
    proc = subprocess.Popen([str(dxr), "--data-dir", str(tmp_path), "sql",
                             "SELECT sum(hash(range)) FROM range(1000000000000)"],  # hours if not stopped
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # Well into the query: once DuckDB is loaded (the query starts 0.3 s later on a quiet machine), the process
        # has spent 2 s more of CPU, which its start-up after that point does not come near on a loaded machine
        # either. A fixed 8 s from the start waited mostly for nothing.
        def cpu_seconds() -> float:
            utime, stime = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13]
            return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")

        deadline = time.monotonic() + 60
        while "duckdb" not in Path(f"/proc/{proc.pid}/maps").read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, "dxr sql never loaded DuckDB"
            time.sleep(0.05)
        loaded = cpu_seconds()
        while cpu_seconds() < loaded + 2 and proc.poll() is None:
            assert time.monotonic() < deadline, "dxr sql's query never ran"
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()
        sent = time.monotonic()
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == exit_code
        assert time.monotonic() - sent < 30
        assert proc.stderr.read().strip().splitlines()[-1] == last_line
    finally:
        proc.kill()  # a query that went on would otherwise outlive the test by hours


def test_a_signal_that_surfaces_as_another_error_still_ends_as_terminated(tmp_path, monkeypatch):
    import warehouse.sql

    def interrupted_query(*args, **kwargs):
        # What DuckDB does when SIGTERM arrives while it runs a query: it takes the pending exception
        # of the Python handler and raises its own.
        try:
            signal.raise_signal(signal.SIGTERM)
        except SystemExit:
            raise RuntimeError("Query interrupted") from None

    monkeypatch.setattr(warehouse.sql, "stream_query", interrupted_query)
    default = signal.getsignal(signal.SIGTERM)
    (tmp_path / "forecast").mkdir()
    try:
        result = CliRunner().invoke(main, ["--data-dir", str(tmp_path), "sql", "SELECT 1"])
    finally:  # the command installed dxr's handlers in this process
        signal.signal(signal.SIGTERM, default)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert result.exit_code == 128 + signal.SIGTERM
    assert result.output.strip().splitlines() == ["dxr: stopped by SIGTERM"]
    monkeypatch.undo()
    assert CliRunner().invoke(main, ["--data-dir", str(tmp_path), "sql", "SELECT 1"]).exit_code == 0  # forgotten


def test_a_closed_output_pipe_ends_quietly(tmp_path, monkeypatch):
    import warehouse.sql

    def reader_gone(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")  # what writing to `dxr … | head` raises once head exits

    monkeypatch.setattr(warehouse.sql, "stream_query", reader_gone)
    (tmp_path / "forecast").mkdir()
    result = CliRunner().invoke(main, ["--data-dir", str(tmp_path), "sql", "SELECT 1"])
    # Click's own exit for a closed pipe: exit code 1 alone is also what CliRunner reports for any exception that
    # escaped (a traceback in a terminal).
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1 and "Error" not in result.output


def test_prefects_temporary_server_ends_with_a_sigkilled_dxr(tmp_path):
    # What the CLI does before a flow, in a process that is then SIGKILLed (a scheduler's hard timeout).
    script = ("import sys, time\nfrom flows.api_server import start_temporary_api\n"
              "from prefect.server.api.server import SubprocessASGIServer\n"
              "start_temporary_api()\nprint(SubprocessASGIServer().server_process.pid, flush=True)\ntime.sleep(600)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**env, "PREFECT_HOME": str(tmp_path / "prefect")}, cwd=Path(__file__).parents[1])
    server = None
    try:
        server = int(proc.stdout.readline())
        os.kill(server, 0)  # the server is up
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and Path(f"/proc/{server}").exists():
            time.sleep(0.2)
        assert not Path(f"/proc/{server}").exists(), "the temporary Prefect server outlived its dxr process"
    finally:
        proc.kill()
        if server is not None and Path(f"/proc/{server}").exists():
            os.kill(server, signal.SIGKILL)


def test_ingest_meds_memory_limit_option_bounds_the_validation_and_running_out_is_one_line(tiny_meds, wh_vocab):
    line = one_line_error(run("ingest", "meds", tiny_meds, "--name", "tiny", "--memory-limit", "1MB",
                              data_dir=wh_vocab.root))
    assert line.startswith(f"Error: MEDS ingest of {tiny_meds}: DuckDB ran out of memory within its limit of 1MB "
                           "(Out of Memory Error: "), line
    assert line.endswith(": rerun with a larger memory limit (`--memory-limit`, e.g. 8GB) that the machine has free"
                         ), line
    assert run("ingest", "meds", tiny_meds, "--name", "tiny", "--memory-limit", "64MB",
               data_dir=wh_vocab.root).exit_code == 0

def test_cohort_build_memory_limit_option_overrides_the_setting_and_running_out_is_one_line(tmp_path, tiny_meds,
                                                                                            wh_vocab, monkeypatch):
    data_dir = wh_vocab.root
    assert run("ingest", "meds", tiny_meds, "--name", "tiny", data_dir=data_dir).exit_code == 0
    monkeypatch.setenv("DXR_COHORT__MEMORY_LIMIT", "1MB")
    line = one_line_error(run("cohort", "build", "--dataset", "tiny", "--name", "default", data_dir=data_dir))
    assert line.startswith("Error: cohort build of default from dataset tiny: DuckDB ran out of memory within its "
                           "limit of 1MB (Out of Memory Error: "), line
    assert line.endswith(": rerun with a larger memory limit (`--memory-limit`, e.g. 8GB, or the setting "
                         "cohort.memory_limit) that the machine has free"), line
    result = run("cohort", "build", "--dataset", "tiny", "--name", "default", "--memory-limit", "lots",
                 data_dir=data_dir)
    assert result.exit_code == 2
    assert [line for line in result.output.splitlines() if line.strip()] == [
        "Error: Invalid value for '--memory-limit': 'lots' is not a size such as 2GB or 512MB "
        "(usage: main cohort build -h)"], result.output
    result = run("cohort", "build", "--dataset", "tiny", "--name", "default", "--memory-limit", "512MB",
                 data_dir=data_dir)
    assert result.exit_code == 0, result.output
    monkeypatch.delenv("DXR_COHORT__MEMORY_LIMIT")
    line = one_line_error(run("cohort", "build", "--dataset", "tiny", "--name", "default", "--memory-limit", "1MB",
                              data_dir=data_dir))
    assert "DuckDB ran out of memory within its limit of 1MB" in line, line


def test_demo_refuses_its_run_id_before_any_work(tmp_path):
    # The flow refused an unsafe --run-id, or one holding a record of what a command made, only after generating the
    # dataset, building the cohort and training the prior: minutes, then a failed flow run's traceback in the log.
    from datetime import datetime

    from warehouse.runs import record_run

    assert usage_error(run("demo", "--run-id", "demo/1", "--patients", "50", data_dir=tmp_path / "wh")) == (
        "Error: Invalid value for '--run-id': run id 'demo/1' has unsafe characters: use letters, digits and _.:- "
        "(usage: main demo -h)")
    assert not (tmp_path / "wh").exists()
    wh = Warehouse(tmp_path / "wh")
    record_run(wh, "p1-llm", None, "train:ehr_prior", {}, "finished", datetime(2026, 1, 1), datetime(2026, 1, 1))
    assert one_line_error(run("demo", "--run-id", "p1", "--patients", "50", data_dir=wh.root)) == (
        "Error: run id 'p1-llm' already holds a record of what a command made (train:ehr_prior), and a "
        "forecast:ehr_prior run is a result: give it a run id of its own (or none, to have one generated); "
        "`dxr run delete` deletes results only, so it could not delete a run id that holds both")
    assert not wh.has_rows("datasets") and wh.read("runs")["run_id"].to_list() == ["p1-llm"]


def test_doctests_of_the_settings_model():
    import doctest

    from dxr import settings_model

    result = doctest.testmod(settings_model)
    assert result.failed == 0 and result.attempted >= 2, result
