"""Evaluation stage: forecast metrics with patient-cluster bootstrap intervals (spec/evaluation.md §1).

For a frozen trajectory set (n trajectories), a budget K, a ranking prefix Ŷ_K(i) and targets Y(i):
h = |Ŷ_K ∩ Y|; `precision_at_k` = mean h/K, `recall_at_k` = mean h/|Y|, `micro_precision` =
Σh/(nK), `micro_recall` = Σh/Σ|Y|, `micro_f1` = 2Σh/(nK + Σ|Y|), `macro_f1` = mean 2h/(K + |Y|).
`k = 0` in the `metrics` table denotes the variable-cardinality version: K is replaced by the
length |C(i)| of each trajectory's full ranking (h/|C| := 0 for an empty list).

Valid codes: when the cohort has a vocabulary Ω (`cohort_vocabulary`), every ranked code must be
in it; a ranking with a code outside Ω is refused rather than scored as a silent miss.

Which trajectories are evaluated: every trajectory that any system of the run ranked or recorded
a status for (the run's frozen set). Each evaluated system must cover every one of them with at
least K ranked codes, or carry an explicit `short`/`failed` status for it; otherwise evaluation
refuses the run (InputError naming the trajectory, system and run). Explicit short or failed
trajectories count with the hits they have; their denominators stay K.

Subsets restrict the TARGET codes, and therefore the hits, to one class; a trajectory with no
target code of the class is left out of that subset (its n), and the denominators that count
predictions (K, nK) are unchanged:
- `all`: every target code;
- `icd9` / `icd10`: codes `DIAGNOSIS//ICD//9//…` / `DIAGNOSIS//ICD//10//…`;
- `repeated`: the code occurs among the trajectory's pre-target diagnosis events
  (`pretarget_events` rows whose code starts with `DIAGNOSIS//`); `new_onset`: it does not;
- frequency buckets by the number of distinct train-split encounters whose (harmonized) diagnoses
  in the cohort's `train_events` include the code, the count `global_frequency` ranks by: a code
  recorded twice in one stay, or two source codes harmonized to one, counts the stay once, and a
  diagnosis row without an encounter adds nothing, as `global_frequency` counts distinct encounter
  ids and a null is none: `freq_0` (in no train encounter), `freq_1_9`, `freq_10_99`, `freq_100plus`.

Uncertainty: the bootstrap resamples patients (subject ids of the evaluated trajectories, every
trajectory of a sampled patient kept) with a seeded generator, applies the same resample to every
system (so paired differences use paired resamples) and reports 95% percentile intervals.

Oracles (gold side, written to `metrics`/`headroom` only, never to `rankings`): the synthetic
generator's `oracle` ranks `oracle_probabilities` by probability (desc), then code, and
`record_oracle` ranks `record_oracle_probabilities` the same way (the oracle restricted to what
the pre-target record reveals; see `warehouse.synthetic.oracle`); the
target-conditioned pool oracle puts min(K, |pool ∩ Y|) hits in its top K, for a pool that is the
union of the full lists of some systems (`headroom` table).

Repeated runs of one configuration: a configuration is the cohort, the run kind and the run's
`config_json` without the keys in `CONFIG_IGNORED_KEYS`; its metrics are the mean of the run-level
metrics (with the same patient resample in every run), written under the run id
`config-<hash>` (or every system's under one run id the caller names) with `n_runs` = the number
of runs, beside its coverage (short, failed and below-K lists counted over the runs, the mean native
share), and registered there (kind `evaluate`, the averaged runs under `runs` in its config) so
that a report refuses the mean once a forecast of one of those runs is run again. Two systems'
means under one run id are compared as a single run's systems are (`paired_means`): the difference
of the means, its interval from the one patient resample shared by every run and both systems, and
the sign test over patients of the metric's summand summed over their trajectories and the runs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from itertools import combinations

import meds
import numpy as np
import polars as pl
from prefect import task
from scipy.stats import binom

from dxr.errors import InputError, NotFoundError
from tasks.forecast import LLM_RUN_KEYS
from warehouse.cohorts import cut_by, registered_cohort, superseded_note
from warehouse.locks import held
from warehouse.meds import SPLITS
from warehouse.runs import EVALUATE_KIND, RESULT_KINDS, holding_run, record_run
from warehouse.schemas import METRICS, ORACLES, RANKING_STATUSES, TABLES, utc_now
from warehouse.store import Warehouse, check_run_id, conform

NATURAL_K = 0
DEFAULT_KS = (10, 20)
# (name, lowest count, highest count or None) of the train-split encounters coding a target code.
FREQUENCY_BUCKETS = (("freq_0", 0, 0), ("freq_1_9", 1, 9), ("freq_10_99", 10, 99), ("freq_100plus", 100, None))
SUBSETS = ("all", "icd9", "icd10", "new_onset", "repeated") + tuple(b[0] for b in FREQUENCY_BUCKETS)
# Keys that differ between repeats of one configuration without changing what it is: the seeds are what repeats of a
# sampled system vary (a Direct Forecast at temperature > 0 repeated under llm.seed 1, 2, 3). `cut_rule_version`
# records the build of the cohort a forecast read, not an option (`check_rerun` ignores it too), and is absent in
# forecasts recorded before 2026-12-06: a run's evaluation notes a rebuild since its forecast (`cohort_rebuilt_note`).
CONFIG_IGNORED_KEYS = ("run_id", "seed", "llm_seed", "replicate", "cut_rule_version")
# The version of the rules that compute an evaluation from a run's lists: its metrics and their subsets, its paired
# comparisons and its headroom. Bump it with every change that gives a stored evaluation other values: an evaluation
# records the version that computed it (`evaluation_rule_version` in its `runs` config, absent before it was
# recorded) and keeps its tables until it is taken again, so a report of one computed by another version says so
# (`outdated_evaluation_note`). 1 (2026-12-06): each paired row's sign test counts the patients whose summand of that
# row's own metric moved (the F1 summand before, whatever the metric), and the freq_* subsets count the train-split
# encounters coding a code (its diagnosis rows before 2026-12-05).
EVALUATION_RULE_VERSION = 1
EXPLICIT_INCOMPLETE = ("short", "failed")
# Resamples drawn at a time: bounds the integer draws beside the weights at (BOOTSTRAP_CHUNK, patients).
BOOTSTRAP_CHUNK = 100
# Per-trajectory summands whose mean over a subset's trajectories is a metric (the others are pooled).
AVERAGED = ("precision", "recall", "f1")
# The summand whose change, summed over a patient's trajectories, says whether the patient improved on each metric
# (in METRICS order): a pooled metric takes the per-trajectory form of its ratio.
SIGN_SUMMANDS = ("precision", "recall", "precision", "recall", "f1", "f1")


# ---- target classes ---------------------------------------------------------------------------

def label_targets(targets: pl.DataFrame) -> pl.DataFrame:
    """Long table (trajectory_id, code, subset): each target code once per subset it belongs to.

    `targets` has columns trajectory_id, code, repeated (bool) and train_count (int: the train-split
    encounters coding the code).

    >>> t = pl.DataFrame({"trajectory_id": ["a"], "code": ["DIAGNOSIS//ICD//10//E119"],
    ...                   "repeated": [True], "train_count": [12]})
    >>> label_targets(t)["subset"].to_list()
    ['all', 'icd10', 'repeated', 'freq_10_99']
    """
    version = (pl.when(pl.col("code").str.starts_with("DIAGNOSIS//ICD//9//")).then(pl.lit("icd9"))
               .when(pl.col("code").str.starts_with("DIAGNOSIS//ICD//10//")).then(pl.lit("icd10")))
    onset = pl.when(pl.col("repeated")).then(pl.lit("repeated")).otherwise(pl.lit("new_onset"))
    bucket = pl.lit(None, dtype=pl.String)
    for name, low, high in reversed(FREQUENCY_BUCKETS):
        in_bucket = pl.col("train_count") >= low
        if high is not None:
            in_bucket = in_bucket & (pl.col("train_count") <= high)
        bucket = pl.when(in_bucket).then(pl.lit(name)).otherwise(bucket)
    return (targets.select("trajectory_id", "code",
                           pl.concat_list(pl.lit("all"), version, onset, bucket).alias("subset"))
            .explode("subset").drop_nulls("subset"))


# ---- inputs of one run ------------------------------------------------------------------------

@dataclass
class RunData:
    """Everything the metrics need for one run, restricted to its frozen trajectory set."""

    run_id: str
    cohort_id: str
    trajectory_ids: list[str]          # sorted; index i of every array below
    subject_index: np.ndarray          # (n,) cluster (patient) index of each trajectory
    systems: list[str]
    rankings: pl.DataFrame             # system, trajectory_id, position (1-based), code, native
    status: pl.DataFrame               # system, trajectory_id, status
    labelled: pl.DataFrame             # trajectory_id, code, subset


def check_forecasts_finished(con, run_id: str, systems: list[str]) -> None:
    """Refuse to evaluate a system whose forecast of the run did not finish: its lists may stop part way.

    The caller holds the run's lock exclusively and every forecast holds it while it writes, so a
    forecast still recorded as `running` here has ended without recording how (killed).
    """
    forecasts = _query(con, "SELECT kind, status, cohort_id FROM runs "
                            "WHERE run_id = ? AND starts_with(kind, 'forecast:')",
                       [run_id]).with_columns(pl.col("kind").str.strip_prefix("forecast:").alias("system"))
    unfinished = forecasts.filter(pl.col("system").is_in(systems) & (pl.col("status") != "finished")).sort("system")
    if unfinished.height:
        system, status, cohort_id = unfinished.select("system", "status", "cohort_id").row(0)
        how = "was killed" if status in ("running", "killed") else status
        raise InputError(f"run {run_id!r}: its {system} forecast {how}, so its lists may stop part way: rerun "
                         f"dxr forecast --cohort {cohort_id} --system {system} --run-id {run_id} with the same "
                         f"options, or leave {system} out with --systems")


def not_a_forecast(wh: Warehouse, run_id: str) -> NotFoundError | None:
    """The error for a run id that records what a command made (a dataset's ingest, a cohort's build, a training):
    no forecast wrote lists under it, so neither evaluating nor reporting it can help. None for any other run."""
    records = sorted({kind for kind in wh.read("runs", run_id=run_id)["kind"] if not kind.startswith(RESULT_KINDS)})
    if not records:
        return None
    return NotFoundError(f"run {run_id!r} is a {', '.join(records)} run (see `dxr run list`), not a forecast: it has "
                         "no rankings to evaluate or report; name a forecast run (`dxr run list --kind forecast` "
                         "lists them)")


def _no_rankings(wh: Warehouse, run_id: str) -> NotFoundError:
    return not_a_forecast(wh, run_id) or NotFoundError(
        f"run {run_id!r} has no rankings in the warehouse at {wh.root}: run a forecast first (dxr forecast …), check "
        "--data-dir, or list the forecast runs with `dxr run list --kind forecast`")


def _not_ranked(run_id: str, system: str, ranked: list[str], named_by: str) -> NotFoundError:
    """The error for a system, named by an option, that has no lists in the run: no typo (the option refused those),
    so it names the run's systems and the two ways out."""
    return NotFoundError(f"{named_by} names {system!r}, which has no rankings in run {run_id!r} (it has: "
                         f"{', '.join(ranked) or 'none'}): forecast it into the run (dxr forecast --system {system} "
                         f"--run-id {run_id}, with the options of the run's other systems), or find a run that has it "
                         f"with `dxr run list --kind forecast:{system}`")


