"""The one async client every LLM stage uses: cache, concurrency limit, retries, JSON validation, telemetry.

`complete_json` returns a parsed object that satisfies the prompt's JSON schema (and any extra
structural check), or raises `LLMOutputError` after the bounded validation retries. Every backend
request and every cache hit becomes one telemetry row (`llm_calls`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

import jsonschema
import polars as pl

from dxr.errors import DxrError
from models.llm.backends import Backend, Completion, TransportError, canonical_json, make_backend
from models.llm.cache import ResponseCache, cache_key_input
from models.llm.config import LLMConfig


class LLMOutputError(DxrError):
    """The model's reply stayed invalid after every validation retry."""


# Structural errors quoted back to the model on a retry; a long list would only crowd out the record.
MAX_LISTED_ERRORS = 10


CALL_COLUMNS = {
    "call_id": pl.String, "run_id": pl.String, "stage": pl.String, "trajectory_id": pl.String,
    "backend": pl.String, "model": pl.String, "prompt_version": pl.String, "tokens_in": pl.Int64,
    "tokens_cached_in": pl.Int64, "tokens_out": pl.Int64, "tokens_reasoning": pl.Int64, "latency_ms": pl.Float64,
    "cache_hit": pl.Boolean, "status": pl.String, "error": pl.String, "truncated_chars": pl.Int64,
    "model_identity": pl.String,
}


@dataclass
class CallContext:
    """Who is calling: recorded on every telemetry row of the call."""

    run_id: str
    stage: str
    trajectory_id: str | None = None
    truncated_chars: int = 0


@lru_cache(maxsize=64)
def _validator(schema_json: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads(schema_json))


def schema_errors(schema: dict, value) -> list[str]:
    """Structural errors of `value` against a JSON schema, one readable line each (sorted by path)."""
    validator = _validator(canonical_json(schema))
    errors = sorted(validator.iter_errors(value), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"at {'/'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}" for e in errors]


