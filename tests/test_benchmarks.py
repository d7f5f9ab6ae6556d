"""The benchmark scripts' wiring: every name they import from the project still exists.

The scripts are run by hand (their numbers are quoted in the README and docs), so nothing else notices when a
function they use is renamed or moved; many import inside the function that needs it, where loading the module does
not reach. Reading their imports from the source covers those too.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
from datetime import datetime, timedelta
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).parents[1] / "benchmarks").glob("*.py"))
PROJECT_PACKAGES = {"dxr", "models", "tasks", "tools", "warehouse"}


def project_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every `from <project module> import <name>` in the script, at any depth."""
    return [(node.lineno, node.module, alias.name)
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
            and node.module.split(".")[0] in PROJECT_PACKAGES
            for alias in node.names]


def test_project_imports_reach_into_functions(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text("import json\nfrom pathlib import Path\nfrom warehouse.store import Warehouse\n\n\n"
                      "def main():\n    from tasks.evaluate import evaluate, load_run\n")
    assert project_imports(script) == [(3, "warehouse.store", "Warehouse"), (7, "tasks.evaluate", "evaluate"),
                                       (7, "tasks.evaluate", "load_run")]


def resolves(module_name: str, name: str) -> bool:
    """`from module_name import name` works: an attribute, or a submodule of a package."""
    module = importlib.import_module(module_name)
    return hasattr(module, name) or (hasattr(module, "__path__")
                                     and importlib.util.find_spec(f"{module_name}.{name}") is not None)


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_imports_resolve(path):
    missing = [f"{path.name}:{line}: from {module_name} import {name}"
               for line, module_name, name in project_imports(path) if not resolves(module_name, name)]
    assert not missing, "benchmark imports that no longer exist: " + "; ".join(missing)


def load_benchmark(name: str):
    path = Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_registry_benchmark_records_its_runs_and_its_measuring_time_in_utc(tmp_path, monkeypatch, host_in_kolkata,
                                                                              capsys):
    """Its runs' started_at / finished_at and its JSON's measured_at were local times (5:30 hours off here), while
    every time dxr records is UTC (`warehouse.schemas.utc_now`)."""
    from datetime import timezone

    from warehouse.schemas import utc_now
    from warehouse.store import Warehouse

    registry = load_benchmark("registry")
    assert datetime.now() - utc_now() > timedelta(hours=5)  # the zone took effect
    wh = Warehouse(tmp_path / "wh")
    before = utc_now()
    registry.grow(wh, 0, 2)
    runs = wh.read("runs").sort("run_id")
    assert runs["run_id"].to_list() == ["r0", "r1"]
    for column in ("started_at", "finished_at"):
        assert all(before <= t <= utc_now() for t in runs[column].to_list()), runs[column]
    monkeypatch.setattr(registry, "REPO", tmp_path)
    monkeypatch.setattr(registry, "RESULTS", tmp_path / "results")
    monkeypatch.setattr("sys.argv", ["registry.py", "--sizes", "0", "--repeats", "1"])
    registry.main()
    record = json.loads((tmp_path / "results" / "registry.json").read_text())
    measured_at = datetime.fromisoformat(record["measured_at"])
    assert measured_at.utcoffset() == timedelta(0)
    assert timedelta(0) <= datetime.now(timezone.utc) - measured_at < timedelta(minutes=5)
    # Each row as it is measured is progress, on stderr; stdout holds the table and the results file's path.
    printed = capsys.readouterr()
    assert printed.err.splitlines() == [str(row) for row in record["rows"]]
    assert printed.out.splitlines()[0].split() == list(record["rows"][0])
    assert printed.out.splitlines()[-1] == f"wrote {tmp_path / 'results' / 'registry.json'}"


def test_a_second_retrieval_benchmark_on_one_index_dir_is_refused_before_it_loads_the_model(tmp_path, monkeypatch):
    from tools.index import building_index

    # It loaded the embedding model and read both benchmarks before its first build refused it, and a run that got
    # past that (another run building only its combined index) was refused minutes later, at that build.
    retrieval = load_benchmark("retrieval")

    def too_early(*args, **kwargs):
        raise AssertionError("read the benchmarks or loaded the model before taking the index locks")

    for slow in ("make_embedder", "pubmedqa_task", "medquad_task"):
        monkeypatch.setattr(retrieval, slow, too_early)
    for data in ("PUBMEDQA", "MEDQUAD"):
        (tmp_path / data).touch()
        monkeypatch.setattr(retrieval, data, tmp_path / data)
    monkeypatch.setattr("sys.argv", ["retrieval.py", "--index-dir", str(tmp_path / "indexes")])
    with building_index(tmp_path / "indexes" / "combined"), pytest.raises(SystemExit) as exited:
        retrieval.main()
    assert exited.value.code == (f"index {tmp_path / 'indexes' / 'combined'} is being built by another process: wait "
                                 "for it to finish, then rerun")


def test_the_retrieval_benchmark_prints_its_progress_on_stderr(capsys):
    """Its progress lines (here the dev grid's, one per fusion setting) were mixed into the tables on stdout."""
    retrieval = load_benchmark("retrieval")
    golds = [f"doc{i}" for i in range(8)]
    assert {retrieval.split_of(gold) for gold in golds} == {"dev", "test"}
    retrieved = [(gold, {gold: (None, 2.0), "other": (None, 1.0)}, {gold: (None, 0.4), "other": (None, 0.9)})
                 for gold in golds]
    grid, _ = retrieval.select_on_dev({"tiny": retrieved})
    printed = capsys.readouterr()
    assert printed.out == ""
    assert [line.split(":")[0] for line in printed.err.splitlines()] == [
        f"[dev] {row['fusion']:<6} share {row['dense_share']:.1f}" for row in grid]


def test_mimic_import_leaves_the_rest_of_a_given_workdir(tmp_path, monkeypatch):
    """benchmarks/mimic_import.py --workdir D without --keep removes the files it generated there, not D."""
    mimic_import = load_benchmark("mimic_import")
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("the caller's")
    monkeypatch.setattr(mimic_import, "RESULTS", tmp_path / "results")
    monkeypatch.setattr("sys.argv", ["mimic_import.py", "--scale", "0.0002", "--prescriptions", "5000",
                                     "--workdir", str(workdir)])
    mimic_import.main()
    assert sorted(p.name for p in workdir.iterdir()) == ["notes.txt"]
    record = json.loads((tmp_path / "results" / "mimic_import.json").read_text())
    assert (record["rows_per_table"]["patients"], record["rows_per_table"]["admissions"]) == (60, 86)
    # When it ran, in UTC and saying so (it was local time without an offset).
    assert datetime.fromisoformat(record["when"]).utcoffset() == timedelta(0)


def test_mimic_import_generates_and_counts_its_files_in_any_workdir(tmp_path):
    """The generated files were written and counted with the path pasted into the SQL: a workdir with an apostrophe
    failed to parse; they are now read back as the importer reads a user's files (`duck.read`, so a `key=value`
    directory adds no column and glob characters match themselves)."""
    import gzip

    mimic_import = load_benchmark("mimic_import")
    folder = tmp_path / "site=a" / "o'brien [v2]" / "hosp"
    rows = mimic_import.generate(folder, scale=0.0002, prescriptions=5000, labevents=0)
    lines = {path.name.removesuffix(".csv.gz"): sum(1 for _ in gzip.open(path, "rt")) - 1  # without the header
             for path in folder.iterdir()}
    assert rows == lines and len(rows) == 7 and min(rows.values()) > 0


@pytest.mark.parametrize("theirs", ["mimic-iv/hosp/patients.csv.gz", "meds/data/0.parquet"])
def test_mimic_import_refuses_a_workdir_holding_files_of_the_names_it_writes(tmp_path, monkeypatch, theirs):
    """A caller's mimic-iv/ was deleted before generation (hosp/) and after the run (all of it), and a caller's
    meds/ was replaced by the benchmark's output and then deleted."""
    mimic_import = load_benchmark("mimic_import")
    workdir = tmp_path / "work"
    (workdir / theirs).parent.mkdir(parents=True)
    (workdir / theirs).write_text("the caller's")
    monkeypatch.setattr(mimic_import, "RESULTS", tmp_path / "results")
    monkeypatch.setattr("sys.argv", ["mimic_import.py", "--scale", "0.0002", "--prescriptions", "5000",
                                     "--workdir", str(workdir)])
    with pytest.raises(SystemExit) as stopped:
        mimic_import.main()
    held = workdir / theirs.split("/")[0]
    assert stopped.value.code == (
        f"--workdir {workdir} holds {held}, not generated by this script (no generated.json): the run would replace "
        "and then remove them; pass a new or empty directory, or remove them if a killed run of this script left them")
    assert (workdir / theirs).read_text() == "the caller's"
    assert not (tmp_path / "results").exists()


def test_every_result_records_the_commit_and_machine_it_was_measured_on(tmp_path):
    """A number quoted in the docs must be traceable to the code that produced it: every benchmark writes its JSON
    through `write_result`, which adds the commit, whether tracked files differed from it, and when and where."""
    import subprocess
    from datetime import timezone

    provenance = load_benchmark("provenance")
    head = subprocess.run(["git", "-C", str(provenance.REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout: the commit is recorded as null there")
    provenance.write_result(tmp_path / "out" / "bench.json", {"rows": [1, 2]})
    record = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert record["rows"] == [1, 2]
    assert record["provenance"]["commit"] == head.stdout.strip()
    assert isinstance(record["provenance"]["uncommitted_changes"], bool)
    measured_at = datetime.fromisoformat(record["provenance"]["measured_at"])
    assert timedelta(0) <= datetime.now(timezone.utc) - measured_at < timedelta(minutes=5)
    assert len(record["provenance"]["load_average"]) == 3 and record["provenance"]["cpus"] >= 1


@pytest.mark.parametrize("path", [p for p in BENCHMARKS if p.name != "provenance.py"], ids=lambda p: p.name)
def test_every_benchmark_writes_its_results_through_write_result(path):
    assert "write_result(" in path.read_text(), (
        f"{path.name} writes its JSON without its provenance: use benchmarks.provenance.write_result")


REFERENCE = Path(__file__).parents[1] / "benchmarks" / "reference"
README = Path(__file__).parents[1] / "README.md"
# The README's column names and system labels for the results' keys.
README_COLUMNS = {"R@20 new-onset": "R@20 new", "R@20 repeated": "R@20 rep"}
README_SYSTEMS = {"ehr_prior (MoE)": "ehr_prior"}


def readme_table_after(heading: str) -> dict[str, dict[str, str]]:
    """The first Markdown table after the paragraph starting with `heading`: {system: {column: cell}}."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("| "))
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    header, body = rows[0], rows[2:]
    return {README_SYSTEMS.get(row[0], row[0]): {README_COLUMNS.get(h, h): cell for h, cell in zip(header[1:], row[1:])}
            for row in body}


@pytest.mark.parametrize("heading, reference", [
    ("**Next-encounter forecasting on the default synthetic cohort**", "prior-synthetic5k.json"),
    ("**The same on a 50,000-patient synthetic cohort**", "prior-synthetic50k.json"),
])
def test_the_readme_prior_tables_are_the_kept_results(heading, reference):
    """The README's prior tables quote the results files kept in benchmarks/reference/, to the digit: a table edited
    by hand, or left behind by a rerun that changed the numbers, fails here."""
    result = json.loads((REFERENCE / reference).read_text())
    assert result["provenance"]["commit"] and result["provenance"]["uncommitted_changes"] is False
    measured = {row["system"]: row for row in result["table"]}
    table = readme_table_after(heading)
    assert set(table) == set(measured)
    for system, cells in table.items():
        for column, cell in cells.items():
            assert cell == f"{measured[system][column][0]:.3f}", (system, column, cell)


def test_the_readme_mimic_import_row_is_the_kept_result():
    """The README's MIMIC-IV import row opens with the run kept in benchmarks/reference/: its time, rows per second,
    peak memory and load, to the printed digit."""
    result = json.loads((REFERENCE / "mimic_import.json").read_text())
    assert result["provenance"]["commit"] and result["provenance"]["uncommitted_changes"] is False
    assert result["scale"] == 1.0 and result["rows_per_table"]["prescriptions"] == 3_000_000
    row = next(line for line in README.read_text().splitlines()
               if line.startswith("| MIMIC-IV import, generated full-scale `hosp` layout"))
    measured = row.strip("|").split("|")[2].strip()
    assert measured.startswith(
        f"{result['import_s']:.1f} s ({result['rows_per_s']:,} rows/s), {result['peak_rss_mib']:,.0f} MiB peak under "
        f"load {result['load_avg_1m_before']:.1f}–{result['load_avg_1m_after']:.1f} "), measured


def test_the_readme_generator_row_is_the_kept_result():
    """The README's synthetic generator row opens with the run kept in benchmarks/reference/: its events, time, rows per
    second, peak memory and load, to the printed digit, measured with the generator version of this checkout."""
    from warehouse.synthetic import GENERATOR_VERSION

    result = json.loads((REFERENCE / "synth.json").read_text())
    assert result["provenance"]["commit"] and result["provenance"]["uncommitted_changes"] is False
    assert result["generator_version"] == GENERATOR_VERSION, "rerun benchmarks/synth.py for the new generator"
    row = next(line for line in README.read_text().splitlines()
               if line.startswith(f"| synthetic generator, {result['patients']:,} patients"))
    measured = row.strip("|").split("|")[2].strip()
    assert measured.startswith(
        f"{result['events']:,} events in {result['seconds']:.1f} s ({result['rows_per_second']:,} rows/s), peak RSS "
        f"{result['peak_rss_mb_main']:.0f} MB main process, {result['peak_rss_mb_worker']:.0f} MB worker "
        f"({result['workers']} worker processes) under load {result['provenance']['load_average'][0]:.1f} "), measured


def readme_row(start: str) -> str:
    """The measured cell of the README's Benchmarks row that starts with `start`."""
    row = next(line for line in README.read_text().splitlines() if line.startswith(start))
    return row.strip("|").split("|")[2].strip()


def test_the_retrieval_rows_and_tables_are_the_kept_results():
    """The README's retrieval rows and docs/tools.md's quality, latency and build tables quote the two runs kept in
    benchmarks/reference/ (a first build and a rebuild from its cached embeddings), to the printed digit."""
    cold, cached = (json.loads((REFERENCE / name).read_text()) for name in ("retrieval.json", "retrieval-cached.json"))
    for result in (cold, cached):
        assert result["provenance"]["commit"] and result["provenance"]["uncommitted_changes"] is False
    # Retrieval and fusion are deterministic: the rebuild must not change one quality number.
    assert cold["benchmarks"] == cached["benchmarks"] and cold["selection"] == cached["selection"]
    assert all(index["embedded"] == 0 for index in cached["indexes"].values())
    quality = cold["benchmarks"]
    hybrid = f"hybrid {cold['product_default']['fusion']} {cold['product_default']['dense_share']}"

    def r10(benchmark, split, method):
        return f"{quality[benchmark][split][method]['R@10']:.3f}"

    def trio(benchmark, split):
        return " / ".join(r10(benchmark, split, method) for method in ("bm25", "dense", hybrid))

    for benchmark, name in (("pubmedqa", "PubMedQA"), ("medquad", "MedQuAD")):
        test = quality[benchmark]["test"]
        assert readme_row(f"| literature retrieval, {name} ").startswith(
            f"R@10 on the test half ({test['bm25']['n_queries']:,}): BM25 {r10(benchmark, 'test', 'bm25')}, dense "
            f"{r10(benchmark, 'test', 'dense')}, hybrid {r10(benchmark, 'test', hybrid)}; full set "
            f"{trio(benchmark, 'full')}"), benchmark
    latency = [result["combined_latency"]["hybrid"] for result in (cold, cached)]
    loads = [result["load_average"]["before_latency"][0] for result in (cold, cached)]
    assert readme_row("| hybrid query over MedQuAD").startswith(
        f"p50/p95 {latency[0]['p50_ms']:.1f}/{latency[0]['p95_ms']:.1f} ms under load average {loads[0]:.1f} "
        f"(2026-12-06, kept with the rows above), {latency[1]['p50_ms']:.1f}/{latency[1]['p95_ms']:.1f} ms under "
        f"load {loads[1]:.1f} "), latency
    medquad, icd = cold["indexes"]["medquad"], cold["indexes"]["icd"]
    assert readme_row("| index builds |").startswith(
        f"MedQuAD {medquad['n_chunks']:,} chunks ({medquad['embedded']:,} distinct texts embedded) in "
        f"{medquad['build_seconds']:.1f} s, {medquad['bytes'] / 1e6:.1f} MB; with the embeddings cached a rebuild "
        f"takes {cached['indexes']['medquad']['build_seconds']:.1f} s; ICD BM25 index {icd['n_chunks']:,} chunks in "
        f"{icd['build_seconds']:.1f} s")

    tools = (Path(__file__).parents[1] / "docs" / "tools.md").read_text().splitlines()
    methods = {"BM25": "bm25", "dense": "dense", "hybrid z-score, s = 0.7 (default)": hybrid,
               "hybrid plain RRF (previous)": "hybrid rrf 0.5 (previous default)"}
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in tools
            if line.startswith(tuple(f"| {name} | {split} |" for name in ("PubMedQA", "MedQuAD")
                                     for split in ("test", "full", "dev")))]
    assert len(rows) == 24
    for benchmark, split, method, n, *metrics in rows:
        measured = quality[benchmark.lower()][split][methods[method]]
        expected = [str(measured["n_queries"]), *(f"{measured[m]:.3f}" for m in ("R@1", "R@5", "R@10", "MRR"))]
        assert [n, *metrics] == expected, (benchmark, split, method)
    modes = {"BM25": "bm25", "dense": "dense", "hybrid (z-score, s = 0.7)": "hybrid"}
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in tools
            if line.startswith(tuple(f"| {mode} | 1000 |" for mode in modes))]
    assert len(rows) == 3
    for mode, n, r1, r10_, mrr, first, second in rows:
        runs = [result["combined_latency"][modes[mode]] for result in (cold, cached)]
        assert [n, r1, r10_, mrr] == [str(runs[0]["n_queries"]), *(f"{runs[0][m]:.3f}" for m in ("R@1", "R@10", "MRR"))]
        assert [first, second] == [f"{run['p50_ms']:.1f} / {run['p95_ms']:.1f}" for run in runs], mode
    builds = {"PubMedQA": "pubmedqa", "MedQuAD": "medquad", "combined": "combined", "ICD (lexical)": "icd"}
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in tools
            if line.startswith(tuple(f"| {name} | " for name in builds)) and line.count("|") == 7]
    assert len(rows) == 4
    for name, documents, chunks, size, first, rebuild in rows:
        built, rebuilt = cold["indexes"][builds[name]], cached["indexes"][builds[name]]
        assert (documents, chunks, size) == (f"{built['n_documents']:,}", f"{built['n_chunks']:,}",
                                             f"{built['bytes'] / 1e6:.1f} MB"), name
        assert first.startswith(f"{built['build_seconds']:.1f} s") and rebuild == f"{rebuilt['build_seconds']:.1f} s"
        if built["embedded"]:
            assert f"({built['embedded']:,} distinct texts embedded" in first, name


def test_the_prior_benchmark_says_when_it_scores_train_patients(tmp_path, monkeypatch, capsys):
    """`--eval-split all` (the MIMIC-III demo's smoke run: it has no held_out trajectory) scores patients the learned
    systems were fit on; the table and the results file say so, as `dxr evaluate` does."""
    import multiprocessing

    from benchmarks import prior

    monkeypatch.setattr(prior, "RESULTS", tmp_path / "results")
    monkeypatch.setattr("sys.argv", ["prior.py", "--data-dir", str(tmp_path / "wh"), "--planted", "60", "--epochs", "1",
                                     "--patience", "2", "--bootstrap", "0", "--systems", " repeat_history",
                                     "--eval-split", "all", "--name", "smoke"])
    start_method = multiprocessing.get_start_method(allow_none=True)
    try:
        prior.main()  # sets the start method to spawn, which the rest of the session must not inherit
    finally:
        multiprocessing.set_start_method(start_method, force=True)
    record = json.loads((tmp_path / "results" / "prior-smoke.json").read_text())
    assert (record["prior_config"]["epochs"], record["prior_config"]["patience"]) == (1, 2)
    # What reproduces the numbers: the data, the bootstrap, the options, the model version each system forecast with.
    assert (record["patients"], record["seed"], record["bootstrap"]) == (60, 7, {"replicates": 0, "seed": 0})
    assert record["arguments"]["systems"] == " repeat_history" and record["systems"] == ["repeat_history", "ehr_prior"]
    assert record["inference"]["ehr_prior"]["evaluated"]["model_version"] == record["training"]["ehr_prior"]["version"]
    counts = record["trajectories"]
    assert record["in_sample_note"].startswith(
        f"{counts['train']} of the {sum(counts.values())} trajectories are of train-split patients")
    assert "scores on them are in-sample" in record["in_sample_note"]
    printed = capsys.readouterr()
    assert f"note: {record['in_sample_note']}\n" in printed.out
    assert "note: a planted cohort of 60 patients (--planted) is a smoke test of the wiring" in printed.out
    # The tuning patients it also scores are those the learned systems chose their epoch on.
    assert ("note: the learned systems chose their epoch on the tuning patients' pre-target records, which "
            "--eval-split all scores; held_out is the split no choice has seen\n") in printed.out
    # Progress goes to stderr, as `dxr synth` prints its own: stdout is the table and the results file's path.
    assert printed.out.splitlines()[1].startswith("system | P@10 | R@10 |")
    assert printed.out.endswith(f"wrote {tmp_path / 'results' / 'prior-smoke.json'}\n")
    assert [line.split(":")[0] for line in printed.err.splitlines()] == [
        "cohort cplanted", "trained ehr_prior", "forecast repeat_history", "forecast ehr_prior"]
    assert "(epoch 1 of 1 trained)" in printed.err.splitlines()[1]


def test_the_prior_benchmark_says_how_far_its_synthetic_data_and_cohort_have_got(wh_vocab, capsys):
    """Without a terminal (a 50k run's log) the benchmark's generation and build showed no line for minutes: they log
    as `dxr synth` and `dxr cohort build` do, on stderr (they were mixed into the table's stdout)."""
    import argparse
    import re

    from benchmarks import prior

    args = argparse.Namespace(planted=0, cohort="default", patients=20, seed=7)
    cohort_id, dataset = prior.ensure_cohort(str(wh_vocab.root), args)
    assert dataset == {"dataset_id": "synthetic", "source": "synthetic", "patients": 20, "seed": 7}
    printed = capsys.readouterr()
    assert printed.out == ""
    assert [re.sub(r"in \d+\.\d s$", "in S s", line) for line in printed.err.splitlines()] == [
        "synthetic: 20/20 patients written (100%) in S s",
        *(f"cohort default: {step} done in S s" for step in (
            "events", "harmonized diagnosis codes", "trajectories", "vocabulary",
            "pre-target records, train events and targets",
            "oracle probabilities (latent and record)"))]
    assert wh_vocab.read("cohorts")["cohort_id"].to_list() == [cohort_id]


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSEGV"])
def test_the_prior_benchmark_ends_when_a_step_is_killed_before_it_reports(signal_name):
    """A training or forecast child the out-of-memory killer ends (SIGKILL) puts no result on the queue: the benchmark
    waited for it forever, and ignored a SIGINT sent to it while it waited."""
    import signal
    import threading

    from benchmarks import prior

    outcome = {}

    def step():
        try:
            prior.in_child(signal.raise_signal, signal.Signals[signal_name])
        except prior.ChildFailed as exc:
            outcome["error"] = str(exc)

    waiting = threading.Thread(target=step, daemon=True)
    waiting.start()
    waiting.join(timeout=60)
    assert not waiting.is_alive(), "still waiting for a child that is dead"
    number = signal.Signals[signal_name].value
    assert outcome["error"].startswith(f"the child process of raise_signal was killed by signal {number} "
                                       f"({signal_name})")
    assert ("out-of-memory killer" in outcome["error"]) == (signal_name == "SIGKILL")


def test_the_prior_benchmark_reports_a_failed_step_in_one_line(tmp_path):
    """A step that fails in its child (here a --skip-train with nothing trained) ended in the parent's traceback."""
    import subprocess
    import sys

    script = Path(__file__).parents[1] / "benchmarks" / "prior.py"
    done = subprocess.run([sys.executable, str(script), "--data-dir", str(tmp_path / "wh"), "--planted", "40",
                           "--skip-train", "--systems", "ehr_prior", "--bootstrap", "0", "--name", "untrained"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1
    last = done.stderr.splitlines()[-1]
    assert last.startswith("Error: NotFoundError: no registered model 'ehr_prior-cplanted' with alias 'champion'")
    assert "Traceback" not in done.stderr


def test_the_prior_benchmark_reports_the_data_a_reused_cohort_was_built_on(wh_vocab):
    """A second run on a data dir reuses its cohort: with other --patients or --seed it measured the old data and wrote
    the asked-for numbers into the results file as those it measured."""
    import argparse

    from benchmarks import prior
    from dxr.errors import InputError

    def ask(patients, seed):
        return prior.ensure_cohort(str(wh_vocab.root), argparse.Namespace(planted=0, cohort="default",
                                                                          patients=patients, seed=seed))

    cohort_id, built = ask(20, 5)
    assert ask(None, None) == (cohort_id, built) == (cohort_id, {"dataset_id": "synthetic", "source": "synthetic",
                                                                 "patients": 20, "seed": 5})
    with pytest.raises(InputError, match=r"^--seed 7: cohort default in .* is built on synthetic data of 20 patients, "
                                         r"seed 5; leave the option out"):
        ask(None, 7)
    with pytest.raises(InputError, match=r"^--patients 30 --seed 6: cohort default"):
        ask(30, 6)


def test_the_prior_benchmark_refuses_a_cohort_the_data_dir_does_not_hold(wh_vocab):
    """`--cohort mimic3-demo` (for mimic3demo) generated 5,000 synthetic patients into the user's warehouse and
    benchmarked them under that name."""
    import argparse

    from benchmarks import prior
    from dxr.errors import InputError

    args = argparse.Namespace(planted=0, cohort="mimic3-demo", patients=None, seed=None)
    with pytest.raises(InputError, match=r"^--cohort mimic3-demo: no cohort of that name in .* \(it has: none\); "
                                         "build it with `dxr cohort build`"):
        prior.ensure_cohort(str(wh_vocab.root), args)
    assert wh_vocab.read("datasets").height == 0


@pytest.mark.parametrize(("option", "value", "error"), [
    ("--name", "a/b", "--name 'a/b': use 1-64 letters, digits"),
    ("--name", "x" * 300, "--name 'xxx"),
    ("--eval-split", "tuning", "--eval-split tuning: cohort cplanted has no trajectory in that split"),
])
def test_the_prior_benchmark_refuses_a_bad_option_before_it_trains(tmp_path, monkeypatch, capsys, option, value,
                                                                   error):
    """A --name no file can carry failed when the results were written, after every training and forecast (a
    name with '/' wrote into a new directory); an --eval-split with no trajectory failed after the trainings."""
    import multiprocessing

    from benchmarks import prior

    monkeypatch.setattr(prior, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(prior, "train_one", None)  # a training started fails the test, not the option
    # A planted cohort of 3 patients has them all in train.
    monkeypatch.setattr("sys.argv", ["prior.py", "--data-dir", str(tmp_path / "wh"), "--planted", "3", option, value])
    start_method = multiprocessing.get_start_method(allow_none=True)
    try:
        with pytest.raises(SystemExit) as stopped:
            prior.main()
    finally:
        multiprocessing.set_start_method(start_method, force=True)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"prior.py: error: {error}")
    assert not (tmp_path / "results").exists()


def test_the_prior_benchmark_refuses_a_data_dir_that_is_a_file(tmp_path, monkeypatch, capsys):
    from benchmarks import prior

    data_dir = tmp_path / "file"
    data_dir.write_text("")
    monkeypatch.setattr("sys.argv", ["prior.py", "--data-dir", str(data_dir)])
    with pytest.raises(SystemExit):
        prior.main()
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"prior.py: error: --data-dir {data_dir} is a file: give a directory (a missing one is created)")
