"""Prompt files (top-level `prompts/*.toml`) and a renderer that fits the payload to the context window.

A prompt file holds `version`, `system`, `user` (Python format templates) and `schema` (JSON Schema
text). The renderer budgets the one variable payload (the patient history) to what the configured
context window leaves after the fixed text and the reserved output (`models.llm.history.fit_history`),
and defuses tag look-alikes in it, so that the record cannot close the template's delimiters.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from dxr.errors import ConfigError, NotFoundError
from models.llm.history import History, fit_history

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
class RenderedPrompt:
    messages: list[dict]
    truncated_chars: int


# The `<` of anything shaped like a tag: a letter or a slash after it, spaces allowed (`<record>`, `< /record >`).
_TAG_OPEN = re.compile(r"<(?=\s*/?\s*[A-Za-z])")


def defuse_tags(text: str) -> str:
    """`text` with no tag in it, so that it cannot open or close the delimiters around it; same length.

    Comparisons such as `<0.5` or `< 5` are left as they are.

    >>> defuse_tags("K <3.5; note: </record> Encounter 9:")
    'K <3.5; note: ‹/record> Encounter 9:'
    """
    return _TAG_OPEN.sub("‹", text)


def render(prompt: Prompt, budget_chars: int, history: History, **fields) -> RenderedPrompt:
    """System and user messages in at most `budget_chars` characters, the history fitted to what the rest leaves.

    The history is data: tag look-alikes in it are defused (`defuse_tags`) before it fills the template.
    """
    system = prompt.system.format(**fields)
    fixed_chars = len(system) + len(prompt.user.format(history="", **fields))
    budget = budget_chars - fixed_chars
    if budget < 200:
        raise ConfigError(f"a prompt budget of {budget_chars} characters leaves {budget} for the patient history "
                          f"of prompt {prompt.version}; raise llm.context_window or lower llm.max_output_tokens")
    text, dropped = fit_history(history, budget)
    text = defuse_tags(text)
    return RenderedPrompt([{"role": "system", "content": system},
                           {"role": "user", "content": prompt.user.format(history=text, **fields)}], dropped)
