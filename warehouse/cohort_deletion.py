"""Deleting a cohort (`dxr cohort delete`): its tables in both stores, and on request the runs recorded on it.

What belongs to a cohort is read off the schemas, so a table added later is not forgotten: every table
partitioned by `cohort_id` first (its row, Ω, trajectories, records, targets, oracles), its `prediction_cache`
entries (keyed by a digest whose inputs name the cohort), the `runs` rows recorded on it, and the cohort's
copies of its priors under `<data_dir>/mlflow/cache` and the resume checkpoints its priors' trainings left under
`<data_dir>/mlflow/checkpoints` (`warehouse.checkpoints`). The runs whose results are on the cohort (forecasts and
evaluations, means over repeated runs included) go only with `with_runs`, and then with every table partitioned
by `run_id` first and their reports in the default place (`<data_dir>/reports/<run_id>`). The rows of its build,
its priors' trainings and their promotions in `runs` are the cohort's own record and go with it.

A prior's training that was killed (SIGKILL, the OOM killer) left its MLflow run RUNNING; a later training ends it
as KILLED because the registry records that training as killed (`tasks.prior.killed_attempt`). Once the delete has
removed that record nothing could, so the delete has them ended first (`end_killed_trainings`, the CLI's
`tasks.prior.end_killed_trainings`): as KILLED, never deleted, like the models.

Shared data stays: datasets, vocabularies, corpora, the page cache and the LLM response cache (content-addressed,
shared by every cohort). So do the registered MLflow models of the cohort's priors (`{system}-{cohort_id}`,
`models.prior.tracking.registered_name`): a cohort id hashes the dataset's files, options and seed, not the
warehouse, so a copied data dir with a configured (shared) tracking store holds models of the same names that
its own cohort still uses. `registered_models` names them, for the user to remove.

Everything goes in one removal commit of the forecasting store, with the cohort's `cohorts` row first, and a rerun
after a kill past its commit point finishes it, as every delete does (`warehouse.deletion`); its build's `runs` rows go
with it, so nothing else records that the cohort was there.

A cohort that a build cut short left unregistered (`warehouse.cohorts.unregistered_build`: half built, refused by
every reader) goes the same way, by its id or a name only it has: it has no `cohorts` row, and its builds' `runs`
rows, which name it, are what a rerun after a kill finds pending. Gone, they no longer make its name refused, and the
name means the newest cohort of it still registered.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field

import polars as pl

from dxr.errors import InputError, NotFoundError
from warehouse.checkpoints import CHECKPOINTS_DIR, remove_emptied_checkpoint_dirs, training_checkpoint
from warehouse.cohorts import describe_cohort, get_cohort, unregistered_build
from warehouse.deletion import INTERRUPTED_DONE, Removal, finish_interrupted, run_locks
from warehouse.locks import held, remove_unheld
from warehouse.runs import RESULT_KINDS, mark_killed
from warehouse.schemas import TABLES
from warehouse.store import Warehouse, fetch_frame

# Every table whose partitions are one cohort's (first key `cohort_id`), its row first: it is what finds the cohort.
COHORT_TABLES = ("cohorts", *sorted(name for name, spec in TABLES.items()
                                    if spec.partition_by[0] == "cohort_id" and name != "cohorts"))
SHOWN_RUNS = 5  # run ids an error names before it says how many more


class RunsOnCohort(InputError):
    """A cohort with results recorded on it, deleted without `with_runs`."""


@dataclass
class CohortDeletion(Removal):
    """What deleting a cohort removes (or removed), its row first, and the registered models that stay."""

    cohort: dict  # its `cohorts` row; of one a build cut short, what `unregistered_build` makes of its build
    runs: list[str]  # run ids with results on the cohort
    unbuilt: str | None = None  # how the build that left it unregistered ended, for a cohort a build cut short
    registered_models: list[str] = field(default_factory=list)  # MLflow models of its priors, which stay
    killed_trainings: list[dict] = field(default_factory=list)  # `runs` rows (run_id, kind, config_json) of them

    def described(self) -> str:
        """The cohort as the delete's first line names it."""
        if self.unbuilt is None:
            return describe_cohort(self.cohort)
        return f"{self.cohort['name']} ({self.cohort['cohort_id']}), not built ({self.unbuilt})"


