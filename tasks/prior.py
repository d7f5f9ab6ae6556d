"""Training stage of the learned priors (`ehr_prior`, `dense_prior`, `gru`).

`train_prior` is the plain stage function: forecasting-store connection in (train patients' full
records, tuning pre-target records), a registered MLflow model out, a `runs` row recorded.
`train_prior_task` is its Prefect wrapper. `ensure_prior` trains only when the alias resolves to
nothing (the demo's once-per-cohort-build training), and then puts that model in service.
`prior_versions` and `promote_prior` list the registered versions and move the alias.
`run_prior_config` lays the fields a flow run sets over the configured prior settings.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import TYPE_CHECKING

from prefect import task
from pydantic import ValidationError

from dxr.config import load_settings
from dxr.errors import InputError, NotFoundError
from models.prior import tracking
from models.prior.config import PriorConfig, check_model_version, check_prior_system, check_prior_systems
from tasks import stage_logger
from warehouse.checkpoints import remove_training_checkpoint, training_checkpoint
from warehouse.cohorts import get_cohort, outdated_cut_note, reading_cohort, rebuild_command
from warehouse.runs import registered_run
from warehouse.schemas import NON_RUN_TABLES
from warehouse.store import Warehouse, fetch_frame

if TYPE_CHECKING:
    from mlflow.entities import Run as MlflowRun

    from models.prior.train import EpochReport, TrainResult


def train_prior(data_dir: str, cohort: str, system: str, cfg: PriorConfig, run_id: str | None = None,
                progress: bool = False) -> TrainResult:
    """Train `system` on a cohort (by name or id) and register it; the run is recorded in `runs`.

    A run id whose training of `system` already finished with the same settings, and whose version is
    still registered, returns that training instead of repeating it (see `finished_training`); one whose
    earlier attempt registered a version and then failed takes that version (`registered_training`). A given run id's
    training writes a resume checkpoint after each finished epoch (`warehouse.checkpoints`), and an earlier attempt
    of the same training (settings and cohort build) killed or failed is continued after its last finished epoch;
    the checkpoint goes once the training is recorded finished. A generated run id is new: nothing to continue.
    """
    from models.prior.train import (CheckpointPlace, TrainResult, registered_training,  # Lightning is slow to import
                                    train_prior_model)

    check_prior_system(system)  # before the run is registered: a typo is no failed training
    wh = Warehouse(data_dir)
    with reading_cohort(wh, cohort) as cohort_row:
        cohort_id = cohort_row["cohort_id"]
        config = {"system": system, "cohort": cohort_id, "prior": cfg.model_dump()}
        if run_id is not None and (done := finished_training(wh, run_id, config)) is not None:
            stage_logger(__name__).info("%s: already trained in run %s (registered %s v%s), not trained again",
                                        system, run_id, done["registered_model"], done["version"])
            remove_training_checkpoint(wh.root, run_id, system)  # left by a process killed just after recording it
            # The alias recorded is where the training put it; a promotion since may have moved it elsewhere.
            return TrainResult(**{**done, "alias": alias_on(system, cohort_id, cfg.alias, done["version"])})
        if outdated := outdated_cut_note(wh, cohort_row):
            # Training reads the train patients' full records, which no cut rule changes, but selects its epoch on
            # the tuning patients' pre-target records, which the cohort's rules cut.
            stage_logger(__name__).warning("%s; this training validates on its tuning records as they are, and `%s` "
                                           "cuts it again", outdated,
                                           rebuild_command(cohort_row, load_settings(data_dir=data_dir).seed))
        with registered_run(wh, f"train:{system}", config, run_id=run_id, cohort_id=cohort_id) as run:
            identity = training_identity(run.run_id, config)
            tracking.use_tracking(wh.root, cfg.tracking_uri, cfg.experiment)
            for killed in tracking.end_killed_attempts(lambda attempt: killed_attempt(wh, attempt, run.run_id, system)):
                stage_logger(__name__).info("%s: MLflow run %s of a killed training ended as KILLED", system, killed)
            # Only a given run id can have had an earlier attempt.
            result = None
            if run_id is not None:
                result = registered_training(system, cohort_id, cfg, identity)
            if result is not None:
                stage_logger(__name__).info("%s: an earlier attempt of run %s registered %s v%s, not trained again",
                                            system, run.run_id, result.registered_model, result.version)
            else:
                # The cohort's build too: one built again under its id holds other records.
                checkpoint = None if run_id is None else CheckpointPlace(
                    training_checkpoint(wh.root, run_id, system),
                    {**identity, "dxr.cohort_built_at": cohort_row["created_at"].isoformat()})
                result = train_prior_model(wh.connect(tables=NON_RUN_TABLES), cohort_id, system, cfg, wh.root,
                                           progress=progress, report_epoch=epoch_reporter(system, cfg.epochs),
                                           identity=identity, log=stage_logger(__name__).info, checkpoint=checkpoint)
            run.config = {**config, "result": asdict(result)}
        remove_training_checkpoint(wh.root, run.run_id, system)
    return result


def alias_on(system: str, cohort_id: str, alias: str, version: str) -> str | None:
    """`alias` when it points at the version of a system's registered model for a cohort now, else None."""
    try:
        return alias if tracking.resolve_alias(system, cohort_id, alias)[0] == version else None
    except NotFoundError:
        return None


