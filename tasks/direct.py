"""Direct Forecast (system `direct`) and Union + RRF over the EHR prior and Direct lists (`rrf_prior_direct`).

Direct Forecast (forecasting spec §2): the LLM reads the rendered pre-target record H of one
trajectory and returns 20–30 codes with non-increasing confidence; V(.) keeps the codes of Ω.
It sees no candidate list and no other system's output.

Union + RRF (spec §5, control arm): for one run, the prior's pi_F (its top 20, whatever K its rankings hold)
and Direct's list D already written under that run id as their stages' `candidates` are fused,
s(c) = Σ 1/(k0 + rank), k0 = 60, ranks one-based, ties by code. A run finds them by its run id: forecast
`ehr_prior` and `direct` with the same `--run-id` first.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Mapping, Sequence

import polars as pl

from dxr.errors import ConfigError, DxrError, InputError, NotFoundError
from models.llm.backends import ContextLengthError, TransportError, make_backend
from models.llm.client import (CONTEXT_REFUSED, FEEDBACK_RESERVE_CHARS, FIRST, CallContext, LLMClient, prompt_budget,
                               refit_chars_per_token)
from models.llm.config import LLMConfig
from models.llm.history import render_history
from models.llm.prompts import RenderedPrompt, load_prompt, render
from models.registry import FUSED_INPUTS
from tasks import stage_logger
from tasks.forecast import CANDIDATE_STAGES, write_shard_outputs
from warehouse.cohorts import code_titles
from warehouse.schemas import NON_RUN_TABLES
from warehouse.store import Warehouse
from warehouse.vocab import Vocabulary

DIRECT = "direct"
RRF_PRIOR_DIRECT = "rrf_prior_direct"
DIRECT_PROMPT = "direct_forecast"
RRF_K0 = 60
ICD_NAMES = {9: "ICD-9-CM", 10: "ICD-10-CM"}
# What codes the prompt asks for. A cohort harmonized to categories counts I50.22 and I50.23 as one code I50
# (V(.) keeps the first), so full codes asked for there would collapse into a list shorter than asked: it asks
# for categories.
SPECIFIC_CODES = "Prefer specific billable codes"
CATEGORY_CODES = ("Give ICD categories only (the first three characters of a code, four for ICD-9 E codes, e.g. I50 "
                  "or 428), each at most once")
# Progress lines per shard: one each tenth of its trajectories (each one when fewer than ten), since a shard of an LLM
# system runs for minutes to hours (about a minute a patient with the embedded model) with nothing else to show.
PROGRESS_LINES = 10
# The code of the example reply, (specific, category), in the cohort's own version: an ICD-10 example before an
# ICD-9 record contradicts the rule to use the record's version, and a small model copies examples.
EXAMPLE_CODES = {9: ("428.0", "428"), 10: ("I50.22", "I50")}


def check_confidence_order(value) -> list[str]:
    """Errors for confidences that increase down the list (JSON Schema cannot express the order).

    It reads any reply, also one that breaks the schema, so that a single re-ask names both kinds of mistake: a
    confidence that is no number is the schema's to name, and the order is checked across the others.

    >>> check_confidence_order({"predictions": [{"confidence": 90}, {"confidence": "x"}, {"confidence": 120}]})
    ['at predictions/2/confidence: 120 is higher than the 90 before it; confidences must not increase']
    """
    predictions = value.get("predictions") if isinstance(value, dict) else None
    numbered = [(i, p["confidence"]) for i, p in enumerate(predictions if isinstance(predictions, list) else [])
                if isinstance(p, dict) and type(p.get("confidence")) in (int, float)]
    return [f"at predictions/{i}/confidence: {b} is higher than the {a} before it; confidences must not increase"
            for (_, a), (i, b) in zip(numbered, numbered[1:]) if b > a]


def direct_prompt(events: pl.DataFrame, vocabulary: Vocabulary, config: LLMConfig,
                  chars_per_token: float | None = None, code_titles: Mapping[str, str] | None = None
                  ) -> RenderedPrompt:
    """The Direct Forecast messages of one trajectory (its pre-target events only), budgeted at `chars_per_token`
    (default: the configured one) with room left for a re-ask. Codes of Ω are named by Ω's titles, other codes
    by `code_titles` (the cohort's `code_titles` table)."""
    codes = set(events["code"].to_list())
    titles = {code: (code_titles or {}).get(code) for code in codes}
    titles.update({code: vocabulary.title(code) for code in codes if code in vocabulary})
    budget = prompt_budget(config, chars_per_token) - FEEDBACK_RESERVE_CHARS  # room left for a re-ask's errors
    return render(load_prompt(DIRECT_PROMPT), budget, render_history(events, titles), **prompt_fields(vocabulary))


def prompt_fields(vocabulary: Vocabulary) -> dict[str, str]:
    """The Direct Forecast prompt's fields besides the history: which ICD versions, and what codes, to give."""
    categories = vocabulary.harmonization == "category"
    example = EXAMPLE_CODES[9 if vocabulary.versions == {9} else 10][categories]
    return {"icd_versions": " or ".join(ICD_NAMES[v] for v in sorted(vocabulary.versions)) or "the record's own codes",
            "code_form": CATEGORY_CODES if categories else SPECIFIC_CODES, "example_code": example}


def direct_run_config(config: LLMConfig, data_dir: Path) -> dict:
    """What a Direct Forecast run records besides its options (`runs.config_json`): the backend, the configured
    model name, which model answers (`Backend.identity`), the prompt version, and the settings that shape its
    requests and prompts (sampling, reply length, the window the history is fitted to, the JSON mode, re-asks),
    so that the run can be reproduced and a rerun of it under other ones is refused like any other change of
    options."""
    client = LLMClient(config, make_backend(config, Path(data_dir)))
    return {"llm_backend": config.backend, "llm_model": config.model, "llm_model_identity": client.backend.identity,
            "prompt_versions": [load_prompt(DIRECT_PROMPT).version], "llm_temperature": config.temperature,
            "llm_seed": config.seed, "llm_max_output_tokens": config.max_output_tokens,
            "llm_context_window": config.context_window, "llm_chars_per_token": config.chars_per_token,
            "llm_response_format": client.response_format, "llm_validation_retries": config.validation_retries,
            "llm_max_tokens_field": config.max_tokens_field}


def drop_detail(drops) -> str:
    """`dropped 2 not_in_vocabulary, 1 duplicate` (reasons sorted), or empty when nothing was dropped."""
    return "dropped " + ", ".join(f"{n} {reason}" for reason, n in sorted(drops.items())) if drops else ""


async def forecast_direct(client: LLMClient, trajectories: pl.DataFrame, pretarget: pl.DataFrame,
                          vocabulary: Vocabulary, run_id: str, cohort_id: str, k: int,
                          code_titles: Mapping[str, str] | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Rankings and status rows of Direct Forecast for `trajectories` (one concurrent call each); `code_titles`
    names the codes outside Ω in the prompts."""
    prompt = load_prompt(DIRECT_PROMPT)
    by_trajectory = pretarget.partition_by("trajectory_id", as_dict=True)

    async def ask(trajectory_id: str, rendered: RenderedPrompt, chars_per_token: float, reason: str):
        """The reply to a trajectory's prompt, rendered at `chars_per_token`; `reason` says why it is asked."""
        context = CallContext(run_id, DIRECT, trajectory_id, rendered.truncated_chars, reason)
        return await client.complete_json(rendered.messages, prompt.schema, prompt.version, context,
                                          check=check_confidence_order,
                                          budget_chars=prompt_budget(client.config, chars_per_token))

    async def ask_within_context(trajectory_id: str, events: pl.DataFrame):
        """`ask`, and once more after the endpoint found the prompt too long for its context (refused it, or cut
        the reply off at the full window): rendered again to the window at the characters per token it measured.
        Returns (reply, prompt, notes)."""
        rendered = direct_prompt(events, vocabulary, client.config, code_titles=code_titles)
        try:
            return await ask(trajectory_id, rendered, client.config.chars_per_token, FIRST), rendered, []
        except ContextLengthError as exc:
            chars_per_token = refit_chars_per_token(client.config, rendered.messages, exc,
                                                    client.config.chars_per_token)
            if chars_per_token is None:
                raise
            refusal = exc
        try:
            rendered = direct_prompt(events, vocabulary, client.config, chars_per_token, code_titles)
        except ConfigError as exc:  # no room left for the history at the measured rate
            raise InputError(f"{refusal}; a prompt short enough leaves no room for the history ({exc})") from exc
        tokens = refusal.prompt_tokens or "unknown"
        return await ask(trajectory_id, rendered, chars_per_token, CONTEXT_REFUSED), rendered, [
            f"prompt shortened: the endpoint found it too long for the context ({tokens} prompt tokens)"]

    async def one(trajectory_id: str):
        events = by_trajectory.get((trajectory_id,), pretarget.clear())
        try:
            reply, rendered, notes = await ask_within_context(trajectory_id, events)
        except ConfigError:
            # A backend that cannot serve the run at all (bad key, unknown model, a parameter it does not take,
            # a replay file without the run's requests) is the run's failure, not this trajectory's.
            raise
        except (DxrError, TransportError) as exc:  # this request's problem (incl. a second refusal as too long)
            return [], ("failed", str(exc)[:500])
        predictions = reply["predictions"]
        validation = vocabulary.validate(p["code"] for p in predictions)
        confidence = {}
        for p in predictions:
            code, _ = vocabulary.resolve(p["code"])
            confidence.setdefault(code, float(p["confidence"]))
        rows = [(trajectory_id, rank, code, confidence[code], True)
                for rank, code in enumerate(validation.codes, 1)]
        notes.insert(0, drop_detail(validation.drops))
        if rendered.truncated_chars:
            notes.append(f"history truncated by {rendered.truncated_chars} characters")
        status = "ok" if len(rows) >= k else "short"
        if status == "short":
            notes.insert(0, f"{len(rows)} of {k} codes")
        return rows, (status, "; ".join(n for n in notes if n) or None)

    ids = trajectories["trajectory_id"].to_list()
    logger, started, outcomes = stage_logger(__name__), time.monotonic(), Counter()
    every = max(1, len(ids) // PROGRESS_LINES)

    async def reported(trajectory_id: str):
        rows, (status, detail) = await one(trajectory_id)
        outcomes[status] += 1
        done = outcomes.total()
        if done % every == 0 or done == len(ids):
            logger.info("%s: %d of %d trajectories done (%s) in %.0f s", DIRECT, done, len(ids),
                        ", ".join(f"{n} {s}" for s, n in sorted(outcomes.items())), time.monotonic() - started)
        return rows, (status, detail)

    tasks = [asyncio.ensure_future(reported(t)) for t in ids]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        # One trajectory's error stops the run (or it was interrupted): the others' requests are cancelled and
        # awaited, so that each call made has its final telemetry row before the caller writes them.
        for pending in tasks:
            pending.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    ranked = pl.DataFrame([row for rows, _ in results for row in rows], orient="row",
                          schema={"trajectory_id": pl.String, "rank": pl.Int32, "code": pl.String,
                                  "score": pl.Float64, "native": pl.Boolean})
    ranked = ranked.with_columns(pl.lit(run_id).alias("run_id"), pl.lit(cohort_id).alias("cohort_id"),
                                 pl.lit(DIRECT).alias("system"))
    status = pl.DataFrame({"run_id": run_id, "system": DIRECT, "trajectory_id": ids,
                           "status": [s for _, (s, _) in results], "detail": [d for _, (_, d) in results]},
                          schema={"run_id": pl.String, "system": pl.String, "trajectory_id": pl.String,
                                  "status": pl.String, "detail": pl.String})
    return ranked, status


def direct_shard(wh: Warehouse, cohort_id: str, shard: int, trajectories: pl.DataFrame, pretarget: pl.DataFrame,
                 k: int, run_id: str, config: LLMConfig) -> int:
    """Run Direct Forecast over one shard and write its rankings, candidates, ranking_status and llm_calls
    partitions (only llm_calls when the run stops on an error: the calls made so far)."""
    vocabulary = Vocabulary.from_warehouse(wh.connect(tables=NON_RUN_TABLES), cohort_id)
    titles = code_titles(wh, cohort_id)
    client = LLMClient.from_config(config, wh.root)

    async def run():
        try:
            return await forecast_direct(client, trajectories, pretarget, vocabulary, run_id, cohort_id, k, titles)
        finally:
            await client.close()

    try:
        ranked, status = asyncio.run(run())
    except BaseException:
        # The run stops (a configuration error, an interrupt), but the calls it made were made, and cost: on record.
        wh.write("llm_calls", client.telemetry(), run_id=run_id, stage=DIRECT, shard=shard)
        raise
    write_shard_outputs(wh, DIRECT, shard, run_id, ranked, status, pretarget)
    wh.write("llm_calls", client.telemetry(), run_id=run_id, stage=DIRECT, shard=shard)
    return trajectories.height


def rrf_fuse(lists: Sequence[Sequence[str]], k0: int = RRF_K0) -> list[tuple[str, float]]:
    """Reciprocal-rank fusion: s(c) = Σ over lists holding c of 1/(k0 + rank), ranks one-based; desc, ties by code.

    >>> rrf_fuse([["a", "b"], ["b", "c"]], k0=1)
    [('b', 0.8333333333333333), ('a', 0.5), ('c', 0.3333333333333333)]
    """
    scores: dict[str, float] = {}
    for ranked in lists:
        for rank, code in enumerate(ranked, 1):
            scores[code] = scores.get(code, 0.0) + 1.0 / (k0 + rank)
    return sorted(scores.items(), key=lambda item: (-item[1], item[0]))


def fuse_prior_direct(prior: pl.DataFrame, direct: pl.DataFrame, trajectories: pl.DataFrame, vocabulary: Vocabulary,
                      run_id: str, cohort_id: str, k: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Union + RRF rankings and status of each trajectory from its `ehr_prior` (pi_F) and `direct` lists."""
    def lists(frame: pl.DataFrame) -> dict[str, list[str]]:
        return {t: group.sort("rank")["code"].to_list()
                for (t,), group in frame.partition_by("trajectory_id", as_dict=True).items()}

    prior_lists, direct_lists = lists(prior), lists(direct)
    rows, statuses = [], []
    for trajectory_id in trajectories["trajectory_id"].to_list():
        sources = [prior_lists.get(trajectory_id, []), direct_lists.get(trajectory_id, [])]
        fused = rrf_fuse(sources)
        allowed = set(vocabulary.validate(code for code, _ in fused).codes)
        fused = [(code, score) for code, score in fused if code in allowed]
        rows += [(trajectory_id, rank, code, score, True) for rank, code, score in
                 ((r, c, s) for r, (c, s) in enumerate(fused, 1))]
        missing = [name for name, codes in zip(("ehr_prior", DIRECT), sources) if not codes]
        notes = [f"no {name} list" for name in missing]
        status = "ok" if len(fused) >= k else "short"
        if status == "short":
            notes.insert(0, f"{len(fused)} of {k} codes")
        statuses.append((run_id, RRF_PRIOR_DIRECT, trajectory_id, status, "; ".join(notes) or None))
    ranked = pl.DataFrame(rows, orient="row", schema={"trajectory_id": pl.String, "rank": pl.Int32,
                                                       "code": pl.String, "score": pl.Float64,
                                                       "native": pl.Boolean}).with_columns(
        pl.lit(run_id).alias("run_id"), pl.lit(cohort_id).alias("cohort_id"), pl.lit(RRF_PRIOR_DIRECT).alias("system"))
    status = pl.DataFrame(statuses, orient="row", schema={"run_id": pl.String, "system": pl.String,
                                                          "trajectory_id": pl.String, "status": pl.String,
                                                          "detail": pl.String})
    return ranked, status


def rrf_prior_direct_shard(wh: Warehouse, cohort_id: str, shard: int, trajectories: pl.DataFrame, k: int,
                           run_id: str) -> int:
    """Fuse the run's `ehr_prior` and `direct` lists of one shard's trajectories into `rrf_prior_direct`."""
    inputs = {system: fused_input(wh, run_id, cohort_id, system, trajectories)
              for system in FUSED_INPUTS[RRF_PRIOR_DIRECT]}
    vocabulary = Vocabulary.from_warehouse(wh.connect(tables=NON_RUN_TABLES), cohort_id)
    ranked, status = fuse_prior_direct(inputs["ehr_prior"], inputs[DIRECT], trajectories, vocabulary, run_id,
                                       cohort_id, k)
    wh.write("rankings", ranked, run_id=run_id, system=RRF_PRIOR_DIRECT, shard=shard)
    wh.write("ranking_status", status, run_id=run_id, system=RRF_PRIOR_DIRECT, shard=shard)
    return trajectories.height


def fused_input(wh: Warehouse, run_id: str, cohort_id: str, system: str, trajectories: pl.DataFrame) -> pl.DataFrame:
    """The run's `system` stage list (`candidates`) of these trajectories; an error unless that forecast addressed
    every one.

    The stage list, not the rankings: the prior's rankings hold the run's K codes, its pi_F the 20 that the spec
    fuses, so the fused list stays one list whatever K the prior was forecast with (its first K are scored).
    A trajectory the input forecast addressed has a `ranking_status` row, written after its list, so a
    list that is absent there failed rather than went missing (a killed forecast, another split or
    limit). Read by trajectory, not by shard number: a cohort rebuilt with another shard size keeps
    its id and trajectories but moves them between shards.
    """
    wanted = trajectories.select("trajectory_id")
    missing = wanted.join(wh.read("ranking_status", run_id=run_id, system=system), on="trajectory_id",
                          how="anti")["trajectory_id"]
    if missing.len():
        coverage = (f" for {missing.len()} of the {wanted.height} trajectories to fuse (e.g. {missing[0]})"
                    if missing.len() < wanted.height else "")
        raise NotFoundError(
            f"run {run_id!r} has no {system} rankings{coverage}; Union + RRF fuses lists of the same run: first run "
            f"dxr forecast --cohort {cohort_id} --system {system} --run-id {run_id} with the same split and limit")
    listed = wh.read("candidates", run_id=run_id, stage=CANDIDATE_STAGES[system]).join(wanted, on="trajectory_id",
                                                                                       how="semi")
    # A forecast made before stage candidates were written has rankings only: fusing it would drop its lists.
    ranked = wh.read("rankings", run_id=run_id, system=system).filter(pl.col("native"))
    unlisted = ranked.join(wanted, on="trajectory_id", how="semi").join(listed, on="trajectory_id",
                                                                        how="anti")["trajectory_id"]
    if unlisted.len():
        raise NotFoundError(
            f"run {run_id!r} has {system} rankings but no {CANDIDATE_STAGES[system]} candidates for "
            f"{unlisted.n_unique()} trajectories (e.g. {unlisted[0]}), made before stage candidates were written: "
            f"forecast it again with dxr forecast --cohort {cohort_id} --system {system} --run-id {run_id}")
    return listed
