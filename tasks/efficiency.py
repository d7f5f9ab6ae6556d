"""Efficiency stage (spec/evaluation.md §6): what each system of a run spent per patient, next to its micro-F1@20.

Matched patients are the patients of the run's frozen set, the trajectories `dxr evaluate` scores
(every one that any system of the run ranked or gave a status); each system's numbers are totals
over the trajectories it addressed divided by the number of their patients. A patient forecast at
several target encounters (`--target every`) counts once, with the work of all its trajectories.

- LLM (`llm_calls`): the rows whose stage is the system, or a system whose lists it fuses in the
  same run (`INPUT_SYSTEMS`: fusing Direct's list costs Direct's calls). Rows of other trajectories
  are left out; run-level rows without a trajectory are shared by its patients. A cache hit is a
  call but not a backend call: no tokens, latency or cost (`models.llm.telemetry.backend_totals`).
  Cost is the one each call stored when its run wrote it (the price in force then; null when its model had no
  price), so a later change of the price table does not reprice calls already made. Calls of files written
  before costs were stored are priced from the price table passed in (`calls_written_before_cost`).
- Superseded attempts (`superseded_llm_calls`): the calls of the same stages that an earlier attempt made before a
  rerun of its system under the run id replaced its outputs, counted as the kept calls are (same stages, same
  matched patients) but apart, as totals: `superseded_calls` and `superseded_cost_usd`, so what a system cost in
  all is `cost_usd` + `superseded_cost_usd`.
- Throughput: observed patients/hour (distinct patients) from the wall clock of the run's registered
  `forecast:<system>` rows (summed over fused inputs; it includes fitting and writing); null, with
  the reason in `clock`, when a row is missing or every LLM call was a cache hit (a replay says
  nothing about throughput). `patients_per_hour_serial` assumes one backend call at a time.
- Retrieval (`search_jobs` + `ledger`, `warehouse.evidence.retrieval_efficiency`): the ledger has no
  system column, so the run's retrieval is counted for every system in `RETRIEVAL_SYSTEMS` (or
  fusing one); `efficiency_notes` says when that is ambiguous or when nothing can claim it. Queries are
  unique within a patient: one asked again at a later target encounter of the patient counts once.
"""

from __future__ import annotations

import polars as pl

from models.llm.config import ModelPrice
from models.llm.telemetry import TOKEN_KINDS, backend_totals, with_report_time_costs
from warehouse.evidence import retrieval_efficiency, search_job_count
from warehouse.run_outputs import (calls_written_before_cost, matched_patients, run_llm_calls, run_metric,
                                   run_superseded_calls)
from warehouse.runs import finished_wall_clocks
from warehouse.store import Warehouse

F1_K = 20
# Systems whose ranking fuses other systems' lists of the same run (and so costs their work too).
INPUT_SYSTEMS = {"rrf_prior_direct": ("ehr_prior", "direct")}
# Systems that search (spec/evaluation.md §2); they write `search_jobs`/`ledger` under the run id.
RETRIEVAL_SYSTEMS = ("research_path", "rrf", "full", "web_search_standalone", "fixed_pool_ledger")
RETRIEVAL_COUNTS = ("queries", "retrieval_operations", "source_accesses", "supported_records")

SCHEMA = {
    "system": pl.String, "patients": pl.Int64, "trajectories": pl.Int64, "llm_stages": pl.String,
    "llm_calls": pl.Int64,
    "backend_calls": pl.Int64, "cache_hits": pl.Int64, "calls_per_patient": pl.Float64,
    "backend_calls_per_patient": pl.Float64, **{f"{kind}_per_patient": pl.Float64 for kind in TOKEN_KINDS},
    "latency_ms_p50": pl.Float64, "latency_ms_total": pl.Float64, "cost_usd": pl.Float64,
    "cost_per_patient_usd": pl.Float64, "wall_clock_s": pl.Float64, "patients_per_hour": pl.Float64,
    "clock": pl.String, "patients_per_hour_serial": pl.Float64, "retrieval": pl.Boolean,
    **{f"{count}_per_patient": pl.Float64 for count in RETRIEVAL_COUNTS}, "micro_f1_at_20": pl.Float64,
    "superseded_calls": pl.Int64, "superseded_cost_usd": pl.Float64,
}


def footprint(system: str) -> tuple[str, ...]:
    """The system and, transitively, every system whose lists it fuses.

    >>> footprint("rrf_prior_direct"), footprint("direct")
    (('rrf_prior_direct', 'ehr_prior', 'direct'), ('direct',))
    """
    out = [system]
    for member in out:  # the list grows while it is walked: a breadth-first closure
        out += [s for s in INPUT_SYSTEMS.get(member, ()) if s not in out]
    return tuple(out)


def _stage_map(systems: list[str]) -> pl.DataFrame:
    pairs = [(system, stage) for system in systems for stage in footprint(system)]
    return pl.DataFrame(pairs, schema={"system": pl.String, "stage": pl.String}, orient="row")