def killed_attempt(wh: Warehouse, attempt: MlflowRun, run_id: str, system: str) -> bool:
    """Whether an MLflow run still RUNNING belongs to a training whose process was killed: an earlier attempt of
    this one (run `run_id`'s training of `system`, whose record lock the caller holds; whatever its settings, since
    one killed before the retry changed them is as dead), or a training that the registry records as killed
    (`warehouse.runs.mark_killed`, which `registered_run` has just run). Another training still running, and a run
    the registry does not hold (another data dir's, in a shared tracking store), are left as they are."""
    attempt_run, attempt_system = attempt.data.tags.get("dxr.run_id"), attempt.data.tags.get("system")
    if attempt_run is None or attempt_system is None:
        return False
    if (attempt_run, attempt_system) == (run_id, system):
        return True
    recorded = wh.read("runs", run_id=attempt_run, kind=f"train:{attempt_system}")
    return recorded["status"].to_list() == ["killed"]


def end_killed_trainings(data_dir: str, configured: PriorConfig, trainings: list[dict]) -> list[str]:
    """End as KILLED the MLflow runs still RUNNING of killed trainings, given as their `runs` rows (run_id, kind,
    config_json), each in the tracking store and experiment it recorded (else the configured ones); returns their
    MLflow run ids.

    For `dxr cohort delete`, which removes those rows: without them no later training can tell that the MLflow runs
    belong to killed trainings (`killed_attempt`), and they would show RUNNING for good.
    """
    by_experiment: dict[tuple[str | None, str], set[tuple[str, str]]] = {}
    for row in trainings:
        prior = json.loads(row["config_json"]).get("prior", {})
        where = (prior.get("tracking_uri", configured.tracking_uri), prior.get("experiment", configured.experiment))
        by_experiment.setdefault(where, set()).add((row["run_id"], row["kind"].removeprefix("train:")))
    ended = []
    for (uri, experiment), killed in sorted(by_experiment.items(), key=str):
        tracking.use_tracking(data_dir, uri, experiment)
        ended += tracking.end_killed_attempts(
            lambda attempt: (attempt.data.tags.get("dxr.run_id"), attempt.data.tags.get("system")) in killed)
    return ended


