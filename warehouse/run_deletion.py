"""Deleting one run (`dxr run delete`): its `runs` rows, every row a table partitioned by `run_id` holds under it,
and its report in the default place (`<data_dir>/reports/<run_id>`). Only results go so: forecasts and evaluations
(`RESULT_KINDS`); a dataset's ingest, a cohort's build and its priors' trainings are the record of what they made
and go with it. A run id holding both (as one could before `check_run_kind`) goes with its cohort, which the refusal
names.

What belongs to a run is read off the schemas (`RUN_TABLES`, as a cohort's delete reads them), so a table added later
is not forgotten: its forecasts' rankings, statuses and stage candidates, its evaluation's metrics, coverage, paired
comparisons and headroom, its LLM calls, search jobs and ledger. Its `runs` rows go first: they are what finds it.

What is not the run's own stays: its cohort and the cohort's other runs; the `prediction_cache` (keyed by model
version, cohort, shard, K and code version, not by run: a later forecast of the cohort reuses those lists), the LLM
response cache and the page cache (content-addressed, shared by every run); and MLflow, whose runs and registered
models a training or a promotion recorded under the id keep.

A run that a mean over repeated runs averages (`dxr evaluate --run A --run B`) is refused, naming the means: they
would stand for runs that are gone. A mean is a run id of its own, whose delete removes only the mean's rows; its
runs can go after it.

Everything goes in one removal commit, and a rerun after a kill past its commit point finishes it, as every delete
does (`warehouse.deletion`).
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from dxr.errors import InputError
from warehouse.deletion import INTERRUPTED_DONE, Removal, finish_interrupted, run_locks
from warehouse.locks import remove_unheld
from warehouse.runs import EVALUATE_KIND, RESULT_KINDS, holding_run, unknown_run
from warehouse.store import Warehouse, check_run_id, fetch_frame


class RunInMeans(InputError):
    """A run that means over repeated runs average, deleted before those means."""


class NotAResult(InputError):
    """A run id that records what made data (an ingest, a cohort's build, a training), not a result."""


@dataclass
class RunDeletion(Removal):
    """What deleting a run removes (or removed), its `runs` rows first."""

    run_id: str
    registered: pl.DataFrame  # its `runs` rows: the kinds recorded under the id, and their cohorts
    cohorts: list[str]  # the cohorts its rows name, as `name (id)`


def means_over(wh: Warehouse, run_id: str) -> list[str]:
    """The run ids of the means over repeated runs that average `run_id` (their `evaluate` row lists it)."""
    registry = wh.connect(tables=["runs"])
    means = fetch_frame(registry, "SELECT DISTINCT run_id FROM runs WHERE kind = ? AND run_id <> ? AND "
                                  "list_contains(json_extract_string(config_json, '$.runs[*]'), ?) ORDER BY run_id",
                        [EVALUATE_KIND, run_id, run_id])
    return means["run_id"].to_list()


def plan_run_deletion(wh: Warehouse, run_id: str, registered: pl.DataFrame) -> RunDeletion:
    """What deleting the run whose `runs` rows are `registered` removes."""
    names = dict(wh.read("cohorts").select("cohort_id", "name").rows())
    cohorts = [f"{names[cohort_id]} ({cohort_id})" if cohort_id in names else cohort_id
               for cohort_id in registered["cohort_id"].drop_nulls().unique().sort()]
    plan = RunDeletion(run_id=run_id, registered=registered, cohorts=cohorts, locks=run_locks(registered))
    plan.add(wh, "runs", run_id=run_id)  # every kind recorded, and the run's directory with them
    plan.add_run_outputs(wh, run_id)
    return plan


def mixed_run_refusal(wh: Warehouse, run_id: str, registered: pl.DataFrame, records: list[str]) -> str:
    """Why a run id holding both results and records (`check_run_kind` refuses that since 2026-12-05, but a warehouse
    written before may hold one) is not deleted as a run, and the delete that removes it: its results' cohort's."""
    results = registered.filter(~pl.col("kind").is_in(records))
    cohort_ids = results["cohort_id"].drop_nulls().unique().sort().to_list()
    names = dict(wh.read("cohorts").select("cohort_id", "name").rows())
    deletes = " and ".join(f"`dxr cohort delete {cohort_id} --with-runs`" for cohort_id in cohort_ids)
    return (f"run {run_id!r} holds both results ({', '.join(sorted(results['kind'].unique()))}) and the record of "
            f"what a command made ({', '.join(records)}), as a run id could before dxr refused that: `dxr run "
            f"delete` deletes results only, and a record goes with what it made, so this run goes only with its "
            f"cohort{'s' * (len(cohort_ids) > 1)} {', '.join(names.get(c, c) for c in cohort_ids)}, every run on it "
            f"included: {deletes} (--dry-run first shows what goes)")


def delete_run(wh: Warehouse, run_id: str, *, dry_run: bool = False) -> RunDeletion:
    """Delete a run and everything it wrote; returns what went (with `dry_run`, what would go: nothing changes).

    The run is held as its evaluation holds it, so no forecast, evaluation or report of it runs meanwhile, nor a
    rebuild or delete of its cohort; a delete refused for that is simply run again later.
    """
    check_run_id(run_id)
    if pending := finish_interrupted(wh, "runs", pl.col("run_id") == run_id):
        removed, _ = pending
        remove_unheld(wh, run_locks(removed))  # those the killed delete held are among them
        return RunDeletion(run_id=run_id, registered=removed, cohorts=[], interrupted=True)
    if not wh.has_rows("runs", run_id=run_id):
        raise unknown_run(wh, run_id)
    with holding_run(wh, run_id, exclusive=True):
        registered = wh.read("runs", run_id=run_id)
        if registered.is_empty():  # deleted meanwhile
            raise unknown_run(wh, run_id)
        # Forecasts and evaluations hold the run's lock; another kind recorded under the id (a build or a training
        # given --run-id) does not, so refusing it also keeps a delete from racing one still running.
        if records := sorted({kind for kind in registered["kind"] if not kind.startswith(RESULT_KINDS)}):
            if len(records) < registered["kind"].n_unique():
                raise NotAResult(mixed_run_refusal(wh, run_id, registered, records))
            raise NotAResult(f"run {run_id!r} is a {', '.join(records)} run, not a forecast or an evaluation: a "
                             "dataset's ingest, a cohort's build and its priors' trainings and promotions record what "
                             "they made and go with it (`dxr cohort delete`)")
        if means := means_over(wh, run_id):
            raise RunInMeans(f"run {run_id!r} is averaged by the mean(s) over repeated runs {', '.join(means)}: "
                             "delete each of them first (`dxr run delete MEAN_ID`, which removes the mean's own rows "
                             "only), then the run")
        plan = plan_run_deletion(wh, run_id, registered)
        if not dry_run:
            plan.remove(wh)  # the run's own lock file, held here, goes as it is released
    return plan


def run_deletion_summary(wh: Warehouse, plan: RunDeletion, dry_run: bool) -> str:
    """What `dxr run delete` prints: the run with its kinds and cohorts, then rows by table and the directories."""
    kinds = ", ".join(sorted(plan.registered["kind"].unique()))
    if plan.interrupted:
        return f"run {plan.run_id} ({kinds}): {INTERRUPTED_DONE}\n"
    cohorts = ", ".join(plan.cohorts)
    done = "would remove" if dry_run else "removed"
    lines = [f"run {plan.run_id} ({kinds}){f' of cohort {cohorts}' if cohorts else ''}: {done} these rows:",
             *plan.listing(wh, done)]
    return "\n".join(lines) + "\n"
