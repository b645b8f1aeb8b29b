"""Locality by full replication: hot experts on every node, the rest partitioned over nodes.

Shapes: E logical experts, N nodes, m GPUs per node, S slots per GPU, T tokens, k top-k, W windows.

Under the ``local`` dispatch model an expert with a replica on every node is always served on
the token's own node, and its load splits over nodes exactly as the tokens' sources do (round-robin
prompts: evenly). So the ``h`` hottest experts get one replica per node ("everywhere" experts); they leave
cross-node traffic and the node-balance problem. Every other expert lives on exactly one node, with
``r_e >= 1`` replicas there on distinct GPUs (extra replicas on the same node cost no locality and help
the GPU packing). Then, per layer (:func:`solve_replicated_layer`):

1. Everywhere set: the ``h`` hottest experts (:func:`replicated_counts`) to start; after a first
   partition, role trades swap an everywhere expert that fires inside one cluster for a "hub" that
   fires with many, where that cuts fitted remote nodes (:func:`choose_everywhere`).
2. Node partition of the single-node experts (:func:`partition_nodes`): at most the node's free slots
   (and, with ``single_margin``, about the same number of experts per node so every node keeps spare
   slots for splitting), node loads within ``(1 + slack)`` of the mean on the fit total and within
   ``(1 + window_slack)`` on every fit window, minimising the fitted remote nodes per token (exact:
   distinct nodes other than the own one among a token's single-node picks), by a greedy affinity start,
   token-level moves/swaps scored all at once (best improvement), then iterated local search (random
   swaps, descend again, keep improvements) for the rest of the time budget.
3. Split and pack each node exactly: how many replicas each of the node's experts gets (spare slots)
   and on which GPUs, minimising the worst GPU/mean ratio over the fit total and the windows. With two
   slots per GPU and one view, :func:`pair_pack` scores every split with the optimal pairing (heaviest
   replica with the lightest), on loads with margins for what unseen traffic changes (everywhere
   replicas: their node's token share; single-node experts: their expected drift); else
   :func:`pack_node_exact` (CP-SAT hinted with LPT).
4. Repair (:func:`gpu_repair`): slot swaps inside nodes, re-splits, and swaps of single-replica experts
   across nodes until no GPU is above its cap on any view (greedy's peak on that view x (1 + gpu_slack)),
   each step the cheapest in fitted remote nodes.

Every expert ends on one node or on all nodes, so the fitted remote nodes are exact under the runtime's
deterministic replica choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from placement.topology import Topology
from solver.budget import Budget, as_budget
from solver.locality.nodes import PartitionSpec, partition_nodes
from solver.locality.pack import pack_node_exact, pack_node_gpus, pack_peak, pair_pack
from solver.locality.reach import FitViews, NodeReach, remote_nodes_fit
from solver.locality.repair import gpu_repair

__all__ = [
    "LayerSearch",
    "choose_everywhere",
    "everywhere_trades",
    "replicated_counts",
    "solve_replicated_layer",
    "window_node_loads",
]


def replicated_counts(
    load: np.ndarray, num_slots: int, num_nodes: int, gpus_per_node: int, num_everywhere: int
):
    """Everywhere set and per-expert replica counts of one layer.

    Args:
        load: float64 ``[E]`` fitted picks per expert.
        num_slots: ``P``; num_everywhere: ``h`` (clipped so every other expert keeps a slot).

    Returns:
        ``(everywhere bool [E], r int64 [E])``: ``r_e`` replicas of a single-node expert (on its node);
        ``N`` (one per node) for everywhere experts.
    """
    w = np.asarray(load, dtype=np.float64)
    E, N, m = w.size, int(num_nodes), int(gpus_per_node)
    h_max = (num_slots - E) // max(N - 1, 1) if N > 1 else E
    h = int(min(max(int(num_everywhere), 0), h_max, E))
    order = np.argsort(-w, kind="stable")
    every = np.zeros(E, dtype=bool)
    every[order[:h]] = True
    r = np.where(every, N, 1).astype(np.int64)
    spare = num_slots - int(r.sum())
    while spare > 0:
        score = np.where(~every & (r < m), w / r, -np.inf)
        if not np.isfinite(score.max()):
            # no single-node expert can take one more (all at m): widen an everywhere expert on a node
            raise ValueError(
                f"{spare} spare slots left with every single-node expert at {m} replicas; "
                f"raise num_everywhere"
            )
        r[int(score.argmax())] += 1
        spare -= 1
    return every, r


def window_node_loads(
    node_of: np.ndarray, win_load: np.ndarray, win_src: np.ndarray, every: np.ndarray
) -> np.ndarray:
    """Node loads per window ``[W, N]`` under ``local``.

    Args:
        node_of: int64 ``[E]`` node of each single-node expert (ignored for everywhere experts).
        win_load: float64 ``[W, E]`` picks per window; win_src: float64 ``[W, N, E]`` picks per window by
            tokens from each node; every: bool ``[E]``.
    """
    _, N, E = win_src.shape
    out = (win_src * every[None, None, :]).sum(axis=2)  # everywhere experts: served where the token is
    single = np.flatnonzero(~every)
    onehot = np.zeros((E, N))
    onehot[single, node_of[single]] = 1.0
    return out + win_load @ onehot


def everywhere_trades(
    ids: np.ndarray,
    src_node: np.ndarray,
    every: np.ndarray,
    node_of: np.ndarray,
    num_nodes: int,
    max_single_load: float = np.inf,
) -> list[tuple[float, int, int]]:
    """Candidate role trades ``(gain, x, e)``, best first: everywhere expert ``x`` becomes a single-node
    expert on the node of single-node expert ``e``, which becomes everywhere.

    ``gain`` is the exact cut in remote nodes per token of the trade alone: the tokens for which ``e`` is
    the only pick on its node (not their own) stop reaching it, unless they also pick ``x``, which takes
    ``e``'s place; the tokens of ``x`` that do not reach that node yet (and are not from it) start to.
    The trade also moves load, so :func:`choose_everywhere` re-partitions before keeping it. Only
    positive gains, and only ``x`` with at most ``max_single_load`` picks (an expert heavier than a GPU's
    share would need splitting on its node, which spends the spare slots the packing needs).

    Args:
        ids: int64 ``[T, k]`` picks (-1 none); src_node: int64 ``[T]``; every: bool ``[E]``;
            node_of: int64 ``[E]`` (node of each single-node expert).
    """
    reach = NodeReach(ids, src_node, every, node_of, num_nodes)
    X, T = reach.X, ids.shape[0]
    single = np.flatnonzero(~every)
    z0, z1 = reach.reach()
    only = X[:, single] * z1[:, node_of[single]]  # [T, n_single] e is the token's only pick on e's node
    save = only.sum(axis=0)  # [n_single] tokens that stop reaching e's node
    xs = np.flatnonzero(every)
    add = X[:, xs].T @ z0  # [h, N] tokens of x that would newly reach node n
    both = X[:, xs].T @ only  # [h, n_single] tokens picking x and e: x takes e's place, no change
    gain = (save[None, :] - both - add[:, node_of[single]]) / max(T, 1)  # [h, n_single]
    gain[X[:, xs].sum(axis=0) > max_single_load] = 0.0
    out = [(float(gain[i, j]), int(xs[i]), int(single[j])) for i, j in zip(*np.nonzero(gain > 0))]
    return sorted(out, reverse=True)


def choose_everywhere(
    ids: np.ndarray,
    src_node: np.ndarray,
    every: np.ndarray,
    part: PartitionSpec,
    time_limit: float | Budget,
    tries: int = 5,
    max_single_load: float = np.inf,
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Node partition with the everywhere set chosen by the remote nodes it saves, not by load alone.

    Start: :func:`partition_nodes` with ``every`` (normally the hottest ``h``) for 40% of the time. Then,
    while time lasts, the best role trades of :func:`everywhere_trades` are tried (``tries`` per round):
    the trade, a descent from the current layout, and the result kept when its balance violation is no
    larger and its fitted remote nodes per token (all tokens) fewer. A hot expert that fires inside one
    cluster costs little as a single-node expert; an expert that fires with every cluster ("hub") saves
    many remote nodes everywhere. The rest of the time polishes the kept layout (kicks). Never worse
    than the start on (violation, remote nodes).

    ``max_single_load``: see :func:`everywhere_trades`. :func:`solve_replicated_layer` sets no cap: with
    two slots per GPU the everywhere experts are often all heavier than a GPU's mean load (DeepSeek-V2-Lite
    at ep64/8 nodes), and a cap at that load would block every trade. ``benchmarks/locality.py`` measures
    what the trades give.

    Args:
        ids: int64 ``[T, k]``; src_node: int64 ``[T]``; every: bool ``[E]``; part: the partition's views
            and settings (:class:`~solver.locality.nodes.PartitionSpec`).

    ``time_limit``: seconds, or a :class:`solver.budget.Budget` (a fixed number of steps: reproducible).

    Returns:
        ``(every bool [E], node_of int64 [E], info)``; info adds ``role_trades`` (kept) and ``role_tries``.
    """
    budget = as_budget(time_limit)
    start = budget.part(0.4)
    best = _partition_scored(ids, src_node, part, every, start)  # (every, node_of, info, remote nodes)
    budget.tick(start.used)
    best, kept, tried = _trade_roles(ids, src_node, part, best, budget, tries, max_single_load)
    every, node_of, info, rn = best
    polish = budget.rest()
    if (polish.work or 0) > 0 or polish.seconds > 0.05:
        _, no2, inf2, rn2 = _partition_scored(ids, src_node, part, every, polish, init=node_of)
        if inf2["violation"] <= info["violation"] + 1e-12 and rn2 <= rn:
            node_of, info, rn = no2, inf2, rn2
    info = {**info, "role_trades": kept, "role_tries": tried}
    return every, node_of, info


