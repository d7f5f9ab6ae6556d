"""MLflow layout of the EHR Prior: where runs live, how models are registered and resolved.

Default store: `sqlite:///<data_dir>/mlflow/mlflow.db` with artifacts in `<data_dir>/mlflow/artifacts`;
any tracking URI by configuration (`prior.tracking_uri`; a configured sqlite store keeps its artifacts
beside it too). One registered model per system and
cohort, named `{system}-{cohort_id}`; inference resolves `models:/{name}@{alias}`.

MLflow stores absolute artifact locations. The default store is the data dir's own, so it is re-pointed at
the data dir it is opened in (`relocate_store`): a moved, copied or restored data dir reads and writes
its own artifacts, never the original's. It is created whole or not at all (`create_default_store`), and so is a
configured sqlite store (`create_configured_store`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sqlite3
import sys
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import unquote

from dxr.errors import ConfigError, NotFoundError
from dxr.noise import silence_mlflow_registration_notices
from warehouse.duck import out_of_disk
from warehouse.locks import held
from warehouse.scratch import remove_abandoned, scratch
from warehouse.store import Warehouse

# Offline hygiene: no telemetry from MLflow (set before mlflow is imported).
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")

import mlflow  # noqa: E402
from mlflow import MlflowClient  # noqa: E402
from mlflow.entities import Run  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402

silence_mlflow_registration_notices()  # here, where every training and serving of a prior imports MLflow

BUNDLE_FILES = ("vocabulary.json", "prior_config.json", "net_config.json")
WEIGHTS = Path("data") / "model.pth"  # an `mlflow.pytorch` model's network, the last file a load needs
# What a store answers for a registered model, version or alias that does not exist (an unknown alias
# is an invalid parameter to MLflow); any other error is the store's, not a missing model.
ABSENT = frozenset({"RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"})
log = logging.getLogger(__name__)


def tracking_uri(data_dir: str | Path, configured: str | None) -> str:
    if configured:
        return configured
    db = default_store(data_dir)
    db.parent.mkdir(parents=True, exist_ok=True)
    return sqlite_uri(db)


def default_store(data_dir: str | Path) -> Path:
    """The sqlite file of the data dir's own MLflow store, used where `prior.tracking_uri` is not set."""
    return Path(data_dir).resolve() / "mlflow" / "mlflow.db"


def sqlite_uri(db: Path) -> str:
    """The tracking URI of the sqlite file `db`. SQLAlchemy decodes `%XX` in a URI's path and ends the path at `?`,
    so a data dir such as `/srv/100%20 data` or `/srv/why?` would open another file, or none: both are escaped,
    and nothing else. MLflow creates the parent directory of the path as the URI spells it, escapes and all, so a
    path escaped needlessly (`/srv/100% data`) would leave an empty `/srv/100%25 data/mlflow` beside the data dir.

    >>> sqlite_uri(Path("/srv/100%20 data/why?/100% sure/mlflow.db"))
    'sqlite:////srv/100%2520 data/why%3F/100% sure/mlflow.db'
    """
    return "sqlite:///" + re.sub(r"%(?=[0-9A-Fa-f]{2})", "%25", str(db)).replace("?", "%3F")


def sqlite_path(uri: str) -> str | None:
    """The path of a sqlite URI as SQLAlchemy reads it (options after `?` dropped, `%XX` decoded); None for others.

    >>> sqlite_path(sqlite_uri(Path("/srv/100%20 data/why?/mlflow.db")))
    '/srv/100%20 data/why?/mlflow.db'
    >>> sqlite_path("http://mlflow.internal:5000") is None
    True
    """
    return unquote(uri.removeprefix("sqlite:///").partition("?")[0]) if uri.startswith("sqlite:///") else None


def artifact_root(uri: str) -> str | None:
    """Artifacts of a new experiment: beside a local sqlite store (MLflow's own default would be
    `./mlruns` under whatever directory the process happens to run in); a server decides for itself.

    >>> artifact_root("sqlite:////srv/dxr/mlflow/mlflow.db")
    'file:///srv/dxr/mlflow/artifacts'
    >>> artifact_root("http://mlflow.internal:5000") is None
    True
    """
    path = sqlite_path(uri)
    return None if path is None else (Path(path).resolve().parent / "artifacts").as_uri()


