"""The one async client every LLM stage uses: cache, concurrency limit, retries, JSON validation, telemetry.

`complete_json` returns a parsed object that satisfies the prompt's JSON schema (and any extra
structural check), or raises `LLMOutputError` after the bounded validation retries. Every backend
request and every cache hit becomes one telemetry row (`llm_calls`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

import jsonschema
import polars as pl

from dxr.errors import ConfigError, DxrError
from models.llm.backends import (Backend, Completion, ContextLengthError, EndedServerError, TransportError,
                                 UnreachableError, canonical_json, make_backend)
from models.llm.cache import ResponseCache, cache_key_input
from models.llm.config import LLMConfig
from models.llm.telemetry import call_costs
from warehouse.schemas import utc_now


class LLMOutputError(DxrError):
    """The model's reply stayed invalid after every validation retry."""


class RunStoppedError(ConfigError):
    """A request not sent because an earlier one met an error that stops the run (`ConfigError`)."""


class EndpointUnreachableError(ConfigError):
    """The endpoint could not be connected to after every transport retry: the run stops with this one error
    rather than wait out the same retries for each of its other requests."""


# Structural errors quoted back to the model on a retry; a long list would only crowd out the record.
MAX_LISTED_ERRORS = 10
# Each quoted error is cut to this length (a schema error can quote a whole reply).
MAX_ERROR_CHARS = 200
# Characters of the prompt budget a first prompt leaves free, so that a re-ask can list a few errors
# without growing the prompt past the budget.
FEEDBACK_RESERVE_CHARS = 800
FEEDBACK_HEAD = "That reply does not follow the required JSON structure:\n"
FEEDBACK_TAIL = "\nReply again with only a JSON object that fixes every listed problem."
# Said when a re-ask would be the previous re-ask again (the same invalid reply, or, where the reply is not quoted,
# the same errors): its answer, from the cache or from a deterministic model, would be the same invalid reply.
FEEDBACK_REPEATED = "\nThe same problems as in your previous reply ({times} replies in a row): write a different reply."
CANCELLED = "cancelled in flight: the run stopped (another request's error, or an interrupt)"


# The columns of a request's row; `telemetry` adds its `cost_usd`.
CALL_COLUMNS = {
    "call_id": pl.String, "run_id": pl.String, "stage": pl.String, "trajectory_id": pl.String,
    "backend": pl.String, "model": pl.String, "prompt_version": pl.String, "tokens_in": pl.Int64,
    "tokens_cached_in": pl.Int64, "tokens_out": pl.Int64, "tokens_reasoning": pl.Int64, "latency_ms": pl.Float64,
    "cache_hit": pl.Boolean, "status": pl.String, "error": pl.String, "truncated_chars": pl.Int64,
    "model_identity": pl.String, "started_at": pl.Datetime("us"), "attempt": pl.Int32, "attempt_reason": pl.String,
    "transport_retries": pl.Int32,
}
# Why a request of a (trajectory, stage) was made (`llm_calls.attempt_reason`): its first, a re-ask after a reply that
# failed validation, or a prompt rendered again shorter after the endpoint found it too long for its context.
FIRST, INVALID_REPLY, CONTEXT_REFUSED = "first", "invalid_reply", "context_refused"


@dataclass
class CallContext:
    """Who is calling, and why (`attempt_reason`, of the call's first request; its re-asks are `invalid_reply`):
    recorded on every telemetry row of the call."""

    run_id: str
    stage: str
    trajectory_id: str | None = None
    truncated_chars: int = 0
    attempt_reason: str = FIRST


@lru_cache(maxsize=64)
def _validator(schema_json: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads(schema_json))


def schema_errors(schema: dict, value) -> list[str]:
    """Structural errors of `value` against a JSON schema, one readable line each, in reply order (array
    positions by number, so that predictions/2 comes before predictions/10 and a re-ask lists the first ones).

    >>> schema_errors({"type": "array", "items": {"maximum": 100}}, [0, 0, 101, 0, 0, 0, 0, 0, 0, 0, 102])
    ['at 2: 101 is greater than the maximum of 100', 'at 10: 102 is greater than the maximum of 100']
    """
    validator = _validator(canonical_json(schema))
    errors = sorted(validator.iter_errors(value),
                    key=lambda e: [(0, p, "") if isinstance(p, int) else (1, 0, str(p)) for p in e.absolute_path])
    return [f"at {'/'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}" for e in errors]


