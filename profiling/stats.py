"""Statistics of expert routing for notebooks and the CLI (numpy only, pure functions).

Shapes: T tokens, L layers, k top-k, E logical experts, W windows, D domains.
A *load* is a non-negative array of selection counts ``[..., E]``; *shares* are loads divided by their
row sum (a zero row stays zero). Skew summaries (max/mean, Gini, entropy) are in
:mod:`profiling.skew`; this module covers hotness, drift between windows, co-activation and
cross-layer / cross-domain comparison.
"""

from __future__ import annotations

import numpy as np

from profiling.coactivation import coactivation_counts, layer_transition_counts
from profiling.trace import RoutingTrace

__all__ = [
    "load_shares",
    "hotness",
    "lorenz_curve",
    "top_share",
    "tv_distance",
    "rank_correlation",
    "topn_overlap",
    "window_loads",
    "window_drift",
    "drift_from_reference",
    "hot_expert_persistence",
    "coactivation",
    "coactivation_lift",
    "pmi",
    "layer_affinity",
    "layer_mutual_information",
    "domain_distance",
]


def _load(x, name="load") -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim < 1 or a.shape[-1] < 1:
        raise ValueError(f"{name} must have an expert axis [..., E], got shape {a.shape}")
    if not np.all(np.isfinite(a)) or (a.size and a.min() < 0):
        raise ValueError(f"{name} must be finite and >= 0")
    return a


def load_shares(load) -> np.ndarray:
    """Each row divided by its sum: float64 ``[..., E]`` (rows of zeros stay zero)."""
    a = _load(load)
    tot = a.sum(axis=-1, keepdims=True)
    return np.divide(a, tot, out=np.zeros_like(a), where=tot > 0)


def hotness(load) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer load shares sorted hottest first.

    Args:
        load: ``[L, E]`` (or ``[..., E]``).

    Returns:
        ``(shares_sorted [L, E] float64 descending, order [L, E] int64 expert ids hottest first)``.
        Ties keep the lower expert id first.
    """
    s = load_shares(load)
    order = np.argsort(-s, axis=-1, kind="stable")
    return np.take_along_axis(s, order, axis=-1), order


def lorenz_curve(load) -> np.ndarray:
    """Cumulative load share of the coldest experts: float64 ``[..., E + 1]`` from 0 to 1.

    Point ``j`` is the share carried by the ``j`` least-loaded experts (x axis ``j / E``); a uniform
    layer gives the diagonal. A zero row gives the diagonal too.
    """
    a = _load(load)
    E = a.shape[-1]
    s = np.sort(load_shares(a), axis=-1)
    cum = np.concatenate([np.zeros(a.shape[:-1] + (1,)), np.cumsum(s, axis=-1)], axis=-1)
    zero = a.sum(axis=-1) == 0
    cum[zero] = np.linspace(0.0, 1.0, E + 1)
    return cum


def top_share(load, n: int = 1) -> np.ndarray:
    """Share of the ``n`` hottest experts, float64 ``[...]``."""
    s, _ = hotness(load)
    if not 1 <= n <= s.shape[-1]:
        raise ValueError(f"n must be in [1, {s.shape[-1]}] (the expert count), got {n}")
    return s[..., :n].sum(axis=-1)


def tv_distance(p, q) -> np.ndarray:
    """Total-variation distance between the load shares of ``p`` and ``q`` (``[..., E]`` each, broadcast).

    Returns float64 ``[...]`` in ``[0, 1]``: half the L1 distance of the normalised rows.
    """
    a, b = load_shares(p), load_shares(q)
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"expert axes differ: {a.shape[-1]} vs {b.shape[-1]}")
    return 0.5 * np.abs(a - b).sum(axis=-1)


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..E along the last axis, ties sharing their average rank. float64 ``[..., E]``."""
    x = np.asarray(x, dtype=np.float64)
    E = x.shape[-1]
    flat = x.reshape(-1, E)  # [N, E]
    order = np.argsort(flat, axis=1, kind="stable")
    v = np.take_along_axis(flat, order, axis=1)  # [N, E] sorted rows
    pos = np.broadcast_to(np.arange(E), v.shape)
    first = np.ones(v.shape, dtype=bool)
    first[:, 1:] = v[:, 1:] != v[:, :-1]  # a run of equal values starts here
    last = np.ones(v.shape, dtype=bool)
    last[:, :-1] = first[:, 1:]  # a run ends here
    start = np.maximum.accumulate(np.where(first, pos, 0), axis=1)  # run start of each position
    end = np.minimum.accumulate(np.where(last, pos, E - 1)[:, ::-1], axis=1)[:, ::-1]  # run end
    out = np.empty_like(flat)
    np.put_along_axis(out, order, (start + end) / 2.0 + 1.0, axis=1)
    return out.reshape(x.shape)


