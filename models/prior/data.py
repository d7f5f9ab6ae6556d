"""From warehouse events to padded visit tensors (the featurization shared by training and inference).

Sources (forecasting store only, through `Warehouse.connect()`):
- training pairs (visits <= t -> diagnoses of visit t+1) from `train_events` (train patients);
- validation pairs from the `tuning` trajectories' pre-target records: the last pre-target visit is
  the label and the earlier visits the input, so no tuning target (gold) is needed or read.
`held_out` is never read here. A pair's input is what forecasting its label visit would see: where the
visits before it hold more than the pre-target view at its cutoff (a stay still open at that admission,
whose diagnoses are coded at its discharge), the pair is made from the record that `pretarget_sql`
cuts there instead (`unserved_visits`, `cut_pairs`).

A visit is an encounter with at least one diagnosis event; it starts at its earliest event. Input
tokens are diagnosis, procedure and medication codes, plus one token per lab and value quintile
(`LAB//…//q0`…`q4`, cut points from train patients' values) and, for a result without a number, per lab and
result text (`LAB//…//NEG`, the texts that train patients' results give often enough); such an event without an
encounter is a token of the visit whose stay holds it (`within_stays`): from its first dated own event, or the ED
registration that led into it, to its last (`stay_spans`, the cohort's rule). A visit's numbers are the
gap since the previous visit and the age (without a MEDS_BIRTH, the train patients' mean age at their visits). A
record's static codes (MEDS rows without a time or an encounter, such as `GENDER//F`) are the patient's
own tokens, embedded apart from the visits and added to each of them. The output vocabulary is the
cohort's Ω restricted to diagnosis codes seen in `train_events`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import duckdb
import numpy as np
import polars as pl
import torch
from torch.utils.data import Dataset

from dxr.errors import InputError
from models.prior.config import PriorConfig
from models.pretarget import cut_record_batches, unserved_visits
from models.stays import has_loose_events, stay_spans, within_stays
from models.transition import sql_frame
from warehouse.cohorts import CLINICAL_PREFIXES, clinical_sql, encounter_starts_sql

TOKEN_PREFIXES = ("DIAGNOSIS//", "PROCEDURE//", "MEDICATION//")  # kept in this order within a visit
LAB_PREFIX = "LAB//"  # lab value tokens come last
LAB_QUANTILES = (0.2, 0.4, 0.6, 0.8)
MICROSECONDS_PER_DAY = 86_400_000_000
PAD, UNKNOWN = 0, 1
# Padded visits per inference batch (`length_batches`): 768 to 1,536 ran the 5k forecast's network fastest.
INFERENCE_BATCH_VISITS = 1024


@dataclass
class Vocabulary:
    input_codes: list[str]  # index i + 2 (0 = padding, 1 = unknown)
    output_codes: list[str]  # index i; padding id = len(output_codes)
    omega: list[str]  # the cohort's Ω, for history codes outside output_codes
    lab_cuts: dict[str, list[float]] = field(default_factory=dict)  # lab code → quintile cut points (train)
    # Age in years of a visit whose patient has no MEDS_BIRTH: the mean age at train visits (0 in models
    # registered before the field, which featurized every such visit at age 0 and still do).
    age_fill: float = 0.0
    # Whether events without an encounter within a visit's stay are its tokens (`within_stays`); False in models
    # registered before, which were trained without them and keep seeing exactly the inputs they learned from.
    within_stays: bool = False
    # Whether a visit's stay begins at the untagged ED registration that led into it (`stay_spans`), so that the ED
    # draws and orders before its first own event are its tokens; False in models registered before, whose stays
    # began at their first own event.
    stays_from_ed_registration: bool = False
    # Lab code → the result texts (`lab_text`) with a token of their own, for results without a number (POSITIVE,
    # NEG, >1000); empty in models registered before, which had no token for such results and keep seeing none.
    lab_texts: dict[str, list[str]] = field(default_factory=dict)

    @property
    def n_input(self) -> int:
        return len(self.input_codes) + 2

    @property
    def n_output(self) -> int:
        return len(self.output_codes)

    def to_json(self) -> dict:
        return {"input_codes": self.input_codes, "output_codes": self.output_codes, "omega": self.omega,
                "lab_cuts": self.lab_cuts, "lab_texts": self.lab_texts, "age_fill": self.age_fill,
                "within_stays": self.within_stays, "stays_from_ed_registration": self.stays_from_ed_registration}

    @cached_property
    def input_ids(self) -> pl.DataFrame:
        """(code, id) of every input code."""
        return pl.DataFrame({"code": self.input_codes, "id": np.arange(2, self.n_input)},
                            schema={"code": pl.String, "id": pl.Int64})

    @cached_property
    def code_ids(self) -> pl.DataFrame:
        """(code, id, out, in_omega) for every input, output and Ω code, null where a code is not an input
        (id) or output (out) code: the one lookup a record's codes are joined with, built once per vocabulary."""
        outputs = pl.DataFrame({"code": self.output_codes, "out": np.arange(self.n_output)},
                               schema={"code": pl.String, "out": pl.Int64})
        omega = pl.DataFrame({"code": self.omega, "in_omega": True}, schema={"code": pl.String, "in_omega": pl.Boolean})
        return (self.input_ids.join(outputs, on="code", how="full", coalesce=True)
                .join(omega, on="code", how="full", coalesce=True)
                .with_columns(pl.col("in_omega").fill_null(False)))

    @cached_property
    def _code_entries(self) -> dict[str, tuple[int, int | None, bool]]:
        """code → (input id, output id or None, in Ω) of every code in `code_ids`, unknown input codes as UNKNOWN."""
        return {code: (UNKNOWN if id_ is None else id_, out, in_omega)
                for code, id_, out, in_omega in self.code_ids.select("code", "id", "out", "in_omega").iter_rows()}

    def token_table(self, codes: pl.Series) -> pl.DataFrame:
        """(code, id, out, in_omega, is_dx, order) of each distinct code of `codes`: its input id (UNKNOWN outside the
        input vocabulary), output id (null outside the output vocabulary), whether it is in Ω and a diagnosis, and its
        rank in the order a visit keeps its codes (`token_rank`, then the code).

        A record's few hundred distinct codes are looked up here instead of joining each of its events with the
        vocabulary (74,731 Ω codes in the 5k cohort), and its events are sorted by an integer rather than a string.

        >>> vocab = Vocabulary(["DIAGNOSIS//a", "MEDICATION//m"], ["DIAGNOSIS//a"], ["DIAGNOSIS//a", "DIAGNOSIS//z"])
        >>> codes = pl.Series(["MEDICATION//m", "DIAGNOSIS//z", "LAB//x//q1", "DIAGNOSIS//a", "MEDICATION//m"])
        >>> for row in vocab.token_table(codes).iter_rows():
        ...     print(row)
        ('DIAGNOSIS//a', 2, 0, True, True, 0)
        ('DIAGNOSIS//z', 1, None, True, True, 1)
        ('MEDICATION//m', 3, None, False, False, 2)
        ('LAB//x//q1', 1, None, False, False, 3)
        """
        table = pl.DataFrame([(code, *self._code_entries.get(code, (UNKNOWN, None, False)))
                              for code in codes.unique().to_list()],
                             schema={"code": pl.String, "id": pl.Int64, "out": pl.Int64, "in_omega": pl.Boolean},
                             orient="row")
        return (table.with_columns(pl.col("code").str.starts_with("DIAGNOSIS//").alias("is_dx"),
                                   token_rank(pl.col("code")).alias("kind_rank"))
                .sort("kind_rank", "code").select(pl.exclude("kind_rank"), pl.int_range(pl.len()).alias("order")))


