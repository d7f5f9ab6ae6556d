"""Flow `cohort-backfill`: forecast a cohort split with several systems into one new run, evaluate it
and render its report.

This is what a scheduled deployment runs (`dxr serve`, `[[backfills]]` in the configuration): each
firing makes a fresh run id, so successive backfills stay side by side in `rankings` and `metrics`
and can be compared with SQL; a retry of a firing (`flow_run_id`) finishes that firing's run. Systems
run in the order given, so a fused system finds its inputs. The headline table also goes to a Prefect
artifact keyed by the backfill's name (`backfill_artifact_key`), so the Prefect UI shows how each firing
did without opening the warehouse.

With `refresh` a firing first brings the cohort up to date: when its dataset was registered again since the
cohort was built (a nightly extract), rules other than this dxr's cut it (`cut_rule_version`), or a build of it was
cut short (killed or failed, leaving it unregistered), the task `refresh-cohort` builds it again under its name and
options, and
a `train_prior` subflow trains each learned system that has no model in service for the cohort (promoted, so the
forecast finds it under the configured alias). Both are recorded under the run id `<run id>-refresh`, so a
retried firing resumes them rather than building or training twice.
"""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from dxr.config import BackfillConfig
from flows import flow_run_id
from flows.forecast import forecast_flow
from flows.train_prior import train_prior_flow
from models.prior.config import PriorConfig
from models.registry import check_system_order
from tasks.evaluate import DEFAULT_KS, evaluate_run_task
from tasks.refresh import refresh_cohort_task, untrained_systems
from tasks.report import ARTIFACT_K, artifact_key, headline_markdown, render_report_task
from warehouse.store import Warehouse

BACKFILL_SYSTEMS = tuple(BackfillConfig.model_fields["systems"].default)  # one default for flow and settings


def backfill_budgets(k: int) -> tuple[int, ...]:
    """The K values a backfill's run is evaluated at: the default ones below its list length k, and k.

    A list of k codes is `ok` at k and silently short above it, which evaluation refuses.

    >>> backfill_budgets(20), backfill_budgets(10), backfill_budgets(5), backfill_budgets(30)
    ((10, 20), (10,), (5,), (10, 20, 30))
    """
    return tuple(x for x in DEFAULT_KS if x < k) + (k,)


def backfill_artifact_key(name: str | None, cohort: str) -> str:
    """The Prefect artifact key of a backfill's firings, one version per firing: `backfill-<name>`.

    Keyed by the backfill (its deployment's name), not its cohort: two backfills of one
    cohort (other systems or splits) would otherwise take turns as its latest version. A flow run without
    a name (called directly, not by a deployment) goes under its cohort's name. Underscores become dashes,
    as Prefect keys take lower-case letters, digits and dashes only.
    """
    return artifact_key("backfill", name or cohort)


@flow(name="cohort-backfill", flow_run_name="backfill-{cohort}")
def cohort_backfill_flow(data_dir: str, cohort: str, systems: tuple[str, ...] = BACKFILL_SYSTEMS,
                         split: str = "held_out", k: int = 20, limit: int | None = None,
                         run_id: str | None = None, name: str | None = None, refresh: bool = False) -> str:
    """Forecast `split` of `cohort` with each system into one run, write its metrics and report; returns
    the run id.

    Args:
        data_dir: the warehouse's data directory (set by `dxr serve`).
        cohort: the cohort's name or id (`dxr cohort list`).
        systems: the systems to run, in order; a fused system (`rrf_prior_direct`) after the systems it fuses.
        split: the trajectories to forecast: train, tuning, held_out or all.
        k: codes per list; the run is evaluated at the default budgets below k and at k.
        limit: at most this many trajectories per system; empty for the whole split.
        run_id: redo this run (its earlier lists are replaced); empty for a new run `backfill-…`.
        name: the backfill's deployment name: its name in `[[backfills]]`, followed by `-NAME` when served by
            `dxr serve --name NAME`; its headline table is the artifact `backfill-<name>` (`backfill-<cohort>`
            without one).
        refresh: first build the cohort again when its dataset was registered again since it was built, other
            rules than this dxr's cut it or a build of it was cut short, and train each learned system that has no
            model for the cohort; the cohort must be named by its name.
    """
    systems = tuple(systems)
    check_system_order(systems)
    run_id = run_id or flow_run_id("backfill")
    forecast_cohort = cohort
    if refresh:
        forecast_cohort = refresh_cohort_task(data_dir, cohort, f"{run_id}-refresh")
        if untrained := untrained_systems(data_dir, forecast_cohort, systems):
            # Promoted whatever prior.promote says, as ensure_prior does: no model of this cohort is in service to
            # be kept from a challenger, and the forecast next resolves the alias.
            train_prior_flow(data_dir, forecast_cohort, untrained, PriorConfig(promote=True), f"{run_id}-refresh")
    for system in systems:
        forecast_flow(data_dir, forecast_cohort, system, split=split, k=k, limit=limit, run_id=run_id)
    evaluate_run_task(data_dir, run_id, ks=backfill_budgets(k))
    report = render_report_task(data_dir, run_id)
    create_markdown_artifact(markdown=headline_markdown(Warehouse(data_dir), run_id, report, min(k, ARTIFACT_K)),
                             key=backfill_artifact_key(name, cohort),
                             description=f"cohort {cohort}, {split}: run {run_id}")
    return run_id
