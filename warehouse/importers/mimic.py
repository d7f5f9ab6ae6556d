"""MIMIC-III and MIMIC-IV (`hosp` module) into MEDS.

The official CSV files (plain or gzipped; header names matched ignoring case and surrounding spaces) are
read by DuckDB as text, checked (required tables and columns present and not empty, every typed value
castable, patients and admissions unique, every diagnosis, procedure and prescription on an admission of
its own patient), normalized into one view per concept by a small layout-specific SQL block, and turned
into MEDS events by SQL shared by both releases. Nothing is held as Python objects; DuckDB works in a file-backed
database next to the output so large releases spill to disk instead of exhausting memory.

Events (all with `encounter_id` = `hadm_id` where there is an admission):
- `GENDER//F|M` static; `MEDS_BIRTH` (MIMIC-III: `dob`; MIMIC-IV: 1 January of anchor_year −
  anchor_age); `MEDS_DEATH` (the admission's `deathtime` when the patient died in hospital, else
  the end of the patient's `dod` day, 23:59:59 with `time_imputed = true`, so that a death known
  by its date never precedes an admission of that day);
- `HOSPITAL_ADMISSION//{admission_type}` at `admittime`, `HOSPITAL_DISCHARGE//{discharge_location}`
  at `dischtime`;
- `DIAGNOSIS//ICD//{9|10}//{code without dot}` at `dischtime`, extra column `seq_num`;
- `PROCEDURE//ICD//{9|10}//{code}` at `chartdate` (MIMIC-IV) or `dischtime` (MIMIC-III);
- `MEDICATION//NDC//{ndc}` when the row has a real NDC, else `MEDICATION//NAME//{drug, lower case,
  single spaces}`, at `starttime` (MIMIC-III: `startdate`); one without `hadm_id` belongs to the
  admission whose stay it falls in, as a lab result does;
- only when asked for (`labs`): `LAB//{label} ({fluid})//{unit}` from `labevents` and `d_labitems`
  (the itemid when the item is not in the dictionary; `no unit` when none) at `charttime`, with
  `numeric_value` = `valuenum`, else `text_value` = `value`; a result without `hadm_id` belongs to
  the admission whose stay it falls in (from `edregtime`, else `admittime`, to `dischtime`: the
  emergency-department draws before an admission), any other (outpatient) stays outside any
  encounter.

Pinned rules:
- an event whose own time is missing takes a stand-in time and gets `time_imputed = true`:
  diagnoses (and MIMIC-III procedures) without `dischtime` take `admittime`, MIMIC-IV procedures
  without `chartdate` take `dischtime` (else `admittime`), prescriptions without a start take
  `admittime`;
- ages above 89 are capped at 90: the `MEDS_BIRTH` row is moved to make the patient exactly 90 at
  the reference point and carries `time_imputed = true`. MIMIC-III shifts the birth dates of
  patients older than 89 (computed ages near 300), so its reference is the first admission;
  MIMIC-IV top-codes `anchor_age` (91 for everyone above 89), so its reference is `anchor_year`;
- duplicate diagnosis rows (same admission, ICD version and code) collapse into one event keeping
  the smallest `seq_num`; identical procedure rows (same admission, code and time) likewise;
- every admission is written, but only admissions with at least one diagnosis count as encounters
  for cohorts; the import summary (also in `metadata/dataset.json`) records both numbers;
- rows that cannot become events (no code, an unknown admission, no time, no drug) are dropped and
  counted per reason in the summary; admissions discharged before they began are kept and counted;
- MIMIC ships no split, so `metadata/subject_splits.parquet` holds the seeded hash split.
- times are kept as the wall-clock time they show: every time of day in the release must be at one UTC offset (an
  export writing `-05:00` or a zone name such as `Asia/Tokyo` whose offset does not change over the data's times
  after each), or none may have one; mixed offsets are refused (`_check_time_zones`), as they can misorder events.
  The summary records the zone and offset.
- `metadata/codes.parquet` lists every code written and the diagnosis and procedure dictionaries, with a
  `description`: a diagnosis's or procedure's `long_title`; for an NDC, the drug name its prescriptions
  write most often (single spaces; a tie goes to the first name in sort order), as the code is a bare
  number. Lab codes get none: the code already spells the `d_labitems` label and fluid, and an item
  missing from the dictionary has no label to give.
"""

from __future__ import annotations

import csv
import difflib
import gzip
import re
import shlex
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path

import duckdb
import polars as pl

from dxr import __version__
from dxr.errors import InputError
from warehouse import duck
from warehouse.meds import (MIXED_OFFSETS_FIX, SPLITS, MedsInfo, hash_split, offset_text, replace_dir, utc_offset,
                            validate_meds_dir, write_data_shard, write_metadata, zone_offset)
from warehouse.scratch import remove_abandoned, scratch

# Events per data shard (a subject's events are never split): a shard is built in memory as one Arrow table and
# copied about three times while written. Bounded by events, not subjects, as events per subject vary several-fold:
# MIMIC-IV v2.2 has about 75 per patient without lab results and about 470 with them (118M results, 300k patients).
EVENTS_PER_SHARD = 2_000_000
EXTENSION_COLUMNS = ("encounter_id", "seq_num", "time_imputed")
_ICD_CODE = "[A-Z0-9]+"
_FRIENDLY_TYPE = {"BIGINT": "an integer", "INTEGER": "an integer", "DOUBLE": "a number",
                  "TIMESTAMP": "a timestamp (YYYY-MM-DD HH:MM:SS)"}
# Official columns of the tables read (either release) that the importer does not use: a file lacking a needed
# column still has them, so they are never suggested as the needed column under another name.
_UNUSED_OFFICIAL_COLUMNS = frozenset({
    "row_id", "admission_location", "insurance", "language", "religion", "marital_status", "ethnicity", "race",
    "edouttime", "diagnosis", "hospital_expire_flag", "has_chartevents_data", "admit_provider_id",
    "dod_hosp", "dod_ssn", "expire_flag", "anchor_year_group", "icustay_id", "pharmacy_id", "poe_id", "poe_seq",
    "order_provider_id", "enddate", "stoptime", "drug_type", "drug_name_poe", "drug_name_generic",
    "formulary_drug_cd", "gsn", "prod_strength", "form_rx", "dose_val_rx", "dose_unit_rx", "form_val_disp",
    "form_unit_disp", "doses_per_24_hrs", "route", "short_title", "labevent_id", "specimen_id", "storetime",
    "ref_range_lower", "ref_range_upper", "flag", "priority", "comments", "category", "loinc_code",
})


@dataclass(frozen=True)
class SourceTable:
    """One official CSV table: the columns read (official name → type they must cast to)."""

    stem: str
    columns: dict[str, str]
    required: bool = True
    not_null: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()  # columns a file may lack (read as empty), e.g. from a trimmed export


@dataclass(frozen=True)
class Layout:
    """A MIMIC release: its tables and the SQL turning them into the shared concept views.

    `normalize_sql` reads typed views `t_<table>` and must create `adm`, `pat`, `dx`, `px`, `rx`,
    `dict_dx` and `dict_px` with the columns the shared event SQL uses.
    """

    source: str
    title: str
    tables: dict[str, SourceTable]
    normalize_sql: str
    subdirectory: str | None = None
    # Modules beside `subdirectory` that older releases keep some tables in (read too when present).
    sibling_subdirectories: tuple[str, ...] = ()


