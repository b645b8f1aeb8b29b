"""Per-layer skew of expert load: the table ``moe-placement inspect`` prints (numpy only)."""

from __future__ import annotations

import numpy as np

from profiling.trace import RoutingTrace

__all__ = ["skew_table", "gini", "normalized_entropy"]


def gini(load: np.ndarray) -> np.ndarray:
    """Gini coefficient of each row of ``[..., E]`` (0 = uniform, ``1 - 1/E`` = one expert takes all)."""
    x = np.sort(np.asarray(load, dtype=np.float64), axis=-1)
    n = x.shape[-1]
    total = x.sum(axis=-1)
    idx = np.arange(1, n + 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        g = (2.0 * (idx * x).sum(axis=-1) / (n * total)) - (n + 1.0) / n
    return np.where(total > 0, g, 0.0)


def normalized_entropy(load: np.ndarray) -> np.ndarray:
    """Shannon entropy of each row's load shares divided by ``log E`` (1 = uniform)."""
    x = np.asarray(load, dtype=np.float64)
    total = x.sum(axis=-1, keepdims=True)
    p = np.divide(x, total, out=np.zeros_like(x), where=total > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=-1)
    n = x.shape[-1]
    return h / np.log(n) if n > 1 else np.ones_like(h)


def skew_table(trace_or_counts, layer_ids=None) -> list[dict]:
    """One row per layer: ``layer_id``, ``tokens`` (selections), ``max_over_mean``, ``gini``,
    ``entropy`` (normalised), ``idle_experts`` (zero load), ``top1_share``, ``hottest_expert``.

    Args:
        trace_or_counts: a :class:`RoutingTrace` or loads ``[L, E]``.
    """
    if isinstance(trace_or_counts, RoutingTrace):
        counts = trace_or_counts.counts()
        ids = trace_or_counts.layer_ids
    else:
        counts = np.asarray(trace_or_counts, dtype=np.float64)
        if counts.ndim != 2:
            raise ValueError(f"counts must be [layers, experts], got shape {counts.shape}")
        ids = tuple(layer_ids) if layer_ids is not None else tuple(range(counts.shape[0]))
    c = np.asarray(counts, dtype=np.float64)
    total = c.sum(axis=1)
    mean = total / c.shape[1]
    mx = c.max(axis=1)
    ratio = np.where(mean > 0, mx / np.where(mean > 0, mean, 1), 1.0)
    g = gini(c)
    h = normalized_entropy(c)
    rows = []
    for l in range(c.shape[0]):
        rows.append(
            {
                "layer_id": int(ids[l]),
                "tokens": float(total[l]),
                "max_over_mean": float(ratio[l]),
                "gini": float(g[l]),
                "entropy": float(h[l]),
                "idle_experts": int((c[l] == 0).sum()),
                "top1_share": float(mx[l] / total[l]) if total[l] > 0 else 0.0,
                "hottest_expert": int(c[l].argmax()),
            }
        )
    return rows
