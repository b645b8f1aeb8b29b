"""The opt-in switch of the engine plugins: ``MOE_PLACEMENT_EPLB=<spec>``, parsed once at engine start.

Specs (one line each in :data:`ACCEPTED`):

- ``greedy[:time_limit=S]``: our greedy balancer (the engines' algorithm without its co-location
  hazard), slots of experts that stay on a GPU kept in place; for SGLang's static table, replicas then
  moved for the table within about ``S`` seconds (default 2; too small a budget: not fitted).
- ``exact[:time_limit=S]``: the exact CP-SAT solver, one worker, deterministic-time limit derived
  from ``S`` seconds (default 2).
- ``migration[:max_moves=M][,time_limit=S]``: re-place from the map in service, at most ``M`` moved
  slots over all layers (default: no budget), the search bounded by a work limit (steps) sized to
  finish in about ``S`` seconds (default 2) at DeepSeek-V3 shape.
- ``file:PATH``: the placement in ``PATH`` (any format :func:`placement.formats.read_placement` reads).
- ``locality``: refused. It needs per-token routing (top-k ids); the engines hand their balancer
  expert counts only. Solve offline (``moe-placement solve --solver locality``) and serve the file.

Nothing here imports numpy, torch or the solvers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = ["ACCEPTED", "ENV_VAR", "PolicySpec", "SpecError", "parse_spec", "spec_from_env"]

ENV_VAR = "MOE_PLACEMENT_EPLB"
ACCEPTED = "greedy[:time_limit=S], exact[:time_limit=S], migration[:max_moves=M][,time_limit=S], file:PATH"
DEFAULT_TIME_LIMIT = 2.0

_OPTIONS = {"greedy": ("time_limit",), "exact": ("time_limit",), "migration": ("max_moves", "time_limit")}


class SpecError(ValueError):
    """A malformed ``MOE_PLACEMENT_EPLB`` value; its message is one line naming the accepted specs."""


@dataclass(frozen=True)
class PolicySpec:
    """A parsed spec.

    Attributes:
        kind: ``greedy``, ``exact``, ``migration`` or ``file``.
        text: the spec as given (for logs).
        time_limit: seconds of budget; exact: turned into deterministic time, migration: into a
            work limit (search steps); neither is cut by the wall clock (ranks would then disagree).
        max_moves: migration's total moved-slot budget over all layers (None: none).
        path: the placement file of ``file:PATH``.
    """

    kind: Literal["greedy", "exact", "migration", "file"]
    text: str
    time_limit: float = DEFAULT_TIME_LIMIT
    max_moves: int | None = None
    path: str = ""


def _fail(text: str, why: str) -> SpecError:
    return SpecError(f"{ENV_VAR}={text!r}: {why}; accepted specs: {ACCEPTED}")


def _number(text: str, key: str, raw: str) -> float | int:
    try:
        value: float | int = int(raw) if key == "max_moves" else float(raw)
    except ValueError:
        raise _fail(text, f"{key} must be a number, got {raw!r}") from None
    if key == "max_moves" and value < 0:
        raise _fail(text, f"max_moves must be >= 0, got {value}")
    if key == "time_limit" and not (0 < value < float("inf")):
        raise _fail(text, f"time_limit must be > 0 seconds, got {raw!r}")
    return value


def _options(text: str, kind: str, rest: str) -> dict[str, float | int]:
    """``key=value`` pairs after ``kind:``, comma-separated, checked against what ``kind`` takes."""
    values: dict[str, float | int] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in _OPTIONS[kind]:
            takes = ", ".join(_OPTIONS[kind]) or "no options"
            raise _fail(text, f"{kind} takes {takes}, got {item!r}")
        values[key] = _number(text, key, raw.strip())
    return values


def parse_spec(text: str) -> PolicySpec:
    """``text`` (e.g. ``migration:max_moves=64``) as a :class:`PolicySpec`, or :class:`SpecError`."""
    spec = text.strip()
    if spec.startswith("file:"):
        path = spec[len("file:") :].strip()
        if not path:
            raise _fail(text, "file: needs a path (file:/path/to/placement.json)")
        return PolicySpec("file", spec, path=path)
    kind, _, rest = spec.partition(":")
    kind = kind.strip().lower()
    if kind == "locality":
        raise _fail(
            text,
            "locality needs per-token routing (top-k ids) and the engines pass their balancer expert "
            "counts only; solve offline with `moe-placement solve --solver locality` and serve the "
            "file with file:PATH",
        )
    if kind not in _OPTIONS:
        raise _fail(text, f"unknown policy {kind!r}")
    values = _options(text, kind, rest)
    return PolicySpec(kind, spec, **values)  # type: ignore[arg-type]


def spec_from_env(environ: Mapping[str, str] | None = None) -> PolicySpec | None:
    """The spec in ``MOE_PLACEMENT_EPLB``; None when it is unset or empty (the plugins then do nothing)."""
    text = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return parse_spec(text) if text.strip() else None