_ADMISSIONS = SourceTable("admissions", {
    "subject_id": "BIGINT", "hadm_id": "BIGINT", "admittime": "TIMESTAMP", "dischtime": "TIMESTAMP",
    "deathtime": "TIMESTAMP", "admission_type": "VARCHAR", "discharge_location": "VARCHAR", "edregtime": "TIMESTAMP",
}, not_null=("subject_id", "hadm_id", "admittime"), optional=("edregtime",))

MIMIC3 = Layout(
    source="mimic3", title="MIMIC-III",
    tables={
        "patients": SourceTable("patients", {"subject_id": "BIGINT", "gender": "VARCHAR", "dob": "TIMESTAMP",
                                             "dod": "TIMESTAMP"}, not_null=("subject_id",)),
        "admissions": _ADMISSIONS,
        "diagnoses_icd": SourceTable("diagnoses_icd", {"subject_id": "BIGINT", "hadm_id": "BIGINT",
                                                       "seq_num": "INTEGER", "icd9_code": "VARCHAR"},
                                     not_null=("subject_id", "hadm_id")),
        "procedures_icd": SourceTable("procedures_icd", {"subject_id": "BIGINT", "hadm_id": "BIGINT",
                                                         "seq_num": "INTEGER", "icd9_code": "VARCHAR"},
                                      required=False, not_null=("subject_id", "hadm_id")),
        "prescriptions": SourceTable("prescriptions", {"subject_id": "BIGINT", "hadm_id": "BIGINT",
                                                       "startdate": "TIMESTAMP", "drug": "VARCHAR", "ndc": "VARCHAR"},
                                     required=False, not_null=("subject_id",)),
        "d_icd_diagnoses": SourceTable("d_icd_diagnoses", {"icd9_code": "VARCHAR", "long_title": "VARCHAR"},
                                       required=False),
        "d_icd_procedures": SourceTable("d_icd_procedures", {"icd9_code": "VARCHAR", "long_title": "VARCHAR"},
                                        required=False),
    },
    normalize_sql="""
        CREATE VIEW adm AS SELECT * FROM t_admissions;
        CREATE VIEW pat AS
            WITH first_admission AS (SELECT subject_id, min(admittime) AS first_admit FROM t_admissions GROUP BY ALL),
            ages AS (SELECT p.*, f.first_admit, p.dob <= f.first_admit - INTERVAL 90 YEAR AS over_89
                     FROM t_patients p LEFT JOIN first_admission f USING (subject_id))
            SELECT subject_id, gender, dod,
                   CASE WHEN over_89 THEN first_admit - INTERVAL 90 YEAR ELSE dob END AS birth_time,
                   coalesce(over_89, false) AS birth_capped
            FROM ages;
        CREATE VIEW dx AS SELECT subject_id, hadm_id, seq_num, 9 AS icd_version, icd9_code AS icd_code, src_row
            FROM t_diagnoses_icd;
        CREATE VIEW px AS SELECT p.subject_id, p.hadm_id, p.seq_num, 9 AS icd_version, p.icd9_code AS icd_code,
                   p.src_row, coalesce(a.dischtime, a.admittime) AS time, a.dischtime IS NULL AS time_imputed
            FROM t_procedures_icd p LEFT JOIN t_admissions a ON a.hadm_id = p.hadm_id;
        CREATE VIEW rx AS SELECT subject_id, hadm_id, startdate AS starttime, drug, ndc, src_row
            FROM t_prescriptions;
        CREATE VIEW dict_dx AS SELECT 9 AS icd_version, icd9_code AS icd_code, long_title AS title
            FROM t_d_icd_diagnoses;
        CREATE VIEW dict_px AS SELECT 9 AS icd_version, icd9_code AS icd_code, long_title AS title
            FROM t_d_icd_procedures;
    """,
)

MIMIC4 = Layout(
    source="mimic4", title="MIMIC-IV", subdirectory="hosp",
    sibling_subdirectories=("core",),  # MIMIC-IV v0.4 and v1.0 keep patients and admissions in core/
    tables={
        "patients": SourceTable("patients", {"subject_id": "BIGINT", "gender": "VARCHAR", "anchor_age": "INTEGER",
                                             "anchor_year": "INTEGER", "dod": "TIMESTAMP"}, not_null=("subject_id",)),
        "admissions": _ADMISSIONS,
        "diagnoses_icd": SourceTable("diagnoses_icd", {"subject_id": "BIGINT", "hadm_id": "BIGINT",
                                                       "seq_num": "INTEGER", "icd_code": "VARCHAR",
                                                       "icd_version": "INTEGER"},
                                     not_null=("subject_id", "hadm_id", "icd_version")),
        "procedures_icd": SourceTable("procedures_icd", {"subject_id": "BIGINT", "hadm_id": "BIGINT",
                                                         "seq_num": "INTEGER", "chartdate": "TIMESTAMP",
                                                         "icd_code": "VARCHAR", "icd_version": "INTEGER"},
                                      required=False, not_null=("subject_id", "hadm_id", "icd_version")),
        "prescriptions": SourceTable("prescriptions", {"subject_id": "BIGINT", "hadm_id": "BIGINT",
                                                       "starttime": "TIMESTAMP", "drug": "VARCHAR", "ndc": "VARCHAR"},
                                     required=False, not_null=("subject_id",)),
        "d_icd_diagnoses": SourceTable("d_icd_diagnoses", {"icd_code": "VARCHAR", "icd_version": "INTEGER",
                                                           "long_title": "VARCHAR"}, required=False),
        "d_icd_procedures": SourceTable("d_icd_procedures", {"icd_code": "VARCHAR", "icd_version": "INTEGER",
                                                             "long_title": "VARCHAR"}, required=False),
    },
    normalize_sql="""
        CREATE VIEW adm AS SELECT * FROM t_admissions;
        CREATE VIEW pat AS SELECT subject_id, gender, dod,
                   make_timestamp(anchor_year - least(anchor_age, 90), 1, 1, 0, 0, 0) AS birth_time,
                   coalesce(anchor_age > 89, false) AS birth_capped
            FROM t_patients;
        CREATE VIEW dx AS SELECT subject_id, hadm_id, seq_num, icd_version, icd_code, src_row FROM t_diagnoses_icd;
        CREATE VIEW px AS SELECT p.subject_id, p.hadm_id, p.seq_num, p.icd_version, p.icd_code, p.src_row,
                   coalesce(p.chartdate, a.dischtime, a.admittime) AS time, p.chartdate IS NULL AS time_imputed
            FROM t_procedures_icd p LEFT JOIN t_admissions a ON a.hadm_id = p.hadm_id;
        CREATE VIEW rx AS SELECT subject_id, hadm_id, starttime, drug, ndc, src_row FROM t_prescriptions;
        CREATE VIEW dict_dx AS SELECT icd_version, icd_code, long_title AS title FROM t_d_icd_diagnoses;
        CREATE VIEW dict_px AS SELECT icd_version, icd_code, long_title AS title FROM t_d_icd_procedures;
    """,
)


def _stay_sql(view: str, rows: str, time: str) -> str:
    """`view(src_row, hadm_id)`: for each row of `rows` without an hadm_id, the admission of its subject whose stay,
    from `edregtime` (else `admittime`) to `dischtime`, holds its `time`; the latest admitted when stays overlap (the
    larger hadm_id of two admitted at one time, so that every import picks the same)."""
    return f"""CREATE VIEW {view} AS
SELECT r.src_row, arg_max(a.hadm_id, (a.admittime, a.hadm_id)) AS hadm_id
FROM {rows} r JOIN adm a ON a.subject_id = r.subject_id
     AND r.{time} >= least(coalesce(a.edregtime, a.admittime), a.admittime)
     AND r.{time} <= greatest(coalesce(a.dischtime, a.admittime), a.admittime)
WHERE r.hadm_id IS NULL GROUP BY r.src_row;
"""


