"""A seeded SYNTHETIC routing workload: the demo's built-in default and a test fixture.

It is not real routing. It imitates three things the recorded traces show: per-layer skew (a few hot
experts; max/mean expert load per layer 1.3-2.6 in DeepSeek-V2-Lite chat routing, 1.1-1.5 in Mixtral
on MMLU), experts that fire together (co-activation clusters), and drift between prompts (the hot set
moves slowly over the trace). Every trace it returns carries
``metadata["synthetic"] = True`` and a name starting with ``synthetic``.

Model: for each layer, expert popularity is a Zipf-like base vector with exponent ``skew``, randomly
permuted. Experts are split into ``num_clusters`` clusters. Each prompt draws a topic cluster per layer
(sticky across layers); a token then samples its top-k without replacement from
``popularity * (1 + affinity * in_cluster)``. Drift: the popularity of every layer is interpolated
over the trace from one random permutation to another, with ``drift`` the fraction of the way it moves.
"""

from __future__ import annotations

import numpy as np

from profiling.trace import RoutingTrace

__all__ = ["synthetic_trace"]


def synthetic_trace(
    num_tokens: int = 20000,
    num_layers: int = 8,
    num_logical_experts: int = 64,
    top_k: int = 6,
    num_prompts: int = 200,
    skew: float = 0.4,
    num_clusters: int = 8,
    affinity: float = 4.0,
    drift: float = 0.3,
    seed: int = 0,
    layer_ids=None,
) -> RoutingTrace:
    """Generate a synthetic per-token trace.

    Args:
        num_tokens: ``T``; num_layers: ``L``; num_logical_experts: ``E``; top_k: ``k`` (< E).
        num_prompts: prompts (``seq_offsets`` boundaries), at least 1 and at most T.
        skew: Zipf exponent of expert popularity (0 = uniform).
        num_clusters: co-activation clusters per layer (1..E).
        affinity: extra weight of a prompt's topic cluster (0 = no co-activation structure).
        drift: 0..1, how far popularity moves from the first to the last prompt.
        seed: makes the trace reproducible.

    Returns:
        RoutingTrace with ``topk_ids`` int16 ``[T, L, k]`` and ``seq_offsets`` ``[num_prompts + 1]``.
    """
    _check_args(
        num_tokens, num_layers, num_logical_experts, top_k, num_prompts, skew, num_clusters, affinity, drift
    )
    rng = np.random.default_rng(seed)
    T, L, E, k = int(num_tokens), int(num_layers), int(num_logical_experts), int(top_k)
    base = 1.0 / np.arange(1, E + 1) ** skew  # [E]
    start = np.stack([base[rng.permutation(E)] for _ in range(L)])  # [L, E]
    end = np.stack([base[rng.permutation(E)] for _ in range(L)])  # [L, E]
    cluster = np.stack([rng.permutation(E) % num_clusters for _ in range(L)])  # [L, E] cluster of each expert

    offsets = _prompt_offsets(rng, T, num_prompts)
    ids = _route(rng, offsets, start, end, cluster, num_clusters, k, affinity, drift)
    return RoutingTrace(
        num_logical_experts=E,
        topk_ids=ids,
        layer_ids=tuple(layer_ids) if layer_ids is not None else tuple(range(L)),
        seq_offsets=offsets,
        name=f"synthetic-seed{seed}",
        metadata={
            "synthetic": True,
            "generator": "profiling.synthetic.synthetic_trace",
            "params": {
                "num_tokens": T,
                "num_layers": L,
                "num_logical_experts": E,
                "top_k": k,
                "num_prompts": int(num_prompts),
                "skew": skew,
                "num_clusters": int(num_clusters),
                "affinity": affinity,
                "drift": drift,
                "seed": seed,
            },
        },
    )


def _check_args(
    num_tokens, num_layers, num_logical_experts, top_k, num_prompts, skew, num_clusters, affinity, drift
):
    """ValueError naming the first argument out of range."""
    for name, v, lo in (
        ("num_tokens", num_tokens, 1),
        ("num_layers", num_layers, 1),
        ("num_logical_experts", num_logical_experts, 2),
        ("num_prompts", num_prompts, 1),
        ("num_clusters", num_clusters, 1),
    ):
        if int(v) < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
    if not 1 <= top_k < num_logical_experts:
        raise ValueError(f"top_k must be in [1, {num_logical_experts - 1}], got {top_k}")
    if num_prompts > num_tokens:
        raise ValueError(f"num_prompts={num_prompts} exceeds num_tokens={num_tokens}")
    if num_clusters > num_logical_experts:
        raise ValueError(f"num_clusters={num_clusters} exceeds num_logical_experts={num_logical_experts}")
    if not 0.0 <= drift <= 1.0 or skew < 0 or affinity < 0:
        raise ValueError(f"need 0 <= drift <= 1, skew >= 0, affinity >= 0; got {drift}, {skew}, {affinity}")


def _prompt_offsets(rng: np.random.Generator, T: int, num_prompts: int) -> np.ndarray:
    """``[num_prompts + 1]`` int64 prompt boundaries: random cut points, every prompt at least one token."""
    cuts = (
        np.sort(rng.choice(np.arange(1, T), size=num_prompts - 1, replace=False))
        if num_prompts > 1
        else np.array([], int)
    )
    return np.concatenate([[0], cuts, [T]]).astype(np.int64)


def _route(rng, offsets, start, end, cluster, num_clusters, k, affinity, drift) -> np.ndarray:
    """``topk_ids`` int16 ``[T, L, k]``: per prompt, popularity drifts from ``start`` to ``end``
    (``[L, E]`` each) and the prompt's topic cluster (``cluster [L, E]``) gets ``1 + affinity`` weight."""
    num_prompts = len(offsets) - 1
    L = start.shape[0]
    E = start.shape[1]
    ids = np.empty((int(offsets[-1]), L, k), dtype=np.int16)
    topic = rng.integers(0, num_clusters, size=num_prompts)  # a prompt's topic, shared across layers
    for s in range(num_prompts):
        a, b = offsets[s], offsets[s + 1]
        n = b - a
        frac = drift * (s / max(num_prompts - 1, 1))
        for l in range(L):
            pop = (1 - frac) * start[l] + frac * end[l]  # [E]
            w = pop * (1.0 + affinity * (cluster[l] == topic[s]))  # [E]
            # k draws without replacement via Gumbel-top-k on log weights, per token
            g = np.log(w)[None, :] - np.log(-np.log(rng.random((n, E))))  # [n, E]
            ids[a:b, l, :] = np.argpartition(-g, k - 1, axis=1)[:, :k]
    return ids
