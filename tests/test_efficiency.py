"""Efficiency telemetry (spec/evaluation.md §6) on a tiny hand-written run: exact per-patient values."""

from __future__ import annotations

from datetime import datetime, timedelta

import polars as pl
import pyarrow.parquet as pq
import pytest

from models.llm.config import ModelPrice
from models.llm.telemetry import call_costs
from tasks.efficiency import efficiency_notes, run_efficiency
from tasks.evaluate import evaluate_run
from tasks.forecast import clear_outputs
from tasks.report import build_report, render_report, to_markdown
from test_metrics import A, B, COHORT, D, E, T1, T2, T3, X, write_cohort, write_rankings
from tools.ledger import Ledger
from warehouse import store
from warehouse.evidence import search_job_count
from warehouse.run_outputs import calls_written_before_cost, matched_patients, run_llm_calls, run_metric
from warehouse.run_deletion import delete_run
from warehouse.runs import finished_wall_clocks, record_run
from warehouse.schemas import TABLES, utc_now
from warehouse.store import Warehouse

PRICES = {"m": ModelPrice(input=2.0, cached_input=0.5, output=10.0)}
START = datetime(2026, 1, 1)
SYSTEMS = ["direct", "ehr_prior", "global_frequency", "rrf_prior_direct"]
# Every list is shorter than 20 and says so, so the run is evaluable at K = 20 with Σ|Y| = 6, n = 3:
# micro-F1@20 = 2h / (3·20 + 6). direct hits A, B (T1), D (T2), E (T3): h = 4; global_frequency hits A in T2: h = 1.
RANKINGS = {"direct": {T1: [A, B], T2: [D], T3: [E]}, "global_frequency": {T1: [X], T2: [A], T3: [X]},
            "ehr_prior": {T1: [A], T2: [X], T3: [X]}, "rrf_prior_direct": {T1: [A, B], T2: [D, X], T3: [E, X]}}
STATUS = {(system, t): "short" for system in RANKINGS for t in (T1, T2, T3)}
WALL_SECONDS = {"direct": 90, "global_frequency": 9, "ehr_prior": 30, "rrf_prior_direct": 6}


def calls_frame(run_id: str, rows: list[tuple], prices: dict[str, ModelPrice] = PRICES) -> pl.DataFrame:
    """llm_calls rows from (stage, trajectory, tokens in, cached in, out, reasoning, latency ms, cache hit), each
    with its cost at `prices`, the price table of the run that wrote them (as `LLMClient.telemetry` prices them)."""
    schema = pl.from_arrow(TABLES["llm_calls"].schema.empty_table()).schema
    return call_costs(pl.DataFrame([{"call_id": f"c{i}", "run_id": run_id, "stage": r[0], "trajectory_id": r[1],
                          "backend": "openai", "model": "m", "prompt_version": "direct_forecast/1",
                          "tokens_in": r[2], "tokens_cached_in": r[3], "tokens_out": r[4], "tokens_reasoning": r[5],
                          "latency_ms": r[6], "cache_hit": r[7], "status": "ok", "error": None, "truncated_chars": 0}
                         for i, r in enumerate(rows)], schema=schema).drop("cost_usd"), prices)


DIRECT_CALLS = [
    ("direct", T1, 1000, 400, 200, 50, 1000.0, False),
    ("direct", T1, 1200, 1000, 100, 0, 3000.0, False),   # a re-ask of T1
    ("direct", T2, 0, 0, 0, 0, 0.5, True),               # a cache hit: a call, but no backend request
    ("direct", T3, 800, 0, 300, 20, 2000.0, False),
    ("direct", "c1:9:90", 500, 0, 50, 0, 700.0, False),  # not a trajectory of this run
    ("unit", T1, 10, 0, 1, 0, 5.0, False),                # a stage that is no system of the run
]


