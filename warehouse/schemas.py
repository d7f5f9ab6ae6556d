"""Every warehouse table, declared once: its store, columns and partition keys.

Two stores keep the information boundary by construction: forecasting code opens only the
`forecast` store; the `gold` store (raw MEDS, targets, oracle outputs) is opened only by
evaluation and `dxr sql --with-gold`.

Each table is a directory of Parquet files, one file per partition
(`<table>/<key>=<value>/.../data.parquet`). Partition columns are also stored inside the file,
so a view never depends on path parsing; the path only addresses what a rerun replaces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

import pyarrow as pa

FORECAST = "forecast"
GOLD = "gold"

TS = pa.timestamp("us")


def utc_now() -> datetime:
    """The time to store in a `TS` column: UTC, without a zone (Parquet and DuckDB keep it as written).

    Every table's times are UTC, so a query can compare them across tables (a run's `started_at` with its
    ledger's `retrieved_at`) and with the UTC time in a run id, on a host in any zone.
    """
    return datetime.now(timezone.utc).replace(tzinfo=None)


@dataclass(frozen=True)
class Table:
    name: str
    store: str
    columns: dict[str, pa.DataType]
    partition_by: tuple[str, ...]
    doc: str
    # Columns that may be null; every other column must be filled.
    nullable: frozenset[str] = field(default_factory=frozenset)

    @property
    def schema(self) -> pa.Schema:
        return pa.schema([pa.field(n, t, nullable=n in self.nullable) for n, t in self.columns.items()])


def _t(name, store, columns, partition_by, doc, nullable=()):
    return Table(name, store, columns, tuple(partition_by), doc, frozenset(nullable))


TABLES: dict[str, Table] = {
    t.name: t
    for t in [
        # ---- registry -------------------------------------------------------------------------
        _t("datasets", FORECAST, {
            "dataset_id": pa.string(), "source": pa.string(), "meds_dir": pa.string(),
            "fingerprint": pa.string(), "generator_version": pa.string(), "n_subjects": pa.int64(),
            "n_events": pa.int64(), "icd_versions": pa.string(), "registered_at": TS,
            "time_zone": pa.string(), "utc_offset": pa.string(),
        }, ["dataset_id"], "Registered MEDS datasets (the MEDS files themselves live in the gold store). "
           "`time_zone` and `utc_offset` name the zone(s) and the one UTC offset the source's times were written in, "
           "whose wall-clock times the dataset keeps ('' when they had none; null for datasets registered before "
           "they were recorded). `generator_version` is the version of the synthetic generator that made the files "
           "(its `GENERATOR_VERSION`, such as `synthetic-1.2.0`) for `source` synthetic, by which the demo decides "
           "whether to generate them again; null for every other source (`meds`, `mimic3`, `mimic4`).",
           nullable=["generator_version", "time_zone", "utc_offset"]),
        # ---- vocabularies ---------------------------------------------------------------------
        _t("icd_codes", FORECAST, {
            "code": pa.string(), "icd_version": pa.int8(), "raw_code": pa.string(), "dotted": pa.string(),
            "title": pa.string(), "parent": pa.string(), "chapter": pa.string(), "billable": pa.bool_(),
        }, ["icd_version"], "ICD-10-CM and ICD-9-CM diagnosis codes; `code` is the MEDS code string. Chapters "
           "are rows too, coded by their range (`DIAGNOSIS//ICD//10//I00-I99`, `DIAGNOSIS//ICD//9//390-459`); "
           "`parent` is the code one level up and null only for a chapter, the top of the hierarchy.",
           nullable=["parent", "chapter"]),
        _t("icd_notes", FORECAST, {
            "code": pa.string(), "icd_version": pa.int8(), "kind": pa.string(), "text": pa.string(),
            "inherited_from": pa.string(),
        }, ["icd_version"], "Inclusion terms, excludes1/2, code-first, use-additional, code-also notes; "
           "`inherited_from` names the ancestor a note was inherited from (null when the code's own).",
           nullable=["inherited_from"]),
        _t("gem_map", FORECAST, {
            "direction": pa.string(), "source_code": pa.string(), "target_code": pa.string(),
            "approximate": pa.bool_(), "no_map": pa.bool_(), "combination": pa.bool_(),
            "scenario": pa.int16(), "choice_list": pa.int16(),
        }, ["direction"], "CMS General Equivalence Mappings, `9to10` and `10to9`, MEDS code strings "
           "(target_code is null for NoDx rows).", nullable=["target_code"]),
        # ---- cohorts --------------------------------------------------------------------------
        _t("cohorts", FORECAST, {
            "cohort_id": pa.string(), "dataset_id": pa.string(), "name": pa.string(),
            "target_rule": pa.string(), "harmonization": pa.string(), "min_history": pa.int32(),
            "created_at": TS, "n_trajectories": pa.int64(), "vocabulary_size": pa.int64(),
            "vocabulary_source": pa.string(), "options_json": pa.string(), "dataset_fingerprint": pa.string(),
            "cut_rule_version": pa.int32(),
        }, ["cohort_id"], "One row per cohort; `cohort_id` is a stable hash of dataset and options. "
           "`dataset_fingerprint` is the dataset's `fingerprint` when the cohort was built: which version of its "
           "files it holds, as a dataset registered again (a refreshed extract) gets another (null for cohorts "
           "built before it was recorded). `cut_rule_version` is the version of the rules that cut its "
           "trajectories, targets and pre-target records (`warehouse.cohorts.CUT_RULE_VERSION`; null for cohorts "
           "built before it was recorded): a cohort keeps its cuts until it is built again (a backfill with "
           "`refresh = true` builds it again under its id), and a forecast or a prior's training of one cut by "
           "another version warns.", nullable=["dataset_fingerprint", "cut_rule_version"]),
        _t("cohort_vocabulary", FORECAST, {
            "cohort_id": pa.string(), "code": pa.string(), "icd_version": pa.int8(), "title": pa.string(),
        }, ["cohort_id"], "The cohort's target vocabulary Ω, fixed at build time independently of targets.",
           nullable=["title"]),
        _t("code_titles", FORECAST, {
            "cohort_id": pa.string(), "code": pa.string(), "title": pa.string(),
        }, ["cohort_id"], "Titles of the codes outside Ω (procedures, medications, labs, ..., and diagnoses Ω "
           "lacks) that occur in the cohort's `pretarget_events` or `train_events`: the `description` of the "
           "dataset's `metadata/codes.parquet`, else for a diagnosis its `icd_codes` title (a code with neither "
           "is absent). Code metadata only, no patient rows; the readable H names these codes by them. The "
           "titles of Ω's codes are `cohort_vocabulary`'s."),
        _t("trajectories", FORECAST, {
            "cohort_id": pa.string(), "trajectory_id": pa.string(), "subject_id": pa.int64(),
            "target_encounter_id": pa.int64(), "cutoff_time": TS, "split": pa.string(), "shard": pa.int32(),
            "n_prior_encounters": pa.int32(), "birth_time_imputed": pa.bool_(),
        }, ["cohort_id"], "One row per (patient, target encounter); `trajectory_id` = "
           "`{cohort_id}:{subject_id}:{target_encounter_id}`; a `shard` holds trajectories of one split; "
           "`n_prior_encounters` counts the earlier encounters whose diagnoses the pre-target record holds "
           "(begun and coded before the cutoff). `birth_time_imputed` is true when the patient's `MEDS_BIRTH` row "
           "has `time_imputed` true in the dataset: the MIMIC importers' age above 89 capped at 90, its birth date "
           "moved, so ages computed from it read 90 (false when the dataset has no `time_imputed` column; null for "
           "cohorts built before it was recorded).", nullable=["birth_time_imputed"]),
        _t("pretarget_events", FORECAST, {
            "cohort_id": pa.string(), "trajectory_id": pa.string(), "subject_id": pa.int64(),
            "time": TS, "code": pa.string(), "numeric_value": pa.float32(), "text_value": pa.large_string(),
            "encounter_id": pa.int64(),
        }, ["cohort_id", "shard"], "Materialized pre-target record H of every trajectory (made by one function). "
           "Event times, like `trajectories.cutoff_time`, are the dataset's wall-clock times (the zone its "
           "`datasets` row names), not UTC as the warehouse's own stamps (`runs.started_at`, …). "
           "`time` is null for an event the dataset records without a time: a static fact such as sex "
           "(`GENDER//F`), race or language, in every record of the patient, or an undated event of an encounter "
           "that ended before the target began (an undated diagnosis, procedure, medication, lab or note outside any "
           "encounter, and an undated event of an encounter still open at the target's admission or without any "
           "dated event, are left out: nothing places them before the target). "
           "`encounter_id` is null for an event the dataset records outside any encounter: static facts, the birth "
           "(`MEDS_BIRTH`), outpatient labs, and what an export writes without its admission id (MEDS-Extract's "
           "MIMIC-IV pharmacy orders, emergency-department registrations and draws); such a dated event is kept "
           "only when it precedes the target encounter's own span (its first own event, or the untagged ED "
           "registration that led into it). The column keeps the dataset's null even where the readable H places "
           "the event within a stay.",
           nullable=["time", "numeric_value", "text_value", "encounter_id"]),
        _t("train_events", FORECAST, {
            "cohort_id": pa.string(), "subject_id": pa.int64(), "time": TS, "code": pa.string(),
            "numeric_value": pa.float32(), "text_value": pa.large_string(), "encounter_id": pa.int64(),
        }, ["cohort_id"], "Full records of `train` patients (diagnosis codes harmonized as the cohort's), at "
           "the dataset's wall-clock times as in `pretarget_events`. "
           "`time` and `encounter_id` are null where the dataset's event has none, as in `pretarget_events`; with "
           "no cutoff to apply, every such event is here, the undated clinical events outside any encounter and those "
           "of encounters never dated included.",
           nullable=["time", "numeric_value", "text_value", "encounter_id"]),
        # ---- runs and forecasts ---------------------------------------------------------------
        _t("runs", FORECAST, {
            "run_id": pa.string(), "cohort_id": pa.string(), "kind": pa.string(), "config_json": pa.string(),
            "code_version": pa.string(), "started_at": TS, "finished_at": TS, "status": pa.string(),
            "host": pa.string(), "pid": pa.int64(),
        }, ["run_id", "kind"], "Every producing command registers its run here (`cohort_id` is null for "
           "dataset-level runs such as `synth`, `ingest` and `corpus:ingest`, and for a `cohort` build until it begins "
           "to write its cohort: one failed or killed that names it was cut short midway, one that names none wrote "
           "nothing). `status` is running, finished, failed, killed (the process ended without recording how, e.g. "
           "SIGKILL or out of memory, or a failure it could not record on a full disk; set by the next run that "
           "starts), or stale (a finished fused forecast whose outputs were removed because a forecast it read was run "
           "again into the run; a finished evaluation once any system is forecast into its run, anew or again; or an "
           "evaluation until all its tables are written, so one cut short among its writes stays stale; run it again). "
           "`host` and `pid` are the recording process (null in rows written before they were added); `finished_at` is "
           "null while a run is `running` and once it is `killed`. A mean over repeated runs (`dxr evaluate` with "
           "several --run) is registered under its `config-…` run id (or its --run-id) with kind `evaluate` and the "
           "runs it averages under `runs` in `config_json`, the pairs of means it compares under `pairs` (absent in "
           "means recorded before they were compared). A learned system's forecast records the registered model "
           "version it used under `model` in `config_json`, and every forecast its cohort's `cut_rule_version` under "
           "`cut_rule_version` (absent in forecasts recorded before it was added; an evaluation of a run whose cohort "
           "was built again since says whether the rules differ); a Direct Forecast (`direct`) records its LLM under "
           "`llm_backend`, `llm_model` (the configured name), `llm_model_identity` (which model answered, as in "
           "`llm_calls`), `prompt_versions`, and its request settings `llm_temperature`, `llm_seed`, "
           "`llm_max_output_tokens`, `llm_context_window`, `llm_chars_per_token` (with the window, the history's "
           "budget), `llm_response_format`, `llm_validation_retries` and `llm_max_tokens_field` (the request field "
           "that "
           "carries the output limit) (each absent in runs recorded before it was added). An evaluation (kind "
           "`evaluate`) records the version of the rules that computed it under `evaluation_rule_version` "
           "(`tasks.evaluate.EVALUATION_RULE_VERSION`; absent in evaluations recorded before it was): it keeps its "
           "tables until it is taken again, and the report of one computed by another version says so.",
           nullable=["cohort_id", "finished_at", "host", "pid"]),
        _t("rankings", FORECAST, {
            "run_id": pa.string(), "cohort_id": pa.string(), "system": pa.string(), "trajectory_id": pa.string(),
            "rank": pa.int32(), "code": pa.string(), "score": pa.float64(), "native": pa.bool_(),
        }, ["run_id", "system", "shard"], "Ordered code lists per trajectory, up to K codes (the forecast's `--k`) "
           "but for `direct` and `rrf_prior_direct`, which keep their whole lists (Direct's up to 30 codes after V(.), "
           "their union with the prior's 20: up to 50), of which evaluation scores the first K; `native` is false for "
           "padding. "
           "`score` orders one list and is on its system's own scale, so compare ranks, not scores, across systems: "
           "train-split encounter counts (`global_frequency`), the patient's encounters recording the code "
           "(`repeat_history`, its padding below 1), a transition probability (`transition`, padding negative), "
           "an unnormalized logit (the learned priors), the model's 0-100 confidence (`direct`) or the "
           "reciprocal-rank sum (`rrf_prior_direct`)."),
        _t("candidates", FORECAST, {
            "run_id": pa.string(), "cohort_id": pa.string(), "stage": pa.string(), "system": pa.string(),
            "trajectory_id": pa.string(), "rank": pa.int32(), "code": pa.string(), "score": pa.float64(),
            "history_count": pa.int32(),
        }, ["run_id", "stage", "shard"], "Each forecasting stage's candidate codes per trajectory, in the stage's "
           "order: `candidate_generation` is the EHR prior's pi_F, its top 20 whatever K its rankings hold "
           "(their set is the research seed B), `direct_forecast` Direct's list D (score = its confidence). "
           "`history_count` is the number of pre-target encounters of the trajectory that record the code (0 = new "
           "to the record)."),
        _t("prediction_cache", FORECAST, {
            "system": pa.string(), "cache_key": pa.string(), "key_json": pa.string(), "trajectory_id": pa.string(),
            "rank": pa.int32(), "code": pa.string(), "score": pa.float64(), "native": pa.bool_(),
        }, ["system", "cache_key"], "Ranked lists of a registered model over one shard's trajectories, reused by "
           "any later forecast with the same key. `key_json` holds the key's inputs: system, registered model "
           "version and MLflow run, cohort, shard, K, code version, the torch threads that predicted (scores "
           "summed over other threads round otherwise), and SHA-256 digests of the trajectory ids and of the "
           "shard's pre-target file. Safe to delete at any time (it is only recomputed)."),
        _t("ranking_status", FORECAST, {
            "run_id": pa.string(), "system": pa.string(), "trajectory_id": pa.string(), "status": pa.string(),
            "detail": pa.string(),
        }, ["run_id", "system", "shard"], "Per-trajectory outcome of a system: ok, short or failed. `detail` says "
           "why (how many of the K codes the list kept, what the validator dropped, history truncated to fit the "
           "prompt, the error of a "
           "`failed` list, a fused list's missing input); null when there is nothing to say.",
           nullable=["detail"]),
        _t("metrics", FORECAST, {
            "run_id": pa.string(), "cohort_id": pa.string(), "system": pa.string(), "subset": pa.string(),
            "k": pa.int32(), "metric": pa.string(), "value": pa.float64(), "ci_low": pa.float64(),
            "ci_high": pa.float64(), "n": pa.int64(), "n_runs": pa.int32(),
        }, ["run_id", "system"], "Aggregate forecast metrics with bootstrap 95% intervals. `metric` in "
           "{precision_at_k, recall_at_k, micro_precision, micro_recall, micro_f1, macro_f1} (spec/evaluation.md "
           "§1); `subset` in {all, icd9, icd10, new_onset, repeated, freq_0, freq_1_9, freq_10_99, freq_100plus} "
           "restricts the target codes "
           "(a subset no trajectory has a target code of has no rows; `repeated`: the code is among the trajectory's "
           "pre-target diagnoses; `freq_*`: the number of distinct train-split encounters whose diagnoses in "
           "`train_events` include the code, the count `global_frequency` ranks by, so a code recorded twice in one "
           "stay, or two source codes harmonized to one, counts the stay once and a diagnosis without an encounter "
           "adds nothing); `k` = 0 is the "
           "variable-cardinality version (K = the length of each trajectory's whole list); `n` counts the "
           "trajectories, and the per-trajectory metrics (precision_at_k, recall_at_k, macro_f1) are their means, so "
           "with `--target every` a patient counts once per trajectory (the bootstrap resamples patients); `n_runs` "
           "counts the runs averaged. "
           "`ci_low` and `ci_high` are null when the evaluation ran without a bootstrap (`--bootstrap 0`).",
           nullable=["ci_low", "ci_high"]),
        # ---- gold -----------------------------------------------------------------------------
        _t("targets", GOLD, {
            "cohort_id": pa.string(), "trajectory_id": pa.string(), "code": pa.string(),
        }, ["cohort_id"], "Deduplicated (harmonized) diagnosis codes of each target encounter."),
        _t("oracle_probabilities", GOLD, {
            "cohort_id": pa.string(), "trajectory_id": pa.string(), "code": pa.string(),
            "probability": pa.float64(),
        }, ["cohort_id"], "Synthetic oracle: P(code in Y | latent state at the cutoff), top codes per trajectory."),
        _t("record_oracle_probabilities", GOLD, {
            "cohort_id": pa.string(), "trajectory_id": pa.string(), "code": pa.string(),
            "probability": pa.float64(),
        }, ["cohort_id"], "Synthetic record oracle: the same, from the latent state restricted to the conditions "
                          "the pre-target record reveals (a code or a medication)."),
    ]
}

# The gold-side oracles: no forecast writes their lists; evaluation reads each from its gold table.
ORACLES = {"oracle": "oracle_probabilities", "record_oracle": "record_oracle_probabilities"}  # system → gold table
SYSTEMS = (
    "oracle", "record_oracle", "global_frequency", "repeat_history", "transition", "gru", "dense_prior", "ehr_prior",
    "direct", "rrf_prior_direct", "research_path", "rrf", "full", "web_search_standalone",
    "fixed_pool_ledger", "fixed_pool_no_ledger",
)
METRICS = ("precision_at_k", "recall_at_k", "micro_precision", "micro_recall", "micro_f1", "macro_f1")
RANKING_STATUSES = ("ok", "short", "failed")

# ---- evaluation outputs (appended by the evaluation harness; aggregates only, no gold rows) -------
TABLES.update({
    t.name: t
    for t in [
        _t("evaluation_coverage", FORECAST, {
            "run_id": pa.string(), "cohort_id": pa.string(), "system": pa.string(), "k": pa.int32(),
            "n_trajectories": pa.int64(), "n_short": pa.int64(), "n_failed": pa.int64(), "n_below_k": pa.int64(),
            "native_share": pa.float64(),
        }, ["run_id", "system"], "Per system and K: explicit short/failed trajectories, trajectories with fewer "
           "than K codes, and the share of top-K rows that are native (not padding; null when no trajectory has a "
           "code); k = 0 is the whole list. Under the run id of a mean over repeated runs: the short, failed and "
           "below-K lists counted over all its runs, and the mean of the runs' native shares.",
           nullable=["native_share"]),
        _t("paired_comparisons", FORECAST, {
            "run_id": pa.string(), "cohort_id": pa.string(), "system_a": pa.string(), "system_b": pa.string(),
            "subset": pa.string(), "k": pa.int32(), "metric": pa.string(), "value_a": pa.float64(),
            "value_b": pa.float64(), "difference": pa.float64(), "ci_low": pa.float64(), "ci_high": pa.float64(),
            "n": pa.int64(), "n_improved": pa.int64(), "n_worsened": pa.int64(), "n_tied": pa.int64(),
            "sign_test_p": pa.float64(),
        }, ["run_id"], "Metric difference a - b on the same patients with a paired bootstrap 95% interval and "
           "an exact sign test over patients whose summand of the row's metric (summed over their trajectories) "
           "improved or worsened: h/K for precision_at_k and micro_precision, h/|Y| for recall_at_k and "
           "micro_recall, 2h/(K + |Y|) for micro_f1 and macro_f1 (K = the list's length at k = 0); n counts "
           "trajectories, n_improved, n_worsened and n_tied count patients. Under the run id of "
           "a mean over repeated runs (`dxr evaluate` with several --run), for two systems whose means share the id "
           "(every system's does under a --run-id; without one each has its own `config-…` id): the difference of "
           "the means over the runs, its interval from one patient resample shared by every run and both systems, "
           "and each patient's summand summed over its trajectories and the runs.",
           nullable=["ci_low", "ci_high"]),
        _t("headroom", FORECAST, {
            "run_id": pa.string(), "cohort_id": pa.string(), "pool": pa.string(), "subset": pa.string(),
            "k": pa.int32(), "metric": pa.string(), "value": pa.float64(), "ci_low": pa.float64(),
            "ci_high": pa.float64(), "n": pa.int64(), "mean_pool_size": pa.float64(),
        }, ["run_id"], "Target-conditioned pool oracle: metrics of the best achievable top-K within a pool "
           "(`a+b` = union of the full lists of systems a and b).", nullable=["ci_low", "ci_high"]),
    ]
})

# ---- research tools (tools/): corpora, search jobs, the evidence ledger, the page cache --------
TABLES.update({
    t.name: t
    for t in [
        _t("documents", FORECAST, {
            "corpus": pa.string(), "source": pa.string(), "doc_id": pa.string(), "source_format": pa.string(),
            "title": pa.string(), "url": pa.string(), "doi": pa.string(), "pmcid": pa.string(), "pmid": pa.string(),
            "arxiv_id": pa.string(), "sections_json": pa.large_string(), "n_chars": pa.int64(),
            "ingested_at": TS, "authors": pa.string(), "categories": pa.string(),
        }, ["corpus", "source"], "Ingested local documents (one partition per ingested path) and pages read "
           "from the web (corpus `web`, source = run and shard); `doc_id` is stable (pmc:/arxiv:/pmid:/doi:/"
           "<corpus>:); `sections_json` is a list of [heading, text]. `authors` and `categories` are an arXiv "
           "record's, as its metadata snapshot writes them (a list of names joined by ', ' and ' '); null for "
           "other formats and for documents ingested before they were kept.",
           nullable=["url", "doi", "pmcid", "pmid", "arxiv_id", "authors", "categories"]),
        _t("chunks", FORECAST, {
            "corpus": pa.string(), "source": pa.string(), "chunk_id": pa.string(), "doc_id": pa.string(),
            "ordinal": pa.int32(), "section": pa.string(), "text": pa.large_string(),
        }, ["corpus", "source"], "Retrievable chunks of each document; `doc_id` is the parent, `ordinal` "
           "the position; chunk_id = `{doc_id}#{ordinal}`."),
        _t("search_jobs", FORECAST, {
            "job_id": pa.string(), "run_id": pa.string(), "trajectory_id": pa.string(),
            "hypothesis_id": pa.string(), "code": pa.string(), "temporal_class": pa.string(),
            "iteration": pa.int32(), "purpose": pa.string(), "query": pa.string(),
            "entity_terms": pa.list_(pa.string()), "endpoint_terms": pa.list_(pa.string()), "created_at": TS,
        }, ["run_id", "shard"], "One row per search job (spec 4.4); a job is reused only within its "
           "trajectory for the same normalized code, temporal class and query.", nullable=["hypothesis_id"]),
        _t("ledger", FORECAST, {
            "evidence_id": pa.string(), "run_id": pa.string(), "trajectory_id": pa.string(), "job_id": pa.string(),
            "hypothesis_id": pa.string(), "code": pa.string(), "anchor": pa.string(),
            "temporal_class": pa.string(), "query": pa.string(), "engine": pa.string(), "doc_id": pa.string(),
            "title": pa.string(), "url": pa.string(), "excerpt": pa.large_string(), "support_cue": pa.bool_(),
            "support_score": pa.float64(), "iteration": pa.int32(), "retrieved_at": TS,
            "provenance": pa.string(), "channel": pa.string(), "state": pa.string(), "detail": pa.string(),
            "injection_suspected": pa.bool_(), "chunk_id": pa.string(),
        }, ["run_id", "shard"], "The evidence ledger (spec 4.4): one row per retrieval record, including "
           "no_result and unreadable attempts; `evidence_id` (E1, E2, ... per trajectory) is what verdicts cite; "
           "channel in {definition, relation, discovery}; state in {readable_supported, readable_unsupported, "
           "unreadable, no_result}; `detail` says why a page was rejected; excerpts are untrusted data; "
           "`chunk_id` is the `chunks` row whose passage (with its neighbours in the section) the excerpt was "
           "drawn from, null for evidence not drawn from one chunk (web pages, definitions, rows written before "
           "it was recorded).",
           nullable=["hypothesis_id", "anchor", "doc_id", "title", "url", "excerpt", "provenance", "detail",
                     "chunk_id"]),
        _t("page_cache", FORECAST, {
            "url": pa.string(), "final_url": pa.string(), "status": pa.int32(), "content_type": pa.string(),
            "title": pa.string(), "text": pa.large_string(), "links_json": pa.large_string(), "error": pa.string(),
            "fetched_at": TS,
        }, ["bucket"], "Pages fetched by the web reader (extracted text and links, or the error), shared by "
           "runs; bucket = first two hex digits of sha1(url).",
           nullable=["final_url", "content_type", "title", "text", "links_json", "error"]),
    ]
})

# ---- language-model calls (models/llm) -------------------------------------------------------
LLM_CALL_COLUMNS = {
    "call_id": pa.string(), "run_id": pa.string(), "stage": pa.string(), "trajectory_id": pa.string(),
    "backend": pa.string(), "model": pa.string(), "prompt_version": pa.string(), "tokens_in": pa.int64(),
    "tokens_cached_in": pa.int64(), "tokens_out": pa.int64(), "tokens_reasoning": pa.int64(),
    "latency_ms": pa.float64(), "cache_hit": pa.bool_(), "status": pa.string(), "error": pa.string(),
    "truncated_chars": pa.int64(), "model_identity": pa.string(), "started_at": TS, "attempt": pa.int32(),
    "attempt_reason": pa.string(), "transport_retries": pa.int32(), "cost_usd": pa.float64(),
}
LLM_CALL_NULLABLE = ("trajectory_id", "error", "model_identity", "started_at", "attempt", "attempt_reason",
                     "transport_retries", "cost_usd")
TABLES.update({
    t.name: t
    for t in [
        _t("llm_calls", FORECAST, LLM_CALL_COLUMNS, ["run_id", "stage", "shard"], "One row per LLM request or "
           "cache hit; status in {ok, invalid, transport_error, rejected (the backend refused the request, e.g. "
           "HTTP 4xx), cancelled (in flight when the run stopped on another request's error or an interrupt)}; a "
           "run that stops still writes the rows of the requests it sent; `model` = the configured model name, "
           "`model_identity` = which model answered (the endpoint's base URL, `<file>@<fingerprint>` of the "
           "embedded backend's GGUF, the replay file; null in rows written before it was recorded); "
           "`truncated_chars` = history characters dropped to fit the context window; `latency_ms` = time in "
           "flight at the backend over every attempt (queueing and backoff excluded; the lookup time for a cache "
           "hit). `tokens_cached_in` is part of `tokens_in` and `tokens_reasoning` part of `tokens_out`; a cache hit "
           "sent no request, so its tokens are 0. `trajectory_id` is null for a request made for no one trajectory; "
           "`error` is null when `ok` (for `invalid`, why the reply failed validation). "
           "`started_at` is when the request was first sent (after its wait for a concurrency slot and the rate "
           "limit) or the cache was read, UTC; `attempt` numbers the rows of one (run, stage, trajectory) from 1 in "
           "the order they were made, a cache hit included, so `ORDER BY attempt` lists a trajectory's requests; "
           "`attempt_reason` says why the row's request was made: `first` (the trajectory's first request), "
           "`invalid_reply` (a re-ask after the previous reply failed validation, with its errors appended; at most "
           "`llm.validation_retries` in a row) or `context_refused` (the prompt rendered again shorter after the "
           "endpoint refused it as too long for its context or cut the reply off at a full window). A transport "
           "retry sends the same request again within its row: `transport_retries` counts them (0 when the first "
           "send answered, and for a cache hit), and `latency_ms` sums every send. These four are null in rows "
           "written before they were recorded. "
           "`cost_usd` = the call's cost in US dollars at the `llm.prices` entry of its `model` in force when the "
           "run wrote it (uncached input, cached input and output tokens at their prices per 1M tokens): 0 for a "
           "cache hit, null when the model had no price, and null in rows written before it was recorded (the "
           "report prices those from the price table at report time). These are the calls behind the outputs the "
           "run holds now: those of an earlier attempt of the same system under the same run id (killed, failed "
           "or redone) are in `superseded_llm_calls`, so the run's whole spend is the sum over both tables.",
           nullable=LLM_CALL_NULLABLE),
        _t("superseded_llm_calls", FORECAST, {**LLM_CALL_COLUMNS, "superseded_at": TS},
           ["run_id", "stage", "calls"], "The `llm_calls` rows of a system's earlier attempt in a run, moved here "
           "when the system was forecast again under the same run id (after a kill, a failure or on purpose), "
           "which replaces its outputs: calls made and paid for, whose outputs the run no longer holds. Every "
           "`llm_calls` column with its meaning, plus `superseded_at` (UTC), when the rerun moved them. `cost_usd` "
           "is the cost the call stored; for a row written before `llm_calls` stored costs it is priced when moved, "
           "at the `llm.prices` of the forecast that superseded it (null for an unpriced model, as always). One "
           "partition per move: `calls` is a digest of the moved call ids, and the move and the removal of the rows "
           "from `llm_calls` are one commit, so a rerun killed during it neither loses nor duplicates a call.",
           nullable=LLM_CALL_NULLABLE),
    ]
})

# Tables partitioned by run first: one partition or more per run, so they grow with every run a
# warehouse keeps. Model fitting, training and vocabularies read none of them; their connections
# leave them out (`Warehouse.connect(tables=NON_RUN_TABLES)`), because a view's creation opens
# every file it covers.
RUN_TABLES = frozenset(name for name, spec in TABLES.items() if spec.partition_by[0] == "run_id")
NON_RUN_TABLES = frozenset(TABLES) - RUN_TABLES
