"""Benchmark: the EHR Prior against the oracles and every baseline on a synthetic cohort.

Steps (each timed; training and inference of each system run in a fresh child process so that
its peak RSS is its own):
1. synthetic dataset (`--patients`, `--seed`) and its default cohort, unless already built;
2. train `gru`, `dense_prior`, `ehr_prior` (train patients; validation on tuning pre-target views),
   registered in MLflow under the warehouse;
3. forecast `held_out` with every system into one run (plain stage functions, `forecast.shard_workers`
   shards at a time as the forecast flow runs them: model resolution/loading, pre-target tables in,
   rankings written), timed end to end;
4. inference throughput of each system over every trajectory of the cohort (split `all`);
5. evaluation on held_out: P@10/R@10/P@20/R@20 with patient bootstrap 95% CIs, recall on
   new-onset and repeated target codes, paired differences of ehr_prior against each peer and
   each oracle (`oracle`: latent state; `record_oracle`: what the record reveals), and the ratio
   of ehr_prior's R@20 to each oracle's.

Prints its progress on stderr, then one table on stdout, and writes JSON to
benchmarks/results/prior[-<name>].json.

    python benchmarks/prior.py --data-dir /tmp/prior_bench/wh5k [--patients 5000] [--seed 7]
    python benchmarks/prior.py --planted 400 --data-dir /tmp/prior_planted   # smoke test only
    python benchmarks/prior.py --data-dir D --cohort mimic3demo --eval-split all   # smoke test only: D holds the
        # MIMIC-III demo's cohort (dxr ingest mimic3, dxr cohort build); it has no held_out trajectory, so the
        # scores are in-sample, and the benchmark prints a note that says so
    python benchmarks/prior.py --data-dir /tmp/wh200k --patients 200000 --systems repeat_history,ehr_prior
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue as queue_module
import re
import resource
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

from benchmarks.provenance import write_result  # noqa: E402
import polars as pl  # noqa: E402

from models.prior.config import PriorConfig  # noqa: E402
from tasks.evaluate import ORACLES  # noqa: E402
from warehouse.schemas import utc_now  # noqa: E402
from warehouse.store import Warehouse  # noqa: E402

LEARNED = ("gru", "dense_prior", "ehr_prior")
BASELINES = ("global_frequency", "repeat_history", "transition")
PEERS = ("repeat_history", "transition", "gru", "dense_prior", "global_frequency")
DEFAULT_PATIENTS, DEFAULT_SEED = 5000, 7
BOOTSTRAP_SEED = 0


def say(line: str) -> None:
    """A progress line on stderr, as `dxr synth` prints its own, at once (a child process's output otherwise waits in
    its buffer): stdout holds the table and the results file's path alone."""
    print(line, file=sys.stderr, flush=True)


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child(queue, fn, args):
    try:
        queue.put(("ok", fn(*args)))
    except BaseException as exc:  # report the failure to the parent instead of hanging it
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


class ChildFailed(RuntimeError):
    """A step's child process raised, or ended without a result (killed): its one-line reason."""


def child_result(queue, process, step: str):
    """The (status, value) a child puts on `queue`; ChildFailed when it ends without one (killed before it could).

    The queue is polled: a blocked read would wait forever for a child the out-of-memory killer ended, and would let
    a SIGINT sent to this process land in another thread, unseen."""
    while process.is_alive():
        try:
            return queue.get(timeout=1)
        except queue_module.Empty:
            pass
    try:  # it may have reported just before it ended
        return queue.get(timeout=1)
    except queue_module.Empty:
        code = process.exitcode
        reason = (f"was killed by signal {-code} ({signal.Signals(-code).name})" if code < 0
                  else f"exited with code {code}")
        advice = "rerun the same command"
        if code == -signal.SIGKILL:
            advice = ("most often the out-of-memory killer ends a process so: free memory or give it more, then "
                      + advice)
        raise ChildFailed(f"the child process of {step} {reason} before it reported a result; {advice}") from None