def write_run(wh: Warehouse, run_id: str, calls: list[tuple], prices: dict[str, ModelPrice] = PRICES) -> None:
    write_rankings(wh, run_id, rankings=RANKINGS, status=STATUS)
    for system, seconds in WALL_SECONDS.items():
        record_run(wh, run_id, COHORT, f"forecast:{system}", {"system": system}, "finished", START,
                   START + timedelta(seconds=seconds))
    frame = calls_frame(run_id, calls, prices)
    for (stage,), part in frame.group_by("stage"):
        wh.write("llm_calls", part, run_id=run_id, stage=stage, shard=0)


@pytest.fixture
def run(tmp_path) -> Warehouse:
    wh = Warehouse(tmp_path / "wh")
    write_cohort(wh)
    write_run(wh, "e1", DIRECT_CALLS)
    evaluate_run(wh, "e1", ks=(20,), n_boot=0, natural=False)
    return wh


def by_system(frame: pl.DataFrame) -> dict[str, dict]:
    return {r["system"]: r for r in frame.iter_rows(named=True)}


def test_llm_numbers_per_patient_with_cached_and_uncached_input_prices(run):
    rows = by_system(run_efficiency(run, "e1", PRICES))
    assert sorted(rows) == SYSTEMS
    direct = rows["direct"]
    # Matched patients T1..T3: four calls (the c1:9:90 and `unit` calls are not this system's).
    assert (direct["patients"], direct["llm_calls"], direct["backend_calls"], direct["cache_hits"]) == (3, 4, 3, 1)
    assert direct["calls_per_patient"] == pytest.approx(4 / 3)
    assert direct["backend_calls_per_patient"] == 1.0
    assert direct["tokens_in_per_patient"] == 1000.0                   # (1000 + 1200 + 800) / 3
    assert direct["tokens_cached_in_per_patient"] == pytest.approx(1400 / 3)
    assert direct["tokens_out_per_patient"] == 200.0                   # (200 + 100 + 300) / 3
    assert direct["tokens_reasoning_per_patient"] == pytest.approx(70 / 3)
    # Uncached input at $2/M, cached at $0.5/M, output at $10/M:
    # (600·2 + 400·0.5 + 200·10) + (200·2 + 1000·0.5 + 100·10) + (800·2 + 300·10)
    # = 3400 + 1900 + 4600 micro-dollars.
    assert direct["cost_usd"] == pytest.approx(9900e-6)
    assert direct["cost_per_patient_usd"] == pytest.approx(3300e-6)
    # Backend latency only: the cache hit's 0.5 ms file read is not a backend call.
    assert (direct["latency_ms_p50"], direct["latency_ms_total"]) == (2000.0, 6000.0)
    assert direct["patients_per_hour_serial"] == pytest.approx(3 * 3600 / 6)
    assert direct["wall_clock_s"] == 90.0 and direct["patients_per_hour"] == pytest.approx(3 * 3600 / 90)
    assert direct["clock"] == "wall clock of forecast:direct; 1 of 4 LLM calls were cache hits"
    assert direct["micro_f1_at_20"] == pytest.approx(8 / 66)
    assert direct["llm_stages"] == "direct" and direct["retrieval"] is False


def test_systems_without_calls_cost_zero_and_fusion_counts_its_inputs(run):
    rows = by_system(run_efficiency(run, "e1", PRICES))
    baseline = rows["global_frequency"]
    assert (baseline["llm_calls"], baseline["calls_per_patient"], baseline["cost_per_patient_usd"]) == (0, 0.0, 0.0)
    assert (baseline["latency_ms_p50"], baseline["patients_per_hour_serial"]) == (None, None)
    assert baseline["patients_per_hour"] == pytest.approx(3 * 3600 / 9)
    assert baseline["micro_f1_at_20"] == pytest.approx(2 / 66)
    assert baseline["queries_per_patient"] == 0.0
    # Union + RRF fuses ehr_prior's and direct's lists: it costs direct's calls and all three clocks.
    fused = rows["rrf_prior_direct"]
    assert (fused["llm_stages"], fused["llm_calls"], fused["cost_per_patient_usd"]) == (
        "direct", 4, pytest.approx(3300e-6))
    assert fused["wall_clock_s"] == 6 + 30 + 90
    assert fused["patients_per_hour"] == pytest.approx(3 * 3600 / 126)
    assert fused["clock"].startswith("summed wall clocks of forecast:rrf_prior_direct + forecast:ehr_prior + "
                                     "forecast:direct")
    assert efficiency_notes(run, "e1") == [
        "1 LLM call(s) of stage(s) unit belong to no system of this run and are not counted.",
        "1 LLM call(s) name trajectories outside the run's matched set and are not counted."]


