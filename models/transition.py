"""First-order code transitions: diagnoses of the last visit → diagnoses of the next one.

Learned on `train` patients only (consecutive visit pairs of `train_events`; a visit that follows a stay
still open at its admission is paired with the last visit of its pre-target record, the one its forecast
sees, as in `models.pretarget`). For a trajectory the
score of code b is the mean over the last pre-target visit's diagnoses a of P(b in visit t+1 | a in
visit t); codes the table cannot score are padded by train-split frequency below every learned score.
"""

from __future__ import annotations

import duckdb
import polars as pl

from models.pretarget import cut_record_batches, unserved_visits


def sql_frame(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None) -> pl.DataFrame:
    """Run a query on a warehouse connection and return a polars frame (DuckDB 2 relation API)."""
    return con.sql(sql, params=params or None).pl()


def train_diagnosis_frequency(con: duckdb.DuckDBPyConnection, cohort_id: str) -> pl.DataFrame:
    """Ω codes by the number of train-split encounters carrying them (code, count), most frequent first."""
    return sql_frame(con, """
        SELECT e.code, count(DISTINCT e.encounter_id)::DOUBLE AS count
        FROM train_events e JOIN cohort_vocabulary v ON v.cohort_id = e.cohort_id AND v.code = e.code
        WHERE e.cohort_id = ? AND e.code LIKE 'DIAGNOSIS//%'
        GROUP BY e.code ORDER BY count DESC, e.code""", [cohort_id])


def visit_diagnoses(events: pl.DataFrame, key: str) -> pl.DataFrame:
    """(key, visit, code, encounter_id) for diagnosis codes; `visit` numbers a key's encounters by start time
    from 0.

    An encounter starts at its earliest dated event; its undated diagnoses are still its own.
    Encounters without diagnoses are not visits.

    >>> import datetime as dt
    >>> e = pl.DataFrame({"subject_id": [1, 1, 1], "time": [dt.datetime(2020, 1, 2), dt.datetime(2020, 1, 1),
    ...                   dt.datetime(2020, 1, 3)], "code": ["DIAGNOSIS//A", "DIAGNOSIS//B", "LAB//x"],
    ...                   "encounter_id": [20, 10, 10]})
    >>> visit_diagnoses(e, "subject_id").sort("visit").rows()
    [(1, 0, 'DIAGNOSIS//B', 10), (1, 1, 'DIAGNOSIS//A', 20)]
    """
    with_encounter = events.filter(pl.col("encounter_id").is_not_null())
    starts = (with_encounter.filter(pl.col("time").is_not_null())
              .group_by(key, "encounter_id").agg(pl.col("time").min().alias("start")))
    dx = with_encounter.filter(pl.col("code").str.starts_with("DIAGNOSIS//")).select(key, "encounter_id", "code")
    visits = (starts.join(dx.select(key, "encounter_id").unique(), on=[key, "encounter_id"], how="semi")
              .sort(key, "start", "encounter_id")
              .with_columns(pl.int_range(pl.len()).over(key).alias("visit")))
    return (dx.unique().join(visits, on=[key, "encounter_id"])
            .select(key, pl.col("visit").cast(pl.Int64), "code", "encounter_id"))