def in_child(fn, *args):
    """Run fn(*args) in a fresh spawned process; returns its result (which includes its own peak RSS)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=_child, args=(queue, fn, args))
    process.start()
    try:
        status, value = child_result(queue, process, fn.__name__)
    except BaseException:
        process.terminate()  # an interrupted benchmark leaves no step running on without it
        raise
    finally:
        process.join()
    if status != "ok":
        raise ChildFailed(value)
    return value


def train_one(data_dir: str, cohort_id: str, system: str, cfg_json: str) -> dict:
    from dataclasses import asdict

    from tasks.prior import train_prior

    result = asdict(train_prior(data_dir, cohort_id, system, PriorConfig.model_validate_json(cfg_json)))
    return {**result, "peak_rss_mb": peak_mb()}


def forecast_one(data_dir: str, cohort_id: str, system: str, split: str, run_id: str) -> dict:
    """Every shard of the split through the forecast stage, `forecast.shard_workers` at a time as the forecast
    flow runs them; times the model resolution/loading and the shard loop apart.

    `load_seconds`: for learned systems, resolve the alias in MLflow and load that version (`fit`).
    `shard_seconds`: per shard read the pre-target tables, predict, write rankings, candidates, the
    prediction cache entry and statuses.
    End to end = both; module imports (torch, mlflow and its SQL store, polars) are process start-up
    and excluded. `cpu_seconds`: the CPU time (user and system, every thread) the process spent end to end; on a
    machine shared with other work it varies less than the wall time, and so shows a change of the code better.
    """
    from dxr.config import load_settings
    from models.registry import forecaster_class
    from tasks.forecast import (fitted_forecaster, forecast_shard_task, forecast_shards, pinned_model, run_shards,
                                shard_workers)

    forecaster_class(system)  # module imports are process start-up, not inference
    # So is MLflow's SQL store, which fit imports lazily when it resolves the alias (≈ 0.7 s).
    import mlflow.store.model_registry.sqlalchemy_store  # noqa: F401
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
    wh = Warehouse(data_dir)
    shards = forecast_shards(wh, cohort_id, split)  # as the forecast flow does
    workers = shard_workers(system, None, load_settings(data_dir=data_dir).forecast.shard_workers)
    # Lists of an earlier run with the same model would be read back, not predicted: time the model.
    wh.delete("prediction_cache", system=system)
    started, cpu_started = time.perf_counter(), time.process_time()
    model = pinned_model(wh, cohort_id, system)  # as the forecast flow does: resolve the alias once
    version, model_run_id = (model["version"], model["mlflow_run_id"]) if model else (None, None)
    fitted_forecaster(str(wh.root), cohort_id, system, version, model_run_id)
    loaded = time.perf_counter()
    n = run_shards(lambda shard, _: forecast_shard_task.fn(str(wh.root), cohort_id, system, shard, split, 20, run_id,
                                                           model_version=version, model_run_id=model_run_id),
                   shards, workers)
    done, cpu_done = time.perf_counter(), time.process_time()
    return {"system": system, "split": split, "trajectories": n, "shard_workers": workers,
            "model_version": version, "model_run_id": model_run_id,
            "load_seconds": loaded - started,
            "shard_seconds": done - loaded, "seconds": done - started, "patients_per_second": n / (done - started),
            "warm_patients_per_second": n / (done - loaded), "cpu_seconds": cpu_done - cpu_started,
            "peak_rss_mb": peak_mb()}


def or_default(value, default):
    return default if value is None else value


def reused_dataset(wh: Warehouse, cohort: dict, args) -> dict:
    """What a cohort already in the data dir was built on: {dataset_id, source, patients, seed}, the last two None
    for data not made by the synthetic generator. An InputError when --patients or --seed asks for other data: the
    benchmark would measure this cohort and report the numbers asked for."""
    from dxr.errors import InputError
    from warehouse.synthetic import generation_parameters

    dataset = wh.read("datasets", dataset_id=cohort["dataset_id"]).row(0, named=True)
    made = {"patients": None, "seed": None}
    if dataset["source"] == "synthetic":
        generated = generation_parameters(wh.meds_dir(dataset["dataset_id"]))
        made = {"patients": generated["patients"], "seed": generated["seed"]}
    asked = {"patients": args.patients, "seed": args.seed}
    differing = [f"--{option} {value}" for option, value in asked.items()
                 if value is not None and value != made[option]]
    if differing:
        built_on = (f"synthetic data of {made['patients']} patients, seed {made['seed']}" if made["seed"] is not None
                    else f"dataset {dataset['dataset_id']} (source {dataset['source']}), which no seed generated")
        raise InputError(f"{' '.join(differing)}: cohort {cohort['name']} in {wh.root} is built on {built_on}; "
                         "leave the option out to benchmark that cohort, or give a new --data-dir for new data")
    return {"dataset_id": dataset["dataset_id"], "source": dataset["source"], **made}


def ensure_cohort(data_dir: str, args) -> tuple[str, dict]:
    """The cohort's id and what it was built on (`reused_dataset`), building the dataset and cohort first when
    needed. Runs in a child of its own: Linux carries a process's peak RSS across exec, so a parent that generated
    the data would lend its peak to every training and inference child measured after it."""
    from warehouse.cohorts import CohortOptions, build_cohort

    wh = Warehouse(data_dir)
    seed = or_default(args.seed, DEFAULT_SEED)
    if args.planted:
        from models.prior.planted import write_planted_cohort

        cohort_id = write_planted_cohort(wh, n_patients=args.planted, seed=seed, shard_size=500)
        return cohort_id, {"dataset_id": None, "source": "planted", "patients": args.planted, "seed": seed}
    cohorts = wh.read("cohorts")
    if cohorts.filter(pl.col("name") == args.cohort).height:
        cohort = cohorts.filter(pl.col("name") == args.cohort).row(0, named=True)
        return cohort["cohort_id"], reused_dataset(wh, cohort, args)
    if args.cohort != "default":  # a misspelt cohort of real data must not become a new synthetic one beside it
        from dxr.errors import InputError

        raise InputError(f"--cohort {args.cohort}: no cohort of that name in {wh.root} (it has: "
                         f"{', '.join(cohorts['name'].sort()) or 'none'}); build it with `dxr cohort build`, or leave "
                         "--cohort out to benchmark the synthetic default cohort")
    from warehouse.datasets import create_synthetic

    patients = or_default(args.patients, DEFAULT_PATIENTS)
    # A bar on a terminal; in a log (a 50k run under nohup) a line each tenth of the patients and each build step.
    create_synthetic(wh, "synthetic", patients, seed, progress=True, log=say)
    cohort_id = build_cohort(wh, "synthetic", args.cohort, CohortOptions(), seed=seed, progress=True,
                             log=say)["cohort_id"]
    return cohort_id, {"dataset_id": "synthetic", "source": "synthetic", "patients": patients, "seed": seed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--patients", type=int, default=None,
                        help=f"synthetic patients to generate (default {DEFAULT_PATIENTS}); a cohort already in "
                             "--data-dir is reused only if it was generated so")
    parser.add_argument("--seed", type=int, default=None,
                        help=f"seed of the synthetic or planted data (default {DEFAULT_SEED}); checked as --patients")
    parser.add_argument("--cohort", default="default")
    parser.add_argument("--planted", type=int, default=0, help="smoke test on a planted cohort of N patients")
    parser.add_argument("--epochs", type=int, default=None, help="override prior.epochs")
    parser.add_argument("--patience", type=int, default=None,
                        help="set prior.patience: stop a training once N epochs in a row bring no better tuning R@20")
    parser.add_argument("--bootstrap", type=int, default=1000, help=f"bootstrap replicates (seed {BOOTSTRAP_SEED})")
    parser.add_argument("--skip-train", action="store_true", help="reuse the registered champions")
    parser.add_argument("--name", default=None, help="results file suffix")
    parser.add_argument("--eval-split", default="held_out", choices=["held_out", "tuning", "all"],
                        help="trajectories to score (MIMIC demo smoke: all, since it has no held_out)")
    parser.add_argument("--systems", default=",".join(BASELINES + LEARNED),
                        help="comma-separated systems to run (ehr_prior always; e.g. a scaling run of "
                             "repeat_history,ehr_prior)")
    args = parser.parse_args()
    asked = [name.strip() for name in args.systems.split(",")]  # "repeat_history, ehr_prior" as typed in a shell
    systems = [s for s in BASELINES + LEARNED if s in asked or s == "ehr_prior"]
    unknown = set(asked) - set(BASELINES + LEARNED)
    if unknown:
        parser.error(f"--systems: unknown {sorted(unknown)}; choose from {', '.join(BASELINES + LEARNED)}")
    # Checked now: the results file is written last, after what may be hours of training and forecasting.
    if args.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", args.name):
        parser.error(f"--name {args.name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or "
                     "digit (it becomes part of a file name in benchmarks/results/)")
    if Path(args.data_dir).exists() and not Path(args.data_dir).is_dir():
        parser.error(f"--data-dir {args.data_dir} is a file: give a directory (a missing one is created)")
    # Worker pools (the synthetic generator's) must not fork a process that already runs
    # polars/torch threads: forked children can deadlock on locks held by those threads.
    mp.set_start_method("spawn", force=True)

    wh = Warehouse(args.data_dir)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    cohort_id, dataset = in_child(ensure_cohort, str(wh.root), args)
    timings["dataset_and_cohort_seconds"] = time.perf_counter() - started
    trajectories = wh.read("trajectories", cohort_id=cohort_id)
    counts = dict(trajectories.group_by("split").len().iter_rows())
    cfg = PriorConfig(**{key: value for key, value in (("epochs", args.epochs), ("patience", args.patience))
                         if value is not None})
    if args.planted:
        cfg = cfg.model_copy(update={"min_code_count": 1})
    say(f"cohort {cohort_id}: {trajectories.height} trajectories {counts}")
    if args.eval_split != "all" and not counts.get(args.eval_split):  # before the trainings, not after them
        parser.error(f"--eval-split {args.eval_split}: cohort {cohort_id} has no trajectory in that split (it has "
                     f"{counts}); choose another, or all (every split, scores of train patients in-sample)")

    training = {}
    if not args.skip_train:
        for system in (s for s in LEARNED if s in systems):
            training[system] = in_child(train_one, str(wh.root), cohort_id, system, cfg.model_dump_json())
            t = training[system]
            validated = (f"val R@20 {t['metrics']['val_recall_at_20']:.3f}" if 'val_recall_at_20' in t['metrics']
                         else "no tuning pair to validate on")
            say(f"trained {system}: {t['train_seconds']:.0f} s, {t['n_train_patients']} patients, {validated} "
                f"(epoch {int(t['metrics']['selected_epoch']) + 1} of {int(t['metrics']['epochs_trained'])} trained), "
                f"peak {t['peak_rss_mb']:.0f} MB")

    run_id = f"bench-prior-{utc_now():%Y%m%dT%H%M%S}"  # UTC, as every run id
    inference = {}
    for system in systems:
        held = in_child(forecast_one, str(wh.root), cohort_id, system, args.eval_split, run_id)
        everyone = in_child(forecast_one, str(wh.root), cohort_id, system, "all", f"{run_id}-all")
        inference[system] = {"evaluated": held, "all": everyone}
        say(f"forecast {system}: {args.eval_split} {held['trajectories']} in {held['seconds']:.1f} s; all "
            f"{everyone['trajectories']}: load {everyone['load_seconds']:.1f} s + shards "
            f"{everyone['shard_seconds']:.1f} s = {everyone['patients_per_second']:.0f} patients/s end to end "
            f"({everyone['warm_patients_per_second']:.0f}/s once loaded; {everyone['cpu_seconds']:.2f} CPU-s), "
            f"peak {everyone['peak_rss_mb']:.0f} MB")

    from tasks.evaluate import evaluate, in_sample_note

    pairs = [("ehr_prior", peer) for peer in PEERS if peer in systems]
    gold = wh.connect(gold=True)
    oracles = [name for name, table in ORACLES.items() if gold.sql(
        f"SELECT count(*) FROM {table} WHERE cohort_id = ?", params=[cohort_id]).fetchall()[0][0] > 0]
    gold.close()
    pairs += [(name, "ehr_prior") for name in oracles]
    evaluation = evaluate(wh, run_id, ks=(10, 20), n_boot=args.bootstrap, seed=BOOTSTRAP_SEED, natural=False,
                          pairs=pairs)
    metrics, paired = evaluation.metrics, evaluation.paired

    wanted = [("all", 10, "precision_at_k"), ("all", 10, "recall_at_k"), ("all", 20, "precision_at_k"),
              ("all", 20, "recall_at_k"), ("new_onset", 20, "recall_at_k"), ("repeated", 20, "recall_at_k")]
    labels = ["P@10", "R@10", "P@20", "R@20", "R@20 new", "R@20 rep"]
    table = []
    for system in oracles + systems:
        row = {"system": system}
        for label, (subset, k, metric) in zip(labels, wanted):
            hit = metrics.filter((pl.col("system") == system) & (pl.col("subset") == subset) & (pl.col("k") == k)
                                 & (pl.col("metric") == metric))
            row[label] = hit.select("value", "ci_low", "ci_high").row(0) if hit.height else None
        inf = inference.get(system, {}).get("all")
        row["infer pat/s"] = inf["patients_per_second"] if inf else None
        row["warm pat/s"] = inf["warm_patients_per_second"] if inf else None
        row["train s"] = training.get(system, {}).get("train_seconds")
        row["train pat/s"] = training.get(system, {}).get("metrics", {}).get("train_patients_per_second")
        # The oracles are read from the gold store, not run: no process of theirs to measure.
        peaks = [m for m in (training.get(system, {}).get("peak_rss_mb"), inf["peak_rss_mb"] if inf else None) if m]
        row["peak MB"] = max(peaks) if peaks else None
        table.append(row)

    def cell(v):
        if v is None:
            return "—"
        if isinstance(v, tuple):
            value, low, high = v
            return f"{value:.3f} [{low:.3f},{high:.3f}]" if low is not None else f"{value:.3f}"
        return f"{v:.0f}"

    header = ["system"] + labels + ["infer pat/s", "warm pat/s", "train s", "train pat/s", "peak MB"]
    print()
    print(" | ".join(header))
    for row in table:
        print(" | ".join([row["system"]] + [cell(row[h]) for h in header[1:]]))

    diffs = paired.filter((pl.col("subset").is_in(["all", "new_onset"])) & (pl.col("k") == 20)
                          & (pl.col("metric") == "recall_at_k"))
    print("\npaired R@20 differences (bootstrap 95% CI):")
    for r in diffs.sort("subset", "system_b").iter_rows(named=True):
        interval = f" [{r['ci_low']:+.4f}, {r['ci_high']:+.4f}]" if r["ci_low"] is not None else ""  # --bootstrap 0
        print(f"  {r['system_a']} - {r['system_b']} [{r['subset']}]: {r['difference']:+.4f}{interval}  n={r['n']}")
    get = {row["system"]: row["R@20"][0] for row in table if row["R@20"]}
    ratios = {name: get["ehr_prior"] / get[name] for name in oracles}
    for name, ratio in ratios.items():
        print(f"ehr_prior R@20 / {name} R@20 = {ratio:.3f}" + (" (target >= 0.90)" if name == "oracle" else ""))
    # Scores of train patients (--eval-split all or train, as on the MIMIC-III demo) are no benchmark result.
    in_sample = in_sample_note(wh, run_id)
    if in_sample:
        print(f"note: {in_sample}")
    if args.eval_split != "held_out" and counts.get("tuning") and cfg.keep_best_epoch:
        print("note: the learned systems chose their epoch on the tuning patients' pre-target records, which "
              f"--eval-split {args.eval_split} scores; held_out is the split no choice has seen")
    if args.planted:  # its codes are planted so that a model that learns anything finds them
        print(f"note: a planted cohort of {args.planted} patients (--planted) is a smoke test of the wiring: its "
              "scores say nothing of the systems' quality, and it has no oracle")

    write_result(RESULTS / f"prior{'-' + args.name if args.name else ''}.json", {
        "cohort_id": cohort_id, "trajectories": counts, "patients": dataset["patients"], "seed": dataset["seed"],
        "dataset": dataset, "arguments": vars(args), "systems": systems,
        "bootstrap": {"replicates": args.bootstrap, "seed": BOOTSTRAP_SEED},
        "eval_split": args.eval_split, "prior_config": cfg.model_dump(),
        "planted_smoke": bool(args.planted),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "timings": timings,
        "training": training, "inference": inference, "table": table, "oracle_ratio_r20": ratios.get("oracle"),
        "record_oracle_ratio_r20": ratios.get("record_oracle"), "in_sample_note": in_sample,
        "paired": diffs.to_dicts(), "run_id": run_id}, indent=1, default=str)


if __name__ == "__main__":
    try:
        main()
    except ChildFailed as exc:  # its reason names what failed and what to do: a traceback of the parent adds nothing
        sys.exit(f"Error: {exc}")