# Laboratory results (`--labs`): the same columns in both releases. Opt-in because labevents is by far the
# largest table (MIMIC-IV: over 100 million rows), which the import, the cohort build and training then carry.
LAB_TABLES = {
    "labevents": SourceTable("labevents", {"subject_id": "BIGINT", "hadm_id": "BIGINT", "itemid": "BIGINT",
                                           "charttime": "TIMESTAMP", "value": "VARCHAR", "valuenum": "DOUBLE",
                                           "valueuom": "VARCHAR"}, not_null=("subject_id", "itemid")),
    "d_labitems": SourceTable("d_labitems", {"itemid": "BIGINT", "label": "VARCHAR", "fluid": "VARCHAR"},
                              required=False),
}
# `LAB//<label> (<fluid>)//<unit>`: readable in prompts, and the EHR prior bins `numeric_value` per code. Items
# missing from d_labitems keep their itemid. A `//` in a label or unit becomes `/`: readers split codes on `//`, so
# 'mg//dL' would read as the item '<label> mg' with the unit 'dL'. A lab of an admission the file does not have is
# dropped and counted, like a prescription. One without an admission belongs to the admission whose stay it falls
# in, from the emergency-department registration (`edregtime`, else `admittime`) to `dischtime`: MIMIC leaves
# hadm_id empty on the ED draws that precede an admission, which would otherwise sit in the pre-target record of
# that very admission. Any other is an outpatient result and stays outside any encounter.
_LABS_SQL = _stay_sql("lab_stay", "t_labevents", "charttime") + """
CREATE VIEW lab_coded AS
SELECT l.subject_id, l.charttime AS time, coalesce(l.hadm_id, s.hadm_id) AS hadm_id,
       l.hadm_id IS NULL AND s.hadm_id IS NOT NULL AS within_stay,
       'LAB//' || replace(coalesce(nullif(trim(d.label), '') || coalesce(' (' || nullif(trim(d.fluid), '') || ')', ''),
                                   l.itemid::VARCHAR), '//', '/')
               || '//' || replace(coalesce(nullif(trim(l.valueuom), ''), 'no unit'), '//', '/') AS code,
       l.valuenum AS numeric_value,
       CASE WHEN l.valuenum IS NULL THEN nullif(trim(l.value), '') END AS text_value,
       l.hadm_id IS NOT NULL AND a.hadm_id IS NULL AS without_admission
FROM t_labevents l LEFT JOIN t_d_labitems d USING (itemid) LEFT JOIN adm a ON a.hadm_id = l.hadm_id
     LEFT JOIN lab_stay s ON s.src_row = l.src_row
"""

# One normalization for every ICD code the importer emits: no dot, no spaces, upper case.
_NORMALIZED = "upper(replace(trim({col}), '.', ''))"

# A view: the events take its usable rows and the import summary counts the rest by reason. A prescription without
# hadm_id is placed like a lab result (`_stay_sql`): one given in the emergency department before its admission would
# otherwise be in that admission's pre-target record.
_MEDICATIONS_SQL = _stay_sql("rx_stay", "rx", "starttime") + """
CREATE VIEW rx_coded AS
SELECT r.subject_id, coalesce(r.starttime, a.admittime) AS time, coalesce(r.hadm_id, s.hadm_id) AS hadm_id,
       r.starttime IS NULL AS time_imputed, r.hadm_id IS NULL AND s.hadm_id IS NOT NULL AS within_stay,
       CASE WHEN regexp_full_match(replace(trim(r.ndc), '-', ''), '[0-9]*[1-9][0-9]*')
            THEN 'MEDICATION//NDC//' || replace(trim(r.ndc), '-', '')
            ELSE 'MEDICATION//NAME//' || lower(regexp_replace(nullif(trim(r.drug), ''), '\\s+', ' ', 'g'))
       END AS code,
       nullif(regexp_replace(trim(r.drug), '\\s+', ' ', 'g'), '') AS drug,
       r.hadm_id IS NOT NULL AND a.hadm_id IS NULL AS without_admission
FROM rx r LEFT JOIN adm a ON a.hadm_id = r.hadm_id LEFT JOIN rx_stay s ON s.src_row = r.src_row
"""

_EVENTS_SQL = f"""
CREATE TABLE events AS
WITH dx_rows AS (
    SELECT subject_id, hadm_id, seq_num, icd_version, {_NORMALIZED.format(col="icd_code")} AS code
    FROM dx WHERE nullif(trim(icd_code), '') IS NOT NULL
),
dx_unique AS (
    SELECT subject_id, hadm_id, icd_version, code, min(seq_num) AS seq_num FROM dx_rows GROUP BY ALL
),
px_unique AS (
    SELECT subject_id, hadm_id, icd_version, {_NORMALIZED.format(col="icd_code")} AS code, time,
           bool_or(time_imputed) AS time_imputed, min(seq_num) AS seq_num
    FROM px WHERE nullif(trim(icd_code), '') IS NOT NULL AND hadm_id IN (SELECT hadm_id FROM adm) GROUP BY ALL
),
in_hospital_death AS (
    SELECT subject_id, max(deathtime) AS deathtime, arg_max(hadm_id, (deathtime, hadm_id)) AS hadm_id
    FROM adm WHERE deathtime IS NOT NULL GROUP BY ALL
),
death AS (
    -- A death known by its date only is put at the end of that day: at midnight it would precede an
    -- admission of the same day and sit in that admission's pre-target record.
    SELECT subject_id, coalesce(d.deathtime, date_trunc('day', p.dod) + INTERVAL 1 DAY - INTERVAL 1 SECOND) AS time,
           d.hadm_id, d.deathtime IS NULL AS time_imputed
    FROM in_hospital_death d
    FULL OUTER JOIN (SELECT subject_id, dod FROM pat WHERE dod IS NOT NULL) p USING (subject_id)
)
SELECT subject_id, NULL::TIMESTAMP AS time, 'GENDER//' || upper(trim(gender)) AS code,
       NULL::BIGINT AS encounter_id, NULL::INTEGER AS seq_num, false AS time_imputed,
       NULL::DOUBLE AS numeric_value, NULL::VARCHAR AS text_value
    FROM pat WHERE nullif(trim(gender), '') IS NOT NULL
UNION ALL SELECT subject_id, birth_time, 'MEDS_BIRTH', NULL, NULL, birth_capped, NULL, NULL
    FROM pat WHERE birth_time IS NOT NULL
UNION ALL SELECT subject_id, time, 'MEDS_DEATH', hadm_id, NULL, time_imputed, NULL, NULL FROM death
UNION ALL SELECT subject_id, admittime, 'HOSPITAL_ADMISSION//' || coalesce(nullif(trim(admission_type), ''), 'UNK'),
                 hadm_id, NULL, false, NULL, NULL FROM adm
UNION ALL SELECT subject_id, dischtime, 'HOSPITAL_DISCHARGE//' || coalesce(nullif(trim(discharge_location), ''), 'UNK'),
                 hadm_id, NULL, false, NULL, NULL FROM adm WHERE dischtime IS NOT NULL
UNION ALL SELECT d.subject_id, coalesce(a.dischtime, a.admittime),
                 'DIAGNOSIS//ICD//' || d.icd_version || '//' || d.code,
                 d.hadm_id, d.seq_num, a.dischtime IS NULL, NULL, NULL
    FROM dx_unique d JOIN adm a ON a.hadm_id = d.hadm_id
UNION ALL SELECT subject_id, time, 'PROCEDURE//ICD//' || icd_version || '//' || code, hadm_id, seq_num, time_imputed,
                 NULL, NULL
    FROM px_unique
UNION ALL SELECT subject_id, time, code, hadm_id, NULL, time_imputed, NULL, NULL FROM rx_coded
    WHERE NOT without_admission AND time IS NOT NULL AND code IS NOT NULL
"""
_LAB_EVENTS_SQL = """
UNION ALL SELECT subject_id, time, code, hadm_id, NULL, false, numeric_value, text_value FROM lab_coded
    WHERE NOT without_admission AND time IS NOT NULL
"""

