"""The base of every settings model (`dxr.config.Settings` and each of its sections)."""

from __future__ import annotations

from pathlib import Path
from types import NoneType, UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def members(annotation: Any) -> tuple:
    """The types a field's annotation allows: a union's members, else the annotation alone.

    >>> members(int | None), members(int)
    ((<class 'int'>, <class 'NoneType'>), (<class 'int'>,))
    """
    return get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)


def is_number(annotation: Any) -> bool:
    """Whether a field holds an int or a float, possibly optional (`bool` is no number here).

    >>> [is_number(t) for t in (int, float, int | None, bool, str, list[int])]
    [True, True, True, False, False, False]
    """
    return any(member in (int, float) for member in members(annotation))


def is_integer(annotation: Any) -> bool:
    """Whether a field holds an int, possibly optional, and no float.

    >>> [is_integer(t) for t in (int, int | None, float, int | float, bool, str)]
    [True, True, False, False, False, False]
    """
    allowed = members(annotation)
    return int in allowed and float not in allowed


def reads_null_text(annotation: Any) -> bool:
    """Whether a field may be null and holds no text (nor a path), so that the text `null` can only mean null there.

    >>> from typing import Literal
    >>> [reads_null_text(t) for t in (int | None, float | None, Literal["none"] | None, str | None, Path | None, int)]
    [True, True, True, False, False, False]
    """
    allowed = members(annotation)
    return NoneType in allowed and not any(member in (str, Path) for member in allowed)


def is_decimal(value: Any) -> bool:
    """Whether `value` is a number written with a decimal point: a TOML or JSON float, or such a variable's text.

    >>> [is_decimal(v) for v in (1.0, "1.0", " 2.50 ", 1, "1", "v1.0", True)]
    [True, True, True, False, False, False, False]
    """
    if isinstance(value, str) and "." in value:
        try:
            float(value)
        except ValueError:
            return False
        return True
    return isinstance(value, float)


def is_boolean(annotation: Any) -> bool:
    """Whether a field holds a bool, possibly optional.

    >>> [is_boolean(t) for t in (bool, bool | None, int, str)]
    [True, True, False, False]
    """
    return bool in members(annotation)


class SettingsModel(BaseModel):
    """Unknown keys fail, and so do a boolean given for a number, a number for a boolean and a decimal for an
    integer: pydantic's lax mode would read `seed = true` as 1 (bool is an int to Python), a typo that would train
    with seed 1 unseen, `refresh = 1` as true, and `patients = 1e3` or DXR_SEED=1.0 as an integer, so a setting
    mistaken for a fraction would pass. Numbers and booleans written in the TOML file and the strings of DXR_*
    variables ("7", "true", "1") are read as before; the text `null` unsets an optional setting that holds no text."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_value_of_another_kind(cls, value: Any, info: ValidationInfo) -> Any:
        annotation = cls.model_fields[info.field_name].annotation
        # A variable holds text and TOML has no null: `null`, as `dxr config show` prints it, unsets an optional
        # number or choice (DXR_LLM__SEED=null). A text or path setting keeps the text: a file may be named null.
        if value == "null" and reads_null_text(annotation):
            return None
        if isinstance(value, bool) and is_number(annotation):
            raise ValueError("a boolean is not a number: write a number (true and false are not read as 1 and 0)")
        if isinstance(value, int | float) and not isinstance(value, bool) and is_boolean(annotation):
            raise ValueError("a number is not a boolean: write true or false (1 and 0 are not read as true and false)")
        if is_decimal(value) and is_integer(annotation):
            raise ValueError("a decimal is not an integer: write a whole number without a decimal point (1.0 is not "
                             "read as 1)")
        return value