def _partition_scored(
    ids: np.ndarray,
    src_node: np.ndarray,
    part: PartitionSpec,
    every: np.ndarray,
    budget: Budget,
    init: np.ndarray | None = None,
    perturb: bool = True,
) -> tuple[np.ndarray, np.ndarray, dict, float]:
    """:func:`partition_nodes` with everywhere set ``every`` bool ``[E]`` (one replica per single-node
    expert): ``(every, node_of int64 [E], info, fitted remote nodes per token over all tokens)``."""
    N = int(part.num_nodes)
    r = np.where(every, N, 1).astype(np.int64)
    no, inf = partition_nodes(ids, src_node, every, r, part, budget, init=init, perturb=perturb)
    return every, no, inf, float(remote_nodes_fit(no, every, ids, src_node, N).mean())


def _trade_roles(
    ids: np.ndarray,
    src_node: np.ndarray,
    part: PartitionSpec,
    best: tuple,
    budget: Budget,
    tries: int,
    max_single_load: float,
) -> tuple[tuple, int, int]:
    """Rounds of role trades from ``best = (every, node_of, info, remote nodes)`` while more than 5% of
    ``budget`` is left: each round tries the ``tries`` best trades and keeps the first that is no less
    balanced and has fewer remote nodes; stops after a round keeps none.

    Returns:
        ``(best, kept, tried)``.
    """
    N = int(part.num_nodes)
    kept = tried = 0
    while budget.left_fraction() > 0.05:
        every, node_of, info, rn = best
        better = False
        for _, x, e in everywhere_trades(ids, src_node, every, node_of, N, max_single_load)[:tries]:
            if budget.left_fraction() <= 0.05:
                break
            ev2 = every.copy()
            ev2[x], ev2[e] = False, True
            init = node_of.copy()
            init[x], init[e] = node_of[e], -1
            tried += 1
            trial = budget.part(min(0.1, budget.left_fraction()))
            cand = _partition_scored(ids, src_node, part, ev2, trial, init=init, perturb=False)
            budget.tick(max(trial.used, 1))
            if cand[2]["violation"] <= info["violation"] + 1e-12 and cand[3] < rn - 1e-12:
                best = cand
                kept += 1
                better = True
                break
        if not better:
            break
    return best, kept, tried


