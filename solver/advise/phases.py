"""Pricing one option in one phase (decode or prefill) on the held-out steps, and its gain over a baseline.

The one place advise turns a placement into step time: :func:`price_phase`, with the one cost model
(:func:`placement.cost.step_time.step_time_from_arrays`: whole step = MoE layers + the dispatch's own
per-step cost + the rest of the step). The held-out steps are cut into ``BLOCKS`` blocks of consecutive
steps, each priced alone: the mean step is their step-weighted mean, and the band of a gain is twice the
standard error of the per-block gains (paired: the same blocks for option and baseline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from placement.cost.hardware import ClusterSpec
from placement.cost.modelspec import ModelSpec
from placement.cost.step_time import step_time_from_arrays
from placement.model import Placement
from profiling.trace import RoutingTrace

__all__ = [
    "BLOCKS",
    "MODEL_NOTE",
    "PHASES",
    "PhasePrice",
    "StepArrays",
    "count_steps",
    "gain",
    "held_out_steps",
    "price_phase",
]

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
    calibrated: bool = False


@dataclass(frozen=True)
class StepArrays:
    """Held-out steps as arrays: ``step [T]`` (-1: in no step), ``rank [T]``, ``row [T]`` or None."""

    phase: str
    step_tokens: int
    num_steps: int
    step: np.ndarray
    rank: np.ndarray
    row: np.ndarray | None
    shape_note: str


def held_out_steps(held: RoutingTrace, ep_size: int, phase: str, step_tokens: int) -> StepArrays:
    """The held-out steps of ``phase`` with ``step_tokens`` tokens per rank on ``ep_size`` ranks.

    Interim: chunks of consecutive tokens per rank for both phases (the prefill shape).
    """
    T, per = held.num_tokens, step_tokens * ep_size
    S = T // per
    tok = np.arange(T, dtype=np.int64)
    step = np.where(tok < S * per, tok // per, -1)
    return StepArrays(
        phase, step_tokens, S, step, (tok % per) // step_tokens, tok % step_tokens, "consecutive tokens"
    )


def count_steps(held: RoutingTrace, ep_size: int, phase: str, step_tokens: int) -> int:
    """Held-out steps of ``phase`` with ``step_tokens`` tokens per rank on ``ep_size`` ranks."""
    return held_out_steps(held, ep_size, phase, step_tokens).num_steps


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
    st = held_out_steps(held, placement.topology.ep_size, phase, step_tokens)
    if st.num_steps < 1:
        raise ValueError(
            f"no whole {phase} step of {step_tokens} tokens x {placement.topology.ep_size} ranks in "
            f"{held.num_tokens} held-out tokens; use a smaller step or a longer trace"
        )
    assert held.topk_ids is not None
    edges = np.linspace(0, st.num_steps, min(BLOCKS, st.num_steps) + 1).round().astype(int)
    parts = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (st.step >= lo) & (st.step < hi)
        rows = None if st.row is None else st.row[m]
        parts.append(
            step_time_from_arrays(
                placement, held.topk_ids[m], st.step[m] - lo, st.rank[m], int(hi - lo), step_tokens, phase,
                dispatch, model, cluster, rows=rows, context_len=context_len,
            )
        )  # fmt: skip
    w = np.diff(edges) / st.num_steps

    def mean(attr: str) -> float:
        return float(sum(wi * getattr(p, attr) for wi, p in zip(w, parts)))

    whole = tuple(p.whole_ms for p in parts)
    return PhasePrice(
        phase, step_tokens, st.num_steps, mean("whole_ms"), mean("moe_ms"), mean("dispatch_overhead_ms"), whole,
        parts[0].calibrated,
    )  # fmt: skip


def gain(option: PhasePrice, baseline: PhasePrice) -> tuple[float, float]:
    """``(gain, band)``: throughput gain of ``option`` over ``baseline`` and twice its standard error."""
    g = baseline.whole_ms / option.whole_ms - 1.0 if option.whole_ms > 0 else 0.0
    a, b = np.asarray(option.block_whole_ms), np.asarray(baseline.block_whole_ms)
    if a.size < 2 or a.size != b.size:
        return float(g), 0.0
    per = b / np.where(a > 0, a, 1.0) - 1.0
    return float(g), float(2.0 * per.std(ddof=1) / math.sqrt(per.size))


MODEL_NOTE = (
    "step time: placement.cost.step_time (one cost model: per GPU grouped GEMM from tokens and active experts, "
    "dispatch/combine by kernel per phase, the dispatch's own per-step cost, attention and the rest of the step)"
)