_CODES_SQL = f"""
WITH dictionary AS (
    SELECT 'DIAGNOSIS//ICD//' || icd_version || '//' || {_NORMALIZED.format(col="icd_code")} AS code,
           min(title) AS description
    FROM dict_dx WHERE icd_version IN (9, 10)
      AND regexp_full_match({_NORMALIZED.format(col="icd_code")}, '{_ICD_CODE}') GROUP BY ALL
    UNION ALL
    SELECT 'PROCEDURE//ICD//' || icd_version || '//' || {_NORMALIZED.format(col="icd_code")}, min(title)
    FROM dict_px WHERE icd_version IN (9, 10)
      AND regexp_full_match({_NORMALIZED.format(col="icd_code")}, '{_ICD_CODE}') GROUP BY ALL
),
drug_names AS (
    SELECT code, drug, count(*) AS n FROM rx_coded
    WHERE code LIKE 'MEDICATION//NDC//%' AND drug IS NOT NULL AND NOT without_admission AND time IS NOT NULL
    GROUP BY ALL
),
-- An NDC's name: the one its prescriptions write most often; a tie goes to the first in sort order.
ndc_titles AS (SELECT code, first(drug ORDER BY n DESC, drug) AS description FROM drug_names GROUP BY code)
SELECT code, description, NULL::VARCHAR[] AS parent_codes FROM dictionary
UNION ALL
SELECT e.code, t.description, NULL::VARCHAR[] FROM (SELECT DISTINCT code FROM events) e
LEFT JOIN ndc_titles t ON t.code = e.code
WHERE e.code NOT IN (SELECT code FROM dictionary) AND e.code NOT LIKE 'DIAGNOSIS//%'
ORDER BY code
"""


@dataclass(frozen=True)
class ImportSummary:
    """What an import read and wrote; also stored under `import_summary` in metadata/dataset.json."""

    source: str
    out_dir: str
    rows_read: dict[str, int]
    tables_absent: list[str]
    n_subjects: int
    n_admissions: int
    # Kept as recorded: real MIMIC-III has a few (deaths, organ donors); their diagnoses sit at the earlier dischtime.
    n_admissions_discharged_before_admitted: int
    n_encounters: int  # admissions with at least one diagnosis: the ones cohorts count
    n_diagnosis_rows: int  # raw rows with a code
    n_diagnosis_rows_without_code: int  # dropped: real MIMIC-III has rows with an empty icd9_code
    n_diagnoses: int  # after duplicates collapse
    n_diagnoses_time_imputed: int
    n_diagnoses_without_admission: int  # dropped: their hadm_id is not in admissions
    diagnoses_by_icd_version: dict[str, int]
    n_procedures: int
    n_procedure_rows_without_admission: int  # dropped, like diagnoses: no encounter to attach them to
    n_procedure_rows_without_code: int  # dropped
    n_medications: int
    # Dropped prescription rows, each counted under the first reason that applies.
    n_prescription_rows_without_admission: int  # hadm_id given but not in admissions
    n_prescription_rows_without_time: int  # no start time and no admission to take admittime from
    n_prescription_rows_without_drug: int  # neither an NDC nor a drug name
    n_medications_within_stays: int  # no hadm_id but within an admission's stay (ED orders): given that admission
    n_labs: int  # lab results written (0 unless imported with labs)
    n_labs_outside_admissions: int  # outpatient results: no hadm_id, kept outside any encounter
    n_labs_within_stays: int  # no hadm_id but within an admission's stay (ED draws): given that admission
    n_lab_rows_without_admission: int  # dropped: hadm_id given but not in admissions
    n_lab_rows_without_time: int  # dropped: no charttime
    n_ages_capped: int
    n_events: int
    n_shards: int
    # The time zones the times were written in ('-05:00', 'Asia/Tokyo'; '' when none, as in the official files) and
    # their one UTC offset: the times are kept as the wall-clock times they show there.
    time_zone: str
    utc_offset: str
    seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)

    def table(self) -> str:
        """A short two-column summary for the terminal."""
        rows = [("subjects", self.n_subjects), ("admissions", self.n_admissions),
                ("  dischtime before admittime (kept as recorded)", self.n_admissions_discharged_before_admitted),
                ("encounters (admissions with ≥ 1 diagnosis)", self.n_encounters),
                ("diagnosis rows with a code", self.n_diagnosis_rows),
                ("diagnoses written (duplicates collapsed)", self.n_diagnoses),
                ("  at admittime (no dischtime; time_imputed)", self.n_diagnoses_time_imputed),
                ("  dropped (admission not in admissions)", self.n_diagnoses_without_admission),
                ("  dropped (rows without a code)", self.n_diagnosis_rows_without_code),
                *((f"  ICD-{v}", n) for v, n in sorted(self.diagnoses_by_icd_version.items())),
                ("procedures", self.n_procedures),
                ("  dropped (rows whose admission is not in admissions)", self.n_procedure_rows_without_admission),
                ("  dropped (rows without a code)", self.n_procedure_rows_without_code),
                ("medications", self.n_medications),
                ("  without hadm_id, within an admission's ED or hospital stay (given it)",
                 self.n_medications_within_stays),
                ("  dropped (rows whose admission is not in admissions)", self.n_prescription_rows_without_admission),
                ("  dropped (rows without a start time or admission)", self.n_prescription_rows_without_time),
                ("  dropped (rows without an NDC or drug name)", self.n_prescription_rows_without_drug),
                *((("lab results", self.n_labs), ("  outside admissions (outpatient)", self.n_labs_outside_admissions),
                   ("  without hadm_id, within an admission's ED or hospital stay (given it)",
                    self.n_labs_within_stays),
                   ("  dropped (rows whose admission is not in admissions)", self.n_lab_rows_without_admission),
                   ("  dropped (rows without a chart time)", self.n_lab_rows_without_time))
                  if "labevents" in self.rows_read else ()),
                ("ages capped at 90", self.n_ages_capped), ("MEDS events", self.n_events),
                ("shards", self.n_shards),
                ("time zone of the times (kept at its wall-clock time)",
                 f"{self.time_zone} (UTC{self.utc_offset})" if self.time_zone else "none written"),
                ("seconds", f"{self.seconds:.1f}")]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {value:>12,}" if isinstance(value, int) else f"{name:<{width}}  {value:>12}"
                 for name, value in rows]
        if self.tables_absent:
            lines.append(f"optional tables absent: {', '.join(self.tables_absent)}")
        return "\n".join(lines)


def import_mimic3(src: Path, out_dir: Path, *, seed: int, labs: bool = False, memory_limit: str = "2GB",
                  log: Callable[[str], None] | None = None, events_per_shard: int = EVENTS_PER_SHARD) -> ImportSummary:
    """Import a MIMIC-III directory (ADMISSIONS.csv, PATIENTS.csv, DIAGNOSES_ICD.csv, …) into MEDS at `out_dir`."""
    return import_mimic(MIMIC3, src, out_dir, seed=seed, labs=labs, memory_limit=memory_limit, log=log,
                        events_per_shard=events_per_shard)


