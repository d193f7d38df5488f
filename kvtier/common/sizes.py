"""Byte sizes written the way people write them: `4GiB`, `512MiB`, `1.5GB`, `1048576`."""

from __future__ import annotations

import re

_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, name: str) -> int:
    """Bytes in `value` (an int or a string such as "4GiB"); `name` is the field for errors."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte size such as 4GiB or 1073741824, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # e.g. 4 * 2**30 computed in floats, as vLLM's configs carry it
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {value}")
        return value
    match = _SIZE_RE.match(value) if isinstance(value, str) else None
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{name} must be a byte size such as 4GiB, 512MiB or 1073741824, "
                         f"got {value!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