def test_unknown_price_is_not_zero(run):
    # A run whose price table had no price for its model: a price added to the table since does not make the cost
    # of the calls it made known.
    write_run(run, "e2", DIRECT_CALLS, prices={"other-model": ModelPrice(input=1.0)})
    rows = by_system(run_efficiency(run, "e2", PRICES))
    assert rows["direct"]["cost_usd"] is None and rows["direct"]["cost_per_patient_usd"] is None
    assert rows["global_frequency"]["cost_per_patient_usd"] == 0.0      # no calls: a known zero


def test_the_cost_stored_with_a_call_outlives_a_change_of_the_price_table(run):
    # The run wrote its calls at PRICES; the table has doubled every price since, and lost the model later still.
    doubled = {"m": ModelPrice(input=4.0, cached_input=1.0, output=20.0)}
    for prices in (doubled, {}):
        direct = by_system(run_efficiency(run, "e1", prices))["direct"]
        assert direct["cost_usd"] == pytest.approx(9900e-6)            # as at PRICES (see the test above)


def test_calls_written_before_costs_were_stored_are_priced_at_report_time(run):
    # Shard 0 of direct's calls as dxr wrote it before `cost_usd` existed (a file without the column), shard 1 as
    # written since, at PRICES: only the first is priced from the table of the report.
    write_run(run, "e3", [])
    old = run.write("llm_calls", calls_frame("e3", DIRECT_CALLS[:2]), run_id="e3", stage="direct", shard=0)
    pq.write_table(pq.read_table(old).drop_columns(["cost_usd"]), old)
    new = calls_frame("e3", DIRECT_CALLS[2:4]).with_columns(pl.format("new-{}", "call_id").alias("call_id"))
    run.write("llm_calls", new, run_id="e3", stage="direct", shard=1)
    assert calls_written_before_cost(run, "e3") == ["c0", "c1"]
    doubled = {"m": ModelPrice(input=4.0, cached_input=1.0, output=20.0)}
    # T1's two calls at twice PRICES (2 · (3400 + 1900) micro-dollars), T3's as stored (4600; T2's is a cache hit).
    assert by_system(run_efficiency(run, "e3", doubled))["direct"]["cost_usd"] == pytest.approx(15200e-6)
    # A model the table of the report does not price leaves the old calls' cost unknown, as before.
    assert by_system(run_efficiency(run, "e3", {}))["direct"]["cost_usd"] is None


def test_fully_cached_rerun_has_no_backend_calls_and_no_throughput(run):
    cached = [(stage, t, 0, 0, 0, 0, 0.4, True) for stage, t, *_ in DIRECT_CALLS[:4]]
    write_run(run, "e2", cached, prices={})
    direct = by_system(run_efficiency(run, "e2", {}))["direct"]
    assert (direct["llm_calls"], direct["backend_calls"], direct["cache_hits"]) == (4, 0, 4)
    assert direct["tokens_in_per_patient"] == 0.0 and direct["latency_ms_total"] == 0.0
    # Nothing was sent, so nothing was spent, even for a model without a price.
    assert direct["cost_per_patient_usd"] == 0.0
    assert (direct["patients_per_hour"], direct["patients_per_hour_serial"]) == (None, None)
    assert direct["clock"] == "n/a: all 4 LLM calls were cache hits"


def test_missing_or_unfinished_run_record_gives_no_clock(run):
    record_run(run, "e1", COHORT, "forecast:ehr_prior", {}, "running", START)
    rows = by_system(run_efficiency(run, "e1", PRICES))
    assert rows["ehr_prior"]["patients_per_hour"] is None
    assert rows["ehr_prior"]["clock"] == "n/a: no finished forecast:ehr_prior run registered"
    assert rows["rrf_prior_direct"]["clock"].startswith("n/a: no finished forecast:ehr_prior run registered")
    assert rows["direct"]["patients_per_hour"] == pytest.approx(120.0)


