"""Reports and the evaluation CLI on the tiny hand-written warehouse of test_metrics."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from dxr.cli import main
from dxr.errors import InputError
from tasks.evaluate import evaluate_run
from tasks.report import build_report, k_sweep, mean_k_sweep, render_report, system_table, to_markdown
from test_metrics import A, B, C, COHORT, D, E, RANKINGS, T1, T2, T3, X, dx, write_cohort, write_rankings
from warehouse.store import Warehouse


# The CLI takes the ids of systems that dxr forecasts, which test_metrics' s1 and s2 are not: their lists under two.
FORECASTABLE = {"global_frequency": RANKINGS["s1"], "repeat_history": RANKINGS["s2"]}
FORECASTABLE_STATUS = {("repeat_history", T2): "short"}


@pytest.fixture
def wh(tmp_path) -> Warehouse:
    warehouse = Warehouse(tmp_path / "wh")
    write_cohort(warehouse)
    write_rankings(warehouse, "r1")
    warehouse.write("oracle_probabilities", pl.DataFrame({
        "cohort_id": COHORT, "trajectory_id": [T1, T1, T2, T2, T3, T3], "code": [A, C, D, B, E, X],
        "probability": [0.9, 0.8, 0.7, 0.1, 0.6, 0.2]}), cohort_id=COHORT)
    return warehouse


def test_html_report_is_self_contained_with_embedded_plots(wh, tmp_path):
    evaluate_run(wh, "r1", ks=(1, 2), n_boot=100)
    page = render_report(wh, "r1", tmp_path / "out")
    text = page.read_text()
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", text)
    # comparison, K-sweep, frequency buckets, new-onset vs repeated
    assert len(images) == 4
    assert all(base64.b64decode(i).startswith(b"\x89PNG\r\n\x1a\n") for i in images)
    decoded = b"".join(base64.b64decode(i) for i in images)
    assert b"http" not in decoded
    assert not re.search(r"https?://|src=['\"](?!data:)|href=|<script|<link", text)
    for heading in ("Systems at K = 2", "Systems at K = 1", "Systems at K = |C|", "Paired comparisons",
                    "Headroom: target-conditioned pool oracle", "New-onset vs repeated target codes"):
        assert heading in text
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "| system | P@K | R@K | micro-F1 | macro-F1 | n | short | failed | native share |" in markdown
    # s2 is explicitly short on one trajectory; the oracle ranks A, C in T1 (2 hits), D, B in T2 (1), E, X in T3 (1).
    assert re.search(r"\| s2 \| [^|]+ \| [^|]+ \| [^|]+ \| [^|]+ \| 3 \| 1 \| 0 \| 1\.000 \|", markdown)
    assert re.search(r"\| oracle \| 0\.667 \[", markdown)
    for figure in ("comparison", "k_sweep", "frequency", "onset"):
        assert (tmp_path / "out" / f"{figure}.png").stat().st_size > 1000
        assert f"]({figure}.png)" in markdown


def test_the_short_column_counts_the_trajectories_ranked_below_k_at_each_k_failed_ones_apart(wh):
    # s2 ranks one code for T2 and records it `short`: short of K = 2 but not of K = 1. The column showed the
    # status rows, 1 at every K. s5's failed T2 (no codes) counts as failed only, as `dxr forecast` counts it: the
    # column counted it as short too ("short 2, failed 1" at K = 2 where the forecast said "1 short, 1 failed").
    write_rankings(wh, "r4", rankings={"s1": RANKINGS["s1"], "s2": RANKINGS["s2"], "s5": {T1: [A, B], T2: [], T3: [E]}},
                   status={("s2", T2): "short", ("s5", T2): "failed", ("s5", T3): "short"})
    evaluate_run(wh, "r4", ks=(1, 2), n_boot=0)
    metrics, coverage = wh.read("metrics", run_id="r4"), wh.read("evaluation_coverage", run_id="r4")

    def short_and_failed(k):
        table = system_table(metrics, coverage, k)
        at = table.columns.index("short")
        return {row[0]: (row[at], row[at + 1]) for row in table.rows}

    assert short_and_failed(1) == {"s1": ("0", "0"), "s2": ("0", "0"), "s5": ("0", "1"), "oracle": ("0", "0")}
    assert short_and_failed(2) == {"s1": ("0", "0"), "s2": ("1", "0"), "s5": ("1", "1"), "oracle": ("0", "0")}
    assert short_and_failed(0) == {"s1": ("0", "0"), "s2": ("0", "0"), "s5": ("0", "1"), "oracle": ("0", "0")}
    markdown = to_markdown(build_report(wh, "r4"))
    assert ("short = trajectories whose list has fewer than K codes (failed ones not included, as in dxr forecast's "
            "summary), scored with the hits they have; a list recorded short at the forecast's K may be complete at a "
            "smaller K. failed = trajectories whose forecast failed (no list).") in markdown


def test_the_k_sweep_counts_only_the_subset_it_draws(tmp_path):
    # The K-sweep draws subset `all` at K = 1..20 but counted all nine subsets: nine times the memory of its
    # (systems, subsets, K, trajectories) float64 arrays, about 10 GB for 16 systems at 50,000 trajectories.
    import tracemalloc

    from tasks.report import k_sweep

    wh = Warehouse(tmp_path / "wh")
    codes = [dx(f"C{c:02d}") for c in range(21)]
    ids = [f"{COHORT}:{i}:{i}" for i in range(1, 2001)]
    write_cohort(wh, targets={t: codes[i % 7:i % 7 + 3] for i, t in enumerate(ids)}, pretarget={}, train_counts={})
    write_rankings(wh, "big", rankings={"s1": {t: codes[:20] for t in ids}, "s2": {t: codes[1:] for t in ids}},
                   status={})
    tracemalloc.start()
    try:
        sweep = k_sweep(wh, "big", ["s1", "s2"], 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 15e6, f"{peak / 1e6:.0f} MB"
    recall = dict(sweep.filter((pl.col("k") == 20) & (pl.col("metric") == "micro_recall"))
                  .select("system", "value").iter_rows())
    # s1 ranks every target code; s2 misses codes[0], a target of the 286 trajectories with i % 7 == 0.
    assert recall == {"s1": 1.0, "s2": (6000 - 286) / 6000}
    assert set(sweep["subset"]) == {"all"} and sorted(set(sweep["k"])) == list(range(1, 21))


def test_report_needs_an_evaluation(wh, tmp_path):
    result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "report", "--run", "r1"])
    assert result.exit_code == 1
    assert "run 'r1' has no stored metrics: run `dxr evaluate --run r1` first" in result.output


def test_report_names_a_run_id_the_warehouse_does_not_hold(wh):
    # A typo must not send the user to `dxr evaluate`, which would then refuse the run for having no rankings.
    result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "report", "--run", "r2"])
    assert result.exit_code == 1
    assert f"no run 'r2' in the warehouse at {wh.root}: list the runs with dxr run list\n" in result.output
    assert "dxr evaluate" not in result.output


def test_report_refuses_an_evaluation_that_a_system_joining_the_run_made_stale(wh, tmp_path):
    # The refusal said "a forecast it read was run again" when a system the evaluation never read had joined the run.
    from tasks.forecast import clear_outputs

    evaluate_run(wh, "r1", ks=(1, 2), n_boot=10)
    clear_outputs(wh, "r1", "s9", {})  # what a forecast of a system new to the run does first
    with pytest.raises(InputError, match=r"^the evaluation of run 'r1' is stale \(a system was forecast into the run "
                                         r"since, anew or again, "):
        render_report(wh, "r1", tmp_path / "out")


def test_report_refuses_an_evaluation_a_forecast_rerun_made_stale(wh, tmp_path):
    from tasks.forecast import clear_outputs

    evaluate_run(wh, "r1", ks=(1, 2), n_boot=10)
    clear_outputs(wh, "r1", "s1", {})  # what a rerun of s1 does first: its metrics go, the others' stay
    assert wh.has_rows("metrics", run_id="r1")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "report", "--run", "r1", "--out", str(out)])
    assert result.exit_code == 1
    assert "the evaluation of run 'r1' is stale" in result.output
    assert "run `dxr evaluate --run r1` again" in result.output
    assert not out.exists()
    evaluate_run(wh, "r1", ks=(1, 2), n_boot=10)
    assert render_report(wh, "r1", out).exists()


def test_a_rerender_that_fails_between_files_leaves_the_previous_set_whole(wh, tmp_path, monkeypatch):
    # The files were renamed into place one by one: a render that failed (or was killed) at report.html left the
    # new report.md and figures beside the previous evaluation's page, two evaluations shown as one report.
    import errno
    from pathlib import Path

    out = tmp_path / "out"
    evaluate_run(wh, "r1", ks=(1, 2), n_boot=10)
    render_report(wh, "r1", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["comparison.png", "frequency.png", "k_sweep.png", "onset.png", "report.html",
                              "report.md"]
    evaluate_run(wh, "r1", ks=(2,), n_boot=10, seed=1)   # another evaluation: other K values and intervals

    write_bytes = Path.write_bytes

    def html_fills_the_disk(self, data):
        if "report.html" not in self.name:
            return write_bytes(self, data)
        with open(self, "wb") as f:  # half of the page, then the disk is full
            f.write(data[:len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", html_fills_the_disk)
    with pytest.raises(OSError, match="No space left"):
        render_report(wh, "r1", out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "wh"]   # no staging directory left behind

    monkeypatch.undo()   # the disk has room again: a rerun renders the new evaluation whole
    page = render_report(wh, "r1", out)
    assert "Systems at K = 1" in before["report.md"].decode() and "Systems at K = 1" not in page.read_text()
    assert (out / "report.md").read_bytes() != before["report.md"]
    assert sorted(p.name for p in out.iterdir()) == sorted(before)


def test_a_render_killed_at_any_step_of_its_swap_leaves_one_whole_report(wh, tmp_path):
    # The old report was moved aside before the new one was moved in: a render killed (SIGKILL, the OOM killer)
    # between the two renames left no report at all, and the next render removed the old one as scratch.
    import subprocess
    import sys

    out, expected = tmp_path / "out", tmp_path / "expected"
    evaluate_run(wh, "r1", ks=(1, 2), n_boot=10)
    render_report(wh, "r1", out)
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    evaluate_run(wh, "r1", ks=(2,), n_boot=10, seed=1)
    render_report(wh, "r1", expected)
    new = {p.name: p.read_bytes() for p in expected.iterdir()}
    assert old != new
    # A render that kills itself at its `step`-th move of a directory: before it (even steps) or after it (odd).
    program = ("import os, signal, sys\nimport warehouse.meds as meds\n"
               "from tasks.report import render_report\nfrom warehouse.store import Warehouse\n"
               "step, moves = int(sys.argv[1]), [0]\n"
               "def killing(move):\n"
               "    def moving(*paths):\n"
               "        moves[0] += 1\n"
               "        if step == 2 * moves[0] - 2: os.kill(os.getpid(), signal.SIGKILL)\n"
               "        done = move(*paths)\n"
               "        if step == 2 * moves[0] - 1: os.kill(os.getpid(), signal.SIGKILL)\n"
               "        return done\n"
               "    return moving\n"
               "meds.exchange, meds.os.replace = killing(meds.exchange), killing(meds.os.replace)\n"
               f"render_report(Warehouse({str(wh.root)!r}), 'r1', {str(out)!r})\n")
    seen = []
    for step in range(10):
        child = subprocess.run([sys.executable, "-c", program, str(step)], capture_output=True, text=True, timeout=120)
        assert child.returncode in (-9, 0), child.stderr
        shown = {p.name: p.read_bytes() for p in out.iterdir()} if out.is_dir() else {}
        seen.append("old" if shown == old else "new" if shown == new else sorted(shown))
        if child.returncode == 0:
            break
    assert seen == ["old", "new", "new"]
    render_report(wh, "r1", out)  # removes what the killed renders left beside the report
    assert {p.name: p.read_bytes() for p in out.iterdir()} == new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["expected", "out", "wh"]


def test_a_report_rendered_over_another_keeps_none_of_its_files(wh, tmp_path):
    # An evaluation at the natural list sizes alone draws no K-sweep (no fixed K to sweep up to): rendered over
    # the report of an evaluation at K = 2, it left that report's k_sweep.png beside its own figures.
    out = tmp_path / "out"
    evaluate_run(wh, "r1", ks=(2,), n_boot=0)
    render_report(wh, "r1", out)
    assert (out / "k_sweep.png").is_file()
    evaluate_run(wh, "r1", ks=(), natural=True, n_boot=0)
    render_report(wh, "r1", out)
    assert sorted(p.name for p in out.iterdir()) == ["comparison.png", "frequency.png", "onset.png", "report.html",
                                                     "report.md"]


def test_a_report_is_not_swapped_over_a_directory_holding_other_files(wh, tmp_path):
    # The set is swapped in as a whole directory, so --out must hold only a report: the user's files are refused,
    # not replaced.
    evaluate_run(wh, "r1", ks=(2,), n_boot=0)
    (tmp_path / "notes.txt").write_text("mine")
    result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "report", "--run", "r1", "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert result.output == (f"Error: {tmp_path} holds 'notes.txt', which is not a file of a report: a report "
                             "replaces its directory whole, so give --out a new or empty directory of its own\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "wh"]


def test_a_report_is_not_swapped_over_the_directory_dxr_runs_in(wh, tmp_path, monkeypatch):
    # `dxr report --out .` swapped the directory away from under the caller: the report landed in a new directory
    # at that path, the caller's shell sat in the removed one, and the printed `report.html` was not there.
    evaluate_run(wh, "r1", ks=(2,), n_boot=0)
    empty, rendered = tmp_path / "empty", tmp_path / "rendered"
    empty.mkdir()
    render_report(wh, "r1", rendered)
    before = {p.name: p.read_bytes() for p in rendered.iterdir()}
    for cwd in (empty, rendered):
        monkeypatch.chdir(cwd)
        result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "report", "--run", "r1", "--out", "."])
        assert (result.exit_code, result.output) == (1, (
            "Error: . is the directory dxr runs in: a report replaces its directory whole; give --out another "
            "directory, or run dxr from outside this one\n"))
        assert Path.cwd() == cwd and cwd.is_dir()
    assert list(empty.iterdir()) == [] and {p.name: p.read_bytes() for p in rendered.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "rendered", "wh"]


def test_a_report_is_not_swapped_over_a_file_and_replaces_scratch_of_a_killed_write(wh, tmp_path):
    evaluate_run(wh, "r1", ks=(2,), n_boot=0)
    page = tmp_path / "page"
    page.write_text("mine")
    with pytest.raises(InputError, match=f"^{page} is a file: give --out a directory for the report$"):
        render_report(wh, "r1", page)
    assert page.read_text() == "mine"
    # What a render killed inside an earlier version's per-file write left: part of the set, not the user's.
    out = tmp_path / "out"
    out.mkdir()
    (out / ".report.html.host-1-0123abcd.tmp").write_text("<html>half")
    render_report(wh, "r1", out)
    assert sorted(p.name for p in out.iterdir()) == ["comparison.png", "frequency.png", "k_sweep.png", "onset.png",
                                                     "report.html", "report.md"]


def test_two_renders_do_not_swap_one_directory_at_once(wh, tmp_path, monkeypatch):
    import tasks.report
    from warehouse.locks import beside_held

    evaluate_run(wh, "r1", ks=(2,), n_boot=0)
    out = tmp_path / "out"
    monkeypatch.setattr(tasks.report, "SWAP_WAIT_SECONDS", 0.0)
    with beside_held(out, busy="held by the test"):
        with pytest.raises(InputError, match=f"another dxr process is swapping a report into {out}: retry"):
            render_report(wh, "r1", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "wh"] and list(out.iterdir()) == []


def test_a_report_file_that_does_not_fit_on_the_disk_is_named(wh, tmp_path):
    # Python's own file write names no file: on a full disk `dxr report` printed "[Errno 28] No space left on
    # device" and not which of its files (or which --out) it could not write.
    import errno

    from dxr.cli import one_line
    from tests.conftest import file_size_limit

    evaluate_run(wh, "r1", ks=(1, 2), n_boot=10)
    with file_size_limit(64), pytest.raises(OSError) as raised:
        render_report(wh, "r1", tmp_path / "out")
    first = tmp_path / "out" / "comparison.png"  # the first file the report writes
    assert (raised.value.errno, raised.value.filename) == (errno.EFBIG, str(first))
    assert one_line(raised.value) == (f"{first}: File too large: raise the file-size limit (ulimit -f) or "
                                     "choose another location (--data-dir, DXR_DATA_DIR, TMPDIR)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "wh"] and list((tmp_path / "out").iterdir()) == []

def test_cli_evaluate_prints_table_and_report_writes_files(wh, tmp_path):
    write_rankings(wh, "r5", rankings=FORECASTABLE, status=FORECASTABLE_STATUS)
    runner = CliRunner()
    result = runner.invoke(main, ["--data-dir", str(wh.root), "evaluate", "--run", "r5", "--k", "2",
                                  "--bootstrap", "0", "--systems", "global_frequency,repeat_history"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["run", "system", "K", "n", "n_runs", "micro-F1", "R@K", "P@K"]
    # Hand-computed in test_metrics: s1 micro-F1 0.5, R@2 4/9, P@2 0.5; s2 0.5, 5/9, 0.5.
    assert lines[1].split() == ["r5", "global_frequency", "2", "3", "1", "0.500", "0.444", "0.500"]
    assert lines[2].split() == ["r5", "repeat_history", "2", "3", "1", "0.500", "0.556", "0.500"]
    assert [line.split()[2] for line in lines[3:]] == ["|C|", "|C|"]
    stored = wh.read("metrics", run_id="r5")
    assert set(stored["system"]) == set(FORECASTABLE) and set(stored["n_runs"]) == {1}

    out = tmp_path / "rep"
    result = runner.invoke(main, ["--data-dir", str(wh.root), "report", "--run", "r5", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [f"report: {out / 'report.html'}", f"markdown: {out / 'report.md'}"]
    assert (out / "report.html").is_file() and (out / "report.md").is_file()


def test_cli_evaluate_says_how_many_lists_were_short_or_failed(wh):
    # spec/evaluation.md §1: an explicitly short or failed list is scored with the hits it has, "reporting how
    # many". s2's T2 list is recorded short (one code at K = 2); the printed table alone showed only its lower
    # scores. s1 and the oracle's lists are all complete and go unnamed.
    write_rankings(wh, "r2", rankings={"s3": {T1: [A, B], T2: [], T3: [E]}},
                   status={("s3", T2): "failed", ("s3", T3): "short"})
    runner = CliRunner()
    for run_id, counts in (("r1", "s2 1 short"), ("r2", "s3 1 short, 1 failed")):
        result = runner.invoke(main, ["--data-dir", str(wh.root), "evaluate", "--run", run_id, "--k", "2",
                                      "--bootstrap", "0"])
        assert result.exit_code == 0, result.output
        assert result.stderr.splitlines()[-1] == (
            f"note: run {run_id}: lists recorded short or failed (ranking_status) are scored with the hits they have "
            f"over the same denominators (K): {counts} (see evaluation_coverage)")
        assert "note" not in result.stdout
    write_rankings(wh, "r3", rankings={"global_frequency": {T1: [A, B], T2: [A, D], T3: [E, X]}}, status={})
    result = runner.invoke(main, ["--data-dir", str(wh.root), "evaluate", "--run", "r3", "--k", "2", "--bootstrap",
                                  "0", "--systems", "global_frequency"])
    assert result.exit_code == 0, result.output
    assert "note" not in result.output


def test_a_run_over_train_patients_is_called_in_sample_by_evaluate_and_the_report(wh):
    # The MIMIC-III demo has no held_out trajectory, so its documented run is `--split all`: 12 of its 14
    # trajectories are train patients', whose targets the learned systems trained on. Neither the printed table
    # nor the report said so, and its transition model's R@20 of 0.843 read as a result.
    runner = CliRunner()
    evaluate = ["--data-dir", str(wh.root), "evaluate", "--run", "r1", "--k", "2", "--bootstrap", "0"]
    result = runner.invoke(main, evaluate)
    assert result.exit_code == 0, result.output
    assert "in-sample" not in result.output and "In-sample" not in to_markdown(build_report(wh, "r1"))

    trajectories = wh.read("trajectories", cohort_id=COHORT)
    wh.write("trajectories", trajectories.with_columns(
        split=pl.when(pl.col("trajectory_id") == T3).then(pl.lit("held_out")).otherwise(pl.lit("train"))),
        cohort_id=COHORT)
    note = ("2 of the 3 trajectories are of train-split patients (train 2, held_out 1): the learned systems, and the "
            "train-split frequency list that pads other lists, were fit on their records, targets included, so "
            "scores on them are in-sample; only held_out trajectories (forecast --split held_out) score patients no "
            "system learned from")
    result = runner.invoke(main, evaluate)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[-1] == f"note: run r1: {note}"
    assert "note" not in result.stdout
    markdown = to_markdown(build_report(wh, "r1"))
    assert f"\n\nIn-sample: {note}.\n\n## Run registry" in markdown
    # `dxr report` repeats it on stderr, as its other notes: a scheduled report's reader saw it in the file only.
    result = runner.invoke(main, ["--data-dir", str(wh.root), "report", "--run", "r1"])
    assert result.exit_code == 0, result.output
    assert result.stderr == f"note: run r1: {note}\n"


def test_the_in_sample_note_of_a_cohort_without_held_out_trajectories_suggests_no_held_out_run(wh):
    # The MIMIC-III demo's cohort has 12 train and 2 tuning trajectories and none in held_out: the note told the
    # user to forecast `--split held_out`, which finds nothing to forecast there.
    wh.write("trajectories", wh.read("trajectories", cohort_id=COHORT).with_columns(
        split=pl.when(pl.col("trajectory_id") == T3).then(pl.lit("tuning")).otherwise(pl.lit("train"))),
        cohort_id=COHORT)
    note = ("2 of the 3 trajectories are of train-split patients (train 2, tuning 1): the learned systems, and the "
            "train-split frequency list that pads other lists, were fit on their records, targets included, so "
            "scores on them are in-sample; the cohort has no held_out trajectory, so no run of it scores patients "
            "no system learned from: a larger extract, or another split of its patients (the MIMIC importers' "
            "--seed), can give it held_out patients")
    result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "evaluate", "--run", "r1", "--k", "2",
                                       "--bootstrap", "0"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[-1] == f"note: run r1: {note}"
    assert f"\n\nIn-sample: {note}.\n\n## Run registry" in to_markdown(build_report(wh, "r1"))


def test_an_evaluation_an_earlier_dxr_computed_is_named_by_the_report_until_it_is_taken_again(wh, tmp_path):
    # A warehouse kept across an upgrade keeps its evaluations: one made by ff794fa's dxr held paired rows whose sign
    # test counted F1 summands for recall at k = 0 (ehr_prior - oracle: 37 patients improved, 2 worsened, where this
    # dxr counts 0 and 38), and the report showed them under today's definitions without a word.
    from tasks.evaluate import EVALUATION_RULE_VERSION
    from warehouse.runs import EVALUATE_KIND

    report = ["--data-dir", str(wh.root), "report", "--run", "r1", "--out", str(tmp_path / "out")]
    evaluate_run(wh, "r1", ks=(2,), n_boot=0)
    row = wh.read("runs", run_id="r1", kind=EVALUATE_KIND)
    recorded = json.loads(row["config_json"][0])
    assert recorded["evaluation_rule_version"] == EVALUATION_RULE_VERSION
    result = CliRunner().invoke(main, report)
    assert result.exit_code == 0, result.output
    assert not result.stderr and "Earlier evaluation rules" not in to_markdown(build_report(wh, "r1"))

    del recorded["evaluation_rule_version"]  # the registry row as a dxr from before the version wrote it
    wh.write("runs", row.with_columns(config_json=pl.lit(json.dumps(recorded)), code_version=pl.lit("0.1.0+ff794fa")),
             run_id="r1", kind=EVALUATE_KIND)
    note = ("its evaluation was computed by dxr 0.1.0+ff794fa before evaluation rules were versioned, not by this "
            f"dxr's version {EVALUATION_RULE_VERSION}: its metrics, paired comparisons and headroom may differ from "
            "what `dxr evaluate --run r1` computes now")
    result = CliRunner().invoke(main, report)
    assert result.exit_code == 0, result.output
    assert result.stderr == f"note: run r1: {note}\n"
    assert f"\n\nEarlier evaluation rules: {note}.\n\n## Run registry" in to_markdown(build_report(wh, "r1"))

    evaluate_run(wh, "r1", ks=(2,), n_boot=0)
    assert "Earlier evaluation rules" not in to_markdown(build_report(wh, "r1"))


def test_the_report_of_a_mean_over_in_sample_runs_calls_it_in_sample(wh):
    # A mean over repeated runs has no trajectories of its own: its report said nothing of the train patients
    # whose targets the runs it averages were scored on.
    from datetime import datetime

    from tasks.evaluate import evaluate_repeated
    from warehouse.runs import record_run

    wh.write("trajectories", wh.read("trajectories", cohort_id=COHORT).with_columns(split=pl.lit("train")),
             cohort_id=COHORT)
    write_rankings(wh, "r1", rankings=FORECASTABLE, status=FORECASTABLE_STATUS)
    write_rankings(wh, "r9", rankings={"global_frequency": {T1: [B, C], T2: [D, A], T3: [E, X]}}, status={})
    for run_id in ("r1", "r9"):
        record_run(wh, run_id, COHORT, "forecast:global_frequency", {"k": 2}, "finished", datetime(2026, 1, 1),
                   datetime(2026, 1, 1))
    config_id = evaluate_repeated(wh, ["r1", "r9"], systems=["global_frequency"], ks=(2,), n_boot=0)["run_id"][0]
    assert "\n\nIn-sample: 3 of the 3 trajectories are of train-split patients (train 3): " in to_markdown(
        build_report(wh, config_id))
    result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "report", "--run", config_id])
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith(f"note: run {config_id}: 3 of the 3 trajectories are of train-split patients "
                                    "(train 3): ") and result.stderr.count("\n") == 1
    # `dxr evaluate` over both runs says it once, naming both, not once per run.
    result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "evaluate", "--run", "r1", "--run", "r9",
                                       "--k", "2", "--bootstrap", "0", "--systems", "global_frequency"])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith("note: runs r1, r9: 3 of the 3 trajectories are of train-split")


def test_a_report_without_bootstrap_or_natural_k_claims_neither(wh):
    # Evaluated with --bootstrap 0 --no-natural, the page said "with 95% intervals", "a − b [95% CI]" and
    # "(|C| = each system's whole list)" of values that have no interval and a K that was not evaluated.
    evaluate_run(wh, "r1", ks=(2,), n_boot=0, natural=False)
    markdown = to_markdown(build_report(wh, "r1"))
    assert "K values: 2. No bootstrap intervals were computed." in markdown
    assert "*micro-F1 and R@K at K=2 (no bootstrap intervals).*" in markdown
    assert "| a | b | micro-F1 a | micro-F1 b | a − b | improved |" in markdown
    assert "95%" not in markdown and "|C|" not in markdown
    # The subset tables say which metric and K they hold, and the ICD version columns have a heading that names them.
    assert "## New-onset vs repeated target codes, and ICD version\n\nR@K at K = 2. " in markdown
    assert "## Recall by code frequency in the train split\n\nR@K at K = 2. " in markdown
    evaluate_run(wh, "r1", ks=(2,), n_boot=20)
    markdown = to_markdown(build_report(wh, "r1"))
    assert "(|C| = each system's whole list)" in markdown
    assert "*micro-F1 and R@K at K=2 with 95% intervals.*" in markdown
    assert "a − b [95% CI]" in markdown


def test_the_report_says_what_native_share_counts(wh):
    evaluate_run(wh, "r1", ks=(2,), n_boot=0)
    assert ("native share = the share of the top-K codes that the system ranked itself; the rest pad its list from "
            "the train-split frequency list.") in to_markdown(build_report(wh, "r1"))


def test_cli_rejects_bad_k_and_silent_short(wh):
    runner = CliRunner()
    result = runner.invoke(main, ["--data-dir", str(wh.root), "evaluate", "--run", "r1", "--k", "two"])
    assert result.exit_code == 2 and "'two' is not a list of comma-separated integers" in result.output
    write_rankings(wh, "r2", rankings={"s3": {T1: [A, B], T2: [D], T3: [E, X]}}, status={})
    result = runner.invoke(main, ["--data-dir", str(wh.root), "evaluate", "--run", "r2", "--k", "2"])
    assert result.exit_code == 1
    assert f"Error: run 'r2', system 's3', trajectory '{T2}' ranks 1 code(s) < K=2" in result.output


def test_cli_names_a_system_forecast_on_fewer_trajectories_than_the_others_of_its_run(wh):
    # transition forecast with --limit 1 into a run whose global_frequency covers three trajectories: it has no list
    # and no status for two of them, which was reported as if its output were short ("fix the system's output").
    write_rankings(wh, "r3", rankings={"global_frequency": {T1: [A, B], T2: [D, A], T3: [E, X]},
                                       "transition": {T1: [A, B]}}, status={})
    result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "evaluate", "--run", "r3", "--k", "2"])
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        "evaluating run r3 (K=2, bootstrap 1000) …",
        f"Error: run 'r3': system 'transition' was not forecast for 2 of the run's 3 trajectories (e.g. '{T2}'), which "
        "another system of the run was (another --split, --limit or --subject-id); a run's systems are evaluated on "
        "the same trajectories: evaluate the others alone (--systems global_frequency,oracle), or forecast transition "
        "with the others' options under a new run id"]
    result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "evaluate", "--run", "r3", "--k", "2",
                                       "--bootstrap", "0", "--systems", "global_frequency,oracle"])
    assert result.exit_code == 0, result.output
    # Two systems on different patients: neither alone covers the run, so only a new run id helps.
    write_rankings(wh, "r4", rankings={"s4": {T1: [A, B]}, "s5": {T2: [D, A]}}, status={})
    result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "evaluate", "--run", "r4", "--k", "2"])
    assert result.output.splitlines() == [
        "evaluating run r4 (K=2, bootstrap 1000) …",
        f"Error: run 'r4': system 's4' was not forecast for 1 of the run's 2 trajectories (e.g. '{T2}'), which another "
        "system of the run was (another --split, --limit or --subject-id); a run's systems are evaluated on the same "
        "trajectories: forecast s4 with the others' options under a new run id"]


def test_report_of_repeated_runs_aggregate(wh, tmp_path):
    from datetime import datetime

    from tasks.evaluate import evaluate_repeated
    from warehouse.runs import record_run

    write_rankings(wh, "r9", rankings={"s1": {T1: [B, C], T2: [D, A], T3: [E, X]}}, status={})
    for run_id in ("r1", "r9"):
        record_run(wh, run_id, COHORT, "forecast:s1", {"k": 2}, "finished", datetime(2026, 1, 1), datetime(2026, 1, 1))
    config_id = evaluate_repeated(wh, ["r1", "r9"], systems=["s1"], ks=(2,), n_boot=50)["run_id"][0]
    text = render_report(wh, config_id, tmp_path / "agg").read_text()
    assert "Values are means of 2 repeated runs of one configuration." in text
    # The mean has no rankings of its own; its K-sweep averages its runs' sweeps, so at K = 2 it meets the stored
    # means (mean of run-level metrics) and at K = 1 the mean of the two runs' own values.
    assert text.count("data:image/png;base64,") == 4 and "K-sweep 1..2 (point values; means over the 2 runs)." in text
    sweep = mean_k_sweep(wh, ["r1", "r9"], ["s1"], 2)
    stored = wh.read("metrics", run_id=config_id).filter((pl.col("subset") == "all") & (pl.col("k") == 2))
    joined = stored.join(sweep, on=["system", "subset", "k", "metric"], suffix="_sweep")
    assert joined.height == stored.height == 6 and (joined["value"] - joined["value_sweep"]).abs().max() < 1e-12
    runs_at_1 = pl.concat([k_sweep(wh, run_id, ["s1"], 1) for run_id in ("r1", "r9")])
    expected = runs_at_1.group_by("metric").agg(pl.col("value").mean()).sort("metric")
    assert sweep.filter(pl.col("k") == 1).select("metric", "value").sort("metric").equals(expected)


def test_the_report_of_a_mean_over_repeated_runs_shows_its_short_failed_and_native_share(wh, tmp_path):
    from datetime import datetime

    from tasks.evaluate import evaluate_repeated
    from warehouse.runs import record_run

    # r1: s2 is explicitly short on T2 (one code), every code native. r9: s2 failed on T3 (no list), and pads T1's
    # second code, so its native share at K = 2 is 3 of 4 top-2 rows.
    write_rankings(wh, "r9", rankings={"s2": {T1: [B, X], T2: [A, D]}}, status={}, padding={("s2", T1, X)})
    failed = pl.DataFrame({"run_id": "r9", "system": "s2", "trajectory_id": [T3], "status": "failed", "detail": None},
                          schema_overrides={"detail": pl.String})
    wh.write("ranking_status", failed, run_id="r9", system="s2", shard=1)
    for run_id in ("r1", "r9"):
        record_run(wh, run_id, COHORT, "forecast:s2", {"k": 2}, "finished", datetime(2026, 1, 1), datetime(2026, 1, 1))
    evaluate_repeated(wh, ["r1", "r9"], systems=["s2"], ks=(2,), n_boot=0, natural=False, run_id="mean-s2")
    coverage = wh.read("evaluation_coverage", run_id="mean-s2")
    assert coverage.select("system", "k", "n_trajectories", "n_short", "n_failed", "n_below_k",
                           "native_share").rows() == [("s2", 2, 3, 1, 1, 2, (1.0 + 0.75) / 2)]
    markdown = to_markdown(build_report(wh, "mean-s2"))
    # short: T2 of r1; failed: T3 of r9, which has no list and is not counted as short too
    assert "| s2 | 0.500 | 0.500 | 0.500 | 0.478 | 3 | 1 | 1 | 0.875 |" in markdown
    assert ("Over the 2 runs: short and failed count the lists of every run, and native share is the mean of the "
            "runs' shares.") in markdown


def test_prefect_task_wrappers_call_the_stage_functions(wh, tmp_path):
    from tasks.evaluate import evaluate_run_task
    from tasks.report import render_report_task

    rows = evaluate_run_task.fn(str(wh.root), "r1", ks=(2,), n_boot=0)
    assert rows == wh.read("metrics", run_id="r1").height > 0
    assert render_report_task.fn(str(wh.root), "r1", str(tmp_path / "t")) == str(tmp_path / "t" / "report.html")


def test_cli_evaluates_repeats_of_one_configuration(wh):
    from datetime import datetime

    from warehouse.runs import record_run

    write_rankings(wh, "r1", rankings=FORECASTABLE, status=FORECASTABLE_STATUS)
    write_rankings(wh, "r9", rankings={"global_frequency": {T1: [B, C], T2: [D, A], T3: [E, X]}}, status={})
    for run_id in ("r1", "r9"):
        record_run(wh, run_id, COHORT, "forecast:global_frequency", {"k": 2, "run_id": run_id}, "finished",
                   datetime(2026, 1, 1), datetime(2026, 1, 1))
    result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "evaluate", "--run", "r1", "--run", "r9",
                                       "--systems", "global_frequency", "--k", "2", "--bootstrap", "0", "--no-natural"])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    # r1: micro-F1 0.5, R@2 4/9, P@2 0.5; r9 hits T1 {B, C}, T2 {D, A}, T3 {E}: 5/6, 8/9, 5/6; means below.
    assert rows[0] == ["r1", "global_frequency", "2", "3", "1", "0.500", "0.444", "0.500"]
    assert rows[1] == ["r9", "global_frequency", "2", "3", "1", "0.833", "0.889", "0.833"]
    assert rows[2][0].startswith("config-") and rows[2][1:] == ["global_frequency", "2", "3", "2", "0.667", "0.667",
                                                                "0.667"]


def test_cli_repeats_with_an_oracle_among_the_systems(wh):
    # Each run is scored with the oracle too; the mean over runs is of the forecasting system alone (the oracle
    # is the same gold list in every run and no forecast configures it), not a registry error after the work.
    from datetime import datetime

    from warehouse.runs import record_run

    write_rankings(wh, "r1", rankings=FORECASTABLE, status=FORECASTABLE_STATUS)
    write_rankings(wh, "r9", rankings={"global_frequency": {T1: [B, C], T2: [D, A], T3: [E, X]},
                                       "repeat_history": {T1: [B, C], T2: [X], T3: [E, X]}},
                   status={("repeat_history", T2): "short"})
    for run_id in ("r1", "r9"):
        for system in FORECASTABLE:
            record_run(wh, run_id, COHORT, f"forecast:{system}", {"k": 2, "run_id": run_id}, "finished",
                       datetime(2026, 1, 1), datetime(2026, 1, 1))
    args = ["--data-dir", str(wh.root), "evaluate", "--run", "r1", "--run", "r9", "--k", "2", "--bootstrap", "0",
            "--no-natural", "--systems"]
    result = CliRunner().invoke(main, args + ["global_frequency,oracle"])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    assert [(r[0][:7], r[1], r[4]) for r in rows] == [
        ("r1", "global_frequency", "1"), ("r1", "oracle", "1"), ("r9", "global_frequency", "1"), ("r9", "oracle", "1"),
        ("config-", "global_frequency", "2")]
    result = CliRunner().invoke(main, args + ["oracle"])
    assert result.exit_code == 2  # options that do not go together
    assert result.output.startswith("Error: --systems oracle names only gold-side oracles, which are the same")


def test_a_report_is_a_function_of_the_warehouse_not_of_the_clock(wh, tmp_path, monkeypatch):
    # Rendered again an hour later from the same stored evaluation, every file is the same bytes: the page
    # can be diffed or checked in, and says when its evaluation ran in its run registry table instead.
    from datetime import datetime, timezone

    evaluate_run(wh, "r1", ks=(1, 2), n_boot=20)
    render_report(wh, "r1", tmp_path / "first")

    class AnHourLater(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.now(tz) + (datetime(2000, 1, 1, 1) - datetime(2000, 1, 1))

    assert AnHourLater.now(timezone.utc) > datetime.now(timezone.utc)
    monkeypatch.setattr("tasks.report.datetime", AnHourLater, raising=False)
    render_report(wh, "r1", tmp_path / "second")
    first = sorted(p.name for p in (tmp_path / "first").iterdir())
    assert first == sorted(p.name for p in (tmp_path / "second").iterdir())
    assert "report.md" in first and "report.html" in first
    for name in first:
        assert (tmp_path / "first" / name).read_bytes() == (tmp_path / "second" / name).read_bytes(), name


def test_a_mean_over_repeated_runs_is_refused_once_one_of_their_forecasts_ran_again(wh, tmp_path):
    from datetime import datetime

    from dxr.errors import InputError
    from tasks.evaluate import evaluate_repeated
    from warehouse.runs import mark_stale, record_run

    write_rankings(wh, "r9", rankings={"s1": {T1: [B, C], T2: [D, A], T3: [E, X]}}, status={})
    for run_id in ("r1", "r9"):
        record_run(wh, run_id, COHORT, "forecast:s1", {"k": 2}, "finished", datetime(2026, 1, 1), datetime(2026, 1, 1))
    config_id = evaluate_repeated(wh, ["r1", "r9"], systems=["s1"], ks=(2,), n_boot=0)["run_id"][0]
    assert render_report(wh, config_id, tmp_path / "before").is_file()

    # s1 of r9 is forecast again after the mean was taken; its new lists hit nothing.
    record_run(wh, "r9", COHORT, "forecast:s1", {"k": 2}, "running", datetime.now())
    with pytest.raises(InputError, match=f"the mean over repeated runs '{config_id}' is out of date \\(the "
                                         "forecast:s1 run of 'r9' is running\\): run `dxr evaluate --run r1 --run r9`"):
        render_report(wh, config_id, tmp_path / "during")
    write_rankings(wh, "r9", rankings={"s1": {T1: [X, D], T2: [X, B], T3: [X, A]}}, status={})
    record_run(wh, "r9", COHORT, "forecast:s1", {"k": 2}, "finished", datetime.now(), datetime.now())
    with pytest.raises(InputError, match="forecast:s1 run of 'r9' finished at .*, after the mean was taken"):
        render_report(wh, config_id, tmp_path / "after")
    assert not (tmp_path / "during").exists() and not (tmp_path / "after").exists()

    # Taken again, the mean is of r1's micro-F1@2 0.5 (test_metrics) and r9's new 0.
    evaluate_repeated(wh, ["r1", "r9"], systems=["s1"], ks=(2,), n_boot=0)
    stored = wh.read("metrics", run_id=config_id).filter((pl.col("metric") == "micro_f1") & (pl.col("k") == 2)
                                                         & (pl.col("subset") == "all"))
    assert stored["value"].to_list() == [0.25]
    assert "| s1 | 0.250 | " in (render_report(wh, config_id, tmp_path / "again").parent / "report.md").read_text()
    # A mean killed among its writes stays stale; the fix names the runs it averages, not its own id.
    mark_stale(wh, config_id, "evaluate")
    with pytest.raises(InputError, match=f"the evaluation of run '{config_id}' is stale .*: run `dxr evaluate --run r1 "
                                         "--run r9` again"):
        render_report(wh, config_id, tmp_path / "killed")


def test_an_out_of_date_named_mean_says_to_take_it_again_under_its_run_id(wh, tmp_path):
    from datetime import datetime

    from dxr.errors import InputError
    from tasks.evaluate import evaluate_repeated
    from warehouse.runs import mark_stale, record_run

    write_rankings(wh, "r9", rankings={"s1": {T1: [B, C], T2: [D, A], T3: [E, X]}}, status={})
    for run_id in ("r1", "r9"):
        record_run(wh, run_id, COHORT, "forecast:s1", {"k": 2}, "finished", datetime(2026, 1, 1), datetime(2026, 1, 1))
    evaluate_repeated(wh, ["r1", "r9"], systems=["s1"], ks=(2,), n_boot=0, run_id="seeds")
    assert render_report(wh, "seeds", tmp_path / "before").is_file()
    # Without --run-id the mean would go to a config-… id, leaving this one stale.
    mark_stale(wh, "seeds", "evaluate")
    with pytest.raises(InputError, match="^the evaluation of run 'seeds' is stale .*: run `dxr evaluate --run r1 "
                                         "--run r9 --run-id seeds` again, then the report$"):
        render_report(wh, "seeds", tmp_path / "stale")


def test_the_report_of_a_named_mean_shows_its_paired_comparisons(wh, tmp_path):
    from datetime import datetime

    from tasks.evaluate import evaluate_repeated
    from warehouse.runs import record_run

    write_rankings(wh, "r9", rankings={"s1": {T1: [B, C], T2: [D, A], T3: [E, X]}, "s2": RANKINGS["s2"]})
    for run_id in ("r1", "r9"):
        for system in ("s1", "s2"):
            record_run(wh, run_id, COHORT, f"forecast:{system}", {"k": 2}, "finished", datetime(2026, 1, 1),
                       datetime(2026, 1, 1))
    evaluate_repeated(wh, ["r1", "r9"], ks=(2,), n_boot=50, run_id="seeds")
    paired = wh.read("paired_comparisons", run_id="seeds")
    [row] = paired.filter((pl.col("subset") == "all") & (pl.col("metric") == "micro_f1") & (pl.col("k") == 2)).rows(
        named=True)
    markdown = (render_report(wh, "seeds", tmp_path / "out").parent / "report.md").read_text()
    assert "## Paired comparisons (micro-F1 at K = 2, same patients)" in markdown
    assert "Difference of the means over the 2 runs, a − b, with a paired bootstrap interval" in markdown
    assert (f"| s1 | s2 | {row['value_a']:.3f} | {row['value_b']:.3f} | {row['difference']:.3f} "
            f"[{row['ci_low']:.3f}, {row['ci_high']:.3f}] | {row['n_improved']} | {row['n_worsened']} | "
            f"{row['n_tied']} | {row['sign_test_p']:.3g} |") in markdown


def test_a_first_mean_under_its_run_id_cut_short_among_its_writes_is_refused_by_the_report(wh, tmp_path, monkeypatch):
    # The first mean under an id had no `runs` row for its writes to mark stale: cut short after one system's
    # metrics, it left them unregistered, and the report showed that system alone as the mean.
    from datetime import datetime

    from dxr.errors import InputError
    from tasks.evaluate import evaluate_repeated
    from warehouse.runs import record_run

    write_rankings(wh, "r9")  # as r1: s1 and s2
    for run_id in ("r1", "r9"):
        for system in ("s1", "s2"):
            record_run(wh, run_id, COHORT, f"forecast:{system}", {"k": 2}, "finished", datetime(2026, 1, 1),
                       datetime(2026, 1, 1))
    systems_written = metrics_fill_the_disk_at_the_second_system(monkeypatch, "seeds")
    with pytest.raises(OSError):
        evaluate_repeated(wh, ["r1", "r9"], systems=["s1", "s2"], ks=(2,), n_boot=0, run_id="seeds")
    monkeypatch.undo()
    assert len(systems_written) == 1 and set(wh.read("metrics", run_id="seeds")["system"]) == set(systems_written)
    with pytest.raises(InputError, match="^the evaluation of run 'seeds' is stale .*: run `dxr evaluate --run r1 "
                                         "--run r9 --run-id seeds` again, then the report$"):
        render_report(wh, "seeds", tmp_path / "cut")
    assert not (tmp_path / "cut").exists()
    evaluate_repeated(wh, ["r1", "r9"], systems=["s1", "s2"], ks=(2,), n_boot=0, run_id="seeds")
    assert "| s2 | " in (render_report(wh, "seeds", tmp_path / "whole").parent / "report.md").read_text()


def test_a_first_evaluation_cut_short_among_its_writes_is_refused_by_the_report(wh, tmp_path, monkeypatch):
    # A run's first evaluation had no `runs` row for its writes to mark stale: cut short after one system's
    # metrics, it left them unregistered, and the report showed that system alone as the run's evaluation.
    systems_written = metrics_fill_the_disk_at_the_second_system(monkeypatch, "r1")
    with pytest.raises(OSError):
        evaluate_run(wh, "r1", ks=(2,), n_boot=0)
    monkeypatch.undo()
    assert len(systems_written) == 1 and set(wh.read("metrics", run_id="r1")["system"]) == set(systems_written)
    with pytest.raises(InputError, match=r"^the evaluation of run 'r1' is stale \(a system was forecast into the "
                                         r"run since, anew or again, or its writes were cut short\): run "
                                         r"`dxr evaluate --run r1` again, then the report$"):
        render_report(wh, "r1", tmp_path / "cut")
    assert not (tmp_path / "cut").exists()
    evaluate_run(wh, "r1", ks=(2,), n_boot=0)
    assert wh.read("runs", run_id="r1", kind="evaluate")["status"].to_list() == ["finished"]
    assert render_report(wh, "r1", tmp_path / "whole").is_file()


def metrics_fill_the_disk_at_the_second_system(monkeypatch, run_id: str) -> list[str]:
    """Make the second system's `metrics` write of `run_id` fail as a full disk does; returns the systems written."""
    write, systems_written = Warehouse.write, []

    def full_disk_at_the_second_system(self, table, frame, **keys):
        if table == "metrics" and keys.get("run_id") == run_id:
            if systems_written:
                raise OSError(28, "No space left on device")
            systems_written.append(keys["system"])
        return write(self, table, frame, **keys)

    monkeypatch.setattr(Warehouse, "write", full_disk_at_the_second_system)
    return systems_written
