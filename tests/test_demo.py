"""`dxr demo` end to end on the default synthetic dataset: table, realism bands, report, idempotent rerun.

This is the README's main job, so CI runs it at full default size (5,000 patients), but for the LLM sample: the
embedded model takes about a minute a patient, and one patient goes through the same plumbing as the README's four.
"""

from __future__ import annotations

import polars as pl
from click.testing import CliRunner

from dxr.cli import main

LLM_SAMPLE = 1


def test_demo_prints_metrics_and_realism_bands_and_reruns_cleanly(tmp_path, prefect_harness, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default data dir ./data must land in the test's folder
    demo = ["demo", "--run-id", "demo-test", "--llm-sample", str(LLM_SAMPLE)]
    result = CliRunner().invoke(main, demo, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    out = result.output
    for header in ("system", "P@10", "R@10", "P@20", "R@20"):
        assert header in out
    for system in ("oracle", "record_oracle", "global_frequency", "repeat_history", "ehr_prior"):
        assert system in out
    # The LLM sample: Direct Forecast with the embedded model and Union + RRF on the same patients.
    llm_part = out.split("LLM sample (local backend")[1]
    assert f": {LLM_SAMPLE} held_out patient, run demo-test-llm\n" in llm_part  # one patient, not 'patients'
    for system in ("direct", "rrf_prior_direct", "ehr_prior"):
        assert f"\n{system} " in llm_part
    assert "ranking status: direct " in llm_part
    assert "Realism bands" in out and "false" not in out.split("Realism bands")[1].lower()
    report = tmp_path / "data" / "reports" / "demo-test" / "report.html"
    assert f"report: {report}" in out and report.is_file()

    from warehouse.store import Warehouse

    wh = Warehouse(tmp_path / "data")
    first_calls = wh.read("llm_calls", run_id="demo-test-llm")
    # Every patient's requests reached the model; only a re-ask identical to one the run already sent (the
    # quote of an invalid reply dropped to fit the budget) is answered from the run's own cache.
    asked = first_calls.filter(~pl.col("cache_hit"))
    assert first_calls["trajectory_id"].n_unique() == LLM_SAMPLE
    assert set(asked["trajectory_id"]) == set(first_calls["trajectory_id"])
    assert (first_calls["backend"] == "local").all() and (asked["tokens_out"] > 0).all()
    con = wh.connect()
    rows = con.execute("SELECT count(*), count(DISTINCT (run_id, system, trajectory_id, rank)) "
                       "FROM rankings").fetchall()
    metrics = wh.read("metrics").sort(pl.all())
    # A rerun reuses the dataset and replaces its own partitions: no duplicates, same numbers.
    again = CliRunner().invoke(main, demo, catch_exceptions=False)
    assert again.exit_code == 0, again.output
    assert Warehouse(tmp_path / "data").connect().execute(
        "SELECT count(*), count(DISTINCT (run_id, system, trajectory_id, rank)) FROM rankings").fetchall() == rows
    assert rows[0][0] == rows[0][1]
    # The rerun's LLM answers all come from the response cache: no request reaches the model.
    again_calls = wh.read("llm_calls", run_id="demo-test-llm")
    assert again_calls.height == first_calls.height and again_calls["cache_hit"].all()
    assert wh.read("metrics").sort(pl.all()).drop("value", "ci_low", "ci_high").equals(
        metrics.drop("value", "ci_low", "ci_high"))
    assert wh.read("metrics").sort(pl.all())["value"].to_list() == metrics["value"].to_list()


def test_a_violated_band_is_named_with_its_value_range_and_fix():
    from dxr.cli.demo import band_violation

    realism = pl.DataFrame({"band": ["mean_target_size", "oracle_r20"], "value": [9.5, 0.5321],
                            "low": [8.0, 0.55], "high": [20.0, 0.85], "within_band": [True, False]})
    assert band_violation(realism, 200) == (
        "realism band violated: oracle_r20 0.532 outside [0.55, 0.85]; the bands are set for 5,000 patients "
        "and 200 give noisy statistics: rerun with --patients 5000")
    assert band_violation(realism, 5000) == (
        "realism band violated: oracle_r20 0.532 outside [0.55, 0.85]; the generator no longer produces the "
        "cohort its bands describe: see docs/synthetic.md#realism-bands")


def test_the_headline_table_shows_each_metric_with_its_interval_and_leaves_a_missing_one_blank():
    from dxr.cli.demo import headline_table

    rows = [("oracle", "precision_at_k", 10, 0.41234, 0.4, 0.425), ("oracle", "recall_at_k", 10, 0.5, None, None),
            ("oracle", "precision_at_k", 20, 0.3, 0.25, 0.35), ("oracle", "recall_at_k", 20, 0.6, 0.55, 0.65),
            ("oracle", "recall_at_k", 20, 0.9, 0.8, 1.0)]  # the last one is the `new` subset's
    metrics = pl.DataFrame([(s, "new" if i == 4 else "all", m, k, v, lo, hi, 332) for i, (s, m, k, v, lo, hi)
                            in enumerate(rows)],
                           schema=["system", "subset", "metric", "k", "value", "ci_low", "ci_high", "n"], orient="row")
    metrics = pl.concat([metrics, metrics.filter(pl.col("metric") == "recall_at_k", pl.col("k") == 10)
                        .with_columns(system=pl.lit("global_frequency"), value=pl.lit(0.172))])
    assert headline_table(metrics).splitlines() == [
        "system            P@10                  R@10   P@20                  R@20                  n",
        "----------------  --------------------  -----  --------------------  --------------------  ---",
        "global_frequency                        0.172                                              332",
        "oracle            0.412 [0.400, 0.425]  0.500  0.300 [0.250, 0.350]  0.600 [0.550, 0.650]  332",
        "(2 rows)"]
