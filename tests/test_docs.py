"""The reference pages are generated from the code and committed; they must be current."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from dxr.config import load_settings
from dxr.docs import PAGES, ROOT
from warehouse.sql import _READ_ONLY_PREFIXES


@pytest.mark.parametrize("page", sorted(PAGES))
def test_generated_reference_is_current(page):
    committed = (ROOT / page).read_text()
    assert committed == PAGES[page](), f"{page} is stale: run `.venv/bin/python -m dxr.docs` and commit"


def test_readme_shows_the_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```"  # a fence may be indented (a block inside a list item)


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to dashes, a repeated
    heading numbered (`-1`, `-2`)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", re.sub(FENCE, "", text, flags=re.S | re.M), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_heading_anchors_are_spelled_as_github_spells_them():
    text = "# A\n## Where the oracle's lead lies (2026-12-04, evening)\n#### `ckd` — Chronic kidney disease\n## A\n"
    assert heading_anchors(text) == {"a", "where-the-oracles-lead-lies-2026-12-04-evening",
                                     "ckd--chronic-kidney-disease", "a-1"}


@pytest.mark.parametrize("page", DOC_PAGES, ids=[page.name for page in DOC_PAGES])
def test_every_relative_link_and_anchor_resolves(page):
    # Links in the prose only: a fenced block is code, not a link.
    for target in re.findall(r"\]\(((?!https?:)[^)\s]+)\)", re.sub(FENCE, "", page.read_text(), flags=re.S | re.M)):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name} links to missing {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in heading_anchors(linked.read_text()), f"{page.name} links to {target}: no such heading"


def inline_code(text: str) -> list[str]:
    """The inline code spans outside fenced blocks, a span that wraps a line joined into one."""
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", re.sub(FENCE, "", text, flags=re.S | re.M))]


def code_lines(text: str) -> list[str]:
    """Each line of a fenced block (`\\` continuations joined) and each inline code span."""
    blocks = re.findall(FENCE, text, flags=re.S | re.M)
    return [*(line for block in blocks for line in block.replace("\\\n", " ").splitlines()), *inline_code(text)]


TOML_EXAMPLES = [(path.name, block) for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
                 for block in re.findall(r"```toml\n(.*?)```", path.read_text(), flags=re.S)]


@pytest.mark.parametrize("page, example", TOML_EXAMPLES, ids=[f"{page}-{i}" for i, (page, _) in
                                                             enumerate(TOML_EXAMPLES)])
def test_every_documented_settings_file_is_valid(page, example, tmp_path, monkeypatch):
    config = tmp_path / "dxr.toml"
    config.write_text(example)
    monkeypatch.setenv("DXR_CONFIG", str(config))
    settings = load_settings()  # raises ConfigError naming the bad key or syntax
    # Valid, and read as written: every value the example sets is the setting's value (a key dropped or
    # coerced into another value would load without an error).
    assert_sets(tomllib.loads(example), settings.model_dump(mode="json"), page)


def assert_sets(written, loaded, where: str) -> None:
    """Each value in `written` (a parsed TOML example) is in `loaded` (the settings as JSON) at the same place;
    settings the example leaves out are not compared."""
    if isinstance(written, dict):
        for key, value in written.items():
            assert isinstance(loaded, dict) and key in loaded, f"{where}: {key} is no setting"
            assert_sets(value, loaded[key], f"{where}: {key}")
    elif isinstance(written, list):
        assert isinstance(loaded, list) and len(loaded) == len(written), \
            f"{where}: the example lists {len(written)}, the settings hold {loaded!r}"
        for i, (value, setting) in enumerate(zip(written, loaded)):
            assert_sets(value, setting, f"{where}[{i}]")
    else:
        assert loaded == written, f"{where}: the example sets {written!r}, the settings hold {loaded!r}"


# `dxr sql [--run R] [--with-gold] "QUERY"` (options in either order) anywhere in the README and docs (a query may
# span lines), ```sql blocks, and a query shown as inline code on its own (`SELECT … FROM runs WHERE …`); each with
# its --with-gold.
SQL_EXAMPLES = [(path.name, query, "--with-gold" in options) for path in DOC_PAGES
                for options, query in [*re.findall(r'dxr sql ((?:--run \S+ |--with-gold )*)"([^"]+)"',
                                                   path.read_text()),
                                       *(("", block) for block in re.findall(r"```sql\n(.*?)```", path.read_text(),
                                                                             flags=re.S)),
                                       *(("", span) for span in inline_code(path.read_text())
                                         if re.match(r"(SELECT|WITH) ", span))]
                if query != "QUERY"]  # the CLI table's placeholder


@pytest.mark.parametrize("page, query, with_gold", SQL_EXAMPLES,
                         ids=[f"{page}-{i}" for i, (page, *_) in enumerate(SQL_EXAMPLES)])
def test_every_documented_sql_example_runs(page, query, with_gold, tmp_path):
    """Each example binds against the tables as `warehouse/schemas.py` defines them (an empty warehouse)."""
    from click.testing import CliRunner

    from dxr.cli import main

    (tmp_path / "forecast").mkdir()
    query = re.sub(r"\s*--[^\n]*\n", "\n", query).strip().rstrip(";")  # a SQL comment line of a ```sql block
    result = CliRunner().invoke(main, ["--data-dir", str(tmp_path), "sql", *["--with-gold"] * with_gold, query])
    assert result.exit_code == 0, f"{page}: {query!r} fails: {result.output}"


def test_readme_names_every_statement_dxr_sql_runs():
    readme = " ".join((ROOT / "README.md").read_text().split())
    listed = re.search(r"`dxr sql` runs exactly one read-only statement \(([^)]*)\)", readme).group(1)
    assert sorted(re.findall(r"`([A-Z]+)`", listed)) == sorted({p.upper() for p in _READ_ONLY_PREFIXES} | {"ANALYZE"})


# `duckdb -c "QUERY"` in the README and docs: DuckDB run directly on the Parquet files, no dxr in between.
DUCKDB_EXAMPLES = [(path.name, query) for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
                   for query in re.findall(r'duckdb -c "([^"]+)"', path.read_text())]


def test_the_readme_reads_the_parquet_files_with_duckdb():
    assert len([page for page, _ in DUCKDB_EXAMPLES if page == "README.md"]) == 2


@pytest.mark.parametrize("page, query", DUCKDB_EXAMPLES,
                         ids=[f"{page}-{i}" for i, (page, _) in enumerate(DUCKDB_EXAMPLES)])
def test_every_documented_duckdb_example_reads_every_file(page, query, tmp_path, monkeypatch):
    """Run against files of two generations: a `runs` file written before `host` and `pid` existed."""
    from datetime import datetime

    import duckdb
    import polars as pl
    import pyarrow.parquet as pq

    from warehouse.store import Warehouse

    wh = Warehouse(tmp_path / "data")
    started = datetime(2026, 12, 1)
    run = {"cohort_id": "c1", "config_json": "{}", "code_version": "v", "started_at": started,
           "finished_at": started, "status": "finished"}
    wh.write("runs", pl.DataFrame([{**run, "run_id": "new", "kind": "evaluate", "host": "h1", "pid": 7}]),
             run_id="new", kind="evaluate")
    old = wh.write("runs", pl.DataFrame([{**run, "run_id": "old", "kind": "evaluate", "host": None, "pid": None}]),
                   run_id="old", kind="evaluate")
    pq.write_table(pq.read_table(old).drop_columns(["host", "pid"]), old)  # as dxr wrote it before `host`
    for run_id in ("new", "old"):
        wh.write("metrics", pl.DataFrame({
            "run_id": run_id, "cohort_id": "c1", "system": "repeat_history", "subset": "all", "k": [10, 20],
            "metric": "recall_at_k", "value": [0.25, 0.5], "ci_low": None, "ci_high": None, "n": 4, "n_runs": 1},
            schema_overrides={"k": pl.Int32, "ci_low": pl.Float64, "ci_high": pl.Float64, "n_runs": pl.Int32}),
            run_id=run_id, system="repeat_history")
    monkeypatch.chdir(tmp_path)
    rows = duckdb.sql(" ".join(query.split())).fetchall()
    assert rows in ([("new", "repeat_history", 0.5), ("old", "repeat_history", 0.5)],
                    [("new", "evaluate", "finished", "h1"), ("old", "evaluate", "finished", None)]), f"{page}: {rows}"


def test_the_readme_demo_realism_table_is_as_dxr_demo_prints_it():
    # `dxr demo` prints the realism bands with format_table, which spells booleans true / false as DuckDB does;
    # the README kept Python's right-aligned True.
    from warehouse.sql import format_table

    block = re.search(r"^band +value.*?^\(\d+ rows\)\n", (ROOT / "README.md").read_text(), flags=re.S | re.M)[0]
    rows = []
    for line in block.splitlines()[2:-1]:
        band, value, low, high = line.split()[:4]
        rows.append((band, float(value), float(low), float(high), float(low) <= float(value) <= float(high)))
    assert len(rows) == 7
    assert block == format_table(["band", "value", "low", "high", "within_band"], rows)


def script_options(script: Path) -> tuple[set[str], set[str]]:
    """The `--options` a benchmark script's argparse parser defines, and those of them it requires."""
    import ast

    defined, required = set(), set()
    for node in ast.walk(ast.parse(script.read_text())):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value.startswith("--")):
            defined.add(node.args[0].value)
            if any(kw.arg == "required" and getattr(kw.value, "value", False) for kw in node.keywords):
                required.add(node.args[0].value)
    return defined, required


