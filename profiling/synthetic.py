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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moe_placement.base.options import options_or_fields, refuse_unknown_keywords
from profiling.trace import RoutingTrace

__all__ = ["MAX_SYNTHETIC_CELLS", "SyntheticSpec", "synthetic_trace"]

MAX_SYNTHETIC_CELLS = 1 << 28  # token x layer x pick cells one synthetic trace allocates (~0.5 GiB of int16)


@refuse_unknown_keywords
@dataclass(frozen=True)
class SyntheticSpec:
    """The shape and the routing statistics of a synthetic trace; a bad value is a ValueError naming it.

    Attributes:
        num_tokens: ``T``; num_layers: ``L``; num_logical_experts: ``E`` (>= 2); top_k: ``k`` (< E).
        num_prompts: prompts (``seq_offsets`` boundaries), at least 1 and at most T.
        skew: Zipf exponent of expert popularity (0 = uniform).
        num_clusters: co-activation clusters per layer (1..E).
        affinity: extra weight of a prompt's topic cluster (0 = no co-activation structure).
        drift: 0..1, how far popularity moves from the first to the last prompt.
        seed: makes the trace reproducible.
        layer_ids: the layer id of each row (default ``0..L-1``).
    """

    num_tokens: int = 20000
    num_layers: int = 8
    num_logical_experts: int = 64
    top_k: int = 6
    num_prompts: int = 200
    skew: float = 0.4
    num_clusters: int = 8
    affinity: float = 4.0
    drift: float = 0.3
    seed: int = 0
    layer_ids: Sequence[int] | None = None

    def __post_init__(self) -> None:
        for name, lo in (
            ("num_tokens", 1),
            ("num_layers", 1),
            ("num_logical_experts", 2),
            ("top_k", 1),
            ("num_prompts", 1),
            ("num_clusters", 1),
            ("seed", 0),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{name} must be a whole number >= {lo}, got {v!r}")
        for name in ("skew", "affinity", "drift"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not np.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        cells = self.num_tokens * self.num_layers * self.top_k
        if cells > MAX_SYNTHETIC_CELLS:
            raise ValueError(
                f"num_tokens x num_layers x top_k = {self.num_tokens} x {self.num_layers} x {self.top_k} = "
                f"{cells} routing cells, over the {MAX_SYNTHETIC_CELLS} a synthetic trace may hold "
                f"(MAX_SYNTHETIC_CELLS); use fewer tokens or layers"
            )
        E, k = self.num_logical_experts, self.top_k
        if not 1 <= k < E:
            raise ValueError(f"top_k must be in [1, {E - 1}], got {k}")
        if self.num_prompts > self.num_tokens:
            raise ValueError(f"num_prompts={self.num_prompts} exceeds num_tokens={self.num_tokens}")
        if self.num_clusters > E:
            raise ValueError(f"num_clusters={self.num_clusters} exceeds num_logical_experts={E}")
        if not 0.0 <= self.drift <= 1.0 or self.skew < 0 or self.affinity < 0:
            raise ValueError(
                f"need 0 <= drift <= 1, skew >= 0, affinity >= 0; got {self.drift}, {self.skew}, {self.affinity}"
            )


def synthetic_trace(spec: SyntheticSpec | None = None, /, **fields) -> RoutingTrace:
    """Generate a synthetic per-token trace.

    Args:
        spec: the trace's shape and statistics (default ``SyntheticSpec()``).
        fields: :class:`SyntheticSpec` fields to set over ``spec`` (``synthetic_trace(num_tokens=3000,
            seed=1)``); the fields are documented there, once.

    Returns:
        RoutingTrace with ``topk_ids`` int16 ``[T, L, k]`` and ``seq_offsets`` ``[num_prompts + 1]``.
    """
    spec = options_or_fields(SyntheticSpec, spec, fields, "synthetic_trace", merge=True)
    rng = np.random.default_rng(spec.seed)
    T, L, E, k = int(spec.num_tokens), int(spec.num_layers), int(spec.num_logical_experts), int(spec.top_k)
    base = 1.0 / np.arange(1, E + 1) ** spec.skew  # [E]
    start = np.stack([base[rng.permutation(E)] for _ in range(L)])  # [L, E]
    end = np.stack([base[rng.permutation(E)] for _ in range(L)])  # [L, E]
    cluster = np.stack(
        [rng.permutation(E) % spec.num_clusters for _ in range(L)]
    )  # [L, E] cluster of each expert

    offsets = _prompt_offsets(rng, T, spec.num_prompts)
    ids = _route(rng, offsets, start, end, cluster, spec)
    return RoutingTrace(
        num_logical_experts=E,
        topk_ids=ids,
        layer_ids=tuple(spec.layer_ids) if spec.layer_ids is not None else tuple(range(L)),
        seq_offsets=offsets,
        name=f"synthetic-seed{spec.seed}",
        metadata={
            "synthetic": True,
            "generator": "profiling.synthetic.synthetic_trace",
            "params": {
                "num_tokens": T,
                "num_layers": L,
                "num_logical_experts": E,
                "top_k": k,
                "num_prompts": int(spec.num_prompts),
                "skew": spec.skew,
                "num_clusters": int(spec.num_clusters),
                "affinity": spec.affinity,
                "drift": spec.drift,
                "seed": spec.seed,
            },
        },
    )


def _prompt_offsets(rng: np.random.Generator, T: int, num_prompts: int) -> np.ndarray:
    """``[num_prompts + 1]`` int64 prompt boundaries: random cut points, every prompt at least one token."""
    cuts = (
        np.sort(rng.choice(np.arange(1, T), size=num_prompts - 1, replace=False))
        if num_prompts > 1
        else np.array([], int)
    )
    return np.concatenate([[0], cuts, [T]]).astype(np.int64)


def _route(rng, offsets, start, end, cluster, spec: SyntheticSpec) -> np.ndarray:
    """``topk_ids`` int16 ``[T, L, k]``: per prompt, popularity drifts from ``start`` to ``end``
    (``[L, E]`` each) and the prompt's topic cluster (``cluster [L, E]``) gets ``1 + affinity`` weight."""
    k, affinity, drift, num_clusters = int(spec.top_k), spec.affinity, spec.drift, spec.num_clusters
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