class Transition:
    """P(next-visit diagnosis | last-visit diagnosis), averaged over the last visit's diagnoses."""

    system = "transition"

    def fit(self, con: duckdb.DuckDBPyConnection, cohort_id: str) -> None:
        self.frequency = train_diagnosis_frequency(con, cohort_id)
        # Only the diagnoses and each encounter's earliest dated event make the visits: reading every event
        # held all lab and medication rows too (2.8 GB peak for 21M train events against 1.6 GB).
        # Admissions too: they are the cutoffs that decide which visit pairs a forecast sees (`unserved_visits`).
        events = sql_frame(con, """SELECT subject_id, time, code, encounter_id FROM train_events
                                   WHERE cohort_id = $1 AND encounter_id IS NOT NULL
                                     AND (code LIKE 'DIAGNOSIS//%' OR code LIKE 'HOSPITAL_ADMISSION//%')
                                   UNION ALL
                                   SELECT subject_id, min(time), '', encounter_id FROM train_events
                                   WHERE cohort_id = $1 AND encounter_id IS NOT NULL AND time IS NOT NULL
                                   GROUP BY subject_id, encounter_id""", [cohort_id])
        omega = sql_frame(con, "SELECT code FROM cohort_vocabulary WHERE cohort_id = ?", [cohort_id])
        visits = visit_diagnoses(events, "subject_id")
        # A pair is keyed by its target visit (subject_id, encounter_id): its Ω diagnoses, and as sources the
        # diagnoses of the last visit its pre-target record holds. That is the previous visit of the sequence,
        # except for a visit after a stay still open at its admission (`unserved_visits`), learned from its record
        # as `pretarget_sql` cuts it there.
        pair = ["subject_id", "encounter_id"]
        targets = visits.join(omega, on="code", how="semi").select(*pair, "code")
        unserved = unserved_visits(events, "subject_id").select(pair)
        sources = (visits.select("subject_id", pl.col("visit") + 1, "code")
                   .join(visits.select("subject_id", "visit", "encounter_id").unique(), on=["subject_id", "visit"])
                   .join(unserved, on=pair, how="anti")
                   .select(*pair, "code"))
        # Cut a batch at a time: only each cut record's last visit is kept (`cut_record_batches`).
        for cut, _, names in cut_record_batches(events, "subject_id", unserved):
            cut_visits = visit_diagnoses(cut, "pair")
            last = cut_visits.filter(pl.col("visit") == pl.col("visit").max().over("pair"))
            target_of = pl.DataFrame([(pair, *names[pair]) for pair in last["pair"].unique().to_list()],
                                     schema={"pair": last.schema["pair"], "subject_id": pl.Int64,
                                             "encounter_id": pl.Int64}, orient="row")
            # Its codes copied: a filtered frame's text points into the buffers of the batch's whole cut, and kept,
            # it held them all (4.2 GB for one patient with 5,000 visits within a stay that spans them).
            codes = pl.Series("code", last["code"].to_list(), dtype=pl.String)
            sources = pl.concat([sources, last.select("pair", codes).join(target_of, on="pair")
                                 .select(sources.columns)])
        # Only sources of a target with Ω diagnoses count in a transition's denominator.
        has_next = sources.join(targets.select(pair).unique(), on=pair, how="semi")
        source_counts = has_next.group_by("code").agg(pl.len().alias("n_source"))
        # Streamed: the join holds every (source, target) code pair of every visit pair before the count, 24.7M
        # rows at 100,000 patients, and held whole it took the fit's peak from 1.6 to 4.3 GB. Their codes are joined
        # and counted as categories, not text: the pairs grow with the product of two visits' diagnoses, and 5 train
        # patients with 300 diagnoses at each of 50 visits made 22M of them: the fit took 45 s at a 1.7 GB peak as
        # text, 16 s at 0.9 GB as categories, with the same table.
        as_category = pl.col("code").cast(pl.Categorical)
        self.table = (has_next.lazy().with_columns(as_category)
                      .join(targets.lazy().with_columns(as_category), on=pair, suffix="_next")
                      .group_by("code", "code_next").agg(pl.len().alias("n_pair"))
                      .with_columns(pl.col("code", "code_next").cast(pl.String))
                      .join(source_counts.lazy(), on="code")
                      .select(pl.col("code").alias("source"), pl.col("code_next").alias("code"),
                              (pl.col("n_pair") / pl.col("n_source")).alias("probability"))
                      .collect(engine="streaming"))

    def predict(self, trajectories: pl.DataFrame, pretarget: pl.DataFrame, k: int) -> pl.DataFrame:
        visits = visit_diagnoses(pretarget, "trajectory_id")
        last = visits.filter(pl.col("visit") == pl.col("visit").max().over("trajectory_id"))
        n_last = last.group_by("trajectory_id").agg(pl.len().alias("n_last"))
        learned = (last.rename({"code": "source"}).join(self.table, on="source")
                   # Summed in value order: the join yields the sources in a different order from run to run, and
                   # a floating sum in that order made equal scores differ in the last bit, swapping their codes.
                   .group_by("trajectory_id", "code").agg(pl.col("probability").sort().sum())
                   .join(n_last, on="trajectory_id")
                   .select("trajectory_id", "code", (pl.col("probability") / pl.col("n_last")).alias("score"),
                           pl.lit(True).alias("native"), pl.lit(0).alias("tier")))
        # Padding scores are negative, so they sit below every learned probability.
        padding = self.frequency.head(k).select(
            "code", (pl.col("count") / (pl.col("count").max() + 1) - 1).alias("score"),
            pl.lit(False).alias("native"), pl.lit(1).alias("tier"))
        candidates = pl.concat([learned, trajectories.select("trajectory_id").join(padding, how="cross")
                                .select(learned.columns)])
        return (candidates.sort(["trajectory_id", "tier", "score", "code"], descending=[False, False, True, False])
                .unique(["trajectory_id", "code"], keep="first", maintain_order=True)
                .with_columns(pl.int_range(1, pl.len() + 1, dtype=pl.Int32).over("trajectory_id").alias("rank"))
                .filter(pl.col("rank") <= k)
                .select("trajectory_id", "rank", "code", "score", "native"))
