"""Typed plugin options: a user's dict becomes a frozen dataclass, unknown keys are an error."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

OptionsT = TypeVar("OptionsT")


def parse_options(options_cls: type[OptionsT], raw: Mapping[str, Any], where: str) -> OptionsT:
    """`options_cls(**raw)`, after checking that every key is a field and every required field
    is present. `where` names the dict in error messages; value checks live in the class's
    `__post_init__`."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be a JSON object, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(options_cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; valid keys are {sorted(fields)}")
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in raw:
            raise ValueError(f"{where}: missing required key {name!r}")
    return options_cls(**raw)


def require(ok: bool, where: str, rule: str, value: Any) -> None:
    """Raise ValueError("`where` `rule`, got `value`") unless `ok`."""
    if not ok:
        raise ValueError(f"{where} {rule}, got {value!r}")


def is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_positive_seconds(seconds: float, flag: str) -> None:
    """ValueError naming `flag` unless `seconds` is finite and > 0: a NaN passes any `<=` test
    (a NaN health interval checked the router's instances ~9 times a second)."""
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{flag} must be a finite number of seconds > 0, got {seconds}")
