"""Refresh stage of a scheduled backfill (`[[backfills]]` with `refresh = true`): bring its cohort up to date
with its dataset's files before the cohort is forecast.

`refresh_cohort` builds a cohort again, under its name and with its options, when its dataset was registered
again since it was built (a nightly extract ingested under the same name) or when rules other than this dxr's cut it
(an upgrade of dxr); `untrained_systems` are the learned
systems whose configured alias resolves to no model for a cohort, which the backfill trains next. Both only look
at what is registered, so a retried firing redoes nothing that finished: a finished build leaves the cohort
current, and a finished training leaves its alias set.
"""

from __future__ import annotations

import json

from prefect import task

from dxr.config import load_settings
from dxr.errors import InputError, NotFoundError
from tasks import stage_logger
from tasks.forecast import pinned_model
from warehouse.cohorts import (CohortOptions, build_cohort, get_cohort, outdated_cut_note, rebuild_command,
                              superseded_note, unregistered_build)
from warehouse.store import Warehouse


def refresh_cohort(data_dir: str, cohort: str, run_id: str | None = None) -> str:
    """The id of the cohort named `cohort` once it holds its dataset's current files as this dxr's rules cut them;
    returns it unchanged when it does, else builds it again first (registered in `runs` as kind `cohort` under
    `run_id`). A cohort of the current files cut by other rules (`outdated_cut_note`) is built again under its own id,
    which its files, options and seed make: its models stay in service, since training reads the train patients'
    full records, which no cut rule changes. A cohort that a build cut short left unregistered (`unregistered_build`)
    is built again with that build's options, also when an older cohort of the name is still registered: the
    name means the cut-short build's options, which every reader of the name waits for.

    The build is `dxr cohort build`'s: the cohort's own target rule, harmonization, minimum history and seed, the
    configured shard size, oracle draws and memory limit. A cohort named by its id is refused: an id stays on the
    files it was built from, so a backfill of it would forecast the earlier files every night.
    """
    wh = Warehouse(data_dir)
    # A build cut short (killed, failed) left the cohort unregistered: finished with that build's
    # options, else every later firing would refuse it until the build was run by hand.
    if unregistered := unregistered_build(wh, cohort):
        row, how = unregistered
        why = f"cohort {row['name']} ({row['cohort_id']}) is not built: {how}"
    else:
        row = get_cohort(wh, cohort, suggest_build=True)
        # Superseded first: a cohort of earlier files is built again whatever rules cut it, under a new id.
        why = superseded_note(wh, row) or outdated_cut_note(wh, row)
    if row["cohort_id"] == cohort:
        raise InputError(f"refresh: cohort {cohort} is named by its id, which stays on the files it was built "
                         f"from: name the backfill's cohort by its name, {row['name']!r}, or set refresh = false")
    if why is None:
        return row["cohort_id"]
    settings = load_settings(data_dir=data_dir)
    stage_logger(__name__).info("%s; building it again from the current files, as `%s` does", why,
                                rebuild_command(row, settings.seed))
    options = CohortOptions(target=row["target_rule"], harmonize=row["harmonization"], min_history=row["min_history"])
    built = build_cohort(wh, row["dataset_id"], row["name"], options, seed=json.loads(row["options_json"])["seed"],
                         shard_size=settings.cohort.shard_size, oracle_draws=settings.synth.oracle_draws,
                         memory_limit=settings.cohort.memory_limit, log=stage_logger(__name__).info, run_id=run_id)
    stage_logger(__name__).info("cohort %s is now %s: %d trajectories", built["name"], built["cohort_id"],
                                built["n_trajectories"])
    return built["cohort_id"]


def untrained_systems(data_dir: str, cohort_id: str, systems: tuple[str, ...]) -> tuple[str, ...]:
    """The learned systems among `systems` whose configured alias resolves to no registered model for the cohort:
    the ones a forecast of it would refuse."""
    wh = Warehouse(data_dir)
    untrained = []
    for system in systems:
        try:
            pinned_model(wh, cohort_id, system)
        except NotFoundError:
            untrained.append(system)
    return tuple(untrained)


@task(name="refresh-cohort")
def refresh_cohort_task(data_dir: str, cohort: str, run_id: str | None = None) -> str:
    return refresh_cohort(data_dir, cohort, run_id)