@dataclass(frozen=True)
class LayerSearch:
    """How :func:`solve_replicated_layer` searches one layer.

    Attributes:
        num_everywhere: ``h``, experts with a replica on every node (the hottest to start).
        slack: node loads within ``(1 + slack) x`` the mean on the fit total.
        time_limit: the node partition's budget (seconds, or a :class:`~solver.budget.Budget` of steps).
        seed: seeds the partition, the packing and the repair.
        window_weight, window_slack, single_margin: as in :class:`~solver.locality.nodes.PartitionSpec`.
        pack_time: budget of packing one node; exact_pack: CP-SAT packs each node (else LPT or pairs).
        gpu_cap: GPU peak cap (absolute picks, one per view) for the repair; None: no repair.
        repair_time: the repair's budget.
        role_swaps: start from the ``h`` hottest experts everywhere, then trade roles where that cuts
            fitted remote nodes (:func:`choose_everywhere`).
        share_margin: pairing margin of everywhere replicas (see :func:`_pack_nodes`).
    """

    num_everywhere: int
    slack: float
    time_limit: float | Budget
    seed: int = 0
    window_weight: float = 1.0
    pack_time: float | Budget = 0.0
    window_slack: float | None = None
    gpu_cap: float | np.ndarray | None = None
    repair_time: float | Budget = 1.0
    exact_pack: bool = True
    single_margin: int | None = None
    role_swaps: bool = True
    share_margin: float = 0.0