def build_vocabulary(con: duckdb.DuckDBPyConnection, cohort_id: str, min_code_count: int) -> Vocabulary:
    """Vocabularies from train patients only (counts of encounters carrying each code; of patients
    carrying each static code)."""
    prefixes = " OR ".join(f"code LIKE '{p}%'" for p in TOKEN_PREFIXES)
    # The encounters a code's events belong to, or for an event without one the visit whose stay (`stay_spans`)
    # holds it, as `within_stays` places it: of the stays open at its time, the one begun last.
    records = "(SELECT subject_id, time, code, encounter_id FROM train_events WHERE cohort_id = $1)"
    inputs = sql_frame(con, f"""
        WITH visits AS (
            SELECT subject_id, encounter_id, claims_from AS start, last_time
            FROM ({encounter_starts_sql(records)}) WHERE n_dx > 0 AND claims_from IS NOT NULL),
        loose AS (
            SELECT row_number() OVER () AS event, subject_id, time, code FROM train_events
            WHERE cohort_id = $1 AND encounter_id IS NULL AND time IS NOT NULL AND code NOT LIKE 'DIAGNOSIS//%'
              AND ({prefixes})),
        placed AS (
            SELECT l.code, v.encounter_id FROM loose l
            JOIN visits v ON v.subject_id = l.subject_id AND v.start <= l.time AND l.time <= v.last_time
            QUALIFY row_number() OVER (PARTITION BY l.event ORDER BY v.start DESC, v.encounter_id DESC) = 1),
        coded AS (
            SELECT code, encounter_id FROM train_events
            WHERE cohort_id = $1 AND encounter_id IS NOT NULL AND ({prefixes})
            UNION ALL
            SELECT code, encounter_id FROM placed)
        SELECT code FROM coded GROUP BY code HAVING count(DISTINCT encounter_id) >= $2 ORDER BY code""",
                       [cohort_id, min_code_count])["code"].to_list()
    static = sql_frame(con, f"""SELECT code FROM train_events
                                WHERE cohort_id = ? AND time IS NULL AND encounter_id IS NULL
                                  AND NOT {clinical_sql('code')}
                                GROUP BY code HAVING count(DISTINCT subject_id) >= ? ORDER BY code""",
                       [cohort_id, min_code_count])["code"].to_list()
    omega = sql_frame(con, "SELECT code FROM cohort_vocabulary WHERE cohort_id = ? ORDER BY code",
                      [cohort_id])["code"].to_list()
    outputs = sql_frame(con, """SELECT DISTINCT e.code FROM train_events e
                                JOIN cohort_vocabulary v ON v.cohort_id = e.cohort_id AND v.code = e.code
                                WHERE e.cohort_id = ? AND e.code LIKE 'DIAGNOSIS//%' ORDER BY e.code""",
                        [cohort_id])["code"].to_list()
    if not outputs:
        raise InputError(f"cohort {cohort_id}: train_events hold no diagnosis code of the cohort vocabulary; "
                         "rebuild the cohort so that it has train-split patients with diagnoses")
    cuts = sql_frame(con, f"""SELECT code, quantile_cont(numeric_value, {list(LAB_QUANTILES)}) AS cuts
                              FROM train_events WHERE cohort_id = ? AND code LIKE '{LAB_PREFIX}%'
                                AND numeric_value IS NOT NULL AND isfinite(numeric_value)
                              GROUP BY code HAVING count(*) >= ? ORDER BY code""", [cohort_id, min_code_count])
    lab_cuts = {code: [float(c) for c in values] for code, values in cuts.iter_rows()}
    lab_tokens = [f"{code}//q{q}" for code in lab_cuts for q in range(len(LAB_QUANTILES) + 1)]
    # Texts are counted as raw values first: far fewer distinct values than results, normalized in one place.
    texts = (sql_frame(con, f"""SELECT code, text_value, count(*) AS n FROM train_events
                                WHERE cohort_id = ? AND code LIKE '{LAB_PREFIX}%' AND text_value IS NOT NULL
                                  AND (numeric_value IS NULL OR NOT isfinite(numeric_value))
                                GROUP BY ALL""", [cohort_id])
             .with_columns(lab_text(pl.col("text_value")).alias("text")).filter(pl.col("text") != "")
             .group_by("code", "text").agg(pl.col("n").sum()).filter(pl.col("n") >= min_code_count)
             .group_by("code").agg(pl.col("text").sort()).sort("code"))
    lab_texts = dict(texts.iter_rows())
    lab_tokens += [f"{code}//{text}" for code, values in lab_texts.items() for text in values]
    return Vocabulary(sorted(set(inputs + static + lab_tokens)), outputs, omega, lab_cuts,
                      mean_visit_age(con, cohort_id), lab_texts=lab_texts, within_stays=True,
                      stays_from_ed_registration=True)


