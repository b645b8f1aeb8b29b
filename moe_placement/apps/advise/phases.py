"""Pricing one option in one phase (decode or prefill) on the held-out steps, and its gain over a baseline.

The one place advise turns a placement into step time: :func:`price_phase`, with the one cost model
(:func:`placement.cost.step_time.step_time_from_arrays`: whole step = MoE layers + the dispatch's own
per-step cost + the rest of the step). The held-out steps are cut into ``BLOCKS`` blocks of consecutive
steps, each priced alone: the mean step is their step-weighted mean, and the band of a gain is twice the
standard error of the per-block gains (paired: the same blocks for option and baseline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from placement.cost.hardware import ClusterSpec
from placement.cost.modelspec import ModelSpec
from placement.cost.step_time import StepOptions, rest_of_step_seconds, step_time_from_arrays
from placement.cost.traffic import StepArrays
from placement.model import Placement
from placement.steps import Steps, make_steps, priced_phase
from profiling.trace import RoutingTrace

__all__ = [
    "BLOCKS",
    "MODEL_NOTE",
    "PUBLISHED_GAIN",
    "PhasePrice",
    "band_side",
    "band_text",
    "band_warning",
    "count_steps",
    "gain",
    "held_out_steps",
    "known",
    "price_phase",
    "published_band",
    "with_context",
]

BLOCKS = 8  # blocks of held-out steps the band is measured over

# Published whole-step throughput gains of expert balancing over none, percent: (low, high, source).
# The "over none" rows of benchmarks/step_model_check.py's PUBLISHED_GAINS (a test checks they agree),
# all measured on DeepSeek-V3-scale serving (671B, FP8, 61 layers, 256 experts, EP 32+).
PUBLISHED_GAIN: dict[str, tuple[float, float, str]] = {
    "decode": (
        2.6,
        7.5,
        "SGLang DeepEP waterfill +2.6-4.3%, vLLM-Ascend EPLB TPOT -7% (+7.5%), DeepSeek-V3 scale",
    ),
    "prefill": (4.9, 18.0, "SGLang EPLB +4.9-13.5%, large-scale EP prefill +18%, DeepSeek-V3 scale"),
}


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
    block_steps: tuple[int, ...] = ()  # steps in each block (``[B]``, the weights of the mean)
    block_tokens: tuple[float, ...] = ()  # tokens per rank per step held in each block (``[B]``)


def held_out_steps(held: RoutingTrace, ep_size: int, phase: str, step_tokens: int, seed: int = 0) -> Steps:
    """The held-out steps of ``phase`` (:func:`placement.steps.make_steps`: decode = continuous batching of
    ``step_tokens`` sequences per rank, prefill = chunks of ``step_tokens`` consecutive tokens)."""
    return make_steps(held, ep_size, phase, step_tokens, seed=seed)


def count_steps(held: RoutingTrace, ep_size: int, phase: str, step_tokens: int) -> int:
    """Held-out steps of ``phase`` with ``step_tokens`` tokens per rank on ``ep_size`` ranks (0: none fits)."""
    try:
        return held_out_steps(held, ep_size, phase, step_tokens).num_steps
    except ValueError:
        return 0


def price_phase(
    placement: Placement,
    held: RoutingTrace,
    steps: Steps,
    dispatch: str,
    model: ModelSpec,
    cluster: ClusterSpec,
    context_len: int,
    *,
    kernel: str | None = None,
    overlap: bool = False,
) -> PhasePrice:
    """Price ``placement`` under ``dispatch`` on the held-out ``steps`` (module docstring), with the
    all-to-all ``kernel`` the command selects (None: the phase's own) and two-batch ``overlap``."""
    assert held.topk_ids is not None
    ids = np.asarray(held.topk_ids)[steps.token]  # [N, L, k]
    S = steps.num_steps
    edges = np.linspace(0, S, min(BLOCKS, S) + 1).round().astype(int)
    parts = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (steps.step >= lo) & (steps.step < hi)
        block = StepArrays(
            ids[m],
            steps.step[m] - lo,
            steps.rank[m],
            int(hi - lo),
            steps.step_tokens,
            steps.phase,
            steps.row[m],
        )
        parts.append(
            step_time_from_arrays(
                placement,
                block,
                dispatch,
                model,
                cluster,
                context_len=context_len,
                options=StepOptions(kernel=kernel, overlap="on" if overlap else "off"),
            )
        )
    w = np.diff(edges) / S
    G = placement.topology.ep_size
    held_tokens = [
        float(((steps.step >= lo) & (steps.step < hi)).sum()) / ((hi - lo) * G)
        for lo, hi in zip(edges[:-1], edges[1:])
    ]

    def mean(attr: str) -> float:
        return float(sum(wi * getattr(p, attr) for wi, p in zip(w, parts)))

    whole = tuple(p.whole_ms for p in parts)
    return PhasePrice(
        phase=steps.phase,
        step_tokens=steps.step_tokens,
        num_steps=S,
        whole_ms=mean("whole_ms"),
        moe_ms=mean("moe_ms"),
        dispatch_overhead_ms=mean("dispatch_overhead_ms"),
        block_whole_ms=whole,
        calibrated=parts[0].calibrated,
        block_steps=tuple(int(n) for n in np.diff(edges)),
        block_tokens=tuple(held_tokens),
    )


def with_context(
    price: PhasePrice, model: ModelSpec, cluster: ClusterSpec, old: float, new: float
) -> PhasePrice:
    """``price`` at another context length: only the rest of the step (attention reading the KV cache)
    changes, block by block (:func:`placement.cost.step_time.rest_of_step_seconds`); exact without
    two-batch overlap."""
    phase = priced_phase(price.phase)

    def rest_ms(tokens: float, c: float) -> float:
        t = tokens if tokens > 0 else price.step_tokens
        return rest_of_step_seconds(model, cluster, t, phase, c) * 1e3

    blocks = tuple(
        w + rest_ms(t, new) - rest_ms(t, old) for w, t in zip(price.block_whole_ms, price.block_tokens)
    )
    weights = np.asarray(price.block_steps, dtype=float)
    return replace(price, whole_ms=float(np.dot(weights, blocks) / weights.sum()), block_whole_ms=blocks)


def gain(option: PhasePrice, baseline: PhasePrice) -> tuple[float, float]:
    """``(gain, band)``: throughput gain of ``option`` over ``baseline`` and twice its standard error;
    the band is NaN (JSON null) when the held-out steps form one block (one step): it cannot be estimated."""
    g = baseline.whole_ms / option.whole_ms - 1.0 if option.whole_ms > 0 else 0.0
    a, b = np.asarray(option.block_whole_ms), np.asarray(baseline.block_whole_ms)
    if a.size < 2 or a.size != b.size:
        return float(g), math.nan
    per = b / np.where(a > 0, a, 1.0) - 1.0
    return float(g), float(2.0 * per.std(ddof=1) / math.sqrt(per.size))


def known(band: float) -> float:
    """A band for a decision: an unknown one (NaN, one held-out step) counts as 0; it is said, not hidden."""
    return 0.0 if math.isnan(band) else band


def band_text(band: float) -> str:
    """``"band 0.12%"``, or why there is none."""
    return "band unknown: one held-out step" if math.isnan(band) else f"band {band * 100:.2f}%"


def published_band(phase: str) -> tuple[float, float, str]:
    """``(low %, high %, source)`` of the published whole-step gains of balancing in ``phase``."""
    return PUBLISHED_GAIN[phase]


def band_side(phase: str, whole_gain: float) -> str | None:
    """``"above"`` or ``"below"`` the published band of ``phase`` for a gain (fraction); None inside."""
    lo, hi, _ = published_band(phase)
    return "above" if whole_gain * 100.0 > hi else "below" if whole_gain * 100.0 < lo else None


def band_warning(phase: str, whole_gain: float, why: str) -> str | None:
    """A warning when a modelled whole-step gain (fraction) lies outside the published band of ``phase``
    (None inside it): the published figures were measured elsewhere, so the modelled one is named next
    to them, never clipped; ``why`` says what makes this deployment differ."""
    side = band_side(phase, whole_gain)
    if side is None:
        return None
    lo, hi, src = published_band(phase)
    return (
        f"modelled {phase} whole-step gain {whole_gain * 100:+.1f}% is {side} the published {lo:g}-{hi:g}% "
        f"({src}): {why}; modelled, not measured"
    )


MODEL_NOTE = (
    "step time: placement.cost.step_time (one cost model: per GPU grouped GEMM from tokens and active experts, "
    "dispatch/combine by kernel per phase, the dispatch's own per-step cost, attention and the rest of the step)"
)
