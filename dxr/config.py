"""Settings: one optional TOML file plus DXR_* environment variables, validated by pydantic.

Precedence (highest first): environment (`DXR_DATA_DIR`, `DXR_SEED`, ...), the TOML file named by
`DXR_CONFIG` (default `./dxr.toml` when present), then the defaults below.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError, TomlConfigSettingsSource

from dxr.errors import ConfigError, InputError
from dxr.settings_model import SettingsModel
from models.llm.config import LLMConfig
from models.prior.config import PriorConfig
from tools.config import ToolsConfig
from warehouse.choices import FORECAST_SPLITS, HARMONIZATIONS, TARGET_RULES, pattern

# A DuckDB memory limit, e.g. 2GB or 512MiB.
MEMORY_LIMIT_PATTERN = r"^\d+(\.\d+)?\s*(KB|MB|GB|TB|KiB|MiB|GiB|TiB)$"
# A backfill's name and a serve's (`dxr serve --name`) make Prefect deployment names and artifact keys.
DEPLOYMENT_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]*$"


class SynthConfig(SettingsModel):
    """Defaults of the embedded synthetic dataset."""

    patients: int = Field(5000, ge=1, description="patients in the default synthetic dataset")
    # Shards bound memory: one shard of patients is simulated and written at a time.
    shard_size: int = Field(2000, ge=1)
    oracle_draws: int = Field(200, ge=200, description="Monte Carlo draws per trajectory (spec: >= 200)")


class CohortConfig(SettingsModel):
    """Defaults for `dxr cohort build`."""

    target: str = Field("final", pattern=pattern(TARGET_RULES))
    harmonize: str = Field("native", pattern=pattern(HARMONIZATIONS))
    # A trajectory needs at least this many encounters before its target.
    min_history: int = Field(1, ge=0)
    # Trajectories per pre-target shard; later stages run one Prefect task per shard.
    shard_size: int = Field(500, ge=1)
    # DuckDB memory of a build; beyond it DuckDB spills to a scratch directory beside the gold store. DuckDB gets at
    # most 80% of what the machine or its container allows (duck.memory_limit_within_reach).
    memory_limit: str = Field("2GB", pattern=MEMORY_LIMIT_PATTERN)


class ForecastConfig(SettingsModel):
    """How `dxr forecast` runs a cohort's shards."""

    # Two at a time on two cores: one shard's featurization (polars) overlaps another's network (one
    # torch thread); benchmarks/prior.py measures it. LLM systems and `--limit` runs go one at a time.
    # Each worker runs `prior.threads` torch threads: keep workers × threads at most the cores.
    shard_workers: int = Field(2, ge=1, description="shards of a model or baseline forecast run at once")


class BackfillConfig(SettingsModel):
    """One scheduled cohort backfill served by `dxr serve` (a `[[backfills]]` table in the TOML file)."""

    name: str = Field(..., pattern=DEPLOYMENT_NAME_PATTERN, description="deployment name, e.g. nightly")
    cohort: str = Field(..., description="cohort name or id")
    systems: list[str] = Field(["global_frequency", "repeat_history", "ehr_prior"], min_length=1,
                               description="forecast in this order into one run, then evaluated")
    split: str = Field("held_out", pattern=pattern(FORECAST_SPLITS))
    k: int = Field(20, ge=1)
    limit: int | None = Field(None, ge=1)
    cron: str = Field(..., description="five-field cron expression, e.g. '0 2 * * *'")
    timezone: str = Field("UTC", description="IANA time zone the cron expression is read in")
    refresh: bool = Field(False, description="each firing first builds the cohort again if its dataset was "
                                             "registered again since, older rules cut it or a build of it was cut "
                                             "short, and trains its learned systems that have no model for the cohort")

    @field_validator("cron", "timezone")
    @classmethod
    def _schedulable(cls, value: str, info) -> str:
        # Prefect's own schedule model decides what its scheduler accepts; imported only when a
        # backfill is configured, so other commands do not pay for importing Prefect.
        from prefect.client.schemas.schedules import CronSchedule

        try:
            CronSchedule(**{"cron": "0 0 * * *", "timezone": "UTC", info.field_name: value})
        except ValidationError as exc:
            raise ValueError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
        return value

    @field_validator("systems")
    @classmethod
    def _forecastable_in_order(cls, systems: list[str]) -> list[str]:
        # Checked with the settings, so that `dxr config show` refuses what `dxr serve` would.
        from models.registry import check_system_order

        try:
            check_system_order(tuple(systems))
        except InputError as exc:
            raise ValueError(str(exc)) from None
        return systems


