"""Units as users read them: bytes (``6.0 GiB``) and durations (``4 ms``).

A leaf module: it imports nothing of gpucleanup, so the framework adapters, the report
and the engine can all use it without importing one another.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["format_bytes", "format_in_unit", "format_pair", "format_duration", "count_of"]

_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def _unit_for(n: int) -> tuple[str, int]:
    for unit, size in _UNITS:
        if n >= size:
            return unit, size
    return "B", 1


def _number(value: float, unit: str) -> str:
    if unit == "B":
        return str(int(value))
    if unit in ("GiB", "TiB"):
        return f"{value:.1f}"
    # MiB and KiB: whole numbers once they are big enough to read that way
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def format_bytes(n: Optional[int]) -> str:
    """``6.0 GiB``, ``512 MiB``, ``1.5 MiB``, ``8 B``; ``?`` when unknown."""
    if n is None:
        return "?"
    n = int(n)
    sign = "-" if n < 0 else ""
    unit, size = _unit_for(abs(n))
    return f"{sign}{_number(abs(n) / size, unit)} {unit}"


def format_in_unit(n: int, unit_of: int) -> str:
    """``n`` as a bare number in the unit ``format_bytes(unit_of)`` would pick (``5.5`` for GiB)."""
    unit, size = _unit_for(abs(int(unit_of)))
    return _number(int(n) / size, unit)


def format_pair(used: Optional[int], total: Optional[int]) -> str:
    """``2.7/79.6 GiB``: used in the unit of the total."""
    if total is None:
        return format_bytes(used)
    if used is None:
        return f"?/{format_bytes(total)}"
    unit, _ = _unit_for(abs(int(total)))
    return f"{format_in_unit(used, total)}/{format_bytes(total)}" if unit != "B" else f"{used}/{total} B"


def format_duration(seconds: Optional[float]) -> str:
    """``0.4 ms``, ``12 ms``, ``2.5 s``, ``31 s``, ``2 min 5 s``."""
    if seconds is None:
        return "?"
    s = max(0.0, float(seconds))
    if s < 0.001:
        return f"{s * 1000:.1f} ms"
    if s < 1.0:
        ms = round(s * 1000)
        return f"{ms} ms" if ms < 1000 else "1.0 s"
    if s < 10.0:
        return f"{s:.1f} s"
    if s < 60.0:
        return f"{s:.0f} s"
    minutes, rest = divmod(int(round(s)), 60)
    return f"{minutes} min {rest} s" if rest else f"{minutes} min"


def count_of(n: int, noun: str) -> str:
    """``1 frame``, ``2 frames``: a count with its noun in the right number."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