def lab_text(text: pl.Expr) -> pl.Expr:
    """A lab result's text as its token spells it: single spaces, upper case, `//` (the code separator) as `/`; empty
    for MIMIC-IV's de-identification mask (`___`, the result's words being in `comments`), which says nothing.

    >>> pl.DataFrame({"t": ["  Positive\t(see  comment)", " ___ "]}).select(lab_text(pl.col("t")))["t"].to_list()
    ['POSITIVE (SEE COMMENT)', '']
    """
    return (text.str.replace_all(r"\s+", " ").str.strip_chars(" ").str.to_uppercase()
            .str.replace_all("//", "/", literal=True).str.replace(r"^_+$", ""))


def mean_visit_age(con: duckdb.DuckDBPyConnection, cohort_id: str) -> float:
    """Mean age in years at the visits of train patients with a MEDS_BIRTH (0 when none has one), each visit
    starting at its first dated event as in `visit_tensors`.

    A real export may lack the birth of some patients: at age 0 they would look like newborns, far from
    every adult the network learned from; at the mean they look like a typical patient.
    """
    # The ages are summed as whole microseconds: exact, so the mean is the same bits whatever order DuckDB's threads
    # add them in (a sum of float ages was not, and a retraining on the same data got another `age_fill`). A birth
    # without a time gives no age (`visit_tensors` fills its visits' as a missing birth's), so it is not counted.
    [(total_us, visits)] = con.execute("""
        WITH births AS (SELECT subject_id, min(time) AS birth FROM train_events
                        WHERE cohort_id = ? AND code = 'MEDS_BIRTH' GROUP BY subject_id),
             visits AS (SELECT subject_id, min(time) AS start FROM train_events
                        WHERE cohort_id = ? AND encounter_id IS NOT NULL GROUP BY subject_id, encounter_id
                        HAVING bool_or(code LIKE 'DIAGNOSIS//%') AND min(time) IS NOT NULL)
        SELECT sum(epoch_us(start) - epoch_us(birth))::HUGEINT, count(birth)
        FROM visits JOIN births USING (subject_id)""",
        [cohort_id, cohort_id]).fetchall()
    return 0.0 if not visits else int(total_us) / visits / MICROSECONDS_PER_DAY / 365.25


def lab_value_tokens(labs: pl.DataFrame, lab_cuts: dict[str, list[float]],
                     lab_texts: dict[str, list[str]] | None = None) -> pl.DataFrame:
    """Lab rows (…, code, numeric_value[, text_value]) → the same rows with code `{lab}//q{quintile}`, or for a
    result without a finite number whose text is one of `lab_texts`, `{lab}//{text}` (`lab_text`); other rows
    dropped.

    >>> rows = pl.DataFrame({"code": ["LAB//k//u"] * 6, "numeric_value": [1.0, 5.0, 9.0, None, float("nan"),
    ...                                                                     float("inf")]})
    >>> lab_value_tokens(rows, {"LAB//k//u": [2.0, 4.0, 6.0, 8.0]})["code"].to_list()
    ['LAB//k//u//q0', 'LAB//k//u//q2', 'LAB//k//u//q4']
    >>> rows = rows.with_columns(pl.Series("text_value", [None, None, None, "neg", "Pos", "free text"]))
    >>> lab_value_tokens(rows, {"LAB//k//u": [2.0, 4.0, 6.0, 8.0]}, {"LAB//k//u": ["NEG", "POS"]})["code"].to_list()
    ['LAB//k//u//q0', 'LAB//k//u//q2', 'LAB//k//u//q4', 'LAB//k//u//NEG', 'LAB//k//u//POS']
    """
    texts = lab_value_texts(labs, lab_texts or {})
    if not lab_cuts or labs.is_empty():
        return texts
    cuts = pl.DataFrame({"code": list(lab_cuts), **{f"cut{i}": [c[i] for c in lab_cuts.values()]
                                                    for i in range(len(LAB_QUANTILES))}})
    # Non-finite values have no quintile (the cut points leave them out too); NaN would compare above every cut.
    binned = labs.filter(pl.col("numeric_value").is_finite()).join(cuts, on="code")
    quintile = pl.sum_horizontal((pl.col("numeric_value") > pl.col(f"cut{i}")).cast(pl.Int32)
                                 for i in range(len(LAB_QUANTILES)))
    binned = binned.with_columns(pl.format("{}//q{}", "code", quintile).alias("code")).select(labs.columns)
    return pl.concat([binned, texts]) if texts.height else binned


