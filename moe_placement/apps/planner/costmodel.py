"""A step-time and memory model for MoE serving with attention-DP and expert-EP (no GPU needed).

The model docs/layout.md describes. Shapes: L MoE layers, E logical experts, P physical slots,
G EP ranks (GPUs), N nodes, m = G/N GPUs per node, S steps sampled from a trace.

Per MoE layer and GPU ``g`` (decode or prefill step, ``b`` tokens per attention-DP rank):

- expert compute (grouped GEMM with the small-GEMM penalty)::

      F_g = 6 d f n_g ;  M_g = A_g W + n_g (activation bytes) ;
      T_comp(g) = max(F_g / (P eta_c), M_g / (BW eta_m)) + t0

  ``n_g`` token-expert pairs on ``g`` (from :func:`placement.metrics.expected_gpu_load` or, with a
  trace, :func:`placement.metrics.route_tokens`), ``A_g`` experts with at least one token, ``W`` one
  expert's weights (``3 d f b_w``).
- dispatch and combine::

      T_a2a = alpha + max_g max(NVLink_bytes(g) / B_nvl, RDMA_bytes(g) / B_rdma)   (send and receive)

  ``a2a_mode="normal"`` (prefill; DeepEP normal kernels): node-deduplicated, a token crosses RDMA
  once per remote node it needs and NVLink fans it out. ``a2a_mode="low_latency"`` (decode; DeepEP
  low-latency kernels): one copy per (token, expert) pair, off-node copies over RDMA, on-node over
  NVLink. Without a token trace the bytes are an analytic expectation from per-expert loads assuming
  the ``k`` picks of a token are independent; with a trace they are counted token by token.
- attention: projections with the GEMM formula, plus the attention core
  ``max(FLOPs / (P_bf16 eta_attn), KV read / (BW eta_m)) + t0``; shared
  experts, dense MLP layers and the LM head with the GEMM formula above.
- layer: ``T_attn + T_shared + T_dispatch + max_g T_comp + T_combine``; with two-batch overlap
  (two micro-batches of ``b/2``) ``2 max(T_attn + T_shared + T_comp, T_dispatch + T_combine)``
  evaluated at ``b/2``. ``overlap="auto"`` keeps the faster of the two (an engine turns TBO off when
  it does not pay: at tiny batches each half re-reads every expert's weights).
- memory per GPU: non-expert weights + ``slots_per_gpu x W x L_moe`` (every redundant slot costs one
  expert's weights in every MoE layer) + a runtime reserve; the rest is KV cache.

Layout: model descriptions (:class:`ModelSpec`, :func:`load_model`) live in
:mod:`placement.cost.modelspec`, per-step workloads (:class:`Workload`, :func:`analytic_workload`,
:func:`trace_workload`) in :mod:`moe_placement.apps.planner.workload`, the primitive timings (``gemm_time``,
``a2a_time``, attention, MLPs, LM head; re-exported here) in :mod:`placement.cost.primitives`, the one
cost model every caller shares. This module holds the options, memory and the layout step time.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np

from moe_placement.apps.planner.workload import Workload
from moe_placement.base.limits import MAX_STEP_TOKENS, check_context_len, check_whole
from moe_placement.base.options import refuse_unknown_keywords
from placement.cost.hardware import ClusterSpec, GpuSpec
from placement.cost.modelspec import ModelSpec
from placement.cost.primitives import (
    a2a_time,
    attention_time,
    expert_gemm_time,
    gemm_time,
    lm_head_time,
    mlp_time,
)
from placement.steps import SIZING_STEP_TOKENS

if TYPE_CHECKING:
    from placement.model import Placement

__all__ = [
    "CostOptions",
    "gemm_time",
    "a2a_time",
    "LayerCost",
    "MemoryBreakdown",
    "StepCost",
    "memory_per_gpu",
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
        a2a_mode: ``auto`` (decode -> low_latency, prefill -> normal), ``normal`` or ``low_latency``.
        overlap: ``off``, ``on`` (two-batch overlap) or ``auto`` (the faster; reported).
        attn_tp: attention tensor-parallel size inside an attention-DP group.
        reserve_fraction: HBM kept for activations, CUDA graphs, communication buffers
            (SGLang's ``mem_fraction_static`` 0.9 leaves 0.1; band 0.05-0.2).
    """

    phase: Literal["decode", "prefill"] = "decode"
    step_tokens: int = SIZING_STEP_TOKENS["decode"]
    context_len: int = 4096
    a2a_mode: Literal["auto", "normal", "low_latency"] = "auto"
    overlap: Literal["off", "on", "auto"] = "auto"
    attn_tp: int = 1
    reserve_fraction: float = 0.10

    def __post_init__(self) -> None:
        if self.phase not in ("decode", "prefill"):
            raise ValueError(f"phase must be 'decode' or 'prefill', got {self.phase!r}")
        sizes = {"step_tokens": self.step_tokens, "context_len": self.context_len, "attn_tp": self.attn_tp}
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.step_tokens < 1 or self.context_len < 1 or self.attn_tp < 1:
            raise ValueError(
                f"step_tokens, context_len and attn_tp must be >= 1, got {self.step_tokens}, {self.context_len}, {self.attn_tp}"
            )
        check_whole("step_tokens", self.step_tokens, 1, MAX_STEP_TOKENS, fix="(MAX_STEP_TOKENS)")
        check_context_len(self.context_len)  # the bound the CLI's --context-len has
        if self.a2a_mode not in ("auto", "normal", "low_latency") or self.overlap not in (
            "off",
            "on",
            "auto",
        ):
            raise ValueError(
                f"a2a_mode in auto/normal/low_latency and overlap in off/on/auto, got {self.a2a_mode}, {self.overlap}"
            )
        if not 0 <= self.reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction}")

    @property
    def mode(self) -> str:
        if self.a2a_mode != "auto":
            return self.a2a_mode
        return "low_latency" if self.phase == "decode" else "normal"


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


