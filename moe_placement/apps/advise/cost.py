"""The memory side of the advice: what redundant slots take from the KV cache, at the user's batch x context.

Step time is not here: every time figure comes from the one cost model (``placement.cost.step_time``,
through :mod:`moe_placement.apps.advise.phases`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_placement.apps.planner.costmodel import CostOptions, memory_per_gpu
from placement.cost.hardware import ClusterSpec
from placement.cost.modelspec import ModelSpec

__all__ = ["MemoryCost", "model_slots_per_gpu", "replica_memory"]


def model_slots_per_gpu(model: ModelSpec, ep_size: int, redundant_per_gpu: int) -> int:
    """Slots per GPU on the model's side: ``ceil(E / G) + r``."""
    return math.ceil(model.num_logical_experts / ep_size) + int(redundant_per_gpu)


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
    """From :func:`moe_placement.apps.planner.costmodel.memory_per_gpu`: fits when the KV cache of ``batch`` sequences per
    rank x ``context_len`` tokens still fits beside the weights and the replicas."""
    S = model_slots_per_gpu(model, ep_size, redundant_per_gpu)
    opts = CostOptions(phase="decode", step_tokens=batch, context_len=context_len)
    mem = memory_per_gpu(model, cluster.gpu, ep_size, S * ep_size, opts)
    per_token = model.kv_bytes_per_token
    spare = mem.kv_free - mem.kv_needed
    return MemoryCost(
        mem.redundant, mem.redundant / per_token, max(mem.kv_free, 0.0) / per_token, bool(mem.fits), spare
    )
