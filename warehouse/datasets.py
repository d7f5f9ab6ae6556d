"""The dataset registry: any MEDS directory becomes a named dataset in the warehouse."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import polars as pl

from dxr.errors import InputError, NotFoundError
from warehouse import duck
from warehouse.importers import ImportSummary
from warehouse.importers.mimic import MIMIC3, MIMIC4, import_mimic_validated
from warehouse.locks import held
from warehouse.meds import MedsInfo, copy_meds_dir, offset_text, validate_meds_dir
from warehouse.runs import registered_run
from warehouse.schemas import utc_now
from warehouse.scratch import remove_abandoned, scratch
from warehouse.store import Warehouse

_NAME = re.compile(r"^[a-z0-9][a-z0-9_\-]{0,63}$")


def check_name(kind: str, name: str) -> str:
    """Dataset and cohort names become partition keys: keep them simple and portable."""
    if not _NAME.fullmatch(name):  # `$` alone would let a trailing newline through
        raise InputError(f"{kind} name {name!r} is not allowed: use 1-64 lower-case letters, digits, '_' or '-', "
                         "starting with a letter or digit")
    return name


def check_cohort_key(key: str) -> str:
    """A cohort as commands name it, by name or by id: an id (c and 11 hex digits) is spelt as a name is, so a key
    that could be no cohort's name is no cohort."""
    if not _NAME.fullmatch(key):
        raise InputError(f"cohort {key!r} is no cohort name or id: names are 1-64 lower-case letters, digits, '_' "
                         "or '-', starting with a letter or digit, and ids c and 11 hex digits (`dxr cohort list` "
                         "lists the cohorts)")
    return key


def register_dataset(wh: Warehouse, dataset_id: str, source: str, generator_version: str | None = None,
                     memory_limit: str = "2GB", validated: MedsInfo | None = None, time_zone: str = "",
                     utc_offset: str = "") -> dict:
    """Validate the MEDS directory already at `wh.meds_dir(dataset_id)` (DuckDB within `memory_limit`; `validated`
    is a validation of it to hand on, see `validate_meds_dir`) and write its `datasets` row.

    `time_zone` and `utc_offset` are those of the source's times ('' when none): the copy in the gold store keeps
    their wall-clock times without the zone, so only the caller knows them.

    Returns the row plus what the ingest should tell the user but the table does not keep.
    """
    check_name("dataset", dataset_id)
    info = validate_meds_dir(wh.meds_dir(dataset_id), memory_limit, validated)
    registered = get_dataset(wh, dataset_id)["fingerprint"] if wh.has_rows("datasets", dataset_id=dataset_id) else None
    row = {
        "dataset_id": dataset_id, "source": source, "meds_dir": str(info.root),
        "fingerprint": info.fingerprint_replacing(registered),
        "generator_version": generator_version,
        "n_subjects": info.n_subjects, "n_events": info.n_events,
        "icd_versions": ",".join(map(str, info.icd_versions)), "registered_at": utc_now(),
        "time_zone": time_zone, "utc_offset": utc_offset,
    }
    wh.write("datasets", pl.DataFrame([row]), dataset_id=dataset_id)
    told = ("n_diagnoses_without_encounter", "n_subjects_without_split", "n_born_after_events", "born_after_events",
            "n_subjects_in_several_shards", "in_several_shards", "n_implausible_times", "implausible_time",
            "other_files", "bookkeeping_shards", "n_listed_without_events", "listed_without_events")
    return {**row, **{name: getattr(info, name) for name in told}}


def writing_dataset(wh: Warehouse, dataset_id: str):
    """The exclusive lock of a dataset, held while its files are replaced and registered."""
    return held(wh, f"dataset:{dataset_id}", shared=False,
                busy=f"dataset {dataset_id!r} is being written, or read by a cohort build, in another dxr process")


def ingest_meds(wh: Warehouse, source_dir: Path, dataset_id: str, run_id: str | None = None,
                memory_limit: str = "2GB") -> dict:
    """Copy an external MEDS dataset into the gold store and register it (and the run, kind
    `ingest:meds`; `dxr ingest meds`). Its validation reads the events with DuckDB within `memory_limit`.

    Diagnosis codes in another ETL's spelling (`DIAGNOSIS_SPELLINGS`) are copied in the platform's; the returned
    row's `respelled` says which (`MedsInfo.respelled`)."""
    config = {"path": str(source_dir), "dataset": dataset_id}
    with registered_run(wh, "ingest:meds", config, run_id):
        check_name("dataset", dataset_id)
        target = wh.meds_dir(dataset_id)
        # shutil.copytree's Error gathers each file's, without errno or file name: `out_of_disk` reads its text.
        with duck.resource_errors(f"MEDS ingest of {source_dir}", target.parent, memory_limit):
            info = validate_meds_dir(source_dir, memory_limit, other_spellings=True)  # fail before copying anything
            with writing_dataset(wh, dataset_id):
                copy_meds_dir(Path(source_dir), target, info.encounter_column, info.utc_offset,
                              respell=bool(info.respelled), memory_limit=memory_limit)
                # The copy keeps wall-clock times without their zone: the row records which zone that was.
                row = register_dataset(wh, dataset_id, source="meds", memory_limit=memory_limit,
                                       time_zone=info.time_zone,
                                       utc_offset="" if info.utc_offset is None else offset_text(info.utc_offset))
                return {**row, "respelled": info.respelled}