def test_matched_patients_are_what_the_run_ranked_or_gave_a_status(tmp_path):
    wh = Warehouse(tmp_path / "wh")
    # Patient 1 is forecast at two target encounters (`--target every`), patient 2 at one.
    first, second, other = f"{COHORT}:1:10", f"{COHORT}:1:11", f"{COHORT}:2:20"
    write_cohort(wh, targets={first: [A], second: [B], other: [D]}, pretarget={}, train_counts={A: 1})
    write_rankings(wh, "m1", rankings={"direct": {first: [A]}, "ehr_prior": {first: [A], second: [B]}}, status={})
    wh.write("ranking_status", pl.DataFrame({"run_id": "m1", "system": "direct", "trajectory_id": [other],
                                             "status": "failed", "detail": "no valid reply"}),
             run_id="m1", system="direct", shard=1)  # a failed trajectory: a status without a list
    write_rankings(wh, "m2", rankings={"global_frequency": {other: [A]}}, status={})
    assert matched_patients(wh.connect(), "m1").rows() == [("direct", first, 1), ("direct", other, 2),
                                                           ("ehr_prior", first, 1), ("ehr_prior", second, 1)]
    assert matched_patients(wh.connect(), "m2").rows() == [("global_frequency", other, 2)]


def test_the_run_queries_read_only_their_run(run):
    write_run(run, "e2", DIRECT_CALLS[:1])
    con = run.connect()  # every run's partitions: the queries' own filter keeps the other run out
    calls = run_llm_calls(con, "e1")
    expected = calls_frame("e1", DIRECT_CALLS)
    assert calls.select(expected.columns).sort("call_id").rows() == expected.rows()
    assert run_llm_calls(con, "e2")["call_id"].to_list() == ["c0"]
    assert dict(run_metric(con, "e1", "micro_f1", 20).iter_rows()) == pytest.approx(
        {"direct": 8 / 66, "ehr_prior": 2 / 66, "global_frequency": 2 / 66, "rrf_prior_direct": 8 / 66})
    assert run_metric(con, "e1", "micro_f1", 5).is_empty() and run_metric(con, "e2", "micro_f1", 20).is_empty()
    assert run_metric(con, "e1", "micro_f1", 20, subset="new_onset").height == len(SYSTEMS)


def test_finished_wall_clocks_leave_out_what_did_not_finish(run):
    write_run(run, "e2", [])
    record_run(run, "e2", COHORT, "forecast:direct", {}, "running", START)
    record_run(run, "e2", COHORT, "forecast:ehr_prior", {}, "failed", START, START + timedelta(seconds=5))
    assert finished_wall_clocks(run.connect(), "e2") == {"forecast:global_frequency": 9.0,
                                                         "forecast:rrf_prior_direct": 6.0}


def write_retrieval(wh: Warehouse, run_id: str) -> None:
    """Real ledger writes: T1 two queries over three (job, engine) operations, T2 one, T3 none."""
    ledger = Ledger(run_id, 0, wh)
    terms = {"temporal_class": "chronic_active", "iteration": 1}
    kidney = ledger.job(trajectory_id=T1, code=A, query="chronic kidney disease dialysis", purpose="validation",
                        entity_terms=["kidney disease"], endpoint_terms=["dialysis"], **terms)
    ledger.record(kidney, engine="pmc", state="readable", excerpt="Chronic kidney disease often leads to dialysis.")
    ledger.record(kidney, engine="web", state="no_result")
    heart = ledger.job(trajectory_id=T1, code=B, query="heart failure readmission", purpose="discovery", **terms)
    ledger.record(heart, engine="pmc", state="unreadable", detail="empty page")
    other = ledger.job(trajectory_id=T2, code=D, query="chronic kidney disease dialysis", purpose="validation",
                       entity_terms=["kidney disease"], endpoint_terms=["dialysis"], **terms)
    ledger.record(other, engine="pmc", state="readable", excerpt="An unrelated passage about fractures.")
    ledger.flush()


