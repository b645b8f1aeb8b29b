"""The cost model's primitive timings (seconds), numpy only; described in docs/layout.md.

Every caller that prices time (the step-time model, the planner, advise, the exact solvers' decode
objective, the rebalance rule and the rebalancer) computes it here, from the hardware presets of
:mod:`placement.cost.hardware` and the shapes of :mod:`placement.cost.modelspec`:

- :func:`gemm_time`: ``max(F / (P eta_c), M / (BW eta_m)) + t0``.
- :func:`expert_gemm_time`: one GPU's grouped expert GEMM from its token-expert pairs ``n`` and its
  active experts ``A`` (``F = 6 d f n``, ``M = A W + n x activation bytes``).
- :func:`a2a_time`: one dispatch or combine, ``alpha + max(NVLink bytes / B_nvl, RDMA bytes / B_rdma)``
  with the low-latency (decode) or normal (prefill) kernels' figures.
- :func:`allreduce_time`: the small count all-reduce a per-step dispatch runs in every MoE layer.
- :func:`attention_time`, :func:`mlp_time`, :func:`lm_head_time`: the parts of a step the placement
  does not change (attention reading the KV cache, shared experts, dense MLPs, the LM head).

Traffic (what each GPU sends and receives) is counted in :mod:`placement.cost.traffic`, a rebalance's
weight copies are priced in :mod:`placement.cost.migration`.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from placement.cost.hardware import ClusterSpec, GpuSpec
from placement.cost.modelspec import ModelSpec
from placement.steps import PHASES

__all__ = [
    "KERNELS",
    "a2a_time",
    "allreduce_time",
    "assignment_seconds",
    "attention_time",
    "expert_gemm_time",
    "gemm_time",
    "kernel_of_phase",
    "lm_head_time",
    "mlp_time",
]

KERNELS = ("low_latency", "normal")


def kernel_of_phase(phase: str) -> str:
    """DeepEP's choice: low-latency kernels for decode, normal (node-deduplicated) kernels for prefill."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    return "low_latency" if phase == "decode" else "normal"


def gemm_time(
    gpu: GpuSpec, flops: ArrayLike, bytes_moved: ArrayLike, weight_bytes: float = 1.0
) -> np.ndarray:
    """``max(F / (P eta_c), M / (BW eta_m)) + t0`` (seconds); ``flops``/``bytes_moved`` broadcast."""
    P = gpu.peak_flops(weight_bytes) * gpu.eta_compute
    BW = gpu.hbm_bandwidth * gpu.eta_memory
    return (
        np.maximum(np.asarray(flops, dtype=np.float64) / P, np.asarray(bytes_moved, dtype=np.float64) / BW)
        + gpu.gemm_overhead
    )


def expert_gemm_time(gpu: GpuSpec, model: ModelSpec, tokens: ArrayLike, active: ArrayLike) -> np.ndarray:
    """One GPU's grouped expert GEMM: ``tokens`` token-expert pairs over ``active`` experts (any shape,
    broadcast). FLOPs ``6 d f n``; bytes ``A W`` (every active expert's weights read once) plus the
    activations (dispatched input, BF16 output, the ``4 f`` intermediate)."""
    d, f = model.hidden_size, model.moe_intermediate_size
    n = np.asarray(tokens, dtype=np.float64)
    act = n * (model.dispatch_bytes_per_token + 2 * d + 4 * f)
    return gemm_time(
        gpu, 6.0 * d * f * n, np.asarray(active, float) * model.expert_bytes + act, model.weight_bytes
    )


def assignment_seconds(gpu: GpuSpec, model: ModelSpec) -> float:
    """Compute seconds of one (token, expert) assignment above the knee: ``6 d f / (P eta_c)``
    (DeepSeek-V3 on Hopper FP8: 82 ns)."""
    d, f = model.hidden_size, model.moe_intermediate_size
    return 6.0 * d * f / (gpu.peak_flops(model.weight_bytes) * gpu.eta_compute)


def a2a_time(
    cluster: ClusterSpec,
    nvl_bytes: ArrayLike,
    rdma_bytes: ArrayLike,
    num_nodes: int,
    ep_size: int,
    kernel: str = "low_latency",
) -> np.ndarray:
    """``alpha + max(NVLink_bytes / B_nvl, RDMA_bytes / B_rdma)`` per GPU; 0 when ``ep_size == 1``.

    ``alpha`` is the inter-node latency when the EP group spans nodes, else the intra-node one;
    ``kernel`` picks the ``low_latency`` or ``normal`` figures of each link.
    """
    if ep_size <= 1:
        return np.zeros_like(np.asarray(nvl_bytes, dtype=np.float64))
    b_nvl, a_nvl = cluster.intra.kernel(kernel)
    b_rdma, a_rdma = cluster.inter.kernel(kernel)
    alpha = a_rdma if num_nodes > 1 else a_nvl
    return alpha + np.maximum(np.asarray(nvl_bytes, float) / b_nvl, np.asarray(rdma_bytes, float) / b_rdma)


