"""The choice: which option to run, by one rule, and the best option not picked with the reason.

Rule: among the options the engine can run whose KV cache of the decode batch x context still fits, those
whose net whole-step gain (the priced phases weighted alike) pays for a change: the LOW end of its range
(:func:`placement.cost.ranges.value_range`) less its band is at least ``min_gain``, and no
phase is worse beyond its band. Of those, the one with the most net throughput (central gain); options
within :data:`TIE_GAIN` of it are a tie, broken by gain per GB of replicas per GPU (at least
:data:`GB_FLOOR` counted), then by fewer redundant slots. None pays: no balancing, keep what you run.

A row's gains come from its prices unless a ``gains`` table is given (the stability checks pass
resampled or re-priced gains; see :mod:`moe_placement.apps.advise.stability`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from moe_placement.apps.advise.phases import gain, known

__all__ = ["GB_FLOOR", "TIE_GAIN", "Choice", "choose", "net_gain", "net_of", "phase_gains", "sure"]

GB_FLOOR = 0.25  # GB per GPU: an option that spends less counts as spending this (gain per GB stays finite)
TIE_GAIN = 0.001  # net gains within 0.1 point of the whole step are a tie (broken by gain per GB)


def net_of(per_phase: Mapping[str, tuple[float, float, float, float]]) -> dict:
    """The decision figures from per-phase ``(gain, band, low, high)``: ``{ph: (gain, band), net, band,
    low, high, ranges}`` with the priced phases weighted alike (``ranges[ph] = (low, high)``)."""
    n = max(len(per_phase), 1)
    bands = [known(v[1]) for v in per_phase.values()]
    return {
        **{ph: (v[0], v[1]) for ph, v in per_phase.items()},
        "net": sum(v[0] for v in per_phase.values()) / n,
        "band": math.hypot(*bands) / n if bands else 0.0,
        "low": sum(v[2] for v in per_phase.values()) / n,
        "high": sum(v[3] for v in per_phase.values()) / n,
        "ranges": {ph: (v[2], v[3]) for ph, v in per_phase.items()},
    }


def phase_gains(row, base) -> dict[str, tuple[float, float, float, float]]:
    """Per priced phase ``(gain, band, low, high)`` of ``row`` over ``base`` (the range from ``row.ranges``;
    without one, the central gain at both ends)."""
    out = {}
    for ph in row.priced:
        g, band = gain(row.phase(ph), base.phase(ph))
        lo, hi = row.ranges.get(ph, {}).get("whole_step_gain", (g, g))
        out[ph] = (g, band, lo, hi)
    return out


def net_gain(row, base) -> dict:
    """:func:`net_of` of ``row``'s own prices over ``base``'s."""
    return net_of(phase_gains(row, base))


def sure(g: dict) -> float:
    """The net gain a change can count on: the low end of its range less its band."""
    return g["low"] - g["band"]


@dataclass(frozen=True)
class Choice:
    """The row chosen (the baseline: no balancing), why, and the best row not chosen with why not."""

    row: object
    reason: str
    runner_up: object = None
    runner_up_why: str = ""


def _verdict(row, g: dict, available: Mapping, min_gain: float) -> str:
    """``""`` when ``row`` pays for a change, else why not (first reason that applies)."""
    ok, why = available[row.key]
    if not ok:
        return f"the engine cannot run it ({why})"
    if not row.memory.fits:
        return "its replicas leave no room for the KV cache of the decode batch x context"
    worse = [ph for ph in row.priced if g[ph][0] + known(g[ph][1]) < 0]
    if worse:
        return f"{' and '.join(worse)} worse beyond the band"
    if sure(g) < min_gain:
        return f"its low end less band, {sure(g) * 100:+.2f}%, is under the {min_gain * 100:g}% minimum gain worth a change"
    return ""


def _per_gb(row, base, g: dict) -> float:
    extra = max((row.memory.redundant_bytes - base.memory.redundant_bytes) / 1e9, GB_FLOOR)
    return g["net"] / extra


def choose(rows, base, available: Mapping, min_gain: float, gains: Mapping | None = None) -> Choice:
    """The choice by the module's rule; ``gains`` (row key -> :func:`net_gain`-shaped dict) overrides
    the rows' own figures."""
    table = gains if gains is not None else {r.key: net_gain(r, base) for r in rows if r is not base}
    others = [r for r in rows if r is not base]
    why = {r.key: _verdict(r, table[r.key], available, min_gain) for r in others}
    paying = [r for r in others if not why[r.key]]
    ranked = sorted(others, key=lambda r: -table[r.key]["net"])  # the best by throughput first
    if not paying:
        best = ranked[0] if ranked else None
        reason = (
            f"keep what you run: no runnable option that fits in memory gains at least {min_gain * 100:g}% of the "
            f"whole step at the low end of its range less its band"
        )
        return Choice(base, reason, best, why[best.key] if best is not None else "")
    top = max(table[r.key]["net"] for r in paying)
    tied = [r for r in paying if top - table[r.key]["net"] <= TIE_GAIN]
    pick = max(tied, key=lambda r: (_per_gb(r, base, table[r.key]), -r.redundant_per_gpu))
    g = table[pick.key]
    reason = (
        f"the most net whole-step throughput among runnable options that fit ({g['net'] * 100:+.2f}%, low end less "
        f"band {sure(g) * 100:+.2f}% >= the {min_gain * 100:g}% minimum)"
    )
    if len(tied) > 1:
        reason += f"; {len(tied)} options within {TIE_GAIN * 100:g} point, the most gain per GB taken"
    runner = next((r for r in ranked if r is not pick), None)
    return Choice(pick, reason, runner, _runner_why(runner, pick, table, why, tied) if runner else "")


def _runner_why(runner, pick, table: Mapping, why: Mapping, tied: list) -> str:
    if why[runner.key]:
        return why[runner.key]
    if runner in tied:
        return f"a tie within {TIE_GAIN * 100:g} point, with less gain per GB"
    gap = table[pick.key]["net"] - table[runner.key]["net"]
    return f"{gap * 100:.2f} points less net throughput"