def lab_value_texts(labs: pl.DataFrame, lab_texts: dict[str, list[str]]) -> pl.DataFrame:
    """The rows of `lab_value_tokens` for results without a finite number: code `{lab}//{text}`."""
    if not lab_texts or labs.is_empty() or "text_value" not in labs.columns:
        return labs.head(0)
    known = pl.DataFrame([(code, text) for code, values in lab_texts.items() for text in values],
                         schema={"code": pl.String, "_text": pl.String}, orient="row")
    return (labs.filter(pl.col("numeric_value").is_null() | ~pl.col("numeric_value").is_finite())
            .with_columns(lab_text(pl.col("text_value")).alias("_text")).join(known, on=["code", "_text"])
            .with_columns(pl.format("{}//{}", "code", "_text").alias("code")).select(labs.columns))


def token_rank(code: pl.Expr) -> pl.Expr:
    """0 diagnosis, 1 procedure, 2 medication, 3 lab value: the order in which a visit keeps its codes.

    >>> pl.select(token_rank(pl.lit("MEDICATION//aspirin"))).item()
    2
    """
    rank = pl.lit(len(TOKEN_PREFIXES), dtype=pl.Int8)
    for i, prefix in reversed(list(enumerate(TOKEN_PREFIXES))):
        rank = pl.when(code.str.starts_with(prefix)).then(pl.lit(i, dtype=pl.Int8)).otherwise(rank)
    return rank


@dataclass
class RaggedIds:
    """Output ids of each (sequence, visit), stored flat in sequence, visit and slot order, and padded per batch
    only (`dense`): to the widest visit of the batch's sequences, not of every sequence.

    As one (N, V, D) tensor, D was the widest visit of all: one train patient's visit coded with 2,000 diagnoses (an
    export that files a problem list under one encounter) padded every visit of the 8,000 training sequences of a
    10,000-patient cohort to 2,000 slots, and training one epoch peaked at 5.5 GB instead of 1.3 GB. Stored flat they
    cost what the records hold.

    >>> ids = RaggedIds.from_entries(torch.tensor([1, 0, 1]), torch.tensor([0, 1, 0]), torch.tensor([5, 6, 7]),
    ...                              n=2, visits=2, pad=9)
    >>> ids.counts.tolist(), ids.dense().tolist()
    ([[0, 1], [2, 0]], [[[9, 9], [6, 9]], [[5, 7], [9, 9]]])
    >>> ids.dense(torch.tensor([0])).tolist()  # padded to its own widest visit
    [[[9], [6]]]
    """

    ids: torch.Tensor  # (M,) output ids, int32
    counts: torch.Tensor  # (N, V) ids of each visit
    pad: int  # the padding id of `dense`: the number of output codes

    @staticmethod
    def from_entries(row: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor, n: int, visits: int,
                     pad: int) -> RaggedIds:
        """From 1-D (row, visit position, id) entries in any order of visits; within a visit they keep their order."""
        cell = row.long() * visits + pos.long()
        order = torch.argsort(cell, stable=True)
        counts = torch.bincount(cell, minlength=n * visits).reshape(n, visits)
        return RaggedIds(ids[order].to(torch.int32), counts, pad)

    def __len__(self) -> int:
        return self.counts.shape[0]

    @property
    def visits(self) -> int:
        return self.counts.shape[1]

    def entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row, visit position, slot within the visit, id) of every id."""
        sizes = self.counts.reshape(-1)
        cell = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
        slot = torch.arange(len(self.ids)) - (torch.cumsum(sizes, 0) - sizes)[cell]
        return cell // self.visits, cell % self.visits, slot, self.ids

    def select(self, rows: torch.Tensor) -> RaggedIds:
        """The sequences `rows` (1-D int64), in that order."""
        per_row = self.counts.sum(1)
        sizes = per_row[rows]
        starts = (torch.cumsum(per_row, 0) - per_row)[rows]
        # The k-th id of the selection is at its row's start in `ids` plus k less the ids of the rows selected before.
        shift = torch.repeat_interleave(starts - (torch.cumsum(sizes, 0) - sizes), sizes)
        index = shift + torch.arange(int(sizes.sum()))
        return RaggedIds(self.ids[index], self.counts[rows], self.pad)

    def dense(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(N, V, D) int32 ids of the sequences `rows` (default: all), padded with `pad`; D is their widest visit."""
        part = self if rows is None else self.select(rows)
        widest = int(part.counts.max()) if part.counts.numel() else 0
        out = torch.full((len(part), part.visits, max(1, widest)), part.pad, dtype=torch.int32)
        row, pos, slot, ids = part.entries()
        out[row, pos, slot] = ids
        return out

    @staticmethod
    def concat(parts: list[RaggedIds]) -> RaggedIds:
        """The sequences of `parts` in order, with as many visits as the most of them (the others' empty)."""
        V = max(part.visits for part in parts)
        return RaggedIds(torch.cat([part.ids for part in parts]),
                         torch.cat([torch.nn.functional.pad(part.counts, [0, V - part.visits]) for part in parts]),
                         parts[0].pad)


@dataclass
class VisitTensors:
    """Padded per-sequence tensors (N sequences, V visits, C codes), and the diagnoses of each visit."""

    keys: list  # sequence key (subject_id or trajectory_id), row order
    codes: torch.Tensor  # (N, V, C) input ids, 0 = padding; int32 (`trim` widens a batch to int64)
    numeric: torch.Tensor  # (N, V, 2) log1p(gap days) / 5, age / 100 years
    static: torch.Tensor  # (N, S) input ids of the record's static codes (sex, …), 0 = padding; int32
    lengths: torch.Tensor  # (N,) real visits, >= 1
    dx: RaggedIds  # (N, V) visits' output ids (`dx.dense()`: (N, V, D) padded with O, int32 like `codes`)
    history: pl.DataFrame  # (row, code) Ω diagnosis codes in the record that are not output codes
    # (N, V) bool: the visits that may be the training target of the visits before them (see `visit_losses`)
    targets: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.keys)