def test_retrieval_counts_from_ledger_writes(run):
    research = {"research_path": RANKINGS["direct"], "full": RANKINGS["direct"],
                "global_frequency": RANKINGS["global_frequency"]}
    write_rankings(run, "e3", rankings=research, status={(s, t): "short" for s in research for t in (T1, T2, T3)})
    write_retrieval(run, "e3")
    assert (search_job_count(run.connect(), "e3"), search_job_count(run.connect(), "e1")) == (3, 0)
    rows = by_system(run_efficiency(run, "e3", PRICES))
    for system in ("research_path", "full"):
        r = rows[system]
        assert r["retrieval"] is True
        assert r["queries_per_patient"] == 1.0                         # (2 + 1 + 0) / 3
        assert r["retrieval_operations_per_patient"] == pytest.approx(4 / 3)   # pmc+web, pmc | pmc | none
        assert r["source_accesses_per_patient"] == 1.0                 # supported + unreadable | unsupported
        assert r["supported_records_per_patient"] == pytest.approx(1 / 3)
        assert r["micro_f1_at_20"] is None                             # e3 was never evaluated
    assert rows["global_frequency"]["queries_per_patient"] == 0.0 and rows["global_frequency"]["retrieval"] is False
    assert efficiency_notes(run, "e3") == [
        "The ledger has no system column: the run's whole retrieval is counted for each of full, research_path."]
    # Shown without its searching systems (left out of the evaluation), the run's retrieval is theirs, not nobody's.
    assert efficiency_notes(run, "e3", systems=["global_frequency"]) == [
        "3 search job(s) under this run are of systems left out of the evaluation (full, research_path) and are not "
        "counted."]
    # Retrieval under a run whose systems do not search is reported as unclaimed, not silently dropped.
    write_retrieval(run, "e1")
    assert by_system(run_efficiency(run, "e1", PRICES))["direct"]["queries_per_patient"] == 0.0
    assert efficiency_notes(run, "e1")[-1] == ("3 search job(s) under this run belong to no retrieval system of the "
                                              "run (research_path, rrf, full, web_search_standalone, "
                                              "fixed_pool_ledger) and are not counted.")