def _ranked_systems(wh: Warehouse, run_id: str) -> list[str]:
    """The systems with lists (rankings or statuses) in the run, sorted."""
    con = wh.connect(run_id=run_id)  # only this run's partitions are opened
    return sorted(_query(con, "SELECT system FROM rankings WHERE run_id = $run UNION SELECT system FROM "
                              "ranking_status WHERE run_id = $run", {"run": run_id})["system"].to_list())


def check_has_rankings(wh: Warehouse, run_id: str) -> None:
    """Refuse a run without ranking files; cheap (no file is read), so a command given several runs checks
    them all before evaluating the first."""
    if not (wh.has_rows("rankings", run_id=check_run_id(run_id))
            or wh.has_rows("ranking_status", run_id=run_id)):
        raise _no_rankings(wh, run_id)


def load_run(wh: Warehouse, run_id: str, systems: list[str] | None = None, ks=DEFAULT_KS,
             include_oracle: bool = True) -> RunData:
    """Read one run's rankings and statuses, the gold targets and the oracle; refuse silent gaps."""
    con = wh.connect(gold=True, run_id=run_id)  # only this run's partitions are opened
    rankings = _query(con, "SELECT cohort_id, system, trajectory_id, rank, code, native FROM rankings "
                           "WHERE run_id = ?", [run_id])
    status = _query(con, "SELECT system, trajectory_id, status FROM ranking_status WHERE run_id = ?", [run_id])
    if rankings.is_empty() and status.is_empty():
        raise _no_rankings(wh, run_id)
    cohorts = rankings["cohort_id"].unique().to_list()
    if not cohorts:  # every trajectory failed: the registry still knows the run's cohort
        cohorts = _query(con, "SELECT DISTINCT cohort_id FROM runs WHERE run_id = ? AND kind <> ?",
                         [run_id, EVALUATE_KIND])["cohort_id"].to_list()
    if len(cohorts) != 1:
        raise InputError(f"run {run_id!r} ranks trajectories of {len(cohorts)} cohorts ({cohorts}); "
                         "a run covers exactly one cohort: write each cohort's rankings under its own run id")
    cohort_id = cohorts[0]
    registered_cohort(wh, cohort_id)  # a build cut short leaves its tables half rewritten
    reserved = sorted(set(rankings["system"]) & set(ORACLES))
    if reserved:
        raise InputError(f"run {run_id!r} has rankings of system {reserved[0]!r}: that name is reserved for a "
                         "gold-side oracle, which is never written to the forecasting store; rename the system")
    # The frozen set: every trajectory any system of the run addressed, whichever systems we evaluate.
    trajectory_ids = sorted(set(rankings["trajectory_id"]) | set(status["trajectory_id"]))
    available = sorted(set(rankings["system"]) | set(status["system"]))
    oracle_rows = {name: _query(con, f"SELECT count(*) AS n FROM {table} WHERE cohort_id = ?", [cohort_id]).item()
                   for name, table in ORACLES.items()}
    if systems is None:
        systems = available + [name for name, n in oracle_rows.items() if include_oracle and n]
    else:
        systems = list(dict.fromkeys(systems))  # a system named twice is evaluated once, not written twice
        unknown = [s for s in systems if s not in available and s not in ORACLES]
        if unknown:
            raise _not_ranked(run_id, unknown[0], available, f"--systems {','.join(systems)}")
        absent = [s for s in systems if s in ORACLES and not oracle_rows[s]]
        if absent:
            raise NotFoundError(f"cohort {cohort_id} has no {ORACLES[absent[0]]} (only synthetic cohorts have "
                                f"oracles): drop {absent[0]!r} from --systems")
    check_forecasts_finished(con, run_id, systems)
    rankings = rankings.filter(pl.col("system").is_in(systems)).drop("cohort_id")
    status = status.filter(pl.col("system").is_in(systems))

    frozen = pl.DataFrame({"trajectory_id": trajectory_ids})
    con.register("frozen", frozen.to_arrow())
    members = frozen.join(_query(con, "SELECT t.trajectory_id, t.subject_id FROM trajectories t "
                                      "JOIN frozen USING (trajectory_id) WHERE t.cohort_id = ?", [cohort_id]),
                          on="trajectory_id", how="inner", maintain_order="left")
    if members.height != len(trajectory_ids):
        strays = sorted(set(trajectory_ids) - set(members["trajectory_id"]))
        raise InputError(f"run {run_id!r} ranks trajectory {strays[0]!r} ({len(strays)} such), which is not in cohort "
                         f"{cohort_id}'s trajectories: forecast the run's systems again on the current build, under a "
                         f"new --run-id or this one with the same options{_rebuilt_clause(wh, run_id)}")
    targets = _query(con, """
        WITH tg AS (SELECT DISTINCT trajectory_id, code FROM targets JOIN frozen USING (trajectory_id)
                    WHERE cohort_id = $cohort),
        prior AS (SELECT DISTINCT p.trajectory_id, p.code FROM pretarget_events p JOIN tg USING (trajectory_id, code)
                  WHERE p.cohort_id = $cohort AND p.code LIKE 'DIAGNOSIS//%'),
        freq AS (SELECT code, count(DISTINCT encounter_id) AS n FROM train_events
                 WHERE cohort_id = $cohort AND code LIKE 'DIAGNOSIS//%' GROUP BY code)
        SELECT tg.trajectory_id, tg.code, prior.code IS NOT NULL AS repeated, coalesce(freq.n, 0) AS train_count
        FROM tg LEFT JOIN prior USING (trajectory_id, code) LEFT JOIN freq USING (code)""",
                          {"cohort": cohort_id})
    empty = sorted(set(trajectory_ids) - set(targets["trajectory_id"]))
    if empty:
        raise InputError(f"trajectory {empty[0]!r} of run {run_id!r} has no gold targets ({len(empty)} such): empty "
                         "targets are excluded at cohort build time, so the cohort build and the run disagree; "
                         f"rebuild the cohort and rerun the forecast{_rebuilt_clause(wh, run_id)}")
    for name in (s for s in ORACLES if s in systems):
        oracle = _query(con, f"""
            SELECT '{name}' AS system, trajectory_id,
                   row_number() OVER (PARTITION BY trajectory_id ORDER BY probability DESC, code)::INTEGER AS rank,
                   code, true AS native
            FROM {ORACLES[name]} JOIN frozen USING (trajectory_id) WHERE cohort_id = ?""", [cohort_id])
        rankings = pl.concat([rankings, oracle.cast(rankings.schema)])
        status = pl.concat([status, _oracle_status(name, oracle, trajectory_ids, max(ks, default=0))])
    vocabulary = _query(con, "SELECT DISTINCT code FROM cohort_vocabulary WHERE cohort_id = ?", [cohort_id])
    con.close()

    if vocabulary.height:
        invalid = rankings.join(vocabulary, on="code", how="anti").sort("system", "trajectory_id", "rank")
        if invalid.height:
            row = invalid.row(0, named=True)
            raise InputError(f"run {run_id!r}, system {row['system']!r}, trajectory {row['trajectory_id']!r} ranks "
                             f"{row['code']!r} (rank {row['rank']}), which is not in cohort {cohort_id}'s vocabulary "
                             f"Ω ({invalid.height} such rows): a ranking lists valid codes only; map or drop them")
    check_rankings(rankings, status, trajectory_ids, systems, max(ks, default=0), run_id)
    rankings = rankings.with_columns(
        pl.col("rank").rank("ordinal").over("system", "trajectory_id").cast(pl.Int32).alias("position"))
    subject_index = np.unique(members["subject_id"].to_numpy(), return_inverse=True)[1]
    return RunData(run_id, cohort_id, trajectory_ids, subject_index, list(systems),
                   rankings.select("system", "trajectory_id", "position", "code", "native"), status,
                   label_targets(targets))