def attempts_made(count: int) -> str:
    """'1 attempt', '3 attempts': the lines that say how often a request was tried."""
    return f"{count} attempt{'' if count == 1 else 's'}"


def prompt_budget(config: LLMConfig, chars_per_token: float | None = None) -> int:
    """Characters a whole prompt may take: the context window less the reserved output, at `chars_per_token`
    (default: the configured one)."""
    return int((config.context_window - config.max_output_tokens) * (chars_per_token or config.chars_per_token))


def refit_chars_per_token(config: LLMConfig, messages: list[dict], refusal: ContextLengthError,
                          chars_per_token: float) -> float | None:
    """The chars_per_token to render `messages` again with after the endpoint refused them as too long for its
    context; None when no prompt can fit (the reserved output alone fills the window).

    With the server's token count, from the characters per token it measured on this very prompt (and the
    window it reported, when smaller than the configured one), less 5 %; without, 25 % fewer characters.
    """
    window = min(config.context_window, refusal.context_window or config.context_window)
    if window <= config.max_output_tokens:
        return None
    if not refusal.prompt_tokens:
        return chars_per_token * 0.75
    measured = sum(len(m["content"]) for m in messages) / refusal.prompt_tokens
    fitting = measured * (window - config.max_output_tokens) / (config.context_window - config.max_output_tokens)
    return min(fitting, chars_per_token) * 0.95


# A Markdown code fence: its info string's first word (`json`, `json5`, `python`, none) and what follows (to the end
# of the reply when the fence is not closed: a reply cut off).
_FENCE = re.compile(r"```[ \t]*([A-Za-z][\w+./-]*)?(.*?)(?:```|$)", re.S)


def parse_json_reply(text: str) -> object:
    """The JSON value of a reply; tolerates a Markdown code fence around it, on one line or with a sentence before
    or after it, as models write it. Its content is read as JSON, whichever JSON flavour the fence names.

    Which fence, when there are several: those tagged with a JSON flavour (`json`, `json5`, `application/json`)
    first, then untagged ones, then those tagged with another language, each in reply order; the first whose
    content is JSON is the answer. Small local models tag their JSON `python` or `js`, so such a fence is read
    after the others, but not beside a JSON-tagged one: there it is an example, not the answer. When no fence read
    holds JSON, the error is the first one's.

    >>> parse_json_reply('```json {"a": 1}```'), parse_json_reply('Here it is:\\n```json5\\n{"a": 1}\\n```\\nDone.')
    ({'a': 1}, {'a': 1})
    >>> parse_json_reply('```python\\n{"a": 1}\\n```'), parse_json_reply('```python\\nprint(1)\\n```\\n```{"a": 2}```')
    ({'a': 1}, {'a': 2})
    """
    stripped = text.strip()
    try:
        return json.loads(stripped)
    except json.JSONDecodeError:
        fences = _FENCE.findall(stripped)
        if not fences:
            raise
    fences.sort(key=_fence_rank)  # stable: in reply order within a rank
    if _fence_rank(fences[0]) == 0:
        fences = [fence for fence in fences if _fence_rank(fence) < 2]
    first_error = None
    for _, content in fences:
        # The rest of a fence's opening line belongs to its info string (`json title="reply"`), unless the value
        # starts there (a fence on one line, or `{` after the info word).
        opening, newline, body = content.partition("\n")
        try:
            return json.loads(body if newline and not opening.strip().startswith(("{", "[")) else content)
        except json.JSONDecodeError as exc:
            first_error = first_error or exc
    raise first_error


def _fence_rank(fence: tuple[str, str]) -> int:
    """0 for a fence tagged with a JSON flavour, 1 for an untagged one, 2 for one tagged with another language."""
    tag = fence[0].lower()
    return 0 if "json" in tag else 1 if not tag else 2


