"""The greedy replicate-then-pack balancer (DeepSeek EPLB's published algorithm), re-implemented.

Three steps, batched over layers (pure numpy):

1. Replicate: give one extra replica at a time to the expert with the highest load per replica.
2. Pack: take replicas in order of decreasing per-replica load; put each on the least-loaded GPU
   that still has a free slot (each GPU takes exactly ``S`` replicas).
3. Hierarchical variant (when ``num_groups`` divides over ``num_nodes``): first pack expert groups onto
   nodes the same way, replicate inside each node, then pack each node's replicas onto its GPUs.

``parity=True`` reproduces the published behaviour to the slot, including its hazard of putting two
replicas of one expert on one GPU. By default a GPU that already holds the expert is skipped during
packing and replica counts are capped at the number of GPUs that can hold them, so every result is a
valid placement for the engines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from moe_placement.base.limits import check_whole
from moe_placement.base.options import refuse_unknown_keywords
from placement.metrics import expected_gpu_load, peak_lower_bound
from placement.model import Placement
from placement.topology import Topology
from solver.report import LayerReport, SolveReport

if TYPE_CHECKING:
    from solver.problem import Problem

__all__ = [
    "GreedyOptions",
    "greedy_placement",
    "replicate",
    "balanced_packing",
    "greedy_replica_counts",
    "hierarchical_groups",
    "group_nodes",
    "run_greedy",
]

log = logging.getLogger(__name__)


def replicate(
    weight: np.ndarray, num_slots: int, max_replicas: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hand out ``num_slots`` replicas, one at a time, to the expert with the highest load per replica.

    Args:
        weight: ``[X, n]`` loads.
        num_slots: total replicas per row (``>= n``).
        max_replicas: cap per expert (None: no cap, as published).

    Returns:
        ``(phy2item int64 [X, num_slots], replica_rank int64 [X, num_slots], count int64 [X, n])``;
        slots ``0..n-1`` hold each item once, later slots the extra replicas in the order given.
    """
    w = np.asarray(weight, dtype=np.float64)
    X, n = w.shape
    if num_slots < n:
        raise ValueError(f"{num_slots} slots cannot hold {n} experts")
    if max_replicas is not None and n * max_replicas < num_slots:
        raise ValueError(
            f"{num_slots} slots exceed {n} experts x {max_replicas} replicas each; at most {n * max_replicas} "
            f"slots can hold distinct replicas (fewer redundant slots, or more GPUs)"
        )
    phy = np.tile(np.arange(num_slots, dtype=np.int64), (X, 1))
    rank = np.zeros((X, num_slots), dtype=np.int64)
    cnt = np.ones((X, n), dtype=np.int64)
    rows = np.arange(X)
    for i in range(n, num_slots):
        score = w / cnt
        if max_replicas is not None:
            score = np.where(cnt >= max_replicas, -np.inf, score)
        best = score.argmax(axis=1)  # [X], first index on ties
        phy[:, i] = best
        rank[:, i] = cnt[rows, best]
        cnt[rows, best] += 1
    return phy, rank, cnt


def greedy_replica_counts(weight: np.ndarray, num_slots: int, max_replicas: int | None = None) -> np.ndarray:
    """Replica counts ``[X, n]`` from :func:`replicate` (used as a hint by the exact solvers)."""
    return replicate(weight, num_slots, max_replicas)[2]