# `benchmarks/NAME.py ARGS` as a command line in the README and docs (a bare `benchmarks/NAME.py` names the script).
BENCHMARK_COMMANDS = [(path.name, script, args) for path in DOC_PAGES for line in code_lines(path.read_text())
                      for script, args in re.findall(r"benchmarks/(\w+)\.py((?: +[^\s#]+)*)", line) if args]


@pytest.mark.parametrize("page, script, args", BENCHMARK_COMMANDS,
                         ids=[f"{page}-{script}-{i}" for i, (page, script, _) in enumerate(BENCHMARK_COMMANDS)])
def test_every_documented_benchmark_command_takes_its_options(page, script, args):
    defined, required = script_options(ROOT / "benchmarks" / f"{script}.py")
    given = set(re.findall(r"(?:^|[ \[])(--[a-z][a-z0-9-]*)", args))
    assert given <= defined, f"{page}: benchmarks/{script}.py{args}: no option {sorted(given - defined)}"
    assert required <= given, f"{page}: benchmarks/{script}.py{args}: requires {sorted(required - given)}"


def dxr_arguments(line: str) -> list[list[str]]:
    """The arguments of each `dxr` command a line shows, up to a comment, `&&`, a pipe or a redirection."""
    import shlex

    commands = []
    for start in re.finditer(r"(?:^|(?<=[\s(/=]))dxr(?= |$)", line):
        rest = line[start.end():]
        for closing in ("", '"', "'"):  # a query that goes on in the block's next line closes here
            try:
                tokens = shlex.split(rest + closing, comments=True)
                break
            except ValueError:
                continue
        stop = next((i for i, token in enumerate(tokens) if token in ("&&", "|", ";", ">")), len(tokens))
        commands.append(tokens[:stop])
    return commands