class Settings(BaseSettings, SettingsModel):
    """Everything configurable. Secrets never live here: they come from the environment only."""

    model_config = SettingsConfigDict(env_prefix="DXR_", env_nested_delimiter="__", extra="forbid")

    data_dir: Path = Field(Path("data"), description="warehouse root (forecasting and gold stores)")
    seed: int = Field(7, description="global seed: splits, generator, shuffles")
    synth: SynthConfig = SynthConfig()
    cohort: CohortConfig = CohortConfig()
    forecast: ForecastConfig = ForecastConfig()
    prior: PriorConfig = PriorConfig()
    tools: ToolsConfig = ToolsConfig()
    llm: LLMConfig = LLMConfig()
    backfills: list[BackfillConfig] = Field([], description="scheduled cohort backfills served by `dxr serve`")

    @field_validator("backfills")
    @classmethod
    def _unique_backfill_names(cls, backfills: list[BackfillConfig]) -> list[BackfillConfig]:
        names = [b.name for b in backfills]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"backfill names must be unique; repeated: {', '.join(repeated)}")
        return backfills

    @property
    def forecast_dir(self) -> Path:
        return self.data_dir / "forecast"

    @property
    def gold_dir(self) -> Path:
        return self.data_dir / "gold"

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        # Precedence: explicit arguments, then DXR_* variables, then the TOML file.
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=config_path()))


DEFAULT_CONFIG_FILE = "dxr.toml"  # in the current directory


def config_path() -> Path | None:
    """The TOML file in force: `DXR_CONFIG` when set, else `./dxr.toml` when present."""
    named = os.environ.get("DXR_CONFIG")
    if named:
        path = Path(named)
        if path.is_dir():
            raise ConfigError(f"DXR_CONFIG points to {path}, which is a directory: name the TOML file in it or unset "
                              "DXR_CONFIG")
        if not path.is_file():
            raise ConfigError(f"DXR_CONFIG points to {path}, which does not exist: create it or unset DXR_CONFIG")
        return path
    default = Path(DEFAULT_CONFIG_FILE)
    return default if default.is_file() else None


def check_variables(settings: Settings) -> None:
    """Refuse a DXR_* variable that sets nothing: pydantic-settings ignores one whose first part names no
    setting, so a typo such as DXR_PRIOR_EPOCHS (one underscore) would leave the default in force unseen."""
    # A key may live in any variable the configuration names, DXR_* included.
    key_variables = {settings.llm.api_key_env, settings.tools.embedding.api_key_env, settings.tools.web.api_key_env}
    for variable in sorted(os.environ):
        setting = variable[len("DXR_"):].lower()
        if (not variable.upper().startswith("DXR_") or variable.upper() == "DXR_CONFIG" or variable in key_variables
                or setting.split("__")[0] in Settings.model_fields):
            continue
        section = next((f for f in Settings.model_fields
                        if setting.startswith(f"{f}_") and isinstance(getattr(settings, f), BaseModel)), None)
        meant = f" (did you mean DXR_{section.upper()}__{variable[len(f'DXR_{section}_'):]}?)" if section else ""
        raise ConfigError(f"{variable} sets no setting{meant}: DXR_* variables name a setting, nested with __; "
                          "`dxr config show` lists the valid keys")


