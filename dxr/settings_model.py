"""The base of every settings model (`dxr.config.Settings` and each of its sections)."""

from __future__ import annotations

from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def is_number(annotation: Any) -> bool:
    """Whether a field holds an int or a float, possibly optional (`bool` is no number here).

    >>> [is_number(t) for t in (int, float, int | None, bool, str, list[int])]
    [True, True, True, False, False, False]
    """
    if get_origin(annotation) in (Union, UnionType):
        return any(is_number(member) for member in get_args(annotation))
    return annotation in (int, float)


def is_boolean(annotation: Any) -> bool:
    """Whether a field holds a bool, possibly optional.

    >>> [is_boolean(t) for t in (bool, bool | None, int, str)]
    [True, True, False, False]
    """
    if get_origin(annotation) in (Union, UnionType):
        return any(is_boolean(member) for member in get_args(annotation))
    return annotation is bool


class SettingsModel(BaseModel):
    """Unknown keys fail, and so do a boolean given for a number and a number for a boolean: pydantic's lax mode
    would read `seed = true` as 1 (bool is an int to Python), a typo that would train with seed 1 unseen, and
    `refresh = 1` as true. Numbers and booleans written in the TOML file and the strings of DXR_* variables ("7",
    "true", "1") are read as before."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number_nor_number_for_a_boolean(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and is_number(cls.model_fields[info.field_name].annotation):
            raise ValueError("a boolean is not a number: write a number (true and false are not read as 1 and 0)")
        if isinstance(value, int | float) and not isinstance(value, bool) and is_boolean(
                cls.model_fields[info.field_name].annotation):
            raise ValueError("a number is not a boolean: write true or false (1 and 0 are not read as true and false)")
        return value