DXR_COMMANDS = [(path.name, args) for path in DOC_PAGES for line in code_lines(path.read_text())
                for args in dxr_arguments(line)]
PLACEHOLDER = re.compile(r"^[A-Z_]+\]?$|…|\.\.\.|^<")  # `--run R`, `--split …`, `<dir>`, `[OPTIONS]`


def dxr_usage_error(args: list[str]) -> str | None:
    """Why `dxr ARGS` names a command, an option or a value that the CLI lacks; None when all exist."""
    import click

    from dxr.cli import main

    command, path, args = main, ["dxr"], list(args)
    while args:
        token = args.pop(0).lstrip("[").rstrip("]")
        if not token.startswith("-"):
            if not isinstance(command, click.Group):
                continue  # a positional argument
            if PLACEHOLDER.search(token):
                return None  # a usage line (`dxr cohort [OPTIONS] COMMAND`)
            if token not in command.commands:
                return f"{' '.join(path)} has no command {token!r}"
            command = command.commands[token]
            path.append(token)
            continue
        option = next((p for p in command.params if isinstance(p, click.Option)
                       and token.split("=")[0] in p.opts + p.secondary_opts), None)
        if option is None:
            return f"{' '.join(path)} has no option {token!r}"
        if option.is_flag or option.count or not args or args[0].startswith("-"):
            continue  # a flag, or an option named in prose without its value (`--fusion --dense-share`)
        value = args.pop(0).rstrip("]")
        if PLACEHOLDER.search(value) or isinstance(option.type, click.Path):
            continue  # a path shown need not exist here
        for each in value.split("|"):  # `--mode hybrid|bm25|dense` shows the choices
            try:  # the option's type, then its callback (the system ids `--system` and `--systems` take, ...)
                option.process_value(click.Context(command), (each,) if option.multiple else each)
            except click.BadParameter as error:
                return f"{' '.join(path)} {token} {each!r}: {error.format_message()}"
    return None


@pytest.mark.parametrize("page, args", DXR_COMMANDS, ids=[f"{page}-{i}" for i, (page, _) in enumerate(DXR_COMMANDS)])
def test_every_documented_dxr_command_exists_as_shown(page, args):
    assert dxr_usage_error(args) is None, f"{page}: dxr {' '.join(args)}: {dxr_usage_error(args)}"


def test_a_documented_dxr_command_with_a_wrong_option_or_value_is_caught():
    assert dxr_usage_error(["forecast", "--cohort", "C", "--systems", "ehr_prior"]) == \
        "dxr forecast has no option '--systems'"
    assert dxr_usage_error(["cohort", "make", "--dataset", "D"]) == "dxr cohort has no command 'make'"
    assert dxr_usage_error(["corpus", "search", "q", "--mode", "bm25|sparse"]) == (
        "dxr corpus search --mode 'sparse': Invalid value for '--mode': "
        "'sparse' is not one of 'hybrid', 'bm25', 'dense'.")
    assert dxr_usage_error(["forecast", "--cohort", "C", "--limit", "ten"]) == \
        "dxr forecast --limit 'ten': Invalid value for '--limit': 'ten' is not a valid integer range."
    assert dxr_usage_error(["evaluate", "--run", "R", "--systems", "s1", "--k", "5"]) == (
        "dxr evaluate --systems 's1': Invalid value for '--systems': unknown system 's1'; evaluable: dense_prior, "
        "direct, ehr_prior, global_frequency, gru, oracle, record_oracle, repeat_history, rrf_prior_direct, transition")
    assert dxr_usage_error(["run", "list", "--kind", "forecast:ehr_prior", "--limit", "3"]) is None
    assert dxr_usage_error(["--data-dir", "D", "cohort", "build", "--dataset", "mimic4", "--name", "native"]) is None
