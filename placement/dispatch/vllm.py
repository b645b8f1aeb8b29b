"""vLLM's EPLB replica choice (``--enable-eplb``, vLLM 0.33): a hash of the token's batch row.

Replica ``((i * 2654435769) mod 2**32) mod c`` of an expert with ``c`` replicas, where ``i`` is the
token's row in its rank's forward batch. Even in expectation; scored token by token.
"""

from __future__ import annotations

import numpy as np

from placement.dispatch.ideal import even_choices
from placement.dispatch.registry import DispatchModel, register
from placement.model import Placement

__all__ = ["VLLM_HASH", "VLLM_HASH_MULTIPLIER", "vllm_hash_replica"]

VLLM_HASH_MULTIPLIER = 2654435769  # floor(2**32 / golden ratio), Knuth's multiplicative hash


def vllm_hash_replica(batch_index: np.ndarray, replica_count: np.ndarray) -> np.ndarray:
    """Replica index vLLM picks: ``((i * 2654435769) & 0xFFFFFFFF) % c`` (int64, same shape)."""
    i = np.asarray(batch_index, dtype=np.uint64)
    hashed = (i * np.uint64(VLLM_HASH_MULTIPLIER)) & np.uint64(0xFFFFFFFF)
    return (hashed % np.maximum(np.asarray(replica_count), 1).astype(np.uint64)).astype(np.int64)


def _route(placement: Placement, layer: int, ids, src, batch_index=None, rng=None) -> np.ndarray:
    """Slots ``[T, k]`` for ids ``[T, k]`` (valid ids only; the caller masks -1)."""
    if batch_index is None:
        raise ValueError("vllm-hash routing needs each token's row in its forward batch")
    l2p = placement.logical_to_physical_map[layer]  # [E, R]
    cnt = placement.logical_replica_count[layer]  # [E]
    return l2p[ids, vllm_hash_replica(np.asarray(batch_index)[:, None], cnt[ids])]


VLLM_HASH = register(
    DispatchModel(
        "vllm-hash",
        "vLLM --enable-eplb (token-index hash)",
        even_choices,
        engine="vLLM",
        version="0.33",
        engine_flag=("--enable-eplb",),
        needs_batch_rows=True,
        fractional=False,
        route=_route,
        counts_only=False,
        local_first=False,
        locality_fit=False,
        table_fit="",
        runtime_route="",
    )
)
