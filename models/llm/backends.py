"""Backends: one async `complete(request) -> Completion` each, chosen by configuration.

A request is a plain JSON-serializable dict in the OpenAI chat-completions shape (model, messages,
temperature, seed, max_tokens or max_completion_tokens, response_format); its canonical hash identifies it
everywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import aiohttp

from dxr.errors import ConfigError, InputError


class TransportError(Exception):
    """A failure worth retrying: timeout, connection error, HTTP 408, 429 or 5xx, or a body that is not a completion.

    `retry_after` is the wait in seconds the server asked for (its `Retry-After` header), when it gave one.
    """

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class ContentRefusalError(InputError):
    """The endpoint's content filter refused one request's prompt (a record whose text it flags): a problem of
    this request, not of the run, whose other records it lets through."""


class UnreachableError(TransportError):
    """No connection to the endpoint could be made (refused, unknown host, no route, a bad certificate).

    Retried like any transport error (a server may be restarting), but after the last retry it is the run's
    failure, not the request's: every other request of the run would wait out the same retries and fail alike.
    """


class EndedServerError(UnreachableError):
    """The embedded server's process has ended: no retry can reach it, so the run stops at once."""


class ContextLengthError(InputError):
    """One request's prompt left too little of the model's context window for the reply: the endpoint refused
    it, or cut the reply off at the full window.

    A problem of this request, not of the run: a shorter prompt can succeed. `prompt_tokens` and
    `context_window` are the server's counts, when it gives them.
    """

    def __init__(self, message: str, prompt_tokens: int | None = None, context_window: int | None = None):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.context_window = context_window


@dataclass
class Completion:
    text: str
    tokens_in: int = 0
    tokens_cached_in: int = 0
    tokens_out: int = 0
    tokens_reasoning: int = 0
    # Why generation stopped, as the endpoint says ("stop", "length", ...); None when it does not say.
    finish_reason: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


class Backend(Protocol):
    name: str
    # Which model answers (a server's base URL, a GGUF file's fingerprint, a replay file): part of every
    # cache key and telemetry row, because the configured model name alone does not say.
    identity: str | None

    async def complete(self, request: dict) -> Completion: ...

    async def close(self) -> None: ...


def canonical_json(value) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def request_hash(request: dict) -> str:
    """Content address of a request (sha256 of its canonical JSON)."""
    return hashlib.sha256(canonical_json(request).encode("utf-8")).hexdigest()


def completion_from_openai(body) -> Completion:
    """Text and token counts of an OpenAI-style chat completion body."""
    try:
        text = body["choices"][0]["message"]["content"] or ""
        finish_reason = body["choices"][0].get("finish_reason")
        usage = body.get("usage") or {}
        prompt_details = usage.get("prompt_tokens_details") or {}
        output_details = usage.get("completion_tokens_details") or {}
        if not isinstance(text, str):
            raise TypeError(f"content is a {type(text).__name__}")
        return Completion(text=text, tokens_in=int(usage.get("prompt_tokens") or 0),
                          tokens_cached_in=int(prompt_details.get("cached_tokens") or 0),
                          tokens_out=int(usage.get("completion_tokens") or 0),
                          tokens_reasoning=int(output_details.get("reasoning_tokens") or 0),
                          finish_reason=finish_reason if isinstance(finish_reason, str) else None)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        raise TransportError(f"malformed completion body (no text in choices[0].message.content, or token counts "
                             f"that are not numbers: {exc}): {str(body)[:200]}") from exc


def body_preview(raw: bytes, limit: int = 200) -> str:
    """The start of a response body on one line, undecodable bytes replaced, for an error message."""
    text = " ".join(raw[:limit * 4].decode("utf-8", errors="replace").split())
    return repr(text[:limit] + ("…" if len(text) > limit or len(raw) > limit * 4 else ""))


def json_or_none(raw: bytes):
    """The JSON value of a body, or None when it is not UTF-8 JSON."""
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None


def server_message(raw: bytes) -> str:
    """The error text of a refusal: OpenAI-style `error.message` (or `error`, `detail`, `message`), else the body."""
    body = json_or_none(raw)
    if isinstance(body, dict):
        error = body.get("error")
        found = error.get("message") if isinstance(error, dict) else error
        found = found or body.get("detail") or body.get("message")
        if found:
            return " ".join(str(found).split())[:300]
    return " ".join(raw.decode("utf-8", errors="replace").split())[:300] or "(empty body)"


