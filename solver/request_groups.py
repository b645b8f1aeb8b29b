"""Requests grouped by expert signature, each group the size of one node's share of the traffic.

Shapes: Q requests, D = L x E signature cells, K groups.

:func:`request_signatures` gives every request of a trace its signature (the share of its picks per
layer and expert over all its tokens: the fit sees whole requests). :func:`balanced_groups` is seeded
k-means on the square roots of the signatures (the Hellinger distance between two distributions is the
Euclidean distance between their square roots) with a capacity: no group holds more than
``(1 + slack) / K`` of the tokens, so a group can be one node's traffic. Each assignment pass takes the
requests in order of regret (how much farther their second-nearest centre is than their nearest) and
gives each its nearest centre with room; centres are the token-weighted means of their requests.
"""

from __future__ import annotations

import numpy as np

from placement.routing.requests import signature_of
from profiling.trace import RoutingTrace

__all__ = ["assign_capacity", "balanced_groups", "request_signatures"]


def request_signatures(trace: RoutingTrace) -> tuple[np.ndarray, np.ndarray]:
    """Signatures float64 ``[Q, L, E]`` of the trace's requests (``seq_offsets``) and their tokens ``[Q]``."""
    if not trace.has_tokens or trace.seq_offsets is None:
        raise ValueError("grouping requests needs a per-token trace with request boundaries (seq_offsets)")
    off = trace.seq_offsets
    assert trace.topk_ids is not None
    sigs = np.stack(
        [signature_of(trace.topk_ids[a:b], trace.num_logical_experts) for a, b in zip(off[:-1], off[1:])]
    )
    return sigs, np.diff(off).astype(np.float64)


def _plus_plus(rng, X: np.ndarray, w: np.ndarray, K: int) -> np.ndarray:
    """k-means++ seeding, token-weighted: ``[K, D]`` centres from the rows of ``X``."""
    centres = [X[rng.choice(X.shape[0], p=w / w.sum())]]
    d2 = ((X - centres[0]) ** 2).sum(axis=1)
    for _ in range(1, K):
        p = w * d2
        i = rng.choice(X.shape[0], p=p / p.sum()) if p.sum() > 0 else rng.integers(0, X.shape[0])
        centres.append(X[i])
        d2 = np.minimum(d2, ((X - X[i]) ** 2).sum(axis=1))
    return np.stack(centres)


def assign_capacity(dist: np.ndarray, w: np.ndarray, cap: float) -> np.ndarray:
    """Capacitated assignment ``[Q]`` of requests (weights ``w [Q]``) to the ``K`` columns of ``dist
    [Q, K]`` (lower is nearer), each column at most ``cap`` of weight, by regret order (module docstring)."""
    Q, K = dist.shape
    part = np.sort(dist, axis=1)
    regret = part[:, 1] - part[:, 0] if K > 1 else np.zeros(Q)
    room = np.full(K, cap)
    out = np.empty(Q, dtype=np.int64)
    for q in np.argsort(-regret, kind="stable"):
        order = np.argsort(dist[q], kind="stable")
        fits = order[room[order] >= w[q]]
        k = int(fits[0]) if fits.size else int(np.argmax(room))  # none has room: the emptiest
        out[q] = k
        room[k] -= w[q]
    return out


def balanced_groups(
    signatures: np.ndarray, tokens: np.ndarray, num_groups: int, slack: float, seed: int, iterations: int = 30
) -> np.ndarray:
    """Group ``[Q]`` (0..K-1) of each request (module docstring).

    Args:
        signatures: ``[Q, L, E]``; tokens: ``[Q]`` each request's weight.
        slack: a group holds at most ``(1 + slack) / K`` of the tokens.
    """
    X = np.sqrt(np.asarray(signatures, dtype=np.float64).reshape(len(signatures), -1))  # [Q, D]
    w = np.asarray(tokens, dtype=np.float64)
    Q, K = X.shape[0], int(num_groups)
    if K <= 1 or Q <= K:
        return np.arange(Q, dtype=np.int64) % max(K, 1)
    rng = np.random.default_rng(seed)
    centres = _plus_plus(rng, X, w, K)
    cap = (1.0 + float(slack)) * w.sum() / K
    labels = np.full(Q, -1, dtype=np.int64)
    for _ in range(int(iterations)):
        dist = (X**2).sum(axis=1)[:, None] - 2 * X @ centres.T + (centres**2).sum(axis=1)[None, :]
        new = assign_capacity(dist, w, cap)
        if np.array_equal(new, labels):
            break
        labels = new
        for k in range(K):
            mine = labels == k
            if mine.any():
                centres[k] = np.average(X[mine], axis=0, weights=w[mine])
    return labels
