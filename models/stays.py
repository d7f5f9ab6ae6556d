"""Which stay an event recorded without an encounter belongs to, as both the EHR prior (`models.prior.data`, whose
stays are its visits) and the readable record of Direct Forecast (`models.llm.history`, whose stays are the
encounters it shows) place it. Polars and DuckDB only: the LLM layer must not import torch to share it.
"""

from __future__ import annotations

import polars as pl

from models.pretarget import register_records
from warehouse import duck
from warehouse.cohorts import encounter_starts_sql


# An event that `within_stays` may place: dated, without an encounter, and no diagnosis.
LOOSE = pl.col("encounter_id").is_null() & pl.col("time").is_not_null() & ~pl.col("code").str.starts_with("DIAGNOSIS//")


def has_loose_events(events: pl.DataFrame) -> bool:
    """Whether `within_stays` would have anything of `events` to place; `stay_spans` (a DuckDB query) is not worth
    running otherwise."""
    return bool(events.select(LOOSE.any()).item())


def stay_spans(events: pl.DataFrame, key: str) -> pl.DataFrame:
    """(key, encounter_id, start, end, n_dx) of each encounter of `events` with a dated own event: the span within
    which an event without an encounter is its own, as the cohort rules it (`encounter_starts_sql`).

    A stay starts at its `claims_from`: its first dated own event, or the untagged ED registration of the visit that
    led into it (the pre-target view cuts a target's record there); it ends at its last dated own event. `events`
    has `key`, `time`, `code` and `encounter_id`.
    """
    con = duck.connect()
    try:
        register_records(con, events, key)
        spans = con.sql(f"""
            SELECT r.record AS {key}, r.source_encounter_id AS encounter_id, s.claims_from AS start,
                   s.last_time AS "end", s.n_dx
            FROM ({encounter_starts_sql('rec')}) s
            JOIN (SELECT DISTINCT record, encounter_id, source_encounter_id FROM rec) r USING (encounter_id)
            WHERE s.claims_from IS NOT NULL ORDER BY ALL""").pl()
    finally:
        con.close()
    return spans.cast({key: events.schema[key], "encounter_id": events.schema["encounter_id"]})


def within_stays(events: pl.DataFrame, key: str, spans: pl.DataFrame) -> pl.DataFrame:
    """The dated non-diagnosis events of `events` without an encounter that fall within a stay, given that stay's
    encounter id. `spans` (key, encounter_id, start, end): each stay's span, `stay_spans` (or, in EHR prior models
    registered before it, each stay's first and last dated own event).

    MEDS-Extract's MIMIC-IV ETL writes every pharmacy order (MEDICATION//START//…, //STOP//…) without its hadm_id,
    and MIMIC leaves it off the ED draws taken before an admission (its ED registration, or its ED transfer row, which
    has it, begins the stay): left out, the prior would see none of those and the record would show them apart from
    their stay. An event within stays nested in one another goes to the stay begun last that holds it: within a long
    stay after a stay nested in it ended, the long stay. A diagnosis stays out: a visit's diagnoses are its
    encounter's coding, its labels. `build_vocabulary` counts the same placement in SQL.
    """
    loose = events.filter(LOOSE).drop("encounter_id").sort("time")
    if loose.is_empty() or spans.is_empty():
        return events.head(0)
    # The stay begun last on or before each event, and how long any stay begun by then lasts (`_open`).
    spans = spans.sort("start", "encounter_id").with_columns(pl.col("end").cum_max().over(key).alias("_open"))
    placed = loose.join_asof(spans, left_on="time", right_on="start", by=key,
                             strategy="backward", check_sortedness=False)  # both sorted by time, so in each group
    # Past that stay's end but within an earlier one that spans it (rare): the latest begun of those that hold it.
    # Such a stay began before the event's stay and ends after that one's end, so it outlasts the start of the stay
    # after it: only those are joined. Every stay of the record was, and one patient's 10,000 untagged labs within a
    # stay that spans 10,000 visits made 10^8 pairs (7.4 GB).
    spanning = spans.filter(pl.col("end") > pl.col("start").shift(-1).over(key))
    outer = (placed.filter((pl.col("time") > pl.col("end")) & (pl.col("time") <= pl.col("_open")))
             .select(loose.columns).with_row_index("_event").join(spanning, on=key)
             .filter((pl.col("start") <= pl.col("time")) & (pl.col("time") <= pl.col("end")))
             .sort("_event", "start", "encounter_id").group_by("_event", maintain_order=True).last())
    return pl.concat([placed.filter(pl.col("time") <= pl.col("end")).select(events.columns),
                      outer.select(events.columns)])