def _rebuilt_clause(wh: Warehouse, run_id: str) -> str:
    """`; <cohort_rebuilt_note>` for an error where the run's lists and its cohort's build disagree, or nothing:
    a build of the cohort after the run forecast it is the likely why."""
    note = cohort_rebuilt_note(wh, run_id)
    return f"; {note}" if note else ""


def _query(con, sql: str, params) -> pl.DataFrame:
    return pl.from_arrow(con.sql(sql, params=params).to_arrow_table())


def _oracle_status(name: str, oracle: pl.DataFrame, trajectory_ids: list[str], k: int) -> pl.DataFrame:
    """The generator lists its top codes only; a trajectory with fewer than K is explicitly short, and
    one without a list is short at natural list sizes too (k = 0)."""
    lengths = dict(oracle.group_by("trajectory_id").len().iter_rows())
    return pl.DataFrame({"system": name, "trajectory_id": trajectory_ids,
                         "status": ["ok" if lengths.get(t, 0) >= max(k, 1) else "short" for t in trajectory_ids]})


def check_rankings(rankings: pl.DataFrame, status: pl.DataFrame, trajectory_ids: list[str], systems: list[str],
                   k: int, run_id: str) -> None:
    """Refuse duplicate codes/ranks, unknown statuses and silently short rankings (fewer than k codes)."""
    bad_status = status.filter(~pl.col("status").is_in(RANKING_STATUSES))
    if bad_status.height:
        row = bad_status.row(0, named=True)
        raise InputError(f"ranking_status of run {run_id!r}, system {row['system']!r}, trajectory "
                         f"{row['trajectory_id']!r} has status {row['status']!r}; use one of {RANKING_STATUSES}")
    for keys, what in ((["system", "trajectory_id", "code"], "code"), (["system", "trajectory_id", "rank"], "rank")):
        dup = rankings.filter(pl.struct(keys).is_duplicated())
        if dup.height:
            row = dup.row(0, named=True)
            raise InputError(f"run {run_id!r}, system {row['system']!r}, trajectory {row['trajectory_id']!r} repeats "
                             f"{what} {row[what]!r}: a ranking lists each code once at a distinct rank")
    lengths = rankings.group_by("system", "trajectory_id").agg(pl.len().alias("n"))
    explicit = status.filter(pl.col("status").is_in(EXPLICIT_INCOMPLETE)).select("system", "trajectory_id")
    grid = pl.DataFrame({"system": systems}).join(pl.DataFrame({"trajectory_id": trajectory_ids}), how="cross")
    # With natural list sizes only (k = 0) a list may have any length, but it must exist.
    needed = max(k, 1)
    silent = (grid.join(lengths, on=["system", "trajectory_id"], how="left").with_columns(pl.col("n").fill_null(0))
              .filter(pl.col("n") < needed).join(explicit, on=["system", "trajectory_id"], how="anti")
              .sort("system", "trajectory_id"))
    _check_addressed(silent, status, trajectory_ids, systems, run_id)
    if silent.height:
        row = silent.row(0, named=True)
        bound = f"K={k}" if k else "1 (natural list sizes still need a list)"
        # Every list shorter than K is a K above the forecast's own (`--k 30` over a run forecast at 20), not an
        # output to fix.
        longest = lengths.filter(pl.col("system") == row["system"])["n"].max() or 0
        fix = (f"{row['system']}'s lists hold at most {longest} codes: evaluate with --k up to {longest}, or forecast "
               f"{row['system']} with --k {k} under a new run id" if 0 < longest < k
               else "fix the system's output or record its status")
        raise InputError(f"run {run_id!r}, system {row['system']!r}, trajectory {row['trajectory_id']!r} ranks "
                         f"{row['n']} code(s) < {bound} with no ranking_status 'short' or 'failed' row "
                         f"({silent.height} such lists): {fix}")


def _check_addressed(silent: pl.DataFrame, status: pl.DataFrame, trajectory_ids: list[str], systems: list[str],
                     run_id: str) -> None:
    """Refuse a system that has neither a list nor a status for trajectories another system of the run forecast.

    Every forecast records a status for each trajectory it addressed, so such a gap is no short list:
    the system was forecast into the run with another --split, --limit or --subject-id than the others.
    """
    unaddressed = silent.filter(pl.col("n") == 0).join(status, on=["system", "trajectory_id"], how="anti")
    if unaddressed.is_empty():
        return
    row = unaddressed.row(0, named=True)
    system = row["system"]
    n = unaddressed.filter(pl.col("system") == system).height
    gaps = set(unaddressed["system"])
    others = [s for s in systems if s not in gaps]
    # Left out, the gaps' systems still put their trajectories in the evaluated set (any system's count),
    # so the others alone pass only if their forecasts cover every one; an oracle's list covers all.
    forecasts = [s for s in others if s not in ORACLES]
    covered = set(status.filter(pl.col("system").is_in(forecasts))["trajectory_id"])
    alone = (f"evaluate the others alone (--systems {','.join(others)}), or "
             if forecasts and covered >= set(trajectory_ids) else "")
    # Forecasting it again into this run with other options is refused (a run keeps a system's options).
    raise InputError(f"run {run_id!r}: system {system!r} was not forecast for {n} of the run's {len(trajectory_ids)} "
                     f"trajectories (e.g. {row['trajectory_id']!r}), which another system of the run was (another "
                     f"--split, --limit or --subject-id); a run's systems are evaluated on the same trajectories: "
                     f"{alone}forecast {system} with the others' options under a new run id")


# ---- per-trajectory counts --------------------------------------------------------------------

@dataclass
class Counts:
    """Dense per-trajectory counts: hits H (M,S,K,n), predictions C (M,K,n), targets Y (S,n) of the S `subsets`."""

    names: list[str]
    ks: tuple[int, ...]
    hits: np.ndarray
    predictions: np.ndarray
    targets: np.ndarray
    subsets: tuple[str, ...] = SUBSETS


def system_counts(run: RunData, ks: tuple[int, ...], subsets: tuple[str, ...] = SUBSETS) -> Counts:
    """Hits of each system's top-K (K = 0: whole list) per subset, from the ranking positions.

    The arrays are (systems, subsets, K, trajectories): a caller that needs fewer subsets names them.
    """
    n, n_sub, n_k, n_sys = len(run.trajectory_ids), len(subsets), len(ks), len(run.systems)
    traj_index = pl.DataFrame({"trajectory_id": run.trajectory_ids, "i": np.arange(n)})
    sub_index = pl.DataFrame({"subset": list(subsets), "s": np.arange(n_sub)})
    sys_index = pl.DataFrame({"system": run.systems, "m": np.arange(n_sys)})
    labelled = run.labelled.join(traj_index, on="trajectory_id").join(sub_index, on="subset")
    targets = np.bincount(labelled["s"].to_numpy() * n + labelled["i"].to_numpy(), minlength=n_sub * n)
    hits_rows = (run.rankings.join(labelled, on=["trajectory_id", "code"]).join(sys_index, on="system"))
    m, s, i, pos = (hits_rows[c].to_numpy() for c in ("m", "s", "i", "position"))
    hits = np.zeros((n_sys, n_sub, n_k, n))
    for kk, k in enumerate(ks):
        keep = pos <= k if k != NATURAL_K else np.ones(len(pos), bool)
        cell = (m[keep] * n_sub + s[keep]) * n + i[keep]
        hits[:, :, kk, :] = np.bincount(cell, minlength=n_sys * n_sub * n).reshape(n_sys, n_sub, n)
    lists = run.rankings.join(traj_index, on="trajectory_id").join(sys_index, on="system")
    lengths = np.bincount(lists["m"].to_numpy() * n + lists["i"].to_numpy(), minlength=n_sys * n).reshape(n_sys, n)
    predictions = np.stack([lengths if k == NATURAL_K else np.full((n_sys, n), k) for k in ks], axis=1)
    return Counts(list(run.systems), tuple(ks), hits, predictions.astype(float),
                  targets.reshape(n_sub, n).astype(float), tuple(subsets))


