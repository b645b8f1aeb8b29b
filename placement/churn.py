"""Churn between two placements: what a re-placement costs to apply (docs/metrics.md, "Churn").

Shapes: L layers, E logical experts, P physical slots, G GPUs, S = P // G slots per GPU.

- ``moved_slots`` (in :mod:`placement.metrics`): slots whose logical expert changed.
- ``arrived_experts``: (layer, GPU, expert) triples of the new placement whose GPU did not hold that
  expert before. Only these cross a link; an expert already on the GPU (in another slot) is a local
  copy. After :func:`solver.migration.slots.keep_slots` the two counts are equal; a map whose slots
  were shuffled within GPUs has moved slots but no arrivals.
- ``moved_bytes`` = arrived experts x the weight bytes of one expert.

Both placements may hold an expert twice on a GPU (engine maps): a triple counts once.
"""

from __future__ import annotations

import numpy as np

from placement.model import Placement

__all__ = ["arrived_experts", "arrived_per_gpu", "moved_bytes"]


def _maps(previous: Placement, new: Placement) -> tuple[np.ndarray, np.ndarray, int, int]:
    """``(previous map [L, P], new map [L, P], E, G)``, or a ValueError when the shapes differ."""
    if not (isinstance(previous, Placement) and isinstance(new, Placement)):
        raise ValueError(
            f"arrived experts compare two Placements, got {type(previous).__name__} and {type(new).__name__}"
        )
    a, b = previous.physical_to_logical_map, new.physical_to_logical_map
    if a.shape != b.shape or previous.topology.ep_size != new.topology.ep_size:
        raise ValueError(
            f"placements differ: maps {a.shape} vs {b.shape} over {previous.topology.ep_size} vs "
            f"{new.topology.ep_size} GPUs; compare placements of the same layers, slots and GPUs"
        )
    E = max(previous.num_logical_experts, new.num_logical_experts)
    return a, b, E, new.topology.ep_size


def _held(p2l: np.ndarray, E: int, G: int) -> np.ndarray:
    """bool ``[L, G, E]``: GPU ``g`` holds expert ``e`` in layer ``l`` (from ``p2l [L, P]``)."""
    L, P = p2l.shape
    held = np.zeros((L, G, E), dtype=bool)
    gpu = np.arange(P) // (P // G)  # [P] GPU of each slot
    held[np.arange(L)[:, None], gpu[None, :], p2l] = True
    return held


def arrived_per_gpu(previous: Placement, new: Placement) -> np.ndarray:
    """int64 ``[L, G]``: experts that arrive on each GPU of each layer (held by ``new``, not ``previous``)."""
    a, b, E, G = _maps(previous, new)
    return (_held(b, E, G) & ~_held(a, E, G)).sum(axis=2).astype(np.int64)


def arrived_experts(previous: Placement, new: Placement) -> int:
    """(layer, GPU, expert) triples of ``new`` whose GPU did not hold that expert in ``previous``."""
    return int(arrived_per_gpu(previous, new).sum())


def moved_bytes(previous: Placement, new: Placement, bytes_per_expert: int) -> int:
    """Bytes that cross a link to go from ``previous`` to ``new``: arrived experts x ``bytes_per_expert``."""
    if int(bytes_per_expert) != bytes_per_expert or bytes_per_expert < 0:
        raise ValueError(f"bytes_per_expert must be a non-negative integer, got {bytes_per_expert!r}")
    return arrived_experts(previous, new) * int(bytes_per_expert)