def solve_replicated_layer(
    ids: np.ndarray,
    src_node: np.ndarray,
    win: np.ndarray,
    num_windows: int,
    num_experts: int,
    topology: Topology,
    search: LayerSearch,
    drift: np.ndarray | None = None,
) -> tuple[np.ndarray, dict]:
    """One layer: int64 ``[P]`` physical-to-logical row and info.

    Steps: picks per window and source node -> everywhere set and node partition
    (:func:`choose_everywhere`, or :func:`partition_nodes` alone) -> split and pack every node
    (:func:`_pack_nodes`) -> GPU-peak repair against ``search.gpu_cap`` (:func:`gpu_repair`).

    Args:
        ids: int64 ``[T, k]`` fit picks; src_node: int64 ``[T]``; win: int64 ``[T]`` window of each token
            (``0..num_windows-1``); topology: :class:`placement.topology.Topology`; search: the layer's
            budgets and settings (:class:`LayerSearch`); drift: float64 ``[E]`` (picks, optional), the
            pairing margin of single-node experts (see :func:`_pack_nodes`).
    """
    E, W, o = int(num_experts), int(num_windows), search
    N, P = topology.num_nodes, topology.num_physical_experts
    win_src = _window_picks(ids, src_node, win, W, N, E)  # [W, N, E]
    win_load = win_src.sum(axis=1)  # [W, E]
    load = win_load.sum(axis=0)  # [E]
    every, _ = replicated_counts(load, P, N, topology.gpus_per_node, o.num_everywhere)
    part = PartitionSpec(
        win_load,
        win_src,
        N,
        P // N,
        o.slack,
        seed=o.seed,
        window_weight=o.window_weight,
        window_slack=o.window_slack,
        single_margin=o.single_margin,
    )
    every, node_of, info = _node_partition(ids, src_node, every, part, o.time_limit, o.role_swaps)
    src_tot = win_src.sum(axis=0)  # [N, E]
    views = FitViews(
        np.concatenate([load[None], win_load], axis=0) if W > 1 else load[None],  # [V, E]
        np.concatenate([src_tot[None], win_src], axis=0) if W > 1 else src_tot[None],  # [V, N, E]
        ids,
        src_node,
    )
    row, info["pack_status"] = _pack_nodes(every, node_of, views, topology, drift, o)
    if o.gpu_cap is not None:
        cap = np.asarray(o.gpu_cap, dtype=np.float64)
        row, rinfo = gpu_repair(row, every, views, topology, cap, o.repair_time, seed=o.seed)
        info.update(rinfo)
    info["num_everywhere"] = int(every.sum())
    return row, info