def systems_calls(calls: pl.DataFrame, patients: pl.DataFrame) -> pl.DataFrame:
    """`calls` with the system each is counted for: its own and its fused inputs' calls on its matched patients
    (run-level calls, without a trajectory, included)."""
    mine = _stage_map(patients["system"].unique().to_list()).join(calls, on="stage", how="inner")
    return pl.concat([mine.filter(pl.col("trajectory_id").is_null()),
                      mine.filter(pl.col("trajectory_id").is_not_null())
                      .join(patients, on=["system", "trajectory_id"], how="semi")])


def llm_part(wh: Warehouse, con, run_id: str, patients: pl.DataFrame,
             prices: dict[str, ModelPrice]) -> pl.DataFrame:
    """Per system: `backend_totals` of its own and its fused inputs' calls on its matched patients."""
    written_before_cost = pl.col("call_id").is_in(calls_written_before_cost(wh, run_id))
    mine = systems_calls(with_report_time_costs(run_llm_calls(con, run_id), prices, written_before_cost), patients)
    stages = mine.group_by("system").agg(pl.col("stage").unique().sort().str.join(", ").alias("llm_stages"))
    return backend_totals(mine, ["system"]).join(stages, on="system")


def superseded_part(con, run_id: str, patients: pl.DataFrame) -> pl.DataFrame:
    """Per system with superseded calls: how many of them count for it (as `llm_part` counts the kept ones) and
    their cost (null when one's is unknown)."""
    mine = systems_calls(run_superseded_calls(con, run_id), patients)
    return backend_totals(mine, ["system"]).select(
        "system", pl.col("llm_calls").alias("superseded_calls"), pl.col("cost_usd").alias("superseded_cost_usd"))


def clock_part(con, run_id: str, counts: pl.DataFrame) -> pl.DataFrame:
    """Per system: wall-clock seconds of its registered forecast run(s), patients/hour and which clock that was."""
    seconds = finished_wall_clocks(con, run_id)
    rows = []
    for system, patients in counts.iter_rows():
        kinds = [f"forecast:{s}" for s in footprint(system)]
        missing = [k for k in kinds if k not in seconds]
        if missing:
            rows.append((system, None, None, f"n/a: no finished {', '.join(missing)} run registered"))
            continue
        total = sum(seconds[k] for k in kinds)
        label = f"wall clock of {kinds[0]}" if len(kinds) == 1 else f"summed wall clocks of {' + '.join(kinds)}"
        if total <= 0:
            rows.append((system, total, None, f"n/a: {label} is {total:.0f} s"))
        else:
            rows.append((system, total, patients * 3600 / total, label))
    return pl.DataFrame(rows, schema={"system": pl.String, "wall_clock_s": pl.Float64,
                                      "patients_per_hour": pl.Float64, "clock": pl.String}, orient="row")


def retrieval_claimers(systems: list[str]) -> list[str]:
    """The systems that search, or fuse a system that does."""
    return sorted(s for s in systems if set(footprint(s)) & set(RETRIEVAL_SYSTEMS))


def retrieval_part(con, run_id: str, patients: pl.DataFrame) -> pl.DataFrame:
    """Per system: `retrieval_efficiency` counts of each of its matched patients, summed; only retrieval systems."""
    rows = []
    for system in retrieval_claimers(patients["system"].unique().to_list()):
        mine = patients.filter(pl.col("system") == system).select(pl.col("subject_id").alias("unit"), "trajectory_id")
        per_patient = retrieval_efficiency(con, run_id, mine)
        rows.append({"system": system, "retrieval": True, **{c: int(per_patient[c].sum()) for c in RETRIEVAL_COUNTS}})
    return pl.DataFrame(rows, schema={"system": pl.String, "retrieval": pl.Boolean,
                                      **{c: pl.Int64 for c in RETRIEVAL_COUNTS}})


def run_systems(wh: Warehouse, run_id: str) -> list[str]:
    """The systems with lists (rankings or statuses) in the run, sorted; none for an aggregate of repeated runs."""
    return sorted(matched_patients(wh.connect(run_id=run_id), run_id)["system"].unique().to_list())


