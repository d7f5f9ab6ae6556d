"""MEDS datasets: writing shards and metadata, validating a directory, registering it.

Layout (MEDS 0.4): `data/**/*.parquet` (a subject lives in exactly one shard, rows sorted by subject and
time), `metadata/dataset.json`, `metadata/codes.parquet`, `metadata/subject_splits.parquet`.
Every importer writes this layout first; everything downstream reads only MEDS + warehouse tables.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import NamedTuple
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

import duckdb
import meds
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from flexible_schema.exceptions import SchemaValidationError

from dxr.errors import InputError
from warehouse import duck
from warehouse.scratch import exchange, naming, remove_abandoned, scratch

# Extra columns this platform relies on; `encounter_id` groups events into hospital encounters.
EXTRA_COLUMNS = {"encounter_id": pa.int64()}
# Other names a MEDS export gives the encounter column: MEDS-Extract's MIMIC-IV ETL, whose codes this platform
# follows, keeps the admission id as `hadm_id`. Ingest copies it into `encounter_id`.
ENCOUNTER_ALIASES = ("hadm_id",)
# Columns that may hold the encounter under a name validation does not take, told as the one to rename: meds_etl
# writes `visit_id` (OMOP's visit_occurrence_id, which counts outpatient visits too: only the user knows whether
# its visits are hospital encounters), OMOP exports `visit_occurrence_id`, MIMIC's CSVs `HADM_ID`.
_ENCOUNTER_LOOKALIKES = ("encounter_id", "hadm_id", "visit_id", "visit_occurrence_id")
# Codes whose system the platform knows; anything under DIAGNOSIS// must be ICD-9 or ICD-10.
_DIAGNOSIS_CODE = re.compile(r"^DIAGNOSIS//ICD//(9|10)//[A-Z0-9]+$")
# A diagnosis dictionary (codes.parquet) may also list chapters and blocks by their range, e.g. C00-C96.
_DICTIONARY_DIAGNOSIS_CODE = re.compile(r"^DIAGNOSIS//ICD//(9|10)//[A-Z0-9]+(-[A-Z0-9]+)?$")
# How other MEDS ETLs spell an ICD-10(-CM) or ICD-9-CM diagnosis, which `ingest meds` rewrites to the platform's
# DIAGNOSIS//ICD//{9|10}//<code without dot> (`respelled_diagnosis_sql`), by ICD version: group 1 is the prefix,
# group 3 the code, with or without its dot. meds_etl writes OMOP's vocabulary_id/concept_code (ICD10CM/E11.9,
# ICD9CM/250.00, WHO's ICD10/E11.9), other ETLs a double slash (ICD10CM//E11.9, ICD10//E119), a hand-made export
# the platform's prefix with the dot. The code must have the shape of a diagnosis of its version (ICD-9 procedures
# have two digits before their dot), and the prefix names no procedure system: ICD10PCS/… and ICD9Proc/… stay
# procedures. A bare ICD9 prefix is not read as a diagnosis: ICD-9-CM holds procedures too (volume 3), and an
# undotted procedure (3893) has a diagnosis's shape.
DIAGNOSIS_SPELLINGS = {
    10: r"^(ICD10(CM)?//?|DIAGNOSIS//ICD//10//)([A-Z][0-9][0-9A-Z](\.?[0-9A-Z]{1,4})?)$",
    9: r"^(ICD9(CM)//?|DIAGNOSIS//ICD//9//)(([0-9]{3}|V[0-9]{2})(\.?[0-9]{1,2})?|E[0-9]{3}(\.?[0-9])?)$",
}
# Codes that name an ICD diagnosis system in another spelling (any case): refused unless a spelling above matches.
_OTHER_DIAGNOSIS_PREFIX = r"^ICD(9CM|10(CM)?)/"
# Hex digits of a dataset's content fingerprint (`_fingerprints`); registrations from before it have 16.
FINGERPRINT_LENGTH = 24
SPLITS = (meds.train_split, meds.tuning_split, meds.held_out_split)
_OFFSET = re.compile(r"([+-])(\d{2}):?(\d{2})?")
# Every time of a dataset must be at one UTC offset, or none have one (see `utc_offset`).
MIXED_OFFSETS_FIX = "convert every time to one UTC offset (such as UTC itself) or to local time without an offset"


def utc_offset(zone: str) -> str | None:
    """A time zone as written after a time (or in an Arrow timestamp type) as its UTC offset, '' for none; None for
    a zone name, whose offset can change (daylight saving): `zone_offset` tells it over the data's times.

    Times are kept as the wall-clock time they show, which orders the events of a single-zone export correctly.
    Times at several offsets (across a daylight-saving change, or sites in two zones) would not be, so importers
    refuse them, a zone name whose offset changes within the data, and some times with an offset beside others
    without one.

    >>> [utc_offset(z) for z in ("", "-05:00", "-0500", "+02", "Z", "UTC", "Etc/UTC", "-00:00", "America/New_York")]
    ['', '-05:00', '-05:00', '+02:00', '+00:00', '+00:00', '+00:00', '+00:00', None]
    """
    if zone.upper() in ("Z", "UTC", "ETC/UTC", "GMT"):
        return "+00:00"
    if match := _OFFSET.fullmatch(zone):
        sign, hours, minutes = match.groups()
        offset = f"{hours}:{minutes or '00'}"
        return f"{'+' if offset == '00:00' else sign}{offset}"
    return "" if zone == "" else None


# Offset changes in the zone database are days apart at least (95.7 hours in tzdata 2025b, Africa/Freetown in 1939;
# usually a daylight-saving season): a scan in steps this long finds each one (an offset that reverted within a step
# would be missed; none does), and a few hundred years of data take a fraction of a second.
_ZONE_SCAN_STEP = timedelta(hours=6)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_TIME_LIMITS = (datetime(1, 1, 2, tzinfo=timezone.utc) - _EPOCH, datetime(9999, 12, 30, tzinfo=timezone.utc) - _EPOCH)
# The times Python's datetime holds (years 1 to 9999), as microseconds since 1970: polars hands a time outside them
# to no Python code (Direct Forecast's rendering of a record fails on it), so validation refuses it.
_DATETIME_US = tuple((limit - datetime(1970, 1, 1)) // timedelta(microseconds=1)
                     for limit in (datetime.min, datetime.max))
_TICKS_PER_SECOND = {"s": 1, "ms": 10**3, "us": 10**6, "ns": 10**9}
# Events dated outside these years (from the first, before the last) are told in a note: a placeholder date
# (1700-01-01, 2999-12-31) or a mistaken year. MIMIC's shifted years (2100 to 2210) fall within, and so do
# MIMIC-III's births of patients over 89, which it moves 300 years before their first admission (1800 on).
PLAUSIBLE_YEARS = (1800, 2300)


def zone_offset(zone: str, first: datetime, last: datetime, where: str) -> timedelta:
    """The UTC offset that time zone name `zone` gives every time from `first` to `last` (naive ones are read as
    wall-clock times in the zone), by the zone database that ships with Python (the system's, else `tzdata`).

    An InputError starting with `where` (the file and column naming the zone) when the offset changes in between
    (daylight saving: the wall-clock times could misorder events), the zone is unknown, or there is no database.

    >>> zone_offset("Asia/Tokyo", datetime(2150, 1, 1), datetime(2180, 7, 1), "x")
    datetime.timedelta(seconds=32400)
    """
    try:
        info = ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        if not available_timezones():
            raise InputError(f"{where} names the time zone {zone!r}, but this system has no time zone database to "
                             f"tell its UTC offsets: install one (pip install tzdata) or {MIXED_OFFSETS_FIX}") from exc
        raise InputError(f"{where} names the time zone {zone!r}, which the time zone database does not know: write "
                         f"a zone name it has (such as Asia/Tokyo) or {MIXED_OFFSETS_FIX}") from exc
    first, last = (time if time.tzinfo else time.replace(tzinfo=info) for time in (first, last))
    offset = first.astimezone(info).utcoffset()
    before = first
    while before < last:
        after = min(before + _ZONE_SCAN_STEP, last)
        if after.astimezone(info).utcoffset() != offset:
            while after - before > timedelta(seconds=1):  # the change itself, to name its date
                middle = before + (after - before) / 2
                before, after = (middle, after) if middle.astimezone(info).utcoffset() == offset else (before, middle)
            changed = after.astimezone(info)
            raise InputError(f"{where} names the time zone {zone!r}, whose UTC offset changes from "
                             f"{offset_text(offset)} to {offset_text(changed.utcoffset())} on {changed:%Y-%m-%d}, "
                             f"within the data's times ({first.astimezone(info):%Y-%m-%d} to "
                             f"{last.astimezone(info):%Y-%m-%d}): times at mixed offsets (daylight saving) can "
                             f"misorder events; {MIXED_OFFSETS_FIX}")
        before = after
    return offset


def offset_text(offset: timedelta) -> str:
    """A UTC offset as `utc_offset` writes it.

    >>> [offset_text(timedelta(hours=h, minutes=m)) for h, m in ((9, 0), (-5, 0), (5, 30), (0, 0))]
    ['+09:00', '-05:00', '+05:30', '+00:00']
    >>> offset_text(timedelta(hours=5, minutes=21, seconds=10))
    '+05:21:10'
    """
    minutes, seconds = divmod(abs(int(offset.total_seconds())), 60)
    return f"{'-' if offset < timedelta(0) else '+'}{minutes // 60:02d}:{minutes % 60:02d}" + (
        f":{seconds:02d}" if seconds else "")


def meds_data_schema(extra: dict[str, pa.DataType] | None = None) -> pa.Schema:
    """The MEDS core schema plus `encounter_id` and any importer-specific extra columns."""
    fields = list(meds.DataSchema.schema()) + [pa.field(n, t) for n, t in {**EXTRA_COLUMNS, **(extra or {})}.items()]
    return pa.schema(fields)


def hash_split(subject_id: int, seed: int) -> str:
    """Deterministic 80/10/10 train/tuning/held_out split from a seeded hash of the subject id.

    >>> hash_split(1, 7) == hash_split(1, 7)
    True
    """
    digest = hashlib.sha256(f"{seed}:{subject_id}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return meds.train_split if u < 0.8 else meds.tuning_split if u < 0.9 else meds.held_out_split


def write_data_shard(root: Path, shard_name: str, table: pa.Table | pl.DataFrame) -> Path:
    """Write one MEDS data shard atomically, sorted by subject and time (static rows first)."""
    arrow = table.to_arrow() if isinstance(table, pl.DataFrame) else table
    # Sort in polars (stable, static rows first), then cast back to the exact MEDS types.
    arrow = pl.from_arrow(arrow).sort("subject_id", "time", nulls_last=False, maintain_order=True).to_arrow()
    arrow = meds.DataSchema.align(arrow)
    path = Path(root) / meds.data_subdirectory / f"{shard_name}.parquet"
    _atomic_write(arrow, path)
    return path


def write_metadata(root: Path, *, dataset_name: str, dataset_version: str, etl_name: str, etl_version: str,
                   codes: pa.Table | pl.DataFrame, splits: pa.Table | pl.DataFrame,
                   extra: dict | None = None) -> None:
    """Write dataset.json, codes.parquet and subject_splits.parquet (validated by the meds schemas)."""
    root = Path(root)
    codes_arrow = codes.to_arrow() if isinstance(codes, pl.DataFrame) else codes
    splits_arrow = splits.to_arrow() if isinstance(splits, pl.DataFrame) else splits
    _atomic_write(meds.CodeMetadataSchema.align(codes_arrow), root / meds.code_metadata_filepath)
    _atomic_write(meds.SubjectSplitSchema.align(splits_arrow), root / meds.subject_splits_filepath)
    metadata = {
        "dataset_name": dataset_name, "dataset_version": dataset_version, "etl_name": etl_name,
        "etl_version": etl_version, "meds_version": meds.__version__,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "other_extension_columns": sorted(EXTRA_COLUMNS), **(extra or {}),
    }
    meds.DatasetMetadataSchema.validate(metadata)
    path = root / meds.dataset_metadata_filepath
    _atomic_replace(path, lambda tmp: tmp.write_text(json.dumps(metadata, indent=2, default=str)))


def _atomic_write(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_replace(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))


def _atomic_replace(path: Path, write: Callable[[Path], object]) -> None:
    """`write` a hidden sibling of `path`, then rename it over `path`; a failed write leaves no sibling behind."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with naming(path):
            write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class Respelling(NamedTuple):
    """The diagnosis events of one prefix of `DIAGNOSIS_SPELLINGS` that are not in the platform's spelling."""

    prefix: str  # as written, e.g. ICD10CM/
    version: int  # ICD version
    n_events: int
    example: str  # one of the codes as written


class LateBirth(NamedTuple):
    """A subject whose `MEDS_BIRTH` (the earliest, as the EHR prior reads it) is dated after its first other event."""

    subject_id: int
    birth: datetime  # wall-clock times, as the copy in the gold store holds them
    first_event: datetime


class SubjectInShards(NamedTuple):
    """A subject whose dated events other than its birth are in more than one shard: two of them (paths relative to
    the MEDS directory)."""

    subject_id: int
    first_shard: str
    last_shard: str


class OddTime(NamedTuple):
    """An event dated outside `PLAUSIBLE_YEARS`: its shard (relative to the MEDS directory), row (1-based), subject,
    code and wall-clock time."""

    shard: str
    row: int
    subject_id: int
    code: str
    time: datetime


@dataclass(frozen=True)
class MedsInfo:
    """What validation learned about a MEDS directory."""

    root: Path
    shards: tuple[Path, ...]
    metadata: dict
    n_subjects: int
    n_events: int
    icd_versions: tuple[int, ...]
    has_splits: bool
    fingerprint: str
    # Diagnoses coded outside any encounter (outpatient, problem lists): history only, never a target.
    n_diagnoses_without_encounter: int = 0
    # Subjects of data/ that the dataset's own subject_splits.parquet does not list: in no cohort (`read_splits`).
    n_subjects_without_split: int = 0
    encounter_column: str = "encounter_id"  # or an alias (ENCOUNTER_ALIASES) that ingest copies into encounter_id
    # The time zones that the shards' times are in ('UTC', '-05:00', 'Asia/Tokyo'; '' when none) and their one UTC
    # offset (None when none), whose wall-clock times ingest keeps (`_time_zone`).
    time_zone: str = ""
    utc_offset: timedelta | None = None
    # Every file under `root` as validation found it (`_file_stamps`): what lets a validation be handed on.
    stamps: tuple[tuple, ...] = ()
    # Diagnosis events in another spelling (`DIAGNOSIS_SPELLINGS`) that the copy rewrites; validated with
    # `other_spellings` only.
    respelled: tuple[Respelling, ...] = ()
    # The content fingerprint with dataset.json's paths hashed too (`_metadata_bytes`), as datasets were registered
    # before it left them out (`fingerprint` itself for metadata without them).
    fingerprint_with_paths: str = ""
    # What ingest tells in notes but takes (`_subject_checks`): subjects born after their first other event, subjects
    # spread over several shards and events dated outside `PLAUSIBLE_YEARS`, each counted with its first example.
    n_born_after_events: int = 0
    born_after_events: LateBirth | None = None
    n_subjects_in_several_shards: int = 0
    in_several_shards: SubjectInShards | None = None
    n_implausible_times: int = 0
    implausible_time: OddTime | None = None
    # Files under data/ that are not *.parquet, which nothing reads (paths relative to the MEDS directory, sorted;
    # the tools' own, `_bookkeeping`, left out).
    other_files: tuple[str, ...] = ()
    # Shards whose path marks them a tool's own (`_bookkeeping`), such as a failed Spark write's data/_temporary/:
    # read as events like every *.parquet file, though Spark and pyarrow skip them (paths relative to the MEDS
    # directory).
    bookkeeping_shards: tuple[str, ...] = ()
    # Subjects of subject_splits.parquet without any event in data/, and the smallest of their ids.
    n_listed_without_events: int = 0
    listed_without_events: int | None = None

    def holds_registered(self, fingerprint: str) -> bool:
        """True when these are the files a dataset was registered with under `fingerprint` (a registration older
        than content fingerprints has a shorter one, of sizes and row counts: `_size_fingerprint`; one older than
        the fingerprint's leaving paths out has `fingerprint_with_paths`)."""
        if len(fingerprint) == FINGERPRINT_LENGTH:
            return fingerprint in (self.fingerprint, self.fingerprint_with_paths)
        return fingerprint == _size_fingerprint(self.root, self.shards)

    def fingerprint_replacing(self, registered: str | None) -> str:
        """The fingerprint to register these files under in place of the dataset's `registered` one (None when it
        has none): a registration of these very files from before the fingerprint left paths out keeps its own, so
        the cohorts built from it keep their ids and are not named as built from earlier files."""
        return registered if registered == self.fingerprint_with_paths else self.fingerprint

    def moved_to(self, root: Path) -> MedsInfo:
        """This validation of the directory after its move to `root`."""
        return replace(self, root=root, shards=tuple(root / shard.relative_to(self.root) for shard in self.shards))


def check_meds_path(root: Path) -> Path:
    """Refuse a path that is no directory, before anything is read from it."""
    if not root.exists():
        raise InputError(f"MEDS directory {root} does not exist: check the path")
    if not root.is_dir():
        raise InputError(f"{root} is a file, not a MEDS directory: pass the folder that holds data/ and metadata/")
    return root


def validate_meds_dir(path: str | os.PathLike, memory_limit: str = "2GB", validated: MedsInfo | None = None,
                      other_spellings: bool = False) -> MedsInfo:
    """Check a MEDS directory and summarize it; every problem is one InputError naming it and the fix.

    With `other_spellings` (what `ingest meds` reads before its copy rewrites them) diagnosis codes may also be
    spelled as `DIAGNOSIS_SPELLINGS` lists, counted in `MedsInfo.respelled`; otherwise (the copy in the gold store,
    which a cohort build reads) only the platform's spelling is a diagnosis.

    DuckDB reads the events within `memory_limit` (`_spilling_connection`). `validated` hands on an earlier
    validation of the same files, such as an importer's of its staging directory before moving it to `path`: it
    is returned for `path` when every file is still the one it read (same inode, size, modification and change
    times; a rename keeps them all, any write changes the change time), else the directory is validated afresh.
    """
    root = check_meds_path(Path(path))
    # Taken before anything is read: a file changed while validation reads it fails the comparison later.
    stamps = _file_stamps(root)
    if validated is not None and validated.stamps == stamps and (other_spellings or not validated.respelled):
        return validated.moved_to(root)
    data_dir = root / meds.data_subdirectory
    shards = _shard_files(data_dir)
    if not shards:
        raise InputError(f"{root} is not a MEDS directory: no Parquet shards under {data_dir}; "
                         "MEDS keeps events in data/**/*.parquet")
    schema = meds_data_schema()
    encounter_columns: dict[str, Path] = {}  # encounter column name -> first shard using it
    time_types: dict[Path, pa.DataType] = {}  # each shard's type of timestamps
    float_encounters = False  # pandas writes an integer column with missing values as float64
    for shard in shards:
        try:
            shard_schema = pq.read_schema(shard)
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputError(f"{shard} is not a readable Parquet file ({exc}): rewrite or remove it") from exc
        encounter = next((name for name in ("encounter_id", *ENCOUNTER_ALIASES) if name in shard_schema.names),
                         "encounter_id")
        for field in schema:
            if field.name in ("numeric_value", "text_value"):
                continue  # optional in MEDS
            if field.name == "encounter_id" and encounter in shard_schema.names:
                continue
            if field.name not in shard_schema.names:
                fix = (_encounter_fix(shard_schema.names) if field.name == "encounter_id"
                       else _renaming_fix(field.name, shard_schema.names)
                       or ("this is the MEDS layout before 0.3; rename patient_id to subject_id (and timestamp to "
                           "time)" if {"patient_id", "timestamp"} & set(shard_schema.names)
                           else "every MEDS shard needs it"))
                raise InputError(f"{shard}: missing column '{field.name}' ({field.type}): {fix}")
        if pa.types.is_timestamp(time_type := shard_schema.field("time").type):
            time_types[shard] = time_type
        encounter_columns.setdefault(encounter, shard)
        if len(encounter_columns) > 1:
            first_name, first_shard = next(iter(encounter_columns.items()))
            raise InputError(f"{shard}: the encounter column is '{encounter}' but {first_shard} calls it "
                             f"'{first_name}': use one name in every shard")
        encounter_type = shard_schema.field(encounter).type
        float_encounters |= pa.types.is_floating(encounter_type)
        if not (pa.types.is_integer(encounter_type) or pa.types.is_floating(encounter_type)
                or pa.types.is_null(encounter_type)):
            raise InputError(f"{shard}: column '{encounter}' is {encounter_type}, not an integer: number the "
                             "encounters (e.g. map each visit id to an integer) and write them as int64")
        core = pq.read_table(shard, columns=[c for c in ("subject_id", "time", "code", "numeric_value", "text_value")
                                             if c in shard_schema.names]).slice(0, 0)
        if _holds_text(core.schema.field("subject_id").type):
            first = next((value for value in pq.read_table(shard, columns=["subject_id"])["subject_id"].to_pylist()
                          if value is not None), None)
            raise InputError(f"{shard}: column 'subject_id' is {core.schema.field('subject_id').type} (such as "
                             f"{first!r}), not an integer: number the subjects (map each id to an integer, keeping "
                             "the map to look patients up) and write those numbers as int64")
        try:
            meds.DataSchema.validate(core.cast(_meds_types(core.schema)))
        except SchemaValidationError as exc:
            raise InputError(f"{shard}: not the MEDS data schema ({exc}): cast the columns to the MEDS types") from exc
    [encounter] = encounter_columns
    _check_time_values(time_types)  # before DuckDB or a zone's offsets read a time beyond years 1 to 9999
    if len({time_type.tz for time_type in time_types.values()}) > 1:
        # A shard of static rows only (an export writing sex apart) has no time, so no offset to agree on, whatever
        # zone its empty column carries: polars and pandas write a column of missing times without one.
        time_types = {shard: time_type for shard, time_type in time_types.items() if _holds_times(shard)}
    time_zone, offset = _time_zone(time_types)
    with _spilling_connection(f"validation of MEDS directory {root}", memory_limit) as con:
        n_subjects, n_events, n_loose, versions, respelled = _check_events(
            con, data_dir, shards, encounter, float_encounters, other_spellings)
        subject_checks = _subject_checks(con, root, offset)
    metadata_path = root / meds.dataset_metadata_filepath
    try:
        metadata = json.loads(metadata_path.read_text()) if metadata_path.is_file() else {}
    except json.JSONDecodeError as exc:
        # Some of json's messages end with "at" ("Unterminated string starting at"): said once.
        raise InputError(f"{metadata_path}: not valid JSON ({exc.msg.removesuffix(' at')} at line {exc.lineno} "
                         f"column {exc.colno}): fix it or remove it (the file is optional)") from exc
    if not isinstance(metadata, dict):
        raise InputError(f"{metadata_path}: a JSON {type(metadata).__name__}, not an object of dataset fields "
                         "(dataset_name, …): fix it or remove it (the file is optional)")
    codes_path = root / meds.code_metadata_filepath
    if codes_path.is_file():
        # Read by the cohort build (a dictionary becomes Ω): refused here, before the dataset is registered.
        try:
            code_schema = pq.read_schema(codes_path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise _unreadable_optional_file(codes_path, exc) from exc
        if "code" not in code_schema.names:
            fix = (_renaming_fix("code", code_schema.names)
                   or "MEDS code metadata has code, description and parent_codes")
            raise InputError(f"{codes_path}: missing column 'code' (columns found: {', '.join(code_schema.names)}): "
                             f"{fix}")
        # A description column may be all-null as pandas writes it (no code described); text may be dictionary-encoded.
        untyped = next((f for f in code_schema if f.name in ("code", "description") and not _holds_text(f.type)
                        and not (f.name == "description" and pa.types.is_null(f.type))), None)
        if untyped is not None:
            raise InputError(f"{codes_path}: column '{untyped.name}' is {untyped.type}, not text: "
                             "MEDS code metadata holds codes and descriptions as strings")
        _check_dictionary_codes(codes_path, other_spellings)
    splits_path = root / meds.subject_splits_filepath
    n_unsplit = n_eventless = 0
    eventless = None
    if splits_path.is_file():
        # Checked here rather than at cohort build, so a bad split is refused before the dataset is registered.
        try:
            splits = pl.read_parquet(splits_path, glob=False)
        except (pl.exceptions.PolarsError, OSError) as exc:
            raise _unreadable_optional_file(splits_path, exc) from exc
        missing = [column for column in ("subject_id", "split") if column not in splits.columns]
        if missing:
            fix = _renaming_fix(missing[0], splits.columns) or "MEDS subject splits have subject_id and split"
            raise InputError(f"{splits_path}: missing column '{missing[0]}' (columns found: "
                             f"{', '.join(splits.columns)}): {fix}")
        check_splits(splits, splits_path)
        # Told at ingest, where the file can still be fixed, and not first by a cohort build that leaves them out;
        # and its subjects without events, which hint at missing shards or the split file of another extract.
        with _spilling_connection(f"validation of MEDS directory {root}", memory_limit) as con:
            con.register("listed", splits.select("subject_id").to_arrow())
            events = duck.read("read_parquet", data_dir, "**/*.parquet", "union_by_name = true")
            [(n_unsplit, n_eventless, eventless)] = con.execute(f"""
                WITH events AS (SELECT DISTINCT subject_id FROM {events})
                SELECT (SELECT count(*) FROM events ANTI JOIN listed USING (subject_id)), count(*), min(subject_id)
                FROM listed ANTI JOIN events USING (subject_id)""").fetchall()
    fingerprint, fingerprint_with_paths = _fingerprints(root, shards)
    return MedsInfo(root=root, shards=shards, metadata=metadata, n_subjects=n_subjects, n_events=n_events,
                    icd_versions=versions, has_splits=splits_path.is_file(), fingerprint=fingerprint,
                    n_diagnoses_without_encounter=n_loose, encounter_column=encounter, stamps=stamps,
                    n_subjects_without_split=n_unsplit,
                    time_zone=time_zone, utc_offset=offset, respelled=respelled,
                    fingerprint_with_paths=fingerprint_with_paths, **subject_checks,
                    other_files=tuple(sorted(str(path.relative_to(root)) for path in data_dir.rglob("*")
                                             if path.is_file() and not path.name.endswith(".parquet")
                                             and not _bookkeeping(path.relative_to(data_dir)))),
                    bookkeeping_shards=tuple(str(shard.relative_to(root)) for shard in shards
                                             if _bookkeeping(shard.relative_to(data_dir))),
                    n_listed_without_events=n_eventless, listed_without_events=eventless)


def _shard_files(data_dir: Path) -> tuple[Path, ...]:
    """The event shards under `data_dir`, sorted: its files named *.parquet at any depth, the files DuckDB's
    `**/*.parquet` reads. A directory so named is no shard but holds them: Spark, pyarrow and pandas write a dataset
    as `events.parquet/part-00000.parquet`."""
    return tuple(sorted(path for path in data_dir.rglob("*.parquet") if path.is_file())) if data_dir.is_dir() else ()


def _bookkeeping(path: Path) -> bool:
    """Whether a file under data/ (`path` relative to it) is a tool's own rather than an export's: hidden (a file
    browser's .DS_Store, a notebook's .ipynb_checkpoints/) or, as Hadoop and pyarrow.dataset skip, named with a
    leading underscore (Spark's _SUCCESS, the _common_metadata of a Parquet dataset). A note on them, after every
    such export, would teach users to ignore the note. A Parquet file so placed is still read as a shard, and noted
    (`MedsInfo.bookkeeping_shards`): it may hold events.

    >>> [_bookkeeping(Path(p)) for p in ("_SUCCESS", ".DS_Store", ".ipynb_checkpoints/a.csv", "labs.csv")]
    [True, True, True, False]
    """
    return any(part.startswith((".", "_")) for part in path.parts)


def _renaming_fix(name: str, columns: list[str]) -> str | None:
    """The fix for a missing column `name` that one of `columns` spells in another case or with spaces around it
    (`Subject_ID`, `code `, as a CSV header or a spreadsheet export leaves them), else None."""
    lookalike = next((column for column in columns if column.strip().lower() == name), None)
    if lookalike is None:
        return None
    why = "column names are case-sensitive" if lookalike == lookalike.strip() else "column names keep their spaces"
    return f"rename column {lookalike!r} to {name} ({why})"


def _encounter_fix(columns: list[str]) -> str:
    """How to give a shard without an encounter column one, naming a column of `columns` that may hold it."""
    lookalike = next((name for name in columns if name.strip().lower() in _ENCOUNTER_LOOKALIKES), None)
    if lookalike is None:
        return ("add the hospital encounter (admission) id to every event, as encounter_id or as hadm_id "
                "(MEDS-Extract's MIMIC-IV layout)")
    if lookalike.strip().lower() in ("encounter_id", "hadm_id"):
        return _renaming_fix(lookalike.strip().lower(), columns)
    return (f"the shard has '{lookalike}': when its ids are hospital encounters (admissions), rename it to "
            "encounter_id; when it counts outpatient visits too, write the admission id as encounter_id instead")


def _time_zone(time_types: dict[Path, pa.DataType]) -> tuple[str, timedelta | None]:
    """The time zones of the shards' timestamps (`time_types`), ', '-joined ('' when none), and their UTC offset,
    which must be one (`utc_offset`); None when the times have no zone.

    A zone name's offset is the one it has over the times of every shard naming it (`zone_offset`).
    """
    offsets: dict[str, timedelta | None] = {}
    first: tuple[timedelta | None, Path, pa.DataType] | None = None  # the first shard's offset, the shard, its type
    for shard, time_type in time_types.items():
        zone = time_type.tz or ""
        if zone not in offsets:
            fixed = utc_offset(zone)
            if fixed is None:
                named = [other for other, other_type in time_types.items() if other_type.tz == zone]
                offsets[zone] = zone_offset(zone, *_time_range(named), where=f"{shard}: column 'time' ({time_type})")
            else:
                offsets[zone] = _offset_delta(fixed) if fixed else None
        first = first or (offsets[zone], shard, time_type)
        if offsets[zone] != first[0]:
            raise InputError(f"{shard}: column 'time' is {time_type} but {first[1]} has "
                             f"{first[2]}: times at mixed offsets can misorder events; {MIXED_OFFSETS_FIX}")
    written = (zone if utc_offset(zone) is None else utc_offset(zone) for zone in offsets)  # names, and offsets alike
    return ", ".join(dict.fromkeys(filter(None, written))), first[0] if first else None


def _holds_times(shard: Path) -> bool:
    """Whether any event of `shard` has a time."""
    with pq.ParquetFile(shard) as source:
        return any(batch.column(0).null_count < batch.num_rows for batch in source.iter_batches(columns=["time"]))


def _offset_delta(offset: str) -> timedelta:
    """An offset as `utc_offset` writes it ('-05:00') as a timedelta."""
    hours, minutes = offset[1:].split(":")
    return (-1 if offset[0] == "-" else 1) * timedelta(hours=int(hours), minutes=int(minutes))


def _time_range(shards: list[Path]) -> tuple[datetime, datetime]:
    """The first and last time (UTC) in the shards; the present when they hold none (static rows only)."""
    bounds: list[int] = []  # microseconds since the epoch
    for shard in shards:
        with pq.ParquetFile(shard) as source:
            for batch in source.iter_batches(columns=["time"]):
                times = batch.column(0).cast(pa.timestamp("us", batch.column(0).type.tz), safe=False)
                least, most = pc.min_max(times.cast(pa.int64())).values()
                bounds += [bound.as_py() for bound in (least, most) if bound.is_valid]
    if not bounds:
        now = datetime.now(timezone.utc)
        return now, now
    # Times beyond those a datetime holds (years 1 to 9999, with a day to spare for the offset) take its ends'.
    return tuple(_EPOCH + min(max(timedelta(microseconds=bound), _TIME_LIMITS[0]), _TIME_LIMITS[1])
                 for bound in (min(bounds), max(bounds)))


def _check_time_values(time_types: dict[Path, pa.DataType]) -> None:
    """Refuse times whose copy is outside the years 1 to 9999 (`_DATETIME_US`), naming the first and how many there
    are. The copy keeps wall-clock times: a time with a zone is compared after the offset its copy adds.

    Such a time is mostly written in another unit than its type says: epoch microseconds under timestamp[ms] read as
    about year 51,969, and a birth before 1970 so as about year -18,031; under timestamp[s], beyond even DuckDB's
    range, validation failed with DuckDB's traceback. Taken, a cohort is built from them and Direct Forecast fails
    on the first record it renders.
    """
    first: tuple[Path, int, int, pa.DataType, int] | None = None  # shard, row (1-based), value, type, offset (us)
    count = 0
    for shard, time_type in time_types.items():
        per_second = _TICKS_PER_SECOND[time_type.unit]
        offsets = _offsets_at_ends(time_type.tz)
        # In the column's unit (rounded inwards), within int64: no nanosecond time reaches either end.
        low = max(-((offsets[0] - _DATETIME_US[0]) * per_second // 10**6), -2**63)
        high = min((_DATETIME_US[1] - offsets[1]) * per_second // 10**6, 2**63 - 1)
        row = 0  # of the batch's first, in the shard
        with pq.ParquetFile(shard) as source:
            for batch in source.iter_batches(columns=["time"]):
                values = batch.column(0).cast(pa.int64())
                outside = pc.or_(pc.less(values, low), pc.greater(values, high))
                n_outside = pc.sum(outside).as_py() or 0
                if n_outside and first is None:
                    index = pc.index(outside, True).as_py()
                    value = values[index].as_py()
                    first = (shard, row + index + 1, value, time_type, offsets[value > high])
                count += n_outside
                row += batch.num_rows
    if first is not None:
        shard, row, value, time_type, offset = first
        year = _year_of(value * 10**6 // _TICKS_PER_SECOND[time_type.unit] + offset)
        more = f" ({count:,} events like it)" if count > 1 else ""
        raise InputError(f"{shard}, row {row:,}: time {value:,} {time_type.unit} from 1970 (year {year:,}) is "
                         f"outside the years 1 to 9999 that dates take{more}: write the times in the unit of the "
                         f"column's type, {time_type} (epoch microseconds as timestamp[us]), or correct the value")


def _year_of(microseconds: int) -> int:
    """The year of a wall-clock time (microseconds since 1970) in the Gregorian calendar extended both ways, beyond
    the years 1 to 9999 too (0 the year before 1): the calendar repeats every 400 years, 146,097 days.

    >>> [_year_of(us) for us in (-62_135_596_800_000_001, 253_402_300_800_000_000, 1_577_836_800_000_000_000)]
    [0, 10000, 51969]
    """
    ordinal = microseconds // (86_400 * 10**6) + datetime(1970, 1, 1).toordinal()  # 1 for 0001-01-01
    cycles = (ordinal - 1) // 146_097
    return datetime.fromordinal(ordinal - cycles * 146_097).year + 400 * cycles


def _offsets_at_ends(zone: str | None) -> tuple[int, int]:
    """The UTC offsets, in microseconds, of time zone `zone` (an Arrow timestamp's, None for none) at the first and
    the last time a datetime holds: those its copy adds to times near either end. 0 for a zone the database does not
    know, which `_time_zone` refuses after `_check_time_values`.

    >>> _offsets_at_ends(None), _offsets_at_ends("-12:00"), _offsets_at_ends("Etc/GMT-14")
    ((0, 0), (-43200000000, -43200000000), (50400000000, 50400000000))
    """
    fixed = utc_offset(zone or "")
    if fixed is not None:
        return (_offset_delta(fixed) // timedelta(microseconds=1) if fixed else 0,) * 2
    try:
        info = ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        return 0, 0
    return tuple(info.utcoffset(end) // timedelta(microseconds=1) for end in (datetime.min, datetime.max))


def _subject_checks(con: duckdb.DuckDBPyConnection, root: Path, offset: timedelta | None) -> dict:
    """What ingest tells in notes (the `MedsInfo` fields of the same names), in one read of the shards: subjects
    born after their first other dated event, subjects whose dated events but the birth are spread over several
    shards (static rows and births written apart are a layout, not a split patient), and events dated outside
    `PLAUSIBLE_YEARS`, each with its first example (by subject; by shard and row). Times are compared as the
    wall-clock times the copy keeps (UTC instants plus the one `offset`).

    None of these breaks a step, so a 300,000-patient extract is not refused for one patient: a birth after the
    patient's events makes the ages at those events negative (the EHR prior's age feature), a record cut before the
    birth has none (the prior takes the train patients' mean age) and Direct Forecast's record names the birth year
    after visits it lists; every step reads all shards as one table, so a subject's events in two are joined.
    """
    shift = 0 if offset is None else offset // timedelta(microseconds=1)
    first, last = (f"epoch_us(TIMESTAMP '{year}-01-01') - {shift}" for year in PLAUSIBLE_YEARS)
    events = duck.read("read_parquet", root / meds.data_subdirectory, "**/*.parquet",
                       "union_by_name = true, filename = true, file_row_number = true")
    birth = duck.literal(meds.birth_code)
    # Every time as a UTC instant in microseconds, whatever its type (a zone's nanoseconds have no epoch_us of their
    # own): cast to TIMESTAMP, which shows a time with a zone in the session's zone, UTC (`duck.connect`). (Casting to
    # TIMESTAMPTZ instead would look up the zone of every time without one, four times slower.)
    [(n_late, late, n_spread, spread, n_odd, odd)] = con.execute(f"""
        WITH events AS (
            SELECT subject_id, code, filename, file_row_number, epoch_us(time::TIMESTAMP) AS time
            FROM {events}),
        subjects AS (
            SELECT subject_id, min(time) FILTER (WHERE code = {birth}) AS birth,
                   min(time) FILTER (WHERE code <> {birth}) AS first_event,
                   -- Where its clinical events are: demographics (sex, birth) in a shard of their own are a layout.
                   min(filename) FILTER (WHERE time IS NOT NULL AND code <> {birth}) AS first_shard,
                   max(filename) FILTER (WHERE time IS NOT NULL AND code <> {birth}) AS last_shard
            FROM events GROUP BY subject_id),
        odd AS (
            SELECT count(*) AS n, arg_min((filename, file_row_number + 1, subject_id, code, time + {shift}),
                                          (filename, file_row_number)) AS first
            FROM events WHERE time < {first} OR time >= {last})
        SELECT count(*) FILTER (WHERE birth > first_event),
               arg_min((subject_id, birth + {shift}, first_event + {shift}), subject_id)
                   FILTER (WHERE birth > first_event),
               count(*) FILTER (WHERE first_shard <> last_shard),
               arg_min((subject_id, first_shard, last_shard), subject_id) FILTER (WHERE first_shard <> last_shard),
               (SELECT n FROM odd), (SELECT first FROM odd)
        FROM subjects""").fetchall()

    def wall_clock(microseconds: int) -> datetime:
        return datetime(1970, 1, 1) + timedelta(microseconds=microseconds)

    def relative(shard: str) -> str:
        return str(Path(shard).relative_to(root))

    return {
        "n_born_after_events": n_late,
        "born_after_events": late and LateBirth(late[0], wall_clock(late[1]), wall_clock(late[2])),
        "n_subjects_in_several_shards": n_spread,
        "in_several_shards": spread and SubjectInShards(spread[0], relative(spread[1]), relative(spread[2])),
        "n_implausible_times": n_odd,
        "implausible_time": odd and OddTime(relative(odd[0]), odd[1], odd[2], odd[3], wall_clock(odd[4])),
    }


def _file_stamps(root: Path) -> tuple[tuple, ...]:
    """(relative path, inode, size, modification and change time in ns) of every file under `root`, sorted."""
    stamps = []
    for path in root.rglob("*"):
        status = path.lstat()
        if stat.S_ISREG(status.st_mode):
            stamps.append((str(path.relative_to(root)), status.st_ino, status.st_size, status.st_mtime_ns,
                           status.st_ctime_ns))
    return tuple(sorted(stamps))


@contextlib.contextmanager
def _spilling_connection(what: str, memory_limit: str) -> Iterator[duckdb.DuckDBPyConnection]:
    """An in-memory DuckDB connection for `what` that spills beyond `memory_limit` to the system's temporary
    directory (`duck.connect`), where a full disk is one ConfigError saying so.

    Without a limit DuckDB takes 80% of the machine's memory for a dataset of hundreds of millions of events.
    Running out of memory within the limit is left to the command, which knows how its user sets the limit
    (`duck.resource_errors`)."""
    con = duck.connect(":memory:")
    try:
        with duck.resource_errors(what, Path(tempfile.gettempdir()),
                                  elsewhere="set TMPDIR to a directory on a disk with room"):
            duck.limit_memory(con, memory_limit)
            yield con
    finally:
        con.close()


def _check_events(con: duckdb.DuckDBPyConnection, data_dir: Path, shards: tuple[Path, ...], encounter: str,
                  float_encounters: bool, other_spellings: bool
                  ) -> tuple[int, int, int, tuple[int, ...], tuple[Respelling, ...]]:
    """The event checks of `validate_meds_dir`, in DuckDB; returns the subjects, events, diagnoses without an
    encounter, ICD versions of the data, and its diagnoses in other spellings (with `other_spellings`)."""
    def scan(options: str = "", as_written: bool = False) -> str:
        """The shards with the encounter column under its platform name and, unless `as_written`, each diagnosis
        code in the platform's spelling."""
        relation = duck.read("read_parquet", data_dir, "**/*.parquet", f"union_by_name = true{options}")
        columns = "*" if encounter == "encounter_id" else f"*, {encounter} AS encounter_id"
        if other_spellings and not as_written:
            columns = columns.replace("*", f"* REPLACE (coalesce({respelled_diagnosis_sql('code')}, code) AS code)", 1)
        return relation if columns == "*" else f"(SELECT {columns} FROM {relation})"

    rel = scan()
    # Every event needs a subject and a code, every diagnosis a known code system. The prefix
    # test ignores case: codes are case-sensitive, so 'diagnosis//…' would otherwise pass as some other code.
    # Spaces around a code (a spreadsheet or CSV export's) are no part of it: such a diagnosis would otherwise pass
    # as a code of no system, or its absence as data without diagnoses.
    # DuckDB's one-argument trim() strips spaces only; tabs and line breaks are as little part of a code.
    trimmed = "trim(code, ' ' || chr(9) || chr(10) || chr(13))"
    is_diagnosis = f"{trimmed} ILIKE 'DIAGNOSIS//%'"
    if other_spellings:  # a code naming ICD in another spelling that none of DIAGNOSIS_SPELLINGS matches
        is_diagnosis = f"({is_diagnosis} OR regexp_matches({trimmed}, {duck.literal(_OTHER_DIAGNOSIS_PREFIX)}, 'i'))"
    problems = {
        "subject_id IS NULL": "subject_id is empty: every MEDS event needs its subject",
        # '' (or white space) is no code either: it would pass into records and vocabularies as one.
        f"code IS NULL OR {trimmed} = ''": "code is empty: every MEDS event needs a code",
        f"{is_diagnosis} AND NOT regexp_full_match(code, '{_DIAGNOSIS_CODE.pattern[1:-1]}')": None,
    }
    if float_encounters:  # copied as int64 (`_conform_shard`), so every id must be a whole number
        problems["encounter_id IS NOT NULL AND (NOT isfinite(encounter_id) OR encounter_id <> trunc(encounter_id))"] = (
            f"{encounter} {{encounter_id}} is not a whole number: encounter ids must be integers (write them as int64)")
    located = scan(", filename=true, file_row_number=true")
    # One pass: the problem counts and the dataset summary.
    *counts, n_subjects, n_events, n_loose = con.execute(
        "SELECT " + ", ".join(f"count(*) FILTER (WHERE {condition})" for condition in problems)
        + ", count(DISTINCT subject_id), count(*), count(*) FILTER (WHERE code LIKE 'DIAGNOSIS//%' "
        f"AND encounter_id IS NULL) FROM {located}").fetchone()
    for (condition, problem), count in zip(problems.items(), counts):
        if not count:
            continue
        filename, row, code, encounter_id = con.execute(
            f"SELECT filename, file_row_number + 1, code, encounter_id FROM {located} "
            f"WHERE {condition} ORDER BY filename, file_row_number LIMIT 1").fetchone()
        more = f" ({count:,} events like it)" if count > 1 else ""
        if problem is not None:
            problem = problem.format(code=code, encounter_id=encounter_id)
        else:
            problem = _diagnosis_code_problem(code, _DIAGNOSIS_CODE)
        raise InputError(f"{filename}, row {row:,}: {problem}{more}")
    # Encounters are told apart by encounter_id alone (cohorts order them and cut records by it): an id that
    # a second patient reuses would merge two stays.
    shared = con.execute(f"""SELECT encounter_id, min(subject_id), max(subject_id), count(*) OVER ()
                             FROM {rel} WHERE encounter_id IS NOT NULL GROUP BY encounter_id
                             HAVING count(DISTINCT subject_id) > 1 ORDER BY encounter_id LIMIT 1""").fetchone()
    if shared:
        encounter, first, second, n_shared = shared
        filename, row = con.execute(f"SELECT filename, file_row_number + 1 FROM {located} WHERE encounter_id = ? "
                                    "AND subject_id = ? ORDER BY filename, file_row_number LIMIT 1",
                                    [encounter, second]).fetchone()
        more = f" ({n_shared:,} encounter ids like it)" if n_shared > 1 else ""
        raise InputError(f"{filename}, row {row:,}: encounter_id {encounter} belongs to subjects {first} and {second}"
                         f"{more}: encounter ids must be unique across the dataset (e.g. the admission id); "
                         "number them per dataset, not per patient")
    # A shard copied under a second name would count its events twice. Only shards with equal row counts (from the
    # Parquet footers) can hold the same events, so only those are read, each summed to an order-independent hash.
    by_rows: dict[int, list[Path]] = {}
    for shard in shards:
        by_rows.setdefault(pq.ParquetFile(shard).metadata.num_rows, []).append(shard)
    first_with_content: dict[tuple[int, int], Path] = {}
    for n_rows, group in by_rows.items():
        for shard in group if len(group) > 1 and n_rows else ():  # empty shards (a split without patients) are fine
            [(content,)] = con.execute(f"SELECT sum(hash(t)::HUGEINT) FROM {duck.read('read_parquet', shard)} t"
                                       ).fetchall()
            earlier = first_with_content.setdefault((n_rows, content), shard)
            if earlier != shard:
                raise InputError(f"{shard}: the same {n_rows:,} events as {earlier} (a copied shard): remove one of "
                                 "the two; every event must be stored once")
    versions = tuple(sorted(int(v) for (v,) in con.execute(
        f"SELECT DISTINCT split_part(code, '//', 3) FROM {rel} WHERE code LIKE 'DIAGNOSIS//ICD//%'").fetchall()))
    if not versions:
        # What the data codes instead, by prefix (up to its first slashes), so the user knows what to rewrite.
        seen = con.execute(f"""SELECT regexp_extract(code, '^[^/]*/*') AS prefix, count(*) AS n FROM {rel}
                               GROUP BY prefix ORDER BY n DESC, prefix LIMIT 5""").fetchall()
        codes_seen = ", ".join(f"{prefix}{'…' if prefix.endswith('/') else ''} {n:,}" for prefix, n in seen)
        raise InputError(f"{data_dir.parent}: no diagnosis events (codes DIAGNOSIS//ICD//9|10//..."
                         f"{', or ICD10CM/… and the other spellings ingest takes' if other_spellings else ''}); "
                         f"codes seen: {codes_seen}: next-encounter forecasting needs ICD-9-CM or ICD-10-CM "
                         "diagnosis codes; write them as DIAGNOSIS//ICD//10//<code without dot> "
                         "(docs/bring-your-own-data.md)")
    respelled: tuple[Respelling, ...] = ()
    if other_spellings:
        written, platform = scan(as_written=True), respelled_diagnosis_sql("code")
        respelled = tuple(Respelling(*row) for row in con.execute(f"""
            SELECT regexp_extract(code, '^(.*/)'), CAST(split_part({platform}, '//', 3) AS INTEGER), count(*), min(code)
            FROM {written} WHERE {platform} <> code GROUP BY ALL ORDER BY count(*) DESC, 1""").fetchall())
    return n_subjects, n_events, n_loose, versions, respelled


def _diagnosis_code_problem(code: str, valid: re.Pattern) -> str:
    """What is wrong with a code under DIAGNOSIS// that `valid` does not match, or one naming ICD in another
    spelling that no pattern of `DIAGNOSIS_SPELLINGS` matches, and the fix."""
    if code != code.strip():
        return f"diagnosis code {code!r} has white space around it: write it {code.strip()!r}"
    if not code.upper().startswith("DIAGNOSIS//"):
        if any(re.match(pattern, code.upper()) for pattern in DIAGNOSIS_SPELLINGS.values()):
            return f"diagnosis code {code!r} is not upper case: write it {code.upper()!r}"
        prefix = re.match(_OTHER_DIAGNOSIS_PREFIX, code, re.IGNORECASE).group(0)
        version, examples, procedures = (("10", "E11.9 or E119", "ICD10PCS/") if prefix.upper().startswith("ICD10")
                                         else ("9", "250.00, V45.81 or 25000", "ICD9Proc/"))
        return (f"diagnosis code {code!r}: no ICD-{version} diagnosis code follows {prefix!r} (such as {examples}): "
                f"write the code so, or as DIAGNOSIS//ICD//{version}//<code without dot>; give a procedure its own "
                f"prefix ({procedures}…)")
    if valid.match(code.upper()):
        prefix = code.upper().rsplit("//", 1)[0] + "//"
        return f"diagnosis code {code!r} is not upper case: write it {code.upper()!r} (prefix {prefix})"
    if valid.match(undotted := code.upper().replace(".", "")):
        return f"diagnosis code {code!r} has a dot: write it {undotted!r} (MEDS ICD codes are written without it)"
    return (f"unknown code system in diagnosis code {code!r}: diagnosis codes must be "
            "DIAGNOSIS//ICD//9//<code> or DIAGNOSIS//ICD//10//<code> without the dot")


def _check_dictionary_codes(codes_path: Path, other_spellings: bool) -> None:
    """Refuse a diagnosis code in codes.parquet written other than the data's codes are (e.g. with its dot, unless
    `other_spellings` has the copy rewrite it as the data's).

    A diagnosis dictionary there becomes the cohorts' vocabulary Ω: a code spelled `DIAGNOSIS//ICD//10//I50.22`
    would match no event and no model output, so every forecast would come out empty without an error.
    """
    codes = pl.read_parquet(codes_path, columns=["code"], glob=False).cast(pl.String).with_row_index("row", offset=1)
    respelled = pl.any_horizontal([pl.col("code").str.contains(pattern) for pattern in DIAGNOSIS_SPELLINGS.values()])
    wrong = codes.filter(pl.col("code").str.strip_chars().str.to_uppercase().str.starts_with("DIAGNOSIS//")
                         & ~pl.col("code").str.contains(_DICTIONARY_DIAGNOSIS_CODE.pattern)
                         & ~(respelled & pl.lit(other_spellings)))
    if wrong.height:
        more = f" ({wrong.height:,} codes like it)" if wrong.height > 1 else ""
        raise InputError(f"{codes_path}, row {wrong['row'][0]:,}: "
                         f"{_diagnosis_code_problem(wrong['code'][0], _DICTIONARY_DIAGNOSIS_CODE)}{more}")


def respelled_diagnosis_sql(code: str) -> str:
    """SQL for the platform's spelling of the code in column `code` when it is a diagnosis spelled as
    `DIAGNOSIS_SPELLINGS` lists (ICD10CM/E11.9 as DIAGNOSIS//ICD//10//E119), else NULL."""
    return "CASE " + " ".join(
        f"WHEN regexp_full_match({code}, {duck.literal(pattern)}) THEN 'DIAGNOSIS//ICD//{version}//' || "
        f"replace(regexp_extract({code}, {duck.literal(pattern)}, 3), '.', '')"
        for version, pattern in DIAGNOSIS_SPELLINGS.items()) + " END"


def _respelled(codes: pa.Array | pa.ChunkedArray) -> pa.Array:
    """`codes` as text, each diagnosis in another spelling (`DIAGNOSIS_SPELLINGS`) in the platform's."""
    con = duck.connect(":memory:")
    try:
        con.register("written", pa.table({"code": codes.cast(pa.large_string())}))
        return con.sql(f"SELECT coalesce({respelled_diagnosis_sql('code')}, code) FROM written"
                       ).to_arrow_table().column(0).combine_chunks()
    finally:
        con.close()


def _respell_dictionary(codes_path: Path) -> None:
    """Rewrite codes.parquet with its diagnoses in the platform's spelling, one row per code: a code listed in two
    spellings keeps its first row with a description. A file without such codes is left as it is (the dataset's
    fingerprint reads its bytes). `parent_codes` stay as written: MEDS lets them name codes of other vocabularies
    (OMOP's ICD10CM/E11 above all), and nothing here reads them."""
    table = pq.read_table(codes_path)
    codes = _respelled(table["code"])
    if codes.equals(table["code"].cast(pa.large_string()).combine_chunks()):
        return
    described = (pc.is_valid(table["description"]) if "description" in table.column_names
                 else pa.array([False] * table.num_rows))
    rows = pl.DataFrame({"code": codes, "described": described}).with_row_index("row")
    kept = rows.sort("described", descending=True, maintain_order=True).unique("code", keep="first").sort("row")
    table = table.set_column(table.column_names.index("code"), pa.field("code", pa.string()),
                             codes.cast(pa.string())).take(kept["row"].to_arrow())
    _atomic_write(table, codes_path)


def _unreadable_optional_file(path: Path, exc: Exception) -> InputError:
    """The error for an optional metadata file that is no readable Parquet, with the reader's first line."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return InputError(f"{path} is not a readable Parquet file ({reason}): rewrite or remove it (the file is optional)")


def _is_text(arrow_type: pa.DataType) -> bool:
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_string_view(arrow_type)


def _holds_text(arrow_type: pa.DataType) -> bool:
    """Any string type, also dictionary-encoded (a polars Categorical, a pandas category)."""
    return _is_text(arrow_type) or pa.types.is_dictionary(arrow_type) and _is_text(arrow_type.value_type)


def _meds_types(schema: pa.Schema) -> pa.Schema:
    """`schema` with each MEDS column given the type MEDS declares for it where the file's type is one that
    common writers choose for the same values.

    Any string type (Parquet stores them alike: polars records large_string, pandas string), also
    dictionary-encoded (a polars Categorical, a pandas category); a column that pandas wrote as all-null; a
    numeric_value of double or integers (pandas' float64; MEDS keeps float32); a time of another unit, without
    a time zone (pandas: ns) or in one (validation checks that the times are at one UTC offset, `_time_zone`); a
    subject_id of another signed integer width, or unsigned up to 32 bits. Anything else (dates, text times) keeps
    its type, so validation names it.
    """
    declared = meds.DataSchema.schema()

    def conformed(field: pa.Field) -> pa.Field:
        if field.name not in declared.names:
            return field
        have, want = field.type, declared.field(field.name).type
        takes = {"numeric_value": pa.types.is_null(have) or pa.types.is_floating(have) or pa.types.is_integer(have),
                 "text_value": pa.types.is_null(have) or _holds_text(have),
                 "code": _holds_text(have),
                 # at the wall-clock time of its one UTC offset (`_conform_shard`); null in a shard of static rows
                 "time": pa.types.is_null(have) or pa.types.is_timestamp(have),
                 # uint64 ids may not fit int64
                 "subject_id": pa.types.is_signed_integer(have) or pa.types.is_unsigned_integer(have)
                 and have.bit_width < 64}
        return declared.field(field.name) if takes[field.name] else field

    return pa.schema([conformed(f) for f in schema])


def _stored_types(schema: pa.Schema) -> pa.Schema:
    """The types a copied shard is rewritten to: `_meds_types`, except that text keeps the writer's string type
    (readers take either, and a dataset written by polars is not worth rewriting for it)."""
    return pa.schema([f if _is_text(f.type) else conformed for f, conformed in zip(schema, _meds_types(schema))])


def _fingerprints(root: Path, shards: tuple[Path, ...]) -> tuple[str, str]:
    """The content fingerprint of a MEDS directory, of its metadata but its paths (`_metadata_bytes`), splits, code
    dictionary and every shard's bytes; and the same with those paths (`MedsInfo.fingerprint_with_paths`).

    Every byte, not sizes and row counts: a nightly extract that corrects one code to another of the same length
    often keeps each file's size, and under an unchanged fingerprint the next cohort build would rebuild the
    earlier cohort in place, under the runs scored against it. SHA-256 reads about 1 GB/s, little next to
    validation's own read of every event; the files are read once for both.
    """
    files = bytearray()  # each file's name and digest, hashed after the metadata
    for path in (root / meds.subject_splits_filepath, root / meds.code_metadata_filepath, *shards):
        if path.is_file():
            files += f"{path.relative_to(root)}\n".encode()
            with path.open("rb") as f:
                files += hashlib.file_digest(f, "sha256").digest()

    def fingerprint(with_paths: bool) -> str:
        return hashlib.sha256(_metadata_bytes(root, with_paths) + files).hexdigest()[:FINGERPRINT_LENGTH]

    return fingerprint(with_paths=False), fingerprint(with_paths=True)


def current_size_fingerprint(root: Path) -> str | None:
    """The fingerprint of sizes and row counts (`_size_fingerprint`) of a MEDS directory's shards as they are now,
    without validating them: what a registration from before content fingerprints would have found. None when the
    files change while it reads them: it is read without the dataset's lock (a forecast's note; an ingest may swap
    the directory meanwhile), and only a note's wording rests on it, which must not fail the forecast."""
    data_dir = root / meds.data_subdirectory
    try:
        return _size_fingerprint(root, _shard_files(data_dir))
    except (OSError, pa.ArrowException, ValueError):  # a file gone or half-replaced; dataset.json rewritten
        return None


def _size_fingerprint(root: Path, shards: tuple[Path, ...]) -> str:
    """The fingerprint datasets were registered under before `_fingerprints` read contents: metadata (paths and
    all), splits, shard row counts and sizes. Kept to recognize those registrations, whose cohort ids it is part of."""
    h = hashlib.sha256()
    h.update(_metadata_bytes(root, with_paths=True))
    splits_path = root / meds.subject_splits_filepath
    if splits_path.is_file():
        h.update(splits_path.read_bytes())
    for shard in shards:
        h.update(f"{shard.relative_to(root)}:{shard.stat().st_size}:{pq.ParquetFile(shard).metadata.num_rows}".encode())
    return h.hexdigest()[:16]


def _metadata_bytes(root: Path, with_paths: bool) -> bytes:
    """metadata/dataset.json as fingerprinted (empty when there is no such file): without its creation stamp, which
    changes on every regeneration of identical data, and unless `with_paths` without the two keys that say where
    files were, not what they hold: the MIMIC importer's `source_dir` (the release it read) and
    `import_summary.out_dir` (the gold-store directory it wrote). So the same release imported from any path into any
    warehouse gets one fingerprint, and its cohorts one id each."""
    metadata_path = root / meds.dataset_metadata_filepath
    if not metadata_path.is_file():
        return b""
    metadata = {k: v for k, v in json.loads(metadata_path.read_text()).items() if k != "created_at"}
    if not with_paths:
        metadata.pop("source_dir", None)
        if isinstance(metadata.get("import_summary"), dict):
            metadata["import_summary"] = {k: v for k, v in metadata["import_summary"].items() if k != "out_dir"}
    return json.dumps(metadata, sort_keys=True).encode()


def copy_meds_dir(source: Path, target: Path, encounter_column: str = "encounter_id",
                  offset: timedelta | None = None, respell: bool = False, memory_limit: str = "2GB") -> None:
    """Copy a MEDS directory into the gold store, replacing any older copy.

    A real copy, not hard links: a source file later rewritten in place must not change the
    registered dataset under its fingerprint. Shards whose encounter column has another name
    (`encounter_column`, see `validate_meds_dir`) gain an `encounter_id` copy of it, the column
    everything downstream reads; shards with columns of other writers' types (`_meds_types`) are
    rewritten with the MEDS types, and shards without the optional value columns gain them empty. Times in a
    time zone become the wall-clock times they show at `offset`, the one UTC offset validation found for them
    (`MedsInfo.utc_offset`). With `respell` (validation found diagnoses in other spellings: `MedsInfo.respelled`)
    every diagnosis code of the shards is written in the platform's spelling (one written in several at one time and
    encounter, once, found by DuckDB within `memory_limit`); those of codes.parquet are whenever it has such codes
    (a dictionary may spell its codes so although the data does not).
    """
    source, target = Path(source).resolve(), Path(target)
    if source == target.resolve() and encounter_column == "encounter_id" and not respell:
        return
    remove_abandoned(target)
    with scratch(target, "tmp") as staging:
        shutil.copytree(source, staging)
        for shard in _shard_files(staging / meds.data_subdirectory):
            _conform_shard(shard, encounter_column, offset, respell, memory_limit)
        if (staging / meds.code_metadata_filepath).is_file():
            _respell_dictionary(staging / meds.code_metadata_filepath)
        replace_dir(staging, target)


# Rows a shard's rewrite holds at once (pyarrow's default): a batch may span row groups, so a shard of fewer rows is
# one batch however it was written.
_BATCH_ROWS = 65_536


def _conform_shard(shard: Path, encounter_column: str, offset: timedelta | None, respell: bool = False,
                   memory_limit: str = "2GB") -> None:
    """Rewrite a shard, `_BATCH_ROWS` rows at a time (shards can be large), when its columns need the MEDS types
    (`_stored_types`), its encounter column needs the `encounter_id` copy (int64) or holds whole numbers as
    floats (int64 too), it lacks a value column, or `respell` asks for its diagnosis codes in the platform's
    spelling (`_respelled`), a diagnosis written in several spellings at one time and encounter once
    (`_respelled_repeats`).

    MEDS lets a shard leave out `numeric_value` and `text_value` (exports before MEDS 0.3.3 have no
    `text_value`); the copy gains them as empty columns, since every reader selects both."""
    declared = meds.DataSchema.schema()
    with pq.ParquetFile(shard) as source:
        have = source.schema_arrow
        want = _stored_types(have)
        absent = [name for name in ("numeric_value", "text_value") if name not in have.names]
        for name in absent:
            want = want.append(declared.field(name))
        if encounter_column != "encounter_id":
            want = want.append(pa.field("encounter_id", pa.int64()))
        elif pa.types.is_floating(have.field("encounter_id").type):  # whole numbers (`validate_meds_dir`)
            want = want.set(want.get_field_index("encounter_id"), pa.field("encounter_id", pa.int64()))
        repeats = np.array([], np.int64)
        if respell:
            want = want.set(want.get_field_index("code"), pa.field("code", pa.large_string()))
            repeats = _respelled_repeats(shard, encounter_column, [name for name in ("numeric_value", "text_value")
                                                                   if name in have.names], memory_limit)
        elif want.equals(have):
            return
        tmp = shard.with_name(f".{shard.name}.{uuid.uuid4().hex}.tmp")
        first_row = 0  # of the batch, in the shard
        with pq.ParquetWriter(tmp, want, compression="zstd") as writer:
            for batch in source.iter_batches(batch_size=_BATCH_ROWS):
                n_rows = batch.num_rows
                # The batch's own repeats, a slice of the sorted row numbers: matching each batch against all of
                # them cost batches x repeats, minutes for a shard of millions of rows that spells each diagnosis
                # twice.
                start, stop = np.searchsorted(repeats, [first_row, first_row + n_rows])
                if stop > start:
                    keep = np.ones(n_rows, dtype=bool)
                    keep[repeats[start:stop] - first_row] = False
                    batch = batch.filter(pa.array(keep))
                first_row += n_rows
                columns = [*batch.columns, *(pa.nulls(batch.num_rows, declared.field(name).type) for name in absent)]
                if encounter_column != "encounter_id":
                    columns = [*columns, batch.column(encounter_column)]
                if respell:
                    columns[want.get_field_index("code")] = _respelled(columns[want.get_field_index("code")])
                # Times and values lose what MEDS does not keep (nanoseconds, float64 digits, a UTC offset: the
                # times at one offset keep the wall-clock time they show); ids must fit.
                writer.write_batch(pa.RecordBatch.from_arrays(
                    [_wall_clock(column, offset).cast(field.type, safe=field.name not in ("time", "numeric_value"))
                     for column, field in zip(columns, want)], schema=want))
    os.replace(tmp, shard)


def _respelled_repeats(shard: Path, encounter_column: str, value_columns: list[str],
                       memory_limit: str = "2GB") -> np.ndarray:
    """The rows of `shard` (numbers in file order, ascending) that the rewrite to the platform's spelling would make
    copies of others: diagnoses of one subject, time and encounter, with the same values (`value_columns`, those the
    shard has), written in several spellings of one code, such as ICD10CM/E11.9 beside DIAGNOSIS//ICD//10//E119.

    One diagnosis coded twice by the source would count twice wherever rows are counted (the evaluation's frequency
    buckets count a code's train events). Of such rows the spelling written most often (then first) stays: rows in
    one spelling were equal before the rewrite too, repeated measurements MEDS allows, and are all kept.
    """
    platform = respelled_diagnosis_sql("code")
    same = ", ".join(f'"{name}"' for name in ("subject_id", "time", encounter_column, "platform_code", *value_columns))
    with _spilling_connection(f"finding the diagnoses of MEDS shard {shard} written in several spellings",
                              memory_limit) as con:
        return con.sql(f"""
            WITH diagnoses AS (
                SELECT *, {platform} AS platform_code
                FROM {duck.read("read_parquet", shard, options="file_row_number = true")} WHERE {platform} IS NOT NULL),
            spellings AS (
                SELECT file_row_number, code, {same}, count(*) OVER spelling AS n, min(file_row_number) OVER spelling
                       AS first_row
                FROM diagnoses WINDOW spelling AS (PARTITION BY {same}, code))
            SELECT file_row_number FROM spellings
            QUALIFY code <> first_value(code) OVER (PARTITION BY {same} ORDER BY n DESC, first_row)
            ORDER BY file_row_number""").to_arrow_table().column(0).to_numpy().astype(np.int64)


def _wall_clock(column: pa.Array, offset: timedelta | None) -> pa.Array:
    """A time zone's times (stored as UTC instants) as the wall-clock times they show at its UTC `offset`; others as
    they are.

    Adding the offset needs no zone database, which Arrow would read from the system (a slim container has none).
    """
    if not (pa.types.is_timestamp(column.type) and column.type.tz):
        return column
    unit = column.type.unit
    if offset is None:
        if column.null_count == len(column):  # a static shard's empty times, which validation leaves out
            return column.cast(pa.timestamp(unit))
        raise ValueError(f"times in time zone {column.type.tz} copied without the UTC offset validation found for them")
    return pc.add(column.cast(pa.timestamp(unit)), pa.scalar(offset, pa.duration(unit)))


def replace_dir(staging: Path, target: Path) -> None:
    """Swap a fully written directory into place; the old one is removed only after the swap.

    Where the system can, the two trade places in one step (`exchange`), so a reader finds the old directory or the
    new one at `target`, never neither, even when this process is killed (the old one is then left at `staging`,
    the scratch of a killed write). Elsewhere the old one is moved aside first: an exception between the two renames
    (Ctrl-C, SIGTERM as the CLI raises it) puts it back, since the scratch block would otherwise remove it.
    """
    if target.is_dir() and exchange(staging, target):
        shutil.rmtree(staging, ignore_errors=True)  # the old directory now
        return
    with scratch(target, "old") as old:
        try:
            if target.exists():
                os.replace(target, old)
            os.replace(staging, target)
        except BaseException:
            if old.exists() and not target.exists():
                os.replace(old, target)
            raise


def check_splits(splits: pl.DataFrame, path: Path) -> None:
    """Refuse subject ids that are not integers (they match no subject of data/), a split name other than
    train/tuning/held_out, and a subject listed twice (its held-out target would be in the training data)."""
    if not splits.schema["subject_id"].is_integer():
        raise InputError(f"{path}: column 'subject_id' is {splits.schema['subject_id']}, not an integer: write the "
                         "subject ids of data/ (int64)")
    rows = splits.with_row_index("row", offset=1)
    unknown = rows.filter(~pl.col("split").is_in(SPLITS).fill_null(False))
    if unknown.height:
        first = unknown.row(0, named=True)
        more = f" ({unknown.height:,} rows like it)" if unknown.height > 1 else ""
        raise InputError(f"{path}, row {first['row']:,}: split {first['split']!r} is not one of "
                         f"{', '.join(SPLITS)}{more}: rename it to one of these")
    repeated = rows.filter(pl.col("subject_id").is_duplicated())
    if repeated.height:
        first, again = repeated.filter(pl.col("subject_id") == repeated["subject_id"][0]).head(2).iter_rows(named=True)
        raise InputError(f"{path}, row {again['row']:,}: subject {first['subject_id']} is listed again (first at row "
                         f"{first['row']:,}, split {first['split']!r}): list every subject once")


def read_splits(info: MedsInfo, seed: int, memory_limit: str = "2GB") -> pl.DataFrame:
    """Subject splits: the dataset's own when present, else the deterministic hash rule (DuckDB reads the
    subjects within `memory_limit`)."""
    if info.has_splits:
        path = info.root / meds.subject_splits_filepath
        splits = pl.read_parquet(path, glob=False).select("subject_id", "split")
        check_splits(splits, path)  # again: the file may have changed since the dataset was registered
        return splits
    with _spilling_connection(f"reading the subjects of MEDS directory {info.root}", memory_limit) as con:
        events = duck.read("read_parquet", info.root / "data", "**/*.parquet")
        ids = con.execute(f"SELECT DISTINCT subject_id FROM {events} ORDER BY subject_id").fetchnumpy()["subject_id"]
    return pl.DataFrame({"subject_id": ids, "split": [hash_split(int(s), seed) for s in ids]},
                        schema={"subject_id": pl.Int64, "split": pl.String})