def resolve_cohort(wh: Warehouse, name_or_id: str) -> tuple[dict, str | None]:
    """The `cohorts` row an id or a name names, or for a cohort that a build cut short left unregistered its options
    as `unregistered_build` gives them, with how that build ended (None for a registered cohort). A name that
    several cohorts share, a half-built one among them, is refused, since deleting the one the name means to other
    commands would rarely be what was meant."""
    cohorts = wh.read("cohorts")
    if name_or_id in cohorts["cohort_id"].to_list():
        return get_cohort(wh, name_or_id), None
    unregistered = unregistered_build(wh, name_or_id)
    named = [(row["cohort_id"], f"built {row['created_at']:%Y-%m-%d %H:%M} UTC") for row in
             cohorts.filter(pl.col("name") == name_or_id).sort("created_at").iter_rows(named=True)]
    # Asked by a name: the cohort's, or the one a build cut short was renaming it from (`unregistered_build`).
    if unregistered is not None and unregistered[0]["cohort_id"] != name_or_id:
        named.append((unregistered[0]["cohort_id"], f"not built: {unregistered[1]}"))
    if len(named) > 1:
        listed = ", ".join(f"{cohort_id} ({how})" for cohort_id, how in named)
        raise InputError(f"cohort name {name_or_id!r} names {len(named)} cohorts, oldest first: {listed}; "
                         "delete one by its id (`dxr cohort list` shows them)")
    if unregistered is not None:
        return unregistered
    return get_cohort(wh, name_or_id), None


def plan_deletion(wh: Warehouse, cohort: dict) -> CohortDeletion:
    """What deleting `cohort` (its `cohorts` row) with its runs removes."""
    cohort_id = cohort["cohort_id"]
    registry = wh.connect(tables=["runs", "prediction_cache"])
    recorded = fetch_frame(registry, "SELECT DISTINCT run_id, kind FROM runs WHERE cohort_id = ? ORDER BY ALL",
                           [cohort_id])
    results = recorded.filter(pl.any_horizontal(pl.col("kind").str.starts_with(kind) for kind in RESULT_KINDS))
    plan = CohortDeletion(cohort, sorted(set(results["run_id"])), locks=[f"cohort:{cohort_id}", *run_locks(recorded)])
    for table in COHORT_TABLES:
        plan.add(wh, table, cohort_id=cohort_id)
    # Of a run of another cohort that reused a run id (its build under the same --run-id), only the rows on this one.
    for run_id, kind in recorded.iter_rows():
        plan.add(wh, "runs", run_id=run_id, kind=kind)
    for run_id in plan.runs:
        plan.add_run_outputs(wh, run_id)
    cached = registry.execute("SELECT DISTINCT system, cache_key FROM prediction_cache "
                              "WHERE json_extract_string(key_json, '$.cohort_id') = ? ORDER BY ALL",
                              [cohort_id]).fetchall()
    for system, cache_key in cached:
        plan.add(wh, "prediction_cache", system=system, cache_key=cache_key)
    # `{system}-{cohort_id}` (`models.prior.tracking.download_model`): the cohort's copies of its priors.
    plan.directories += sorted(p for p in (wh.root / "mlflow" / "cache").glob(f"*-{cohort_id}") if p.is_dir())
    # The resume checkpoints its priors' trainings left (killed or failed: a finished one removes its own).
    trainings = [(run_id, kind.removeprefix("train:")) for run_id, kind in recorded.iter_rows()
                 if kind.startswith("train:")]
    plan.directories += [path.parent for run_id, system in trainings
                         if (path := training_checkpoint(wh.root, run_id, system)).parent.is_dir()]
    plan.registered_models = registered_models(cohort_id, recorded["kind"])
    plan.killed_trainings = fetch_frame(
        registry, "SELECT run_id, kind, config_json FROM runs WHERE cohort_id = ? AND starts_with(kind, 'train:') "
                  "AND status = 'killed' ORDER BY run_id, kind", [cohort_id]).to_dicts()
    return plan


def registered_models(cohort_id: str, kinds: Iterable[str]) -> list[str]:
    """The MLflow models (`{system}-{cohort_id}`) of the priors trained or promoted on a cohort, by its runs' kinds."""
    trained = {kind.split(":", 1)[1] for kind in kinds if kind.startswith(("train:", "promote:"))}
    return [f"{system}-{cohort_id}" for system in sorted(trained)]