# Context-length refusals of OpenAI, vLLM, llama-cpp-python's server ("This model's maximum context length
# is 8192 tokens. However, you requested 9000 tokens (7500 in the messages, 1500 in the completion)") and
# llama.cpp's llama-server ("exceed_context_size_error", with n_prompt_tokens and n_ctx).
CONTEXT_REFUSAL = re.compile(r"context[ _](length|window|size)|maximum context|exceeds? (the )?(available )?context"
                             r"|prompt is too long|too many (input )?tokens", re.IGNORECASE)
PROMPT_TOKENS = re.compile(r"\((\d+) in the messages|(\d+) in your prompt|messages resulted in (\d+) tokens"
                           r"|request has (\d+) input tokens")
WINDOW_TOKENS = re.compile(r"maximum context length is (\d+)")
# Content-filter refusals of one prompt: OpenAI's ("Invalid prompt: your prompt was flagged as potentially violating
# our usage policy", code `invalid_prompt`) and Azure OpenAI's (code `content_filter`: "The response was filtered
# due to the prompt triggering Azure OpenAI's content management policy").
CONTENT_REFUSAL = re.compile(r"content[ _]filter|content management policy|flagged as potentially violating"
                             r"|content[ _]policy[ _]violation", re.IGNORECASE)
CONTENT_REFUSAL_CODES = {"content_filter", "content_policy_violation", "invalid_prompt"}


def error_field(raw: bytes, name: str) -> str | None:
    """The `error.<name>` (`code`, `param`) of an OpenAI-style refusal body, when it is a string."""
    body = json_or_none(raw)
    error = body.get("error") if isinstance(body, dict) else None
    value = error.get(name) if isinstance(error, dict) else None
    return value if isinstance(value, str) else None


def context_counts(raw: bytes, message: str) -> tuple[int | None, int | None]:
    """(prompt tokens, context window) of a context-length refusal, each None when the server does not say."""
    body = json_or_none(raw)
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("n_prompt_tokens"), int):  # llama.cpp's llama-server
        return error["n_prompt_tokens"], error.get("n_ctx") if isinstance(error.get("n_ctx"), int) else None
    prompt = PROMPT_TOKENS.search(message)
    window = WINDOW_TOKENS.search(message)
    return (int(next(g for g in prompt.groups() if g)) if prompt else None,
            int(window.group(1)) if window else None)


# A server that asks for a longer pause than this is waited for this long (then asked again).
MAX_RETRY_AFTER_S = 60.0


def retry_after_seconds(value: str | None) -> float | None:
    """A `Retry-After` header in its seconds form, capped at MAX_RETRY_AFTER_S (None for a date or nothing).

    >>> retry_after_seconds("3"), retry_after_seconds("3600"), retry_after_seconds("Wed, 21 Oct 2026 07:28:00 GMT")
    (3.0, 60.0, None)
    """
    try:
        return min(max(float(value), 0.0), MAX_RETRY_AFTER_S) if value is not None else None
    except ValueError:
        return None


def http_refusal(url: str, status: int, raw: bytes, retry_after: str | None) -> Exception:
    """The error for an HTTP error status: retryable, this request's problem, or the whole run's.

    408, 429 (but an exhausted quota) and 5xx are worth retrying. A context-length refusal (or 413) is this
    request's: its prompt is too long; so is a content-filter refusal: its record's text was flagged. Every other
    refusal (bad key, used-up quota, unknown model or path, a parameter the endpoint does not take) would refuse
    every request of the run alike, so it is a configuration error that stops the run.
    """
    message = server_message(raw)
    where = f"HTTP {status} from {url}: {message}"
    # OpenAI's used-up quota: no retry can help, nor any other request.
    if status == 429 and error_field(raw, "code") == "insufficient_quota":
        return ConfigError(f"{where}; the API key's quota is used up: check the plan and billing of the key in the "
                           "environment variable named by llm.api_key_env")
    if status in (408, 429) or status >= 500:
        return TransportError(where, retry_after_seconds(retry_after))
    if status == 413 or CONTEXT_REFUSAL.search(message):
        return ContextLengthError(f"{where} (request rejected: the prompt is too long for the model's context)",
                                  *context_counts(raw, message))
    if CONTENT_REFUSAL.search(message) or error_field(raw, "code") in CONTENT_REFUSAL_CODES:
        return ContentRefusalError(f"{where} (request rejected: the endpoint's content filter refused this "
                                   "prompt; the run's other requests go on)")
    if status in (401, 403):
        fix = "check the API key in the environment variable named by llm.api_key_env"
    elif status == 404:
        fix = "check llm.base_url (the OpenAI-compatible base URL, usually ending in /v1) and llm.model"
    elif "max_completion_tokens" in message:  # OpenAI's reasoning models
        fix = ('the model takes max_completion_tokens instead of max_tokens: set '
               'llm.max_tokens_field = "max_completion_tokens"')
    elif error_field(raw, "param") == "temperature" or "temperature" in message:
        # OpenAI's reasoning models refuse the default temperature 0: "Unsupported value: 'temperature' does not
        # support 0 with this model. Only the default (1) value is supported."
        fix = ("the model refuses the temperature sent (llm.temperature, default 0; OpenAI's reasoning models take "
               "only 1): set llm.temperature to one it takes, e.g. DXR_LLM__TEMPERATURE=1")
    else:
        fix = "the endpoint refuses the request's parameters: check llm.model, llm.response_format and llm.base_url"
    return ConfigError(f"{where}; {fix}")


