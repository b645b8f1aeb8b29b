"""The ideals no engine runs as such: ``even`` and ``local``.

- ``even``: an expert's tokens split evenly over its replicas (vLLM's hash comes close in expectation).
- ``local``: a replica on the token's own GPU, else the replicas on its own node (evenly), else all.

Both are what our runtime executes (:mod:`runtime_hooks.ep_layer`, :mod:`runtime_hooks.hf`), token
by token as a rotation over the tier's replicas (:func:`placement.metrics.route_tokens`).
"""

from __future__ import annotations

import numpy as np

from placement.dispatch.registry import DispatchModel, register
from placement.model import Placement

__all__ = ["EVEN", "LOCAL", "even_choices", "local_choices"]


def even_choices(placement: Placement, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Every rank sends ``1/c`` of an expert's tokens to each of its ``c`` replicas.

    Returns ``(slots int64 [G, E, R], weights float64 [G, E, R])``, slots ascending, -1 padded.
    """
    G = placement.topology.ep_size
    l2p = placement.logical_to_physical_map[layer]  # [E, R]
    cnt = placement.logical_replica_count[layer]  # [E]
    slots = np.broadcast_to(l2p, (G, *l2p.shape)).copy()  # [G, E, R]
    weights = np.where(slots >= 0, 1.0 / cnt[None, :, None], 0.0)
    return slots, weights


def local_choices(placement: Placement, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Own GPU's replica, else the own node's replicas evenly, else all evenly: ``[G, E, R]`` x2."""
    slots, weights = even_choices(placement, layer)
    t = placement.topology
    valid = slots >= 0
    gpu = np.where(valid, slots // t.slots_per_gpu, -1)  # [G, E, R]
    ranks = np.arange(t.ep_size)[:, None, None]
    on_gpu = valid & (gpu == ranks)
    on_node = valid & (gpu // t.gpus_per_node == ranks // t.gpus_per_node)
    n_node = on_node.sum(axis=2, keepdims=True)
    w = np.where(on_node, 1.0 / np.maximum(n_node, 1), 0.0)
    w = np.where(n_node > 0, w, weights)
    return slots, np.where(on_gpu.any(axis=2, keepdims=True), on_gpu.astype(float), w)


EVEN = register(
    DispatchModel(
        "even",
        "ideal even split (vLLM's hash comes close in expectation)",
        even_choices,
        counts_only=True,
        local_first=False,
        locality_fit=True,
        table_fit="",
        runtime_route="table",
    )
)
LOCAL = register(
    DispatchModel(
        "local",
        "own GPU, else own node, else spread (the locality-first ideal)",
        local_choices,
        needs_source_ranks=True,
        counts_only=False,
        local_first=True,
        locality_fit=True,
        table_fit="",
        runtime_route="table",
    )
)