def run_efficiency(wh: Warehouse, run_id: str, prices: dict[str, ModelPrice],
                   systems: list[str] | None = None) -> pl.DataFrame:
    """One row per system of the run (sorted by name) with the `SCHEMA` columns; empty for a run without rankings.

    `prices` prices only the calls written before each stored its cost. `systems` keeps those of them (the
    evaluated ones): a system that `dxr evaluate --systems` left out has no micro-F1 of this evaluation to set its
    costs against.
    """
    con = wh.connect(run_id=run_id)  # only this run's partitions are opened
    patients = matched_patients(con, run_id)
    if systems is not None:
        patients = patients.filter(pl.col("system").is_in(systems))
    if patients.is_empty():
        return pl.DataFrame(schema=SCHEMA)
    counts = (patients.group_by("system").agg(pl.col("subject_id").n_unique().cast(pl.Int64).alias("patients"),
                                              pl.len().cast(pl.Int64).alias("trajectories")).sort("system"))
    f1 = run_metric(con, run_id, "micro_f1", F1_K).rename({"value": "micro_f1_at_20"})
    frame = (counts.join(llm_part(wh, con, run_id, patients, prices), on="system", how="left")
             .join(clock_part(con, run_id, counts.select("system", "patients")), on="system", how="left")
             .join(retrieval_part(con, run_id, patients), on="system", how="left")
             .join(f1, on="system", how="left")
             .join(superseded_part(con, run_id, patients), on="system", how="left"))

    def per_patient(column: str) -> pl.Expr:
        return pl.col(column) / pl.col("patients")

    frame = frame.with_columns(
        # No row in llm_calls: the system made no calls, so it cost nothing (known zero, not unknown).
        pl.when(pl.col("llm_calls").is_null()).then(0.0).otherwise(pl.col("cost_usd")).alias("cost_usd"),
        pl.when(pl.col("superseded_calls").is_null()).then(0.0).otherwise(pl.col("superseded_cost_usd"))
        .alias("superseded_cost_usd"),
        pl.col("llm_calls", "backend_calls", "cache_hits", "superseded_calls", *TOKEN_KINDS, *RETRIEVAL_COUNTS)
        .fill_null(0),
        pl.col("latency_ms_total").fill_null(0.0), pl.col("llm_stages").fill_null(""),
        pl.col("retrieval").fill_null(False))
    fully_cached = (pl.col("llm_calls") > 0) & (pl.col("backend_calls") == 0)
    frame = frame.with_columns(
        per_patient("llm_calls").alias("calls_per_patient"),
        per_patient("backend_calls").alias("backend_calls_per_patient"),
        *(per_patient(kind).alias(f"{kind}_per_patient") for kind in TOKEN_KINDS),
        *(per_patient(count).alias(f"{count}_per_patient") for count in RETRIEVAL_COUNTS),
        per_patient("cost_usd").alias("cost_per_patient_usd"),
        pl.when(fully_cached).then(None).otherwise(pl.col("patients_per_hour")).alias("patients_per_hour"),
        pl.when(fully_cached).then(pl.format("n/a: all {} LLM calls were cache hits", "llm_calls"))
        .when(pl.col("cache_hits") > 0)
        .then(pl.format("{}; {} of {} LLM calls were cache hits", "clock", "cache_hits", "llm_calls"))
        .otherwise(pl.col("clock")).alias("clock"),
        pl.when(pl.col("latency_ms_total") > 0).then(pl.col("patients") * 3.6e6 / pl.col("latency_ms_total"))
        .alias("patients_per_hour_serial"))
    return frame.select([pl.col(name).cast(dtype) for name, dtype in SCHEMA.items()]).sort("system")


def efficiency_notes(wh: Warehouse, run_id: str, systems: list[str] | None = None) -> list[str]:
    """What the per-system numbers leave out or share: unmatched LLM stages or patients, unclaimed retrieval.

    `systems` are the systems shown (`run_efficiency`); by default every system of the run.
    """
    con = wh.connect(run_id=run_id)
    patients = matched_patients(con, run_id)
    ranked = sorted(patients["system"].unique().to_list())
    systems = ranked if systems is None else [s for s in ranked if s in systems]
    notes = []
    calls = run_llm_calls(con, run_id)
    covered = {stage for system in systems for stage in footprint(system)}
    left_out = {stage for system in ranked for stage in footprint(system)} - covered
    for kind, made in (("LLM call(s)", calls), ("superseded LLM call(s)", run_superseded_calls(con, run_id))):
        for stray, whose in ((made.filter(pl.col("stage").is_in(sorted(left_out))),
                              "are of systems left out of the evaluation"),
                             (made.filter(~pl.col("stage").is_in(sorted(covered | left_out))),
                              "belong to no system of this run")):
            if stray.height:
                notes.append(f"{stray.height} {kind} of stage(s) {', '.join(sorted(set(stray['stage'])))} {whose} "
                             "and are not counted.")
        outside = (made.filter(pl.col("stage").is_in(sorted(covered)) & pl.col("trajectory_id").is_not_null())
                   .join(patients.select("trajectory_id").unique(), on="trajectory_id", how="anti"))
        if outside.height:
            notes.append(f"{outside.height} {kind} name trajectories outside the run's matched set and are not "
                         "counted.")
    jobs = search_job_count(con, run_id)
    if jobs and not retrieval_claimers(systems):
        unevaluated = retrieval_claimers(ranked)
        whose = (f"are of systems left out of the evaluation ({', '.join(unevaluated)})" if unevaluated else
                 f"belong to no retrieval system of the run ({', '.join(RETRIEVAL_SYSTEMS)})")
        notes.append(f"{jobs} search job(s) under this run {whose} and are not counted.")
    own = [s for s in systems if s in RETRIEVAL_SYSTEMS]
    if jobs and len(own) > 1:
        notes.append("The ledger has no system column: the run's whole retrieval is counted for each of "
                     f"{', '.join(own)}.")
    return notes
