"""Byte sizes: parsing what users type and formatting what we print."""

from __future__ import annotations

import re

from planner.errors import PlannerError

GiB = 1024**3
MiB = 1024**2
KiB = 1024

_UNITS = {
    "b": 1,
    "k": 1000, "kb": 1000, "kib": KiB,
    "m": 1000**2, "mb": 1000**2, "mib": MiB,
    "g": 1000**3, "gb": 1000**3, "gib": GiB,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
#: No device or host this planner plans for has more (the largest nodes hold a few TiB of RAM);
#: anything above is a typo, and would not fit the store's 64-bit integers either.
MAX_BYTES = 1024**5  # 1 PiB


def parse_bytes(text: str, *, option: str = "size") -> int:
    """Parse ``20GiB``, ``24 GB``, ``23028MiB`` or ``4096B`` into bytes.

    Decimal units (GB) are powers of 1000, binary units (GiB) powers of 1024, as in IEC 80000-13.
    The unit is required: a bare ``20`` is far more often a forgotten ``GiB`` than 20 bytes.
    """
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        hint = " (the unit is required)" if match and not unit else ""
        raise PlannerError(f"{option} {text!r} is not a size{hint}: write e.g. 20GiB, 24GB or 23028MiB")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise PlannerError(f"{option} must be larger than zero, got {text!r}")
    if value > MAX_BYTES:
        raise PlannerError(f"{option} {text!r} is more than 1 PiB: write the device's or host's real size, e.g. 80GiB")
    return int(value)


def size_of(value: object, *, option: str) -> int | None:
    """A size given as bytes (an int, as the Python API and the HTTP API take it) or as text with a
    unit (``parse_bytes``), held to the same bounds: above zero, at most ``MAX_BYTES`` (an int of
    10**30 bytes passed unchecked and held a search for minutes). None stays None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise PlannerError(f"{option} must be bytes (an int) or a size like '20GiB', got {value!r}")
    if isinstance(value, str):
        return parse_bytes(value, option=option)
    if value <= 0:
        raise PlannerError(f"{option} must be larger than zero, got {value}")
    if value > MAX_BYTES:
        raise PlannerError(f"{option} {value} is more than 1 PiB: write the device's or host's real size, e.g. 80GiB")
    return value


def format_bytes(n: float) -> str:
    """``1536 MiB`` -> ``1.50 GiB``; binary units, three significant figures."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            value = n / size
            return f"{sign}{value:.3g} {unit}" if value < 100 else f"{sign}{value:.0f} {unit}"
    return f"{sign}{int(n)} B"