def _attention_time(model: ModelSpec, cluster: ClusterSpec, b: float, options: CostOptions) -> float:
    """One attention block for ``b`` tokens on one GPU (:func:`placement.cost.primitives.attention_time`)."""
    return attention_time(model, cluster, b, options.phase, options.context_len, options.attn_tp)


def _mlp_time(model: ModelSpec, gpu: GpuSpec, tokens: float, inter: int, split: int = 1) -> float:
    return mlp_time(model, gpu, tokens, inter, split)


def _moe_parts(
    model: ModelSpec,
    cluster: ClusterSpec,
    wl: Workload,
    scale: float,
    num_nodes: int,
    ep_size: int,
    kernel: str,
):
    """Per-step, per-layer ``(dispatch, compute max over g, combine, compute mean)`` arrays ``[S, L]``."""
    n = wl.gpu_tokens(scale)  # [S, L, G]
    A = wl.active_experts(scale)  # [S, L, G]
    comp = expert_gemm_time(cluster.gpu, model, n, A)  # [S, L, G]
    parts = []
    for per_token in (model.dispatch_bytes_per_token, model.combine_bytes_per_token):
        nvl, rdma = wl.nvl_units * scale * per_token, wl.rdma_units * scale * per_token
        parts.append(a2a_time(cluster, nvl, rdma, num_nodes, ep_size, kernel).max(axis=2))
    return parts[0], comp.max(axis=2), parts[1], comp.mean(axis=2), A.max(axis=2), n


@dataclass(frozen=True)
class StepCost:
    """One forward step on one GPU.

    ``step_time`` seconds; ``tokens_per_s_per_gpu = step_tokens / step_time``.
    """

    step_time: float
    tokens_per_s_per_gpu: float
    layer: LayerCost
    moe_layers_time: float
    dense_layers_time: float
    lm_head_time: float
    bottleneck: str
    workload_how: str


