"""The deployments `dxr serve` offers a Prefect server: ad-hoc patient reruns, ad-hoc prior training and
scheduled backfills.

`forecast-patient/adhoc` has no schedule: it is started from the Prefect UI (or `prefect deployment
run`) with a cohort and a subject id. `train_prior/adhoc` retrains learned priors of a cohort, with
the configured `prior` settings as its editable defaults. Each `[[backfills]]` entry of the configuration becomes
`cohort-backfill/<name>` on its cron schedule, its firings' tables the versions of artifact `backfill-<name>`.
A serve given a name of its own (`dxr serve --name NAME`, one per data dir served to one Prefect server) appends
`-NAME` to each deployment's name, and so to each artifact key: deployments are the Prefect server's, one per
flow and name, so two serves of one name would share them.
Entry points are module paths, so a served flow run imports the installed packages wherever `dxr serve` was started.
"""

from __future__ import annotations

from prefect.client.schemas.schedules import CronSchedule
from prefect.deployments.runner import EntrypointType, RunnerDeployment

from dxr.config import BackfillConfig, Settings
from dxr.errors import ConfigError
from flows.backfill import backfill_artifact_key, cohort_backfill_flow
from flows.patient import forecast_patient_flow
from flows.train_prior import train_prior_flow
from warehouse.store import Warehouse

PATIENT_DEPLOYMENT = "adhoc"
TRAIN_DEPLOYMENT = "adhoc"
TAGS = ["dxr"]


def deployment_name(name: str, serve_name: str | None) -> str:
    """The name of deployment `name` served under `serve_name` (`dxr serve --name`); unchanged without one."""
    return f"{name}-{serve_name}" if serve_name else name


def build_deployments(settings: Settings, serve_name: str | None = None) -> list[RunnerDeployment]:
    """The patient-rerun and training deployments plus one scheduled deployment per configured backfill, each
    named for `serve_name` when given."""
    data_dir = str(settings.data_dir.resolve())  # served runs must not depend on the server's working directory
    deployments = [forecast_patient_flow.to_deployment(
        name=deployment_name(PATIENT_DEPLOYMENT, serve_name), parameters={"data_dir": data_dir}, tags=TAGS,
        entrypoint_type=EntrypointType.MODULE_PATH,
        description="Forecast one patient of a cohort with each system into a new run; the ranked codes are "
                    "in the flow run's log."),
        train_prior_flow.to_deployment(
            name=deployment_name(TRAIN_DEPLOYMENT, serve_name),
            parameters={"data_dir": data_dir, "cfg": settings.prior.model_dump()}, tags=TAGS,
            entrypoint_type=EntrypointType.MODULE_PATH,
            description="Train learned priors of a cohort on its train patients and register them in MLflow; "
                        "set cfg.promote to false to register a challenger without moving the alias.")]
    keys: dict[str, str] = {}
    for backfill in settings.backfills:
        name = deployment_name(backfill.name, serve_name)
        key = backfill_artifact_key(name, backfill.cohort)
        if key in keys:  # unique names can still share a key: `a_b` and `a-b`
            raise ConfigError(f"backfills {keys[key]!r} and {backfill.name!r} would publish under one Prefect "
                              f"artifact key {key!r} (underscores become dashes there): rename one")
        keys[key] = backfill.name
        description = (f"Forecast {backfill.split} of cohort {backfill.cohort} with {', '.join(backfill.systems)} "
                       "into a new run, evaluate it and render its report.")
        if backfill.refresh:
            description = ("First build the cohort again if its dataset was registered again since it was built, "
                           "older rules cut it or a build of it was cut short, and train its learned systems that "
                           "have no model for it. " + description)
        deployments.append(cohort_backfill_flow.to_deployment(
            name=name, schedules=[CronSchedule(cron=backfill.cron, timezone=backfill.timezone)],
            parameters={"data_dir": data_dir, "cohort": backfill.cohort, "systems": backfill.systems,
                        "split": backfill.split, "k": backfill.k, "limit": backfill.limit, "name": name,
                        "refresh": backfill.refresh},
            tags=TAGS, entrypoint_type=EntrypointType.MODULE_PATH,
            description=description))
    return deployments


def unbuilt_backfill_cohorts(wh: Warehouse, backfills: list[BackfillConfig]) -> list[str]:
    """A warning line per backfill whose cohort, by name or id, is not in the warehouse: every firing fails until
    it is built. A warning, not a refusal: it may be built after `dxr serve` starts."""
    cohorts = wh.read("cohorts")
    known = set(cohorts["cohort_id"].to_list()) | set(cohorts["name"].to_list())
    return [f"warning: backfill {b.name!r}: cohort {b.cohort!r} is not in the warehouse at {wh.root} (yet), and every "
            f"firing fails until it is: build it with `dxr cohort build --dataset DATASET --name {b.cohort}`"
            for b in backfills if b.cohort not in known]


def check_refreshing_backfills(wh: Warehouse, backfills: list[BackfillConfig]) -> None:
    """Refuse a backfill with `refresh = true` whose cohort is given by its id: an id stays on the files it was built
    from, so every firing would be refused (`tasks.refresh.refresh_cohort`); better said once, at start."""
    cohorts = wh.read("cohorts")
    names_by_id = dict(zip(cohorts["cohort_id"].to_list(), cohorts["name"].to_list()))
    for backfill in backfills:
        if backfill.refresh and backfill.cohort in names_by_id and backfill.cohort not in names_by_id.values():
            raise ConfigError(f"backfills {backfill.name!r}: cohort {backfill.cohort} is named by its id, which stays "
                              "on the files it was built from, so refresh = true could never refresh it: set cohort = "
                              f"{names_by_id[backfill.cohort]!r} (its name) or refresh = false")