def store_error(exc: Exception, action: str) -> ConfigError:
    """One line for an MLflow failure (server down, database locked, no permission, a damaged database) naming the
    store and the setting that chooses it, instead of a traceback from deep inside MLflow."""
    if full_disk(exc):
        return ConfigError(f"MLflow store {mlflow.get_tracking_uri()} failed while {action}: out of disk space: free "
                           "disk space there, or set prior.tracking_uri (env DXR_PRIOR__TRACKING_URI) to a store on a "
                           "disk with room")
    if database_error(exc):  # the database's own words; SQLAlchemy's text adds the statement and a web link
        reason = " ".join(str(getattr(exc, "orig", None) or exc).split())[:300]
        return ConfigError(f"MLflow store {mlflow.get_tracking_uri()} failed while {action}: {reason}: it must be a "
                           "readable and writable database (restore it from a backup if it is damaged), or set "
                           "prior.tracking_uri (env DXR_PRIOR__TRACKING_URI)")
    reason = " ".join(str(exc).split())[:300]
    return ConfigError(f"MLflow store {mlflow.get_tracking_uri()} failed while {action}: {reason}: check that it "
                       "is reachable and writable, or set prior.tracking_uri (env DXR_PRIOR__TRACKING_URI)")


def database_error(exc: Exception) -> bool:
    """Whether an error is SQLAlchemy's: MLflow's SQL stores let a damaged or unreadable database's errors out as
    SQLAlchemy's, not as their own. SQLAlchemy is loaded whenever it raised one, so a store that never imports it (a
    server) is not made to."""
    sqlalchemy_errors = sys.modules.get("sqlalchemy.exc")
    return sqlalchemy_errors is not None and isinstance(exc, sqlalchemy_errors.SQLAlchemyError)


def full_disk(exc: Exception) -> bool:
    """Whether an MLflow error says a disk is full: ENOSPC in the text of a failed artifact copy, or SQLite's own."""
    return out_of_disk(exc) or "database or disk is full" in str(exc)


