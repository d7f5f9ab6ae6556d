"""Prompt files (top-level `prompts/*.toml`) and a renderer that fits the payload to the context window.

A prompt file holds `version`, `system`, `user` (Python format templates) and `schema` (JSON Schema
text). The renderer budgets the one variable payload (the patient history) to what the configured
context window leaves after the fixed text and the reserved output, keeping the most recent part.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from dxr.errors import ConfigError, NotFoundError
from models.llm.config import LLMConfig

PROMPTS_DIR = Path(__file__).resolve().parents[2] / "prompts"


@dataclass(frozen=True)
class Prompt:
    name: str
    version: str
    system: str
    user: str
    schema: dict


@lru_cache(maxsize=None)
def load_prompt(name: str) -> Prompt:
    path = PROMPTS_DIR / f"{name}.toml"
    if not path.is_file():
        available = sorted(p.stem for p in PROMPTS_DIR.glob("*.toml"))
        raise NotFoundError(f"prompt {name!r} not found in {PROMPTS_DIR}; available: {', '.join(available)}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        return Prompt(name, data["version"], data["system"], data["user"], json.loads(data["schema"]))
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, KeyError) as exc:
        raise ConfigError(f"prompt file {path} is malformed ({type(exc).__name__}: {exc}); it needs version, "
                          "system, user and schema (JSON text)") from exc


@dataclass
class History:
    """A rendered pre-target record: a fixed header plus blocks (encounters) from oldest to newest."""

    header: str
    blocks: list[str]

    @property
    def text(self) -> str:
        return "\n\n".join([self.header, *self.blocks])


def fit_history(history: History, budget_chars: int) -> tuple[str, int]:
    """The history within `budget_chars`, dropping the oldest blocks first; returns (text, chars dropped).

    >>> fit_history(History("Sex: F", ["x" * 50, "new visit"]), 60)
    ('Sex: F\\n\\n[earlier history omitted: 52 characters]\\n\\nnew visit', 52)
    """
    full = history.text
    if len(full) <= budget_chars:
        return full, 0
    kept: list[str] = []
    for block in reversed(history.blocks):
        dropped = len(full) - len("\n\n".join([history.header, block, *kept]))
        marker = f"[earlier history omitted: {dropped} characters]"
        if len("\n\n".join([history.header, marker, block, *kept])) > budget_chars:
            break
        kept.insert(0, block)
    if not kept:
        # Even the newest block alone is too long: keep its end, which is its most recent part.
        newest = history.blocks[-1] if history.blocks else ""
        room = max(budget_chars - len(history.header) - 60, 0)
        tail = newest[len(newest) - room:] if room else ""
        dropped = len(full) - len(history.header) - len(tail) - 2
        marker = f"[earlier history omitted: {dropped} characters]"
        return "\n\n".join(p for p in (history.header, marker, tail) if p), dropped
    body = "\n\n".join(kept)
    dropped = len(full) - len(history.header) - len(body) - 2
    return "\n\n".join([history.header, f"[earlier history omitted: {dropped} characters]", body]), dropped


@dataclass
class RenderedPrompt:
    messages: list[dict]
    truncated_chars: int


def render(prompt: Prompt, config: LLMConfig, history: History, **fields) -> RenderedPrompt:
    """System and user messages with the history fitted to the context window left after the rest."""
    system = prompt.system.format(**fields)
    fixed_chars = len(system) + len(prompt.user.format(history="", **fields))
    budget = int((config.context_window - config.max_output_tokens) * config.chars_per_token) - fixed_chars
    if budget < 200:
        raise ConfigError(f"llm.context_window {config.context_window} leaves {budget} characters for the patient "
                          f"history of prompt {prompt.version}; raise it or lower llm.max_output_tokens")
    text, dropped = fit_history(history, budget)
    return RenderedPrompt([{"role": "system", "content": system},
                           {"role": "user", "content": prompt.user.format(history=text, **fields)}], dropped)
