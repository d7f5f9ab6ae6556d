"""Backends: one async `complete(request) -> Completion` each, chosen by configuration.

A request is a plain JSON-serializable dict in the OpenAI chat-completions shape (model, messages,
temperature, seed, max_tokens, response_format); its canonical hash identifies it everywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import aiohttp

from dxr.errors import ConfigError, InputError, NotFoundError


class TransportError(Exception):
    """A failure worth retrying: timeout, connection error, 429 or a 5xx answer."""


@dataclass
class Completion:
    text: str
    tokens_in: int = 0
    tokens_cached_in: int = 0
    tokens_out: int = 0
    tokens_reasoning: int = 0

    def to_json(self) -> dict:
        return asdict(self)


class Backend(Protocol):
    name: str

    async def complete(self, request: dict) -> Completion: ...

    async def close(self) -> None: ...


def canonical_json(value) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def request_hash(request: dict) -> str:
    """Content address of a request (sha256 of its canonical JSON)."""
    return hashlib.sha256(canonical_json(request).encode("utf-8")).hexdigest()


def completion_from_openai(body: dict) -> Completion:
    """Text and token counts of an OpenAI-style chat completion body."""
    try:
        text = body["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError) as exc:
        raise TransportError(f"malformed completion body (no choices[0].message.content): {str(body)[:200]}") from exc
    usage = body.get("usage") or {}
    prompt_details = usage.get("prompt_tokens_details") or {}
    output_details = usage.get("completion_tokens_details") or {}
    return Completion(text=text, tokens_in=int(usage.get("prompt_tokens") or 0),
                      tokens_cached_in=int(prompt_details.get("cached_tokens") or 0),
                      tokens_out=int(usage.get("completion_tokens") or 0),
                      tokens_reasoning=int(output_details.get("reasoning_tokens") or 0))


class OpenAIBackend:
    """Any OpenAI-compatible `/chat/completions` endpoint over HTTP (OpenAI, vLLM, llama.cpp, Ollama)."""

    name = "openai"

    def __init__(self, base_url: str, timeout_s: float, api_key: str | None = None):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def complete(self, request: dict) -> Completion:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)
        try:
            async with self._session.post(self.url, json=request) as response:
                if response.status == 429 or response.status >= 500:
                    raise TransportError(f"HTTP {response.status} from {self.url}: {(await response.text())[:200]}")
                if response.status in (401, 403):
                    raise ConfigError(f"HTTP {response.status} from {self.url}: check the API key in the "
                                      "environment variable named by llm.api_key_env")
                if response.status >= 400:
                    raise InputError(f"HTTP {response.status} from {self.url} (request rejected): "
                                     f"{(await response.text())[:300]}")
                body = await response.json(content_type=None)
        except TimeoutError as exc:
            raise TransportError(f"timeout after {self.timeout.total}s waiting for {self.url}") from exc
        except aiohttp.ClientError as exc:
            raise TransportError(f"{type(exc).__name__} talking to {self.url}: {exc}") from exc
        return completion_from_openai(body)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class UnrecordedRequestError(NotFoundError):
    """The replay backend was asked something it has no recording for."""


class ReplayBackend:
    """Answers from recorded request/response pairs (one JSON object per line of a JSONL file)."""

    name = "replay"

    def __init__(self, path: Path):
        self.path = Path(path)
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