def balanced_packing(
    weight: np.ndarray,
    num_packs: int,
    item_key: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Pack ``n`` weighted items into ``num_packs`` packs of exactly ``n / num_packs`` items each.

    Items go in order of decreasing weight to the lightest pack with room. With ``item_key`` (e.g. the
    logical expert of each replica) a pack that already holds an item with the same key is skipped;
    when no pack qualifies the item goes to the lightest pack with room and a swap pass repairs it.

    Args:
        weight: ``[X, n]``; item_key: int ``[X, n]`` or None.

    Returns:
        ``(pack_index int64 [X, n], rank_in_pack int64 [X, n])``.
    """
    w = np.asarray(weight, dtype=np.float64)
    X, n = w.shape
    if n % num_packs:
        raise ValueError(f"{n} items do not split into {num_packs} equal packs")
    cap = n // num_packs
    if cap == 1 and item_key is None:
        return np.tile(np.arange(n, dtype=np.int64), (X, 1)), np.zeros((X, n), dtype=np.int64)
    order = np.argsort(-w, axis=1, kind="stable")  # [X, n] items by decreasing weight
    pack_w = np.zeros((X, num_packs))
    pack_n = np.zeros((X, num_packs), dtype=np.int64)
    pack_index = np.empty((X, n), dtype=np.int64)
    rank_in_pack = np.empty((X, n), dtype=np.int64)
    rows = np.arange(X)
    if item_key is not None:
        keys = np.asarray(item_key, dtype=np.int64)
        nkeys = int(keys.max()) + 1
        holds = np.zeros((X, num_packs, nkeys), dtype=bool)
    for pos in range(n):
        item = order[:, pos]  # [X]
        room = pack_n < cap  # [X, packs]
        if item_key is not None:
            key = keys[rows, item]  # [X]
            ok = room & ~holds[rows, :, key]
            ok = np.where(ok.any(axis=1, keepdims=True), ok, room)  # repaired below
        else:
            ok = room
        pack = np.where(ok, pack_w, np.inf).argmin(axis=1)  # [X], first lightest on ties
        pack_index[rows, item] = pack
        rank_in_pack[rows, item] = pack_n[rows, pack]
        pack_w[rows, pack] += w[rows, item]
        pack_n[rows, pack] += 1
        if item_key is not None:
            holds[rows, pack, key] = True
    if item_key is not None:
        _repair_colocation(w, keys, pack_index, rank_in_pack, num_packs)
    return pack_index, rank_in_pack


def _repair_colocation(w, keys, pack_index, rank_in_pack, num_packs) -> None:
    """Swap items so that no pack holds two items with the same key (in place; rare path)."""
    X, n = w.shape
    pair = np.sort(pack_index * (int(keys.max()) + 1) + keys, axis=1)  # [X, n] (pack, key) codes
    clashing = np.flatnonzero((pair[:, 1:] == pair[:, :-1]).any(axis=1))  # rows needing a repair
    for x in clashing:
        for _ in range(n * n):
            members = [np.flatnonzero(pack_index[x] == p) for p in range(num_packs)]
            bad = None
            for p, mem in enumerate(members):
                k = keys[x, mem]
                uniq, cnt = np.unique(k, return_counts=True)
                if (cnt > 1).any():
                    dup_key = uniq[cnt > 1][0]
                    bad = (p, mem[keys[x, mem] == dup_key][0], dup_key)
                    break
            if bad is None:
                break
            p, item, key = bad
            best = None
            for q, mem in enumerate(members):
                if q == p or (keys[x, mem] == key).any():
                    continue
                pkeys = set(keys[x, members[p]].tolist())
                for other in mem:
                    if keys[x, other] in pkeys:
                        continue
                    cost = abs(w[x, other] - w[x, item])
                    if best is None or cost < best[0]:
                        best = (cost, q, other)
            if best is None:
                raise ValueError(
                    f"cannot place replicas without putting two of expert {key} on one GPU; "
                    f"use fewer redundant experts or more GPUs"
                )
            _, q, other = best
            pack_index[x, item], pack_index[x, other] = q, p
            rank_in_pack[x, item], rank_in_pack[x, other] = rank_in_pack[x, other], rank_in_pack[x, item]


def hierarchical_groups(num_groups: int | None, num_experts: int, num_nodes: int) -> int | None:
    """``num_groups`` when a call is hierarchical (the groups divide the experts and divide over more
    than one node: every group then lives on one node, as the engines' hierarchical policy keeps it),
    else None."""
    if not num_groups or num_nodes <= 1 or num_experts % num_groups or num_groups % num_nodes:
        return None
    return int(num_groups)


def group_nodes(phy2log: np.ndarray, num_experts: int, num_groups: int, topology: Topology) -> np.ndarray:
    """The node each expert group sits on, int64 ``[L, num_groups]``: ``-1`` where a group's replicas
    span more than one node (``num_nodes``: a group on no slot). Groups are contiguous id ranges
    (``num_experts / num_groups`` experts each).

    Args:
        phy2log: int ``[L, P]`` map; topology: its ``P`` slots over ``N`` nodes.
    """
    p2l = np.asarray(phy2log, dtype=np.int64)
    L, P = p2l.shape
    size = max(1, num_experts // num_groups)
    node = np.arange(P) // (P // topology.num_nodes)  # [P] node of each slot
    grp = p2l // size  # [L, P]
    low = np.full((L, num_groups), topology.num_nodes, dtype=np.int64)
    high = np.full((L, num_groups), -1, dtype=np.int64)
    rows = np.repeat(np.arange(L), P)
    np.minimum.at(low, (rows, grp.ravel()), np.tile(node, L))
    np.maximum.at(high, (rows, grp.ravel()), np.tile(node, L))
    return np.where(low == high, low, -1)


# The cap-aware recount: rows whose distinct packing peaks more than RECOUNT_TRIGGER (relative) above
# the co-locating packing of the same counts (the engines' own); count changes tried per round (all
# of them on small rows) and rounds per row. Measured at DeepSeek-V3 shape (58 x 256, 288 slots on
# 32 GPUs / 4 nodes, 8 groups; gamma loads) on the 2-core dev machine: 0.04 s -> 1.4 s per call with
# every row whose cap costs anything recounted (35 of 232 rows, peaks summed 0.04% lower); the
# trigger keeps the rows where it costs 0.25% or more (the engines' tests: 6%).
RECOUNT_TRIGGER = 0.0025
RECOUNT_PAIRS = 36
RECOUNT_ROUNDS = 8


def _packed_peaks(w: np.ndarray, cnts: np.ndarray, num_packs: int) -> np.ndarray:
    """Peak pack loads ``[K]`` of ``K`` rows of replicas (``w [K, n]`` loads, ``cnts [K, n]`` replicas
    each, split evenly; every row the same total), each packed by :func:`balanced_packing` with no
    two replicas of one item in a pack; ``inf`` where that packing fails."""
    K, n = cnts.shape
    items = np.repeat(np.tile(np.arange(n), K), cnts.ravel()).reshape(K, -1)  # [K, slots]
    share = np.take_along_axis(w / cnts, items, axis=1)  # [K, slots]
    try:
        pack, _ = balanced_packing(share, num_packs, item_key=items)
    except ValueError:  # one row's swap repair failed: score the rows one by one
        if len(cnts) == 1:
            return np.array([np.inf])
        return np.concatenate(
            [_packed_peaks(w[k : k + 1], cnts[k : k + 1], num_packs) for k in range(len(cnts))]
        )
    loads = np.zeros((len(cnts), num_packs))
    np.add.at(loads, (np.repeat(np.arange(len(cnts)), items.shape[1]), pack.ravel()), share.ravel())
    return loads.max(axis=1)


def _count_moves(w: np.ndarray, cnt: np.ndarray, cap: int) -> np.ndarray:
    """Candidate counts ``[K, n]``: ``cnt`` with one replica moved from an expert with 2+ replicas to
    one under ``cap``; all such moves when few, else the cheapest replicas to give up against the
    heaviest experts to split further (:data:`RECOUNT_PAIRS`)."""
    donors = np.flatnonzero(cnt >= 2)
    takers = np.flatnonzero(cnt < cap)
    if donors.size * takers.size > RECOUNT_PAIRS:
        k = max(1, int(np.sqrt(RECOUNT_PAIRS)))
        donors = donors[np.argsort(w[donors] / (cnt[donors] - 1), kind="stable")[:k]]
        takers = takers[np.argsort(-w[takers] / cnt[takers], kind="stable")[:k]]
    a, b = np.repeat(donors, takers.size), np.tile(takers, donors.size)
    a, b = a[a != b], b[a != b]
    cands = np.tile(cnt, (a.size, 1))
    rows = np.arange(a.size)
    cands[rows, a] -= 1
    cands[rows, b] += 1
    return cands


def _recount_rows(w: np.ndarray, cnt: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Replica counts ``[R, n]`` and their distinct packing's peaks ``[R]`` for rows (``w [R, n]``,
    counts ``cnt [R, n]``) whose counts pack worse with distinct replicas per pack than without:
    single-replica moves while one lowers a row's peak (at most ``num_packs`` replicas an item;
    :data:`RECOUNT_ROUNDS` rounds), every row's candidates packed in one batch per round."""
    best, peak = cnt.copy(), _packed_peaks(w, cnt, num_packs)
    active = list(range(len(w)))
    for _ in range(RECOUNT_ROUNDS):
        cands = {r: _count_moves(w[r], best[r], num_packs) for r in active}
        cands = {r: c for r, c in cands.items() if len(c)}
        if not cands:
            break
        owner = np.concatenate([np.full(len(c), r) for r, c in cands.items()])
        peaks = _packed_peaks(w[owner], np.concatenate(list(cands.values())), num_packs)
        active, start = [], 0
        for r, c in cands.items():
            i = int(np.argmin(peaks[start : start + len(c)]))  # first best on ties: deterministic
            if peaks[start + i] < peak[r] * (1 - 1e-12):
                best[r], peak[r] = c[i], peaks[start + i]
                active.append(r)
            start += len(c)
        if not active:
            break
    return best, peak


def _recount_under_cap(
    w: np.ndarray, phy: np.ndarray, cnt: np.ndarray, share: np.ndarray, pack: np.ndarray, num_packs: int
) -> bool:
    """Counts re-chosen knowing that no pack holds an item twice, in place; True when a row changed.

    Rows (``w [X, n]`` loads, ``phy [X, slots]`` slot -> item, ``cnt [X, n]`` counts, ``share [X, slots]``
    per-replica loads, ``pack [X, slots]`` their distinct packing) where that packing peaks more than
    :data:`RECOUNT_TRIGGER` above the packing that may co-locate (the cap costs balance) take the
    counts of :func:`_recount_rows` when they peak lower; every other row stays as it is, slot for slot.
    """
    X, slots = share.shape
    if num_packs <= 1 or slots <= w.shape[1]:  # one GPU, or no redundant slot: nothing to choose
        return False
    rows = np.repeat(np.arange(X), slots)
    capped = np.zeros((X, num_packs))
    np.add.at(capped, (rows, pack.ravel()), share.ravel())
    free_pack, _ = balanced_packing(share, num_packs)  # [X, slots] co-location allowed
    free = np.zeros((X, num_packs))
    np.add.at(free, (rows, free_pack.ravel()), share.ravel())
    todo = np.flatnonzero(capped.max(axis=1) > free.max(axis=1) * (1 + RECOUNT_TRIGGER))
    if not todo.size:
        return False
    new, peak = _recount_rows(w[todo], cnt[todo], num_packs)
    better = peak < capped[todo].max(axis=1) * (1 - 1e-12)
    n = w.shape[1]
    for x, counts in zip(todo[better], new[better]):
        cnt[x] = counts
        phy[x] = np.concatenate([np.arange(n), np.repeat(np.arange(n), counts - 1)])
    return bool(better.any())


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def _hierarchical(weight: np.ndarray, P: int, num_groups: int, num_nodes: int, num_gpus: int, parity: bool):
    """Returns phy2log ``[L, P]``. With ``num_groups = num_nodes = 1`` this is the global mode."""
    L, E = weight.shape
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    slots_per_gpu = P // num_gpus
    gpus_per_node = num_gpus // num_nodes
    e_node = E // num_nodes  # logical experts per node
    p_node = P // num_nodes  # slots per node

    # Step 1: groups -> nodes (balanced by group load).
    group_w = weight.reshape(L, num_groups, group_size).sum(axis=2)  # [L, groups]
    g_pack, g_rank = balanced_packing(group_w, num_nodes)  # [L, groups]
    # log2mlog: logical expert -> position in node-major order ("mlog")
    base = (g_pack * groups_per_node + g_rank) * group_size  # [L, groups]
    log2mlog = (base[:, :, None] + np.arange(group_size)).reshape(L, E)  # [L, E]
    mlog2log = _inverse(log2mlog)  # [L, E]

    # Step 2: replicate inside each node: rows become (layer, node) pairs.
    w_mlog = np.take_along_axis(weight, mlog2log, axis=1).reshape(L * num_nodes, e_node)  # [L*N, E/N]
    cap = None if parity else gpus_per_node
    phy2mlog, _, mlogcnt = replicate(w_mlog, p_node, cap)  # [L*N, P/N], [L*N, E/N]

    # Step 3: replicas -> GPUs inside each node (without parity: counts re-chosen where the
    # no-co-location cap costs balance).
    per_replica = np.take_along_axis(w_mlog / mlogcnt, phy2mlog, axis=1)  # [L*N, P/N]
    key = None if parity else phy2mlog
    pack, rank = balanced_packing(per_replica, gpus_per_node, item_key=key)
    if not parity and _recount_under_cap(w_mlog, phy2mlog, mlogcnt, per_replica, pack, gpus_per_node):
        per_replica = np.take_along_axis(w_mlog / mlogcnt, phy2mlog, axis=1)
        pack, rank = balanced_packing(per_replica, gpus_per_node, item_key=phy2mlog)
    phy2pphy = pack * slots_per_gpu + rank  # replica -> slot within the node
    pphy2phy = _inverse(phy2pphy)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)  # [L*N, P/N]
    pphy2mlog = (
        pphy2mlog.reshape(L, num_nodes, p_node) + (np.arange(num_nodes) * e_node)[None, :, None]
    ).reshape(L, P)
    return np.take_along_axis(mlog2log, pphy2mlog, axis=1)  # [L, P]


def greedy_placement(
    load: np.ndarray,
    topology: Topology,
    num_groups: int | None = None,
    *,
    mode: Literal["auto", "hierarchical", "global"] = "auto",
    parity: bool = False,
    layer_ids: Sequence[int] | None = None,
) -> tuple[Placement, SolveReport]:
    """The greedy baseline: check the load -> choose the mode and place -> report peak vs bound.

    Args:
        load: ``[L, E]`` tokens per logical expert (any non-negative numbers).
        topology: ``P`` slots over ``G`` GPUs over ``N`` nodes.
        num_groups: expert groups (DeepSeek's group-limited routing); the hierarchical mode is used
            when it divides over the nodes (``mode="auto"``), as the engines do.
        mode: force ``hierarchical`` or ``global``.
        parity: reproduce the published algorithm exactly (may co-locate replicas of one expert).

    Returns:
        (Placement, SolveReport) with the mode used in the report's ``params["mode"]`` (the placement's
        provenance keeps it under its former key ``policy``, so placement files stay byte-identical).
    """
    t0 = time.perf_counter()
    if not isinstance(topology, Topology):
        raise ValueError(f"topology must be a placement.topology.Topology, got {type(topology).__name__}")
    if num_groups is not None:
        check_whole("num_groups", num_groups, 1, fix="the model's expert groups, or None for none")
    w = _checked_load(load, topology, parity)
    used, phy2log, notes = _place_by_mode(w, topology, num_groups, mode, parity)
    placement = Placement(
        phy2log,
        w.shape[1],
        topology,
        tuple(layer_ids or ()),
        {"solver": "greedy", "policy": used, "parity": parity, "num_groups": num_groups},  # files: former key
        allow_colocated_replicas=parity,
    )
    wall = time.perf_counter() - t0
    report = _greedy_report(placement, w, wall, used, parity, num_groups, notes)
    log.debug("greedy: mode=%s %d layers in %.3fs", used, w.shape[0], wall)
    return placement, report


def _checked_load(load: np.ndarray, topology: Topology, parity: bool) -> np.ndarray:
    """``load`` as float64 ``[L, E]``, or a ValueError naming what does not fit the topology."""
    w = np.asarray(load, dtype=np.float64)
    if w.ndim != 2 or 0 in w.shape:
        raise ValueError(
            f"load must be [num_layers, num_logical_experts] with both >= 1, got shape {w.shape}"
        )
    if not np.all(np.isfinite(w)) or (w.size and w.min() < 0):
        raise ValueError("load must be finite and >= 0 (found NaN, inf or a negative count)")
    E = w.shape[1]
    P, G = topology.num_physical_experts, topology.ep_size
    if E > P:
        raise ValueError(f"{E} logical experts do not fit in {P} physical slots; add {E - P} or more slots")
    if not parity and topology.slots_per_gpu > E:
        raise ValueError(
            f"{topology.slots_per_gpu} slots per GPU exceed the {E} experts: some GPU would need two replicas "
            f"of one expert; use at most {E * G - E} redundant experts"
        )
    return w


def _place_by_mode(
    w: np.ndarray, topology: Topology, groups: int | None, mode: str, parity: bool
) -> tuple[str, np.ndarray, list[str]]:
    """``(mode used, phy2log int64 [L, P], notes)``: hierarchical when asked for or when ``auto`` finds
    the groups dividing over the nodes, else global (one group on one node)."""
    E = w.shape[1]
    P, G, N = topology.num_physical_experts, topology.ep_size, topology.num_nodes
    notes: list[str] = []
    if mode == "hierarchical" or (mode == "auto" and groups and groups % N == 0 and E % groups == 0):
        if not groups or E % groups or groups % N:
            raise ValueError(
                f"the hierarchical mode needs num_groups dividing the {E} experts and divisible by "
                f"num_nodes={N}, got num_groups={groups}"
            )
        if not parity and (P // N) > (E // N) * topology.gpus_per_node:
            raise ValueError(
                f"{P // N} slots per node exceed what {E // N} experts x {topology.gpus_per_node} GPUs can hold"
            )
        return "hierarchical", _hierarchical(w, P, groups, N, G, parity), notes
    if mode in ("auto", "global"):
        if mode == "auto" and groups:
            notes.append(f"num_groups={groups} does not divide over num_nodes={N}: global mode used")
        return "global", _hierarchical(w, P, 1, 1, G, parity), notes
    raise ValueError(f"unknown greedy mode {mode!r}; use auto, hierarchical or global")


def _greedy_report(
    placement: Placement,
    w: np.ndarray,
    wall: float,
    used: str,
    parity: bool,
    groups: int | None,
    notes: list[str],
) -> SolveReport:
    """Per layer: peak GPU load ``[L]`` (even split over replicas) against the closed-form bound."""
    G, P = placement.topology.ep_size, placement.topology.num_physical_experts
    peak = expected_gpu_load(placement, w).max(axis=1)  # [L]
    bound = peak_lower_bound(w, G, P)  # [L]
    mean = w.sum(axis=1) / G  # [L]
    layers = tuple(
        LayerReport(
            layer_id=placement.layer_ids[l],
            status="heuristic",
            objective=float(peak[l]),
            bound=float(bound[l]),
            mean_load=float(mean[l]),
        )
        for l in range(w.shape[0])
    )
    return SolveReport(
        solver="greedy",
        layers=layers,
        wall_time_s=wall,
        params={"mode": used, "parity": parity, "num_groups": groups},
        notes=tuple(notes),
    )


@refuse_unknown_keywords
@dataclass(frozen=True)
class GreedyOptions:
    """How the greedy baseline runs: ``mode`` (``auto``: hierarchical when the expert groups divide
    over the nodes, else global) and ``parity`` (reproduce the published slots exactly)."""

    mode: Literal["auto", "hierarchical", "global"] = "auto"
    parity: bool = False


def run_greedy(problem: Problem, options: GreedyOptions) -> tuple[Placement, SolveReport]:
    """The registry's entry (:mod:`solver.api`): :func:`greedy_placement` on ``problem.load``."""
    return greedy_placement(
        problem.load,
        problem.topology,
        problem.num_groups,
        mode=options.mode,
        parity=options.parity,
        layer_ids=problem.layer_id_list,
    )