class OpenAIBackend:
    """Any OpenAI-compatible `/chat/completions` endpoint over HTTP (OpenAI, vLLM, llama.cpp, Ollama)."""

    name = "openai"

    def __init__(self, base_url: str, timeout_s: float, api_key: str | None = None):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.identity = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def complete(self, request: dict) -> Completion:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)
        try:
            async with self._session.post(self.url, json=request) as response:
                status, raw = response.status, await response.read()
                if status >= 400:
                    raise http_refusal(self.url, status, raw, response.headers.get("Retry-After"))
        except TimeoutError as exc:
            raise TransportError(f"timeout after {self.timeout.total}s waiting for {self.url}") from exc
        except aiohttp.ClientConnectorError as exc:
            raise UnreachableError(f"cannot connect to {self.url} ({type(exc).__name__}: {exc}): start the "
                                   "endpoint, or check llm.base_url and llm.backend") from exc
        except aiohttp.ClientError as exc:
            raise TransportError(f"{type(exc).__name__} talking to {self.url}: {exc}") from exc
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            # A proxy's error page or a garbled body: the next attempt may well get the real answer.
            raise TransportError(f"HTTP {status} from {self.url} is not a JSON completion ({type(exc).__name__}: "
                                 f"{exc}); the body starts {body_preview(raw)}") from exc
        return completion_from_openai(body)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class UnrecordedRequestError(ConfigError):
    """The replay backend was asked something it has no recording for: the run's recordings do not fit its
    requests (another prompt, model or setting), so the run fails rather than each request."""


class ReplayBackend:
    """Answers from recorded request/response pairs (one JSON object per line of a JSONL file)."""

    name = "replay"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.identity = str(self.path)
        if not self.path.is_file():
            raise ConfigError(f"replay file {self.path} does not exist: set llm.replay_file to a recorded JSONL file")
        self.responses: dict[str, Completion] = {}
        for number, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                pair = json.loads(line)
                self.responses[pair["request_hash"]] = Completion(**pair["response"])
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise InputError(f"{self.path} line {number} is not a recording "
                                 f"({{request_hash, request, response}}): {exc}") from exc
        self.calls = 0

    async def complete(self, request: dict) -> Completion:
        self.calls += 1
        key = request_hash(request)
        if key not in self.responses:
            raise UnrecordedRequestError(
                f"replay file {self.path} has no response for request {key} "
                f"(model {request.get('model')!r}, {len(request.get('messages', []))} messages): "
                "record it with models.llm.backends.append_recording or use a live backend")
        return self.responses[key]

    async def close(self) -> None:
        return None


def append_recording(path: Path, request: dict, response: Completion) -> str:
    """Add one request/response pair to a replay file; returns the request hash."""
    key = request_hash(request)
    with Path(path).open("a", encoding="utf-8") as handle:
        handle.write(canonical_json({"request_hash": key, "request": request, "response": response.to_json()}) + "\n")
    return key


def make_backend(config, data_dir: Path) -> Backend:
    """The backend named by an `LLMConfig` (the local one keeps its model and server log under `data_dir`)."""
    if config.backend == "openai":
        return OpenAIBackend(config.base_url, config.timeout_s, os.environ.get(config.api_key_env))
    if config.backend == "replay":
        if config.replay_file is None:
            raise ConfigError("llm.backend = 'replay' needs llm.replay_file (a recorded JSONL file)")
        return ReplayBackend(config.replay_file)
    from models.llm.local_server import LocalBackend, LocalServer, packaged_model_path

    model = config.local_model_path or packaged_model_path(Path(data_dir) / "models")
    server = LocalServer(model, config.context_window, config.local_threads,
                         Path(data_dir) / "logs" / "llama_server.log", config.local_startup_timeout_s)
    return LocalBackend(server, config.local_timeout_s)
