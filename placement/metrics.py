"""Placement metrics, exactly as named in ``docs/metrics.md`` (shared with the engines' logs).

Shapes: L layers, E logical experts, P physical slots, G EP ranks (GPUs), N nodes, T tokens, k top-k.

Replica selection (how a token's choice of a logical expert becomes a physical slot) is a dispatch
model from the registry :data:`placement.dispatch.DISPATCH`; every function takes one (``dispatch``: a
registered name or the model) and branches on its attributes, never on its name:

- ``even``: an expert's tokens split evenly over its replicas (an ideal; vLLM's hash is close to it).
- ``sglang-static``, ``sglang-dynamic``, ``vllm-hash``: the engines' own rules (:mod:`placement.dispatch`).
- ``local``: a replica on the token's own GPU, else one on its own node, else any replica; where a
  tier holds several replicas the tokens spread evenly over them (round-robin), which is where a
  least-loaded choice settles for a static map and is reproducible rank by rank.

Balance metrics split fractionally (each token puts ``1/c`` on each of the ``c`` replicas of its tier:
the expectation). A model that decides from each step's all-reduced counts (``needs_step_counts``) is
scored step by step through its ``step_load``. :func:`route_tokens` gives the deterministic token-level
choice the runtime applies (token ``t``'s ``j``-th pick takes replica ``(t + j) mod c`` of its tier);
communication metrics use it, and the runtime's measured per-rank token counts equal
:func:`routed_gpu_tokens` exactly. Source ranks come from :mod:`placement.sources` (re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from placement.churn import arrived_experts, moved_bytes  # noqa: F401 (re-exported)
from placement.cost.traffic import token_copy_bytes
from placement.dispatch import (
    DISPATCH,
    EVEN,
    DispatchModel,
    get_dispatch,
    rank_choices,
    route_layer,
)
from placement.metric_checks import check_bytes_args as _check_bytes_args
from placement.metric_checks import check_compatible as _check_compatible
from placement.metric_checks import check_counts as _check_counts
from placement.metric_checks import check_load_values as _check_load_values
from placement.metric_checks import check_types as _check_types
from placement.model import Placement
from placement.sources import check_src_ranks, rank_expert_counts, resolve_source_ranks, source_ranks
from placement.steps import DEFAULT_STEP_TOKENS, PHASES, make_steps
from profiling.readers import require_data
from profiling.trace import RoutingTrace

__all__ = [
    "balance_stats",
    "expected_gpu_load",
    "trace_gpu_load",
    "route_tokens",
    "routed_gpu_tokens",
    "source_ranks",
    "resolve_source_ranks",
    "rank_expert_counts",
    "rank_gpu_load",
    "batch_positions",
    "par",
    "balancedness",
    "imbalance_ratio",
    "step_par",
    "DEFAULT_PHASE",
    "remote_nodes_per_token",
    "remote_gpus_per_token",
    "communication",
    "moved_slots",
    "peak_lower_bound",
    "evaluate",
]

Dispatch = str | DispatchModel  # a name registered in placement.dispatch.DISPATCH, or the model
ENGINE_RULES = tuple(n for n, m in DISPATCH.items() if m.route is not None)  # deprecated: token-level rules
# A window scored without a step shape is cut into forward batches like prefill steps: this many
# consecutive tokens per rank (the batch rows vllm-hash hashes; the steps of a per-step model).
WINDOW_STEP_TOKENS = DEFAULT_STEP_TOKENS["prefill"]
DEFAULT_PHASE = "decode"  # the phase step_par and evaluate use when none is given (what engines mostly run)


# ---------------------------------------------------------------------------------------------
# Balance
# ---------------------------------------------------------------------------------------------
def balance_stats(gpu_load: np.ndarray) -> dict:
    """Balance of per-GPU loads.

    Args:
        gpu_load: ``[L, G]`` (or ``[..., G]``) tokens per GPU.

    Returns:
        dict with ``par``, ``balancedness``, ``imbalance_ratio`` (mean over layers), ``par_worst``
        (worst layer), and ``*_per_layer`` lists. A layer with no load counts as perfectly balanced.

    Raises:
        ValueError: a negative or non-finite load, or no load at all (the PAR of zero load is undefined,
            not 1.0: nothing was routed).
    """
    g = np.asarray(gpu_load, dtype=np.float64)
    _check_load_values(g, "GPU load")
    mean = g.mean(axis=-1)
    peak = g.max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        par_l = np.where(mean > 0, peak / np.where(mean > 0, mean, 1.0), 1.0)
    bal_l = 1.0 / par_l
    imb_l = par_l - 1.0
    return {
        "par": float(par_l.mean()),
        "par_worst": float(par_l.max()),
        "balancedness": float(bal_l.mean()),
        "imbalance_ratio": float(imb_l.mean()),
        "par_per_layer": par_l.tolist(),
        "balancedness_per_layer": bal_l.tolist(),
        "imbalance_ratio_per_layer": imb_l.tolist(),
    }


def expected_gpu_load(placement: Placement, load: np.ndarray) -> np.ndarray:
    """Per-GPU load under the ``even`` dispatch model from per-expert loads.

    Args:
        load: ``[L, E]`` (or ``[W, L, E]``) tokens per logical expert.

    Returns:
        float64 ``[L, G]`` (or ``[W, L, G]``).
    """
    w = _check_counts(load, "the load")  # a NaN load would give NaN GPU loads
    squeeze = w.ndim == 2
    if squeeze:
        w = w[None]
    if w.ndim != 3:
        raise ValueError(
            f"load must be [layers, experts] or [windows, layers, experts], got shape {np.shape(load)}"
        )
    _check_compatible(placement, w.shape[1], w.shape[2], "the load")
    p2l = placement.physical_to_logical_map  # [L, P]
    cnt = placement.logical_replica_count  # [L, E]
    per_replica = w / cnt[None]  # [W, L, E]
    slot_load = np.take_along_axis(
        per_replica, np.broadcast_to(p2l, (w.shape[0],) + p2l.shape), axis=2
    )  # [W, L, P]
    t = placement.topology
    out = slot_load.reshape(w.shape[0], w.shape[1], t.ep_size, t.slots_per_gpu).sum(axis=3)  # [W, L, G]
    return out[0] if squeeze else out


def rank_gpu_load(placement: Placement, rank_counts: np.ndarray, dispatch: Dispatch) -> np.ndarray:
    """GPU loads ``[..., L, G]`` from tokens per (source rank, expert) ``rank_counts [..., L, G, E]``:
    exact for ``sglang-static`` and every rule that depends only on the rank (the expectation for the
    random ones; vLLM's hash is even in expectation). A model scored per step (``step_load``) reads
    each leading index as one step's counts (no leading axes: the counts are one step)."""
    model = get_dispatch(dispatch)
    t = placement.topology
    counts = _check_counts(rank_counts, "rank_counts")
    lead = counts.shape[:-3]
    G, E = t.ep_size, placement.num_logical_experts
    ranks = counts.shape[-2] if counts.ndim >= 3 and model.step_load is not None else G  # summed per step
    if counts.ndim < 3 or counts.shape[-3:] != (placement.num_layers, ranks, E):
        raise ValueError(
            f"rank_counts must be [..., {placement.num_layers}, {G}, {E}] (layers, ranks, experts), got {counts.shape}"
        )
    out = np.zeros((*lead, placement.num_layers, G))
    for l in range(placement.num_layers):
        if model.step_load is not None:
            per_slot = _step_load(placement, l, counts[..., l, :, :].sum(axis=-2).reshape(-1, E), model)
        else:
            per_slot = counts[..., l, :, :].reshape(-1, G * E) @ _share_matrix(placement, l, model)  # [., P]
        out[..., l, :] = per_slot.reshape(*lead, G, t.slots_per_gpu).sum(axis=-1)
    return out


class _LayerTables:
    """Per-layer lookup tables for replica selection (built once per layer, O(P)).

    ``gpu_slot`` int64 ``[G, E]`` (slot of expert e on GPU g, or -1); ``node_l2p`` int64 ``[N, E, R]``
    (slots of e on node n, ascending, -1 padded); ``node_cnt`` int64 ``[N, E]``; ``l2p`` ``[E, R]``;
    ``cnt`` ``[E]``; ``p2l`` and ``slot_node`` ``[P]``.
    """

    def __init__(self, placement: Placement, layer: int):
        t = placement.topology
        G, N, E = t.ep_size, t.num_nodes, placement.num_logical_experts
        p2l = placement.physical_to_logical_map[layer]  # [P]
        self.p2l = p2l
        self.l2p = placement.logical_to_physical_map[layer]  # [E, R]
        self.cnt = placement.logical_replica_count[layer]  # [E]
        self.gpu_slot = np.full((G, E), -1, dtype=np.int64)
        self.gpu_slot[t.gpu_of_slot, p2l] = np.arange(p2l.size)
        node = t.node_of_slot  # [P]
        self.slot_node = node
        self.node_cnt = np.zeros((N, E), dtype=np.int64)
        np.add.at(self.node_cnt, (node, p2l), 1)
        self.node_l2p = np.full((N, E, self.l2p.shape[1]), -1, dtype=np.int64)
        key = node * E + p2l  # [P]
        order = np.argsort(key, kind="stable")  # slots grouped by (node, expert), ascending inside
        sk = key[order]
        rank = np.arange(p2l.size) - np.searchsorted(sk, sk, side="left")
        self.node_l2p[node[order], p2l[order], rank] = order


def _tier_of(tab: _LayerTables, ids: np.ndarray, src: np.ndarray, model: DispatchModel, gpus_per_node: int):
    """Tier of each pick: 0 own GPU, 1 own node, 2 any replica (always 2 but for a ``local_first`` model), -1 no id.

    Args:
        ids: int ``[T, k]``; src: int64 ``[T]``.

    Returns:
        (tier int8 ``[T, k]``, own-GPU slot int64 ``[T, k]`` or -1, expert ids int64 ``[T, k]`` with -1 -> 0).
    """
    valid = ids >= 0
    e = np.where(valid, ids, 0).astype(np.int64)
    tier = np.full(ids.shape, 2, dtype=np.int8)
    own = np.full(ids.shape, -1, dtype=np.int64)
    if model.local_first:
        E = tab.gpu_slot.shape[1]
        own = tab.gpu_slot.ravel()[src[:, None] * E + e]  # [T, k] flat gather
        node_has = tab.node_cnt.ravel()[(src // gpus_per_node)[:, None] * E + e] > 0
        tier[node_has] = 1
        tier[own >= 0] = 0
    tier[~valid] = -1
    return tier, own, e


def _fractional_slot_load(
    placement: Placement,
    layer: int,
    ids: np.ndarray,
    src: np.ndarray,
    model: DispatchModel,
    group: np.ndarray,
    num_groups: int,
    batch_index: np.ndarray | None = None,
) -> np.ndarray:
    """Expected slot loads ``[num_groups, P]`` of one layer; ``group`` int64 ``[T]`` buckets tokens (steps).

    A model scored per step goes through its ``step_load`` with each group's counts; one our runtime
    executes (``even``, ``local``) puts weight ``1/c`` on each of the ``c`` replicas of a pick's tier;
    the engines' rules go through :func:`_engine_slot_load` (``batch_index``: each token's row in its
    forward batch).
    """
    if model.step_load is not None:
        E = placement.num_logical_experts
        valid = ids >= 0
        key = np.broadcast_to(group[:, None], ids.shape)[valid] * E + ids[valid].astype(np.int64)
        counts = np.bincount(key, minlength=num_groups * E).reshape(num_groups, E)  # [S, E]
        return _step_load(placement, layer, counts.astype(np.float64), model)
    if not model.runtime:
        return _engine_slot_load(placement, layer, ids, src, model, group, num_groups, batch_index)
    t = placement.topology
    E, P, N = placement.num_logical_experts, t.num_physical_experts, t.num_nodes
    tab = _LayerTables(placement, layer)
    tier, own, e = _tier_of(tab, ids, src, model, t.gpus_per_node)
    gk = np.broadcast_to(group[:, None], ids.shape)
    out = np.zeros((num_groups, P))
    sel = tier == 2  # spread over all replicas of the expert
    c2 = np.bincount(gk[sel] * E + e[sel], minlength=num_groups * E).reshape(num_groups, E)
    out += c2[:, tab.p2l] / tab.cnt[tab.p2l][None, :]
    if model.local_first:
        sel = tier == 0  # the replica on the token's own GPU
        out += np.bincount(gk[sel] * P + own[sel], minlength=num_groups * P).reshape(num_groups, P)
        sel = tier == 1  # spread over the replicas on the token's node
        sn = np.broadcast_to((src // t.gpus_per_node)[:, None], ids.shape)
        c1 = np.bincount((gk[sel] * N + sn[sel]) * E + e[sel], minlength=num_groups * N * E).reshape(
            num_groups, N, E
        )
        denom = np.maximum(tab.node_cnt[tab.slot_node, tab.p2l], 1)  # [P]
        out += c1[:, tab.slot_node, tab.p2l] / denom[None, :]
    return out


def _engine_slot_load(placement, layer, ids, src, model, group, num_groups, batch_index) -> np.ndarray:
    """Slot loads ``[num_groups, P]`` of one layer under an engine's rule.

    A model that is not fractional (``vllm-hash``) is routed token by token (``batch_index`` int64
    ``[T]``); the others (the SGLang rules) are scored by expectation: tokens per (group, source rank,
    expert) times each (rank, expert)'s shares.
    """
    P, G, E = placement.num_physical_experts, placement.topology.ep_size, placement.num_logical_experts
    valid = ids >= 0
    gk = np.broadcast_to(group[:, None], ids.shape)[valid]
    if not model.fractional:
        slots = route_layer(placement, layer, ids, src, model, batch_index=batch_index)[valid]
        return np.bincount(gk * P + slots, minlength=num_groups * P).reshape(num_groups, P).astype(np.float64)
    sk = np.broadcast_to(src[:, None], ids.shape)[valid]
    key = (gk * G + sk) * E + ids[valid].astype(np.int64)
    counts = np.bincount(key, minlength=num_groups * G * E).reshape(num_groups, G * E)  # [S, G*E]
    return counts @ _share_matrix(placement, layer, model)


def _step_load(placement: Placement, layer: int, counts: np.ndarray, model: DispatchModel) -> np.ndarray:
    """``model.step_load`` of one layer: float64 slot loads ``[S, P]`` from step counts ``[S, E]``."""
    out = np.asarray(model.step_load(placement, layer, counts), dtype=np.float64)
    if out.shape != (counts.shape[0], placement.num_physical_experts):
        raise ValueError(
            f"step_load of {model.name!r} returned shape {out.shape} for {counts.shape[0]} steps; it must "
            f"return ({counts.shape[0]}, {placement.num_physical_experts}): one row of slot loads per step"
        )
    return out


def _share_matrix(placement: Placement, layer: int, dispatch: Dispatch) -> np.ndarray:
    """``[G*E, P]``: row ``(g, e)`` holds the share of rank ``g``'s tokens for expert ``e`` that each
    slot receives (:func:`placement.dispatch.rank_choices`)."""
    G, E = placement.topology.ep_size, placement.num_logical_experts
    slots, weights = rank_choices(placement, layer, dispatch)  # [G, E, R] each
    share = np.zeros((G * E, placement.num_physical_experts))
    rows = np.broadcast_to(np.arange(G * E).reshape(G, E, 1), slots.shape)
    ok = slots >= 0
    np.add.at(share, (rows[ok], slots[ok]), weights[ok])
    return share


def batch_positions(src: np.ndarray, step_tokens: int) -> np.ndarray:
    """Each token's row in its rank's forward batch: its position among its rank's tokens (trace
    order) modulo ``step_tokens``. ``src`` int64 ``[T]`` -> int64 ``[T]``."""
    return _rank_positions(src) % int(step_tokens)


def _rank_positions(src: np.ndarray) -> np.ndarray:
    """Each token's position among its rank's tokens, in trace order: ``src`` int64 ``[T]`` -> ``[T]``."""
    order = np.argsort(src, kind="stable")  # tokens grouped by rank, trace order inside
    sorted_src = src[order]
    first = np.searchsorted(sorted_src, sorted_src, side="left")
    pos = np.empty_like(order)
    pos[order] = np.arange(order.size) - first
    return pos


def _layer_ids_src(placement: Placement, trace: RoutingTrace, src: np.ndarray | None):
    if not trace.has_tokens:
        raise ValueError("this metric needs a per-token trace (topk_ids); the given trace has counts only")
    _check_compatible(placement, trace.num_layers, trace.num_logical_experts, "the trace")
    if src is None:
        src, _ = source_ranks(trace, placement.topology.ep_size)
    src = check_src_ranks(src, trace.num_tokens, placement.topology.ep_size)
    return src


def trace_gpu_load(
    placement: Placement,
    trace: RoutingTrace,
    dispatch: Dispatch = EVEN,
    src: np.ndarray | None = None,
    step_tokens: int | None = None,
) -> np.ndarray:
    """Expected per-GPU load ``[L, G]`` of a trace under a dispatch model (fractional within a tier).

    Counts-only traces support ``even`` only (the others need to know where tokens come from).
    ``step_tokens``: tokens per rank per forward batch (default :data:`WINDOW_STEP_TOKENS`): a model that needs batch rows
    (``vllm-hash``) hashes each token's row; one scored per step sums its steps, step ``s`` being
    every rank's ``s``-th batch (a trailing partial batch is a step too).
    """
    model = get_dispatch(dispatch)
    if model.counts_only:
        return expected_gpu_load(placement, trace.counts())
    src = _layer_ids_src(placement, trace, src)
    t = placement.topology
    out = np.zeros((placement.num_layers, t.ep_size))
    pos = _rank_positions(src)  # [T]
    b = step_tokens or WINDOW_STEP_TOKENS
    rows = pos % b if model.needs_batch_rows else None
    step = pos // b if model.step_load is not None else np.zeros(trace.num_tokens, dtype=np.int64)  # [T]
    S = int(step.max()) + 1 if step.size else 1
    ids = trace.topk_ids
    assert ids is not None  # _layer_ids_src checked has_tokens
    for l in range(placement.num_layers):
        slot_load = _fractional_slot_load(placement, l, ids[:, l, :], src, model, step, S, rows).sum(axis=0)
        out[l] = slot_load.reshape(t.ep_size, t.slots_per_gpu).sum(axis=1)
    return out


def route_tokens(
    placement: Placement,
    topk_ids: np.ndarray,
    src_gpu: np.ndarray,
    dispatch: Dispatch = EVEN,
    token_index: np.ndarray | None = None,
    batch_index: np.ndarray | None = None,
    seed: int = 0,
) -> np.ndarray:
    """Token-level replica choice (what the runtime applies).

    ``even``/``local``: pick ``j`` of token ``t`` takes replica ``(t + j) mod c`` of its tier (``c``
    replicas, ascending slots). The engines' rules follow :func:`placement.dispatch.route_layer`:
    ``vllm-hash`` hashes ``batch_index`` (default: :func:`batch_positions` with :data:`WINDOW_STEP_TOKENS` tokens per batch),
    ``sglang-dynamic`` draws with ``seed``. A model with neither (scored per step only) raises.

    Args:
        topk_ids: int ``[T, L, k]`` logical ids, -1 for none.
        src_gpu: int64 ``[T]`` attention-DP rank of each token.
        token_index: int64 ``[T]`` global token index for the rotation (default ``arange(T)``); a rank
            that holds a slice of the trace passes the slice's global indices.

    Returns:
        int64 ``[T, L, k]`` physical slot ids, -1 where the id was -1.
    """
    model = get_dispatch(dispatch)
    ids = np.asarray(topk_ids)
    if ids.ndim != 3:
        raise ValueError(f"topk_ids must be [tokens, layers, top_k], got shape {ids.shape}")
    T, L, k = ids.shape
    _check_compatible(placement, L, placement.num_logical_experts, "topk_ids")
    if ids.size and not (
        ids.dtype.kind in "iu" and -1 <= ids.min() and ids.max() < placement.num_logical_experts
    ):
        raise ValueError(
            f"topk_ids must be integer ids in [-1, {placement.num_logical_experts}), got {ids.dtype}"
        )
    tok = np.arange(T, dtype=np.int64) if token_index is None else _check_index("token_index", token_index, T)
    batch_index = None if batch_index is None else _check_index("batch_index", batch_index, T)
    src = check_src_ranks(src_gpu, T, placement.topology.ep_size)
    if model.route is not None:
        return _route_engine(placement, ids, src, model, batch_index, seed)
    if not model.runtime:
        raise ValueError(f"dispatch model {model.name!r} has no token-level route; score it with step_par")
    m = placement.topology.gpus_per_node
    src_node = src // m
    rot = tok[:, None] + np.arange(k, dtype=np.int64)[None, :]  # [T, k]
    out = np.full((T, L, k), -1, dtype=np.int64)
    for l in range(L):
        tab = _LayerTables(placement, l)
        tier, own, e = _tier_of(tab, ids[:, l, :], src, model, m)
        remote = tab.l2p[e, rot % tab.cnt[e]]  # [T, k]
        nc = np.maximum(tab.node_cnt[src_node[:, None], e], 1)
        near = tab.node_l2p[src_node[:, None], e, rot % nc]  # [T, k]
        out[:, l, :] = np.select([tier == 0, tier == 1, tier == 2], [own, near, remote], -1)
    return out


def _check_index(name: str, index, T: int) -> np.ndarray:
    """``index`` as int64 ``[T]`` (one whole number >= 0 per token), else a ValueError naming it."""
    arr = np.asarray(index)
    if arr.shape != (T,) or (arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0)):
        raise ValueError(
            f"{name} must be {T} whole numbers >= 0 (one per token), got {arr.dtype} {arr.shape}"
        )
    return arr.astype(np.int64)


def _route_engine(placement, ids, src, model, batch_index, seed) -> np.ndarray:
    """:func:`route_tokens` for the engines' rules: int64 ``[T, L, k]``."""
    if batch_index is None:
        batch_index = batch_positions(src, WINDOW_STEP_TOKENS)
    rng = np.random.default_rng(seed)
    out = np.empty(ids.shape, dtype=np.int64)
    for l in range(ids.shape[1]):
        out[:, l, :] = route_layer(placement, l, ids[:, l, :], src, model, np.asarray(batch_index), rng)
    return out


def routed_gpu_tokens(placement: Placement, slots: np.ndarray) -> np.ndarray:
    """Exact tokens per GPU ``[L, G]`` (int64) from :func:`route_tokens` output ``[T, L, k]``."""
    t = placement.topology
    T, L, k = slots.shape
    gpu = np.where(slots >= 0, t.gpu_of_slot[np.maximum(slots, 0)], -1)  # [T, L, k]
    flat = (gpu + 1 + (np.arange(L) * (t.ep_size + 1))[None, :, None]).ravel()
    c = np.bincount(flat, minlength=L * (t.ep_size + 1)).reshape(L, t.ep_size + 1)
    return c[:, 1:].astype(np.int64)


def par(placement: Placement, trace_or_load, dispatch: Dispatch = EVEN) -> float:
    """Mean over layers of max/mean GPU load."""
    return balance_stats(_gpu_load_any(placement, trace_or_load, dispatch))["par"]


def balancedness(placement: Placement, trace_or_load, dispatch: Dispatch = EVEN) -> float:
    return balance_stats(_gpu_load_any(placement, trace_or_load, dispatch))["balancedness"]


def imbalance_ratio(placement: Placement, trace_or_load, dispatch: Dispatch = EVEN) -> float:
    return balance_stats(_gpu_load_any(placement, trace_or_load, dispatch))["imbalance_ratio"]


def _gpu_load_any(placement, trace_or_load, dispatch):
    _check_types(placement, what="")
    require_data(trace_or_load, "the trace" if isinstance(trace_or_load, RoutingTrace) else "the load")
    if isinstance(trace_or_load, RoutingTrace):
        return trace_gpu_load(placement, trace_or_load, dispatch)
    model = get_dispatch(dispatch)
    if not model.counts_only:
        raise ValueError(f"dispatch model {model.name!r} needs a per-token trace, not a load matrix")
    return expected_gpu_load(placement, trace_or_load)


def step_par(
    placement: Placement,
    trace: RoutingTrace,
    step_tokens: int | None = None,
    dispatch: Dispatch = EVEN,
    phase: str = DEFAULT_PHASE,
    *,
    seed: int = 0,
    max_steps: int | None = None,
) -> dict:
    """Per-step balance on the steps of ``phase`` (:func:`placement.steps.make_steps`): ``decode``
    (continuous batching, steady state; the default), ``prefill`` (chunks of ``step_tokens``
    consecutive tokens per rank), or the trace's own recorded batches (``engine``).

    ``step_tokens``: tokens per rank per step (None: the phase's default,
    :data:`placement.steps.DEFAULT_STEP_TOKENS`). Each token's rank and batch row are the step's, so
    models that depend on them (``local``, ``vllm-hash``) see the step's ranks and rows.

    Returns:
        dict with ``step_par`` (mean over steps and layers), ``step_par_worst_layer`` (layer whose
        mean over steps is worst), ``step_par_per_layer``, ``num_steps``, ``step_tokens``, ``phase``
        (the phase the steps were built for) and ``notes`` (every assumption the steps made).
    """
    model = get_dispatch(dispatch)
    if not trace.has_tokens:
        raise ValueError("step_par needs a per-token trace (topk_ids)")
    _check_compatible(placement, trace.num_layers, trace.num_logical_experts, "the trace")
    require_data(trace, "the trace")
    steps = make_steps(trace, placement.topology.ep_size, phase, step_tokens, seed=seed, max_steps=max_steps)
    G, L, S = placement.topology.ep_size, placement.num_layers, max(steps.num_steps, 1)
    assert trace.topk_ids is not None
    ids = trace.topk_ids[steps.token]  # [N, L, k] the stepped tokens
    par_ls = np.zeros((L, S))
    for l in range(L):
        slot_load = _fractional_slot_load(
            placement, l, ids[:, l, :], steps.rank, model, steps.step, S, steps.row
        )  # [S, P]
        gpu_load = slot_load.reshape(S, G, -1).sum(axis=2)  # [S, G]
        mean = gpu_load.mean(axis=1)
        par_ls[l] = np.where(mean > 0, gpu_load.max(axis=1) / np.where(mean > 0, mean, 1), 1.0)
    per_layer = par_ls.mean(axis=1)
    return {
        "step_par": float(per_layer.mean()),
        "step_par_worst_layer": float(per_layer.max()),
        "step_par_per_layer": per_layer.tolist(),
        "num_steps": int(steps.num_steps),
        "step_tokens": int(steps.step_tokens),
        "phase": steps.phase,
        "notes": list(steps.notes),
    }


def communication(
    placement: Placement,
    trace: RoutingTrace,
    dispatch: Dispatch = EVEN,
    src: np.ndarray | None = None,
    hidden_size: int | None = None,
    dispatch_bytes_per_elem: float = 1.0,
    combine_bytes_per_elem: float = 2.0,
) -> dict:
    """Remote nodes/GPUs each token must reach (node-deduplicated dispatch), mean per token and layer.

    ``bytes_per_token`` (dispatch + combine crossing GPU boundaries, per layer) is added when
    ``hidden_size`` is given: one token's payload (:func:`placement.cost.traffic.payload_bytes`: dispatch
    ``d * dispatch_bytes_per_elem + d/128*4``, FP8 with scales by default, combine
    ``d * combine_bytes_per_elem``, BF16) per remote GPU reached.
    """
    _check_types(placement, trace)
    model = get_dispatch(dispatch)
    _check_bytes_args(hidden_size, dispatch_bytes_per_elem, combine_bytes_per_elem)
    how = "given" if src is not None else source_ranks(trace, placement.topology.ep_size)[1]
    src = _layer_ids_src(placement, trace, src)
    t = placement.topology
    assert trace.topk_ids is not None  # _layer_ids_src checked has_tokens
    slots = route_tokens(placement, trace.topk_ids, src, model)  # [T, L, k]
    valid = slots >= 0
    gpu = np.where(valid, t.gpu_of_slot[np.maximum(slots, 0)], -1)  # [T, L, k]
    node = np.where(valid, gpu // t.gpus_per_node, -1)
    src_node = src // t.gpus_per_node

    def distinct_remote(x, own, count):
        """Distinct values of ``x [T, L, k]`` other than ``own [T]`` and -1, per (token, layer)."""
        x = np.where(x == own[:, None, None], -1, x)
        if count <= 64 and hasattr(np, "bitwise_count"):  # a set as a 64-bit mask, then popcount
            bits = np.where(
                x >= 0, np.left_shift(np.uint64(1), np.maximum(x, 0).astype(np.uint64)), np.uint64(0)
            )
            return np.bitwise_count(np.bitwise_or.reduce(bits, axis=2)).astype(np.int64)
        xs = np.sort(x, axis=2)  # own and padding are -1
        first = xs[:, :, :1] >= 0
        new = (xs[:, :, 1:] != xs[:, :, :-1]) & (xs[:, :, 1:] >= 0)
        return first.sum(axis=2) + new.sum(axis=2)  # [T, L]

    rn = distinct_remote(node, src_node, t.num_nodes)
    rg = distinct_remote(gpu, src, t.ep_size)
    has = valid.any(axis=2)  # tokens with at least one expert in the layer
    denom = max(int(has.sum()), 1)
    out = {
        "remote_nodes_per_token": float(rn[has].sum() / denom),
        "remote_gpus_per_token": float(rg[has].sum() / denom),
        "remote_nodes_per_layer": (rn.sum(axis=0) / np.maximum(has.sum(axis=0), 1)).tolist(),
        "source_ranks": how,
        "policy": model.name,
    }
    if hidden_size is not None:
        out["bytes_per_token"] = float(
            out["remote_gpus_per_token"]
            * token_copy_bytes(hidden_size, dispatch_bytes_per_elem, combine_bytes_per_elem)
        )
    return out


def remote_nodes_per_token(placement: Placement, trace: RoutingTrace, dispatch: Dispatch = EVEN) -> float:
    return communication(placement, trace, dispatch)["remote_nodes_per_token"]


def remote_gpus_per_token(placement: Placement, trace: RoutingTrace, dispatch: Dispatch = EVEN) -> float:
    return communication(placement, trace, dispatch)["remote_gpus_per_token"]


def moved_slots(previous: Placement | np.ndarray, new: Placement | np.ndarray) -> int:
    """Physical slots whose logical expert differs between two placements, over all layers."""
    a = previous.physical_to_logical_map if isinstance(previous, Placement) else np.asarray(previous)
    b = new.physical_to_logical_map if isinstance(new, Placement) else np.asarray(new)
    if a.shape != b.shape:
        raise ValueError(
            f"placements differ in shape {a.shape} vs {b.shape}; moved_slots needs the same layers and slots"
        )
    return int((a != b).sum())


def peak_lower_bound(load: np.ndarray, ep_size: int, num_physical_experts: int) -> np.ndarray:
    """Closed-form lower bound on the peak GPU load per layer, for any placement.

    ``max(mean, largest unsplittable share)``: the mean GPU load ``sum/G``, and the hottest expert's
    share when it gets the most replicas it can (``min(G, 1 + P - E)``).

    Args:
        load: ``[L, E]``. Returns: float64 ``[L]``.
    """
    w = np.asarray(load, dtype=np.float64)
    E = w.shape[-1]
    if int(ep_size) < 1 or int(num_physical_experts) < E:
        raise ValueError(
            f"peak_lower_bound needs ep_size >= 1 and num_physical_experts >= the {E} experts of the load; "
            f"got ep_size={ep_size}, num_physical_experts={num_physical_experts}"
        )
    _check_load_values(w, "load")
    max_rep = max(1, min(ep_size, 1 + num_physical_experts - E))
    return np.maximum(w.sum(axis=-1) / ep_size, w.max(axis=-1) / max_rep)


@dataclass(frozen=True)
class Evaluation:
    """A scored placement on a trace (``dispatch``: the model's name); ``to_dict`` gives the ``--json``
    payload, which names the model under ``policy`` (its documented key, docs/cli.md)."""

    dispatch: str
    balance: dict
    step: dict | None
    comm: dict | None
    lower_bound_par: float

    def to_dict(self) -> dict:
        d = {"policy": self.dispatch, **self.balance, "lower_bound_par": self.lower_bound_par}
        if self.step is not None:
            d.update(self.step)
        if self.comm is not None:
            d.update(self.comm)
        return d


def evaluate(
    placement: Placement,
    trace: RoutingTrace,
    dispatch: Dispatch = EVEN,
    step_tokens: int | None = None,
    hidden_size: int | None = None,
    src: np.ndarray | None = None,
    phase: str | None = None,
) -> Evaluation:
    """All metrics of a placement on a trace under one dispatch model (communication and step metrics
    need per-token ids; communication also a token-level route). ``src``: int64 ``[T]`` source rank of
    every token (default: :func:`source_ranks`). Step metrics (:func:`step_par`) when ``step_tokens``
    or ``phase`` is given (``phase`` default :data:`DEFAULT_PHASE`, ``step_tokens`` the phase's
    default); they name the phase and carry the steps' notes."""
    _check_types(placement, trace)
    model = get_dispatch(dispatch)
    if not model.counts_only and not trace.has_tokens:
        raise ValueError(
            f"dispatch model {model.name!r} needs a per-token trace; this trace has counts only "
            f"(use --dispatch {EVEN.name})"
        )
    load = trace.counts()
    _check_compatible(placement, load.shape[0], load.shape[1], "the trace")
    require_data(trace, "the trace")  # PAR of zero load is 0 / 0: undefined, not 1
    if phase is not None and phase not in PHASES + ("engine",):
        raise ValueError(f"unknown phase {phase!r}; use one of {', '.join(PHASES)}")
    batch = step_tokens if step_tokens is not None else DEFAULT_STEP_TOKENS.get(phase or "")
    gl = trace_gpu_load(placement, trace, model, src, step_tokens=batch)
    bal = balance_stats(gl)
    mean = load.sum(axis=1) / placement.topology.ep_size
    lb = peak_lower_bound(load, placement.topology.ep_size, placement.num_physical_experts)
    lb_par = float(np.mean(np.where(mean > 0, lb / np.where(mean > 0, mean, 1), 1.0)))
    want_steps = (step_tokens is not None or phase is not None) and trace.has_tokens
    step = step_par(placement, trace, step_tokens, model, phase or DEFAULT_PHASE) if want_steps else None
    routed = trace.has_tokens and (model.route is not None or model.runtime)
    comm = communication(placement, trace, model, src, hidden_size=hidden_size) if routed else None
    return Evaluation(model.name, bal, step, comm, lb_par)