def _node_partition(
    ids: np.ndarray,
    src_node: np.ndarray,
    every: np.ndarray,
    part: PartitionSpec,
    time_limit: float | Budget,
    role_swaps: bool,
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Everywhere set and node of every single-node expert: :func:`choose_everywhere` (``role_swaps``,
    when some but not all experts are everywhere), else :func:`partition_nodes` with ``every`` as given.

    Returns:
        ``(every bool [E], node_of int64 [E], info)``.
    """
    if role_swaps and 0 < int(every.sum()) < every.size:
        # any expert may leave the everywhere set: a hot expert that fires inside one cluster is split on
        # its node like any other heavy single-node expert
        return choose_everywhere(ids, src_node, every, part, time_limit)
    r = np.where(every, int(part.num_nodes), 1).astype(np.int64)
    node_of, info = partition_nodes(ids, src_node, every, r, part, time_limit)
    return every, node_of, info


def _window_picks(
    ids: np.ndarray, src_node: np.ndarray, win: np.ndarray, W: int, N: int, E: int
) -> np.ndarray:
    """Picks per window, source node and expert: float64 ``[W, N, E]`` from ``ids`` int64 ``[T, k]``
    (-1 none), ``src_node`` int64 ``[T]`` and ``win`` int64 ``[T]``."""
    valid = ids >= 0
    e_v = ids[valid]
    t_v = np.broadcast_to(np.arange(ids.shape[0])[:, None], ids.shape)[valid]
    win_src = np.zeros((W, N, E))
    np.add.at(win_src, (win[t_v], src_node[t_v], e_v), 1.0)
    return win_src


def _pack_nodes(
    every: np.ndarray,
    node_of: np.ndarray,
    views: FitViews,
    topology: Topology,
    drift: np.ndarray | None,
    search: LayerSearch,
) -> tuple[np.ndarray, list[str]]:
    """Split and pack every node exactly: the row int64 ``[P]`` and each packed node's status.

    Node ``n`` holds every everywhere expert and its single-node experts; each serves ``base [V, n_e]``
    (its node's sources for everywhere experts, all its picks otherwise). Spare slots go to extra
    replicas of the heaviest per replica (LPT start). With two slots per GPU and one view, :func:`pair_pack`
    scores every split with the optimal pairing, on loads with margins for what unseen traffic changes:
    everywhere replicas at ``(1 + share_margin) x`` (their load follows their node's token share), and
    ``drift`` float64 ``[E]`` (picks, optional) added to every single-node expert (the change of its load
    that unseen traffic can be expected to bring, see ``solver.locality.sources.load_drift``); the pairs
    are kept only if no worse than the start on the fitted loads. Else (``exact_pack``)
    :func:`pack_node_exact` (CP-SAT hinted with the start). ``share_margin``, ``seed``, ``pack_time`` and
    ``exact_pack`` come from ``search``.

    Args:
        every: bool ``[E]``; node_of: int64 ``[E]``; views: the layer's fit data (``load [V, E]``,
            ``src [V, N, E]``).
    """
    views_load, views_src = views.load, views.src
    seed, pack_time, exact_pack = search.seed, search.pack_time, search.exact_pack
    share_margin = search.share_margin
    N, m, S = topology.num_nodes, topology.gpus_per_node, topology.slots_per_gpu
    row = np.empty(topology.num_physical_experts, dtype=np.int64)
    statuses = []
    for n in range(N):
        on_n = np.concatenate([np.flatnonzero(every), np.flatnonzero(~every & (node_of == n))])
        base = np.where(every[on_n][None, :], views_src[:, n, on_n], views_load[:, on_n])  # [V, n_e]
        rr, slot_expert = _lpt_node(base[0], m, S, 0.0 if exact_pack else as_budget(pack_time).seconds, seed)
        exhaustive = False
        if S == 2 and base.shape[0] == 1 and on_n.size <= 2 * m <= on_n.size * min(3, m):  # pairs
            seen = base[0] * np.where(every[on_n], 1.0 + float(share_margin), 1.0)
            if drift is not None:
                seen = seen + np.where(every[on_n], 0.0, drift[on_n])
            r2, se2, _, exhaustive = pair_pack(seen, m, max_split=min(3, m))
            ref = np.maximum(base.sum(axis=1) / m, 1e-12)
            if pack_peak(base, r2, se2, ref) <= pack_peak(base, rr, slot_expert, ref):
                rr, slot_expert = r2, se2
        if exhaustive:
            statuses.append("pairs")
        elif exact_pack and not _spent(pack_time):
            rr, slot_expert, st = pack_node_exact(
                base, m, S, pack_time, seed=seed + n, hint=(rr, slot_expert)
            )
            statuses.append(st)
        for gl in range(m):
            g = n * m + gl
            row[g * S : (g + 1) * S] = np.sort(on_n[slot_expert[gl]])
    return row, statuses


def _spent(budget: float | Budget) -> bool:
    """True when a packing budget is zero (the whole call's budget is spent): no CP-SAT then, whose
    shortest limit would otherwise be paid once per node and layer."""
    b = as_budget(budget)
    return b.work == 0 if b.work is not None else b.seconds <= 0


def _lpt_node(
    load: np.ndarray, m: int, S: int, time_limit: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Start packing of one node: spare slots to extra replicas of the heaviest per replica (at most one
    per GPU), then :func:`pack_node_gpus`.

    Args:
        load: float64 ``[n_e]`` fitted load of each of the node's experts.

    Returns:
        ``(r int64 [n_e], slot_expert int64 [m, S] (local expert index))``.
    """
    rr = np.ones(load.size, dtype=np.int64)
    for _ in range(m * S - load.size):  # spare slots: extra replicas of the heaviest experts here
        score = np.where(rr < m, load / rr, -np.inf)
        rr[int(score.argmax())] += 1
    items = np.repeat(np.arange(load.size), rr).astype(np.int64)
    gpu = pack_node_gpus(items, np.repeat(load / rr, rr), m, time_limit=time_limit, seed=seed)
    return rr, np.stack([np.sort(items[gpu == gl]) for gl in range(m)])  # [m, S] local indices
