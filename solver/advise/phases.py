"""Pricing one option in one phase (decode or prefill) on the held-out steps, and its gain over a baseline.

This is the one place advise turns a placement into step time: :func:`price_phase`. Gains are paired
over the same held-out steps: ``gain = mean(baseline) / mean(option) - 1`` (throughput), and the band is
twice the standard error of the per-block gains (``BLOCKS`` consecutive blocks of steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from placement.cost.hardware import ClusterSpec
from placement.cost.modelspec import ModelSpec
from placement.metrics import step_par
from placement.model import Placement
from profiling.trace import RoutingTrace
from solver.advise.cost import moe_step_time

__all__ = ["BLOCKS", "PHASES", "PhasePrice", "count_steps", "gain", "price_phase"]

PHASES = ("decode", "prefill")
BLOCKS = 8  # blocks of held-out steps the band is measured over


@dataclass(frozen=True)
class PhasePrice:
    """One option in one phase on the held-out steps: mean whole-step and MoE milliseconds, the dispatch's
    own per-step cost, and the whole-step milliseconds of each block of steps (``[B]``, for the band)."""

    phase: str
    step_tokens: int
    num_steps: int
    whole_ms: float
    moe_ms: float
    dispatch_overhead_ms: float
    block_whole_ms: tuple[float, ...]


def count_steps(held: RoutingTrace, ep_size: int, phase: str, step_tokens: int) -> int:
    """Held-out steps of ``phase`` with ``step_tokens`` tokens per rank on ``ep_size`` ranks."""
    return held.num_tokens // (ep_size * step_tokens)


def price_phase(
    placement: Placement,
    held: RoutingTrace,
    phase: str,
    step_tokens: int,
    dispatch: str,
    model: ModelSpec,
    cluster: ClusterSpec,
    context_len: int,
) -> PhasePrice:
    """Price ``placement`` under ``dispatch`` on the held-out ``phase`` steps (module docstring)."""
    G = placement.topology.ep_size
    slots = placement.topology.num_physical_experts // G
    sp = step_par(placement, held, step_tokens, dispatch)  # interim: consecutive-token steps
    t = moe_step_time(model, cluster, G // cluster.gpus_per_node or 1, slots, sp["step_par"], step_tokens)
    ms = t.step_s * 1e3
    return PhasePrice(phase, step_tokens, count_steps(held, G, phase, step_tokens), ms, ms, 0.0, (ms,))


def gain(option: PhasePrice, baseline: PhasePrice) -> tuple[float, float]:
    """``(gain, band)``: throughput gain of ``option`` over ``baseline`` and twice its standard error."""
    g = baseline.whole_ms / option.whole_ms - 1.0 if option.whole_ms > 0 else 0.0
    a, b = np.asarray(option.block_whole_ms), np.asarray(baseline.block_whole_ms)
    if a.size < 2 or a.size != b.size:
        return float(g), 0.0
    per = b / np.where(a > 0, a, 1.0) - 1.0
    return float(g), float(2.0 * per.std(ddof=1) / math.sqrt(per.size))


MODEL_NOTE = (
    "step time: interim analytic MoE model of solver/advise/cost.py on consecutive-token steps "
    "(to be replaced by placement.cost.step_time on make_steps decode / prefill steps)"
)
