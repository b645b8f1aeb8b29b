"""Dispatch models: which replica of an expert serves a token, as each engine decides it.

Shapes: L layers, E logical experts, P physical slots, G EP ranks (GPUs), N nodes, R most replicas of
one expert, T tokens, k top-k. Slots of one expert are taken in ascending slot order everywhere (that
is the order of SGLang's ``logical_to_all_physical_map`` and of vLLM's ``logical_to_physical_map``).

Models (one name each; ``--dispatch`` on the CLI):

- ``even``: an expert's tokens split evenly over its replicas. An ideal, not an engine's rule.
- ``local``: a replica on the token's own GPU, else the replicas on its own node (evenly), else all.
- ``sglang-static``: SGLang's ``--ep-dispatch-algorithm static`` with an all-to-all backend (DeepEP).
  Each rank narrows an expert's replicas to the first on its own GPU, else the first on its own node
  when that narrows the list; an expert with one replica is that replica. The ranks left with several
  candidates get a fixed table from a seeded ``random.Random(42)``: the ``n`` ranks without a near
  replica receive the ``c`` candidates ``n // c`` times each plus a random ``n % c`` of them, shuffled.
  Each rank builds its table in its own process, and its narrowing decides which experts draw from
  the generator, so the draws differ from rank to rank: :func:`sglang_static_tables` replays every
  rank's sequence exactly.
- ``sglang-dynamic``: the same narrowing, then a uniformly random candidate per token.
- ``vllm-hash``: vLLM's EPLB: replica ``((i * 2654435769) mod 2**32) mod c`` of an expert with ``c``
  replicas, where ``i`` is the token's row in its rank's forward batch.

TensorRT-LLM's wide-EP balancer is not modelled: see ``docs/dispatch.md``.
"""

from __future__ import annotations

import random

import numpy as np

from placement.model import Placement, compute_logical_maps, hidden_layer_rows

__all__ = [
    "DISPATCH_MODELS",
    "VLLM_HASH_MULTIPLIER",
    "check_dispatch",
    "layer_draws",
    "nearest_in_row",
    "nearest_replica",
    "rank_choices",
    "route_layer",
    "sglang_static_tables",
    "vllm_hash_replica",
]

VLLM_HASH_MULTIPLIER = 2654435769  # floor(2**32 / golden ratio), Knuth's multiplicative hash
SGLANG_STATIC_SEED = 42  # the seed SGLang's static table is built with


DISPATCH_MODELS: dict[str, str] = {  # name -> the engine setting it models
    "even": "ideal even split (vLLM's hash comes close in expectation)",
    "local": "own GPU, else own node, else spread (the locality-first ideal)",
    "sglang-static": "SGLang --ep-dispatch-algorithm static with DeepEP",
    "sglang-dynamic": "SGLang --ep-dispatch-algorithm dynamic with DeepEP (scored by expectation)",
    "vllm-hash": "vLLM --enable-eplb (token-index hash)",
}


def check_dispatch(name: str) -> str:
    """``name`` if it is a dispatch model, else ValueError listing the models."""
    if name not in DISPATCH_MODELS:
        raise ValueError(f"unknown dispatch model {name!r}; use one of {', '.join(DISPATCH_MODELS)}")
    return name


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
    key = ("sglang-static", seed)
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
# vLLM: the token-index hash
# ---------------------------------------------------------------------------------------------
def vllm_hash_replica(batch_index: np.ndarray, replica_count: np.ndarray) -> np.ndarray:
    """Replica index vLLM picks: ``((i * 2654435769) & 0xFFFFFFFF) % c`` (int64, same shape)."""
    i = np.asarray(batch_index, dtype=np.uint64)
    hashed = (i * np.uint64(VLLM_HASH_MULTIPLIER)) & np.uint64(0xFFFFFFFF)
    return (hashed % np.maximum(np.asarray(replica_count), 1).astype(np.uint64)).astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Expected choice per (source rank, expert), and token-level routing
# ---------------------------------------------------------------------------------------------
def rank_choices(placement: Placement, layer: int, dispatch: str) -> tuple[np.ndarray, np.ndarray]:
    """Where rank ``g``'s tokens for expert ``e`` go, in expectation, for one layer.

    Returns:
        ``(slots int64 [G, E, R], weights float64 [G, E, R])``: slot ids (-1 padded) and the share of
        the tokens each receives (rows sum to 1). ``vllm-hash`` is even in expectation.
    """
    check_dispatch(dispatch)
    t = placement.topology
    G = t.ep_size
    l2p = placement.logical_to_physical_map[layer]  # [E, R]
    cnt = placement.logical_replica_count[layer]  # [E]
    slots = np.broadcast_to(l2p, (G, *l2p.shape)).copy()  # [G, E, R]
    weights = np.where(slots >= 0, 1.0 / cnt[None, :, None], 0.0)
    if dispatch in ("even", "vllm-hash"):
        return slots, weights
    if dispatch == "local":
        return _local_choices(placement, layer, slots, weights)
    if dispatch == "sglang-static":
        table = sglang_static_tables(placement)[:, layer, :]  # [G, E]
        return _single(table, slots.shape)
    near = nearest_replica(placement, layer)  # sglang-dynamic: narrowed, else uniform over all
    one, w_one = _single(np.maximum(near, 0), slots.shape)
    keep = (near >= 0)[:, :, None]
    return np.where(keep, one, slots), np.where(keep, w_one, weights)


def _single(choice: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """One slot per (rank, expert) ``[G, E]`` as ``[G, E, R]`` slots and weights."""
    slots = np.full(shape, -1, dtype=np.int64)
    weights = np.zeros(shape)
    slots[:, :, 0] = choice
    weights[:, :, 0] = 1.0
    return slots, weights


def _local_choices(placement: Placement, layer: int, slots: np.ndarray, weights: np.ndarray):
    """``local``: own GPU's replica, else the own node's replicas evenly, else all evenly."""
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


def route_layer(
    placement: Placement,
    layer: int,
    ids: np.ndarray,
    src: np.ndarray,
    dispatch: str,
    batch_index: np.ndarray | None = None,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Token-level slot choice of one layer under an engine's rule.

    Args:
        ids: int ``[T, k]`` logical ids (-1: none); src: int64 ``[T]`` source rank of each token.
        dispatch: ``sglang-static``, ``sglang-dynamic`` (needs ``rng``) or ``vllm-hash`` (needs
            ``batch_index``: int64 ``[T]``, each token's row in its rank's forward batch).

    Returns:
        int64 ``[T, k]`` physical slots, -1 where the id was -1.
    """
    valid = ids >= 0
    e = np.where(valid, ids, 0).astype(np.int64)  # [T, k]
    l2p = placement.logical_to_physical_map[layer]  # [E, R]
    cnt = placement.logical_replica_count[layer]  # [E]
    if dispatch == "sglang-static":
        out = sglang_static_tables(placement)[src[:, None], layer, e]
    elif dispatch == "vllm-hash":
        if batch_index is None:
            raise ValueError("vllm-hash routing needs each token's row in its forward batch")
        out = l2p[e, vllm_hash_replica(batch_index[:, None], cnt[e])]
    elif dispatch == "sglang-dynamic":
        if rng is None:
            raise ValueError("sglang-dynamic routing draws at random: pass rng")
        near = nearest_replica(placement, layer)[src[:, None], e]  # [T, k]
        drawn = l2p[e, rng.integers(0, 1 << 30, size=e.shape) % cnt[e]]
        out = np.where(near >= 0, near, drawn)
    else:
        raise ValueError(f"route_layer models the engines' rules, not {dispatch!r}")
    return np.where(valid, out, -1)