def rank_correlation(a, b) -> np.ndarray:
    """Spearman rank correlation of expert loads, per row: float64 ``[...]`` in ``[-1, 1]``.

    Ties get average ranks. A row with constant load (no ranking) gives NaN.
    """
    x, y = _load(a, "a"), _load(b, "b")
    x, y = np.broadcast_arrays(x, y)
    rx, ry = _average_ranks(x), _average_ranks(y)
    rx = rx - rx.mean(axis=-1, keepdims=True)
    ry = ry - ry.mean(axis=-1, keepdims=True)
    den = np.sqrt((rx * rx).sum(axis=-1) * (ry * ry).sum(axis=-1))
    num = (rx * ry).sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def topn_overlap(a, b, n: int) -> np.ndarray:
    """Fraction of the ``n`` hottest experts of ``a`` that are also among the ``n`` hottest of ``b``.

    Args:
        a, b: loads ``[..., E]``.
    Returns:
        float64 ``[...]`` in ``[0, 1]`` (ties broken by lower expert id).
    """
    _, oa = hotness(a)
    _, ob = hotness(b)
    E = oa.shape[-1]
    if not 1 <= n <= E:
        raise ValueError(f"n must be in [1, {E}] (the expert count), got {n}")
    ma = np.zeros(oa.shape, dtype=bool)
    mb = np.zeros(ob.shape, dtype=bool)
    np.put_along_axis(ma, oa[..., :n], True, axis=-1)
    np.put_along_axis(mb, ob[..., :n], True, axis=-1)
    return (ma & mb).sum(axis=-1) / n


def window_loads(trace: RoutingTrace, num_windows: int | None = None) -> np.ndarray:
    """Load per window ``[W, L, E]`` float64: the trace's natural windows (prompts, steps, count rows),
    or ``num_windows`` consecutive groups of them."""
    if num_windows is None:
        return trace.window_load()
    return np.stack([w.counts() for w in trace.windows(num_windows)]).astype(np.float64)