def visit_tensors(events: pl.DataFrame, key: str, vocab: Vocabulary, cfg: PriorConfig,
                  keys: list | None = None, unserved: pl.DataFrame | None = None) -> VisitTensors:
    """Turn events (key, time, code, encounter_id) into the most recent `max_visits` visits per key.

    `keys` fixes the row order and keeps keys without any visit (they get one empty visit so the
    model still scores them from age-free defaults and the generative head). V is the longest kept
    record, so short records are not padded to `max_visits`. With `unserved` (key, encounter_id), the
    result's `targets` marks every real visit but those.
    """
    C = cfg.max_codes_per_visit
    # An encounter's events belong to its visit whether dated or not (a source may keep diagnoses
    # undated: the cohort counts them as history); the visit starts at its earliest dated event.
    in_encounter = events.filter(pl.col("encounter_id").is_not_null())
    spans = (in_encounter.filter(pl.col("time").is_not_null())
             .group_by(key, "encounter_id").agg(pl.col("time").min().alias("start"), pl.col("time").max().alias("end")))
    with_dx = (in_encounter.filter(pl.col("code").str.starts_with("DIAGNOSIS//"))
               .select(key, "encounter_id").unique())
    spans = spans.join(with_dx, on=[key, "encounter_id"], how="semi")
    # Only token kinds are worth placing: a birth or an ED registration without an encounter, in every record, would
    # otherwise run `stay_spans` (a DuckDB query) for records with nothing to place.
    placeable = events.filter(pl.any_horizontal(pl.col("code").str.starts_with(prefix)
                                                for prefix in (*TOKEN_PREFIXES, LAB_PREFIX)))
    if vocab.within_stays and has_loose_events(placeable):
        stays = (stay_spans(events, key).filter(pl.col("n_dx") > 0) if vocab.stays_from_ed_registration
                 else spans)
        in_encounter = pl.concat([in_encounter, within_stays(placeable, key, stays)])
    visits = (spans.drop("end").sort(key, "start", "encounter_id")
              .with_columns(pl.int_range(pl.len(), dtype=pl.Int64).over(key).alias("visit"),
                            pl.len().over(key).cast(pl.Int64).alias("n_visits")))
    V = max(1, min(cfg.max_visits, int(visits["n_visits"].max() or 0)))
    visits = visits.with_columns(
        (pl.col("visit") - (pl.col("n_visits") - V).clip(lower_bound=0)).alias("pos"),
        ((pl.col("start") - pl.col("start").shift(1).over(key)).dt.total_hours() / 24).fill_null(0.0).alias("gap"),
    ).filter(pl.col("pos") >= 0)
    if keys is None:
        keys = visits[key].unique().sort().to_list()
    rows = pl.DataFrame({key: keys, "row": np.arange(len(keys))},
                        schema={key: visits.schema[key] if visits.height else events.schema[key], "row": pl.Int64})
    visits = visits.join(rows, on=key)
    birth = (events.filter(pl.col("code") == "MEDS_BIRTH").group_by(key).agg(pl.col("time").min().alias("birth")))
    visits = visits.join(birth, on=key, how="left").with_columns(
        ((pl.col("start") - pl.col("birth")).dt.total_days() / 365.25).fill_null(vocab.age_fill).alias("age"))

    n = len(keys)
    numeric = np.zeros((n, V, 2), dtype=np.float32)
    lengths = np.ones(n, dtype=np.int64)
    if visits.height:
        r, p = visits["row"].to_numpy(), visits["pos"].to_numpy()
        numeric[r, p, 0] = np.log1p(np.maximum(visits["gap"].to_numpy(), 0.0)) / 5.0
        numeric[r, p, 1] = visits["age"].to_numpy() / 100.0
        lengths_frame = visits.group_by("row").agg(pl.col("pos").max() + 1)
        lengths[lengths_frame["row"].to_numpy()] = lengths_frame["pos"].to_numpy()

    coded = in_encounter.filter(pl.any_horizontal(pl.col("code").str.starts_with(p) for p in TOKEN_PREFIXES))
    if "numeric_value" in in_encounter.columns:
        labs = lab_value_tokens(in_encounter.filter(pl.col("code").str.starts_with(LAB_PREFIX)), vocab.lab_cuts,
                                vocab.lab_texts)
        coded = pl.concat([coded, labs])
    tokens = (coded.select(key, "encounter_id", "code")
              .join(visits.select(key, "encounter_id", "row", "pos"), on=[key, "encounter_id"]))
    table = vocab.token_table(tokens["code"])  # in `order`: row i is the code of order i
    # Each (visit, code) once as one integer, (row × V + pos) × |table| + order, sorted: a visit's codes in the order it
    # keeps them, labs last, then medications, then procedures, as truncation to max_codes_per_visit drops them. (Over
    # one integer column, polars found and sorted 50,000 of them in 1.6 ms, over (row, pos, order) in 12.5 ms.)
    width = max(1, table.height)
    keyed = (tokens.join(table.select("code", "order"), on="code")
             .select(((pl.col("row") * V + pl.col("pos")) * width + pl.col("order")).unique().sort())
             .to_series().to_numpy())
    visit, order = np.divmod(keyed, width)
    row, pos = np.divmod(visit, V)
    starts = np.flatnonzero(np.r_[True, visit[1:] != visit[:-1]])  # each visit's first entry
    slot = np.arange(len(keyed)) - np.repeat(starts, np.diff(np.r_[starts, len(keyed)]))
    codes = np.zeros((n, V, C), dtype=np.int32)
    kept = slot < C
    codes[row[kept], pos[kept], slot[kept]] = table["id"].to_numpy()[order[kept]]

    out = table["out"].fill_null(-1).to_numpy()[order]
    is_output = out >= 0
    dx = RaggedIds.from_entries(*(torch.from_numpy(values[is_output]) for values in (row, pos, out)), n, V,
                                vocab.n_output)
    # Ω diagnoses the model has no output for, which `predict` scores from the history
    no_output = table.select(pl.col("is_dx") & pl.col("out").is_null() & pl.col("in_omega")).to_series().to_numpy()
    copied = no_output[order]
    unseen = pl.DataFrame({"row": row[copied], "pos": pos[copied], "code": table["code"].gather(order[copied])})
    targets = None
    if unserved is not None:
        targets = np.zeros((n, V), dtype=bool)
        served = visits.join(unserved.select(key, "encounter_id"), on=[key, "encounter_id"], how="anti")
        targets[served["row"].to_numpy(), served["pos"].to_numpy()] = True
        targets = torch.from_numpy(targets)
    return VisitTensors(keys, torch.from_numpy(codes), torch.from_numpy(numeric),
                        static_ids(events, key, rows, vocab.input_ids), torch.from_numpy(lengths),
                        dx, unseen, targets)


