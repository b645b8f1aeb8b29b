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
- ``file:PATH``: the placement in ``PATH`` (any format :func:`placement.formats.read_placement` reads;
  a regular file of at most :data:`MAX_FILE_BYTES`).

Failures, options of ``greedy``, ``exact`` (``failure_domain``, ``failure_max_par_increase``) and of
``greedy``, ``exact``, ``migration`` (``failover``):

- ``failure_domain=gpu|node``: copies of the hottest experts over two GPUs or nodes
  (:mod:`solver.failure`), at most ``failure_max_par_increase=X`` (default 0.02) more PAR per layer.
- ``failover=DIR``: on an elastic scale-down (fewer ranks than the map in service), the map of
  ``DIR`` (``moe-placement solve --failover DIR``) for that loss when it was computed from the map in
  service; else, and without the option, the failover map computed on the spot
  (:func:`solver.failover.failover_map`, ``failover_moves=N`` moves at most; default: as many as the
  lost ranks held less the reloads). Every spec answers a scale-down with a failover map. A path
  with a comma cannot be given (commas separate the options).

With a map in service, ``greedy``, ``exact`` and ``migration`` switch to their new map only when the
predicted gain pays for the migration (:mod:`runtime_hooks.rebalance_rule`); the rule's options,
accepted by all three: ``always=1`` (rebalance whenever anything moves), ``horizon=H`` (windows of
the same load the new map serves, default 1), ``stall=F`` (share of the copy serving waits for,
default 1), ``expert_bytes=B`` (one expert's weight bytes in one layer, default DeepSeek-V3 FP8).
- ``locality``: refused. It needs per-token routing (top-k ids); the engines hand their balancer
  expert counts only. Solve offline (``moe-placement solve --solver locality``) and serve the file.

Nothing here imports numpy, torch or the solvers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from moe_placement.base.errors import SpecError  # re-exported: the family lives in moe_placement.base.errors

__all__ = [
    "ACCEPTED",
    "ENV_VAR",
    "MAX_FILE_BYTES",
    "PolicySpec",
    "SpecError",
    "failure_reason",
    "parse_spec",
    "spec_from_env",
]

ENV_VAR = "MOE_PLACEMENT_EPLB"
ACCEPTED = (
    "greedy[:time_limit=S], exact[:time_limit=S], migration[:max_moves=M][,time_limit=S], file:PATH; "
    "greedy/exact/migration also take always=1, horizon=H, stall=F, expert_bytes=B, failover=DIR, failover_moves=N; "
    "greedy/exact also failure_domain=gpu|node, failure_max_par_increase=X"
)
DEFAULT_TIME_LIMIT = 2.0
MAX_FILE_BYTES = 64 << 20  # a placement file larger than this is refused (DeepSeek-V3's is ~0.2 MB)

_RULE = ("always", "horizon", "stall", "expert_bytes")
_FAILURE = ("failure_domain", "failure_max_par_increase")
_FAILOVER = ("failover", "failover_moves")
_OPTIONS = {
    "greedy": ("time_limit", *_RULE, *_FAILOVER, *_FAILURE),
    "exact": ("time_limit", *_RULE, *_FAILOVER, *_FAILURE),
    "migration": ("max_moves", "time_limit", *_RULE, *_FAILOVER),
}
_WORDS = ("failure_domain", "failover")  # options whose value is a word or a path, not a number


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
        always: switch to every new map that moves something (the rule's figures still logged).
        horizon, stall, expert_bytes: the rebalance rule's
            (:class:`runtime_hooks.rebalance_rule.RuleParams`); None: the rule's default.
        failure_domain: ``gpu`` or ``node`` (fresh solves protect the hottest experts), or None;
            failure_max_par_increase: its cap (None: the default, 0.02).
        failover: a ``--failover`` folder answering scale-downs, or empty (computed on the spot);
            failover_moves: the move budget of a map computed on the spot (None: the default, ``lost``).
    """

    kind: Literal["greedy", "exact", "migration", "file"]
    text: str
    time_limit: float = DEFAULT_TIME_LIMIT
    max_moves: int | None = None
    path: str = ""
    always: bool = False
    horizon: float | None = None
    stall: float | None = None
    expert_bytes: float | None = None
    failure_domain: str | None = None
    failure_max_par_increase: float | None = None
    failover: str = ""
    failover_moves: int | None = None


def _fail(text: str, why: str) -> SpecError:
    return SpecError(f"{ENV_VAR}={text!r}: {why}; accepted specs: {ACCEPTED}")


_INTEGER = ("max_moves", "always", "failover_moves")
_CHECKS = {  # key: (accepts the value, what it must be)
    "max_moves": (lambda v: v >= 0, ">= 0"),
    "failover_moves": (lambda v: v >= 0, ">= 0 (0: reloads only)"),
    "always": (lambda v: v in (0, 1), "0 or 1"),
    "time_limit": (lambda v: 0 < v < float("inf"), "> 0 seconds"),
    "horizon": (lambda v: 0 < v < float("inf"), "> 0 windows"),
    "stall": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "expert_bytes": (lambda v: 0 < v < float("inf"), "> 0 bytes"),
    "failure_max_par_increase": (lambda v: 0 <= v < float("inf"), ">= 0 (0.02: at most 2% more PAR)"),
}


def _word(text: str, key: str, raw: str) -> str:
    """A ``failure_domain`` (gpu or node) or a ``failover`` folder (non-empty)."""
    if key == "failure_domain":
        from solver.failure import DOMAINS  # at parse time only: the engine has started

        if raw not in DOMAINS:
            raise _fail(text, f"failure_domain must be one of {', '.join(DOMAINS)}, got {raw!r}")
    elif not raw:
        raise _fail(text, "failover needs a folder (failover=/path/to/failover)")
    return raw


def _number(text: str, key: str, raw: str) -> float | int:
    try:
        value: float | int = int(raw) if key in _INTEGER else float(raw)
    except ValueError:
        raise _fail(text, f"{key} must be a number, got {raw!r}") from None
    accepts, must = _CHECKS[key]
    if not accepts(value):
        raise _fail(text, f"{key} must be {must}, got {raw!r}")
    return value


def _options(text: str, kind: str, rest: str) -> dict[str, float | int | str]:
    """``key=value`` pairs after ``kind:``, comma-separated, checked against what ``kind`` takes."""
    values: dict[str, float | int | str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in _OPTIONS[kind]:
            takes = ", ".join(_OPTIONS[kind]) or "no options"
            raise _fail(text, f"{kind} takes {takes}, got {item!r}")
        if key in values:
            raise _fail(text, f"{key} is given twice")
        values[key] = _word(text, key, raw.strip()) if key in _WORDS else _number(text, key, raw.strip())
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
    if "always" in values:
        values["always"] = bool(values["always"])
    return PolicySpec(kind, spec, **values)  # type: ignore[arg-type]


def failure_reason(exc: BaseException) -> str:
    """A one-line, never empty reason for a log line: the exception's message, else its type."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else f"{type(exc).__name__} (no message)"


def spec_from_env(environ: Mapping[str, str] | None = None) -> PolicySpec | None:
    """The spec in ``MOE_PLACEMENT_EPLB``; None when it is unset or empty (the plugins then do nothing)."""
    text = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return parse_spec(text) if text.strip() else None