def step_cost(
    model: ModelSpec, cluster: ClusterSpec, placement: Placement, workload: Workload, options: CostOptions
) -> StepCost:
    """Step time of one attention-DP rank (all ranks run in lockstep through the all-to-alls).

    Steps: per-layer parts at the full batch and at a TBO half -> overlap choice -> MoE, dense and
    LM-head times -> mean layer breakdown and bottleneck.

    Args:
        placement: the :class:`Placement` the workload was computed for (its topology gives G and N).
        workload: from ``analytic_workload`` or ``trace_workload`` (:mod:`moe_placement.apps.planner.workload`).
    """
    t = placement.topology
    G, N = t.ep_size, t.num_nodes
    b = float(options.step_tokens)
    full = _layer_parts(model, cluster, workload, options, b, 1.0, N, G)
    no = full.attn + full.shared + full.disp + full.comp + full.comb  # [S, L]
    half = _layer_parts(model, cluster, workload, options, b, 0.5, N, G)
    tbo = 2.0 * np.maximum(half.attn + half.shared + half.comp, half.disp + half.comb)
    used, on = _choose_overlap(no, tbo, options.overlap)
    # The workload has L rows; the model may have more MoE layers (a trace of some layers): scale the mean.
    moe_time = float(used.mean() * model.num_moe_layers)
    dense_time, lm = _dense_and_head_time(model, cluster, b, options)
    step = moe_time + dense_time + lm
    layer = _layer_cost(model, cluster.gpu, full, no, tbo, used, on)
    return StepCost(step, b / step, layer, moe_time, float(dense_time), lm, _bottleneck(layer), workload.how)


class _Parts(NamedTuple):
    """Per-layer times ``[S, L]`` (attention and shared expert: scalars), plus ``n [S, L, G]``."""

    attn: float
    shared: float
    disp: np.ndarray
    comp: np.ndarray
    comb: np.ndarray
    comp_mean: np.ndarray
    amax: np.ndarray
    n: np.ndarray


def _layer_parts(
    model: ModelSpec,
    cluster: ClusterSpec,
    workload: Workload,
    options: CostOptions,
    b: float,
    scale: float,
    num_nodes: int,
    ep_size: int,
) -> _Parts:
    """One MoE layer's parts for ``b x scale`` tokens per rank (``scale`` 0.5: a TBO micro-batch)."""
    bb = b * scale
    attn = _attention_time(model, cluster, bb, options)
    shared = _mlp_time(model, cluster.gpu, bb, model.shared_intermediate_size)
    disp, comp, comb, comp_mean, amax, n = _moe_parts(
        model, cluster, workload, scale, num_nodes, ep_size, options.mode
    )
    return _Parts(attn, shared, disp, comp, comb, comp_mean, amax, n)


def _choose_overlap(no: np.ndarray, tbo: np.ndarray, overlap: str) -> tuple[np.ndarray, bool]:
    """``(used [S, L], overlap used)``: ``auto`` keeps the faster of no overlap and TBO on the mean."""
    if overlap == "off":
        return no, False
    if overlap == "on":
        return tbo, True
    on = bool(tbo.mean() < no.mean())
    return (tbo if on else no), on


def _dense_and_head_time(
    model: ModelSpec, cluster: ClusterSpec, b: float, options: CostOptions
) -> tuple[float, float]:
    """``(dense layers, LM head)`` seconds of one step (the LM head sees one token per prompt in prefill)."""
    gpu = cluster.gpu
    dense_attn = _attention_time(model, cluster, b, options)
    dense_time = model.num_dense_layers * (
        dense_attn + _mlp_time(model, gpu, b, model.dense_intermediate_size, options.attn_tp)
    )
    lm = lm_head_time(model, gpu, b, options.phase, options.context_len, options.attn_tp)
    return dense_time, lm


def _layer_cost(
    model: ModelSpec,
    gpu: GpuSpec,
    full: _Parts,
    no: np.ndarray,
    tbo: np.ndarray,
    used: np.ndarray,
    on: bool,
) -> LayerCost:
    """Means over layers and sampled steps of the ``[S, L]`` parts."""
    tokens_per_expert = float(full.n.sum(axis=2).mean() / max(model.num_logical_experts, 1))
    knee = gpu.knee_tokens_per_expert(model.weight_bytes)
    return LayerCost(
        attention=float(np.mean(full.attn)),
        shared=float(np.mean(full.shared)),
        dispatch=float(full.disp.mean()),
        compute=float(full.comp.mean()),
        combine=float(full.comb.mean()),
        no_overlap=float(no.mean()),
        overlapped=float(tbo.mean()),
        used=float(used.mean()),
        overlap_used=on,
        compute_mean=float(full.comp_mean.mean()),
        active_experts_max=float(full.amax.mean()),
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