@contextmanager
def store_errors(action: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        if not isinstance(exc, MlflowException) and not database_error(exc):
            raise
        raise store_error(exc, action) from exc


# Where MLflow keeps an absolute artifact location in its sqlite schema (version 3.x; 2.x lacks `logged_models`
# and `storage_location`, and kept a version's files in `source`).
LOCATION_COLUMNS = (("experiments", "artifact_location"), ("runs", "artifact_uri"),
                    ("logged_models", "artifact_location"), ("model_versions", "storage_location"),
                    ("model_versions", "source"))


def relocate_store(db: Path) -> None:
    """Re-point the artifact locations of the data dir's own sqlite store at the data dir it is in now.

    Every experiment dxr creates there keeps its artifacts in `<data_dir>/mlflow/artifacts`; one whose recorded
    location is another `…/mlflow/artifacts` was made in the data dir this one was moved, copied or restored
    from. Its location, and those of its runs, logged models and model versions, are rewritten to this data
    dir in one transaction, and a warning names both; a training here would otherwise write into the original's
    artifact directory, and a load read the original's files (or fail once it is gone). Other locations (MLflow's
    `Default` experiment in the working directory) are left as they are.
    """
    if not db.is_file():
        return
    here = artifact_root(sqlite_uri(db))
    try:
        with closing(sqlite3.connect(db, timeout=60, isolation_level=None)) as con:
            if not columns(con, "experiments") or not moved_from(con, here):
                return
            con.execute("BEGIN IMMEDIATE")  # re-read under the write lock: another process may have done it
            present = [(table, column) for table, column in LOCATION_COLUMNS if column in columns(con, table)]
            olds = moved_from(con, here)
            for old in olds:
                for table, column in present:
                    con.execute(f"UPDATE {table} SET {column} = ? || substr({column}, length(?) + 1) "
                                f"WHERE {column} = ? OR substr({column}, 1, length(?) + 1) = ? || '/'",
                                (here, old, old, old, old))
            con.execute("COMMIT")  # closing without it (an error above) rolls every update back
    except sqlite3.Error as exc:
        raise ConfigError(f"MLflow store {db} failed while checking where its artifacts are: {exc}: it must be a "
                          "readable and writable SQLite file (restore it from a backup if it is damaged)") from exc
    if olds:  # a warning, so a CLI command shows it: a store opened under two paths at once re-points on every open
        log.warning("MLflow store %s: artifact locations recorded under %s re-pointed to %s (the data dir was moved, "
                    "copied or restored)", db, ", ".join(olds), here)


def columns(con: sqlite3.Connection, table: str) -> set[str]:
    """The columns of a table (none when the store's schema has no such table)."""
    return {row[1] for row in con.execute(f"PRAGMA table_info({table})")}


def moved_from(con: sqlite3.Connection, here: str) -> list[str]:
    """The artifact roots of other data dirs that experiments of this store record."""
    return [location for (location,) in con.execute("SELECT DISTINCT artifact_location FROM experiments")
            if location != here and location.startswith("file://") and location.endswith("/mlflow/artifacts")]


def sqlite_file(uri: str) -> Path | None:
    """The file of a local sqlite tracking URI; None for a server, an in-memory store or a URI with options.

    >>> sqlite_file("sqlite:////srv/dxr/mlflow.db")
    PosixPath('/srv/dxr/mlflow.db')
    >>> sqlite_file("http://mlflow.internal:5000") is None
    True
    """
    path = sqlite_path(uri)
    return Path(path) if path and path != ":memory:" and "?" not in uri else None


def create_default_store(data_dir: str | Path) -> None:
    """Create the data dir's own sqlite store whole, unless it is there; replace one whose creation was killed.

    MLflow creates a store by running its schema migrations on the file one after another, each committed apart, and
    opening a store runs those it lacks. A process killed among them (SIGKILL, the OOM killer) left a store whose
    next migration had partly run already, so every later open failed ("table ... already exists") and no
    training or learned forecast could use the data dir again. The store is therefore made in a scratch directory
    beside it and renamed into place once MLflow has finished it, adding its `Default` experiment last. A store
    without any experiment is what such a killed creation left before: it holds nothing (dxr registers models only
    from runs, which belong to experiments), so it is made again.
    """
    create_store(data_dir, Path(sqlite_path(tracking_uri(data_dir, None))), owned=True)


def create_configured_store(data_dir: str | Path, db: Path) -> None:
    """Create a configured sqlite store (`prior.tracking_uri`) whole, as `create_default_store` does, when its file
    is absent and its directory exists (MLflow's own error names a missing directory).

    The file is the user's and may be shared by several data dirs: it is put in place only where nothing is
    (`os.link`), never over another file. A file there without an experiment, which MLflow cannot open, is a creation
    cut short in place (by MLflow itself, or by dxr before this): one line names it and the fix, rather than dxr
    replacing a file it does not own.
    """
    if db.parent.is_dir():
        create_store(data_dir, db, owned=False)


def create_store(data_dir: str | Path, db: Path, *, owned: bool) -> None:
    """Create the sqlite store `db` whole unless it is there, under the data dir's `mlflow-store` lock; a half-made
    one is replaced when the data dir `owned` it, and refused in one line otherwise."""
    if store_made(db):
        return
    with held(Warehouse(data_dir), "mlflow-store", shared=False, wait=120.0,
              busy=f"MLflow store {db} is being created by another dxr process"):
        if store_made(db):  # by another process meanwhile
            return
        if db.exists() and not owned:
            check_opens(db)  # MLflow then opens it as it is
            return
        remove_abandoned(db)
        with scratch(db, "staging") as staging:
            staging.mkdir()
            create_staged(db, staging / db.name)
            if owned:
                os.replace(staging / db.name, db)
                return
            try:
                os.link(staging / db.name, db)
            except FileExistsError:  # made meanwhile by a process of another data dir, whole as this one
                pass


def create_staged(db: Path, staged: Path) -> None:
    """Have MLflow create the sqlite store `db` at `staged`; a full disk is one line naming the store's directory.

    MLflow lets SQLite's "database or disk is full" out of its schema creation as SQLAlchemy's error, not its own."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        MlflowClient(tracking_uri=sqlite_uri(staged)).search_experiments(max_results=1)
    except (SQLAlchemyError, MlflowException) as exc:
        if not full_disk(exc):
            raise
        raise ConfigError(f"creating the MLflow store in {db.parent}: out of disk space: free disk space there, or "
                          "point --data-dir (DXR_DATA_DIR) or prior.tracking_uri (env DXR_PRIOR__TRACKING_URI) to a "
                          "disk with room") from exc


def check_opens(db: Path) -> None:
    """Whether MLflow can open a configured sqlite store that has no experiment (it adds its `Default` one when it
    can); one whose creation was cut short among MLflow's migrations fails on a table that already exists, and one
    line says so. A copy is opened, not the store: MLflow would migrate the user's file further, and keep an engine
    on it for the life of the process (the file a user removes and creates again would still be read through it)."""
    from sqlalchemy.exc import SQLAlchemyError

    with scratch(db, "check") as copy:
        shutil.copyfile(db, copy)
        try:
            MlflowClient(tracking_uri=sqlite_uri(copy)).search_experiments(max_results=1)
        except (SQLAlchemyError, MlflowException) as exc:
            reason = str(exc).strip().splitlines()[0]
            raise ConfigError(f"MLflow store {db} (prior.tracking_uri) is half made: it has no experiment and MLflow "
                              f"cannot open it ({reason}), as a creation cut short leaves it: remove the file (it "
                              "holds no run) and rerun to have it created whole, or restore it from a backup") from exc


def store_made(db: Path) -> bool:
    """Whether the sqlite store `db` exists with its experiments; a file SQLite cannot read counts as made, so that
    `relocate_store` names it instead of it being replaced (it may be a damaged copy someone wants to restore)."""
    if not db.is_file():
        return False
    try:
        # Read-write: opening it rolls back a transaction a killed creation left in its journal, which must not
        # outlive the file it belongs to (SQLite would play it back into the store renamed over it).
        with closing(sqlite3.connect(db, timeout=60)) as con:
            return bool(columns(con, "experiments")) and bool(
                con.execute("SELECT 1 FROM experiments LIMIT 1").fetchall())
    except sqlite3.Error:
        return True


def use_tracking(data_dir: str | Path, configured: str | None, experiment: str) -> str:
    """Point mlflow at the store and experiment (created with `artifact_root` when new); the default store is
    first created whole if absent (`create_default_store`) and re-pointed at this data dir (`relocate_store`); a
    configured sqlite store is created whole if absent (`create_configured_store`), and otherwise left as it is."""
    uri = tracking_uri(data_dir, configured)
    if not configured:
        create_default_store(data_dir)
        relocate_store(Path(sqlite_path(uri)))
    elif (db := sqlite_file(configured)) is not None:
        create_configured_store(data_dir, db)
    mlflow.set_tracking_uri(uri)
    with store_errors(f"opening experiment {experiment!r}"):
        if mlflow.get_experiment_by_name(experiment) is None:
            try:
                mlflow.create_experiment(experiment, artifact_location=artifact_root(uri))
            except MlflowException:
                if mlflow.get_experiment_by_name(experiment) is None:  # not made by another process meanwhile
                    raise
        mlflow.set_experiment(experiment)
    return uri


def read_tracking(data_dir: str | Path, configured: str | None) -> bool:
    """Point mlflow at the store to read it only (`dxr prior models`): nothing is created, migrated or re-pointed
    (`use_tracking` does that for the commands that train or load a model), so an account that may only read the data
    dir, or a read-only copy of it, lists its models. False when the store is a sqlite file that does not exist or has
    no experiment (empty, or its creation cut short): no model was registered in it, and MLflow would create its
    schema in the file, in place."""
    uri = configured or sqlite_uri(default_store(data_dir))
    if (db := sqlite_file(uri)) is not None and not store_made(db):
        return False
    mlflow.set_tracking_uri(uri)
    return True


def registered_name(system: str, cohort_id: str) -> str:
    return f"{system}-{cohort_id}"


def resolve_alias(system: str, cohort_id: str, alias: str) -> tuple[str, str]:
    """(model version, run id) that `alias` points to; a clear error when nothing is registered."""
    name = registered_name(system, cohort_id)
    try:
        version = MlflowClient().get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if exc.error_code not in ABSENT:
            raise store_error(exc, f"resolving {name}@{alias}") from exc
        with store_errors(f"listing the versions of {name}"):
            versions = sorted(int(v.version) for v in MlflowClient().search_model_versions(f"name = '{name}'"))
        # Versions without the alias (another prior.alias, or trained with --no-promote): one is to be pointed at.
        fix = (f"point it at one of versions {', '.join(map(str, versions))} with `dxr prior promote --cohort "
               f"{cohort_id} --system {system} --version {versions[-1]}` (setting prior.alias = {alias!r}), or train "
               "one" if versions else "train one")
        raise NotFoundError(
            f"no registered model {name!r} with alias {alias!r} in {mlflow.get_tracking_uri()}: {fix} with "
            f"`dxr prior train --cohort {cohort_id} --system {system}`") from exc
    return str(version.version), version.run_id


def version_run(system: str, cohort_id: str, version: str) -> str:
    """The run id of a registered version; a clear error naming the versions there are."""
    name = registered_name(system, cohort_id)
    try:
        return MlflowClient().get_model_version(name, version).run_id
    except MlflowException as exc:
        if exc.error_code not in ABSENT:
            raise store_error(exc, f"looking up {name} version {version}") from exc
        known = [row["version"] for row in registered_versions(system, cohort_id)]
        fix = (f"list them with `dxr prior models --cohort {cohort_id} --system {system}`" if known
               else f"train one with `dxr prior train --cohort {cohort_id} --system {system}`")
        raise NotFoundError(f"registered model {name!r} has no version {version!r} in {mlflow.get_tracking_uri()} "
                            f"(versions: {', '.join(known) or 'none'}): {fix}") from exc


def version_tagged(system: str, cohort_id: str, tags: dict[str, str]) -> tuple[str, Run] | None:
    """(version, MLflow run) of the earliest registered version of a system's model for a cohort whose run
    carries every tag of `tags`; None when there is none."""
    client = MlflowClient()
    name = registered_name(system, cohort_id)
    with store_errors(f"looking for a version of {name} by its run's tags"):
        for v in sorted(client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version)):
            run = client.get_run(v.run_id)
            if all(run.data.tags.get(key) == value for key, value in tags.items()):
                return str(v.version), run
    return None


def end_killed_attempts(killed: Callable[[Run], bool]) -> list[str]:
    """End as KILLED the runs of the current experiment still RUNNING that `killed` says no live process owns;
    returns their ids.

    A training's MLflow run ends with its `with` block, FAILED on an exception: one whose process was killed
    (SIGKILL, the OOM killer) would show RUNNING in the MLflow UI for good. Its artifacts stay, as a failed run's do
    (the model files of one killed after logging its model and before registering it): MLflow's own way to remove
    them is to delete the run and its logged model and then run `mlflow gc` (docs/ehr-prior.md), which a user
    decides; nothing here deletes a run.
    """
    with store_errors("looking for killed attempts of trainings"):
        runs = [run for run in mlflow.search_runs(filter_string="attributes.status = 'RUNNING'", output_format="list")
                if killed(run)]
        for run in runs:
            MlflowClient().set_terminated(run.info.run_id, status="KILLED")
    return [run.info.run_id for run in runs]


def registered_versions(system: str, cohort_id: str) -> list[dict]:
    """Every registered version of a system's model for a cohort, newest first, with its aliases, the tuning
    metrics of the epoch whose weights it holds, the epochs its training ran and the dxr run that trained it."""
    name = registered_name(system, cohort_id)
    rows = []
    with store_errors(f"listing the versions of {name}"):
        client = MlflowClient()  # its first use in a process opens the store, which may be damaged
        versions = client.search_model_versions(f"name = '{name}'")
        # A search leaves the versions' aliases empty; the registered model holds them (alias -> version).
        aliases = client.get_registered_model(name).aliases if versions else {}
        for v in sorted(versions, key=lambda v: int(v.version), reverse=True):
            run = client.get_run(v.run_id)
            selected, trained = (run.data.metrics.get(m) for m in ("selected_epoch", "epochs_trained"))
            # A run's plain metric is its last epoch's; the registered weights are the selected epoch's.
            chosen = {metric: next((m.value for m in client.get_metric_history(v.run_id, metric)
                                    if selected is not None and m.step == int(selected)), None)
                      for metric in ("val_recall_at_20", "val_precision_at_20")}
            rows.append({"system": system, "version": str(v.version),
                         "aliases": sorted(alias for alias, of in aliases.items() if str(of) == str(v.version)),
                         "created_at": datetime.fromtimestamp(v.creation_timestamp / 1000, timezone.utc),
                         "selected_epoch": None if selected is None else int(selected) + 1, **chosen,
                         "mlflow_run_id": v.run_id, "epochs_trained": None if trained is None else int(trained),
                         "dxr_run_id": run.data.tags.get("dxr.run_id")})
    return rows


def set_alias(system: str, cohort_id: str, version: str, alias: str) -> str | None:
    """Point `alias` at a registered version; returns the version it pointed to before (None: unset)."""
    version_run(system, cohort_id, version)  # an unknown version is an error, not a dangling alias
    try:
        previous = resolve_alias(system, cohort_id, alias)[0]
    except NotFoundError:
        previous = None
    with store_errors(f"pointing {registered_name(system, cohort_id)}@{alias} at version {version}"):
        MlflowClient().set_registered_model_alias(registered_name(system, cohort_id), alias, version)
    return previous


def download_model(system: str, cohort_id: str, version: str, run_id: str, cache_dir: Path) -> Path:
    """Local copy of a registered version (kept per version and run, so a second load reads the disk only;
    the run id keeps a reset or different tracking store, whose versions restart at 1, from reusing it).

    The copy is downloaded beside its place and renamed into it whole: an interrupted download leaves
    nothing a later load would take for a model, and a load never reads a copy still being written.
    """
    name = registered_name(system, cohort_id)
    target = cache_dir / name / f"v{version}-{run_id}"
    if (target / WEIGHTS).is_file():
        return target
    remove_abandoned(target)
    with scratch(target, "download") as staging:
        staging.mkdir()
        try:
            mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=str(staging))
        except MlflowException as exc:
            if full_disk(exc):  # the copy's disk: the path MLflow's text names is the store's
                raise ConfigError(f"downloading {name} version {version}: out of disk space in {cache_dir}: free "
                                  "disk space there, or point --data-dir (DXR_DATA_DIR) to a disk with room") from exc
            raise store_error(exc, f"downloading {name} version {version}") from exc
        if not (staging / WEIGHTS).is_file():  # MLflow downloads nothing, and says nothing, from a missing local dir
            with store_errors(f"looking up where {name} version {version} is stored"):
                location = MlflowClient().get_model_version_download_uri(name, version)
            raise NotFoundError(f"{name} version {version} has no model files at {location}: the MLflow store's "
                                "artifacts are missing (a data dir moved, copied or restored without "
                                "mlflow/artifacts?): copy them in with mlflow.db, or train again with "
                                f"`dxr prior train --cohort {cohort_id} --system {system}`")
        if (target / WEIGHTS).is_file():  # another process finished the same download first
            return target
        if target.exists():  # an incomplete copy (left by an older dxr) or one without weights
            shutil.rmtree(target)
        os.replace(staging, target)
    return target


def read_bundle(model_dir: Path) -> dict[str, dict]:
    """The JSON files logged next to the network (vocabulary and configs)."""
    found = {p.name: p for p in model_dir.rglob("*.json") if p.name in BUNDLE_FILES}
    missing = [f for f in BUNDLE_FILES if f not in found]
    if missing:
        raise NotFoundError(f"model files in {model_dir} lack {missing}: re-train with `dxr prior train`")
    return {name: json.loads(found[name].read_text()) for name in BUNDLE_FILES}
