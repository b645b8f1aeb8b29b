"""One table-driven check of a frozen dataclass's fields (:class:`ModelSpec`, :class:`GpuSpec`, ...).

Each field is checked by the kind its annotation names (``int``, ``float``, ``str``, ``int | None``,
``tuple[int, ...]``, ``tuple[float, float]``, ``Mapping[...]``, or a class name) and by a range: the
class's own table entry for the field, else the default range of its kind. A field added later is
therefore checked too (its kind's default range) without a line here. Booleans are not numbers here,
NaN and infinities are refused, and every message is one line naming where, the field, the value and
what is accepted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Range", "check_fields", "check_value", "show"]


class Range(NamedTuple):
    """Accepted values ``lo..hi`` (``lo`` excluded when ``lo_open``)."""

    lo: float
    hi: float
    lo_open: bool = False

    def holds(self, v: float) -> bool:
        return (v > self.lo if self.lo_open else v >= self.lo) and v <= self.hi

    def text(self, integer: bool) -> str:
        if integer:
            return f"an integer in {int(self.lo) + int(self.lo_open)}..{int(self.hi)}"
        return f"a finite number in {'(' if self.lo_open else '['}{self.lo:.6g}, {self.hi:.6g}]"


# default ranges of a kind: sizes and counts up to 2^31, physical quantities (bytes, FLOP/s, seconds)
# non-negative and at most 1e21; a field with a tighter meaning has its own entry in its class's table
DEFAULT_INT = Range(0, 2**31 - 1)
DEFAULT_FLOAT = Range(0.0, 1e21)
MAX_TEXT = 10_000  # characters of a name, a source line
MAX_SEQUENCE = 1_000_000  # items of a tuple field (layer ids)


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, (float, np.floating))) and not isinstance(v, (bool, np.bool_))


def show(v: Any) -> str:
    text = (
        repr(v)
        if not _is_int(v) or abs(v) < 10**60
        else f"an integer of about {int(int(v).bit_length() * 0.30103) + 1} digits"
    )
    return text if len(text) <= 60 else text[:57] + "..."


def _refuse(where: str, name: str, value: Any, accepted: str) -> ValueError:
    """The one-line error: ``where: name is value; accepted: ...`` (no ``where:`` when empty)."""
    return ValueError(f"{where + ': ' if where else ''}{name} is {show(value)}; accepted: {accepted}")


def check_value(name: str, value: Any, kind: str, rule: Range | None, where: str) -> None:
    """``value`` of field ``name`` against its annotation ``kind`` and ``rule``; a one-line
    ValueError naming ``where``, the field, the value and what is accepted."""
    kind = kind.replace(" ", "")
    if kind.endswith("|None") or kind.startswith("None|"):
        if value is None:
            return
        kind = kind.replace("|None", "").replace("None|", "")
    if kind == "Any" or ("|" in kind and "[" not in kind):  # nothing to check, or a union of several kinds
        return
    if kind in ("int", "float"):
        _check_number(name, value, kind == "int", rule, where)
    elif kind == "str":
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise _refuse(where, name, value, f"a string of at most {MAX_TEXT} characters")
    elif kind == "bool":
        if not isinstance(value, (bool, np.bool_)):
            raise _refuse(where, name, value, "true or false")
    elif kind.startswith("tuple["):
        _check_tuple(name, value, kind, rule, where)
    elif kind.startswith(("Mapping", "dict")):
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise _refuse(where, name, value, "a JSON object (string keys)")
        _check_seconds(name, value, where)
    elif type(value).__name__ != kind:  # a class name (a nested spec)
        raise _refuse(where, name, value, f"a {kind}")


def _check_seconds(name: str, value: Mapping, where: str) -> None:
    """Measured seconds in a mapping (a preset's ``provenance``, whose ``times_s`` make it calibrated):
    every ``*_s`` entry a finite number >= 0 or a non-empty list of them, never text read as a measurement."""
    for key in (k for k in value if k.endswith("_s")):
        v = value[key]
        items = v if isinstance(v, (list, tuple)) else [v]
        if not items or len(items) > MAX_SEQUENCE:
            raise _refuse(
                where, f"{name}.{key}", v, "a measured time in seconds, or a non-empty list of them"
            )
        for i, x in enumerate(items):
            _check_number(f"{name}.{key}" + (f"[{i}]" if v is items else ""), x, False, None, where)


def _check_number(name: str, value: Any, integer: bool, rule: Range | None, where: str) -> None:
    rule = rule or (DEFAULT_INT if integer else DEFAULT_FLOAT)
    ok_type = _is_int(value) if integer else _is_number(value)
    try:
        x = float(value) if ok_type else math.nan
    except OverflowError:  # an integer of hundreds of digits
        x = math.inf
    if not math.isfinite(x) or not rule.holds(x):
        raise _refuse(where, name, value, rule.text(integer))


def _check_tuple(name: str, value: Any, kind: str, rule: Range | None, where: str) -> None:
    """``tuple[int, ...]`` (any length up to MAX_SEQUENCE) or ``tuple[float, float]`` (that length)."""
    items = kind[len("tuple[") : -1].split(",")
    if not isinstance(value, (tuple, list)) or len(value) > MAX_SEQUENCE:
        raise _refuse(where, name, value, f"a list of {items[0]}s")
    if items[-1] != "..." and len(value) != len(items):
        raise _refuse(where, name, value, f"a list of {len(items)} {items[0]}s")
    for i, v in enumerate(value):
        check_value(f"{name}[{i}]", v, items[0], rule, where)


def check_fields(obj: Any, table: Mapping[str, Range], where: str, prefix: str = "") -> None:
    """Every field of the dataclass ``obj`` by its annotation and ``table``'s range (else the default);
    messages name the field as ``prefix + name`` (``prefix`` ``"FitOptions."``, say)."""
    for f in fields(obj):
        check_value(prefix + f.name, getattr(obj, f.name), str(f.type), table.get(f.name), where)
