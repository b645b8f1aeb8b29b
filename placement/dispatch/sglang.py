"""SGLang's replica choice with an all-to-all backend (DeepEP), as SGLang 0.5.23 builds it.

- ``sglang-static`` (``--ep-dispatch-algorithm static``): each rank narrows an expert's replicas to
  the first on its own GPU, else the first on its own node when that narrows the list; an expert with
  one replica is that replica. The ranks left with several candidates get a fixed table from a seeded
  ``random.Random(42)``: the ``n`` ranks without a near replica receive the ``c`` candidates ``n // c``
  times each plus a random ``n % c`` of them, shuffled. Each rank builds its table in its own process,
  and its narrowing decides which experts draw from the generator, so the draws differ from rank to
  rank: :func:`sglang_static_tables` replays every rank's sequence exactly.
- ``sglang-dynamic`` (``--ep-dispatch-algorithm dynamic``): the same narrowing, then a uniformly random
  candidate per token (scored by expectation).

Shapes: L layers, E logical experts, P physical slots, G EP ranks, R most replicas of one expert,
T tokens, k top-k. Slots of one expert are taken in ascending slot order (the order of SGLang's
``logical_to_all_physical_map``).
"""

from __future__ import annotations

import random

import numpy as np

from placement.dispatch.ideal import even_choices
from placement.dispatch.registry import DispatchModel, register
from placement.model import Placement, compute_logical_maps, hidden_layer_rows

__all__ = [
    "SGLANG_DYNAMIC",
    "SGLANG_STATIC",
    "SGLANG_STATIC_SEED",
    "layer_draws",
    "nearest_in_row",
    "nearest_replica",
    "sglang_static_tables",
]

SGLANG_STATIC_SEED = 42  # the seed SGLang's static table is built with


# ---------------------------------------------------------------------------------------------
# SGLang: narrowing, the static table
# ---------------------------------------------------------------------------------------------
def nearest_replica(placement: Placement, layer: int) -> np.ndarray:
    """SGLang's narrowing for every rank and expert of one layer: int64 ``[G, E]``, -1 where none.

    An expert with one replica: that slot. Else the first replica on the rank's GPU; else the first
    on the rank's node, but only when not all replicas are on that node; else -1.
    """
    l2p = placement.logical_to_physical_map[layer]  # [E, R] ascending, -1 padded
    return nearest_in_row(l2p, placement.logical_replica_count[layer], placement.topology)


