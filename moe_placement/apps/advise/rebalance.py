"""Periodic rebalancing judged out of sample: does re-placing every window beat the static placement on
the window that follows, by more than a margin, after the engine's stall?

Protocol: the held-out half is cut into ``W`` windows. For ``i = 0 .. W-2`` the engine's rebalance
(DeepSeek's greedy, what both engines run) is fitted on window ``i`` and scored on window ``i + 1``;
the static placement (fitted once on the fit half) is scored on the same window. Both are out of
sample. ``gain_i = static_ms / rebalanced_ms - 1`` of the whole step (decode, or the one phase asked for). A periodic rebalance is
advised only when half of the sure gain (mean less twice its standard error) clears ``margin``; its
interval is then the longer of one window and the steps over which one stall (0 for vLLM's async
EPLB) takes at most half of the sure gain. Otherwise ``interval_steps`` is None: a stationary trace
(nothing to gain out of sample) gets none. No verdict at all (``judged`` False, "not enough trace to
judge") when the held-out windows are shorter than ``min_steps`` steps or fewer than three: drift over a
few steps says nothing about drift over a rebalance interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from moe_placement.apps.advise.engines import ENGINES
from placement.cost.hardware import ClusterSpec
from placement.cost.migration import rebalance_stall_seconds
from placement.cost.ranges import value_range
from placement.model import Placement
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.api import solve

__all__ = ["STALL_SOURCE", "JudgeSpec", "Rebalance", "judge", "stall"]

# Where the stall figures (placement.cost.hardware.REBALANCE_STALL_S, seconds low-high; priced by
# placement.cost.migration.rebalance_stall_seconds) come from.
STALL_SOURCE = {
    "vllm": "vLLM sync EPLB rearrangement stall 0.65-1.70 s (mean 0.91 s over 22 rearrangements, DeepSeek-R1 "
    "NVFP4 on 32 GB200, vllm-project/vllm PR #43219); vLLM's async EPLB (use_async, default) keeps serving",
    "sglang": "SGLang EPLB rearrangement about 1.8 s as reported for SGLang (not measured here; sgl-project/sglang "
    "PR #8345 describes each rebalance as second-level latency); SGLang stops serving while it moves weights",
}


def stall(engine: str) -> tuple[float, str]:
    """``(stall seconds on the serving path, source)``: the high end of the engine's measured range for a
    synchronous rearrangement, 0 where the engine rebalances asynchronously."""
    return rebalance_stall_seconds(engine, ENGINES[engine].async_rebalance), STALL_SOURCE[engine]


@dataclass(frozen=True)
class Rebalance:
    """The verdict: ``interval_steps`` None means no periodic rebalance."""

    interval_steps: int | None
    out_of_sample_gain: float | None
    band: float | None
    stall_ms: float
    async_: bool
    window_steps: float
    margin: float
    windows: int
    reason: str
    source: str
    judged: bool = True
    gain_range: tuple[float, float] | None = None

    def to_dict(self) -> dict:
        return {
            "judged": self.judged,
            "interval_steps": self.interval_steps,
            "out_of_sample_gain": self.out_of_sample_gain,
            "out_of_sample_gain_range": list(self.gain_range) if self.gain_range else None,
            "band": self.band,
            "stall_ms": self.stall_ms,
            "async": self.async_,
            "window_steps": self.window_steps,
            "margin": self.margin,
            "windows": self.windows,
            "reason": self.reason,
            "stall_source": self.source,
        }


# (placement, window trace) -> whole-step ms on that window (decode; prefill with --phase prefill)
PriceFn = Callable[[Placement, RoutingTrace], float]


@dataclass(frozen=True)
class JudgeSpec:
    """What a verdict is judged on: the ``engine`` (its stall), ``step_tokens`` per rank per step (how
    many steps a window holds), ``num_windows`` held-out windows, the ``margin`` a rebalance must clear
    and the fewest steps per window (``min_steps``) a verdict needs."""

    engine: str
    step_tokens: int
    num_windows: int
    margin: float
    min_steps: int = 1


def judge(
    held: RoutingTrace,
    static: Placement | None,
    topology: Topology,
    price: PriceFn,
    spec: JudgeSpec,
    price_on: Callable[[ClusterSpec], PriceFn] | None = None,
    cluster: ClusterSpec | None = None,
) -> Rebalance:
    """The out-of-sample verdict (module docstring); ``static`` None: no balancing chosen, none to renew.
    ``price_on(c)``: the same pricing on cluster ``c``, for the gain's range over the cost model's sets."""
    engine, step_tokens, num_windows = spec.engine, spec.step_tokens, spec.num_windows
    margin, min_steps = spec.margin, spec.min_steps
    stall_s, source = stall(engine)
    is_async = ENGINES[engine].async_rebalance
    stall_ms = stall_s * 1e3
    wins = held.windows(num_windows)
    window_steps = float(min(w.num_tokens for w in wins)) / (topology.ep_size * step_tokens)

    def verdict(interval, g, band, reason, judged=True):
        return Rebalance(
            interval, g, band, stall_ms, is_async, window_steps, margin, len(wins), reason, source, judged
        )

    if static is None:
        return verdict(None, None, None, "no balancing chosen: nothing to rebalance")
    if len(wins) < 3 or window_steps < max(min_steps, 1):
        why = (
            f"not enough trace to judge: {len(wins)} held-out windows of {window_steps:,.1f} steps, and a "
            f"verdict needs 3 windows of at least {max(min_steps, 1)} steps"
        )
        return verdict(None, None, None, why, judged=False)
    fresh = [solve("greedy", topology=topology, trace=wins[i]).placement for i in range(len(wins) - 1)]
    static_ms = [price(static, wins[i + 1]) for i in range(len(fresh))]
    gains = [s / price(f, w) - 1.0 for s, f, w in zip(static_ms, fresh, wins[1:])]
    g = float(np.mean(gains))
    band = float(2.0 * np.std(gains, ddof=1) / math.sqrt(len(gains)))
    lo, hi = _range(g, price_on, cluster, static, fresh, wins)
    sure = lo - band  # the gain a rebalance makes out of sample at the low end of its range, less its band
    if sure / 2 <= margin:
        why = (
            f"re-placing every window ({window_steps:,.0f} steps) gains {g * 100:+.2f}% out of sample "
            f"(band {band * 100:.2f}%): half of it clears no {margin * 100:.1f}% margin, no periodic rebalance"
        )
        return replace(verdict(None, g, band, why), gain_range=(lo, hi))
    # the stall may take at most half of the sure gain: interval >= 2 stall / (step x sure gain)
    step_ms = float(np.mean(static_ms))
    interval = max(window_steps, 2.0 * stall_ms / (step_ms * sure))
    why = (
        f"gains {g * 100:+.2f}% out of sample (band {band * 100:.2f}%); every {interval:,.0f} steps a "
        f"{stall_ms:.0f} ms stall takes at most half of it"
    )
    return replace(verdict(int(math.ceil(interval)), g, band, why), gain_range=(lo, hi))


def _range(g: float, price_on, cluster, static, fresh: list, wins: list) -> tuple[float, float]:
    """``(low, high)`` of the mean out-of-sample gain over the cost model's constant sets
    (:func:`placement.cost.ranges.value_range`); ``(g, g)`` without ``price_on``."""
    if price_on is None or cluster is None:
        return g, g

    def mean_gain(c) -> float:
        if c is cluster:
            return g
        pr = price_on(c)
        return float(np.mean([pr(static, w) / pr(f, w) - 1.0 for f, w in zip(fresh, wins[1:])]))

    lo, _, hi = value_range(mean_gain, cluster)
    return lo, hi