def parse_json_reply(text: str) -> object:
    """The JSON object in a reply; tolerates a Markdown code fence around it."""
    stripped = text.strip()
    if stripped.startswith("```"):
        stripped = stripped.split("\n", 1)[-1].rsplit("```", 1)[0]
    return json.loads(stripped)


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

    def request(self, messages: list[dict], schema: dict) -> dict:
        """The backend request for `messages` (deterministic settings, JSON output as configured)."""
        request = {"model": self.config.model, "messages": messages, "temperature": self.config.temperature,
                   "max_tokens": self.config.max_output_tokens}
        if self.config.seed is not None:
            request["seed"] = self.config.seed
        kind = self.config.response_format or getattr(self.backend, "response_format", "json_schema")
        if kind == "json_schema":
            request["response_format"] = {"type": "json_schema",
                                          "json_schema": {"name": "reply", "schema": schema, "strict": False}}
        elif kind == "json_object_schema":
            request["response_format"] = {"type": "json_object", "schema": schema}
        elif kind == "json_object":
            request["response_format"] = {"type": "json_object"}
        return request

    async def complete_json(self, messages: list[dict], schema: dict, prompt_version: str, context: CallContext,
                            check: Callable[[object], list[str]] | None = None) -> object:
        """A reply valid against `schema` and `check`, re-asking with the errors appended when it is not."""
        conversation = list(messages)
        errors: list[str] = []
        for _ in range(self.config.validation_retries + 1):
            completion, row = await self._complete(self.request(conversation, schema), prompt_version, context)
            try:
                value = parse_json_reply(completion.text)
                errors = schema_errors(schema, value)
                if not errors and check is not None:
                    errors = check(value)
            except json.JSONDecodeError as exc:
                errors = [f"the reply is not JSON ({exc.msg} at character {exc.pos})"]
            if not errors:
                return value
            row["status"], row["error"] = "invalid", "; ".join(errors)[:1000]
            conversation = self.retry_conversation(messages, completion.text, errors)
        raise LLMOutputError(f"{context.stage} reply for {context.trajectory_id or 'the request'} stayed invalid after "
                             f"{self.config.validation_retries + 1} attempts: {'; '.join(errors)[:300]}")

    def retry_conversation(self, messages: list[dict], reply: str, errors: list[str]) -> list[dict]:
        """`messages`, the invalid reply and its structural errors (at most MAX_LISTED_ERRORS lines).

        Only the latest reply is quoted, so retries do not grow the prompt; when even that one would not
        fit the context window next to a new reply, the errors alone are appended.
        """
        listed = [f"- {e}" for e in errors[:MAX_LISTED_ERRORS]]
        if len(errors) > MAX_LISTED_ERRORS:
            listed.append(f"- and {len(errors) - MAX_LISTED_ERRORS} more problems of the same kinds")
        feedback = {"role": "user", "content": "That reply does not follow the required JSON structure:\n"
                    + "\n".join(listed) + "\nReply again with only a JSON object that fixes every listed problem."}
        quoted = list(messages) + [{"role": "assistant", "content": reply}, feedback]
        prompt_tokens = sum(len(m["content"]) for m in quoted) / self.config.chars_per_token
        if prompt_tokens + self.config.max_output_tokens <= self.config.context_window:
            return quoted
        return list(messages) + [feedback]

    async def _complete(self, request: dict, prompt_version: str, context: CallContext) -> tuple[Completion, dict]:
        """One response (from the cache or the backend, with transport retries) and its telemetry row."""
        identity = getattr(self.backend, "identity", None)
        key_input = cache_key_input(self.backend.name, identity, prompt_version, request)
        started = time.perf_counter()
        row = {"call_id": uuid.uuid4().hex, "run_id": context.run_id, "stage": context.stage,
               "trajectory_id": context.trajectory_id, "backend": self.backend.name, "model": self.config.model,
               "prompt_version": prompt_version, "tokens_in": 0, "tokens_cached_in": 0, "tokens_out": 0,
               "tokens_reasoning": 0, "latency_ms": 0.0, "cache_hit": False, "status": "ok", "error": None,
               "truncated_chars": context.truncated_chars, "model_identity": identity}
        self.calls.append(row)
        cached = self.cache.get(key_input) if self.cache is not None else None
        if cached is not None:
            row.update(cache_hit=True, latency_ms=(time.perf_counter() - started) * 1000)
            return cached, row
        # Latency is time in flight at the backend (every attempt), not time queued for a slot or backing off.
        in_flight = 0.0
        delay = self.config.backoff_s
        for attempt in range(self.config.transport_retries + 1):
            try:
                async with self._limit:
                    await self._wait_for_rate_limit()
                    sent = time.perf_counter()
                    try:
                        completion = await asyncio.wait_for(self.backend.complete(request), self._timeout_s)
                    finally:
                        in_flight += time.perf_counter() - sent
                break
            except DxrError as exc:  # the backend refused the request (bad key, 4xx): retrying cannot help
                row.update(status="rejected", error=str(exc)[:1000], latency_ms=in_flight * 1000)
                raise
            except (TransportError, TimeoutError) as exc:
                message = str(exc) or f"timeout after {self._timeout_s}s"
                timed_out = isinstance(exc, TimeoutError) or isinstance(exc.__cause__, TimeoutError)
                if attempt == self.config.transport_retries or (timed_out and not self._retry_timeouts):
                    row.update(status="transport_error", error=message[:1000], latency_ms=in_flight * 1000)
                    raise TransportError(f"{context.stage}: gave up after {attempt + 1} attempts: {message}") from exc
                # A server that says when to come back (Retry-After, capped by the backend) is not asked sooner.
                await asyncio.sleep(max(delay, getattr(exc, "retry_after", None) or 0.0))
                delay *= 2
        row.update(tokens_in=completion.tokens_in, tokens_cached_in=completion.tokens_cached_in,
                   tokens_out=completion.tokens_out, tokens_reasoning=completion.tokens_reasoning,
                   latency_ms=in_flight * 1000)
        if self.cache is not None:
            self.cache.put(key_input, completion)
        return completion, row

    def telemetry(self) -> pl.DataFrame:
        """Every call so far as `llm_calls` rows."""
        return pl.DataFrame(self.calls, schema=CALL_COLUMNS)

    async def close(self) -> None:
        await self.backend.close()
