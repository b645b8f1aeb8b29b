"""Co-activation statistics from per-token traces (numpy only).

Shapes: T tokens, L layers, k top-k, E logical experts.
"""

from __future__ import annotations

import numpy as np

from profiling.trace import RoutingTrace

__all__ = ["coactivation_counts", "layer_transition_counts"]


def coactivation_counts(trace_or_ids, num_logical_experts: int | None = None, layers=None) -> np.ndarray:
    """Intra-layer pair counts: how many tokens picked both ``i`` and ``j`` in the same layer.

    Args:
        trace_or_ids: a per-token :class:`RoutingTrace` or int ``[T, L, k]`` ids (-1 = none).
        layers: row indices to compute (default all).

    Returns:
        int64 ``[L', E, E]``, symmetric, with each expert's own count on the diagonal.
    """
    if isinstance(trace_or_ids, RoutingTrace):
        if not trace_or_ids.has_tokens:
            raise ValueError("co-activation needs a per-token trace (topk_ids); this one has counts only")
        ids = trace_or_ids.topk_ids
        E = trace_or_ids.num_logical_experts
    else:
        ids = np.asarray(trace_or_ids)
        if num_logical_experts is None:
            raise ValueError("num_logical_experts is required with a raw id array")
        E = int(num_logical_experts)
    if ids.ndim != 3:
        raise ValueError(f"topk ids must be [tokens, layers, top_k], got shape {ids.shape}")
    rows = range(ids.shape[1]) if layers is None else list(layers)
    out = np.zeros((len(rows), E, E), dtype=np.int64)
    k = ids.shape[2]
    for n, l in enumerate(rows):
        x = ids[:, l, :].astype(np.int64)  # [T, k]
        for a in range(k):
            for b in range(k):
                ok = (x[:, a] >= 0) & (x[:, b] >= 0)
                flat = x[ok, a] * E + x[ok, b]
                out[n] += np.bincount(flat, minlength=E * E).reshape(E, E)
        # pairs (a, b) with a == b put each expert's own count on the diagonal exactly once per pick
    return out


def layer_transition_counts(trace: RoutingTrace, src_layer: int, dst_layer: int) -> np.ndarray:
    """Layer-to-layer affinity: tokens that picked ``i`` at row ``src_layer`` and ``j`` at ``dst_layer``.

    Every pick at one layer is paired with every pick at the other (full cross product per token).

    Returns:
        int64 ``[E, E]``.
    """
    if not trace.has_tokens:
        raise ValueError("layer transitions need a per-token trace (topk_ids)")
    E = trace.num_logical_experts
    a = trace.topk_ids[:, src_layer, :].astype(np.int64)  # [T, k]
    b = trace.topk_ids[:, dst_layer, :].astype(np.int64)  # [T, k]
    out = np.zeros((E, E), dtype=np.int64)
    for i in range(a.shape[1]):
        for j in range(b.shape[1]):
            ok = (a[:, i] >= 0) & (b[:, j] >= 0)
            out += np.bincount(a[ok, i] * E + b[ok, j], minlength=E * E).reshape(E, E)
    return out