def test_report_has_the_efficiency_section(run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # no ./dxr.toml of the checkout: prices come only from the file named below
    config = tmp_path / "priced.toml"
    config.write_text('[llm.prices.m]\ninput = 2.0\ncached_input = 0.5\noutput = 10.0\n')
    monkeypatch.setenv("DXR_CONFIG", str(config))
    render_report(run, "e1", tmp_path / "out")
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "## Efficiency (per patient, same patients)" in markdown
    assert ("| system | patients | micro-F1@20 | LLM calls/pt | backend calls/pt | cache hits | cost/pt (USD) | "
            "patients/h | clock |") in markdown
    assert ("| direct | 3 | 0.121 | 1.33 | 1.00 | 1 | 0.003300 | 120 | wall clock of forecast:direct; 1 of 4 LLM "
            "calls were cache hits |") in markdown
    assert ("| global_frequency | 3 | 0.030 | 0.00 | 0.00 | 0 | 0.000000 | 1,200 | "
            "wall clock of forecast:global_frequency |") in markdown
    assert "| direct | direct | 1000.0 | 466.7 | 200.0 | 23.3 | 2000 | 6.0 | 1,800 |" in markdown
    assert "No retrieval in this run" in markdown
    assert "Not counted above: 1 LLM call(s) of stage(s) unit belong to no system" in markdown
    assert "Efficiency" in (tmp_path / "out" / "report.html").read_text()

    # The configured table no longer prices the model: the calls keep the cost stored when they were made.
    monkeypatch.delenv("DXR_CONFIG")
    assert "| direct | 3 | 0.121 | 1.33 | 1.00 | 1 | 0.003300 | 120 |" in to_markdown(build_report(run, "e1"))


def test_a_patient_forecast_at_several_encounters_counts_once_with_the_work_of_all_its_trajectories(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # no ./dxr.toml of the checkout
    wh = Warehouse(tmp_path / "wh")
    # Patient 1 is forecast at two target encounters (`--target every`), patient 2 at one.
    first, second, other = f"{COHORT}:1:10", f"{COHORT}:1:11", f"{COHORT}:2:20"
    write_cohort(wh, targets={first: [A], second: [B], other: [D]}, pretarget={}, train_counts={A: 1})
    lists = {first: [A], second: [A], other: [A]}
    write_rankings(wh, "ev", rankings={"direct": lists, "research_path": lists}, status={})
    for system in ("direct", "research_path"):
        record_run(wh, "ev", COHORT, f"forecast:{system}", {}, "finished", START, START + timedelta(seconds=9))
    wh.write("llm_calls", calls_frame("ev", [("direct", t, 100, 0, 10, 0, 1000.0, False) for t in lists]),
             run_id="ev", stage="direct", shard=0)
    # Patient 1 asks the same query again at its second encounter, and one more; patient 2 asks it once.
    ledger = Ledger("ev", 0, wh)
    for trajectory_id, query in ((first, "kidney dialysis"), (second, "kidney dialysis"),
                                 (second, "heart failure"), (other, "kidney dialysis")):
        job = ledger.job(trajectory_id=trajectory_id, code=A, query=query, purpose="validation",
                         entity_terms=["kidney"], endpoint_terms=["dialysis"], temporal_class="chronic_active",
                         iteration=1)
        ledger.record(job, engine="pmc", state="unreadable", detail="empty page")
    ledger.flush()
    evaluate_run(wh, "ev", ks=(1,), n_boot=0)
    rows = by_system(run_efficiency(wh, "ev", PRICES))
    for system in ("direct", "research_path"):
        assert (rows[system]["patients"], rows[system]["trajectories"]) == (2, 3)
        assert rows[system]["patients_per_hour"] == 800.0                  # 2 patients in 9 s
    assert rows["direct"]["tokens_in_per_patient"] == 150.0                # 3 calls of 100 tokens, 2 patients
    assert rows["direct"]["patients_per_hour_serial"] == 2400.0           # 2 patients in 3 s of calls
    assert rows["research_path"]["queries_per_patient"] == 1.5            # unique within patient: (2 + 1) / 2
    assert rows["research_path"]["retrieval_operations_per_patient"] == 2.0   # 4 jobs
    markdown = to_markdown(build_report(wh, "ev"))
    assert ("Totals over each system's trajectories of the run divided by the number of their patients (2 matched "
            "patients with 3 trajectories; a patient forecast at several target encounters counts once, with the "
            "work of all its trajectories).") in markdown
    assert "| research_path | 2 | n/a | 0.00 | 0.00 | 0 | 0.000000 | 800 |" in markdown


def test_only_the_evaluated_systems_are_listed(run, tmp_path, monkeypatch):
    # `dxr evaluate --systems` scored two of the run's four systems: the report listed all four, two of them with
    # micro-F1@20 n/a as if K = 20 had not been evaluated.
    monkeypatch.chdir(tmp_path)   # no ./dxr.toml of the checkout
    evaluate_run(run, "e1", systems=["global_frequency", "rrf_prior_direct"], ks=(20,), n_boot=0, natural=False)
    efficiency = to_markdown(build_report(run, "e1")).split("## Efficiency")[1]
    listed = [line.split(" | ")[0][2:] for line in efficiency.splitlines() if line.startswith("| ")]
    assert listed == ["system", "global_frequency", "rrf_prior_direct", "system", "rrf_prior_direct"]
    assert "| rrf_prior_direct | 3 | 0.121 | 1.33 | 1.00 | 1 | 0.003300 |" in efficiency   # it fuses direct's calls
    assert ("Not listed (lists in this run, but left out of its evaluation by `dxr evaluate --systems`): direct, "
            "ehr_prior.") in efficiency
    assert "Not counted above: 1 LLM call(s) of stage(s) unit belong to no system of this run" in efficiency

    evaluate_run(run, "e1", systems=["global_frequency"], ks=(20,), n_boot=0, natural=False)
    assert sorted(run_efficiency(run, "e1", PRICES, systems=["global_frequency"])["system"]) == ["global_frequency"]
    assert efficiency_notes(run, "e1", systems=["global_frequency"]) == [
        "5 LLM call(s) of stage(s) direct are of systems left out of the evaluation and are not counted.",
        "1 LLM call(s) of stage(s) unit belong to no system of this run and are not counted."]

    # Only the gold-side oracle scored: no system with telemetry was evaluated (this is no aggregate of runs).
    run.write("oracle_probabilities", pl.DataFrame({"cohort_id": COHORT, "trajectory_id": [T1, T2, T3], "code": A,
                                                    "probability": 0.5}), cohort_id=COHORT)
    evaluate_run(run, "e1", systems=["oracle"], ks=(20,), n_boot=0, natural=False)
    efficiency = to_markdown(build_report(run, "e1")).split("## Efficiency")[1]
    assert efficiency.strip().splitlines()[-1] == (
        "No per-patient telemetry: no system with lists in this run was evaluated (left out by `dxr evaluate "
        "--systems`: direct, ehr_prior, global_frequency, rrf_prior_direct).")


class Killed(BaseException):
    """The process dies here (SIGKILL): nothing after this point of the move runs."""


def test_a_rerun_keeps_the_replaced_attempts_calls_and_the_report_shows_their_cost_apart(run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # no ./dxr.toml of the checkout
    first = run.read("llm_calls", run_id="e1", stage="direct")
    # direct is forecast again under e1: clear_outputs deleted its calls, so the run's report said it had cost only
    # what the second attempt cost.
    clear_outputs(run, "e1", "direct", PRICES)
    assert run.read("llm_calls", run_id="e1", stage="direct").is_empty()
    moved = run.read("superseded_llm_calls", run_id="e1")
    assert moved.drop("superseded_at").sort("call_id").equals(first.sort("call_id"))
    assert moved["superseded_at"].n_unique() == 1 and moved["superseded_at"][0] <= utc_now()
    # The second attempt makes the same calls again (new call ids) and its lists; the evaluation runs again.
    write_run(run, "e1", [])
    again = calls_frame("e1", DIRECT_CALLS[:5]).with_columns(pl.format("again-{}", "call_id").alias("call_id"))
    run.write("llm_calls", again, run_id="e1", stage="direct", shard=0)
    evaluate_run(run, "e1", ks=(20,), n_boot=0, natural=False)

    rows = by_system(run_efficiency(run, "e1", PRICES))
    direct = rows["direct"]
    # Kept and superseded alike: the four calls on the matched patients, 9900 micro-dollars (see the first test).
    assert (direct["llm_calls"], direct["cost_usd"]) == (4, pytest.approx(9900e-6))
    assert (direct["superseded_calls"], direct["superseded_cost_usd"]) == (4, pytest.approx(9900e-6))
    assert (rows["rrf_prior_direct"]["superseded_calls"], rows["rrf_prior_direct"]["superseded_cost_usd"]) == (
        4, pytest.approx(9900e-6))                                        # it fuses direct's lists
    assert (rows["global_frequency"]["superseded_calls"], rows["global_frequency"]["superseded_cost_usd"]) == (0, 0.0)
    markdown = to_markdown(build_report(run, "e1"))
    assert ("| system | superseded calls | superseded cost (USD) | kept cost (USD) | spent (USD) |\n"
            "|---|---|---|---|---|\n"
            "| direct | 4 | 0.009900 | 0.009900 | 0.019800 |\n"
            "| rrf_prior_direct | 4 | 0.009900 | 0.009900 | 0.019800 |\n") in markdown
    # The per-patient table is the kept calls' alone, as before; the calls of neither kind counted are named.
    assert "| direct | 3 | 0.121 | 1.33 | 1.00 | 1 | 0.003300 |" in markdown
    assert efficiency_notes(run, "e1") == [
        "1 LLM call(s) of stage(s) unit belong to no system of this run and are not counted.",
        "1 LLM call(s) name trajectories outside the run's matched set and are not counted.",
        "1 superseded LLM call(s) name trajectories outside the run's matched set and are not counted."]

    # Its calls and the superseded ones leave with the run.
    delete_run(run, "e1")
    assert run.read("superseded_llm_calls").is_empty() and run.read("llm_calls").is_empty()


def test_superseded_calls_of_an_unpriced_model_cost_n_a_and_old_files_are_priced_when_moved(run, tmp_path,
                                                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)   # no ./dxr.toml of the checkout
    # e2's first attempt ran under a price table without its model: the calls' cost is unknown, not 0.
    write_run(run, "e2", DIRECT_CALLS[:4], prices={})
    clear_outputs(run, "e2", "direct", PRICES)
    write_run(run, "e2", [])
    evaluate_run(run, "e2", ks=(20,), n_boot=0, natural=False)
    direct = by_system(run_efficiency(run, "e2", PRICES))["direct"]
    assert (direct["superseded_calls"], direct["superseded_cost_usd"], direct["cost_usd"]) == (4, None, 0.0)
    assert "| direct | 4 | n/a | 0.000000 | n/a |" in to_markdown(build_report(run, "e2"))

    # e3's first attempt wrote shard 0 before calls stored their cost (a file without the column): the move prices
    # those at the forecast's table (here twice PRICES), the others keep the cost they stored.
    write_run(run, "e3", [])
    old = run.write("llm_calls", calls_frame("e3", DIRECT_CALLS[:2]), run_id="e3", stage="direct", shard=0)
    pq.write_table(pq.read_table(old).drop_columns(["cost_usd"]), old)
    new = calls_frame("e3", DIRECT_CALLS[2:4]).with_columns(pl.format("new-{}", "call_id").alias("call_id"))
    run.write("llm_calls", new, run_id="e3", stage="direct", shard=1)
    doubled = {"m": ModelPrice(input=4.0, cached_input=1.0, output=20.0)}
    clear_outputs(run, "e3", "direct", doubled)
    moved = run.read("superseded_llm_calls", run_id="e3").sort("call_id")
    assert dict(moved.select("call_id", "cost_usd").iter_rows()) == pytest.approx(
        {"c0": 6800e-6, "c1": 3800e-6, "new-c0": 0.0, "new-c1": 4600e-6})


@pytest.mark.parametrize("killed_at", ["new_commit_id", "apply_commit", "remove_into"])
def test_a_move_killed_anywhere_then_run_again_leaves_each_call_once(run, monkeypatch, killed_at):
    # Killed while staging (before the commit point), after the commit point, or between the renaming of the
    # superseded file into place and the removal of the llm_calls partitions.
    first = run.read("llm_calls", run_id="e1", stage="direct")

    def killed(*args, **kwargs):
        raise Killed

    with monkeypatch.context() as patched:
        patched.setattr(store, killed_at, killed)
        with pytest.raises(Killed):
            clear_outputs(run, "e1", "direct", PRICES)
    clear_outputs(run, "e1", "direct", PRICES)  # the rerun of direct

    moved = run.read("superseded_llm_calls", run_id="e1")
    assert moved.drop("superseded_at").sort("call_id").equals(first.sort("call_id"))
    assert run.read("llm_calls", run_id="e1", stage="direct").is_empty()
    assert run.read("llm_calls", run_id="e1", stage="unit").height == 1      # another stage's calls stay
    # A third attempt's calls, superseded in turn, are added beside the first's.
    run.write("llm_calls", calls_frame("e1", DIRECT_CALLS[:1]).with_columns(pl.lit("third").alias("call_id")),
              run_id="e1", stage="direct", shard=0)
    clear_outputs(run, "e1", "direct", PRICES)
    assert sorted(run.read("superseded_llm_calls", run_id="e1")["call_id"]) == sorted(
        [*first["call_id"], "third"])