def static_ids(events: pl.DataFrame, key: str, rows: pl.DataFrame, input_ids: pl.DataFrame) -> torch.Tensor:
    """(N, S) input ids of each row's static codes (events without a time or an encounter), padded with 0.

    A static code outside the input vocabulary is left out rather than mapped to the unknown token:
    it tells the model nothing, and a network trained before static codes were used has none in its
    vocabulary, so it sees exactly the inputs it was trained on.
    """
    # An undated event of an encounter is no fact of the patient: as a static code a later visit's
    # diagnosis would reach the inputs of every earlier visit of a training record. Nor is an undated clinical
    # event without an encounter (a problem list taken at extraction): the pre-target view leaves it out.
    static = (events.filter(pl.col("time").is_null() & pl.col("encounter_id").is_null()
                            & ~pl.any_horizontal(pl.col("code").str.starts_with(p) for p in CLINICAL_PREFIXES))
              .select(key, "code").unique()
              .join(rows, on=key).join(input_ids, on="code").sort("row", "id")
              .with_columns(pl.int_range(pl.len()).over("row").alias("slot")))
    ids = np.zeros((rows.height, int(static["slot"].max()) + 1 if static.height else 1), dtype=np.int32)
    ids[static["row"].to_numpy(), static["slot"].to_numpy()] = static["id"].to_numpy()
    return torch.from_numpy(ids)


def input_config(cfg: PriorConfig) -> PriorConfig:
    """`cfg` for the inputs of a pair or a forecast: the most recent max_visits - 1 visits.

    A training sequence holds at most max_visits visits (the positions the network embeds), its last one
    only ever a target: no loss trains position max_visits - 1 as an input (only the router losses move it).
    """
    return cfg.model_copy(update={"max_visits": cfg.max_visits - 1})


def drop_last_visit(t: VisitTensors, n_output: int) -> tuple[VisitTensors, RaggedIds]:
    """Inputs without each sequence's last visit, and that visit's output ids (N, 1) as labels.

    Only sequences with at least two visits are kept, and with `t.targets` only those whose last visit
    may be the target of the visits before it.
    """
    last_ok = torch.ones_like(t.lengths, dtype=torch.bool) if t.targets is None else \
        t.targets[torch.arange(len(t.lengths)), t.lengths - 1]
    keep = torch.nonzero((t.lengths >= 2) & last_ok).squeeze(1)
    lengths = t.lengths[keep] - 1
    V = t.codes.shape[1]
    visible = (torch.arange(V)[None, :] < lengths[:, None])  # (N', V)
    codes = t.codes[keep] * visible[:, :, None]
    numeric = t.numeric[keep] * visible[:, :, None]
    row, pos, _, ids = t.dx.select(keep).entries()
    last, before = pos == lengths[row], pos < lengths[row]
    labels = RaggedIds.from_entries(row[last], torch.zeros_like(row[last]), ids[last], len(keep), 1, n_output)
    dx = RaggedIds.from_entries(row[before], pos[before], ids[before], len(keep), V, n_output)
    return VisitTensors([t.keys[i] for i in keep.tolist()], codes, numeric, t.static[keep], lengths, dx,
                        t.history.head(0)), labels