def import_mimic4(src: Path, out_dir: Path, *, seed: int, labs: bool = False, memory_limit: str = "2GB",
                  log: Callable[[str], None] | None = None, events_per_shard: int = EVENTS_PER_SHARD) -> ImportSummary:
    """Import a MIMIC-IV `hosp` directory (or the release root holding `hosp/`; v1.0's `core/` too) into MEDS."""
    return import_mimic(MIMIC4, src, out_dir, seed=seed, labs=labs, memory_limit=memory_limit, log=log,
                        events_per_shard=events_per_shard)


def import_mimic(layout: Layout, src: Path, out_dir: Path, *, seed: int, labs: bool = False,
                 memory_limit: str = "2GB", log: Callable[[str], None] | None = None,
                 events_per_shard: int = EVENTS_PER_SHARD) -> ImportSummary:
    """Write a complete MEDS directory at `out_dir` from `src`; on any error nothing at `out_dir` changes.

    With `labs`, lab results (labevents, with labels from d_labitems) are imported too. A data shard holds whole
    subjects and about `events_per_shard` events (`_write_shards` says exactly).
    """
    return import_mimic_validated(layout, src, out_dir, seed=seed, labs=labs, memory_limit=memory_limit, log=log,
                                  events_per_shard=events_per_shard)[0]


def import_mimic_validated(layout: Layout, src: Path, out_dir: Path, *, seed: int, labs: bool = False,
                           memory_limit: str = "2GB", log: Callable[[str], None] | None = None,
                           events_per_shard: int = EVENTS_PER_SHARD) -> tuple[ImportSummary, MedsInfo]:
    """`import_mimic`, also returning the validation of the written directory, which registering it hands on to
    `validate_meds_dir` (`validated`) instead of reading every event a second time."""
    log = log or (lambda message: None)
    started = time.perf_counter()
    tables = {**layout.tables, **(LAB_TABLES if labs else {})}
    files = locate_tables(layout, Path(src), tables)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(out_dir)  # a killed import's work directory can hold gigabytes of DuckDB spill
    scratches = ExitStack()  # closed (removing both) in the `finally` below
    staging = scratches.enter_context(scratch(out_dir, "staging"))
    workdir = scratches.enter_context(scratch(out_dir, "work"))
    stages: dict[str, float] = {}

    def stage(name: str, mark: float) -> float:
        now = time.perf_counter()
        stages[name] = round(now - mark, 3)
        log(f"{name}: {now - mark:.1f}s")
        return now

    # A full disk surfaces from DuckDB (an IOException, or a refused spill) and from the Parquet writers alike.
    with duck.resource_errors(f"{layout.title} import of {src}", out_dir.parent, memory_limit):
        con = None
        try:
            workdir.mkdir()
            con = duck.connect(str(workdir / "import.duckdb"))
            duck.limit_memory(con, memory_limit)
            con.execute("SET preserve_insertion_order = true")  # row numbers in error messages follow the file
            mark = time.perf_counter()
            rows_read = {}
            for name, spec in tables.items():
                rows_read[name] = _load_table(con, layout, name, spec, files.get(name))
            mark = stage("read", mark)
            for name, spec in tables.items():
                _check_values(con, name, spec, files.get(name))
            time_zone = _check_time_zones(con, tables, files)
            _check_unique(con, "admissions", "hadm_id", "admission", files["admissions"])
            _check_unique(con, "patients", "subject_id", "patient", files["patients"])
            for name in ("diagnoses_icd", "procedures_icd", "prescriptions", *(("labevents",) if labs else ())):
                _check_admission_subjects(con, name, files.get(name), files["admissions"])
            con.execute(layout.normalize_sql)
            _check_codes(con, "dx", files["diagnoses_icd"])
            _check_codes(con, "px", files.get("procedures_icd"))
            mark = stage("check", mark)
            con.execute(_MEDICATIONS_SQL)
            if labs:
                con.execute(_LABS_SQL)
            con.execute(_EVENTS_SQL + (_LAB_EVENTS_SQL if labs else ""))
            if not con.sql("SELECT count(*) FROM events WHERE code LIKE 'DIAGNOSIS//%'").fetchall()[0][0]:
                raise InputError(f"{files['diagnoses_icd']}: no diagnosis row belongs to an admission in "
                                 f"{files['admissions'].name}: forecasting needs diagnoses; check that both files come "
                                 "from the same release")
            mark = stage("events", mark)
            n_shards = _write_shards(con, staging, workdir, seed, events_per_shard)
            mark = stage("shards", mark)
            codes = con.sql(_CODES_SQL).to_arrow_table()
            counts = _summarize(con, layout, tables, out_dir, rows_read, files, n_shards, time_zone)
            con.close()
            mark = stage("codes and counts", mark)
            splits = pl.read_parquet(workdir / "splits.parquet", glob=False)
            recorded = {k: v for k, v in asdict(counts).items() if k not in ("seconds", "stage_seconds")}
            write_metadata(staging, dataset_name=layout.title, dataset_version="unspecified",
                           etl_name="dxr.warehouse.importers.mimic", etl_version=__version__, codes=codes,
                           splits=splits,
                           extra={"other_extension_columns": list(EXTENSION_COLUMNS), "source": layout.source,
                                  "source_dir": str(Path(src).resolve()), "seed": seed, "import_summary": recorded})
            info = validate_meds_dir(staging, memory_limit)
            stage("metadata and validation", mark)
            replace_dir(staging, out_dir)
            summary = replace(counts, seconds=round(time.perf_counter() - started, 3), stage_seconds=dict(stages))
            log(f"wrote {out_dir}")
            return summary, info.moved_to(out_dir)
        finally:
            if con is not None:
                con.close()
            scratches.close()


def check_source_dir(layout: Layout, src: Path) -> Path:
    """Refuse a path that is no directory, before anything is read from it."""
    if not src.exists():
        raise InputError(f"{layout.title} directory {src} does not exist: check the path")
    if not src.is_dir():
        raise InputError(f"{src} is a file: pass the {layout.title} directory that holds the CSV tables")
    return src


def locate_tables(layout: Layout, src: Path, tables: dict[str, SourceTable]) -> dict[str, Path]:
    """Map each table to its file (`<name>.csv` or `<name>.csv.gz`, any case); check the required ones exist."""
    check_source_dir(layout, src)
    folder = src
    if layout.subdirectory and (src / layout.subdirectory).is_dir():
        folder = src / layout.subdirectory
    release = folder.parent if layout.subdirectory and folder.name == layout.subdirectory else folder
    siblings = [release / name for name in layout.sibling_subdirectories if (release / name).is_dir()]
    by_name: dict[str, list[Path]] = {}
    for path in (path for directory in (folder, *siblings) for path in directory.iterdir()):
        lower = path.name.lower()
        for suffix in (".csv.gz", ".csv"):
            if lower.endswith(suffix) and path.is_file():
                by_name.setdefault(lower[: -len(suffix)], []).append(path)
                break
    found: dict[str, Path] = {}
    for name, spec in tables.items():
        candidates = sorted(by_name.get(spec.stem, []))
        if len(candidates) > 1:
            names = ", ".join(p.name if p.parent == folder else str(p.relative_to(release)) for p in candidates)
            raise InputError(f"{folder}: table {spec.stem} exists twice ({names}): keep one of them")
        if candidates:
            found[name] = candidates[0]
    required = [spec.stem for spec in tables.values() if spec.required]
    missing = [spec.stem for name, spec in tables.items() if spec.required and name not in found]
    if len(missing) == len(required):
        if layout is MIMIC3 and (src / MIMIC4.subdirectory).is_dir():
            raise InputError(f"{src} looks like a MIMIC-IV directory ({MIMIC4.subdirectory}/ holds the tables): "
                             f"use `dxr ingest {MIMIC4.source}`")
        where = f" (or the release root holding {layout.subdirectory}/)" if layout.subdirectory else ""
        raise InputError(f"{folder} is not a {layout.title} directory: none of {', '.join(required)} "
                         f"(.csv or .csv.gz) is there; pass the folder holding the {layout.title} tables{where}")
    if missing:
        raise InputError(f"{folder}: missing {layout.title} table {missing[0]} ({missing[0]}.csv or "
                         f"{missing[0]}.csv.gz): add it from the official release")
    return found


