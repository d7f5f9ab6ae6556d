"""Content-addressed response cache: one JSON file per request, written atomically.

Safe under concurrent processes: each writer renames its own temporary file into place, so a
reader sees either nothing or a complete file; two writers of one key write identical content.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from models.llm.backends import Completion, canonical_json


def cache_key_input(backend: str, identity: str | None, prompt_version: str, request: dict, serving: dict) -> str:
    """Everything that determines a response: backend, which model answers (`Backend.identity`: a server's URL,
    a GGUF's fingerprint), how it is served beyond the request (`serving`: the context window a full window cuts
    a reply off or refuses a prompt at, the embedded server's chat template, system-message fold and llama-cpp-python
    version), prompt version, model name, messages, parameters."""
    return canonical_json({"backend": backend, "identity": identity, "serving": serving,
                           "prompt_version": prompt_version, "request": request})


class ResponseCache:
    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, key_input: str) -> Path:
        digest = hashlib.sha256(key_input.encode("utf-8")).hexdigest()
        return self.root / digest[:2] / f"{digest}.json"

    def get(self, key_input: str) -> Completion | None:
        path = self.path(key_input)
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        return Completion(**stored["response"])

    def put(self, key_input: str, completion: Completion) -> None:
        path = self.path(key_input)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump({"key_input": key_input, "response": completion.to_json()}, handle, ensure_ascii=False)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