class SequenceDataset(Dataset):
    """Sequences, with their labels for validation pairs, served a batch at a time: a DataLoader calls
    `__getitems__` once per batch, which pads `dx` and `labels` to the batch's widest visit, and keeps the batch as
    it comes (`collate_fn=SequenceDataset.collate`)."""

    def __init__(self, tensors: VisitTensors, labels: RaggedIds | None = None):
        self.t, self.labels = tensors, labels

    def __len__(self) -> int:
        return len(self.t)

    def __getitems__(self, rows: list[int]) -> dict[str, torch.Tensor]:
        index = torch.tensor(rows, dtype=torch.int64)
        batch = {"codes": self.t.codes[index], "numeric": self.t.numeric[index], "static": self.t.static[index],
                 "lengths": self.t.lengths[index], "dx": self.t.dx.dense(index)}
        if self.t.targets is not None:
            batch["targets"] = self.t.targets[index]
        if self.labels is not None:
            batch["labels"] = self.labels.dense(index)[:, 0]  # (B, D)
        return batch

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {name: values[0] for name, values in self.__getitems__([i]).items()}

    @staticmethod
    def collate(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return batch


def train_subject_ranges(con: duckdb.DuckDBPyConnection, cohort_id: str, max_patients: int | None,
                         chunk: int) -> list[tuple[int, int]]:
    """Train patients in ascending subject_id, cut into (first, last) id ranges of `chunk` patients
    (the first `max_patients` only, when set)."""
    limit = "" if max_patients is None else f"LIMIT {int(max_patients)}"
    ids = sql_frame(con, f"""SELECT DISTINCT subject_id FROM train_events WHERE cohort_id = ?
                             ORDER BY subject_id {limit}""", [cohort_id])["subject_id"].to_numpy()
    return [(int(ids[i]), int(ids[min(i + chunk, len(ids)) - 1])) for i in range(0, len(ids), chunk)]


def load_training_events(con: duckdb.DuckDBPyConnection, cohort_id: str, first: int, last: int) -> pl.DataFrame:
    """Events of the train patients with first <= subject_id <= last (train_events hold the full
    records of train patients only, the one split whose full records the forecasting store holds)."""
    return sql_frame(con, """SELECT subject_id, time, code, numeric_value, text_value, encounter_id FROM train_events
                             WHERE cohort_id = ? AND subject_id BETWEEN ? AND ?""", [cohort_id, first, last])


def training_sequences(con: duckdb.DuckDBPyConnection, cohort_id: str, vocab: Vocabulary, cfg: PriorConfig
                       ) -> tuple[VisitTensors, int]:
    """Tensors of every train patient with at least two visits (a pair needs a next visit), and the
    number of train patients with at least one visit; InputError when no patient has two visits.

    A visit whose predecessors in the patient's sequence are not its pre-target view (`unserved_visits`)
    is no target there (`targets`); its pair follows the patient's sequence as one of its own: the record
    cut at the visit's cutoff (`cut_pairs`), then the visit, the only target of that sequence.

    Featurized `cfg.featurize_chunk_patients` patients at a time: the events frame and its joins
    are what costs memory, so only one chunk's exist at once; the chunks' tensors are padded to
    the widest chunk and concatenated in subject order (the result equals featurizing all at once).
    """
    parts, n_patients = [], 0
    for first, last in train_subject_ranges(con, cohort_id, cfg.max_train_patients, cfg.featurize_chunk_patients):
        events = load_training_events(con, cohort_id, first, last)
        unserved = unserved_visits(events, "subject_id")
        chunk = visit_tensors(events, "subject_id", vocab, cfg, unserved=unserved)
        n_patients += len(chunk)
        part = select_rows(chunk, torch.nonzero(chunk.lengths >= 2).squeeze(1).tolist())
        if unserved.height:
            cut = pair_sequences(*cut_pairs(events, "subject_id", unserved, vocab, cfg), vocab.n_output)
            part = concat_rows([part, cut])
            # Each cut pair right after its patient's sequence: the order of featurizing all patients at once.
            order = sorted(range(len(part)), key=lambda i: (part.keys[i], 0, 0) if isinstance(part.keys[i], int)
                           else (part.keys[i][0], 1, part.keys[i][1]))
            part = select_rows(part, order)
        parts.append(part)
        del chunk, events
    if not sum(len(t) for t in parts):
        if cfg.max_train_patients is not None:  # the other train patients may have them: say whom training read
            raise InputError(f"cohort {cohort_id}: none of the first {cfg.max_train_patients} train patients "
                             f"(--max-train-patients / prior.max_train_patients) has two visits with diagnoses; "
                             "raise the cap or leave it unset to train on every train patient")
        raise InputError(f"cohort {cohort_id}: no train patient has two visits with diagnoses; "
                         "nothing to learn next-visit transitions from")
    return concat_rows(parts), n_patients


def select_rows(t: VisitTensors, rows: list[int]) -> VisitTensors:
    """The sequences `rows` of `t`, in that order (without `history`, which training does not use)."""
    index = torch.tensor(rows, dtype=torch.int64)
    return VisitTensors([t.keys[i] for i in rows], t.codes[index], t.numeric[index], t.static[index],
                        t.lengths[index], t.dx.select(index), t.history.head(0),
                        None if t.targets is None else t.targets[index])


def concat_rows(parts: list[VisitTensors]) -> VisitTensors:
    """Sequences of several VisitTensors, each padded to the most visits, codes and static codes.

    `targets` are kept when every part has them (a padded visit is no target)."""
    V = max(t.codes.shape[1] for t in parts)
    S = max(t.static.shape[1] for t in parts)

    def padded(x: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.nn.functional.pad(x, [0, 0, 0, V - x.shape[1]], value=fill)

    with_targets = all(t.targets is not None for t in parts)
    return VisitTensors(
        [key for t in parts for key in t.keys],
        torch.cat([padded(t.codes, PAD) for t in parts]),
        torch.cat([padded(t.numeric, 0) for t in parts]),
        torch.cat([torch.nn.functional.pad(t.static, [0, S - t.static.shape[1]], value=PAD) for t in parts]),
        torch.cat([t.lengths for t in parts]),
        RaggedIds.concat([t.dx for t in parts]),
        parts[0].history.head(0),
        torch.cat([torch.nn.functional.pad(t.targets, [0, V - t.targets.shape[1]], value=False) for t in parts])
        if with_targets else None)


def cut_pairs(events: pl.DataFrame, key: str, visits: pl.DataFrame, vocab: Vocabulary, cfg: PriorConfig
              ) -> tuple[VisitTensors, RaggedIds]:
    """For each visit (key, encounter_id) of `visits`: the visit tensors of its record as `pretarget_sql` cuts
    it at the visit's cutoff (what forecasting that visit sees), and the visit's output ids (N, 1) as labels.
    A visit whose cut record holds no visit has no pair. Keys are (key, encounter_id), in key and encounter order.

    The records are cut and featurized a batch at a time (`cut_record_batches`): only a batch's cut records exist
    at once, however many visits one record has to be cut at.
    """
    parts = []
    for cut, label_codes, names in cut_record_batches(events, key, visits):
        # Only the pairs whose cut record has a visit; `pair_sequences` appends the label visit to their inputs.
        inputs = visit_tensors(cut, "pair", vocab, input_config(cfg))
        rows = pl.DataFrame({"pair": inputs.keys, "row": np.arange(len(inputs))},
                            schema={"pair": cut.schema["pair"], "row": pl.Int64})
        labelled = (label_codes.join(vocab.code_ids.select("code", "out").drop_nulls("out"), on="code")
                    .join(rows, on="pair").sort("row", "out"))
        row, out = (torch.tensor(labelled[column].to_numpy()) for column in ("row", "out"))
        labels = RaggedIds.from_entries(row, torch.zeros_like(row), out, len(inputs), 1, vocab.n_output)
        inputs.keys = [names[pair] for pair in inputs.keys]
        inputs.history = inputs.history.clear()  # training reads none; its text would hold the batch's in memory
        parts.append((inputs, labels))
    return concat_rows([inputs for inputs, _ in parts]), RaggedIds.concat([labels for _, labels in parts])


def pair_sequences(inputs: VisitTensors, labels: RaggedIds, n_output: int) -> VisitTensors:
    """Pairs (inputs, labels) as training sequences: the label visit appended after each input record (no
    codes of its own: nothing after it is trained), and the only visit marked as a target."""
    rows = torch.arange(len(inputs))
    row, pos, _, ids = inputs.dx.entries()
    label_row, _, _, label_ids = labels.entries()
    dx = RaggedIds.from_entries(torch.cat([row, label_row]), torch.cat([pos, inputs.lengths[label_row]]),
                                torch.cat([ids, label_ids]), len(inputs), inputs.dx.visits + 1, n_output)
    targets = torch.zeros(len(inputs), dx.visits, dtype=torch.bool)
    targets[rows, inputs.lengths] = True
    return VisitTensors(inputs.keys, torch.nn.functional.pad(inputs.codes, [0, 0, 0, 1], value=PAD),
                        torch.nn.functional.pad(inputs.numeric, [0, 0, 0, 1]), inputs.static, inputs.lengths + 1, dx,
                        inputs.history.head(0), targets)


def validation_pairs(events: pl.DataFrame, key: str, vocab: Vocabulary, cfg: PriorConfig
                     ) -> tuple[VisitTensors, RaggedIds]:
    """One pair per record of `events` (pre-target records): its last visit as labels, the visits before it as
    inputs, or, when those are not its pre-target view (`unserved_visits`), the record cut at its cutoff."""
    unserved = unserved_visits(events, key).filter(pl.col("last"))
    inputs, labels = drop_last_visit(visit_tensors(events, key, vocab, cfg, unserved=unserved), vocab.n_output)
    if unserved.is_empty():
        return inputs, labels
    cut_inputs, cut_labels = cut_pairs(events, key, unserved, vocab, cfg)
    return concat_rows([inputs, cut_inputs]), RaggedIds.concat([labels, cut_labels])


def load_tuning_pretarget(con: duckdb.DuckDBPyConnection, cohort_id: str) -> pl.DataFrame:
    """Pre-target records of `tuning` trajectories (their targets live in the gold store and are not read)."""
    return sql_frame(con, """SELECT p.trajectory_id, p.time, p.code, p.numeric_value, p.text_value, p.encounter_id
                             FROM pretarget_events p
                             JOIN trajectories t ON t.cohort_id = p.cohort_id AND t.trajectory_id = p.trajectory_id
                             WHERE p.cohort_id = ? AND t.split = 'tuning'""", [cohort_id])


def trim(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Cut padding beyond the longest sequence and the fullest visit of the batch, and widen its ids
    to int64 (stored as int32 to halve the resident tensors; indexing ops want int64).

    Codes fill each visit's slots from the front, so slicing the slot axis drops padding only (`dx` comes
    padded to the batch's widest visit already: `RaggedIds.dense`).
    """
    V = int(batch["lengths"].max())
    C = max(1, int((batch["codes"] > 0).sum(-1).max()))
    trimmed = {k: (v[:, :V] if k in ("codes", "numeric", "dx", "targets") else v) for k, v in batch.items()}
    trimmed["codes"] = trimmed["codes"][:, :, :C]
    for ids in ("codes", "static", "dx", "labels"):
        if ids in trimmed:
            trimmed[ids] = trimmed[ids].long()
    return trimmed


def length_batches(lengths: torch.Tensor, max_rows: int,
                   max_visits: int = INFERENCE_BATCH_VISITS) -> list[torch.Tensor]:
    """Row indices (1-D int64) in inference batches: in order of length, each of at most `max_rows` rows holding,
    once padded to its longest row, at most `max_visits` visits (a longer row has a batch of its own).

    A batch costs what its padded visits cost: in row order, the 5k cohort's records of 1 to 23 visits (median 2)
    made padding most of a forecast's network time (docs/ehr-prior.md).

    >>> [batch.tolist() for batch in length_batches(torch.tensor([3, 1, 2, 1, 3]), max_rows=4, max_visits=6)]
    [[1, 3, 2], [0, 4]]
    """
    ordered, order = torch.sort(lengths, stable=True)
    batches, batch = [], []
    for row, length in zip(order.tolist(), ordered.tolist()):  # the batch's longest row is the one added last
        if batch and (len(batch) == max_rows or (len(batch) + 1) * length > max_visits):
            batches.append(torch.tensor(batch))
            batch = []
        batch.append(row)
    if batch:
        batches.append(torch.tensor(batch))
    return batches