def _read_header(path: Path) -> list[str]:
    """The header row, read here rather than by DuckDB's sniffer, which fails on a damaged row without naming it."""
    if path.stat().st_size == 0:
        return []
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        # Decoding is lenient: the reader decodes a whole buffer, so a non-UTF-8 byte in an early data row would
        # fail here without a row number; DuckDB's read reports that row instead.
        with opener(path, "rt", encoding="utf-8-sig", errors="replace", newline="") as handle:
            # Names are matched without case or surrounding spaces ("subject_id, hadm_id" from some exports).
            return [name.strip() for name in next(csv.reader(handle), [])]
    except (OSError, EOFError, csv.Error) as exc:
        raise InputError(f"{path}: not a readable CSV file ({_first_line(exc)}): "
                         "use the official comma-separated file, plain or gzipped") from exc


def _read_csv(path: Path, n_columns: int) -> str:
    # Every column as text, typed afterwards so a bad value is reported by row and column; no sniffing, so a
    # malformed row fails the read with its line number. Columns are named by position (c0, c1, …): a header may
    # hold an empty name (a trailing comma) or a quote, which DuckDB's column list cannot take.
    columns = ", ".join(f"c{index}: 'VARCHAR'" for index in range(n_columns))
    return duck.read("read_csv", path, options=f"header = true, auto_detect = false, columns = {{{columns}}}, "
                     "delim = ',', quote = '\"', escape = '\"'")


def _load_table(con: duckdb.DuckDBPyConnection, layout: Layout, name: str, spec: SourceTable,
                path: Path | None) -> int:
    """Copy the needed columns of one CSV into `raw_<name>` (all text) and define its typed view `t_<name>`."""
    if path is None:
        columns = ", ".join(f"{column} VARCHAR" for column in spec.columns)
        con.execute(f"CREATE TABLE raw_{name} ({columns})")
    else:
        header = _read_header(path)
        if not header:
            raise InputError(f"{path}: the file is empty: restore {spec.stem} from the official {layout.title} release")
        separator = next((s for s in ";\t|" if len(header) == 1 and s in header[0]), None)
        if separator:
            raise InputError(f"{path}: the columns are separated by {separator!r}, not by commas: "
                             "use the official comma-separated file (or export it again with commas)")
        positions: dict[str, list[int]] = {}
        for index, column in enumerate(header):
            positions.setdefault(column.lower(), []).append(index)
        missing = [column for column in spec.columns if column not in positions and column not in spec.optional]
        if missing:
            raise InputError(_missing_column_message(layout, path, spec, header, missing[0]))
        twice = next((column for column in spec.columns if len(positions.get(column, ())) > 1), None)
        if twice:
            raise InputError(f"{path}: column '{twice}' appears {len(positions[twice])} times in the header (columns "
                             f"found: {', '.join(header)}): keep one of them")
        select = ", ".join(f"c{positions[column][0]} AS {column}" if column in positions
                           else f"NULL::VARCHAR AS {column}" for column in spec.columns)
        try:
            con.execute(f"CREATE TABLE raw_{name} AS SELECT {select} FROM {_read_csv(path, len(header))}")
        except duckdb.Error as exc:
            if isinstance(exc, duckdb.OutOfMemoryException) or duck.out_of_disk(exc):
                raise  # not the file's fault: re-downloading it would not help
            raise InputError(_malformed_csv_message(path, exc)) from exc
    casts = ", ".join(f"TRY_CAST({column} AS {kind}) AS {column}" for column, kind in spec.columns.items())
    con.execute(f"CREATE VIEW t_{name} AS SELECT {casts}, rowid + 1 AS src_row FROM raw_{name}")
    n_rows = con.execute(f"SELECT count(*) FROM raw_{name}").fetchone()[0]
    if path is not None and spec.required and not n_rows:
        raise InputError(f"{path}: a header but no data rows: {layout.title} needs the {spec.stem} rows; "
                         "restore the file from the official release")
    return n_rows


def _malformed_csv_message(path: Path, exc: duckdb.Error) -> str:
    text = str(exc)
    # DuckDB refuses a line ending in \r\r\n (Windows line endings converted a second time) without its line number.
    # Reading such a file would need DuckDB's strict mode off, which also lets through the malformed rows reported
    # below by row, so the line is found here and the file refused.
    if "state machine reached an invalid state" in text and (bad_line := _first_doubled_carriage_return(path)):
        where = "the header" if bad_line == 1 else f"data row {bad_line - 1:,}"
        gzipped = path.suffix.lower() == ".gz"
        fix = ("gunzip it, then " if gzipped else "") + f"sed -i 's/\\r*$//' " + shlex.quote(
            str(path.with_suffix("") if gzipped else path)) + (" (a plain .csv is imported too)" if gzipped else "")
        return (f"{path}, {where}: malformed CSV (the line ends in \\r\\r\\n, a carriage return too many, as when "
                f"Windows line endings are converted twice): end every line with \\n or \\r\\n, e.g. {fix}")
    line = re.search(r"CSV Error on Line: (\d+)", text)
    fields = re.search(r"Expected Number of Columns: (\d+) Found: (\d+)", text)
    if "unterminated quote" in text:
        problem = 'a quote (") opens a value that never closes'
    elif fields:
        problem = f"{fields[2]} fields where the header has {fields[1]}"
    elif "Invalid unicode" in text:
        problem = "text that is not UTF-8, as when the file was saved in another encoding such as Latin-1"
    elif "end of GZIP stream" in text:
        problem = "the gzip data ends early, as after an incomplete download or copy"
    else:
        problem = _first_line(exc)
    if line:  # DuckDB counts lines from the header, which is line 1
        return f"{path}, data row {int(line[1]) - 1:,}: malformed CSV ({problem}): fix the row or re-download the file"
    return f"{path}: malformed CSV ({problem}): re-download the file"