def allreduce_time(cluster: ClusterSpec, nbytes: float, num_nodes: int, ep_size: int) -> float:
    """One small all-reduce of ``nbytes`` across the EP group (ring: ``2 (G-1)/G`` bytes per GPU);
    0 for one GPU."""
    if ep_size <= 1:
        return 0.0
    link = cluster.inter if num_nodes > 1 else cluster.intra
    return link.allreduce_latency + 2.0 * (ep_size - 1) / ep_size * float(nbytes) / link.bandwidth


def mlp_time(model: ModelSpec, gpu: GpuSpec, tokens: float, inter: int, split: int = 1) -> float:
    """A GLU MLP of intermediate size ``inter`` (shared expert, dense layer) for ``tokens`` tokens,
    its weights split over ``split`` ranks; 0 when ``inter`` is 0."""
    if inter <= 0:
        return 0.0
    d = model.hidden_size
    w = 3.0 * d * inter * model.weight_bytes / split
    return float(gemm_time(gpu, 6.0 * d * inter * tokens / split, w + tokens * 4 * d, model.weight_bytes))


def _attention_core(model: ModelSpec, b: float, phase: str, context_len: float, attn_tp: int):
    """``(FLOPs, KV bytes read)`` of one attention core for ``b`` tokens (MLA absorbed in decode)."""
    H, t, c = model.num_attention_heads, attn_tp, float(context_len)
    if model.attention == "mla":
        qk, v = model.qk_nope_head_dim + model.qk_rope_head_dim, model.v_head_dim
        decode_core = 2.0 * H * (2 * model.kv_lora_rank + model.qk_rope_head_dim)  # per cached token
    else:
        qk = v = model.head_dim
        decode_core = 2.0 * H * 2 * model.head_dim
    if phase == "decode":
        kv_read = b * c * model.kv_bytes_per_token_layer * (t if model.attention == "mla" else 1)
        return decode_core * c * b, kv_read
    return 2.0 * H * (qk + v) * (c / 2) * b, b * model.kv_bytes_per_token_layer  # causal: half the prompt


def attention_time(
    model: ModelSpec, cluster: ClusterSpec, b: float, phase: str, context_len: float, attn_tp: int = 1
) -> float:
    """One attention block for ``b`` tokens on one GPU: projections by :func:`gemm_time`, the core as
    ``max(FLOPs / (P_bf16 eta_attn), KV read / (BW eta_m)) + t0`` (decode reads ``b x context_len``
    cached tokens; prefill attends half the prompt on average), plus an all-reduce inside the
    attention-TP group when ``attn_tp > 1`` (the link's all-reduce latency, not the all-to-all's)."""
    gpu, t = cluster.gpu, attn_tp
    proj_flops = 2.0 * model.attention_params * b
    w_bytes = model.attention_params * model.weight_bytes / t
    core, kv_read = _attention_core(model, b, phase, context_len, t)
    proj = float(gemm_time(gpu, proj_flops, w_bytes + b * model.hidden_size * 4, model.weight_bytes))
    time = proj + max(
        core / (gpu.flops_bf16 * gpu.eta_attention), kv_read / (gpu.hbm_bandwidth * gpu.eta_memory)
    )
    time += gpu.gemm_overhead
    if t > 1:  # one all-reduce of the attention output inside the TP group (a ring's bytes)
        time += (
            cluster.intra.allreduce_latency
            + 2.0 * (t - 1) / t * b * t * model.hidden_size * 2 / cluster.intra.bandwidth
        )
    return float(time)


def lm_head_time(
    model: ModelSpec, gpu: GpuSpec, b: float, phase: str, context_len: float, attn_tp: int = 1
) -> float:
    """The LM head (BF16) for one step of ``b`` tokens per rank; prefill computes logits for one token
    per prompt (``b / context_len``, at least 1)."""
    head_tokens = b if phase == "decode" else max(1.0, b / float(context_len))
    return float(
        gemm_time(
            gpu,
            2.0 * model.vocab_size * model.hidden_size * head_tokens,
            model.vocab_size * model.hidden_size * 2.0 / attn_tp,
            2.0,
        )
    )