@dataclass
class LLMClient:
    config: LLMConfig
    backend: Backend
    cache: ResponseCache | None = None
    calls: list[dict] = field(default_factory=list)

    def __post_init__(self):
        # A backend may admit fewer requests in flight than configured (the embedded server: one).
        in_flight = min(self.config.max_concurrency,
                        getattr(self.backend, "max_concurrency", self.config.max_concurrency))
        self._limit = asyncio.Semaphore(in_flight)
        # The embedded backend has its own, longer timeout and does not retry timeouts (see LocalBackend).
        self._timeout_s = getattr(self.backend, "timeout_s", self.config.timeout_s)
        self._retry_timeouts = getattr(self.backend, "retry_timeouts", True)
        self._pace = asyncio.Lock()
        self._next_start = 0.0
        # The first error that stops the run: no request is sent after it.
        self._stopped_by: ConfigError | None = None
        # Rows recorded so far per (run, stage, trajectory): the next row's `attempt` is one more.
        self._attempts: dict[tuple[str, str, str | None], int] = {}

    async def _wait_for_rate_limit(self) -> None:
        """Space request starts by 60 / requests_per_minute seconds (no wait when uncapped)."""
        if not self.config.requests_per_minute:
            return
        async with self._pace:
            now = time.monotonic()
            start = max(now, self._next_start)
            self._next_start = start + 60.0 / self.config.requests_per_minute
            await asyncio.sleep(start - now)

    @classmethod
    def from_config(cls, config: LLMConfig, data_dir: Path) -> LLMClient:
        """The configured backend, with the response cache under `<data_dir>/forecast/llm_cache` when enabled."""
        cache = ResponseCache(Path(data_dir) / "forecast" / "llm_cache") if config.cache else None
        return cls(config, make_backend(config, data_dir), cache)

    @property
    def response_format(self) -> str:
        """How requests ask for JSON: `llm.response_format`, else the backend's own preference."""
        return self.config.response_format or getattr(self.backend, "response_format", "json_schema")

    @property
    def serving(self) -> dict:
        """What shapes a reply besides the request: the context window (the configured one, or the window the
        backend's server runs with when it knows it) and the backend's own settings (`Backend.serving`)."""
        return {"context_window": self.config.context_window, **getattr(self.backend, "serving", {})}

    def request(self, messages: list[dict], schema: dict) -> dict:
        """The backend request for `messages` (deterministic settings, JSON output as configured)."""
        request = {"model": self.config.model, "messages": messages, "temperature": self.config.temperature,
                   self.config.max_tokens_field: self.config.max_output_tokens}
        if self.config.seed is not None:
            request["seed"] = self.config.seed
        kind = self.response_format
        if kind == "json_schema":
            request["response_format"] = {"type": "json_schema",
                                          "json_schema": {"name": "reply", "schema": schema, "strict": False}}
        elif kind == "json_object_schema":
            request["response_format"] = {"type": "json_object", "schema": schema}
        elif kind == "json_object":
            request["response_format"] = {"type": "json_object"}
        return request

    async def complete_json(self, messages: list[dict], schema: dict, prompt_version: str, context: CallContext,
                            check: Callable[[object], list[str]] | None = None,
                            budget_chars: int | None = None) -> object:
        """A reply valid against `schema` and `check`, re-asking with the errors appended when it is not.

        `check` returns the errors beyond the schema (an order it cannot express); it gets every parsed reply, also
        one that breaks the schema, and reads what it can of it. `budget_chars` is the prompt budget `messages` were
        rendered to (default: `prompt_budget` of the configuration); re-asks stay within it.
        """
        conversation = list(messages)
        errors: list[str] = []
        asked, repeats = None, 0  # the previous re-ask (without FEEDBACK_REPEATED); how many in a row were alike
        for request_number in range(self.config.validation_retries + 1):
            reason = INVALID_REPLY if request_number else context.attempt_reason
            completion, row = await self._complete(self.request(conversation, schema), prompt_version, context,
                                                   reason)
            try:
                value = parse_json_reply(completion.text)
                # The check runs on a reply that breaks the schema too: one re-ask then names every kind of mistake.
                errors = schema_errors(schema, value) + (check(value) if check is not None else [])
            except json.JSONDecodeError as exc:
                # Some of json's messages end with "at" ("Unterminated string starting at"): said once.
                errors = [f"the reply is not JSON ({exc.msg.removesuffix(' at')} at character {exc.pos})"]
            if not errors:
                return value
            window = self.cutting_window(completion)
            if completion.finish_reason == "length" and window is None:
                # Stopped at the output limit (or, for a reasoning model, its reasoning used it up): the errors of
                # what was left (an unterminated string, no JSON at all) do not say why, to the model or the user.
                errors.insert(0, f"the reply was cut off at the limit of {self.config.max_output_tokens} output "
                                 "tokens (llm.max_output_tokens) before it was complete")
            row["status"], row["error"] = "invalid", "; ".join(errors)[:1000]
            if window is not None:
                # A server with a full window stops the reply (llama.cpp's shortens max_tokens to what is left
                # rather than refuse): a re-ask, longer still, cannot do better; a shorter prompt can.
                where = f"{context.stage} reply for {context.trajectory_id or 'the request'} was cut off by the context"
                if window == self.config.context_window:
                    message = (f"{where} window: its prompt took {completion.tokens_in} of the {window} tokens, less "
                               f"than llm.max_output_tokens = {self.config.max_output_tokens} left for the reply")
                else:
                    message = (f"{where} window: the endpoint stopped it after {completion.tokens_out} output tokens, "
                               f"before llm.max_output_tokens = {self.config.max_output_tokens}, with "
                               f"{completion.tokens_in} prompt tokens, so its window looks like {window} tokens, "
                               f"smaller than llm.context_window = {self.config.context_window}: set "
                               "llm.context_window to the endpoint's (a llama.cpp server's --n_ctx)")
                raise ContextLengthError(message, prompt_tokens=completion.tokens_in, context_window=window)
            retry = self.retry_conversation(messages, completion.text, errors, budget_chars)
            repeats, asked = (repeats + 1 if retry == asked else 0), retry
            conversation = (self.retry_conversation(messages, completion.text, errors, budget_chars, repeats)
                            if repeats else retry)
        raise LLMOutputError(f"{context.stage} reply for {context.trajectory_id or 'the request'} stayed invalid after "
                             f"{attempts_made(self.config.validation_retries + 1)}: {'; '.join(errors)[:300]}")

    def cutting_window(self, completion: Completion) -> int | None:
        """The context window that cut a reply off at the length limit; None when it was not cut, or was cut at
        max_output_tokens.

        The configured window when the prompt left less than max_output_tokens of it. A reply stopped before
        max_output_tokens was cut by a smaller window than the configured one, full at its prompt and reply: a
        llama.cpp server started with a smaller `--n_ctx` than llm.context_window answers so, never refusing.
        """
        if completion.finish_reason != "length":
            return None
        if completion.tokens_in + self.config.max_output_tokens > self.config.context_window:
            return self.config.context_window
        if completion.tokens_in > 0 and 0 < completion.tokens_out < self.config.max_output_tokens:
            return completion.tokens_in + completion.tokens_out
        return None

    def retry_conversation(self, messages: list[dict], reply: str, errors: list[str],
                           budget_chars: int | None = None, repeats: int = 0) -> list[dict]:
        """`messages`, the invalid reply and its structural errors (at most MAX_LISTED_ERRORS lines), within the
        prompt budget (`budget_chars`, default: `prompt_budget` of the configuration). `repeats`: how many re-asks
        before this one were the same (FEEDBACK_REPEATED then says so, so that the request differs).

        Only the latest reply is quoted, so retries do not grow the prompt; when it would not fit the budget,
        only the errors are appended, as many as fit (at least one: a first prompt leaves
        FEEDBACK_RESERVE_CHARS for a few).
        """
        budget = prompt_budget(self.config) if budget_chars is None else budget_chars
        listed = [e if len(e) <= MAX_ERROR_CHARS else e[:MAX_ERROR_CHARS - 1] + "…" for e in errors]

        def feedback(shown: int) -> dict:
            lines = [f"- {e}" for e in listed[:shown]]
            if len(errors) > shown:
                lines.append(f"- and {len(errors) - shown} more problems of the same kinds")
            repeated = FEEDBACK_REPEATED.format(times=repeats + 1) if repeats else ""
            return {"role": "user", "content": FEEDBACK_HEAD + "\n".join(lines) + repeated + FEEDBACK_TAIL}

        used = sum(len(m["content"]) for m in messages)
        shown = min(len(errors), MAX_LISTED_ERRORS)
        if used + len(reply) + len(feedback(shown)["content"]) <= budget:
            return [*messages, {"role": "assistant", "content": reply}, feedback(shown)]
        while shown > 1 and used + len(feedback(shown)["content"]) > budget:
            shown -= 1
        return [*messages, feedback(shown)]

    async def _complete(self, request: dict, prompt_version: str, context: CallContext,
                        reason: str) -> tuple[Completion, dict]:
        """One response (from the cache or the backend, with transport retries) and its telemetry row; `reason`
        is why the request is made (`attempt_reason`)."""
        identity = getattr(self.backend, "identity", None)
        key_input = cache_key_input(self.backend.name, identity, prompt_version, request, self.serving)
        started = time.perf_counter()
        row = {"call_id": uuid.uuid4().hex, "run_id": context.run_id, "stage": context.stage,
               "trajectory_id": context.trajectory_id, "backend": self.backend.name, "model": self.config.model,
               "prompt_version": prompt_version, "tokens_in": 0, "tokens_cached_in": 0, "tokens_out": 0,
               "tokens_reasoning": 0, "latency_ms": 0.0, "cache_hit": False, "status": "ok", "error": None,
               "truncated_chars": context.truncated_chars, "model_identity": identity, "attempt_reason": reason,
               "transport_retries": 0}
        cached = self.cache.get(key_input) if self.cache is not None else None
        if cached is not None:
            row.update(cache_hit=True, latency_ms=(time.perf_counter() - started) * 1000)
            self._record(row)
            return cached, row
        # Latency is time in flight at the backend (every attempt), not time queued for a slot or backing off.
        in_flight = 0.0
        delay = self.config.backoff_s
        last_error = ""
        try:
            for attempt in range(self.config.transport_retries + 1):
                try:
                    async with self._limit:
                        await self._wait_for_rate_limit()
                        # Recorded once sent: a request still waiting for a slot when the run stops is never made.
                        if self._stopped_by is not None:
                            raise RunStoppedError(f"{context.stage}: not sent, the run stopped on: {self._stopped_by}")
                        if attempt:
                            row["transport_retries"] = attempt
                        else:
                            self._record(row)
                        sent = time.perf_counter()
                        try:
                            completion = await asyncio.wait_for(self.backend.complete(request), self._timeout_s)
                        finally:
                            in_flight += time.perf_counter() - sent
                    break
                except RunStoppedError:
                    if attempt:  # sent before, and failed: not asked again
                        row.update(status="cancelled", error=f"not retried, the run stopped; {last_error}"[:1000],
                                   latency_ms=in_flight * 1000)
                    raise
                except DxrError as exc:  # the backend refused the request (bad key, 4xx): retrying cannot help
                    row.update(status="rejected", error=str(exc)[:1000], latency_ms=in_flight * 1000)
                    if isinstance(exc, ConfigError):
                        self._stopped_by = exc
                    raise
                except (TransportError, TimeoutError) as exc:
                    message = str(exc) or f"timeout after {self._timeout_s}s"
                    timed_out = isinstance(exc, TimeoutError) or isinstance(exc.__cause__, TimeoutError)
                    if (attempt == self.config.transport_retries or (timed_out and not self._retry_timeouts)
                            or isinstance(exc, EndedServerError)):
                        row.update(status="transport_error", error=message[:1000], latency_ms=in_flight * 1000)
                        gave_up = f"{context.stage}: gave up after {attempts_made(attempt + 1)}: {message}"
                        if isinstance(exc, UnreachableError):
                            self._stopped_by = EndpointUnreachableError(gave_up)
                            raise self._stopped_by from exc
                        raise TransportError(gave_up) from exc
                    last_error = message
                    # A server that says when to come back (Retry-After, capped by the backend) is not asked sooner.
                    await asyncio.sleep(max(delay, getattr(exc, "retry_after", None) or 0.0))
                    delay *= 2
        except asyncio.CancelledError:
            # The run stopped (another request's configuration error, an interrupt) while this request was out: it
            # was made all the same, and the server may have computed it.
            row.update(status="cancelled", error=CANCELLED, latency_ms=in_flight * 1000)
            raise
        row.update(tokens_in=completion.tokens_in, tokens_cached_in=completion.tokens_cached_in,
                   tokens_out=completion.tokens_out, tokens_reasoning=completion.tokens_reasoning,
                   latency_ms=in_flight * 1000)
        if self.cache is not None:
            self.cache.put(key_input, completion)
        return completion, row

    def _record(self, row: dict) -> None:
        """Add `row` to the telemetry, stamped with the time it is sent (or read from the cache) and its attempt
        number among its trajectory's rows of the stage. A stage makes one trajectory's requests one after another
        (Direct's do), so the numbers follow their order whatever other trajectories run meanwhile."""
        key = (row["run_id"], row["stage"], row["trajectory_id"])
        self._attempts[key] = self._attempts.get(key, 0) + 1
        row.update(started_at=utc_now(), attempt=self._attempts[key])
        self.calls.append(row)

    def telemetry(self) -> pl.DataFrame:
        """Every call so far as `llm_calls` rows, each priced by this run's price table: the cost of a call is the
        price in force when it was made, whatever the table says when it is reported."""
        return call_costs(pl.DataFrame(self.calls, schema=CALL_COLUMNS), self.config.prices)

    async def close(self) -> None:
        await self.backend.close()