def ingest_mimic(wh: Warehouse, source: str, source_dir: Path, dataset_id: str, seed: int, labs: bool = False,
                 log: Callable[[str], None] | None = None, run_id: str | None = None,
                 memory_limit: str = "2GB") -> tuple[dict, ImportSummary]:
    """Import the official MIMIC-III (`source="mimic3"`) or MIMIC-IV `hosp` files as a MEDS dataset
    and register it (and the run, kind `ingest:<source>`; `dxr ingest mimic3|mimic4`).

    Returns the dataset row and the importer's `ImportSummary`.
    """
    layouts = {layout.source: layout for layout in (MIMIC3, MIMIC4)}
    if source not in layouts:
        raise InputError(f"unknown MIMIC source {source!r}: use one of {', '.join(layouts)}")
    config = {"path": str(source_dir), "dataset": dataset_id, "seed": seed, "labs": labs}
    with registered_run(wh, f"ingest:{source}", config, run_id):
        check_name("dataset", dataset_id)  # before any work: the name becomes a partition key
        # The MEDS directory appears at its final place only once complete; registration comes after.
        with writing_dataset(wh, dataset_id):
            summary, info = import_mimic_validated(layouts[source], Path(source_dir), wh.meds_dir(dataset_id),
                                                   seed=seed, labs=labs, log=log, memory_limit=memory_limit)
            with duck.resource_errors(f"registration of {wh.meds_dir(dataset_id)}", wh.meds_dir(dataset_id).parent,
                                      memory_limit):
                # The import validated these very files: not read again unless they changed (`validate_meds_dir`).
                return register_dataset(wh, dataset_id, source=source, memory_limit=memory_limit, validated=info,
                                        time_zone=summary.time_zone, utc_offset=summary.utc_offset), summary


def get_dataset(wh: Warehouse, dataset_id: str) -> dict:
    rows = wh.read("datasets", dataset_id=dataset_id) if wh.has_rows("datasets", dataset_id=dataset_id) else None
    if rows is None or rows.is_empty():
        known = sorted(wh.read("datasets")["dataset_id"].to_list())
        raise NotFoundError(f"dataset {dataset_id!r} is not registered in the warehouse at {wh.root}; registered: "
                            f"{', '.join(known) or 'none'} (create one with `dxr synth` or `dxr ingest`, "
                            "or check --data-dir)")
    return rows.row(0, named=True)


def create_synthetic(wh: Warehouse, dataset_id: str, patients: int, seed: int, shard_size: int = 2000,
                     progress: bool = False, log: Callable[[str], None] | None = None,
                     run_id: str | None = None) -> dict:
    """Generate the synthetic dataset into the gold store and register it (and the run, kind `synth`).

    With `progress` a bar shows the patients written on a terminal; otherwise `log` receives a line each time another
    tenth of them is written (`warehouse.synthetic.generate`).

    Generation writes into a staging directory that is swapped in only when complete, so a killed
    run leaves the previous dataset (or none) and a rerun produces identical files.
    """
    from warehouse.meds import replace_dir
    from warehouse.synthetic import GENERATOR_VERSION, generate

    check_name("dataset", dataset_id)
    target = wh.meds_dir(dataset_id)
    params = {"dataset": dataset_id, "patients": patients, "seed": seed, "shard_size": shard_size}
    with registered_run(wh, "synth", params, run_id), writing_dataset(wh, dataset_id):
        remove_abandoned(target)
        # A full disk names the directory the dataset goes to, not the hidden staging file that met it.
        with duck.resource_errors(f"generation of synthetic dataset {dataset_id}", target.parent):
            with scratch(target, "tmp") as staging:
                generate(staging, n_patients=patients, seed=seed, shard_size=shard_size, progress=progress, log=log)
                replace_dir(staging, target)
            return register_dataset(wh, dataset_id, source="synthetic", generator_version=GENERATOR_VERSION)


def synthetic_is_current(wh: Warehouse, dataset_id: str, patients: int, seed: int) -> bool:
    """True when the registered dataset was made by this generator version with these parameters."""
    from warehouse.synthetic import GENERATOR_VERSION, generation_parameters

    if not wh.has_rows("datasets", dataset_id=dataset_id):
        return False
    row = wh.read("datasets", dataset_id=dataset_id).row(0, named=True)
    if row["source"] != "synthetic" or row["generator_version"] != GENERATOR_VERSION:
        return False
    try:
        info = validate_meds_dir(wh.meds_dir(dataset_id))  # where this warehouse holds it, as a cohort build reads
    except InputError:
        return False
    return info.holds_registered(row["fingerprint"]) and generation_parameters(info.root) == {
        "patients": patients, "seed": seed, "generator_version": GENERATOR_VERSION}