def nearest_in_row(l2p: np.ndarray, cnt: np.ndarray, topology) -> np.ndarray:
    """:func:`nearest_replica` for one layer's ``l2p [E, R]`` (ascending, -1 padded) and ``cnt [E]``."""
    t = topology
    valid = l2p >= 0
    gpu = np.where(valid, l2p // t.slots_per_gpu, -1)  # [E, R]
    node = np.where(valid, gpu // t.gpus_per_node, -1)  # [E, R]
    ranks = np.arange(t.ep_size)
    on_gpu = gpu[None, :, :] == ranks[:, None, None]  # [G, E, R]
    on_node = node[None, :, :] == (ranks // t.gpus_per_node)[:, None, None]  # [G, E, R]
    n_node = on_node.sum(axis=2)  # [G, E]
    experts = np.arange(l2p.shape[0])[None, :]
    first_gpu = l2p[experts, on_gpu.argmax(axis=2)]  # [G, E] first replica on the rank's GPU (if any)
    first_node = l2p[experts, on_node.argmax(axis=2)]  # [G, E] first replica on the rank's node (if any)
    out = np.full((t.ep_size, l2p.shape[0]), -1, dtype=np.int64)
    narrows = (n_node > 0) & (n_node < cnt[None, :])
    out[narrows] = first_node[narrows]
    has_gpu = on_gpu.any(axis=2)
    out[has_gpu] = first_gpu[has_gpu]
    single = np.broadcast_to(cnt[None, :] == 1, out.shape)
    out[single] = np.broadcast_to(l2p[:, 0][None, :], out.shape)[single]
    return out


def _fair_choices(candidates: list[int], k: int, rng: random.Random) -> list[int]:
    """``k`` picks: every candidate ``k // c`` times, plus ``k % c`` distinct ones drawn, shuffled."""
    whole, extra = divmod(k, len(candidates))
    picks = candidates * whole + rng.sample(candidates, k=extra)
    rng.shuffle(picks)
    return picks


def layer_draws(l2p: np.ndarray, cnt: np.ndarray, near: np.ndarray, rngs: list[random.Random]) -> np.ndarray:
    """One layer of every rank's static table: int64 ``[G, E]``.

    ``l2p [E, R]``, ``cnt [E]``, ``near [G, E]`` (:func:`nearest_in_row`); ``rngs[g]`` is rank ``g``'s
    generator, advanced in place as SGLang's process for that rank advances it (experts ascending,
    one fair assignment for each expert the rank found no near replica for).
    """
    table = near.copy()
    left = near < 0  # [G, E]
    for e in np.flatnonzero(left.any(axis=0)):
        remaining = np.flatnonzero(left[:, e])  # ranks left with all candidates, ascending
        candidates = l2p[e, : cnt[e]].tolist()
        for i, rank in enumerate(remaining):
            table[rank, e] = _fair_choices(candidates, len(remaining), rngs[rank])[i]
    return table


def sglang_static_tables(placement: Placement, seed: int = SGLANG_STATIC_SEED) -> np.ndarray:
    """SGLang's static dispatch table of every rank: int64 ``[G, L, E]`` physical slot ids.

    Each rank builds its table in its own process from ``random.Random(seed)``; its generator
    advances only for the experts it finds no near replica for, so every rank's draws differ. SGLang
    reads one row per hidden layer (:func:`placement.model.hidden_layer_rows`: dense layers hold the
    trivial map, whose replicas draw too), so the tables are built over those rows, in layer order.
    Cached on the placement object (the tables depend only on the map and the topology).
    """
    cache = placement.__dict__.setdefault("_dispatch_cache", {})
    key = ("static-tables", seed)
    if key not in cache:
        full = hidden_layer_rows(placement)  # [H, P]: SGLang builds its tables over every hidden layer
        l2p, cnt = compute_logical_maps(full, placement.num_logical_experts)  # [H, E, R], [H, E]
        rngs = [random.Random(seed) for _ in range(placement.topology.ep_size)]
        layers = [
            layer_draws(l2p[h], cnt[h], nearest_in_row(l2p[h], cnt[h], placement.topology), rngs)
            for h in range(full.shape[0])
        ]
        cache[key] = np.stack(layers, axis=1)[:, list(placement.layer_ids), :]  # [G, L, E]
    return cache[key]


# ---------------------------------------------------------------------------------------------
# Expected choice per (source rank, expert), and token-level routing
# ---------------------------------------------------------------------------------------------
def _single(choice: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """One slot per (rank, expert) ``[G, E]`` as ``[G, E, R]`` slots and weights."""
    slots = np.full(shape, -1, dtype=np.int64)
    weights = np.zeros(shape)
    slots[:, :, 0] = choice
    weights[:, :, 0] = 1.0
    return slots, weights


def static_choices(placement: Placement, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """``sglang-static``: every (rank, expert) sends all its tokens to its table's slot: ``[G, E, R]`` x2."""
    table = sglang_static_tables(placement)[:, layer, :]  # [G, E]
    shape = (placement.topology.ep_size, *placement.logical_to_physical_map[layer].shape)
    return _single(table, shape)


def dynamic_choices(placement: Placement, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """``sglang-dynamic`` in expectation: the narrowed replica, else uniform over all: ``[G, E, R]`` x2."""
    slots, weights = even_choices(placement, layer)
    near = nearest_replica(placement, layer)  # [G, E]
    one, w_one = _single(np.maximum(near, 0), slots.shape)
    keep = (near >= 0)[:, :, None]
    return np.where(keep, one, slots), np.where(keep, w_one, weights)


def _route_static(placement: Placement, layer: int, ids, src, batch_index=None, rng=None) -> np.ndarray:
    """Slots ``[T, k]``: the table entry of each token's source rank."""
    return sglang_static_tables(placement)[src[:, None], layer, ids]


def _route_dynamic(placement: Placement, layer: int, ids, src, batch_index=None, rng=None) -> np.ndarray:
    """Slots ``[T, k]``: the narrowed replica, else a uniform draw from ``rng``."""
    if rng is None:
        raise ValueError("sglang-dynamic routing draws at random: pass rng")
    l2p = placement.logical_to_physical_map[layer]  # [E, R]
    cnt = placement.logical_replica_count[layer]  # [E]
    near = nearest_replica(placement, layer)[src[:, None], ids]  # [T, k]
    drawn = l2p[ids, rng.integers(0, 1 << 30, size=ids.shape) % cnt[ids]]
    return np.where(near >= 0, near, drawn)


SGLANG_STATIC = register(
    DispatchModel(
        "sglang-static",
        "SGLang --ep-dispatch-algorithm static with DeepEP",
        static_choices,
        engine="SGLang",
        version="0.5.23",
        engine_flag=("--ep-dispatch-algorithm", "static"),
        needs_source_ranks=True,
        route=_route_static,
        counts_only=False,
        local_first=False,
        locality_fit=False,
        table_fit="swaps",
        runtime_route="",
    )
)
SGLANG_DYNAMIC = register(
    DispatchModel(
        "sglang-dynamic",
        "SGLang --ep-dispatch-algorithm dynamic with DeepEP (scored by expectation)",
        dynamic_choices,
        engine="SGLang",
        version="0.5.23",
        engine_flag=("--ep-dispatch-algorithm", "dynamic"),
        needs_source_ranks=True,
        route=_route_dynamic,
        counts_only=False,
        local_first=False,
        locality_fit=False,
        table_fit="spread",
        runtime_route="",
    )
)
