"""Cohorts: trajectories, targets, the target vocabulary Ω and the pre-target record H.

A cohort is built from a registered MEDS dataset and a few options. The build reads raw MEDS (gold
side) and writes:
- forecasting store: `cohorts`, `cohort_vocabulary` (Ω), `trajectories`, `pretarget_events`,
  `train_events`, and `code_titles` (the titles of those events' codes outside Ω, from metadata/codes.parquet
  or the official ICD titles, for the readable record);
- gold store: `targets` and, for synthetic datasets, `oracle_probabilities` and
  `record_oracle_probabilities` (the oracle restricted to what the record reveals).

Rules (spec/forecasting.md §1, §3):
- an encounter counts when it has at least one diagnosis event;
- a target is the deduplicated (harmonized) diagnosis codes of the target encounter; encounters
  whose target would be empty after harmonization are excluded here, never at metric time;
- the pre-target record of a trajectory is made by `pretarget_sql` alone: events strictly before
  the target admission, minus every event of the target encounter even when time-stamped earlier,
  and minus untagged events from the target encounter's first own event on (or from the untagged
  emergency-department registration of the visit that led into it), the undated events of an encounter still
  open at the cutoff or never dated, the clinical events with neither a time nor an encounter, and any death;
- Ω is fixed from the dataset's own diagnosis dictionary (metadata/codes.parquet) when it ships
  one (a list of only the codes the data uses is no dictionary), else the official billable codes
  of the ICD versions present — never from targets.

The `cohorts` row is written last and removed before the build's first write, so a killed build never leaves a
half-built cohort registered, and a rerun replaces every partition it owns. From that first write on the build's
`runs` row names the cohort, so that a build cut short there (the newest of its name) makes readers of the name
refuse it with the command that finishes it (`unbuilt_cohort`), and one refused for its input before it wrote counts
for nothing.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial

import duckdb
import polars as pl
import pyarrow.parquet as pq
from tqdm import tqdm

from dxr.config import load_settings
from dxr.errors import InputError, NotFoundError
from warehouse import duck, vocab
from warehouse.datasets import check_name, get_dataset
from warehouse.choices import HARMONIZATIONS, TARGET_RULES
from warehouse.locks import held, lock_held
from warehouse.meds import SPLITS, current_size_fingerprint, read_splits, validate_meds_dir
from warehouse.runs import Run, mark_killed, record_lock, registered_run, runs_in_progress
from warehouse.schemas import utc_now
from warehouse.scratch import remove_abandoned, scratch
from warehouse.store import Warehouse, fetch_frame

ICD10_GEM_RULE = "every_target"  # how `icd10` maps an ICD-9 code since 2026-12-06: to every target of its GEM rows
# How `dxr cohort list` names the rule of an `icd10` cohort built before 2026-12-06.
EARLIER_ICD10_RULE = "icd10_closest (earlier icd10)"
# How the notes of such a cohort name its rule.
EARLIER_ICD10_RULE_TEXT = ("the icd10 rule of before 2026-12-06, one ICD-10 code per GEM choice list (now --harmonize "
                           "icd10_closest)")
# The version of the rules that cut a cohort: which encounters are targets and where their cutoffs fall, what their
# targets hold, and what their pre-target records hold (`pretarget_sql`, `encounter_starts_sql`, `_write_cohort`).
# Bump it with every change of those rules: a cohort records the version it was cut by (`cohorts.cut_rule_version`,
# null before it was recorded) and keeps its cuts until it is built again, so a forecast or a prior's training of one
# cut by another version warns (`outdated_cut_note`) and a refreshing backfill builds it again. 1 (2026-12-06): an
# encounter's undated events are history only once its last dated event precedes the cutoff, and undated clinical
# rows without an encounter are left out.
CUT_RULE_VERSION = 1
SPILL_PREFIX = "cohort-build-"  # + cohort id: the target whose scratch sibling is a build's DuckDB spill directory
# The kinds of event that are an encounter's or a day's (spec §1: H holds demographics, the earlier encounters' events
# and the notes dated before the cutoff). One with neither a time nor an encounter is placed before no cutoff: a
# problem list, a medication list or a note taken at extraction may be the target encounter's own. The other undated
# rows without an encounter (sex, race, language) are the patient's static facts.
CLINICAL_PREFIXES = ("DIAGNOSIS//", "PROCEDURE//", "MEDICATION//", "LAB//", "NOTE//")


def clinical_sql(code: str) -> str:
    """SQL that is true when the code column `code` is of a `CLINICAL_PREFIXES` kind.

    >>> clinical_sql("e.code")[:50]
    "(e.code LIKE 'DIAGNOSIS//%' OR e.code LIKE 'PROCED"
    """
    return "(" + " OR ".join(f"{code} LIKE '{prefix}%'" for prefix in CLINICAL_PREFIXES) + ")"


@dataclass(frozen=True)
class CohortOptions:
    target: str = "final"
    harmonize: str = "native"
    min_history: int = 1

    def __post_init__(self):
        if self.target not in TARGET_RULES:
            raise InputError(f"unknown target rule {self.target!r}: use one of {', '.join(TARGET_RULES)}")
        if self.harmonize not in HARMONIZATIONS:
            raise InputError(f"unknown harmonization {self.harmonize!r}: use one of {', '.join(HARMONIZATIONS)}")
        if self.min_history < 0:
            raise InputError(f"--min-history must be >= 0, got {self.min_history}")


def cohort_id_for(dataset: dict, options: CohortOptions, seed: int) -> str:
    """A stable hash of the dataset (name and content fingerprint), the options and the split seed.

    The cohort name is a label, not part of the identity: building the same options under another
    name relabels that cohort instead of copying it.
    """
    return _hashed_id(dataset, options, seed, gem_rule_fields(options))


def gem_rule_fields(options: CohortOptions) -> dict:
    """The GEM rule an `icd10` cohort is built by, as its id and its `options_json` record it ({} for the others).

    Until 2026-12-06 `icd10` cohorts were built with the rule now named `icd10_closest`: the rule they are built
    with now is part of their identity, so that such a cohort is never taken for one built by it.
    """
    return {"gem_rule": ICD10_GEM_RULE} if options.harmonize == "icd10" else {}


def _hashed_id(dataset: dict, options: CohortOptions, seed: int, rule: dict) -> str:
    payload = json.dumps({"dataset_id": dataset["dataset_id"], "fingerprint": dataset["fingerprint"],
                          "seed": seed, **asdict(options), **rule}, sort_keys=True)
    return "c" + hashlib.sha256(payload.encode()).hexdigest()[:11]


def built_by_earlier_icd10_rule(dataset: dict, cohort: dict) -> bool:
    """Whether a cohort (its `cohorts` row) is an `icd10` one built from these files of `dataset` before
    2026-12-06, by the rule now named `icd10_closest`: its id is the one those builds gave, which names no rule."""
    options = CohortOptions(cohort["target_rule"], cohort["harmonization"], cohort["min_history"])
    seed = json.loads(cohort["options_json"]).get("seed")
    return options.harmonize == "icd10" and _hashed_id(dataset, options, seed, {}) == cohort["cohort_id"]


def gem_rule_of(cohort: dict) -> str | None:
    """The GEM rule an `icd10` cohort (its `cohorts` row) was built by, None for the other harmonizations.

    A build since the rule was recorded says it in `options_json`. An earlier one is told by its id: the files it was
    built from are in the row since 2026-12-05, so one without them predates the rule's change too.
    """
    if cohort["harmonization"] != "icd10":
        return None
    if recorded := json.loads(cohort["options_json"]).get("gem_rule"):
        return recorded
    built_from = {"dataset_id": cohort["dataset_id"], "fingerprint": cohort["dataset_fingerprint"]}
    # Built before the rule was recorded, under either rule: it changed earlier on the day it was first recorded.
    earlier = cohort["dataset_fingerprint"] is None or built_by_earlier_icd10_rule(built_from, cohort)
    return EARLIER_ICD10_RULE if earlier else ICD10_GEM_RULE


def pretarget_sql(events: str, trajectories: str, encounter_starts: str) -> str:
    """The one definition of the pre-target view H (SQL over three named relations).

    `events(subject_id, time, code, numeric_value, text_value, encounter_id)`,
    `trajectories(trajectory_id, subject_id, target_encounter_id, cutoff_time)`,
    `encounter_starts(encounter_id, start_time, last_time, claims_from)` (`encounter_starts_sql`). An event is
    kept when it is static (no time) or strictly before the cutoff, it does not belong to the target
    encounter, and the encounter it belongs to (if any) began before the cutoff. An undated event of an
    encounter is kept only when that encounter's last dated event precedes the cutoff: a stay still open
    at the cutoff (one that spans the target stay) codes its diagnoses at its discharge, after the cutoff,
    and an encounter with no dated event at all is placed nowhere. An event without an
    encounter is also dropped from the target encounter's `claims_from` on (its first own event, or the
    untagged emergency-department registration of the visit that led into it): in that span it may well
    be the target encounter's own (the registration itself, an ED lab draw that the export left
    untagged). A clinical event (`CLINICAL_PREFIXES`: a diagnosis, procedure, medication, lab or note) with neither
    a time nor an encounter is left out: nothing places it before the cutoff (a problem list taken at extraction
    may hold the target encounter's diagnoses), so it cannot be static history as sex is. Nor is a death
    (`MEDS_DEATH`): no encounter follows one, so a death dated before the cutoff is the target encounter's
    own, recorded by its date alone (midnight, before a same-day admission).
    """
    return f"""
        SELECT t.trajectory_id, e.subject_id, e.time, e.code, e.numeric_value, e.text_value, e.encounter_id
        FROM {events} e
        JOIN {trajectories} t ON e.subject_id = t.subject_id
        LEFT JOIN {encounter_starts} s ON e.encounter_id = s.encounter_id
        LEFT JOIN {encounter_starts} own ON own.encounter_id = t.target_encounter_id
        WHERE (e.time IS NULL OR e.time < t.cutoff_time)
          AND (e.encounter_id IS NULL OR e.encounter_id <> t.target_encounter_id)
          AND (s.start_time IS NULL OR s.start_time < t.cutoff_time)
          AND (e.time IS NOT NULL OR e.encounter_id IS NULL OR coalesce(s.last_time < t.cutoff_time, false))
          AND (e.encounter_id IS NOT NULL OR e.time IS NULL OR own.claims_from IS NULL OR e.time < own.claims_from)
          AND NOT (e.time IS NULL AND e.encounter_id IS NULL AND {clinical_sql('e.code')})
          AND e.code <> 'MEDS_DEATH'
    """


def encounter_starts_sql(events: str) -> str:
    """One row per encounter of `events` (a relation with subject_id, time, code, encounter_id):

    - `start_time`: its admission (the first `HOSPITAL_ADMISSION//…` event, else its first dated event), the
      cutoff of a trajectory that targets it;
    - `first_time`, `last_time`: its first and its last dated own event;
    - `claims_from`: from when an event without an encounter may be its own: `first_time`, or earlier the
      registration of an emergency-department visit that was still open then and led into it. MEDS-Extract's
      MIMIC-IV ETL writes the `ED_REGISTRATION` (edregtime) and `ED_OUT` (edouttime) of an admission without
      its hadm_id, and the ED draws before the admission carry none either: they are the admission's own
      (MIMIC records edregtime on the admission's row). The visit is open when no untagged `ED_OUT` follows
      the registration before `first_time`, and it led into this encounter when no other encounter of the
      patient began in between (an export without `ED_OUT` then cannot stretch one registration over
      later stays). An ED visit that ended before the admission began stays history. The EHR prior and the
      readable record place such events in the same span (`models.stays.stay_spans`);
    - `n_dx`, and `dx_time`: from when its diagnoses are in later records: its first dated one, else (every one
      undated) its last dated event, after which `pretarget_sql` keeps its undated events (none when it has no
      dated event at all).
    """
    return f"""
        WITH own AS (
            SELECT encounter_id, any_value(subject_id) AS subject_id,
                   coalesce(min(time) FILTER (WHERE code LIKE 'HOSPITAL_ADMISSION//%'), min(time)) AS start_time,
                   min(time) AS first_time, max(time) AS last_time,
                   count(*) FILTER (WHERE code LIKE 'DIAGNOSIS//%') AS n_dx,
                   coalesce(min(time) FILTER (WHERE code LIKE 'DIAGNOSIS//%'), max(time)) AS dx_time
            FROM {events} WHERE encounter_id IS NOT NULL GROUP BY encounter_id),
        ordered AS (
            SELECT *, lag(first_time) OVER (PARTITION BY subject_id ORDER BY first_time, encounter_id) AS previous_first
            FROM own),
        untagged AS (
            SELECT subject_id, time, code LIKE 'ED_OUT%' AS is_exit FROM {events}
            WHERE encounter_id IS NULL AND time IS NOT NULL
              AND (code IN ('ED_REGISTRATION', 'ED_OUT') OR code LIKE 'ED_REGISTRATION//%' OR code LIKE 'ED_OUT//%')),
        registrations AS (SELECT subject_id, time FROM untagged WHERE NOT is_exit),
        exits AS (SELECT subject_id, time FROM untagged WHERE is_exit)
        SELECT o.encounter_id, o.subject_id, o.start_time, o.first_time, o.last_time,
               CASE WHEN r.time IS NOT NULL AND (x.time IS NULL OR x.time < r.time)
                         AND (o.previous_first IS NULL OR o.previous_first < r.time) THEN r.time
                    ELSE o.first_time END AS claims_from,
               o.n_dx, o.dx_time
        FROM ordered o
        ASOF LEFT JOIN registrations r ON r.subject_id = o.subject_id AND o.first_time > r.time
        ASOF LEFT JOIN exits x ON x.subject_id = o.subject_id AND o.first_time > x.time
    """


def assign_shards(trajectories: pl.DataFrame, shard_size: int) -> pl.DataFrame:
    """Number the shards of a cohort's trajectories (column `shard`, from 0): up to `shard_size`
    trajectories of one split each, in their given order, splits in name order.

    No shard mixes splits, so a forecast of one split (held_out by default, a tenth of the cohort)
    reads and writes only that split's shards, each full, instead of a tenth of every shard.
    """
    parts, first = [], 0
    for split in sorted(trajectories["split"].unique().to_list()):
        part = trajectories.filter(pl.col("split") == split)
        parts.append(part.with_columns(shard=first + pl.int_range(pl.len(), dtype=pl.Int32) // shard_size))
        first += -(-part.height // shard_size)
    return pl.concat(parts)


def build_cohort(wh: Warehouse, dataset_id: str, name: str, options: CohortOptions, *, seed: int,
                 shard_size: int = 500, oracle_draws: int = 200, memory_limit: str = "2GB",
                 progress: bool = False, log: Callable[[str], None] | None = None, run_id: str | None = None) -> dict:
    """Build (or rebuild) a cohort, registered in `runs` (kind `cohort`); returns its `cohorts` row.

    With `progress` a bar shows the build's steps on a terminal; otherwise (no terminal, or no `progress`) `log`
    receives one line per step as it ends (`cohort default: oracle probabilities (latent and record) done in 121.4 s`).

    The dataset stays locked for reading (no synth or ingest replaces it meanwhile) and the cohort
    for writing (no forecast reads it while it is rebuilt).
    """
    check_name("cohort", name)
    config = {"dataset": dataset_id, "name": name, **asdict(options), "seed": seed, "shard_size": shard_size,
              "oracle_draws": oracle_draws}
    with registered_run(wh, "cohort", config, run_id) as run:
        # The build writes to both stores and spills under the gold one: the data dir is where room is needed.
        with duck.resource_errors(f"cohort build of {name} from dataset {dataset_id}", wh.root, memory_limit,
                                  "cohort.memory_limit"):
            row = _build_locked(wh, run, dataset_id, name, options, seed=seed, shard_size=shard_size,
                                oracle_draws=oracle_draws, memory_limit=memory_limit, progress=progress, log=log)
    return row


def _build_locked(wh: Warehouse, run: Run, dataset_id: str, name: str, options: CohortOptions, *, seed: int,
                  shard_size: int, oracle_draws: int, memory_limit: str, progress: bool,
                  log: Callable[[str], None] | None) -> dict:
    get_dataset(wh, dataset_id)  # an unknown dataset is named before any lock file is made
    with held(wh, f"dataset:{dataset_id}", shared=True,
              busy=f"dataset {dataset_id!r} is being written by another dxr process (synth or ingest)"):
        dataset = get_dataset(wh, dataset_id)
        # The files this warehouse holds, not `meds_dir`: that records where they were registered, which a
        # moved or restored warehouse no longer is (and a copy's would be another warehouse's files).
        info = validate_meds_dir(wh.meds_dir(dataset_id), memory_limit)
        if not info.holds_registered(dataset["fingerprint"]):
            remake = "synth" if dataset["source"] == "synthetic" else f"ingest {dataset['source']}"
            raise InputError(f"dataset {dataset_id!r}: the files in {info.root} changed since they were registered "
                             f"(fingerprint {dataset['fingerprint']} -> {info.fingerprint}), e.g. by an interrupted "
                             f"ingest or a file rewritten in place: rerun `dxr {remake}` for it")
        cohort_id = cohort_id_for(dataset, options, seed)
        with held(wh, f"cohort:{cohort_id}", shared=False,
                  busy=f"cohort {name} ({cohort_id}) is in use by another dxr process (a forecast, a prior's "
                       "training or a build)"):
            return _write_cohort(wh, run, dataset, info, cohort_id, name, options, seed=seed, shard_size=shard_size,
                                 oracle_draws=oracle_draws, memory_limit=memory_limit, progress=progress,
                                 log=log)


class _Steps:
    """A build's steps as they end: a bar on a terminal when `progress` is set, else one line each to `log`.

    A build of 100,000 patients takes minutes; a bar shows nothing in a log file (cron) or a Prefect run's log, where
    a working build would otherwise look like a hung one.
    """

    def __init__(self, name: str, total: int, progress: bool, log: Callable[[str], None] | None):
        # disable=None: tqdm draws only when stderr is a terminal, and then the bar says it all.
        self.bar = tqdm(total=total, desc=f"cohort {name}", unit="step", disable=None if progress else True)
        self.log = log if self.bar.disable else None
        self.name, self.mark = name, time.perf_counter()

    def done(self, step: str) -> None:
        now = time.perf_counter()
        self.bar.update()
        if self.log is not None:
            self.log(f"cohort {self.name}: {step} done in {now - self.mark:.1f} s")
        self.mark = now

    def close(self) -> None:
        self.bar.close()


def _why_no_trajectory(con, dataset_id: str, options: CohortOptions, target_filter: str) -> str:
    """Why a build's tables (`_write_cohort`'s) hold no trajectory, and the fix.

    "Lower --min-history" alone misled when the cause lay elsewhere: it was the advice at --min-history 0 too, for a
    dataset whose split file lists none of its patients or whose diagnoses carry no encounter."""
    start = f"dataset {dataset_id!r} yields no trajectory"
    counts = f"""SELECT (SELECT count(*) FROM ordered),
                        (SELECT count(*) FROM ordered JOIN splits_frame USING (subject_id)),
                        (SELECT max(n_prior) FROM counted JOIN splits_frame USING (subject_id) WHERE {target_filter})"""
    [(n_encounters, n_listed, most)] = con.execute(counts).fetchall()
    if not n_encounters:
        return (f"{start}: no encounter has a diagnosis (a target is the diagnoses coded in one encounter, so a "
                "diagnosis needs the encounter_id of its admission, and the encounter a dated event): give diagnoses "
                "their encounter_id and ingest the dataset again")
    if not n_listed:
        return (f"{start}: none of the patients with encounters is listed in its metadata/subject_splits.parquet, "
                "and a patient it does not list is in no cohort: give them a split (train, tuning or held_out) there, "
                "or leave the file out for the seeded hash split, and ingest the dataset again")
    if most < options.min_history:
        return (f"{start} with --min-history {options.min_history}: no patient has that many earlier encounters with "
                f"diagnoses coded before the target encounter began (at most {most}); lower --min-history to {most}")
    return (f"{start}: no target encounter keeps a diagnosis code under --harmonize {options.harmonize} (their codes "
            "have no rendering there): build with --harmonize native")


def _write_cohort(wh: Warehouse, run: Run, dataset: dict, info, cohort_id: str, name: str, options: CohortOptions,
                  *, seed: int, shard_size: int, oracle_draws: int, memory_limit: str, progress: bool,
                  log: Callable[[str], None] | None) -> dict:
    """Every table of a cohort, its `cohorts` row last (the caller holds the locks), recorded by its build's `run`
    (`Run.record_cohort`) once it begins to rewrite them. The row returned also says
    under which other name (`previous_name`) this id was registered, if any: the id leaves the name out, so the
    same build under a new name renames the cohort, and the old name no longer finds it. It says how many
    diagnosis codes a `codes.parquet` that lists only codes of the data held (`dictionary_set_aside`: Ω did not
    take it), and names, as (code, events) most frequent first, the diagnosis codes of the data that Ω lacks
    (`outside_vocabulary`), those that harmonization drops (`unmapped`), and those of either that no official ICD
    table has (`unknown_to_icd`: a typo or a local code of the export)."""
    dataset_id = dataset["dataset_id"]
    previous = wh.read("cohorts", cohort_id=cohort_id)["name"].to_list()
    synthetic = dataset["source"] == "synthetic"  # its two oracles are the last step, most of a build's time
    steps = _Steps(name, 6 if synthetic else 5, progress, log)

    with _spilling_connection(wh, cohort_id, memory_limit) as con:
        vocab.load_vocabularies(wh)
        gem, icd_codes = wh.read("gem_map"), wh.read("icd_codes")
        shards = duck.read("read_parquet", info.root / "data", "**/*.parquet", "union_by_name = true")
        con.execute(f"""CREATE TEMP TABLE raw AS SELECT subject_id, time, code, numeric_value, text_value, encounter_id
                        FROM {shards}""")
        # The MIMIC importers flag the birth date they moved to cap an age above 89 (`time_imputed`, a MEDS
        # extension column a dataset may lack): read apart from `raw`, whose other events it does not concern.
        # This second pass reads three columns: on the generated MIMIC-IV set (9.9M events) it cost 0.4 s of CPU
        # against 38-40 s for the whole build (2026-12-05), so folding it into `raw` would save about 1%.
        flagged = "time_imputed" in con.sql(f"SELECT * FROM {shards} LIMIT 0").columns
        con.execute("CREATE TEMP TABLE imputed_births AS SELECT DISTINCT subject_id " + (
            f"FROM {shards} WHERE code = 'MEDS_BIRTH' AND TRY_CAST(time_imputed AS BOOLEAN)" if flagged
            else "FROM raw WHERE false"))
        steps.done("events")

        # Harmonized diagnosis codes: one source code may map to several (icd10 via GEM) or none.
        dx_codes = [c for (c,) in con.execute(
            "SELECT DISTINCT code FROM raw WHERE code LIKE 'DIAGNOSIS//%'").fetchall()]
        dx_map = vocab.harmonize_codes(dx_codes, options.harmonize, gem, icd_codes.select("code", "title"))
        unmapped = len(set(dx_codes) - set(dx_map["source_code"].to_list()))
        con.register("dx_map_frame", dx_map.to_arrow())
        con.execute("""CREATE TEMP TABLE events AS
            SELECT r.subject_id, r.time, coalesce(m.code, r.code) AS code, r.numeric_value, r.text_value, r.encounter_id
            FROM raw r LEFT JOIN dx_map_frame m ON r.code = m.source_code
            WHERE r.code NOT LIKE 'DIAGNOSIS//%' OR m.code IS NOT NULL""")
        con.execute(f"CREATE TEMP TABLE encounter_starts AS {encounter_starts_sql('raw')}")
        steps.done("harmonized diagnosis codes")

        splits = read_splits(info, seed, memory_limit)
        con.register("splits_frame", splits.to_arrow())
        # Encounters with at least one raw diagnosis, ordered per patient. The prior encounters of one are those
        # whose diagnoses its pre-target record shows: begun before it and coded before it began. A stay still
        # open at the next admission (a transfer, a nested stay) has its diagnoses at discharge, after that
        # cutoff, so it is not history yet.
        con.execute("""CREATE TEMP TABLE ordered AS
            SELECT subject_id, encounter_id, start_time, dx_time,
                   row_number() OVER (PARTITION BY subject_id ORDER BY start_time, encounter_id) - 1 AS position,
                   count(*) OVER (PARTITION BY subject_id) AS n_total
            FROM encounter_starts WHERE n_dx > 0 AND start_time IS NOT NULL""")
        # An encounter is a prior one of every encounter that begins after both its start and its coding: counted
        # in one pass over each patient's encounters in time order, where one counts from that later instant on
        # (at an equal instant after the encounters that begin then, as it must begin before them). Compared pair
        # by pair, one patient's 20,000 encounters took 24 s to count, four times as many 16 times as long.
        # (`dx_time` is set wherever `start_time` is: both come from a dated event of the encounter.)
        con.execute("""CREATE TEMP TABLE counted AS
            WITH instants AS (
                SELECT subject_id, encounter_id, start_time, position, n_total, start_time AS instant, 0 AS counts
                FROM ordered
                UNION ALL
                SELECT subject_id, NULL, NULL, NULL, NULL, greatest(start_time, dx_time), 1 FROM ordered)
            SELECT subject_id, encounter_id, start_time, position, n_total, n_prior
            FROM (SELECT *, sum(counts) OVER (PARTITION BY subject_id ORDER BY instant, counts
                                              ROWS UNBOUNDED PRECEDING) AS n_prior
                  FROM instants)
            WHERE counts = 0""")
        target_filter = "position = n_total - 1" if options.target == "final" else "TRUE"
        con.execute(f"""CREATE TEMP TABLE candidate_targets AS
            SELECT c.*, sp.split FROM counted c
            JOIN splits_frame sp USING (subject_id)
            WHERE {target_filter} AND n_prior >= {int(options.min_history)}""")
        con.execute(f"""CREATE TEMP TABLE target_codes AS
            SELECT DISTINCT '{cohort_id}:' || t.subject_id || ':' || t.encounter_id AS trajectory_id, e.code
            FROM candidate_targets t JOIN events e
              ON e.subject_id = t.subject_id AND e.encounter_id = t.encounter_id AND e.code LIKE 'DIAGNOSIS//%'""")
        # A subject the dataset's own split leaves unassigned is neither trained on nor forecast: putting it in
        # a split here could put a patient its owners keep apart (a later evaluation set) into training.
        [(unsplit,)] = con.execute(
            "SELECT count(DISTINCT subject_id) FROM raw ANTI JOIN splits_frame USING (subject_id)").fetchall()
        trajectories = fetch_frame(con, f"""
            SELECT '{cohort_id}' AS cohort_id, '{cohort_id}:' || subject_id || ':' || encounter_id AS trajectory_id,
                   subject_id, encounter_id AS target_encounter_id, start_time AS cutoff_time, split,
                   CAST(n_prior AS INTEGER) AS n_prior_encounters,
                   subject_id IN (SELECT subject_id FROM imputed_births) AS birth_time_imputed
            FROM candidate_targets
            WHERE '{cohort_id}:' || subject_id || ':' || encounter_id IN (SELECT trajectory_id FROM target_codes)
            ORDER BY subject_id, cutoff_time, target_encounter_id""")
        if trajectories.is_empty():
            raise InputError(_why_no_trajectory(con, dataset_id, options, target_filter))
        trajectories = assign_shards(trajectories, shard_size)
        con.register("traj", trajectories.to_arrow())
        steps.done("trajectories")

        omega, omega_source, set_aside = _vocabulary(info, options, gem, icd_codes, cohort_id, set(dx_codes))
        # A dictionary may lack codes its own data uses (MIMIC-III's d_icd_diagnoses lacks 20 older codes of the
        # demo, such as 789.5 ascites): V(.) drops them from every forecast, so their targets are out of reach.
        outside_codes = set(dx_map["code"].to_list()) - set(omega["code"].to_list())
        outside = len(outside_codes)
        # Named by the build, most frequent first (never written: a code may occur only in held-out targets).
        outside_by_events = _by_events(con, "events", outside_codes)
        unmapped_by_events = _by_events(con, "raw", set(dx_codes) - set(dx_map["source_code"].to_list()))

        # Unregistered before the first write: until the final `cohorts` write, the cohort does not exist for
        # readers. Not earlier, so that a build refused for its input (no trajectory, a dictionary unlike the
        # data) leaves a cohort of this id as it was. Its run names the cohort from here on, which tells a build
        # cut short while it rewrote the cohort from one that never touched it (`unregistered_build`).
        run.record_cohort(wh, cohort_id)
        wh.delete("cohorts", cohort_id=cohort_id)
        for table in ("cohort_vocabulary", "code_titles", "trajectories", "pretarget_events", "train_events",
                      "targets", "oracle_probabilities", "record_oracle_probabilities"):
            wh.delete(table, cohort_id=cohort_id)
        wh.write("cohort_vocabulary", omega, cohort_id=cohort_id)
        steps.done("vocabulary")

        wh.write("trajectories", trajectories, cohort_id=cohort_id)
        used_codes = set()
        for shard in range(int(trajectories["shard"].max()) + 1):
            rows = con.sql(f"""SELECT '{cohort_id}' AS cohort_id, p.* FROM ({pretarget_sql(
                "events", "(SELECT * FROM traj WHERE shard = " + str(shard) + ")", "encounter_starts")}) p
                ORDER BY trajectory_id, time NULLS FIRST, code""").to_arrow_table()
            wh.write("pretarget_events", rows, cohort_id=cohort_id, shard=shard)
            used_codes.update(rows.column("code").unique().to_pylist())
        # Most of a dataset's events: streamed to Parquet by DuckDB rather than held as one Arrow table.
        wh.write_query("train_events", con, f"""SELECT '{cohort_id}' AS cohort_id, e.* FROM events e
            JOIN splits_frame s USING (subject_id) WHERE s.split = 'train'
            ORDER BY subject_id, time NULLS FIRST, code""", cohort_id=cohort_id)
        used_codes.update(code for (code,) in con.execute(
            "SELECT DISTINCT code FROM events JOIN splits_frame s USING (subject_id) WHERE s.split = 'train'"
        ).fetchall())
        wh.write("code_titles", _code_titles(info, cohort_id, used_codes - set(omega["code"].to_list()),
                                             icd_codes.select("code", "title")), cohort_id=cohort_id)
        targets = fetch_frame(con, f"SELECT '{cohort_id}' AS cohort_id, trajectory_id, code FROM target_codes "
                                 "WHERE trajectory_id IN (SELECT trajectory_id FROM traj) ORDER BY ALL")
        wh.write("targets", targets, cohort_id=cohort_id)
        steps.done("pre-target records, train events and targets")

    if synthetic:
        from warehouse.synthetic.oracle import oracles

        harmonize = None if options.harmonize == "native" else partial(
            harmonize_with, dict(dx_map.group_by("source_code").agg("code").iter_rows()))
        keys = trajectories.select("trajectory_id", "subject_id", "target_encounter_id", "cutoff_time")
        # Both oracles from one re-simulation of each patient; each frame is written and dropped before the next is
        # built (at 100,000 patients, 6.5M rows each, the loop's name holding the first through the second's build
        # took the peak from 2.5 to 2.8 GB).
        tables = {"latent": "oracle_probabilities", "record": "record_oracle_probabilities"}
        for information, frame in oracles(info.root, keys, harmonize, draws=oracle_draws):
            wh.write(tables[information], frame.with_columns(pl.lit(cohort_id).alias("cohort_id")), cohort_id=cohort_id)
            del frame
        steps.done("oracle probabilities (latent and record)")
    steps.close()

    row = {
        "cohort_id": cohort_id, "dataset_id": dataset_id, "name": name, "target_rule": options.target,
        "harmonization": options.harmonize, "min_history": options.min_history, "created_at": utc_now(),
        "n_trajectories": trajectories.height, "vocabulary_size": omega.height, "vocabulary_source": omega_source,
        "options_json": json.dumps({**asdict(options), **gem_rule_fields(options), "seed": seed,
                                    "shard_size": shard_size, "unmapped_diagnosis_codes": unmapped,
                                    "subjects_without_split": unsplit,
                                    "diagnosis_codes_outside_vocabulary": outside}, sort_keys=True),
        "dataset_fingerprint": dataset["fingerprint"], "cut_rule_version": CUT_RULE_VERSION,
    }
    wh.write("cohorts", pl.DataFrame([row]), cohort_id=cohort_id)
    known = set(icd_codes["code"].to_list())
    return {**row, "previous_name": next((n for n in previous if n != name), None),
            "outside_vocabulary": outside_by_events, "unmapped": unmapped_by_events, "dictionary_set_aside": set_aside,
            "unknown_to_icd": [(code, n) for code, n in outside_by_events + unmapped_by_events if code not in known]}


def _by_events(con: duckdb.DuckDBPyConnection, table: str, codes: set[str]) -> list[tuple[str, int]]:
    """`codes` with their number of events in `table`, most frequent first (ties by code)."""
    if not codes:
        return []
    con.register("counted_codes", pl.DataFrame({"code": sorted(codes)}).to_arrow())
    try:
        return con.execute(f"SELECT code, count(*) AS n FROM {table} JOIN counted_codes USING (code) "
                           "GROUP BY code ORDER BY n DESC, code").fetchall()
    finally:
        con.unregister("counted_codes")


@contextmanager
def _spilling_connection(wh: Warehouse, cohort_id: str, memory_limit: str) -> Iterator[duckdb.DuckDBPyConnection]:
    """An in-memory DuckDB connection that spills beyond `memory_limit` to a scratch directory.

    A MEDS export with lab results runs to tens or hundreds of millions of events; without a limit
    DuckDB would keep them all in memory. The scratch directory is on the gold side, because the
    spilled rows include target encounters, and is removed afterwards (or by the next build of any
    cohort when a SIGKILL left it).
    """
    # Every cohort's abandoned spill, not only this one's: a build killed before its options changed (a new id)
    # never runs under its id again, and its spill files run to gigabytes. Those of live builds stay (their lock).
    for name in {p.name.split(".")[1] for p in wh.gold_dir.glob(f".{SPILL_PREFIX}*")}:
        remove_abandoned(wh.gold_dir / name)
    target = wh.gold_dir / f"{SPILL_PREFIX}{cohort_id}"
    with scratch(target, "work") as workdir:
        workdir.mkdir()
        con = duck.connect(":memory:")
        try:
            duck.limit_memory(con, memory_limit)
            con.execute(f"SET temp_directory = {duck.literal(workdir)}")
            yield con
        finally:
            con.close()


def _vocabulary(info, options: CohortOptions, gem: pl.DataFrame, icd_codes: pl.DataFrame,
                cohort_id: str, data_codes: set[str]) -> tuple[pl.DataFrame, str, int]:
    """Ω from the dataset's shipped dictionary, else the official billable codes; then harmonized. Also the
    number of diagnosis codes of a `codes.parquet` set aside as no dictionary (0 when none was).

    A `codes.parquet` whose diagnosis codes all occur in the data (`data_codes`) is taken for a list made
    from the data, as MEDS pipelines make it, not for a dictionary: it would hold codes found only in
    held-out targets, and Ω must not depend on targets. A dictionary (MIMIC's `d_icd_diagnoses`, the
    synthetic generator's billable ICD-10-CM) lists codes that the data never uses.
    """
    codes_file = info.root / "metadata" / "codes.parquet"
    shipped = pl.DataFrame(schema={"code": pl.String, "title": pl.String})
    if codes_file.is_file():
        codes = pl.read_parquet(codes_file, glob=False)
        if "description" not in codes.columns:  # optional in MEDS code metadata
            codes = codes.with_columns(description=pl.lit(None, pl.String))
        shipped = (codes.select("code", "description").cast(pl.String)  # also dictionary-encoded or all-null
                   .filter(pl.col("code").str.starts_with("DIAGNOSIS//ICD//"))
                   .rename({"description": "title"}).unique("code", keep="first"))
    set_aside = 0
    if shipped.height and not set(shipped["code"].to_list()) <= data_codes:
        omega, source = shipped, "dataset_dictionary"
    else:
        set_aside = shipped.height
        versions = list(info.icd_versions)
        omega = (icd_codes.filter(pl.col("billable") & pl.col("icd_version").is_in(versions))
                 .select("code", "title"))
        source = "official_billable_icd" + "_".join(map(str, versions))
    harmonized = vocab.harmonized_vocabulary(omega, options.harmonize, gem, icd_codes.select("code", "title"))
    return harmonized.with_columns(pl.lit(cohort_id).alias("cohort_id")).sort("code"), source, set_aside


def _code_titles(info, cohort_id: str, used_codes: set[str], icd_titles: pl.DataFrame) -> pl.DataFrame:
    """`code_titles`: titles of the codes in `used_codes` (the codes outside Ω): the codes.parquet description,
    else for a diagnosis its official ICD title (`icd_titles`).

    Only codes the forecasting store already holds (pre-target and train events): a code found only in
    target encounters, such as the procedure of a held-out target admission, must not reach it by its
    title. Ω's diagnoses are left to Ω, whose titles follow the cohort's harmonization; a diagnosis of
    the record outside Ω (MIMIC-III's 789.5 ascites, which its own dictionary lacks) would otherwise
    reach the prompt as a bare code.
    """
    codes_file = info.root / "metadata" / "codes.parquet"
    described = pl.DataFrame(schema={"code": pl.String, "description": pl.String})
    if codes_file.is_file() and "description" in pq.read_schema(codes_file).names:
        described = pl.read_parquet(codes_file, columns=["code", "description"], glob=False).cast(pl.String)
    official = icd_titles.rename({"title": "description"}).cast(pl.String)
    used = list(used_codes)
    titles = (pl.concat([described.filter(pl.col("code").is_in(used)), official.filter(pl.col("code").is_in(used))])
              .with_columns(title=pl.col("description").str.strip_chars())
              .filter(pl.col("title").str.len_chars() > 0)
              .unique("code", keep="first", maintain_order=True))  # codes.parquet first
    return titles.select(pl.lit(cohort_id).alias("cohort_id"), "code", "title").sort("code")


def code_titles(wh: Warehouse, cohort_id: str) -> dict[str, str]:
    """A built cohort's `code_titles` as code -> title (empty for a cohort built before the table existed)."""
    return dict(wh.read("code_titles", cohort_id=cohort_id).select("code", "title").iter_rows())


def harmonize_with(mapping: dict[str, list[str]], codes: list[str]) -> list[str]:
    """Harmonized codes of a code set (a module-level function so worker processes can receive it)."""
    return sorted({h for c in codes for h in mapping.get(c, [])})


@contextmanager
def reading_cohort(wh: Warehouse, name_or_id: str) -> Iterator[dict]:
    """A cohort's `cohorts` row, with the cohort held for reading (no rebuild) for the block.

    The row is looked up again under the lock: a build that failed or was killed between the first
    lookup and the lock has unregistered the cohort, and its tables may be partial (`registered_cohort` refuses it,
    naming the command that builds it again).
    """
    # Its holders, a forecast and a training, make something from the cohort: building one is a way out for them.
    cohort_id = get_cohort(wh, name_or_id, suggest_build=True)["cohort_id"]
    with held(wh, f"cohort:{cohort_id}", shared=True,
              busy=f"cohort {name_or_id} ({cohort_id}) is being rebuilt by another dxr process"):
        yield registered_cohort(wh, cohort_id)


def superseded_note(wh: Warehouse, cohort: dict) -> str | None:
    """Why a cohort (its `cohorts` row) is no longer what a build of its options makes from its dataset, or None.

    A dataset registered again with other files (a nightly extract's refresh) gives the same options another
    cohort id; the earlier cohort keeps its tables, so the runs scored against it stay as they were, but it
    holds the earlier files' patients and encounters. An `icd10` cohort built before the rule changed
    (`built_by_earlier_icd10_rule`) is told apart: its files are the current ones, its rule is not.
    """
    if not built_by_cohort_build(wh, cohort):
        return None
    seed = json.loads(cohort["options_json"])["seed"]
    dataset = get_dataset(wh, cohort["dataset_id"])
    options = CohortOptions(cohort["target_rule"], cohort["harmonization"], cohort["min_history"])
    if cohort_id_for(dataset, options, seed) == cohort["cohort_id"]:
        return None
    if built_by_earlier_icd10_rule(dataset, cohort):
        return (f"cohort {cohort['name']} ({cohort['cohort_id']}) was built from these files of dataset "
                f"{cohort['dataset_id']} by {EARLIER_ICD10_RULE_TEXT}, whereas icd10 now maps each ICD-9 code to "
                "every target of its GEM rows")
    if built_under_size_fingerprint(wh, dataset, cohort):
        return (f"cohort {cohort['name']} ({cohort['cohort_id']}) was built when dataset {cohort['dataset_id']} had "
                f"a fingerprint of its files' sizes and row counts (before 2026-12-05){earlier_rule_clause(cohort)}; "
                "registered again on "
                f"{dataset['registered_at']:%Y-%m-%d %H:%M} UTC with files of the same sizes and row counts, likely "
                f"the same, it has a fingerprint of their contents ({dataset['fingerprint']}), which gives the "
                "cohort's options another cohort id")
    return (f"cohort {cohort['name']} ({cohort['cohort_id']}) was built from earlier files of dataset "
            f"{cohort['dataset_id']}, registered again on {dataset['registered_at']:%Y-%m-%d %H:%M} UTC with "
            f"other files (fingerprint {dataset['fingerprint']})")


def built_under_size_fingerprint(wh: Warehouse, dataset: dict, cohort: dict) -> bool:
    """Whether a cohort (its `cohorts` row) was built when its dataset (its `datasets` row) was registered under a
    fingerprint of sizes and row counts that its files registered now still have.

    Such a fingerprint (before 2026-12-05) gives way to a content one when the dataset is registered again, even with
    the very same files; sizes and row counts alone cannot tell those from a correction of the same length. An `icd10`
    cohort of those days was built by the earlier rule, under the id that names no rule (`built_by_earlier_icd10_rule`).
    """
    sizes = current_size_fingerprint(wh.meds_dir(cohort["dataset_id"]))
    # Null for a cohort built before the fingerprint was recorded; a build since records the size fingerprint too.
    if sizes is None or cohort["dataset_fingerprint"] not in (None, sizes):
        return False
    legacy = dataset | {"fingerprint": sizes}
    options = CohortOptions(cohort["target_rule"], cohort["harmonization"], cohort["min_history"])
    return (cohort_id_for(legacy, options, json.loads(cohort["options_json"])["seed"]) == cohort["cohort_id"]
            or built_by_earlier_icd10_rule(legacy, cohort))


def earlier_rule_clause(cohort: dict) -> str:
    """The words a size-fingerprinted cohort's notes add for an `icd10` cohort built by the earlier rule, else ''."""
    return f", and by {EARLIER_ICD10_RULE_TEXT}" if gem_rule_of(cohort) == EARLIER_ICD10_RULE else ""


def built_by_cohort_build(wh: Warehouse, cohort: dict) -> bool:
    """Whether a cohort (its `cohorts` row) was built from a dataset still registered, which a build can rebuild: not
    one made without a registered dataset (a test's planted one)."""
    return ("seed" in json.loads(cohort["options_json"])
            and wh.has_rows("datasets", dataset_id=cohort["dataset_id"]))


def outdated_cut_note(wh: Warehouse, cohort: dict) -> str | None:
    """Why a cohort (its `cohorts` row) holds what rules other than this dxr's (`CUT_RULE_VERSION`) cut, or None.

    A cohort keeps its trajectories, targets and pre-target records until it is built again; a dataset whose rows
    the changed rules never meet (for version 1, one whose events all have a time) is cut the same by either.
    """
    version = cohort["cut_rule_version"]
    if version == CUT_RULE_VERSION or not built_by_cohort_build(wh, cohort):
        return None
    return (f"cohort {cohort['name']} ({cohort['cohort_id']}) was cut {cut_by(version)}, not by this dxr's version "
            f"{CUT_RULE_VERSION}: its trajectories, targets and pre-target records may differ from what a build "
            "makes now")


def cut_by(version: int | None) -> str:
    """How a note names the cut rules of a `cut_rule_version`.

    >>> cut_by(1), cut_by(None)
    ('by version 1 of the cut rules', 'before cut rules were versioned')
    """
    return "before cut rules were versioned" if version is None else f"by version {version} of the cut rules"


def cut_rule_cell(version: int | None) -> str:
    """How `dxr cohort list` shows a cohort's `cut_rule_version`: the version, with the current one when it is
    another, e.g. `none (now 2)` for a cohort built before versions were recorded where 2 is this dxr's."""
    if version == CUT_RULE_VERSION:
        return str(version)
    return f"{'none' if version is None else version} (now {CUT_RULE_VERSION})"


def cohort_provenance(wh: Warehouse, cohort_id: str) -> str:
    """A cohort as a report names it: name, id, when it was built from which dataset and which version of its files
    (the id alone for a cohort no longer registered; no fingerprint for one built before it was recorded)."""
    rows = wh.read("cohorts", cohort_id=cohort_id)
    return describe_cohort(rows.row(0, named=True)) if rows.height else cohort_id


def describe_cohort(cohort: dict) -> str:
    """`cohort_provenance` of a `cohorts` row."""
    files = f" (fingerprint {cohort['dataset_fingerprint']})" if cohort["dataset_fingerprint"] else ""
    return (f"{cohort['name']} ({cohort['cohort_id']}), built {cohort['created_at']:%Y-%m-%d %H:%M} UTC from dataset "
            f"{cohort['dataset_id']}{files}")


def rebuild_command(cohort: dict, seed_in_force: int) -> str:
    """The `dxr cohort build` command that builds a cohort's options again from its dataset's current files.

    The seed is an option too (it splits patients without a split file and is part of the cohort id) but a setting,
    not a flag: a cohort built under another seed than `seed_in_force` is named with its own as `DXR_SEED`, so that
    the command builds that cohort again rather than a new one beside it.
    """
    seed = json.loads(cohort["options_json"])["seed"]
    return (f"{'' if seed == seed_in_force else f'DXR_SEED={seed} '}dxr cohort build --dataset {cohort['dataset_id']} "
            f"--name {cohort['name']} --target {cohort['target_rule']} --harmonize {cohort['harmonization']} "
            f"--min-history {cohort['min_history']}")


def superseded_cohorts(wh: Warehouse, dataset_id: str) -> list[dict]:
    """The cohorts of a dataset that are the newest of their name but were built from earlier files of it: the
    ones a refresh of the dataset leaves to be built again."""
    # Newest among every dataset's cohorts: a name another dataset's cohort took since no longer finds this one.
    newest = wh.read("cohorts").sort("created_at", descending=True).unique("name", keep="first", maintain_order=True)
    dataset = get_dataset(wh, dataset_id)
    return [row for row in newest.filter(pl.col("dataset_id") == dataset_id).iter_rows(named=True)
            if superseded_note(wh, row) and not built_by_earlier_icd10_rule(dataset, row)]


def cohort_list(wh: Warehouse) -> str:
    """The built cohorts, oldest first, as the aligned table `dxr cohort list` prints; `cut_rule_version` as
    `cut_rule_cell` shows it, `gem_rule` empty but for `icd10` cohorts (`gem_rule_of`)."""
    from warehouse.sql import format_table

    columns = ["cohort_id", "name", "dataset_id", "target_rule", "harmonization", "min_history", "n_trajectories",
               "vocabulary_size"]
    cohorts = wh.read("cohorts").sort("created_at")
    return format_table(columns + ["cut_rule_version", "gem_rule"], [
        tuple(row[c] for c in columns) + (cut_rule_cell(row["cut_rule_version"]), gem_rule_of(row) or "")
        for row in cohorts.iter_rows(named=True)])


def split_counts(wh: Warehouse, cohort_id: str) -> dict[str, int]:
    """The number of the cohort's trajectories in each split, in split order, empty splits included."""
    counts = dict(wh.read("trajectories", cohort_id=cohort_id).group_by("split").len().rows())
    return {split: counts.get(split, 0) for split in SPLITS}


def get_cohort(wh: Warehouse, name_or_id: str, suggest_build: bool = False) -> dict:
    """Look a cohort up by id or by name (the most recently built cohort of that name).

    A name is refused while a cohort of that name is being built: the build unregisters its cohort until
    it is complete and then is the newest of the name, so an older cohort of the name (other options)
    answering meanwhile would be the wrong one. So it is once the newest build of the name that began to write its
    cohort was cut short (`unbuilt_cohort`): the user's last word on the name is that build's options, which a
    forecast of an older cohort of the name would silently ignore. `suggest_build`: see `unknown_cohort`.
    """
    cohorts = wh.read("cohorts")
    by_id = cohorts.filter(pl.col("cohort_id") == name_or_id)
    if not by_id.is_empty():
        return by_id.row(0, named=True)
    match = cohorts.filter(pl.col("name") == name_or_id)
    running = runs_in_progress(wh).filter(pl.col("kind") == "cohort")  # a killed build is not being built
    building = [row for row in running.iter_rows(named=True)
                if json.loads(row["config_json"]).get("name") == name_or_id]
    if building:
        older = remaining_cohorts(match["cohort_id"].to_list())
        raise NotFoundError(f"cohort {name_or_id!r} is being built (run {building[0]['run_id']}, started "
                            f"{building[0]['started_at']:%Y-%m-%d %H:%M:%S} UTC): retry when it has finished{older}")
    if unbuilt := unbuilt_cohort(wh, name_or_id):
        raise unbuilt
    if match.is_empty():
        raise unknown_cohort(wh, name_or_id, cohorts, suggest_build)
    return match.sort("created_at", descending=True).row(0, named=True)


def registered_cohort(wh: Warehouse, cohort_id: str) -> dict:
    """The `cohorts` row of a cohort id that a run or a table names, refusing one no longer registered: its tables
    are then a build's that did not finish, some rewritten and others still empty, or a deletion's leftovers.

    The caller holds the cohort (`warehouse.runs.holding_run`), so no build unregisters it after this check.
    """
    rows = wh.read("cohorts", cohort_id=cohort_id)
    if rows.height:
        return rows.row(0, named=True)
    raise unbuilt_cohort(wh, cohort_id) or NotFoundError(
        f"cohort {cohort_id} is not built: it was deleted, or a build of it did not finish, and no record of its "
        "options remains; build it again with `dxr cohort build` under the options it had")


def unbuilt_cohort(wh: Warehouse, name_or_id: str, builds: pl.DataFrame | None = None) -> NotFoundError | None:
    """The error for a cohort, by id or name, that a build cut short left unregistered (`unregistered_build`),
    naming the command that builds it again; None for any other. Asked by a name that registered cohorts of other
    options also have, it names them, and the deletes that give the name back to the newest of them.

    A build unregisters its cohort before its first write and registers it last (`_write_cohort`): one killed or
    failed midway leaves the cohort's tables half rewritten, and a reader told only "not found" or "no gold
    targets", or answered by an older cohort of the name, is not told that running the build again is the way out.
    `builds`: `cohort_builds`, when the caller has read them.

    Asked by id, a cohort whose name a later build of another cohort has taken since (an orphan: the name no longer
    leads to it, so nothing refused for it tells of its half-written tables) names that cohort, and its new name if it
    has been renamed since, and the delete that removes them.
    """
    builds = cohort_builds(wh) if builds is None else builds
    if (unregistered := unregistered_build(wh, name_or_id, builds)) is None:
        return None
    cohort, how = unregistered
    cohort_id, name = cohort["cohort_id"], cohort["name"]
    command = rebuild_command(cohort, load_settings(data_dir=wh.root).seed)
    formerly = ""
    if name_or_id != cohort_id:
        # Asked by its name, or by the name a build cut short was renaming it from (`unregistered_build`).
        formerly = f", formerly {name_or_id}" if name_or_id != name else ""
        others = wh.read("cohorts").filter(pl.col("name") == name_or_id)["cohort_id"].to_list()
        after = remaining_cohorts(others, also=f"{deletes_giving_back(wh, name_or_id, cohort_id, builds)} for the "
                                               "name to mean the newest of them again")
    else:
        named = builds.filter(pl.col("name") == name, pl.col("cohort_id").is_not_null())["cohort_id"]
        taken_by = named[-1] if named.len() and named[-1] != cohort_id else None
        after = (f"; a later build of the name {name} (cohort {taken_by}{renamed_since(wh, taken_by, name, builds)}) "
                 f"took the name from it: `dxr cohort delete {cohort_id}` removes the tables it left half written "
                 "(building it again takes the name back)" if taken_by else "")
    return NotFoundError(f"cohort {name} ({cohort_id}{formerly}) is not built: {how}, and a build unregisters its "
                         f"cohort until it is complete; build it again with `{command}`{after}")


def deletes_giving_back(wh: Warehouse, name: str, cohort_id: str, builds: pl.DataFrame) -> str:
    """The `dxr cohort delete` commands after which `name`, which leads to the unregistered `cohort_id`, leads to the
    newest of its registered cohorts: that of `cohort_id`, then of each older cohort of the name that a build cut
    short left unregistered, which the name would lead to next (deleting a cohort removes its builds)."""
    doomed = [cohort_id]
    while (older := unregistered_build(wh, name, builds.filter(pl.col("cohort_id").is_null()
                                                                | ~pl.col("cohort_id").is_in(doomed)))) is not None:
        doomed.append(older[0]["cohort_id"])
    return ", then ".join(f"`dxr cohort delete {doomed_id}`" for doomed_id in doomed)


def renamed_since(wh: Warehouse, cohort_id: str, name: str, builds: pl.DataFrame) -> str:
    """`, renamed <new name> since` for a cohort that a build has given another name than `name` since (its
    registered name, else its newest build's: a rename cut short); empty for one still of `name`."""
    registered = wh.read("cohorts", cohort_id=cohort_id)["name"]
    current = registered[0] if registered.len() else builds.filter(pl.col("cohort_id") == cohort_id)["name"][-1]
    return f", renamed {current} since" if current != name else ""


def remaining_cohorts(cohort_ids: list[str], also: str = "") -> str:
    """The clause of a refused cohort name that names the finished cohorts of the name still usable by id (`also`:
    the other way out, after "or"); empty without any."""
    if not cohort_ids:
        return ""
    other_way = f", or {also}" if also else ""
    return (f"; {len(cohort_ids)} finished cohort(s) of the name remain: name one by its id to use it "
            f"({', '.join(sorted(cohort_ids))}){other_way}")


def cohort_builds(wh: Warehouse) -> pl.DataFrame:
    """The `runs` rows of every cohort build with the name it built under (`name`), oldest first; those a killed
    process left `running` are marked `killed` first."""
    mark_killed(wh)
    return (wh.read("runs", kind="cohort").with_columns(name=pl.col("config_json").str.json_path_match("$.name"))
            .sort("started_at", "run_id"))


def unregistered_build(wh: Warehouse, name_or_id: str,
                       builds: pl.DataFrame | None = None) -> tuple[dict, str] | None:
    """A cohort, by id or name, that a build cut short (killed, or failed after it had begun to rewrite it) left
    unregistered: its options in the shape of a `cohorts` row (what `rebuild_command` reads) and how that build
    ended (`its build in run R failed`); None for any other cohort (one being built, one registered, one never
    built, or deleted: `dxr cohort delete` removes its builds' `runs` rows). `builds`: `cohort_builds`.

    By name, the newest build of the name that began to write decides, whatever older cohorts of the name are
    registered; when a later build cut it short as it renamed the cohort, the options are that build's, under the new
    name. A build refused before it wrote anything (an unknown dataset, a dataset without trajectories under
    its options, a busy lock) recorded no cohort in its `runs` row (`Run.record_cohort`) and counts for nothing. So
    does, for want of that record, a build cut short by a dxr of before 2026-12-06 (when builds began to record it):
    its cohort is found unregistered by its last finished build, which named it.
    """
    builds = cohort_builds(wh) if builds is None else builds
    matching = builds.filter((pl.col("cohort_id") == name_or_id) | (pl.col("name") == name_or_id))
    writing = matching.filter(pl.col("cohort_id").is_not_null())  # began to rewrite its cohort, or finished
    if writing.is_empty():
        return None
    last = writing.row(-1, named=True)
    config = json.loads(last["config_json"])
    running = builds.filter(pl.col("status") == "running", pl.col("name").is_in([name_or_id, config["name"]])
                            | (pl.col("cohort_id") == last["cohort_id"]))
    # Alive by its record lock: a process that may not write the warehouse leaves a killed build `running`.
    alive = any(lock_held(wh, record_lock(run_id, "cohort")) for run_id in running["run_id"])
    if alive or wh.has_rows("cohorts", cohort_id=last["cohort_id"]):
        return None
    ended = writing.tail(1)
    if last["status"] == "finished":
        # Unregistered since by a later build of the cohort under another name, or by one of the name that recorded
        # no cohort, as builds before 2026-12-06 did not.
        later = builds.filter(pl.col("started_at") > last["started_at"])
        if later.filter(pl.col("cohort_id") == last["cohort_id"], pl.col("status") == "finished").height:
            return None  # a later build renamed the cohort, and finished: the name no longer leads to it
        later = later.filter(pl.col("status") != "finished")
        ended = later.filter(pl.col("cohort_id") == last["cohort_id"])
        if ended.height:
            # That build was renaming the cohort: what the user asked for last is the cohort under its new name.
            config = json.loads(ended["config_json"][-1])
        else:
            ended = later.filter(pl.col("cohort_id").is_null() & (pl.col("name") == config["name"]))
    status = ended["status"][-1] if ended.height else None
    # Still `running` when a process that may not write the warehouse asks (`mark_killed` leaves it): no build of the
    # cohort is in progress, as checked above.
    killed = status in ("killed", "running")
    how = (f"its build in run {ended['run_id'][-1]} {'was killed' if killed else status}" if status
           else "a build of it did not finish")
    cohort = {"cohort_id": last["cohort_id"], "dataset_id": config["dataset"], "name": config["name"],
              "target_rule": config["target"], "harmonization": config["harmonize"],
              "min_history": config["min_history"], "options_json": json.dumps({"seed": config["seed"]})}
    return cohort, how


def unbuilt_cohorts(wh: Warehouse) -> list[NotFoundError]:
    """`unbuilt_cohort` of every cohort that a build cut short left unregistered, oldest first (by its newest build):
    by name where the name leads to it, else by id (an orphan whose name a later build of another cohort took, which
    the name alone would never find). A deleted cohort has no builds left (`dxr cohort delete` removes their `runs`
    rows)."""
    builds = cohort_builds(wh)
    registered = set(wh.read("cohorts")["cohort_id"].to_list())  # asked by id, none is unbuilt: skipped unread
    keys = [key for name, cohort_id in builds.select("name", "cohort_id").iter_rows()
            for key in (name, cohort_id) if key is not None and key not in registered]
    # A cohort's place: its newest build's (`builds` is oldest first). An orphan's note tells of the later build that
    # took its name, so it reads before that build's own note when that build was cut short too.
    newest_build = {cohort_id: place for place, cohort_id in enumerate(builds["cohort_id"]) if cohort_id is not None}
    found: dict[str, NotFoundError] = {}
    for key in dict.fromkeys(keys):
        unregistered = unregistered_build(wh, key, builds)
        if unregistered is not None and unregistered[0]["cohort_id"] not in found:
            found[unregistered[0]["cohort_id"]] = unbuilt_cohort(wh, key, builds)
    return [found[cohort_id] for cohort_id in sorted(found, key=newest_build.__getitem__)]


def unknown_cohort(wh: Warehouse, name_or_id: str, cohorts: pl.DataFrame, suggest_build: bool = False) -> NotFoundError:
    """The error for a cohort id or name that none of the built `cohorts` has, naming those there are.

    Building a cohort is advice only to a command that makes something from one (a forecast, a training); to one
    that reads or removes what a cohort already has (its models, its runs, the cohort itself) a new cohort is no
    way out, so `suggest_build` is left False there.
    """
    known = ", ".join(sorted(set(cohorts["name"].to_list()))) or "none"
    build = ", build one with `dxr cohort build`" if suggest_build else ""
    return NotFoundError(f"cohort {name_or_id!r} not found in the warehouse at {wh.root}; built cohorts: "
                         f"{known} (list them with `dxr cohort list`{build}, or check --data-dir)")
