"""Training records as a forecast sees them: which visits of a record its sequence misplaces, and the record
`pretarget_sql` cuts at such a visit's cutoff.

A record's visits in start order are each the target of the visits before them only while every earlier visit
ended before the visit's cutoff (its admission) and no later one began before it. A stay still open at another
stay's admission (MIMIC holds admissions that span a shorter one) has its diagnoses coded at its discharge: in
the sequence they precede the inner stay, in the inner stay's pre-target record they do not. The EHR prior
(`models.prior.data`) and `transition` learn such a visit from its cut record instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import duckdb
import polars as pl

from warehouse import cohorts, duck

# Events of the records that one `cut_records` call cuts (about: a batch holds one visit's record at least). Each
# visit's record is cut at its own cutoff, so one record whose visits all follow a stay still open (a stay spanning
# years of visits) is cut once per visit, its rows growing with the square of its visits: one train patient with
# 2,000 daily visits in such a stay took a training's peak to 6.3 GB when all were cut at once.
CUT_BATCH_EVENTS = 1_000_000


def register_records(con: duckdb.DuckDBPyConnection, events: pl.DataFrame, key: str) -> None:
    """`events` as the relation `rec` that `encounter_starts_sql` and `pretarget_sql` read: `record` is the key,
    `subject_id` numbers the records and `encounter_id` the encounters of each record in their order,
    `source_encounter_id` is the event's own encounter id.

    Records keyed by subject keep their ids: encounter ids are unique across a dataset (`validate_meds_dir`).
    Records of trajectories are numbered: two trajectories of one patient (target rule `every`) share
    encounters whose events each record cuts at its own time.
    """
    con.register("frame", events)
    numeric = "numeric_value" if "numeric_value" in events.columns else "NULL::FLOAT"
    text = "text_value" if "text_value" in events.columns else "NULL::VARCHAR"
    ids = ("subject_id, encounter_id" if key == "subject_id" else
           f"dense_rank() OVER (ORDER BY {key}) AS subject_id, CASE WHEN encounter_id IS NOT NULL "
           f"THEN dense_rank() OVER (ORDER BY {key}, encounter_id) END AS encounter_id")
    # A view: a train chunk's events are read where they lie, not copied.
    con.execute(f"""CREATE TEMP VIEW rec AS SELECT {key} AS record, {ids}, encounter_id AS source_encounter_id,
                    time, code, {numeric} AS numeric_value, {text} AS text_value FROM frame""")


def unserved_visits(events: pl.DataFrame, key: str) -> pl.DataFrame:
    """(key, encounter_id, last) of each visit whose predecessors in its record's sequence are not its
    pre-target view; `last` when it is the record's last visit.

    The visits and their order are `visit_tensors`'s and `visit_diagnoses`'s (encounters with a diagnosis and a
    dated event, by first dated event, then id), the cutoff a cohort's (`encounter_starts_sql`). A visit's
    predecessors are its pre-target view when each of them ended before its cutoff (`pretarget_sql` keeps events
    before it only) and no later visit began before it (that one's early events would be in the view). A stay
    still open at a visit's admission, such as an admission spanning a shorter stay, has its diagnoses coded at
    its discharge: in the sequence they precede the inner stay, in its pre-target view they do not.
    """
    con = duck.connect()
    try:
        register_records(con, events, key)
        return con.sql(f"""
            WITH starts AS ({cohorts.encounter_starts_sql('rec')}),
            visits AS (
                SELECT encounter_id, any_value(record) AS record, any_value(subject_id) AS subject_id,
                       any_value(source_encounter_id) AS source_encounter_id,
                       min(time) AS first_time, max(time) AS last_time
                FROM rec WHERE encounter_id IS NOT NULL GROUP BY encounter_id
                HAVING bool_or(code LIKE 'DIAGNOSIS//%') AND min(time) IS NOT NULL),
            ordered AS (
                SELECT v.*, s.start_time,
                       max(v.last_time) OVER (PARTITION BY v.subject_id ORDER BY v.first_time, v.encounter_id
                                              ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS earlier_last,
                       lead(v.first_time) OVER (PARTITION BY v.subject_id ORDER BY v.first_time, v.encounter_id)
                           AS next_first
                FROM visits v JOIN starts s USING (encounter_id))
            SELECT record AS {key}, source_encounter_id AS encounter_id, next_first IS NULL AS last FROM ordered
            WHERE earlier_last >= start_time OR next_first < start_time
            ORDER BY {key}, encounter_id""").pl()
    finally:
        con.close()


def cut_record_batches(events: pl.DataFrame, key: str, visits: pl.DataFrame
                       ) -> Iterator[tuple[pl.DataFrame, pl.DataFrame, dict[int, tuple]]]:
    """`cut_records` of the visits (key, encounter_id) of `visits` in batches, in key and encounter order, whose
    records hold about `CUT_BATCH_EVENTS` events in all: the caller reduces each batch's cut records before the next
    is cut, so their memory is bounded by a batch's, not by the sum of every visit's record."""
    ordered = (visits.select(key, "encounter_id").unique().sort(key, "encounter_id")
               .join(events.group_by(key).len("events"), on=key, how="left", maintain_order="left"))
    before = ordered["events"].fill_null(0).cum_sum() - ordered["events"].fill_null(0)
    for _, batch in ordered.with_columns(batch=before // CUT_BATCH_EVENTS).group_by("batch", maintain_order=True):
        yield cut_records(events, key, batch.select(key, "encounter_id"))


def cut_records(events: pl.DataFrame, key: str, visits: pl.DataFrame
                ) -> tuple[pl.DataFrame, pl.DataFrame, dict[int, tuple]]:
    """For each visit (key, encounter_id) of `visits`, numbered `pair`: its record as `pretarget_sql` cuts it at
    the visit's cutoff (pair, time, code, numeric_value, text_value, encounter_id), the visit's own diagnoses
    (pair, code), and each pair's (key value, encounter_id)."""
    con = duck.connect()
    try:
        register_records(con, events.join(visits.select(key).unique(), on=key, how="semi"), key)
        con.register("wanted", visits.select(key, "encounter_id").to_arrow())
        con.execute(f"CREATE TEMP TABLE starts AS {cohorts.encounter_starts_sql('rec')}")
        con.execute(f"""CREATE TEMP TABLE pairs AS
            SELECT DISTINCT r.encounter_id AS trajectory_id, r.subject_id, r.encounter_id AS target_encounter_id,
                   s.start_time AS cutoff_time, r.record, r.source_encounter_id
            FROM rec r JOIN wanted w ON w.{key} = r.record AND w.encounter_id = r.source_encounter_id
            JOIN starts s ON s.encounter_id = r.encounter_id""")
        cut = con.sql(f"""SELECT trajectory_id AS pair, time, code, numeric_value, text_value, encounter_id
                          FROM ({cohorts.pretarget_sql('rec', 'pairs', 'starts')})""").pl()
        label_codes = con.sql("""SELECT DISTINCT p.trajectory_id AS pair, r.code FROM pairs p
                                 JOIN rec r ON r.encounter_id = p.target_encounter_id
                                 WHERE r.code LIKE 'DIAGNOSIS//%'""").pl()
        names = {pair: (record, encounter) for pair, record, encounter in con.execute(
            "SELECT trajectory_id, record, source_encounter_id FROM pairs").fetchall()}
    finally:
        con.close()
    return cut, label_codes, names