def _first_doubled_carriage_return(path: Path) -> int | None:
    """The line of `path` (the header is line 1) that first ends in \\r\\r\\n, or None when none does (or the file
    cannot be read to its end)."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    lines, carried = 1, b""
    try:
        with opener(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                window = carried + chunk
                if (at := window.find(b"\r\r\n")) >= 0:
                    return lines + window.count(b"\n", 0, at)
                carried = window[-2:]  # a match may straddle two chunks; its newlines are counted with the next
                lines += window.count(b"\n", 0, len(window) - len(carried))
    except (OSError, EOFError):
        return None
    return None


def _missing_column_message(layout: Layout, path: Path, spec: SourceTable, header: list[str], column: str) -> str:
    message = f"{path}: missing column '{column}' (columns found: {', '.join(header)})"
    unexpected = [c.lower() for c in header
                  if c.lower() not in spec.columns and c.lower() not in _UNUSED_OFFICIAL_COLUMNS]
    guess = difflib.get_close_matches(column, unexpected, n=1, cutoff=0.5)
    other = MIMIC4 if layout is MIMIC3 else MIMIC3
    other_spec = next((s for s in other.tables.values() if s.stem == spec.stem), None)
    if other_spec and set(other_spec.columns) - set(other_spec.optional) <= {c.lower() for c in header}:
        return f"{message}: this file has the {other.title} layout; use `dxr ingest {other.source}`"
    if guess:
        return f"{message}: rename '{guess[0]}' back to the official name '{column}'"
    needed = [column for column in spec.columns if column not in spec.optional]
    return f"{message}: {layout.title} {spec.stem} needs {', '.join(needed)}; restore the official file"


def _check_values(con: duckdb.DuckDBPyConnection, name: str, spec: SourceTable, path: Path | None) -> None:
    """Every typed column casts and every required value is present; else name the first bad row."""
    if path is None:
        return
    conditions = [(column, f"{column} IS NOT NULL AND TRY_CAST({column} AS {kind}) IS NULL", kind)
                  for column, kind in spec.columns.items() if kind != "VARCHAR"]
    conditions += [(column, f"{column} IS NULL", None) for column in spec.not_null]
    if not conditions:
        return
    counts = con.execute("SELECT " + ", ".join(f"count(*) FILTER (WHERE {cond})" for _, cond, _ in conditions)
                         + f" FROM raw_{name}").fetchone()
    for (column, condition, kind), count in zip(conditions, counts):
        if not count:
            continue
        row, value = con.execute(f"SELECT rowid + 1, {column} FROM raw_{name} WHERE {condition} "
                                 "ORDER BY rowid LIMIT 1").fetchone()
        more = f" ({count:,} rows like it)" if count > 1 else ""
        if kind is None:
            raise InputError(f"{path}, data row {row:,}: column '{column}' is empty{more}: "
                             f"every {spec.stem} row needs a value there")
        raise InputError(f"{path}, data row {row:,}, column '{column}': {value!r} is not "
                         f"{_FRIENDLY_TYPE[kind]}{more}: correct the value or restore the official file")


_DATE_RE = r"\s*[0-9]{4}-[0-9]{2}-[0-9]{2}"
_TIME_RE = r"[0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]+)?)?"


def _zone_sql(col: str) -> str:
    """The time zone written after the time of day in text column `col` ('' when none; NULL for a date or no value).

    DuckDB's cast to TIMESTAMP drops it: '2150-03-01 09:30:00-05:00' reads as 09:30. The official form (YYYY-MM-DD
    HH:MM:SS, 19 characters) is told apart without a regular expression, which would cost seconds on a hundred
    million lab rows.
    """
    return (f"CASE WHEN {col} IS NULL OR length({col}) = 10 THEN NULL "
            f"WHEN length({col}) = 19 AND {col}[17] = ':' THEN '' "
            f"WHEN regexp_full_match({col}, '{_DATE_RE}\\s*') THEN NULL "
            f"ELSE regexp_extract({col}, '^{_DATE_RE}[ T]{_TIME_RE}\\s*(.*?)\\s*$', 3) END")


def _check_time_zones(con: duckdb.DuckDBPyConnection, tables: dict[str, SourceTable], files: dict[str, Path]
                      ) -> tuple[str, str]:
    """Every time of day in the release is at one UTC offset, or none has one (`utc_offset` says why); else name
    the first time that differs and the first time it differs from. A zone name's offset is the one it has over
    all the times written with it (`zone_offset`).

    Returns the zones written (', '-joined, '' when none) and their UTC offset ('' when none)."""
    seen: tuple[str, Path, int, str, str] | None = None  # the offset, file, row, column and value of the first time
    written: dict[str, None] = {}  # the zone names and offsets written, in the order found
    named: dict[str, str] = {}  # the UTC offset of each zone name, over all the times written with it
    for name, spec in tables.items():
        columns = [column for column, kind in spec.columns.items() if kind == "TIMESTAMP"]
        if files.get(name) is None or not columns:
            continue
        zones = con.execute(" UNION ALL ".join(
            f"SELECT {index}, zone, min(row), arg_min(value, row) FROM (SELECT {_zone_sql(column)} AS zone, "
            f"rowid + 1 AS row, {column} AS value FROM raw_{name}) WHERE zone IS NOT NULL GROUP BY zone"
            for index, column in enumerate(columns))).fetchall()
        for index, zone, row, value in sorted(zones, key=lambda found: (found[0], found[2])):  # by column, then row
            where = f"{files[name]}, data row {row:,}, column '{columns[index]}': {value!r}"
            offset = utc_offset(zone)
            if offset is None:
                if zone not in named:
                    named[zone] = offset_text(zone_offset(zone, *_zone_time_range(con, tables, files, zone), where))
                offset = named[zone]
            written.setdefault(zone if zone in named else offset)
            seen = seen or (offset, files[name], row, columns[index], value)
            if offset != seen[0]:
                raise InputError(f"{where} is at {'UTC offset ' + offset if offset else 'no UTC offset'} but "
                                 f"{seen[1].name}, data row {seen[2]:,}, column '{seen[3]}' has {seen[4]!r}: times at "
                                 "mixed offsets (daylight saving, sites in several zones) can misorder events; "
                                 f"{MIXED_OFFSETS_FIX}")
    return ", ".join(filter(None, written)), seen[0] if seen else ""


def _zone_time_range(con: duckdb.DuckDBPyConnection, tables: dict[str, SourceTable], files: dict[str, Path],
                     zone: str) -> tuple[datetime, datetime]:
    """The first and last wall-clock time written with time zone `zone`, in any table and column."""
    return con.execute("SELECT min(time), max(time) FROM (" + " UNION ALL ".join(
        f"SELECT {column}::TIMESTAMP AS time FROM raw_{name} WHERE {_zone_sql(column)} = {duck.literal(zone)}"
        for name, spec in tables.items() if files.get(name) is not None
        for column, kind in spec.columns.items() if kind == "TIMESTAMP") + ")").fetchone()


def _check_unique(con: duckdb.DuckDBPyConnection, table: str, key: str, what: str, path: Path) -> None:
    duplicate = con.execute(f"SELECT {key}, list(src_row ORDER BY src_row) FROM t_{table} GROUP BY {key} "
                            "HAVING count(*) > 1 ORDER BY min(src_row) LIMIT 1").fetchone()
    if duplicate:
        rows = ", ".join(f"{r:,}" for r in duplicate[1][:3])
        raise InputError(f"{path}: {key} {duplicate[0]} appears on several data rows ({rows}): "
                         f"each {what} must appear once")


def _check_admission_subjects(con: duckdb.DuckDBPyConnection, table: str, path: Path | None,
                              admissions: Path) -> None:
    """A row's subject_id must be its admission's: the event would otherwise join another patient's encounter.

    An error rather than a counted drop: in the official releases an hadm_id belongs to one patient in every
    table, so a disagreement means edited or mixed files, and which of the two subjects is right is unknowable.
    """
    if path is None:
        return
    mismatch = f"FROM t_{table} r JOIN t_admissions a USING (hadm_id) WHERE r.subject_id <> a.subject_id"
    count = con.execute(f"SELECT count(*) {mismatch}").fetchone()[0]
    if not count:
        return
    row, hadm, subject, owner = con.execute(f"SELECT r.src_row, hadm_id, r.subject_id, a.subject_id {mismatch} "
                                            "ORDER BY r.src_row LIMIT 1").fetchone()
    more = f" ({count:,} rows like it)" if count > 1 else ""
    raise InputError(f"{path}, data row {row:,}: subject_id {subject} but hadm_id {hadm} is an admission of "
                     f"subject_id {owner} in {admissions.name}{more}: use files of one release, unedited")


def _check_codes(con: duckdb.DuckDBPyConnection, view: str, path: Path | None) -> None:
    """ICD versions must be 9 or 10 and codes letters and digits (a dot is dropped)."""
    if path is None:
        return
    bad = con.execute(f"""SELECT src_row, icd_version, icd_code FROM {view}
        WHERE nullif(trim(icd_code), '') IS NOT NULL AND (icd_version NOT IN (9, 10)
              OR NOT regexp_full_match({_NORMALIZED.format(col="icd_code")}, '{_ICD_CODE}'))
        ORDER BY src_row LIMIT 1""").fetchone()
    if bad:
        row, version, code = bad
        if version not in (9, 10):
            raise InputError(f"{path}, data row {row:,}, column 'icd_version': {version} is not 9 or 10: "
                             "MEDS diagnosis codes are ICD-9 or ICD-10")
        raise InputError(f"{path}, data row {row:,}, column 'icd_code': {code!r} is not an ICD code "
                         "(letters and digits, optional dot): correct the value")


def _write_shards(con: duckdb.DuckDBPyConnection, staging: Path, workdir: Path, seed: int,
                  events_per_shard: int) -> int:
    """Assign each subject a split (seeded hash) and write `data/<split>/<n>.parquet` shards.

    A split's events, in subject order, are cut into windows of `events_per_shard`; a shard holds the subjects whose
    first event falls in one window, so at most that many events plus the rest of its last subject's.
    """
    subjects = pl.from_arrow(con.sql("SELECT DISTINCT subject_id FROM events ORDER BY subject_id").to_arrow_table())
    splits = subjects.with_columns(
        pl.col("subject_id").map_elements(lambda s: hash_split(s, seed), return_dtype=pl.String).alias("split"))
    splits.write_parquet(workdir / "splits.parquet")
    con.register("splits_frame", splits.to_arrow())
    con.execute(f"""CREATE TABLE subject_shards AS
        WITH sizes AS (SELECT subject_id, count(*) AS n_events FROM events GROUP BY subject_id),
        windows AS (SELECT subject_id, split, (sum(n_events) OVER (PARTITION BY split ORDER BY subject_id) - n_events)
                                              // {int(events_per_shard)} AS n_window
                    FROM splits_frame JOIN sizes USING (subject_id))
        -- A subject larger than a window leaves the windows it fills without a shard: number the shards densely.
        SELECT subject_id, split, dense_rank() OVER (PARTITION BY split ORDER BY n_window) - 1 AS shard FROM windows""")
    con.unregister("splits_frame")
    shards = con.execute("SELECT DISTINCT split, shard FROM subject_shards ORDER BY split, shard").fetchall()
    for split, shard in shards:
        table = con.sql("""
            SELECT e.subject_id, e.time, e.code, e.numeric_value::FLOAT AS numeric_value, e.text_value,
                   e.encounter_id, e.seq_num, e.time_imputed
            FROM events e JOIN subject_shards s USING (subject_id)
            WHERE s.split = ? AND s.shard = ?
            ORDER BY e.subject_id, e.time NULLS FIRST, e.code, e.encounter_id""",
                        params=[split, shard]).to_arrow_table()
        write_data_shard(staging, f"{split}/{shard}", table)
    assert {s for s, _ in shards} <= set(SPLITS), f"unexpected split names {shards}"
    return len(shards)


def _summarize(con: duckdb.DuckDBPyConnection, layout: Layout, tables: dict[str, SourceTable], out_dir: Path,
               rows_read: dict[str, int], files: dict[str, Path], n_shards: int, time_zone: tuple[str, str]
               ) -> ImportSummary:
    dx = con.execute(f"""SELECT
        (SELECT count(*) FROM dx WHERE nullif(trim(icd_code), '') IS NOT NULL),
        (SELECT count(*) FROM dx WHERE nullif(trim(icd_code), '') IS NULL),
        (SELECT count(*) FROM (SELECT DISTINCT hadm_id, icd_version, {_NORMALIZED.format(col="icd_code")}
                               FROM dx WHERE nullif(trim(icd_code), '') IS NOT NULL
                                 AND hadm_id NOT IN (SELECT hadm_id FROM adm)))""").fetchone()
    px = con.execute("""SELECT
        count(*) FILTER (WHERE hadm_id NOT IN (SELECT hadm_id FROM adm)),
        count(*) FILTER (WHERE hadm_id IN (SELECT hadm_id FROM adm) AND nullif(trim(icd_code), '') IS NULL)
        FROM px""").fetchone()
    rx = con.execute("""SELECT count(*) FILTER (WHERE without_admission),
        count(*) FILTER (WHERE NOT without_admission AND time IS NULL),
        count(*) FILTER (WHERE NOT without_admission AND time IS NOT NULL AND code IS NULL),
        count(*) FILTER (WHERE within_stay AND time IS NOT NULL AND code IS NOT NULL)
        FROM rx_coded""").fetchone()
    ev = con.execute("""SELECT count(DISTINCT subject_id), count(*),
        count(*) FILTER (WHERE code LIKE 'DIAGNOSIS//%'),
        count(*) FILTER (WHERE code LIKE 'DIAGNOSIS//%' AND time_imputed),
        count(DISTINCT encounter_id) FILTER (WHERE code LIKE 'DIAGNOSIS//%'),
        count(*) FILTER (WHERE code LIKE 'PROCEDURE//%'),
        count(*) FILTER (WHERE code LIKE 'MEDICATION//%'),
        count(*) FILTER (WHERE code = 'MEDS_BIRTH' AND time_imputed)
        FROM events""").fetchone()
    labs = (0, 0, 0, 0, 0) if "labevents" not in tables else con.execute("""SELECT
        count(*) FILTER (WHERE NOT without_admission AND time IS NOT NULL),
        count(*) FILTER (WHERE hadm_id IS NULL AND time IS NOT NULL),
        count(*) FILTER (WHERE without_admission),
        count(*) FILTER (WHERE NOT without_admission AND time IS NULL),
        count(*) FILTER (WHERE within_stay)
        FROM lab_coded""").fetchone()
    versions = dict(con.execute("""SELECT split_part(code, '//', 3), count(*) FROM events
        WHERE code LIKE 'DIAGNOSIS//%' GROUP BY ALL ORDER BY ALL""").fetchall())
    n_admissions, n_discharged_before_admitted = con.execute(
        "SELECT count(*), count(*) FILTER (WHERE dischtime < admittime) FROM adm").fetchone()
    return ImportSummary(
        source=layout.source, out_dir=str(out_dir), rows_read=rows_read,
        tables_absent=[spec.stem for name, spec in tables.items() if name not in files],
        n_subjects=ev[0], n_admissions=n_admissions,
        n_admissions_discharged_before_admitted=n_discharged_before_admitted, n_encounters=ev[4],
        n_diagnosis_rows=dx[0],
        n_diagnosis_rows_without_code=dx[1], n_diagnoses=ev[2], n_diagnoses_time_imputed=ev[3],
        n_diagnoses_without_admission=dx[2], diagnoses_by_icd_version=versions,
        n_procedures=ev[5], n_procedure_rows_without_admission=px[0], n_procedure_rows_without_code=px[1],
        n_medications=ev[6], n_prescription_rows_without_admission=rx[0], n_prescription_rows_without_time=rx[1],
        n_prescription_rows_without_drug=rx[2], n_medications_within_stays=rx[3], n_labs=labs[0],
        n_labs_outside_admissions=labs[1],
        n_labs_within_stays=labs[4], n_lab_rows_without_admission=labs[2], n_lab_rows_without_time=labs[3],
        n_ages_capped=ev[7], n_events=ev[1], n_shards=n_shards, time_zone=time_zone[0], utc_offset=time_zone[1])


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