def run_prior_config(data_dir: str, cfg: PriorConfig | None) -> PriorConfig:
    """The configured prior settings with the fields `cfg` sets (`model_fields_set`) over them.

    Prefect merges a run's parameters into its deployment's one level deep: a run of `train_prior/adhoc`
    given `cfg={"promote": false}` receives every other field at its default, not at the configured value
    the deployment's `cfg` holds (the experiment, the alias, a tracking server).
    """
    configured = load_settings(data_dir=data_dir).prior
    if cfg is None:
        return configured
    try:
        return PriorConfig.model_validate(configured.model_dump() | cfg.model_dump(include=cfg.model_fields_set))
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise InputError(f"cfg of this run: {reason} with the configured prior settings (the run sets "
                         f"{', '.join(sorted(cfg.model_fields_set))}): set the clashing settings in cfg together"
                         ) from None


def training_identity(run_id: str, config: dict) -> dict[str, str]:
    """MLflow run tags naming one training: the dxr run and a digest of its settings (system, cohort, prior)."""
    settings = json.dumps(config, sort_keys=True, default=str)
    return {"dxr.run_id": run_id, "dxr.training": hashlib.sha256(settings.encode()).hexdigest()[:16]}


def finished_training(wh: Warehouse, run_id: str, config: dict) -> dict | None:
    """The recorded result of the run's finished training with exactly these settings, when the version it
    registered is still that training's model; else None.

    A retried `train_prior` flow run (or a rerun of the same run id) then resumes: the systems trained
    before the failure are not trained, and registered as new versions, again. A store that has lost the
    version, or numbers another model with it (reset, replaced), gets a new training.
    """
    row = wh.read("runs", run_id=run_id, kind=f"train:{config['system']}")
    if row.is_empty() or row["status"][0] != "finished":
        return None
    recorded = json.loads(row["config_json"][0])
    result = recorded.pop("result", None)
    if result is None or recorded != json.loads(json.dumps(config, sort_keys=True, default=str)):
        return None
    prior = config["prior"]
    tracking.use_tracking(wh.root, prior["tracking_uri"], prior["experiment"])
    try:
        registered_run_id = tracking.version_run(config["system"], config["cohort"], result["version"])
    except NotFoundError:
        return None
    return result if registered_run_id == result["mlflow_run_id"] else None


def epoch_reporter(system: str, epochs: int) -> EpochReport:
    """One log line per finished epoch, its tuning P@20 and R@20 and its time: long trainings (an epoch takes
    minutes at MIMIC-IV scale) show progress in the Prefect run's log and on the console."""
    logger = stage_logger(__name__)

    def report(epoch: int, metrics: dict[str, float], seconds: float) -> None:
        precision, recall = metrics.get("val_precision_at_20"), metrics.get("val_recall_at_20")
        tuning = ("P@20, R@20 n/a (no tuning pair)" if recall is None else
                  f"P@20 {precision:.4f}, R@20 {recall:.4f}")
        logger.info("%s epoch %d/%d: train loss %.4f, tuning %s after %.1f s", system, epoch + 1, epochs,
                    metrics.get("train_loss", float("nan")), tuning, seconds)
    return report


def ensure_prior(data_dir: str, cohort_id: str, system: str, cfg: PriorConfig) -> str:
    """The version the configured alias of `system` points to for the cohort; when the alias points
    nowhere, a model is trained, registered and put in service first (a rerun reuses it).

    The alias is set whatever `prior.promote` says: nothing is in service to be protected from a
    challenger, and the caller forecasts with the alias next. Without it every call would train
    another unaliased version and the forecast would still find none.
    """
    tracking.use_tracking(data_dir, cfg.tracking_uri, cfg.experiment)
    try:
        return tracking.resolve_alias(system, cohort_id, cfg.alias)[0]
    except NotFoundError:
        return train_prior(data_dir, cohort_id, system, cfg.model_copy(update={"promote": True}),
                           progress=True).version


