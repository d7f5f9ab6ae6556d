"""Forecast stage: run one system over a cohort's trajectories, shard by shard (`forecast.shard_workers` at a
time), into `rankings` (and the `candidates` of the pipeline stage it is, if any); a registered model's
lists go through `prediction_cache`.

`forecast_shard` is the plain stage function; `forecast_shard_task` is its Prefect wrapper. The
forecaster only ever sees a forecasting-store connection (the gold store is unreachable from it)
and the materialized pre-target records of the shard.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextvars import copy_context
from functools import lru_cache
from itertools import islice

import polars as pl
from prefect import task

from dxr.errors import InputError
from models.baselines import FORECASTER_COLUMNS, RANKING_COLUMNS, Forecaster
from models.llm.config import ModelPrice
from models.llm.telemetry import with_report_time_costs
from models.prior.config import ARCHS
from models.registry import FUSED_INPUTS, LLM_SYSTEMS, check_system, forecaster_class
from tasks import stage_logger
from warehouse.run_outputs import calls_written_before_cost
from warehouse.runs import EVALUATE_KIND, check_run_id, check_run_kind, code_version, mark_stale
from warehouse.schemas import NON_RUN_TABLES, utc_now
from warehouse.store import Warehouse

# Systems that are a stage of the forecasting pipeline (spec §2): their lists are also written as that
# stage's `candidates`, the input of the stages after them.
CANDIDATE_STAGES = {"ehr_prior": "candidate_generation", "direct": "direct_forecast"}
# Candidate Generation's list pi_F is the prior's top 20 (spec §2), whatever K the run's rankings hold: the stages
# after it take its set as their seed set B.
CANDIDATE_GENERATION_SIZE = 20


def forecast_config(cohort_id: str, system: str, split: str, k: int, limit: int | None,
                    subject_id: int | None = None) -> dict:
    """What a forecast run records in `runs.config_json`; a run id names one such configuration per system.

    `subject_id` (one patient's trajectories, an ad-hoc rerun) is recorded only when given, so a
    cohort run's configuration reads as it always has.
    """
    config = {"system": system, "split": split, "k": k, "limit": limit, "cohort": cohort_id}
    if subject_id is not None:
        config["subject_id"] = subject_id
    return config


# The keys an LLM system's run records about its model, prompts and request settings (see `llm_run_config`).
LLM_RUN_KEYS = ("llm_backend", "llm_model", "llm_model_identity", "prompt_versions", "llm_temperature", "llm_seed",
                "llm_max_output_tokens", "llm_context_window", "llm_chars_per_token", "llm_response_format",
                "llm_validation_retries", "llm_max_tokens_field")


def llm_run_config(system: str, data_dir) -> dict:
    """What a system that asks a language model records besides `forecast_config`: its backend, model, which
    model answers, prompt versions and request settings (empty for the others; `rrf_prior_direct` only fuses
    lists)."""
    if system != "direct":
        return {}
    from dxr.config import load_settings
    from tasks.direct import direct_run_config

    return direct_run_config(load_settings(data_dir=data_dir).llm, data_dir)


def check_rerun(wh: Warehouse, run_id: str | None, config: dict) -> None:
    """Refuse a run id that holds forecasts of another cohort, this system's forecast under other
    options (unless it failed, was killed, is still recorded `running` or made no list), a mean over
    repeated runs, or the record of a build, an ingest or a training (`check_run_kind`).

    Rerunning with the same options redoes the forecast; with other options the run's rankings,
    status and metrics would mix two configurations.
    """
    if run_id is None:
        return
    check_run_id(run_id)  # before it is used in a file pattern or a lock name
    check_run_kind(wh, run_id, f"forecast:{config['system']}")  # as the flow's registered run would, but at once
    registered = wh.read("runs", run_id=run_id)
    # A mean over repeated runs is stored under an id of its own (`dxr evaluate --run-id`): lists forecast into it
    # would be evaluated over its metrics, and its `evaluate` row would describe neither.
    evaluation = registered.filter(pl.col("kind") == EVALUATE_KIND)["config_json"].to_list()
    averaged = json.loads(evaluation[0]).get("runs") if evaluation else None
    if averaged:
        raise InputError(f"run {run_id} holds the mean over repeated runs {', '.join(averaged)} (dxr evaluate): "
                         f"pass a new --run-id for the forecast, or delete the mean first (`dxr run delete {run_id}`)")
    other_cohorts = registered.filter(
        pl.col("kind").str.starts_with("forecast:") & (pl.col("cohort_id") != config["cohort"]))
    if other_cohorts.height:
        first = other_cohorts.row(0, named=True)
        if other_cohorts["status"].is_in(("failed", "killed")).all():  # not one still `running`, which may be alive
            # Still the other cohort's run: the shards a failed forecast wrote stay until it is redone (evaluation
            # would find lists of two cohorts), and its `runs` rows name that cohort, by which `dxr cohort delete
            # --with-runs` deletes the whole run, lists of this cohort included.
            failed = ", ".join(f"{kind.removeprefix('forecast:')} {status}" for kind, status in
                               other_cohorts.sort("kind").select("kind", "status").iter_rows())
            raise InputError(f"run {run_id} holds no finished forecast, only ones of cohort {first['cohort_id']} "
                             f"({failed}), and this one is of cohort {config['cohort']}: a run stays on the cohort "
                             f"it was started on even when none of its forecasts finished; pass a new --run-id, "
                             f"redo them on their cohort with --cohort {first['cohort_id']} --run-id {run_id}, or "
                             f"delete the run first (`dxr run delete {run_id}`)")
        raise InputError(f"run {run_id} already holds forecasts of cohort {first['cohort_id']} ({first['kind']}), "
                         f"this one is of cohort {config['cohort']}: one run compares systems on one cohort, and a "
                         "cohort name follows its newest build (other options, or a dataset registered again); pass "
                         f"--cohort {first['cohort_id']} to add to this run, a new --run-id, or, to discard that run, "
                         f"delete it first (`dxr run delete {run_id}`)")
    own = registered.filter(pl.col("kind") == f"forecast:{config['system']}")
    # A forecast that failed or was killed holds no configuration worth keeping: whatever of it was written is
    # cleared before the redo (`clear_outputs`), so it may be redone with corrected options (a missing --limit).
    # `running` is one killed by SIGKILL that no run has marked `killed` yet; one still alive holds the run-system
    # lock, under which the flow checks again, and is refused there as being forecast.
    if own.is_empty() or own["status"][0] in ("failed", "killed", "running"):
        return
    # Nor does one that finished without a single list (every trajectory `failed`, say an LLM whose replies all
    # broke the contract): `dxr forecast` tells the user to fix the cause and rerun, which may mean other settings.
    lists = wh.read("ranking_status", run_id=run_id, system=config["system"])
    if lists.height and (lists["status"] == "failed").all():
        return
    def options(config: dict) -> dict:
        # The model version is what the alias resolved to, and the cut rule version the cohort's build had, not
        # options: a rerun uses the current ones.
        return {key: value for key, value in config.items() if key not in ("model", "cut_rule_version")}

    recorded = options(json.loads(own["config_json"][0]))
    current = options(json.loads(json.dumps(config, sort_keys=True, default=str)))
    # A run recorded before LLM systems recorded a setting cannot say which it used: not compared on it.
    current = {key: value for key, value in current.items() if key in recorded or key not in LLM_RUN_KEYS}
    changed = [f"{key} {recorded.get(key)!r} -> {current.get(key)!r}"
               for key in sorted(current.keys() | recorded.keys()) if recorded.get(key) != current.get(key)]
    if changed:
        raise InputError(f"run {run_id} already holds a forecast by {config['system']} with other options "
                         f"({', '.join(changed)}): rerun with the recorded options, pass a new --run-id, or delete "
                         f"the run first (`dxr run delete {run_id}`: every system's lists and its evaluation go)")


def clear_outputs(wh: Warehouse, run_id: str, system: str, prices: dict[str, ModelPrice]) -> list[str]:
    """Remove a system's earlier rankings, status, stage candidates and evaluation of a run before it is redone,
    with those of the fused systems that read its lists, and move their LLM telemetry to `superseded_llm_calls`
    (`supersede_llm_calls`, which prices calls recorded before costs were stored at `prices`); returns those fused
    systems.

    Every shard is recomputed anyway; clearing first means a shard that is not written this time
    (the cohort was re-sharded) cannot survive as a stale partition. A fused system's lists of the
    run were made from the lists being replaced, so they go too (the caller says to forecast it
    again). The run's paired comparisons and headroom involve every system, so they go too: `dxr
    evaluate` writes them again.
    """
    fused = [other for other, sources in FUSED_INPUTS.items()
             if system in sources and wh.has_rows("ranking_status", run_id=run_id, system=other)]
    # The registry must not go on calling finished what is about to go: the fused systems' forecasts and the
    # run's evaluation are `stale` until they are run again. Marked first, so a process killed among the
    # deletions below leaves them stale, not finished over half-deleted rows.
    for cleared in fused:
        mark_stale(wh, run_id, f"forecast:{cleared}")
    mark_stale(wh, run_id, EVALUATE_KIND)
    for cleared in (system, *fused):
        # Statuses before lists: a status row tells a fused system that the trajectory's list exists.
        for table in ("ranking_status", "rankings", "metrics", "evaluation_coverage"):
            wh.delete(table, run_id=run_id, system=cleared)
        if cleared in CANDIDATE_STAGES:
            wh.delete("candidates", run_id=run_id, stage=CANDIDATE_STAGES[cleared])
        if cleared in LLM_SYSTEMS:
            supersede_llm_calls(wh, run_id, cleared, prices)
    for table in ("paired_comparisons", "headroom"):
        wh.delete(table, run_id=run_id)
    return fused


def supersede_llm_calls(wh: Warehouse, run_id: str, stage: str, prices: dict[str, ModelPrice]) -> None:
    """Move a stage's `llm_calls` rows of a run into `superseded_llm_calls`: the calls were made and paid for even
    though the outputs they made are being replaced, so the run's spend keeps them.

    One commit writes them there and removes them from `llm_calls`, so a process killed during the move leaves
    them in one table, never both or neither. The partition is named by a digest of the moved call ids, so each
    move has its own and the same calls could only ever replace their copy, not add one. A row written before
    costs were stored is priced now, at `prices`, as the report prices those that stay in `llm_calls`.
    """
    calls = wh.read("llm_calls", run_id=run_id, stage=stage)
    if calls.is_empty():  # nothing to keep, but a stopped shard may have left a file without a row
        wh.delete("llm_calls", run_id=run_id, stage=stage)
        return
    calls = with_report_time_costs(calls, prices, pl.col("call_id").is_in(calls_written_before_cost(wh, run_id)))
    digest = hashlib.sha256("\n".join(sorted(calls["call_id"])).encode()).hexdigest()[:16]
    wh.write_together([("superseded_llm_calls", calls.with_columns(pl.lit(utc_now()).alias("superseded_at")),
                        {"run_id": run_id, "stage": stage, "calls": digest})],
                      removals=[("llm_calls", {"run_id": run_id, "stage": stage})])


def pinned_model(wh: Warehouse, cohort_id: str, system: str) -> dict | None:
    """The registered model version a learned system's run will use (None for a system without one).

    Resolved from the alias once, before the run starts: every shard then loads this version even if
    the alias moves meanwhile, and the run records it (`runs.config_json` key `model`).
    """
    if system not in ARCHS:
        return None
    return forecaster_class(system).resolve(wh.root, cohort_id)


def make_forecaster(system: str, model_version: str | None = None, model_run_id: str | None = None) -> Forecaster:
    check_system(system)
    cls = forecaster_class(system)
    return cls() if model_version is None else cls(version=model_version, run_id=model_run_id)


@lru_cache(maxsize=8)
def _fitted(wh_root: str, cohort_id: str, system: str, model_version: str | None,
            model_run_id: str | None) -> Forecaster:
    forecaster = make_forecaster(system, model_version, model_run_id)
    forecaster.fit(Warehouse(wh_root).connect(tables=NON_RUN_TABLES), cohort_id)
    return forecaster


_fitting = threading.Lock()


def fitted_forecaster(wh_root: str, cohort_id: str, system: str, model_version: str | None = None,
                      model_run_id: str | None = None) -> Forecaster:
    """Fit once per process, cohort and registered version (None: the one the alias points to at the first
    call) with its MLflow run id when pinned (see `pinned_model`); every shard task of a run reuses it."""
    # The run id is part of the key because a reset or another tracking store numbers its versions from 1
    # again: a long-lived process (`dxr serve`) would otherwise serve the model it loaded from the old one.
    # Through one positional form: lru_cache keys `f(a, b, c)` and `f(a, b, c, None)` apart, and a
    # second key would load the same model twice. Under a lock: shards running at once would each
    # fit it (lru_cache does not make concurrent callers of one key wait for the first). The forecast
    # flow fits before its shards start, so that a failing load fails once.
    with _fitting:
        return _fitted(wh_root, cohort_id, system, model_version, model_run_id)


fitted_forecaster.cache_clear = _fitted.cache_clear


def shard_workers(system: str, limit: int | None, configured: int) -> int:
    """How many shards of a forecast run at once: `forecast.shard_workers` for models and baselines, one
    for LLM systems (their client already keeps the server busy with concurrent calls) and under a
    limit (each shard's count decides how many trajectories the next one may take)."""
    return 1 if system in LLM_SYSTEMS or limit is not None else configured


def run_shards(run: Callable[[int, int | None], int], shards: list[int], workers: int,
               limit: int | None = None) -> int:
    """Call `run(shard, remaining)` for each shard, `workers` at a time, and return the trajectories forecast.

    One worker runs the shards in this thread, in order, passing what is left of `limit` (None without
    one): a signal stops the shard under way, as it stops any command. More workers run them in
    threads, each in a copy of this thread's context (a Prefect task called there is a task run of
    the flow). After a failure no shard starts, and the error is raised only once the shards under
    way have ended (written or failed too): nothing is written into a run after it is recorded failed.
    The first failed shard's error is raised; another failed shard's error, if it says something else,
    is logged on one line, since the run ends with the first one only.
    """
    if workers == 1:
        done = 0
        for shard in shards:
            if limit is not None and done >= limit:
                break
            done += run(shard, None if limit is None else limit - done)
        return done
    if limit is not None:
        raise ValueError("a forecast with a limit runs one shard at a time")
    queue, done, shard_of = iter(shards), 0, {}

    def start(count: int) -> set[Future]:
        started = {pool.submit(copy_context().run, run, shard, None): shard for shard in islice(queue, count)}
        shard_of.update(started)
        return set(started)

    with ThreadPoolExecutor(workers, thread_name_prefix="shard") as pool:
        under_way = start(workers)
        while under_way:
            ended, under_way = wait(under_way, return_when=FIRST_COMPLETED)
            if any(future.exception() is not None for future in ended):
                wait(under_way)
                failed = sorted((future for future in ended | under_way if future.exception() is not None),
                                key=lambda future: (future not in ended, shard_of[future]))
                _log_other_failures(failed[0].exception(), [(shard_of[f], f.exception()) for f in failed[1:]])
                raise failed[0].exception()
            done += sum(future.result() for future in ended)
            under_way |= start(len(ended))
    return done


def _log_other_failures(raised: BaseException, others: list[tuple[int, BaseException]]) -> None:
    said = {_one_line(raised)}
    for shard, error in others:
        if _one_line(error) not in said:
            said.add(_one_line(error))
            stage_logger(__name__).error("shard %d failed too: %s", shard, _one_line(error))


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def forecast_shards(wh: Warehouse, cohort_id: str, split: str, subject_id: int | None = None) -> list[int]:
    """The shards a forecast visits: those holding trajectories of the split, or of the patient in the
    split (none for a patient is an input error: a mistyped id or a patient outside the split).

    An empty split is an input error too: the forecast would finish having written nothing, and only
    `dxr evaluate` would then say the run has no rankings (the MIMIC-III demo has no held_out patient)."""
    trajectories = wh.read("trajectories", cohort_id=cohort_id)
    if split != "all":
        counts = trajectories.group_by("split").len().sort("split").rows()
        trajectories = trajectories.filter(pl.col("split") == split)
        if trajectories.is_empty():
            found = ", ".join(f"{name} {n}" for name, n in counts) or "none at all"
            raise InputError(f"cohort {cohort_id} has no trajectory in split {split} (it has {found}): forecast "
                             "a split that has some (all covers every split)")
    if subject_id is not None:
        trajectories = trajectories.filter(pl.col("subject_id") == subject_id)
        if trajectories.is_empty():
            where = "" if split == "all" else f" in split {split} (split all covers every split)"
            raise InputError(f"patient {subject_id} has no trajectory in cohort {cohort_id}{where}: check the "
                             "subject id against the cohort's trajectories table")
    return sorted(trajectories["shard"].unique().to_list())


def shard_inputs(wh: Warehouse, cohort_id: str, shard: int, split: str, limit: int | None = None,
                 subject_id: int | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Trajectories of one shard (restricted to a split, an optional patient and an optional limit) and
    their pre-target events."""
    trajectories = wh.read("trajectories", cohort_id=cohort_id).filter(pl.col("shard") == shard)
    if split != "all":
        trajectories = trajectories.filter(pl.col("split") == split)
    if subject_id is not None:
        trajectories = trajectories.filter(pl.col("subject_id") == subject_id)
    if limit is not None:
        trajectories = trajectories.head(limit)
    pretarget = wh.read("pretarget_events", cohort_id=cohort_id, shard=shard).join(
        trajectories.select("trajectory_id"), on="trajectory_id", how="semi")
    return trajectories.sort("trajectory_id"), pretarget


def forecast_shard(forecaster: Forecaster, trajectories: pl.DataFrame, pretarget: pl.DataFrame, k: int,
                   run_id: str, cohort_id: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Rankings and per-trajectory status of one shard; a list shorter than k is marked `short`.

    The forecaster gets each trajectory's identity only: its cutoff time and target encounter are the
    boundary's, not a forecasting input.
    """
    ranked = forecaster.predict(trajectories.select(FORECASTER_COLUMNS), pretarget, k)
    if ranked.select(pl.struct("trajectory_id", "code").is_duplicated().any()).item():
        raise AssertionError(f"{forecaster.system} returned duplicate codes in run {run_id}")
    return with_run(ranked, run_id, cohort_id, forecaster.system), shard_status(
        ranked, trajectories, k, run_id, forecaster.system)


def with_run(ranked: pl.DataFrame, run_id: str, cohort_id: str, system: str) -> pl.DataFrame:
    return ranked.with_columns(pl.lit(run_id).alias("run_id"), pl.lit(cohort_id).alias("cohort_id"),
                               pl.lit(system).alias("system"))


def shard_status(ranked: pl.DataFrame, trajectories: pl.DataFrame, k: int, run_id: str, system: str) -> pl.DataFrame:
    """`ranking_status` rows of a shard: ok, or short with `n of k codes` when a list holds fewer than k."""
    lengths = trajectories.select("trajectory_id").join(
        ranked.group_by("trajectory_id").agg(pl.len().alias("n")), on="trajectory_id", how="left"
    ).with_columns(pl.col("n").fill_null(0))
    return lengths.select(
        pl.lit(run_id).alias("run_id"), pl.lit(system).alias("system"), "trajectory_id",
        pl.when(pl.col("n") >= k).then(pl.lit("ok")).otherwise(pl.lit("short")).alias("status"),
        pl.when(pl.col("n") >= k).then(None).otherwise(pl.format("{} of {} codes", "n", pl.lit(k))).alias("detail"))


def prediction_key(wh: Warehouse, forecaster: Forecaster, cohort_id: str, shard: int, trajectories: pl.DataFrame,
                   k: int) -> dict | None:
    """The inputs that fix a shard's predictions by a fitted model, or None for a forecaster without a
    `model_key` (recomputed every time).

    The registered model version, the trajectories and their pre-target records (the shard's file, by
    content), K and the code version (featurization is code too) decide the ranked lists, and so do the
    forecaster's `inference_settings()` (the thread count torch predicts with in this thread, the batch size),
    which round the scores otherwise and may order near-ties otherwise.
    """
    model = getattr(forecaster, "model_key", None)
    if model is None:
        return None
    pretarget_file = wh.partition_path("pretarget_events", cohort_id=cohort_id, shard=shard)
    ids = "\n".join(sorted(trajectories["trajectory_id"].to_list()))
    return {"system": forecaster.system, "model": model, "cohort_id": cohort_id, "shard": shard, "k": k,
            "code_version": code_version(), **forecaster.inference_settings(),
            "n_trajectories": trajectories.height,
            "trajectory_ids_sha256": hashlib.sha256(ids.encode()).hexdigest(),
            "pretarget_sha256": hashlib.sha256(pretarget_file.read_bytes() if pretarget_file.is_file() else b"")
            .hexdigest()}


def cached_forecast_shard(wh: Warehouse, forecaster: Forecaster, trajectories: pl.DataFrame, pretarget: pl.DataFrame,
                          k: int, run_id: str, cohort_id: str, shard: int) -> tuple[pl.DataFrame, pl.DataFrame, bool]:
    """`forecast_shard` through `prediction_cache`: (rankings, status, whether they came from the cache).

    A model's predictions depend only on the key's inputs, so a later run (a nightly backfill, a rerun
    under another run id) with the same registered version reads them instead of recomputing them.
    """
    key_inputs = prediction_key(wh, forecaster, cohort_id, shard, trajectories, k)
    if key_inputs is None:
        return *forecast_shard(forecaster, trajectories, pretarget, k, run_id, cohort_id), False
    key_json = json.dumps(key_inputs, sort_keys=True)
    key = hashlib.sha256(key_json.encode()).hexdigest()[:32]
    system = forecaster.system
    ranked = wh.read("prediction_cache", system=system, cache_key=key).select(*RANKING_COLUMNS)
    if ranked.height:
        return with_run(ranked, run_id, cohort_id, system), shard_status(ranked, trajectories, k, run_id, system), True
    ranked, status = forecast_shard(forecaster, trajectories, pretarget, k, run_id, cohort_id)
    wh.write("prediction_cache", ranked.select(
        pl.lit(system).alias("system"), pl.lit(key).alias("cache_key"), pl.lit(key_json).alias("key_json"),
        *RANKING_COLUMNS), system=system, cache_key=key)
    return ranked, status, False


def stage_candidates(ranked: pl.DataFrame, pretarget: pl.DataFrame, stage: str) -> pl.DataFrame:
    """A stage's `candidates` rows: the native codes of its rankings (run_id, cohort_id and system filled)
    with the number of pre-target encounters that record each code in the trajectory's own record.

    Diagnosis events without an encounter count together as one encounter.
    """
    history = (pretarget.filter(pl.col("code").str.starts_with("DIAGNOSIS//"))
               .unique(["trajectory_id", "code", "encounter_id"])
               .group_by("trajectory_id", "code").agg(pl.len().cast(pl.Int32).alias("history_count")))
    return (ranked.filter(pl.col("native"))
            .join(history, on=["trajectory_id", "code"], how="left")
            .with_columns(pl.col("history_count").fill_null(0), pl.lit(stage).alias("stage"))
            .select("run_id", "cohort_id", "stage", "system", "trajectory_id", "rank", "code", "score",
                    "history_count")
            .sort("trajectory_id", "rank"))


def write_shard_outputs(wh: Warehouse, system: str, shard: int, run_id: str, ranked: pl.DataFrame,
                        status: pl.DataFrame, pretarget: pl.DataFrame, stage_list: pl.DataFrame | None = None) -> None:
    """Write a system's rankings of one shard, its stage candidates when it is a pipeline stage (from
    `stage_list` when the stage's list is not the rankings), then the per-trajectory status."""
    wh.write("rankings", ranked, run_id=run_id, system=system, shard=shard)
    if system in CANDIDATE_STAGES:
        stage = CANDIDATE_STAGES[system]
        wh.write("candidates", stage_candidates(ranked if stage_list is None else stage_list, pretarget, stage),
                 run_id=run_id, stage=stage, shard=shard)
    wh.write("ranking_status", status, run_id=run_id, system=system, shard=shard)


def status_counts(wh: Warehouse, run_id: str) -> pl.DataFrame:
    """Trajectories per (system, status) in a run's `ranking_status`: (system, status, len)."""
    return wh.read("ranking_status", run_id=run_id).group_by("system", "status").len().sort("system", "status")


@task(name="forecast-shard")
def forecast_shard_task(wh_root: str, cohort_id: str, system: str, shard: int, split: str, k: int, run_id: str,
                        limit: int | None = None, subject_id: int | None = None,
                        model_version: str | None = None, model_run_id: str | None = None) -> int:
    """Prefect wrapper: fit (from the forecasting store only), predict one shard, write its partitions.

    `model_version` and `model_run_id` pin a learned system's registered version (see `pinned_model`)."""
    wh = Warehouse(wh_root)
    trajectories, pretarget = shard_inputs(wh, cohort_id, shard, split, limit, subject_id)
    if trajectories.is_empty():
        return 0
    if system in LLM_SYSTEMS:
        return llm_shard(wh, cohort_id, system, shard, trajectories, pretarget, k, run_id)
    forecaster = fitted_forecaster(wh_root, cohort_id, system, model_version, model_run_id)
    generates_candidates = CANDIDATE_STAGES.get(system) == "candidate_generation"
    depth = max(k, CANDIDATE_GENERATION_SIZE) if generates_candidates else k
    listed, status, cached = cached_forecast_shard(wh, forecaster, trajectories, pretarget, depth, run_id, cohort_id,
                                                   shard)
    if cached:
        stage_logger(__name__).info("%s shard %d: %d trajectories' lists read from the prediction cache",
                                    system, shard, trajectories.height)
    ranked = listed.filter(pl.col("rank") <= k)
    if depth > k:  # the status says whether the run's k-code lists are full, not the deeper ones pi_F needed
        status = shard_status(ranked, trajectories, k, run_id, system)
    stage_list = listed.filter(pl.col("rank") <= CANDIDATE_GENERATION_SIZE) if generates_candidates else None
    write_shard_outputs(wh, system, shard, run_id, ranked, status, pretarget, stage_list)
    return trajectories.height


def llm_shard(wh: Warehouse, cohort_id: str, system: str, shard: int, trajectories: pl.DataFrame,
              pretarget: pl.DataFrame, k: int, run_id: str) -> int:
    from dxr.config import load_settings
    from tasks.direct import direct_shard, rrf_prior_direct_shard

    if system == "direct":
        return direct_shard(wh, cohort_id, shard, trajectories, pretarget, k, run_id, load_settings().llm)
    return rrf_prior_direct_shard(wh, cohort_id, shard, trajectories, k, run_id)
