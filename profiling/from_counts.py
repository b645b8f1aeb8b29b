"""A per-token stand-in for a counts-only trace: tokens drawn so that, window by window and layer by
layer, each expert's expected count is the window's own.

A counts-only trace (``window_counts [W, L, E]``: per question, per domain) has no token, so nothing
step-level (which tokens share a step, which experts one token picks together) can be read from it.
:func:`tokens_from_counts` draws, in every window, ``T_w = round(f x counts / k)`` tokens (``f`` scales
the trace down to ``max_tokens``); each token picks ``k`` distinct experts per layer by systematic
sampling with inclusion probabilities ``pi_e = k c_e / sum(c)`` (Madow's method: every expert's
inclusion probability is exactly ``pi_e``), independently across layers and tokens. Window-level balance
is therefore the trace's own (up to sampling noise); step-level balance is that of independent routing
within each window (no co-activation, no per-token correlation across layers). The returned trace says
so in its metadata and has one "prompt" per window (``seq_offsets``).

Shapes: W windows, L layers, E experts, k top-k, N tokens drawn.
"""

from __future__ import annotations

import numpy as np

from moe_placement.base.limits import check_whole
from profiling.trace import RoutingTrace

__all__ = ["DEFAULT_MAX_TOKENS", "tokens_from_counts"]

DEFAULT_MAX_TOKENS = 200_000  # about the shared per-token chat trace's size


def _window_tokens(counts: np.ndarray, k: int, max_tokens: int) -> tuple[np.ndarray, float]:
    """``(tokens drawn per window [W], scale f)``: each window's tokens (its mean over layers of
    ``sum(c) / k``), scaled so the total is at most ``max_tokens``, at least one per window."""
    tokens = counts.sum(axis=2).mean(axis=1) / k  # [W]
    total = float(tokens.sum())
    f = min(1.0, max_tokens / total) if total > 0 else 1.0
    return np.maximum(1, np.rint(tokens * f)).astype(np.int64), f


def _capped(pi: np.ndarray, k: int) -> np.ndarray:
    """Inclusion probabilities ``[..., E]`` summing to ``k`` with none above 1: an expert asked for more
    than every token of its window is capped at 1 and the excess spread over the others, pro rata."""
    pi = pi.copy()
    for _ in range(pi.shape[-1]):
        over = pi > 1.0
        if not over.any():
            break
        pi[over] = 1.0
        free = np.where(over | (pi >= 1.0), 0.0, pi)
        need = k - np.where(free > 0, 0.0, pi).sum(axis=-1, keepdims=True)  # what the uncapped must hold
        have = free.sum(axis=-1, keepdims=True)
        pi = np.where(free > 0, free * need / np.where(have > 0, have, 1.0), pi)
    return np.minimum(pi, 1.0)


def _draw(pi: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """``[N, k]`` distinct experts per row of inclusion probabilities ``pi [N, E]`` (rows sum to k)."""
    N, E = pi.shape
    order = np.argsort(rng.random((N, E)), axis=1)  # a random expert order per token
    cum = np.cumsum(np.take_along_axis(pi, order, axis=1), axis=1)  # [N, E]
    cum *= k / cum[:, -1:]  # exactly k at the end: the last threshold u + k - 1 < k always finds an expert
    u = rng.random((N, 1))
    out = np.empty((N, k), dtype=np.int64)
    for j in range(k):  # the expert whose cumulative probability first passes u + j
        at = (cum > u + j).argmax(axis=1)
        out[:, j] = order[np.arange(N), at]
    return out


def tokens_from_counts(
    trace: RoutingTrace, top_k: int, *, max_tokens: int = DEFAULT_MAX_TOKENS, seed: int = 0
) -> RoutingTrace:
    """The per-token stand-in of a counts-only ``trace`` for a model with ``top_k`` (module docstring).

    Raises:
        ValueError: a per-token trace, a window with no routing, or ``top_k`` above the experts.
    """
    if trace.has_tokens or trace.window_counts is None:
        raise ValueError("tokens_from_counts needs a counts-only trace (window_counts); this one has tokens")
    E = trace.num_logical_experts
    k = check_whole("top_k", top_k, 1, E, fix=f"the model's experts per token (at most {E})")
    check_whole("max_tokens", max_tokens, 1, fix="e.g. 200000")
    counts = np.asarray(trace.window_counts, dtype=float)  # [W, L, E]
    W, L, _ = counts.shape
    sums = counts.sum(axis=2, keepdims=True)  # [W, L, 1]
    if (sums <= 0).any():
        w, layer = map(int, np.argwhere(sums[..., 0] <= 0)[0])
        raise ValueError(
            f"window {w} routes nothing in layer row {layer}: every window needs routing to draw tokens"
        )
    pi = _capped(k * counts / sums, k)
    n, f = _window_tokens(counts, k, max_tokens)
    window = np.repeat(np.arange(W), n)  # [N] window of each token
    rng = np.random.default_rng(seed)
    ids = np.empty((window.size, L, k), dtype=np.int16 if E <= 32767 else np.int32)
    for layer in range(L):
        ids[:, layer, :] = _draw(pi[window, layer, :], k, rng)
    offsets = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
    return RoutingTrace(
        num_logical_experts=E,
        topk_ids=ids,
        layer_ids=trace.layer_ids,
        seq_offsets=offsets,
        name=f"{trace.name}-tokens-from-counts",
        metadata={
            "from_counts": True,
            "source": trace.name,
            "windows": W,
            "scale": f,
            "seed": int(seed),
            "generator": "profiling.from_counts.tokens_from_counts",
        },
    )