def prior_versions(data_dir: str, cohort: str, systems: tuple[str, ...], cfg: PriorConfig) -> list[dict]:
    """Every registered version of the systems' models for a cohort (by name or id), newest first per system."""
    check_prior_systems(systems)  # a system listed twice would list each of its versions twice
    wh = Warehouse(data_dir)
    cohort_id = get_cohort(wh, cohort)["cohort_id"]
    if not tracking.read_tracking(data_dir, cfg.tracking_uri):
        return []
    return [{"cohort_id": cohort_id, **row} for system in systems
            for row in tracking.registered_versions(system, cohort_id)]


def lost_versions_note(data_dir: str, cohort: str, systems: tuple[str, ...], listed: list[dict],
                       cfg: PriorConfig) -> str | None:
    """What `dxr prior models` notes when a system lists no version although `runs` records finished trainings of it
    on the cohort: the store in force is not the one they registered in (prior.tracking_uri changed since), or that
    store lost them (replaced, reset or deleted). None when every such system lists versions or was never trained."""
    wh = Warehouse(data_dir)
    cohort_id = get_cohort(wh, cohort)["cohort_id"]
    unlisted = [f"train:{system}" for system in systems if not any(row["system"] == system for row in listed)]
    if not unlisted:
        return None
    trainings = fetch_frame(wh.connect(tables=["runs"]),
                            "SELECT run_id, kind, config_json FROM runs WHERE cohort_id = ? AND status = 'finished' "
                            "AND list_contains(?, kind) ORDER BY started_at", [cohort_id, unlisted])
    if trainings.is_empty():
        return None
    default = tracking.sqlite_uri(tracking.default_store(data_dir))
    store = cfg.tracking_uri or default
    stores = {json.loads(config).get("prior", {}).get("tracking_uri") or default
              for config in trainings["config_json"]}
    trained = sorted({kind.removeprefix("train:") for kind in trainings["kind"]})
    runs = list(dict.fromkeys(trainings["run_id"]))
    named = ", ".join(runs[:3]) + (f" and {len(runs) - 3} more" if len(runs) > 3 else "")
    said = (f"note: the MLflow store {store} holds no version of the {', '.join(trained)} model(s) of cohort "
            f"{cohort_id}, though run(s)")
    if others := sorted(stores - {store}):
        return (f"{said} {named} registered them in {', '.join(others)}: set prior.tracking_uri (env "
                "DXR_PRIOR__TRACKING_URI) to that store to list and use them")
    return (f"{said} {named} registered them there: the store was replaced, reset or deleted since; restore it, or "
            f"train again with `dxr prior train --cohort {cohort_id}{''.join(f' --system {t}' for t in trained)}`")


def promote_prior(data_dir: str, cohort: str, system: str, version: str, cfg: PriorConfig,
                  run_id: str | None = None) -> dict:
    """Point the configured alias of a system's registered model for a cohort at `version` (a rollback,
    or a model trained with `promote = false` made champion); recorded in `runs` as `promote:<system>`
    with the version the alias pointed to before. Forecasts started afterwards use the new version."""
    check_model_version(version)
    wh = Warehouse(data_dir)
    cohort_id = get_cohort(wh, cohort)["cohort_id"]
    tracking.use_tracking(data_dir, cfg.tracking_uri, cfg.experiment)
    tracking.version_run(system, cohort_id, version)  # a typo fails here, before a run is recorded
    config = {"system": system, "cohort": cohort_id, "alias": cfg.alias, "version": version}
    with registered_run(wh, f"promote:{system}", config, run_id, cohort_id=cohort_id) as run:
        previous = tracking.set_alias(system, cohort_id, version, cfg.alias)
        run.config = {**config, "previous_version": previous}
    return {"run_id": run.run_id, **run.config}


@task(name="train-prior")
def train_prior_task(data_dir: str, cohort: str, system: str, cfg: PriorConfig, run_id: str | None = None) -> dict:
    return asdict(train_prior(data_dir, cohort, system, cfg, run_id))