def finish_interrupted_deletion(wh: Warehouse, name_or_id: str) -> CohortDeletion | None:
    """Finish the removal of the cohort `name_or_id` names that a delete killed after its commit point left pending,
    and say what it was; None when no pending removal names it.

    Looked for before any read, since the first read finishes every pending commit and the cohort is then gone.
    """
    unbuilt = None
    pending = finish_interrupted(wh, "cohorts", (pl.col("cohort_id") == name_or_id) | (pl.col("name") == name_or_id))
    if pending is None:
        # A half-built cohort had no `cohorts` row: the `runs` rows of its builds, which name it, went first.
        builds = (pl.col("kind") == "cohort") & pl.col("cohort_id").is_not_null() & (
            (pl.col("cohort_id") == name_or_id) | (pl.col("config_json").str.json_path_match("$.name") == name_or_id))
        if (pending := finish_interrupted(wh, "runs", builds)) is None:
            return None
        unbuilt = "a build of it did not finish"
    removed, runs = pending
    cohort = removed.row(0, named=True)
    if unbuilt is not None:  # the name its last build gave it
        last = removed.sort("started_at", "run_id").row(-1, named=True)
        cohort = {"cohort_id": last["cohort_id"], "name": json.loads(last["config_json"])["name"]}
    its_runs = runs.filter(pl.col("cohort_id") == cohort["cohort_id"])
    remove_unheld(wh, [f"cohort:{cohort['cohort_id']}", *run_locks(its_runs)])  # those the killed delete held too
    return CohortDeletion(cohort, [], registered_models=registered_models(cohort["cohort_id"], its_runs["kind"]),
                          unbuilt=unbuilt, interrupted=True)


def delete_cohort(wh: Warehouse, name_or_id: str, *, with_runs: bool, dry_run: bool = False,
                  end_killed_trainings: Callable[[list[dict]], object] | None = None) -> CohortDeletion:
    """Delete a cohort (by id, or by a name no other cohort has), with its runs when `with_runs`; returns what went
    (with `dry_run`, what would go: nothing is removed, though runs whose process is gone are recorded as killed,
    as any command looking at the runs in progress records them).

    The cohort is held as its build holds it and each of its runs as its evaluation does, so no forecast, training,
    build, evaluation or report of them runs meanwhile; a delete refused for that is simply run again later.
    `end_killed_trainings` is given the `runs` rows of the cohort's killed trainings before they go (see the module's
    docstring); a delete killed after it has ended their MLflow runs and before its commit point leaves them ended and
    the trainings recorded as killed, which is true either way.
    """
    if finished := finish_interrupted_deletion(wh, name_or_id):
        return finished
    cohort, unbuilt = resolve_cohort(wh, name_or_id)
    cohort_id = cohort["cohort_id"]
    label = f"{cohort['name']} ({cohort_id})"
    with held(wh, f"cohort:{cohort_id}", shared=False,
              busy=f"cohort {label} is in use by another dxr process (a forecast, a prior's training, an evaluation, "
                   "a report or a build)"), ExitStack() as runs_held:
        # Deleted, or a build unregistered it, meanwhile; or, half built, built or deleted meanwhile.
        if unbuilt is None and wh.read("cohorts", cohort_id=cohort_id).is_empty():
            raise NotFoundError(f"cohort {label} is no longer registered: `dxr cohort list` shows the cohorts")
        if unbuilt is not None and unregistered_build(wh, cohort_id) is None:
            raise NotFoundError(f"cohort {label} was built or deleted meanwhile: `dxr cohort list` shows the cohorts")
        mark_killed(wh)  # a training killed since the last run started is still `running` in the registry
        plan = plan_deletion(wh, cohort)
        plan.unbuilt = unbuilt
        if plan.runs and not with_runs:
            shown = ", ".join(plan.runs[:SHOWN_RUNS]) + (f" and {len(plan.runs) - SHOWN_RUNS} more"
                                                         if len(plan.runs) > SHOWN_RUNS else "")
            raise RunsOnCohort(f"cohort {label} has {len(plan.runs)} run(s) recorded on it ({shown}): pass "
                               "--with-runs to delete them, and everything they wrote, with it")
        for run_id in plan.runs:
            runs_held.enter_context(held(wh, f"run:{run_id}", shared=False,
                                         busy=f"run {run_id!r} of cohort {label} is being forecast, evaluated or "
                                              "reported by another dxr process"))
        if not dry_run:
            checkpoints = wh.root / CHECKPOINTS_DIR
            if plan.killed_trainings and end_killed_trainings is not None:
                end_killed_trainings(plan.killed_trainings)
            plan.remove(wh)  # the lock files of the cohort and its runs, held here, go as they are released
            for run_id in {path.parent.name for path in plan.directories if path.parent.parent == checkpoints}:
                remove_emptied_checkpoint_dirs(wh.root, run_id)
    return plan


def deletion_summary(wh: Warehouse, plan: CohortDeletion, dry_run: bool) -> str:
    """What `dxr cohort delete` prints: the cohort, then rows by table and the directories removed."""
    if plan.interrupted:
        return f"cohort {plan.described()}: {INTERRUPTED_DONE}\n"
    done = "would remove" if dry_run else "removed"
    runs = f"{len(plan.runs)} run(s) ({', '.join(plan.runs)})" if plan.runs else "no run"
    lines = [f"cohort {plan.described()}: {done} {runs} and these rows:", *plan.listing(wh, done)]
    return "\n".join(lines) + "\n"

