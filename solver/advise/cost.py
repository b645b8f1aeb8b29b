"""The cost side of the advice: MoE step time from the peak GPU load, and what replicas take from KV.

Per MoE layer, on the peak GPU of a step of ``b`` tokens per rank (``G`` ranks, ``m`` per node):

    n = PAR_step x b x k                       token-expert pairs on the peak GPU
    A = S (1 - exp(-n / S))                    active experts among its S slots (Poisson)
    T_comp = max(6 d f n / (P eta_c), (A W + n act) / (BW eta_m)) + t0     (placement.cost.primitives.gemm_time)
    T_a2a  = alpha + max(n (m-1)/G bytes / B_nvl, n (G-m)/G bytes / B_rdma) (placement.cost.primitives.a2a_time)
    T_moe  = L_moe (T_disp + T_comp + T_comb)  one copy per (token, pick): no node de-duplication

Attention, dense layers and the LM head do not change with the placement and are left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from placement.cost.hardware import ClusterSpec
from placement.cost.modelspec import ModelSpec
from placement.cost.primitives import a2a_time, gemm_time
from solver.planner.costmodel import CostOptions, memory_per_gpu

__all__ = [
    "FORMULA",
    "MemoryCost",
    "StepTime",
    "crossover_batch",
    "model_slots_per_gpu",
    "moe_step_time",
    "replica_memory",
]

FORMULA = (
    "MoE step time = MoE layers x (dispatch + expert GEMM on the peak GPU + combine); peak GPU pairs = "
    "per-step PAR x tokens per rank x top-k; GEMM = max(FLOPs / (P eta_c), (active experts x weights + "
    "activations) / (HBM eta_m)) + t0; all-to-all = alpha + bytes / link bandwidth (one copy per pick); "
    "attention, dense layers and the LM head are left out (they do not depend on the placement)"
)


@dataclass(frozen=True)
class StepTime:
    """One phase at one batch: seconds of the MoE part of a step, and which bound the GEMM is at."""

    step_s: float
    compute_s: float
    a2a_s: float
    tokens_per_expert: float
    memory_bound: bool


def model_slots_per_gpu(model: ModelSpec, ep_size: int, redundant_per_gpu: int) -> int:
    """Slots per GPU on the model's side: ``ceil(E / G) + r``."""
    return math.ceil(model.num_logical_experts / ep_size) + int(redundant_per_gpu)


def moe_step_time(
    model: ModelSpec,
    cluster: ClusterSpec,
    nodes: int,
    slots_per_gpu: int,
    step_par: float,
    batch_per_rank: float,
) -> StepTime:
    """MoE time of one step (module docstring) at per-step PAR ``step_par`` and ``b`` tokens per rank."""
    gpu = cluster.gpu
    G = nodes * cluster.gpus_per_node
    m = cluster.gpus_per_node
    d, f, S = model.hidden_size, model.moe_intermediate_size, float(slots_per_gpu)
    n = float(step_par) * float(batch_per_rank) * model.top_k
    active = S * (1.0 - math.exp(-n / S))
    act_bytes = n * (model.dispatch_bytes_per_token + 2 * d + 4 * f)
    comp = float(gemm_time(gpu, 6.0 * d * f * n, active * model.expert_bytes + act_bytes, model.weight_bytes))
    nvl, rdma = n * (m - 1) / G, n * (G - m) / G
    a2a = 0.0
    for per_token in (model.dispatch_bytes_per_token, model.combine_bytes_per_token):
        a2a += float(a2a_time(cluster, np.float64(nvl * per_token), np.float64(rdma * per_token), nodes, G))
    per_expert = n / S
    knee = gpu.knee_tokens_per_expert(model.weight_bytes)
    return StepTime(model.num_moe_layers * (comp + a2a), comp, a2a, per_expert, per_expert < knee)


def crossover_batch(model: ModelSpec, cluster: ClusterSpec, slots_per_gpu: int, step_par: float) -> float:
    """Tokens per rank where the peak GPU's expert GEMM turns compute-bound (``n / S`` = the knee)."""
    knee = cluster.gpu.knee_tokens_per_expert(model.weight_bytes)
    return knee * slots_per_gpu / (max(step_par, 1e-9) * model.top_k)


@dataclass(frozen=True)
class MemoryCost:
    """Per GPU: bytes the redundant slots take, the KV-cache tokens they cost, what is left, and the bytes
    left once the user's batch x context is cached (``spare_bytes``; ``fits`` when >= 0)."""

    redundant_bytes: float
    kv_tokens_lost: float
    kv_tokens_left: float
    fits: bool
    spare_bytes: float = 0.0


def replica_memory(
    model: ModelSpec, cluster: ClusterSpec, ep_size: int, redundant_per_gpu: int, batch: int, context_len: int
) -> MemoryCost:
    """From :func:`solver.planner.costmodel.memory_per_gpu`: fits when the KV cache of ``batch`` sequences per
    rank x ``context_len`` tokens still fits beside the weights and the replicas."""
    S = model_slots_per_gpu(model, ep_size, redundant_per_gpu)
    opts = CostOptions(phase="decode", batch_per_rank=batch, context_len=context_len)
    mem = memory_per_gpu(model, cluster.gpu, ep_size, S * ep_size, opts)
    per_token = model.kv_bytes_per_token
    spare = mem.kv_free - mem.kv_needed
    return MemoryCost(
        mem.redundant, mem.redundant / per_token, max(mem.kv_free, 0.0) / per_token, bool(mem.fits), spare
    )