def _source_of(error: dict, path: Path | None) -> str:
    """Where the value of the setting a validation `error` is about came from: DXR_* variables take precedence over
    the TOML file `path`. A variable holding a section's or list's JSON is the source of the keys it holds: it is
    merged key by key with the file's section (DXR_SYNTH='{"shard_size": 9}' beside the file's `[synth] patients =
    "many"` leaves that bad value the file's), and replaces the file's whole list. The setting's own variable is
    its source, unless it holds a table: then that table, the variables under the setting (DXR_BACKFILLS__0='{}';
    DXR_LLM__CONTEXT_WINDOW for a check of the whole `llm` section) and the file's table there are merged, and each
    that is given is named."""
    # A missing key is in no source: the section or list that lacks it is the one to name.
    loc = error["loc"][:-1] if error["type"] == "missing" else error["loc"]
    variables = {variable.upper(): variable for variable in os.environ}
    for depth in range(len(loc) - 1, 0, -1):
        variable = variables.get("DXR_" + "__".join(str(part) for part in loc[:depth]).upper())
        if variable and _holds(json.loads(os.environ[variable]), loc[depth:]):
            return variable
    own = "DXR_" + "__".join(str(part) for part in loc).upper()
    if own in variables and not _is_table(os.environ[variables[own]]):
        return variables[own]
    sources = sorted(original for upper, original in variables.items()
                     if loc and (upper == own or upper.startswith(f"{own}__")))
    if path and (not sources or isinstance(_value_at(tomllib.loads(path.read_text(encoding="utf-8")), loc), dict)):
        sources.append(str(path))
    return ", ".join(sources) or "DXR_* variables"


def _item_variables(error: dict) -> list[str]:
    """The variables under a list setting (DXR_BACKFILLS__0, DXR_BACKFILLS__0__NAME) that a validation `error` of
    that list is about; empty for any other error. pydantic-settings sets no list item by index: it makes a table of
    them, which the list refuses as no list."""
    if error["type"] not in ("list_type", "tuple_type") or not isinstance(error.get("input"), dict):
        return []
    under = "DXR_" + "__".join(str(part) for part in error["loc"]).upper() + "__"
    return sorted(variable for variable in os.environ if variable.upper().startswith(under))


def _is_table(text: str) -> bool:
    """Whether a variable's text is a JSON object, which pydantic-settings merges with the other sources' table."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _holds(value, keys: tuple) -> bool:
    """Whether the JSON `value` of a section's or list's variable sets the setting at `keys` under it."""
    for key in keys:
        if isinstance(value, list):  # pydantic-settings replaces the file's list with the variable's whole
            return True
        if not isinstance(value, dict) or key not in value:
            return False
        value = value[key]
    return True


def _value_at(value, keys: tuple):
    """The value a TOML document or a JSON value holds at `keys` (section names and list indexes), else None."""
    for key in keys:
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def load_settings(**overrides) -> Settings:
    """Validated settings; a bad key, type or TOML syntax, or a DXR_* variable naming no setting, raises
    ConfigError naming it."""
    path = config_path()
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        if items := _item_variables(first):
            whole = "DXR_" + "__".join(str(part) for part in first["loc"]).upper()
            raise ConfigError(f"invalid setting '{where}' (from {', '.join(items)}): a variable cannot set one item of "
                              f"a list; give the whole list as JSON in {whole} (as `dxr config show` prints it) or in "
                              "the TOML file") from exc
        raise ConfigError(
            f"invalid setting '{where}' (from {_source_of(first, path)}): "
            f"{first['msg'].removeprefix('Value error, ')} "
            f"(got {first.get('input')!r}); "
            "`dxr config show` lists the valid keys and defaults"
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML ({exc}): fix the syntax there") from exc
    except SettingsError as exc:  # a DXR_* variable holding a section or list is parsed as JSON, e.g. DXR_SYNTH
        field = re.search(r'field "(\w+)"', str(exc))
        name = field.group(1) if field else "?"
        variables = sorted(v for v in os.environ if v.upper() == f"DXR_{name.upper()}"
                           or v.upper().startswith(f"DXR_{name.upper()}__"))
        source = ", ".join(variables) or "DXR_* variables"
        raise ConfigError(f"invalid setting '{name}' (from {source}): not valid JSON ({exc.__cause__}); give a JSON "
                          f"value, or set one key as DXR_{name.upper()}__<KEY>=value") from exc
    except UnicodeDecodeError as exc:  # TOML is UTF-8; an editor may have saved the file as Latin-1
        raise ConfigError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}): save it as UTF-8") from exc
    check_variables(settings)
    return settings