def window_drift(window_load, top_n: int | None = None) -> dict[str, np.ndarray]:
    """Drift between consecutive windows.

    Args:
        window_load: ``[W, L, E]`` with ``W >= 2``.
        top_n: size of the hot set for ``topn_overlap`` (default ``max(1, E // 8)``).

    Returns:
        dict of float64 ``[W - 1, L]`` arrays: ``tv`` (total variation of load shares, 0 = same),
        ``spearman`` (rank correlation, 1 = same order), ``topn_overlap`` (hot-set overlap, 1 = same).
    """
    w = _load(window_load, "window_load")
    if w.ndim != 3 or w.shape[0] < 2:
        raise ValueError(f"window_load must be [windows >= 2, layers, experts], got shape {w.shape}")
    n = top_n or max(1, w.shape[-1] // 8)
    a, b = w[:-1], w[1:]
    return {
        "tv": tv_distance(a, b),
        "spearman": rank_correlation(a, b),
        "topn_overlap": topn_overlap(a, b, n),
    }


def drift_from_reference(window_load, reference, top_n: int | None = None) -> dict[str, np.ndarray]:
    """Like :func:`window_drift`, each window ``[W, L, E]`` against one reference load ``[L, E]``
    (e.g. the load a placement was fitted on). Returns float64 ``[W, L]`` arrays."""
    w = _load(window_load, "window_load")
    ref = _load(reference, "reference")
    if w.ndim != 3 or ref.shape != w.shape[1:]:
        raise ValueError(f"window_load {w.shape} and reference {ref.shape} must be [W, L, E] and [L, E]")
    n = top_n or max(1, w.shape[-1] // 8)
    r = np.broadcast_to(ref, w.shape)
    return {
        "tv": tv_distance(w, r),
        "spearman": rank_correlation(w, r),
        "topn_overlap": topn_overlap(w, r, n),
    }


def hot_expert_persistence(window_load, top_n: int | None = None) -> np.ndarray:
    """How often each expert is among the ``top_n`` hottest of its layer, over windows.

    Args:
        window_load: ``[W, L, E]``.
    Returns:
        float64 ``[L, E]`` in ``[0, 1]``: fraction of windows (with any load) in which the expert is hot.
        Each row sums to ``top_n`` when every window has load.
    """
    w = _load(window_load, "window_load")
    if w.ndim != 3:
        raise ValueError(f"window_load must be [windows, layers, experts], got shape {w.shape}")
    n = top_n or max(1, w.shape[-1] // 8)
    _, order = hotness(w)  # [W, L, E]
    hot = np.zeros(w.shape, dtype=bool)
    np.put_along_axis(hot, order[..., :n], True, axis=-1)
    active = w.sum(axis=-1) > 0  # [W, L]
    hot &= active[..., None]
    cnt = active.sum(axis=0)  # [L]
    return np.divide(hot.sum(axis=0), cnt[:, None], out=np.zeros(w.shape[1:]), where=cnt[:, None] > 0)


def coactivation(trace: RoutingTrace, layers=None) -> np.ndarray:
    """Intra-layer co-activation counts int64 ``[L', E, E]`` (see :func:`profiling.coactivation.coactivation_counts`)."""
    return coactivation_counts(trace, layers=layers)


def coactivation_lift(co, num_tokens: int) -> np.ndarray:
    """Lift ``P(i, j) / (P(i) P(j))`` of expert pairs chosen by the same token.

    Args:
        co: co-activation counts ``[..., E, E]`` with each expert's own count on the diagonal.
        num_tokens: ``T``, tokens the counts come from.
    Returns:
        float64 ``[..., E, E]``: 1 = as often as independent picks, > 1 = attracted; 0 where a pair
        never co-occurs; NaN on the diagonal and for experts never chosen.
    """
    c = _load(co, "co")
    if c.ndim < 2 or c.shape[-1] != c.shape[-2]:
        raise ValueError(f"co must be [..., E, E], got shape {c.shape}")
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    d = np.diagonal(c, axis1=-2, axis2=-1)  # [..., E]
    expect = d[..., :, None] * d[..., None, :] / float(num_tokens)  # independent-pick count
    with np.errstate(invalid="ignore", divide="ignore"):
        lift = np.where(expect > 0, c / np.where(expect > 0, expect, 1.0), np.nan)
    E = c.shape[-1]
    lift[..., np.arange(E), np.arange(E)] = np.nan
    return lift


def pmi(co, num_tokens: int, normalized: bool = False) -> np.ndarray:
    """Pointwise mutual information ``log lift`` of expert pairs, float64 ``[..., E, E]``.

    ``normalized=True`` gives NPMI ``pmi / -log P(i, j)`` in ``[-1, 1]``. Pairs that never co-occur
    are ``-inf`` (PMI) or ``-1`` (NPMI); the diagonal is NaN.
    """
    lift = coactivation_lift(co, num_tokens)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.log(lift)  # -inf where a pair never co-occurs
        if not normalized:
            return out
        pij = np.asarray(co, dtype=np.float64) / float(num_tokens)
        inner = (pij > 0) & (pij < 1)
        npmi = np.where(pij <= 0, -1.0, np.where(pij >= 1, 1.0, out / -np.log(np.where(inner, pij, 0.5))))
    return np.where(np.isnan(lift), np.nan, npmi)


def layer_affinity(trace: RoutingTrace, src_row: int, dst_row: int) -> dict[str, np.ndarray]:
    """How a token's expert at one layer predicts its expert at another.

    Args:
        src_row, dst_row: layer rows (not layer ids) of ``trace``.
    Returns:
        ``counts`` int64 ``[E, E]`` (pick pairs), ``conditional`` float64 ``[E, E]`` = P(dst expert j |
        src expert i) (rows sum to 1, zero rows for unused experts), ``lift`` float64 ``[E, E]``.
    """
    L = trace.num_layers
    for r in (src_row, dst_row):
        if not 0 <= r < L:
            raise ValueError(f"layer row {r} out of range: the trace has {L} layers (rows 0..{L - 1})")
    counts = layer_transition_counts(trace, src_row, dst_row)
    c = counts.astype(np.float64)
    row = c.sum(axis=1, keepdims=True)
    col = c.sum(axis=0, keepdims=True)
    tot = c.sum()
    cond = np.divide(c, row, out=np.zeros_like(c), where=row > 0)
    expect = row * col / tot if tot > 0 else np.zeros_like(c)
    with np.errstate(invalid="ignore", divide="ignore"):
        lift = np.where(expect > 0, c / np.where(expect > 0, expect, 1.0), np.nan)
    return {"counts": counts, "conditional": cond, "lift": lift}


def layer_mutual_information(trace: RoutingTrace, pairs=None) -> np.ndarray:
    """Normalised mutual information between the experts a token picks at two layers.

    Every pick at one layer is paired with every pick at the other; NMI = I / sqrt(H_src H_dst), 0 =
    independent, 1 = one layer's choice determines the other's.

    Args:
        pairs: ``[(src_row, dst_row), ...]`` (default consecutive rows ``(l, l + 1)``).
    Returns:
        float64 ``[len(pairs)]``.
    """
    if pairs is None:
        pairs = [(l, l + 1) for l in range(trace.num_layers - 1)]
    out = np.zeros(len(pairs))
    for n, (a, b) in enumerate(pairs):
        c = layer_affinity(trace, a, b)["counts"].astype(np.float64)
        tot = c.sum()
        if tot == 0:
            out[n] = np.nan
            continue
        p = c / tot
        pa, pb = p.sum(axis=1), p.sum(axis=0)
        nz = p > 0
        mi = float((p[nz] * np.log(p[nz] / (pa[:, None] * pb[None, :])[nz])).sum())
        ha = -float((pa[pa > 0] * np.log(pa[pa > 0])).sum())
        hb = -float((pb[pb > 0] * np.log(pb[pb > 0])).sum())
        out[n] = mi / np.sqrt(ha * hb) if ha > 0 and hb > 0 else np.nan
    return out


def domain_distance(window_counts) -> np.ndarray:
    """Pairwise total-variation distance between domains' load, per layer.

    Args:
        window_counts: ``[D, L, E]`` (one row per domain, e.g. the OLMoE per-domain counts).
    Returns:
        float64 ``[L, D, D]``, symmetric, zero diagonal, values in ``[0, 1]``.
    """
    w = _load(window_counts, "window_counts")
    if w.ndim != 3:
        raise ValueError(f"window_counts must be [domains, layers, experts], got shape {w.shape}")
    s = load_shares(w).transpose(1, 0, 2)  # [L, D, E]
    return 0.5 * np.abs(s[:, :, None, :] - s[:, None, :, :]).sum(axis=-1)