def pool_oracle_counts(run: RunData, pools: list[tuple[str, ...]], ks: tuple[int, ...]) -> tuple[Counts, np.ndarray]:
    """The target-conditioned oracle over each pool (union of full lists): min(K, |pool ∩ Y_s|) hits.

    Returns the counts (one "system" per pool) and the mean pool size per pool. Pairs
    (trajectory, code) are encoded as integers once, so each pool is a numpy union and lookup.
    """
    n, n_sub = len(run.trajectory_ids), len(SUBSETS)
    traj_index = pl.DataFrame({"trajectory_id": run.trajectory_ids, "i": np.arange(n, dtype=np.int64)})
    code_index = (pl.concat([run.rankings["code"], run.labelled["code"]]).unique().sort().to_frame()
                  .with_row_index("c").with_columns(pl.col("c").cast(pl.Int64)))
    n_codes = code_index.height
    pair = (pl.col("i") * n_codes + pl.col("c")).alias("pair")
    ranked = (run.rankings.select("system", "trajectory_id", "code").join(traj_index, on="trajectory_id")
              .join(code_index, on="code").select("system", pair))
    pairs_of = {system: group["pair"].to_numpy() for (system,), group in ranked.group_by("system")}
    labelled = (run.labelled.join(traj_index, on="trajectory_id").join(code_index, on="code")
                .join(pl.DataFrame({"subset": list(SUBSETS), "s": np.arange(n_sub)}), on="subset")
                .select("s", "i", pair))
    label_pairs, label_cell = labelled["pair"].to_numpy(), (labelled["s"] * n + labelled["i"]).to_numpy()
    targets = np.bincount(label_cell, minlength=n_sub * n).reshape(n_sub, n).astype(float)
    hits, predictions, sizes = [], [], []
    for pool in pools:
        union = _sorted_unique(np.concatenate([pairs_of.get(system, np.empty(0, np.int64)) for system in pool]))
        size = np.bincount(union // n_codes, minlength=n).astype(float)
        at = np.minimum(np.searchsorted(union, label_pairs), max(len(union) - 1, 0))
        found = union[at] == label_pairs if len(union) else np.zeros(len(label_pairs), bool)
        in_pool = np.bincount(label_cell[found], minlength=n_sub * n).reshape(n_sub, n).astype(float)
        hits.append(np.stack([in_pool if k == NATURAL_K else np.minimum(in_pool, k) for k in ks], axis=1))
        predictions.append(np.stack([size if k == NATURAL_K else np.full(n, float(k)) for k in ks]))
        sizes.append(size.mean())
    names = ["+".join(p) for p in pools]
    return Counts(names, tuple(ks), np.array(hits), np.array(predictions), targets), np.array(sizes)


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """Sorted distinct values (a plain sort: much faster here than np.unique's hash path)."""
    ordered = np.sort(values)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if len(ordered) else ordered


# ---- metrics and bootstrap --------------------------------------------------------------------

def bootstrap_weights(subject_index: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """(B, n) float64 resample multiplicities: patients drawn with replacement, all their trajectories kept.

    The array is laid out trajectory-major (the transpose of an (n, B) C-contiguous array), the layout
    `estimate` multiplies by, and drawn BOOTSTRAP_CHUNK resamples at a time: at 50,000 trajectories and
    B = 1000 it is the one 400 MB array, with no (B, patients) int64 draws or second copy beside it.
    """
    n_subjects = int(subject_index.max()) + 1 if len(subject_index) else 0
    rng = np.random.default_rng(seed)
    weights = np.empty((len(subject_index), n_boot))
    for start in range(0, n_boot, BOOTSTRAP_CHUNK):  # the same draws as one call of size n_boot
        size = min(BOOTSTRAP_CHUNK, n_boot - start)
        draws = rng.multinomial(n_subjects, np.full(n_subjects, 1.0 / n_subjects), size=size)
        weights[:, start:start + size] = draws[:, subject_index].T
    return weights.T


def _per_trajectory(counts: Counts) -> dict[str, np.ndarray]:
    """Per-trajectory summands (M,S,K,n) of every metric; zero outside a trajectory's subsets."""
    member = (counts.targets > 0)[None, :, None, :]
    targets = counts.targets[None, :, None, :]
    predicted = np.where(member, counts.predictions[:, None, :, :], 0.0)
    hits = counts.hits
    with np.errstate(divide="ignore", invalid="ignore"):
        return {
            "hits": hits,
            "predicted": predicted,
            "precision": np.where(predicted > 0, hits / predicted, 0.0),
            "recall": np.where(member, hits / targets, 0.0),
            "f1": np.where(member, 2 * hits / (predicted + targets), 0.0),
        }


def _ratios(sums: dict[str, np.ndarray], patients: np.ndarray, gold: np.ndarray,
            reference: dict[str, np.ndarray]) -> np.ndarray:
    """The six metrics (last axis, in METRICS order) from weighted sums; NaN where a subset has no trajectory.

    The sums of the patient-averaged summands are of their differences from `reference` (see `estimate`); such a
    mean lies in [0, 1] but for rounding, which is clipped: a resample of trajectories without a hit came out at
    -3e-17, an interval printed as [-0.000, …]. No predictions at all (every list empty at natural list sizes)
    means no correct prediction: pooled precision 0, in the point value and in every resample alike.
    """
    def averaged(name: str) -> np.ndarray:
        return np.clip(reference[name] + sums[name] / patients, 0.0, 1.0)

    with np.errstate(divide="ignore", invalid="ignore"):
        return np.stack([
            averaged("precision"),
            averaged("recall"),
            np.where(sums["predicted"] > 0, sums["hits"] / sums["predicted"], np.where(patients > 0, 0.0, np.nan)),
            sums["hits"] / gold,
            2 * sums["hits"] / (sums["predicted"] + gold),
            averaged("f1"),
        ], axis=-1)


@dataclass
class Estimates:
    """Point values (M,S,K,6), bootstrap replicates (B,M,S,K,6) or None, n (S,), and the per-trajectory summands
    (M,S,K,n) of `AVERAGED` by name."""

    counts: Counts
    point: np.ndarray
    boot: np.ndarray | None
    n: np.ndarray
    summands: dict[str, np.ndarray]


def estimate(counts: Counts, weights: np.ndarray | None) -> Estimates:
    """Every metric of every (system, subset, K), with bootstrap replicates when weights are given.

    In float64 throughout, and a patient average is taken as r + mean(x − r), with r the summand of the
    subset's first trajectory: a metric that is the same for every trajectory is then exactly that value, in
    the point and in every resample, so its interval is the point (float32 sums put it ~1e-7 off the point,
    and a plain mean of 300 × 0.1 is 0.09999999999999999). Pooled metrics are ratios of integer-valued sums,
    exact in float64.
    """
    parts = _per_trajectory(counts)
    member = counts.targets > 0                                        # (S, n)
    patients = member.sum(axis=1).astype(float)                        # (S,)
    gold = counts.targets.sum(axis=1)                                  # (S,)
    first = member.argmax(axis=1)[None, :, None, None]                 # an empty subset's NaN hides its r
    reference = {name: np.take_along_axis(parts[name], first, axis=-1)[..., 0] for name in AVERAGED}  # (M,S,K)
    n_sys, n_sub, n_k, n = counts.hits.shape
    point = np.empty((n_sys, n_sub, n_k, len(METRICS)))
    boot = None
    if weights is not None:
        wt = np.ascontiguousarray(weights.T)    # (n, B); no copy of `bootstrap_weights`; contiguous: ~2x faster matmul
        b_patients = (member.astype(float) @ wt).T                      # (B, S)
        b_gold = (counts.targets @ wt).T                                # (B, S)
        boot = np.empty((weights.shape[0], n_sys, n_sub, n_k, len(METRICS)))
    for m in range(n_sys):  # one system at a time bounds memory at (5·S·K, n)
        mine = {name: reference[name][m] for name in AVERAGED}
        stacked = np.stack([np.where(member[:, None, :], parts[name][m] - mine[name][..., None], 0.0)
                            if name in AVERAGED else parts[name][m] for name in parts])      # (5, S, K, n)
        point[m] = _ratios(dict(zip(parts, stacked.sum(axis=-1))), patients[:, None], gold[:, None], mine)
        if boot is not None:
            # (5, B, S, K)
            sums = (stacked.reshape(-1, n) @ wt).reshape(len(parts), n_sub, n_k, -1).transpose(0, 3, 1, 2)
            boot[:, m] = _ratios(dict(zip(parts, sums)), b_patients[:, :, None], b_gold[:, :, None], mine)
    # A subset without trajectories (NaN) has no rows (`metric_frame` leaves it out); 0 keeps the arrays finite.
    point = np.nan_to_num(point, nan=0.0)
    return Estimates(counts, point, boot, patients.astype(np.int64), {name: parts[name] for name in AVERAGED})


def percentile_interval(replicates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """95% percentile interval along axis 0, ignoring NaN replicates (resamples without the subset)."""
    flat = replicates.reshape(replicates.shape[0], -1)
    low, high = np.full(flat.shape[1], np.nan), np.full(flat.shape[1], np.nan)
    has_nan = np.isnan(flat).any(axis=0)
    if (~has_nan).any():
        low[~has_nan], high[~has_nan] = np.percentile(flat[:, ~has_nan], [2.5, 97.5], axis=0)
    for col in np.flatnonzero(has_nan):
        values = flat[:, col][~np.isnan(flat[:, col])]
        if len(values):
            low[col], high[col] = np.percentile(values, [2.5, 97.5])
    return low.reshape(replicates.shape[1:]), high.reshape(replicates.shape[1:])


def metric_rows(est: Estimates) -> pl.DataFrame:
    """Long rows (system, subset, k, metric, value, ci_low, ci_high, n); subsets without patients omitted."""
    return metric_frame(est.counts.names, est.counts.ks, est.point, est.boot, est.n, est.counts.subsets)


def metric_frame(names: list[str], ks: tuple[int, ...], point: np.ndarray, boot: np.ndarray | None,
                 n: np.ndarray, subsets: tuple[str, ...] = SUBSETS) -> pl.DataFrame:
    """`metric_rows` from arrays: point (M,S,K,6), replicates (B,M,S,K,6) or None, n (S,) of the S `subsets`."""
    low = high = np.full(point.shape, np.nan)
    if boot is not None:
        low, high = percentile_interval(boot)
    m, s, kk, q = np.meshgrid(*(np.arange(d) for d in point.shape), indexing="ij")
    frame = pl.DataFrame({
        "system": np.array(names)[m.ravel()], "subset": np.array(subsets)[s.ravel()],
        "k": np.array(ks, dtype=np.int32)[kk.ravel()], "metric": np.array(METRICS)[q.ravel()],
        "value": point.ravel().astype(float), "ci_low": low.ravel().astype(float),
        "ci_high": high.ravel().astype(float),
        "n": n[s.ravel()],
    })
    return frame.filter(pl.col("n") > 0).with_columns(pl.col("ci_low", "ci_high").fill_nan(None))


def sign_test(improved: np.ndarray, worsened: np.ndarray) -> np.ndarray:
    """Exact two-sided binomial sign test p-values (ties already excluded).

    >>> sign_test(np.array([9]), np.array([1])).round(4).tolist()
    [0.0215]
    """
    trials = improved + worsened
    fewer = np.minimum(improved, worsened)
    with np.errstate(invalid="ignore"):
        p = np.minimum(1.0, 2.0 * binom.cdf(fewer, trials, 0.5))
    return np.where(trials > 0, p, 1.0)


def paired_rows(est: Estimates, pairs: list[tuple[str, str]], subject_index: np.ndarray) -> pl.DataFrame:
    """Difference a − b of every metric with paired bootstrap intervals and the per-patient sign test.

    The sign test's unit is the patient, also when a patient has several trajectories (`--target
    every`): a patient improved on a metric when the sum of its trajectories' summands of that metric
    (`SIGN_SUMMANDS`: h/K for precision, h/|Y| for recall, 2h/(K+|Y|) for F1, K = |C| at natural list
    sizes) is higher under a; for one trajectory and a fixed K every metric agrees with more hits, but
    at K = |C| a longer list can raise recall and lower precision. Ties are excluded from the test.
    `n_improved`, `n_worsened` and `n_tied` count patients, `n` trajectories.
    """
    names = est.counts.names
    member = est.counts.targets > 0                                       # (S, n)
    n_patients = int(subject_index.max()) + 1 if len(subject_index) else 0

    def per_patient(values: np.ndarray) -> np.ndarray:
        """Sum (..., n) over each patient's trajectories: (..., n_patients)."""
        rows = values.reshape(-1, values.shape[-1])
        cells = np.arange(len(rows))[:, None] * n_patients + subject_index[None, :]
        sums = np.bincount(cells.ravel(), weights=rows.ravel(), minlength=len(rows) * n_patients)
        return sums.reshape(*values.shape[:-1], n_patients)

    patients = (per_patient(member.astype(float)) > 0).sum(-1)           # (S,) patients in each subset
    frames = []
    for a, b in pairs:
        ia, ib = names.index(a), names.index(b)
        changes = {}
        for name in AVERAGED:
            # Summands are fractions: a patient whose trajectories cancel out is tied, not 1e-17 better.
            change = per_patient((est.summands[name][ia] - est.summands[name][ib]) * member[:, None, :])  # (S,K,P)
            change[np.isclose(change, 0.0, rtol=0.0, atol=1e-9)] = 0.0
            changes[name] = change
        improved = np.stack([(changes[name] > 0).sum(-1) for name in SIGN_SUMMANDS], axis=-1)   # (S, K, 6)
        worsened = np.stack([(changes[name] < 0).sum(-1) for name in SIGN_SUMMANDS], axis=-1)
        tied = patients[:, None, None] - improved - worsened
        p = sign_test(improved, worsened)
        diff = est.point[ia] - est.point[ib]
        low = high = np.full(diff.shape, np.nan)
        if est.boot is not None:
            low, high = percentile_interval(est.boot[:, ia] - est.boot[:, ib])
        s, kk, q = np.meshgrid(*(np.arange(d) for d in diff.shape), indexing="ij")
        s, kk, q = s.ravel(), kk.ravel(), q.ravel()
        frames.append(pl.DataFrame({
            "system_a": a, "system_b": b, "subset": np.array(est.counts.subsets)[s],
            "k": np.array(est.counts.ks, dtype=np.int32)[kk], "metric": np.array(METRICS)[q],
            "value_a": est.point[ia].ravel(), "value_b": est.point[ib].ravel(), "difference": diff.ravel(),
            "ci_low": low.ravel().astype(float), "ci_high": high.ravel().astype(float), "n": est.n[s],
            "n_improved": improved[s, kk, q], "n_worsened": worsened[s, kk, q], "n_tied": tied[s, kk, q],
            "sign_test_p": p[s, kk, q],
        }))
    if not frames:
        return pl.from_arrow(TABLES["paired_comparisons"].schema.empty_table())
    return pl.concat(frames).filter(pl.col("n") > 0).with_columns(pl.col("ci_low", "ci_high").fill_nan(None))


def coverage_rows(run: RunData, ks: tuple[int, ...]) -> pl.DataFrame:
    """Per system and K: explicit short/failed counts, trajectories below K, and the native share of top-K rows."""
    rows = []
    statuses = run.status.group_by("system", "status").len()
    for system in run.systems:
        mine = run.rankings.filter(pl.col("system") == system)
        count = dict(statuses.filter(pl.col("system") == system).select("status", "len").iter_rows())
        lengths = mine.group_by("trajectory_id").len()
        for k in ks:
            top = mine if k == NATURAL_K else mine.filter(pl.col("position") <= k)
            below = 0 if k == NATURAL_K else len(run.trajectory_ids) - lengths.filter(pl.col("len") >= k).height
            rows.append({"system": system, "k": k, "n_trajectories": len(run.trajectory_ids),
                         "n_short": count.get("short", 0), "n_failed": count.get("failed", 0), "n_below_k": below,
                         "native_share": top["native"].mean() if top.height else None})
    return pl.DataFrame(rows, schema={"system": pl.String, "k": pl.Int32, "n_trajectories": pl.Int64,
                                      "n_short": pl.Int64, "n_failed": pl.Int64, "n_below_k": pl.Int64,
                                      "native_share": pl.Float64})


def mean_coverage(runs: list[RunData], systems: list[str], ks: tuple[int, ...]) -> pl.DataFrame:
    """`coverage_rows` of a mean over repeated runs: the short, failed and below-K lists counted over every run, and
    the mean of the runs' native shares (as its metrics are the means of the runs'); `n_trajectories` is each run's
    frozen set, the same in every run."""
    per_run = pl.concat([coverage_rows(_only(run, systems), ks) for run in runs])
    return (per_run.group_by("system", "k", maintain_order=True)
            .agg(pl.col("n_trajectories").first(), pl.col("n_short", "n_failed", "n_below_k").sum(),
                 pl.col("native_share").mean()))


# ---- the stage --------------------------------------------------------------------------------

@dataclass
class Evaluation:
    metrics: pl.DataFrame
    paired: pl.DataFrame
    headroom: pl.DataFrame
    coverage: pl.DataFrame


def budgets(ks, natural: bool) -> tuple[int, ...]:
    """The budgets K to evaluate, sorted (with NATURAL_K for --natural); refuses K < 1."""
    ks = tuple(sorted(set(int(k) for k in ks)))
    if any(k < 1 for k in ks):
        raise InputError(f"every K must be >= 1, got {ks}; the variable-cardinality version is --natural")
    return ks + ((NATURAL_K,) if natural else ())


def _named(pairs: list[tuple[str, ...]], pools: list[tuple[str, ...]]) -> Iterator[tuple[str, str]]:
    """(how the user wrote the pair or pool, system) for each system each names."""
    for label, group in [*((f"pair {','.join(p)}", p) for p in pairs), *((f"pool {'+'.join(p)}", p) for p in pools)]:
        for system in group:
            yield label, system


def check_comparisons(run_id: str, systems: list[str], pairs: list[tuple[str, ...]],
                      pools: list[tuple[str, ...]]) -> None:
    """Refuse a pair or pool naming a system that is not among the evaluated `systems` of run `run_id`."""
    for label, system in _named(pairs, pools):
        if system not in systems:
            raise NotFoundError(f"{label} names {system!r}, not evaluated in run {run_id!r}; evaluated: "
                                f"{', '.join(systems)}")


def comparisons_named(wh: Warehouse, run_id: str, systems: list[str] | None, pairs: list[tuple[str, ...]] | None,
                      pools: list[tuple[str, ...]] | None) -> None:
    """Before the run is read, so that a command given several runs refuses a name before evaluating the first: each
    system of `systems` must have ranking files in the run (cheap: no file is read) or be an oracle (whose gold rows
    `evaluate` checks), and so must each system a pair or pool names, which `check_comparisons` also wants among
    `systems` when given."""
    if systems is not None:
        named = [(f"--systems {','.join(systems)}", system) for system in systems]
    else:
        named = list(_named(pairs or [], pools or []))
    for label, system in named:
        if not (system in ORACLES or wh.has_rows("rankings", run_id=check_run_id(run_id), system=system)
                or wh.has_rows("ranking_status", run_id=run_id, system=system)):
            raise _not_ranked(run_id, system, _ranked_systems(wh, run_id), label)
    if systems is not None:
        check_comparisons(run_id, systems, pairs or [], pools or [])


def evaluate(wh: Warehouse, run_id: str, systems: list[str] | None = None, ks=DEFAULT_KS, n_boot: int = 1000,
             seed: int = 0, natural: bool = True, pairs: list[tuple[str, str]] | None = None,
             pools: list[tuple[str, ...]] | None = None) -> Evaluation:
    """Metrics, paired comparisons, pool-oracle headroom and coverage of one run (nothing written).

    Defaults: every pair of evaluated systems; pools = each forecasting system's own list and the
    union of all of them.
    """
    if n_boot < 0:
        raise InputError(f"--bootstrap must be >= 0 (0 skips intervals), got {n_boot}")
    all_ks = budgets(ks, natural)
    run = load_run(wh, run_id, systems, ks=[k for k in all_ks if k != NATURAL_K])
    # A pair or pool given twice is one comparison: written twice, its rows would be duplicates.
    pairs = list(combinations(run.systems, 2)) if pairs is None else list(dict.fromkeys(pairs))
    forecasting = [s for s in run.systems if s not in ORACLES]
    if pools is None:
        pools = [(s,) for s in forecasting] + ([tuple(forecasting)] if len(forecasting) > 1 else [])
    pools = list(dict.fromkeys(pools))
    check_comparisons(run_id, run.systems, pairs, pools)  # before the bootstrap, minutes at 50,000 trajectories
    weights = bootstrap_weights(run.subject_index, n_boot, seed) if n_boot else None
    est = estimate(system_counts(run, all_ks), weights)
    extra = dict(run_id=run_id, cohort_id=run.cohort_id)
    metrics = metric_rows(est).with_columns(**{c: pl.lit(v) for c, v in extra.items()}, n_runs=pl.lit(1))
    headroom = pl.from_arrow(TABLES["headroom"].schema.empty_table())
    if pools:
        pool_counts, sizes = pool_oracle_counts(run, pools, all_ks)
        pool_est = estimate(pool_counts, weights)
        headroom = (metric_rows(pool_est).rename({"system": "pool"})
                    .join(pl.DataFrame({"pool": pool_counts.names, "mean_pool_size": sizes}), on="pool")
                    .with_columns(**{c: pl.lit(v) for c, v in extra.items()}))
    paired = paired_rows(est, pairs, run.subject_index).with_columns(**{c: pl.lit(v) for c, v in extra.items()})
    coverage = coverage_rows(run, all_ks).with_columns(**{c: pl.lit(v) for c, v in extra.items()})
    return Evaluation(*(_conform(name, frame) for name, frame in (
        ("metrics", metrics), ("paired_comparisons", paired), ("headroom", headroom),
        ("evaluation_coverage", coverage))))


def _conform(table: str, frame: pl.DataFrame) -> pl.DataFrame:
    return pl.from_arrow(conform(TABLES[table], frame))


def write_evaluation(wh: Warehouse, evaluation: Evaluation) -> None:
    """Replace this run's whole earlier evaluation (a rerun never duplicates rows).

    Every system's metrics and coverage go first, not only those evaluated now: a re-evaluation with
    fewer systems or other K values would otherwise leave the earlier rows beside the new ones, and a
    report would mix two evaluations (other K values, intervals, patients) as one.
    """
    run_ids = set(evaluation.metrics["run_id"]) | set(evaluation.coverage["run_id"])
    for run_id in run_ids:
        for table in ("metrics", "evaluation_coverage"):
            wh.delete(table, run_id=run_id)
        for (system,), part in evaluation.metrics.filter(pl.col("run_id") == run_id).group_by("system"):
            wh.write("metrics", part, run_id=run_id, system=system)
        for (system,), part in evaluation.coverage.filter(pl.col("run_id") == run_id).group_by("system"):
            wh.write("evaluation_coverage", part, run_id=run_id, system=system)
        wh.write("paired_comparisons", evaluation.paired.filter(pl.col("run_id") == run_id), run_id=run_id)
        wh.write("headroom", evaluation.headroom.filter(pl.col("run_id") == run_id), run_id=run_id)


def evaluate_run(wh: Warehouse, run_id: str, systems: list[str] | None = None, ks=DEFAULT_KS, n_boot: int = 1000,
                 seed: int = 0, natural: bool = True, pairs: list[tuple[str, str]] | None = None,
                 pools: list[tuple[str, ...]] | None = None) -> pl.DataFrame:
    """Evaluate one run, write metrics, paired comparisons, headroom and coverage; return the metrics rows.

    The evaluation registers itself in `runs` under the evaluated run id with kind `evaluate`.
    """
    started = utc_now()
    with holding_run(wh, run_id, exclusive=True):
        evaluation = evaluate(wh, run_id, systems, ks, n_boot, seed, natural, pairs, pools)
        cohort_id = evaluation.metrics["cohort_id"][0]
        config = {"systems": sorted(set(evaluation.metrics["system"])), "ks": sorted(set(evaluation.metrics["k"])),
                  "n_boot": n_boot, "seed": seed, "pairs": pairs, "pools": pools,
                  "evaluation_rule_version": EVALUATION_RULE_VERSION}
        # Until every table is written the evaluation is `stale`, the run's first one too (no earlier row to mark):
        # a process killed among the writes leaves a mix of old and new rows, or some systems' rows alone, and
        # says so.
        record_run(wh, run_id, cohort_id, EVALUATE_KIND, config, "stale", started)
        write_evaluation(wh, evaluation)
        # Under the lock: a forecast rerun starting right after it marks this evaluation stale, and must not be
        # overwritten by a late `finished`.
        record_run(wh, run_id, cohort_id, EVALUATE_KIND, config, "finished", started, utc_now())
    return evaluation.metrics


@task(name="evaluate-run")
def evaluate_run_task(data_dir: str, run_id: str, systems: list[str] | None = None, ks=DEFAULT_KS,
                      n_boot: int = 1000, seed: int = 0) -> int:
    """Prefect wrapper: evaluate one run into the warehouse; returns the number of metric rows."""
    return evaluate_run(Warehouse(data_dir), run_id, systems, ks, n_boot, seed).height


def in_sample_note(wh: Warehouse, run_id: str) -> str | None:
    """Why a run's scores overstate unseen patients, when some of its trajectories are of train-split patients.

    `--split all` (a small dataset may have no held_out trajectory at all) scores the patients whose full records
    the learned systems and the frequency padding were fit on, targets included. None when no trajectory is of a
    train patient, and for a mean over repeated runs, which has no trajectories of its own: ask about one of the
    runs it averages. The way out it names is a held_out run, unless the cohort has no held_out trajectory.
    """
    con = wh.connect(run_id=run_id, tables=("ranking_status", "trajectories"))
    try:
        scored = "SELECT DISTINCT trajectory_id FROM ranking_status"
        found = dict(con.execute(f"SELECT t.split, count(*) FROM ({scored}) r "
                                 "JOIN trajectories t USING (trajectory_id) GROUP BY t.split").fetchall())
        cohort_held_out = con.execute(
            f"SELECT count(*) FROM trajectories WHERE split = ? AND cohort_id IN (SELECT t.cohort_id FROM ({scored}) r "
            "JOIN trajectories t USING (trajectory_id))", [meds.held_out_split]).fetchone()[0]
    finally:
        con.close()
    in_train = found.get(meds.train_split, 0)
    if not in_train:
        return None
    counts = ", ".join(f"{split} {found[split]:,}" for split in SPLITS if split in found)
    # A small extract (the MIMIC-III demo) has no held_out trajectory: suggesting a held_out run would send the
    # user to a command that finds nothing to forecast.
    way_out = (f"only {meds.held_out_split} trajectories (forecast --split held_out) score patients no system "
               "learned from" if cohort_held_out else
               f"the cohort has no {meds.held_out_split} trajectory, so no run of it scores patients no system learned "
               "from: a larger extract, or another split of its patients (the MIMIC importers' --seed), can give it "
               f"{meds.held_out_split} patients")
    return (f"{in_train:,} of the {sum(found.values()):,} trajectories are of train-split patients ({counts}): "
            "the learned systems, and the train-split frequency list that pads other lists, were fit on their "
            f"records, targets included, so scores on them are in-sample; {way_out}")


def incomplete_note(wh: Warehouse, run_id: str) -> str | None:
    """How many of a run's evaluated lists were explicitly short or failed, per system, or None when none was.

    They are scored with the hits they have over unchanged denominators (K), so a summary that shows only the
    metrics would hide why a system scores low; `evaluation_coverage` holds the counts.
    """
    coverage = wh.read("evaluation_coverage", run_id=run_id)
    counts = coverage.group_by("system").agg(pl.col("n_short", "n_failed").max()).sort("system")
    parts = [f"{system} " + ", ".join(f"{n} {status}" for status, n in (("short", short), ("failed", failed)) if n)
             for system, short, failed in counts.iter_rows() if short or failed]
    if not parts:
        return None
    return ("lists recorded short or failed (ranking_status) are scored with the hits they have over the same "
            f"denominators (K): {'; '.join(parts)} (see evaluation_coverage)")


def run_superseded_note(wh: Warehouse, run_id: str) -> str | None:
    """That a run's cohort was built from earlier files of its dataset than the ones registered now (a refreshed
    extract), or None: its scores stand for that cohort as it was built (`superseded_note`)."""
    cohort_ids = wh.read("runs", run_id=run_id)["cohort_id"].drop_nulls().unique().to_list()
    cohorts = wh.read("cohorts", cohort_id=cohort_ids[0]) if cohort_ids else None
    note = superseded_note(wh, cohorts.row(0, named=True)) if cohorts is not None and cohorts.height else None
    return f"{note}: these scores are of that cohort as it was built" if note else None


def cohort_rebuilt_note(wh: Warehouse, run_id: str) -> str | None:
    """That a run's cohort was built again under its id (its files, options and seed) after systems of the run
    forecast it, or None: the lists are of the build they read, an evaluation scores them against the current one.

    Cut by the same rules, a build of the same files holds the same trajectories and targets; by others, or by rules
    the run did not record (recorded since 2026-12-06), they may differ.
    """
    forecasts = wh.read("runs", run_id=run_id).filter(pl.col("kind").str.starts_with("forecast:"))
    cohorts = wh.read("cohorts", cohort_id=forecasts["cohort_id"][0]) if forecasts.height else None
    if cohorts is None or cohorts.is_empty():
        return None
    cohort = cohorts.row(0, named=True)
    earlier = forecasts.filter(pl.col("started_at") < cohort["created_at"]).sort("kind")
    if earlier.is_empty():
        return None
    systems = ", ".join(kind.removeprefix("forecast:") for kind in earlier["kind"])
    built = f"{cohort['created_at']:%Y-%m-%d %H:%M}"
    rebuilt = (f"cohort {cohort['name']} ({cohort['cohort_id']}) was built again on {built} UTC, after this run's "
               f"{systems} forecast it")
    configs = [json.loads(config) for config in earlier["config_json"]]
    then = sorted({cut_by(config["cut_rule_version"]) if "cut_rule_version" in config else "by rules the run did not "
                   "record" for config in configs})
    now = cut_by(cohort["cut_rule_version"])
    if then == [now]:
        return f"{rebuilt}, cut {now} as before: the same trajectories and targets"
    return (f"{rebuilt}, cut {now} where the lists are of one cut {' and '.join(then)}: its trajectories and "
            "targets may differ from those the lists were forecast for")


# ---- repeated runs ----------------------------------------------------------------------------

def producing_row(wh: Warehouse, run_id: str, system: str) -> dict:
    """The registry row of the run that produced a system's lists in `run_id` (its `*:<system>` row, or the
    run's only row)."""
    rows = wh.read("runs", run_id=run_id).filter(pl.col("kind") != EVALUATE_KIND)
    if rows.is_empty():
        raise NotFoundError(f"run {run_id!r} is not in the run registry (`runs`); only registered runs can be "
                            "grouped as repeats of one configuration")
    own = rows.filter(pl.col("kind").str.ends_with(f":{system}"))
    if not own.height and rows.height > 1:
        raise NotFoundError(f"run {run_id!r} has {rows.height} registry rows and none of kind '*:{system}'; "
                            f"cannot tell which configuration produced system {system!r}")
    return (own if own.height else rows).row(0, named=True)


def configuration_keys(wh: Warehouse, run_ids: list[str], system: str) -> set[str]:
    """The configurations the runs of a system belong to, one when they repeat one: cohort, kind and config minus
    CONFIG_IGNORED_KEYS and minus the LLM settings that some run recorded before they were recorded, which it cannot
    say (compared as `check_rerun` compares a rerun with its recorded run)."""
    rows = [producing_row(wh, run_id, system) for run_id in run_ids]
    configs = [json.loads(row["config_json"]) for row in rows]
    unrecorded = {key for key in LLM_RUN_KEYS if any(key not in config for config in configs)}
    left_out = set(CONFIG_IGNORED_KEYS) | unrecorded
    return {json.dumps({"cohort_id": row["cohort_id"], "kind": row["kind"],
                        "config": {k: v for k, v in config.items() if k not in left_out}}, sort_keys=True)
            for row, config in zip(rows, configs)}


# The run ids of means over repeated runs that are named after their configuration (`configuration_id`).
CONFIGURATION_PREFIX = "config-"


def configuration_id(key: str) -> str:
    return CONFIGURATION_PREFIX + hashlib.sha256(key.encode()).hexdigest()[:12]


def check_mean_name(run_id: str) -> str:
    """Refuse a run id that no mean over repeated runs may be given, whatever the warehouse holds."""
    check_run_id(run_id)
    if run_id.startswith(CONFIGURATION_PREFIX):
        raise InputError(f"run id {run_id!r} starts with {CONFIGURATION_PREFIX}, as the ids a mean over repeated runs "
                         "gets without --run-id (one per configuration) do: choose another")
    return run_id


def check_mean_run_id(wh: Warehouse, run_id: str) -> None:
    """Refuse a run id named for a mean over repeated runs that holds anything but an earlier mean.

    A rerun under the same id replaces that mean; writing a mean under a forecast run's id (one of
    the averaged runs, say) would replace that run's own evaluation and be mistaken for it.
    """
    check_mean_name(run_id)
    # A run's own evaluation is registered beside its forecasts (kind `evaluate` too): the other kinds tell them apart.
    others = wh.read("runs", run_id=run_id).filter(pl.col("kind") != EVALUATE_KIND)["kind"].sort().to_list()
    if others:
        raise InputError(f"--run-id {run_id} is a {others[0]} run (see `runs`), not a mean over repeated runs: pass a "
                         "new --run-id for the mean")
    if wh.has_rows("rankings", run_id=run_id) or wh.has_rows("ranking_status", run_id=run_id):
        raise InputError(f"--run-id {run_id} holds rankings (a forecast run), not a mean over repeated runs: pass a "
                         "new --run-id for the mean")


def repeated_systems(systems: list[str] | None) -> list[str] | None:
    """The systems averaged over repeated runs: those asked for without the oracles (None: every system)."""
    if systems is None:
        return None
    forecasting = [s for s in systems if s not in ORACLES]
    if not forecasting:
        raise InputError(f"--systems {','.join(systems)} names only gold-side oracles, which are the same in every "
                         "run: name a forecasting system to average over the runs")
    return forecasting


def evaluate_repeated(wh: Warehouse, run_ids: list[str], systems: list[str] | None = None, ks=DEFAULT_KS,
                      n_boot: int = 1000, seed: int = 0, natural: bool = True, write: bool = True,
                      run_id: str | None = None, pairs: list[tuple[str, str]] | None = None) -> pl.DataFrame:
    """Mean of run-level metrics over repeats of one configuration per system, with `n_runs`; returns its rows.

    Every run must cover the same frozen trajectories; the bootstrap applies one patient resample
    to every run, and the interval is that of the mean over runs. Oracles named in `systems` are left
    out: they are read from the gold store, the same in every run, and no forecast configures them.
    The mean of each system goes under its configuration's `config-…` id, or under `run_id` when
    given; either id's earlier mean is replaced whole. The pairs of means under one id
    (`paired_means`) are compared into `paired_comparisons` under it.
    """
    run_ids = list(dict.fromkeys(run_ids))  # a run named twice is still one run of the mean
    if len(run_ids) < 2:
        raise InputError(f"repeated runs need at least two distinct run ids, got {run_ids}")
    if run_id is not None:
        check_mean_run_id(wh, run_id)
    systems = repeated_systems(systems)
    all_ks = budgets(ks, natural)
    with ExitStack() as locks:
        for member in sorted(set(run_ids)):
            locks.enter_context(holding_run(wh, member, exclusive=True))
        started = utc_now()  # the lists are read from here on: a forecast finished later is not in the mean
        runs = [load_run(wh, r, systems, ks=[k for k in all_ks if k != NATURAL_K], include_oracle=False)
                for r in run_ids]
    first = runs[0]
    for other in runs[1:]:
        if other.cohort_id != first.cohort_id or other.trajectory_ids != first.trajectory_ids:
            raise InputError(f"runs {first.run_id!r} and {other.run_id!r} cover different trajectories; repeats of a "
                             "configuration must use the same frozen patients and targets")
    shared = [s for s in first.systems if all(s in r.systems for r in runs)]
    if not shared:
        raise NotFoundError(f"no system is ranked in every run of {run_ids}")
    check_comparisons(", ".join(run_ids), shared, without_oracles(pairs or []), [])
    weights = bootstrap_weights(first.subject_index, n_boot, seed) if n_boot else None
    mean = mean_estimate([estimate(system_counts(_only(r, shared), all_ks), weights) for r in runs])
    frames = []
    for m, system in enumerate(shared):
        keys = configuration_keys(wh, [r.run_id for r in runs], system)
        if len(keys) > 1:
            raise InputError(f"system {system!r} ran with different configurations in {run_ids}: "
                             + " vs ".join(sorted(keys)))
        boot = None if mean.boot is None else mean.boot[:, m:m + 1]
        frames.append(metric_frame([system], all_ks, mean.point[m:m + 1], boot, mean.n)
                      .with_columns(run_id=pl.lit(run_id or configuration_id(keys.pop()))))
    extra = dict(cohort_id=pl.lit(first.cohort_id))
    metrics = _conform("metrics", pl.concat(frames).with_columns(**extra, n_runs=pl.lit(len(runs))))
    mean_ids = dict(metrics.select("system", "run_id").unique().iter_rows())
    compared, _ = paired_means(metrics, pairs)
    paired = _conform("paired_comparisons", paired_rows(mean, compared, first.subject_index).with_columns(
        **extra, run_id=pl.col("system_a").replace_strict(mean_ids, return_dtype=pl.String)))
    coverage = _conform("evaluation_coverage", mean_coverage(runs, shared, all_ks).with_columns(
        **extra, run_id=pl.col("system").replace_strict(mean_ids, return_dtype=pl.String)))
    if write:
        write_mean(wh, metrics, paired, coverage, run_ids, run_id, n_boot, seed, all_ks, started)
    return metrics


def mean_estimate(estimates: list[Estimates]) -> Estimates:
    """The mean over repeated runs of the runs' `Estimates`, all drawn with the same bootstrap weights: point values
    and replicates averaged over the runs, so each replicate is the mean under one patient resample shared by every
    run (and system), and the per-trajectory summands summed over the runs, so that a patient's change in
    `paired_rows` counts every run of each of its trajectories."""
    first = estimates[0]
    return Estimates(first.counts, np.mean([e.point for e in estimates], axis=0),
                     None if first.boot is None else np.mean([e.boot for e in estimates], axis=0),
                     first.n, {name: sum(e.summands[name] for e in estimates) for name in AVERAGED})


def without_oracles(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The pairs naming no gold-side oracle, which a mean over repeated runs leaves out."""
    return [(a, b) for a, b in pairs if a not in ORACLES and b not in ORACLES]


def paired_means(metrics: pl.DataFrame,
                 pairs: list[tuple[str, str]] | None) -> tuple[list[tuple[str, str]], str | None]:
    """The pairs of means in `metrics` (`evaluate_repeated`) that are compared, and why the others asked for are not.

    The pairs asked for are a single run's (`pairs`, by default every pair of the averaged systems). A pair is
    compared only when both means are under one run id (always so under the id a caller names): its rows are that
    id's, replaced and deleted with its means, whereas a system's `config-…` mean is taken again on its own (over
    other runs, say), which would leave rows under another id comparing a mean that is no longer stored. A pair
    naming an oracle is left to each run's own evaluation: the oracles are the same in every run and have no mean.
    """
    mean_ids = dict(metrics.select("system", "run_id").unique(maintain_order=True).iter_rows())
    named = list(dict.fromkeys(pairs or []))
    asked = list(combinations(mean_ids, 2)) if pairs is None else without_oracles(named)
    compared = [(a, b) for a, b in asked if mean_ids[a] == mean_ids[b]]
    apart = [f"{a},{b}" for a, b in asked if mean_ids[a] != mean_ids[b]]
    with_oracle = [f"{a},{b}" for a, b in named if (a, b) not in asked]
    reasons = []
    if apart:
        reasons.append(f"no paired comparison of the means of {'; '.join(apart)}: each system's mean is stored under "
                       "its own configuration's config-… id, and only means under one id are compared; pass --run-id "
                       "to store them under one id with their paired comparisons")
    if with_oracle:
        reasons.append(f"no paired comparison of means for {'; '.join(with_oracle)}: an oracle is the same in every "
                       "run and has no mean; each run's own evaluation compares it")
    return compared, "; ".join(reasons) or None


def write_mean(wh: Warehouse, metrics: pl.DataFrame, paired: pl.DataFrame, coverage: pl.DataFrame, run_ids: list[str],
               run_id: str | None, n_boot: int, seed: int, all_ks, started) -> None:
    """Write and register the means over `run_ids` (`evaluate_repeated`), their paired comparisons and coverage,
    under the cohort of their runs.

    The runs were read under their locks, released since: the cohort is held, as an evaluation holds its run's, and
    each run as a report holds it, and the runs must still be registered, or a `dxr cohort delete --with-runs` or a
    `dxr run delete` that finished meanwhile would leave these rows behind, averaging runs no longer registered,
    for no later delete to find.
    """
    cohort_id = metrics["cohort_id"][0]
    with held(wh, f"cohort:{cohort_id}", shared=True,
              busy=f"cohort {cohort_id} of runs {', '.join(run_ids)} is being rebuilt or deleted by another dxr "
                   "process"), ExitStack() as members:
        for member in sorted(set(run_ids)):
            members.enter_context(held(wh, f"run:{member}", shared=True,
                                       busy=f"run {member!r} is being deleted or evaluated by another dxr process"))
        gone = [member for member in run_ids if not wh.has_rows("runs", run_id=member)]
        if gone:
            raise NotFoundError(f"run(s) {', '.join(gone)} of cohort {cohort_id} were deleted while the mean over "
                                f"{', '.join(run_ids)} was taken: nothing was written")
        for (mean_id,), part in metrics.group_by("run_id"):
            # Held like a run being evaluated: no report reads the mean, and no second mean writes it, meanwhile.
            with holding_run(wh, mean_id, exclusive=True):
                if run_id is not None:
                    check_mean_run_id(wh, run_id)  # again under the lock: a forecast may have taken the id since
                # Registered with the runs it averages and when it read them, so that a report can tell when one
                # of their forecasts was run again since (`changed_since_mean`). `stale` until its rows are all
                # written, the first mean under the id too (no earlier row to mark): one cut short among its writes
                # is refused by a report, which names the command to take it again. Replaced whole, so a rerun with
                # fewer systems or pairs leaves none of the earlier mean's rows beside its own.
                compared = paired.filter(pl.col("run_id") == mean_id)
                config = {"runs": run_ids, "systems": sorted(set(part["system"])), "ks": list(all_ks),
                          "n_boot": n_boot, "seed": seed,
                          "pairs": [list(pair) for pair in compared.select("system_a", "system_b").unique().sort(
                              "system_a", "system_b").rows()],
                          "evaluation_rule_version": EVALUATION_RULE_VERSION}
                record_run(wh, mean_id, cohort_id, EVALUATE_KIND, config, "stale", started)
                for table in ("metrics", "paired_comparisons", "evaluation_coverage"):
                    wh.delete(table, run_id=mean_id)
                for (system,), rows in part.group_by("system"):
                    wh.write("metrics", rows, run_id=mean_id, system=system)
                    wh.write("evaluation_coverage", coverage.filter(pl.col("system") == system), run_id=mean_id,
                             system=system)
                if compared.height:
                    wh.write("paired_comparisons", compared, run_id=mean_id)
                record_run(wh, mean_id, cohort_id, EVALUATE_KIND, config, "finished", started, utc_now())


def evaluate_again(wh: Warehouse, run_id: str) -> str:
    """The `dxr evaluate` command that takes a run's stored evaluation again: a mean over repeated runs names the runs
    it averages, and its id unless it is the `config-…` id the mean gets by default."""
    evaluation = wh.read("runs", run_id=run_id, kind=EVALUATE_KIND)
    averaged = [] if evaluation.is_empty() else json.loads(evaluation["config_json"][0]).get("runs", [])
    named = f" --run-id {run_id}" if averaged and not run_id.startswith(CONFIGURATION_PREFIX) else ""
    return f"dxr evaluate {' '.join(f'--run {r}' for r in averaged or [run_id])}{named}"


def outdated_evaluation_note(wh: Warehouse, run_id: str) -> str | None:
    """Why a run's stored evaluation holds what rules other than this dxr's (`EVALUATION_RULE_VERSION`) computed, or
    None (also for metrics no registered evaluation wrote, whose rules nothing records).

    A warehouse kept across an upgrade keeps its evaluations as they were computed: `dxr sql` and the report read them
    until the run is evaluated again.
    """
    evaluation = wh.read("runs", run_id=run_id, kind=EVALUATE_KIND)
    if evaluation.is_empty():
        return None
    version = json.loads(evaluation["config_json"][0]).get("evaluation_rule_version")
    if version == EVALUATION_RULE_VERSION:
        return None
    computed_by = "before evaluation rules were versioned" if version is None else f"by version {version} of them"
    return (f"its evaluation was computed by dxr {evaluation['code_version'][0]} {computed_by}, not by this dxr's "
            f"version {EVALUATION_RULE_VERSION}: its metrics, paired comparisons and headroom may differ from what "
            f"`{evaluate_again(wh, run_id)}` computes now")


def changed_since_mean(wh: Warehouse, run_id: str) -> str | None:
    """Why the stored mean over repeated runs `run_id` (a `config-…` id, or the id it was given) no longer describes
    its runs' lists, or None: a forecast of one of them that is not `finished`, or finished after the mean read the
    lists."""
    evaluation = wh.read("runs", run_id=run_id, kind=EVALUATE_KIND)
    if evaluation.is_empty():
        return None
    mean = evaluation.row(0, named=True)
    config = json.loads(mean["config_json"])
    for member in config.get("runs", []):
        for system in config["systems"]:
            try:
                row = producing_row(wh, member, system)
            except NotFoundError:
                return f"run {member!r} is no longer in the run registry"
            if row["status"] != "finished":
                return f"the {row['kind']} run of {member!r} is {row['status']}"
            if row["finished_at"] is None or row["finished_at"] > mean["started_at"]:
                return f"the {row['kind']} run of {member!r} finished at {row['finished_at']}, after the mean was taken"
    return None


def _only(run: RunData, systems: list[str]) -> RunData:
    return RunData(run.run_id, run.cohort_id, run.trajectory_ids, run.subject_index, systems,
                   run.rankings.filter(pl.col("system").is_in(systems)),
                   run.status.filter(pl.col("system").is_in(systems)), run.labelled)
