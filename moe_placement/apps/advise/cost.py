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

__all__ = ["MemoryCost", "check_something_fits", "model_slots_per_gpu", "replica_memory"]


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
    kv_free_bytes: float = 0.0  # HBM left for the KV cache after weights, replicas and the reserve
    kv_needed_bytes: float = 0.0  # the KV cache of batch x context
    max_batch: int = 0  # the most decode sequences per rank whose KV cache fits at this context


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
        redundant_bytes=mem.redundant,
        kv_tokens_lost=mem.redundant / per_token,
        kv_tokens_left=max(mem.kv_free, 0.0) / per_token,
        fits=bool(mem.fits),
        spare_bytes=spare,
        kv_free_bytes=mem.kv_free,
        kv_needed_bytes=mem.kv_needed,
        max_batch=mem.max_step_tokens,
    )


def check_something_fits(
    model: ModelSpec, cluster: ClusterSpec, ep_size: int, batch: int, context_len: int
) -> None:
    """ValueError, with the numbers and a fix, when even the model without any redundant slot leaves no
    room for the KV cache of ``batch`` sequences per rank x ``context_len`` tokens: no option fits."""
    m = replica_memory(model, cluster, ep_size, 0, batch, context_len)
    if m.fits:
        return
    gb = 1e9
    room = (
        f"at most {m.max_batch} sequences per rank fit at context {context_len}"
        if m.max_batch
        else "no KV cache fits beside the weights"
    )
    raise ValueError(
        f"nothing fits in memory: {model.name} on {ep_size} {cluster.gpu.name} ({cluster.gpu.hbm_bytes / gb:.0f} GB "
        f"each) leaves {max(m.kv_free_bytes, 0.0) / gb:.2f} GB per GPU for the KV cache, and {batch} sequences x "
        f"{context_len} tokens need {m.kv_needed_bytes / gb:.2f} GB ({room}); lower --decode-batch or "
        f"--context-len, or use more GPUs"
    )
