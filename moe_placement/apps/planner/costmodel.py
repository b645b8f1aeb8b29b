"""The layout planner's options, memory model and step cost, on the one cost model (placement/cost/).

Shapes: L MoE layers, E logical experts, P physical slots, G EP ranks (GPUs), S steps.

The time of a step is not computed here: what each step asks of each GPU comes from the traffic model
(:mod:`placement.cost.traffic`: :func:`~placement.cost.traffic.expected_loads` from per-expert loads,
:func:`~placement.cost.traffic.counted_loads` from a trace's steps), and the whole step from
:func:`placement.cost.step_time.price_breakdown`, the one definition ``evaluate --model`` and ``advise``
share (per MoE layer: attention + shared expert + the slowest GPU's grouped GEMM + dispatch + combine,
or with two-batch overlap ``2 max(attention + shared + GEMM, dispatch + combine)`` at half the batch;
``overlap="auto"`` keeps the faster; then dense layers, the LM head and a per-step dispatch's cost).
This module holds :class:`CostOptions`, the memory per GPU (every redundant slot costs one expert's
weights in every MoE layer; the rest is KV cache) and :class:`LayoutCost`, the step a layout gets with
its per-layer breakdown.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from moe_placement.base.limits import MAX_STEP_TOKENS, check_context_len, check_whole
from moe_placement.base.options import refuse_unknown_keywords
from placement.cost.hardware import ClusterSpec, GpuSpec
from placement.cost.modelspec import ModelSpec
from placement.cost.primitives import KERNELS, expert_gemm_time
from placement.cost.step_time import OVERLAPS, StepOptions, StepTime, price_breakdown, price_loads
from placement.dispatch import EVEN, get_dispatch
from placement.steps import PHASES, SIZING_STEP_TOKENS

if TYPE_CHECKING:
    from placement.cost.step_time import LayerBreakdown
    from placement.cost.traffic import StepLoads
    from placement.model import Placement

__all__ = [
    "CostOptions",
    "LayerCost",
    "LayoutCost",
    "MemoryBreakdown",
    "layout_loads",
    "memory_per_gpu",
    "price_layout",
    "step_cost",
]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Options and primitive timings
# ---------------------------------------------------------------------------------------------
@refuse_unknown_keywords
@dataclass(frozen=True)
class CostOptions:
    """Knobs of one evaluation.

    Attributes:
        phase: ``decode`` (``step_tokens`` sequences, each attending ``context_len`` cached tokens)
            or ``prefill`` (``step_tokens`` prompt tokens of prompts ``context_len`` long).
        step_tokens: tokens per GPU per step ``b`` (default: the decode size a deployment is sized at,
            ``placement.steps.SIZING_STEP_TOKENS``).
        a2a_mode: the all-to-all kernel: ``auto`` (by phase: decode low_latency, prefill normal),
            ``normal`` or ``low_latency`` (what the launch selects).
        overlap: ``off``, ``on`` (two-batch overlap) or ``auto`` (the faster; reported).
        attn_tp: attention tensor-parallel size inside an attention-DP group.
        reserve_fraction: HBM kept for activations, CUDA graphs, communication buffers
            (SGLang's ``mem_fraction_static`` 0.9 leaves 0.1; band 0.05-0.2).
        max_steps: with a trace, the first steps of ``placement.steps.make_steps`` priced (None: all,
            as ``evaluate --model`` prices them).
        dispatch: the dispatch model the placement serves under (``placement.dispatch``): how a step's
            tokens split over an expert's replicas, and its own per-step cost (a per-step split's count
            all-reduce); the layout planner's placements are for the even split.
    """

    phase: Literal["decode", "prefill"] = "decode"
    step_tokens: int = SIZING_STEP_TOKENS["decode"]
    context_len: int = 4096
    a2a_mode: Literal["auto", "normal", "low_latency"] = "auto"
    overlap: Literal["off", "on", "auto"] = "auto"
    attn_tp: int = 1
    reserve_fraction: float = 0.10
    max_steps: int | None = None
    dispatch: str = EVEN.name

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
        sizes = {"step_tokens": self.step_tokens, "context_len": self.context_len, "attn_tp": self.attn_tp}
        if self.max_steps is not None:
            sizes["max_steps"] = self.max_steps
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.a2a_mode not in ("auto", *KERNELS) or self.overlap not in OVERLAPS:
            raise ValueError(
                f"a2a_mode in {('auto', *KERNELS)} and overlap in {OVERLAPS}, got {self.a2a_mode}, {self.overlap}"
            )
        check_whole("step_tokens", self.step_tokens, 1, MAX_STEP_TOKENS, fix="(MAX_STEP_TOKENS)")
        check_context_len(self.context_len)  # the bound the CLI's --context-len has
        if not 0 <= self.reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction}")
        get_dispatch(self.dispatch)

    @property
    def step_options(self) -> StepOptions:
        """What the one step-time model takes from these options (kernel, overlap, attention TP)."""
        return StepOptions(kernel=self.mode, overlap=self.overlap, attn_tp=self.attn_tp)

    @property
    def mode(self) -> str:
        """The all-to-all kernel priced (:func:`placement.cost.step_time.priced_kernel`)."""
        from placement.cost.step_time import priced_kernel

        return priced_kernel(self.phase, None if self.a2a_mode == "auto" else self.a2a_mode)


# ---------------------------------------------------------------------------------------------
# Layer and step
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerCost:
    """Mean per-MoE-layer times in seconds (mean over layers and sampled steps)."""

    attention: float
    shared: float
    dispatch: float
    compute: float
    combine: float
    no_overlap: float
    overlapped: float
    used: float
    overlap_used: bool
    compute_mean: float
    active_experts_max: float
    tokens_per_expert: float
    memory_bound: bool


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU."""

    hbm: float
    non_expert: float
    expert: float
    redundant: float
    reserve: float
    kv_free: float
    kv_needed: float
    kv_per_sequence: float

    @property
    def fits(self) -> bool:
        return self.kv_free >= self.kv_needed and self.kv_free >= 0

    @property
    def max_step_tokens(self) -> int:
        """The most decode sequences per rank whose KV cache fits."""
        return int(max(self.kv_free, 0) // self.kv_per_sequence) if self.kv_per_sequence > 0 else 0

    def explain(self) -> str:
        gb = 1e9
        used = self.non_expert + self.expert + self.reserve
        if self.kv_free < 0:
            return (
                f"weights do not fit: {self.expert / gb:.1f} GB experts (incl. {self.redundant / gb:.1f} GB redundant) + "
                f"{self.non_expert / gb:.1f} GB other weights + {self.reserve / gb:.1f} GB reserve = {used / gb:.1f} GB "
                f"> {self.hbm / gb:.1f} GB HBM"
            )
        return (
            f"KV cache does not fit: needs {self.kv_needed / gb:.1f} GB, {self.kv_free / gb:.1f} GB left after "
            f"{self.expert / gb:.1f} GB experts (incl. {self.redundant / gb:.1f} GB redundant) + "
            f"{self.non_expert / gb:.1f} GB other weights + {self.reserve / gb:.1f} GB reserve; "
            f"at most {self.max_step_tokens} sequences per rank"
        )


def memory_per_gpu(
    model: ModelSpec, gpu: GpuSpec, ep_size: int, num_physical_experts: int, options: CostOptions
) -> MemoryBreakdown:
    """Weights, redundant-slot cost and KV space per GPU.

    Every redundant slot costs one expert's weights in every MoE layer (DeepSeek-V3: 44 MB x 58 =
    2.55 GB per GPU per extra slot). MLA's latent KV is replicated over ``attn_tp`` ranks; GQA's splits.
    """
    if num_physical_experts % ep_size:
        raise ValueError(f"{num_physical_experts} physical experts do not divide over ep_size={ep_size}")
    spg = num_physical_experts // ep_size
    per_slot = model.expert_bytes * model.num_moe_layers
    expert = spg * per_slot
    base_slots = math.ceil(model.num_logical_experts / ep_size)
    redundant = max(spg - base_slots, 0) * per_slot
    t = options.attn_tp
    non_expert = model.non_expert_bytes(t)
    reserve = options.reserve_fraction * gpu.hbm_bytes
    kv_free = gpu.hbm_bytes - non_expert - expert - reserve
    kv_token = model.kv_bytes_per_token * (
        1.0 if model.attention == "mla" else 1.0 / min(t, model.num_kv_heads)
    )
    seqs_per_gpu = options.step_tokens * (t if model.attention == "mla" else 1)
    if options.phase == "decode":
        kv_needed = seqs_per_gpu * options.context_len * kv_token
        kv_seq = options.context_len * kv_token * (t if model.attention == "mla" else 1)
    else:
        kv_needed = seqs_per_gpu * kv_token
        kv_seq = kv_token * (t if model.attention == "mla" else 1)
    return MemoryBreakdown(gpu.hbm_bytes, non_expert, expert, redundant, reserve, kv_free, kv_needed, kv_seq)


@dataclass(frozen=True)
class LayoutCost:
    """The step one layout gets: the one cost model's :class:`~placement.cost.step_time.StepTime`
    (``time``), the mean MoE layer's breakdown (``layer``), the bottleneck and where the loads came from.

    ``step_time`` seconds; ``tokens_per_s_per_gpu`` = tokens a rank holds per step / ``step_time``.
    """

    time: StepTime
    layer: LayerCost
    bottleneck: str
    workload_how: str

    @property
    def step_time(self) -> float:
        return self.time.whole_ms * 1e-3

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.time.tokens_per_s_per_gpu


def step_cost(
    model: ModelSpec, cluster: ClusterSpec, placement: Placement, loads: StepLoads, options: CostOptions
) -> LayoutCost:
    """Step time of one attention-DP rank (all ranks run in lockstep through the all-to-alls).

    Steps: the one cost model prices ``loads`` (:func:`placement.cost.step_time.price_breakdown`, with
    the options' phase, context, overlap, attention TP; the loads carry their kernel) -> the mean layer's
    breakdown and bottleneck.

    Args:
        placement: the :class:`Placement` the loads were computed for.
        loads: :func:`placement.cost.traffic.expected_loads` or :func:`~placement.cost.traffic.counted_loads`
            with the options' kernel (:attr:`CostOptions.mode`).
    """
    if loads.kernel != options.mode:
        raise ValueError(
            f"the loads were counted for the {loads.kernel} kernels, the options price {options.mode}"
        )
    st, parts = price_breakdown(
        loads,
        model,
        cluster,
        phase=options.phase,
        context_len=options.context_len,
        step_tokens=options.step_tokens,
        options=options.step_options,
        dispatch=options.dispatch,
    )
    layer = _layer_cost(model, cluster.gpu, loads, parts)
    return LayoutCost(st, layer, _bottleneck(layer), loads.how)


def price_layout(model: ModelSpec, cluster: ClusterSpec, loads: StepLoads, opts: CostOptions) -> StepTime:
    """The one step-time model on ``loads`` with the options' phase, context, overlap and attention TP."""
    return price_loads(
        loads,
        model,
        cluster,
        phase=opts.phase,
        context_len=opts.context_len,
        step_tokens=opts.step_tokens,
        options=opts.step_options,
        dispatch=opts.dispatch,
    )


def layout_loads(model: ModelSpec, placement: Placement, load: np.ndarray, trace, opts: CostOptions):
    """``(placement priced, StepLoads)``: counted from the trace's steps when it has the model's experts
    and top-k per token (its first layers, ``make_steps`` as ``evaluate`` builds them), else expected
    from the per-expert loads; split over replicas by the options' dispatch."""
    from placement.cost.step_time import step_loads
    from placement.cost.traffic import expected_loads
    from placement.steps import make_steps

    mode = opts.mode
    if (
        trace is not None
        and trace.has_tokens
        and trace.num_logical_experts == model.num_logical_experts
        and trace.top_k == model.top_k
    ):
        Lt = min(trace.num_layers, placement.num_layers)
        sub = placement.select_layers(range(Lt)) if Lt < placement.num_layers else placement
        tr = trace.select_layers(range(Lt)) if Lt < trace.num_layers else trace
        try:
            G = placement.topology.ep_size
            steps = make_steps(tr, G, opts.phase, opts.step_tokens, max_steps=opts.max_steps)
            return sub, step_loads(sub, tr, steps, opts.dispatch, model, kernel=mode)
        except ValueError as exc:  # trace shorter than one step: fall back to its counts
            log.info("trace steps unavailable (%s); using the analytic expectation", exc)
    return placement, expected_loads(placement, load, model.top_k, opts.step_tokens, mode, opts.dispatch)


def _layer_cost(model: ModelSpec, gpu: GpuSpec, loads: StepLoads, parts: LayerBreakdown) -> LayerCost:
    """Means over layers and steps of the ``[S, L]`` parts, with the GPUs' mean GEMM and most active slots."""
    tokens, active = loads.gpu_tokens(), loads.active_experts()  # [S, L, G]
    tokens_per_expert = float(tokens.sum(axis=2).mean() / max(model.num_logical_experts, 1))
    knee = gpu.knee_tokens_per_expert(model.weight_bytes)
    overlapped = parts.overlapped if parts.overlapped is not None else parts.no_overlap
    return LayerCost(
        attention=float(parts.attention),
        shared=float(parts.shared),
        dispatch=float(parts.dispatch.mean()),
        compute=float(parts.gemm.mean()),
        combine=float(parts.combine.mean()),
        no_overlap=float(parts.no_overlap.mean()),
        overlapped=float(overlapped.mean()),
        used=float(parts.used.mean()),
        overlap_used=parts.overlap_used,
        compute_mean=float(expert_gemm_time(gpu, model, tokens, active).mean()),
        active_experts_max=float(active.max(axis=2).mean()),
        tokens_per_expert=tokens_per_expert,
        memory_bound=bool(tokens_per_expert < knee),
    )


def _bottleneck(layer: LayerCost) -> str:
    """``communication``, ``attention`` or ``experts``: the largest share of a layer."""
    comm = layer.dispatch + layer.combine
    compute = layer.attention + layer.shared + layer.compute
    return (
        "communication"
        if comm > compute
        else ("attention" if layer.attention > layer.compute + layer.shared else "experts")
    )
