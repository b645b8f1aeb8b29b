"""Locality by full replication: hot experts on every node, the rest partitioned over nodes.

Shapes: E logical experts, N nodes, m GPUs per node, S slots per GPU, T tokens, k top-k, W windows.

Under the ``local`` replica-selection policy an expert with a replica on every node is always served on
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

import itertools
import math

import numpy as np

from solver.budget import Budget, as_budget
from solver.greedy import greedy_replica_counts

__all__ = [
    "gpu_repair",
    "pack_node_exact",
    "pair_pack",
    "partition_nodes",
    "remote_nodes_fit",
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


def remote_nodes_fit(
    node_of: np.ndarray, every: np.ndarray, ids: np.ndarray, src_node: np.ndarray, num_nodes: int
):
    """Remote nodes of each token ``[T]`` (float64): distinct nodes other than its own among its picks."""
    valid = ids >= 0
    e = np.where(valid, ids, 0)
    node = np.where(valid & ~every[e], node_of[e], -1)
    hit = np.zeros((ids.shape[0], num_nodes + 1), dtype=bool)
    hit[np.arange(ids.shape[0])[:, None], node + 1] = True
    hit[np.arange(ids.shape[0]), src_node + 1] = False
    return hit[:, 1:].sum(axis=1).astype(np.float64)


class _NodeReach:
    """Which nodes a set of tokens reaches through its single-node picks, and the exact change in remote
    nodes when single-node experts move or trade nodes (shared by the partition search, the GPU repair
    and the everywhere trades).

    ``X`` float32 ``[T, E]``: token picks expert (all experts); ``cnt`` float32 ``[T, N]``: picks of
    single-node experts on each node; ``notsrc`` float32 ``[T, N]``: node is not the token's own;
    ``pt, pe, pf``: every pair of single-node picks of one token (token, expert, expert).
    """

    def __init__(
        self, ids: np.ndarray, src_node: np.ndarray, every: np.ndarray, node_of: np.ndarray, num_nodes: int
    ):
        T, k = ids.shape
        self.E, self.N = every.size, int(num_nodes)
        valid = ids >= 0
        self.X = np.zeros((T, self.E), dtype=np.float32)
        self.X[np.repeat(np.arange(T), k)[valid.ravel()], ids[valid]] = 1.0
        single_pick = valid & ~every[np.where(valid, ids, 0)]  # [T, k]
        iu, ju = np.triu_indices(k, 1)
        both = single_pick[:, iu] & single_pick[:, ju]
        self.pt = np.broadcast_to(np.arange(T)[:, None], both.shape)[both]
        self.pe, self.pf = ids[:, iu][both], ids[:, ju][both]
        self.notsrc = (np.arange(self.N)[None, :] != src_node[:, None]).astype(np.float32)
        self.recount(node_of)

    def recount(self, node_of: np.ndarray) -> None:
        """Rebuild ``cnt`` from ``node_of`` int64 ``[E]`` (-1: everywhere)."""
        on = np.zeros((self.E, self.N), dtype=np.float32)
        single = np.flatnonzero(node_of >= 0)
        on[single, node_of[single]] = 1.0
        self.cnt = self.X @ on

    def relocate(self, e: int, a: int, b: int) -> None:
        """Single-node expert ``e`` moves from node ``a`` to ``b``."""
        self.cnt[:, a] -= self.X[:, e]
        self.cnt[:, b] += self.X[:, e]

    def reach(self) -> tuple[np.ndarray, np.ndarray]:
        """``(z0, z1)`` float32 ``[T, N]``: remote node not reached / reached by exactly one pick."""
        return (
            ((self.cnt == 0) * self.notsrc).astype(np.float32),
            ((self.cnt == 1) * self.notsrc).astype(np.float32),
        )

    def deltas(self, node_of: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Remote-node changes (token counts) under the current ``cnt``.

        Returns ``(move [E, N], kp [E, E], z1 [T, N])``: ``move[e, b]`` for moving ``e`` alone to node
        ``b``; trading ``e`` and ``f`` (on different nodes) changes by
        ``move[e, node(f)] + move[f, node(e)] + kp[e, f]`` (for tokens picking both, the two single moves'
        terms cancel: ``kp`` adds back z1 at both nodes). Rows of everywhere experts are meaningless.
        """
        z0, z1 = self.reach()
        a_all = np.maximum(node_of, 0)
        move = self.X.T @ z0 - (self.X.T @ z1)[np.arange(self.E), a_all][:, None]
        w = z1[self.pt, a_all[self.pe]] + z1[self.pt, a_all[self.pf]]
        kp = np.bincount(self.pe * self.E + self.pf, weights=w, minlength=self.E * self.E).reshape(
            self.E, self.E
        )
        return move, kp + kp.T, z1

    def remote(self) -> float:
        """Remote nodes summed over the tokens."""
        return float(((self.cnt > 0) * self.notsrc).sum())


def partition_nodes(
    ids: np.ndarray,
    src_node: np.ndarray,
    every: np.ndarray,
    r: np.ndarray,
    win_load: np.ndarray,
    win_src: np.ndarray,
    num_nodes: int,
    slots_per_node: int,
    slack: float,
    time_limit: float | Budget,
    seed: int = 0,
    sample: int = 20000,
    window_weight: float = 1.0,
    window_slack: float | None = None,
    single_margin: int | None = None,
    init: np.ndarray | None = None,
    perturb: bool = True,
) -> tuple[np.ndarray, dict]:
    """Assign single-node experts to nodes: exact slots, balanced windows, few remote nodes per token.

    Feasibility is lexicographic first: ``viol`` = sum over windows and nodes of the load above
    ``(1 + slack) x`` that window's mean node load (relative), with ``window_weight`` scaling the per-window
    terms against the fit-total term. Among layouts of equal (normally zero) violation, fewer fitted remote
    nodes per token win.

    The descent (best-improvement moves and equal-size swaps) is followed, while ``time_limit`` lasts and
    ``perturb`` is set, by kicks: 2-5 random swaps of single-node experts on different nodes, a new
    descent, and the result kept only when its violation is no larger and its fitted remote nodes (on the
    token sample) are fewer; else the best layout is restored. So the result is never worse than the
    first descent.

    Args:
        ids: int64 ``[T, k]`` fit picks (-1 none); src_node: int64 ``[T]``; every: bool ``[E]``; r: int64 ``[E]``.
        win_load: float64 ``[W, E]``; win_src: float64 ``[W, N, E]`` (see :func:`window_node_loads`).
        init: optional int64 ``[E]`` start layout (node of each single-node expert) instead of the greedy start.
        perturb: run the kicks after the first descent.

    Returns:
        ``(node_of int64 [E] (-1 for everywhere experts), info dict)``.
    """
    rng = np.random.default_rng(seed)
    N = int(num_nodes)
    E = every.size
    single = np.flatnonzero(~every)
    cap_slots = slots_per_node - int(every.sum())
    if int(r[single].sum()) > cap_slots * N:
        raise ValueError(
            f"single-node replicas {int(r[single].sum())} exceed {cap_slots} free slots x {N} nodes"
        )
    if single_margin is not None:  # keep spare slots on every node for splitting its heavy experts
        cap_slots = min(cap_slots, -(-int(r[single].sum()) // N) + int(single_margin))
    T = ids.shape[0]
    tok = np.sort(rng.choice(T, size=sample, replace=False)) if T > sample else np.arange(T)
    sid, ssrc = ids[tok], src_node[tok]
    reach = _NodeReach(sid, ssrc, every, np.full(E, -1, dtype=np.int64), N)
    # pair weights among single-node experts (tokens that pick both)
    xs = reach.X * ~every[None, :]
    coact = (xs.T @ xs).astype(np.float64)
    np.fill_diagonal(coact, 0.0)
    # windows plus the fit total (row 0) for the balance constraint
    tot_load = win_load.sum(axis=0, keepdims=True)
    tot_src = win_src.sum(axis=0, keepdims=True)
    wl = np.concatenate([tot_load, win_load], axis=0)  # [W+1, E]
    ws = np.concatenate([tot_src, win_src], axis=0)  # [W+1, N, E]
    wmean = wl.sum(axis=1) / N  # [W+1]
    wmean = np.where(wmean > 0, wmean, 1.0)
    wts = np.concatenate([[1.0], np.full(win_load.shape[0], float(window_weight))])  # [W+1]
    base = (ws * every[None, None, :]).sum(axis=2)  # [W+1, N]
    ws_ = slack if window_slack is None else float(window_slack)
    lim = (1.0 + np.concatenate([[slack], np.full(win_load.shape[0], ws_)]))[:, None] * wmean[
        :, None
    ]  # [W+1, 1]

    def viol(nl):
        return float((wts[:, None] * np.maximum(nl - lim, 0.0) / wmean[:, None]).sum())

    def rebuild(node_of):
        """(used [N], nl [W+1, N]) of a layout."""
        used = np.zeros(N, dtype=np.int64)
        np.add.at(used, node_of[single], r[single])
        member = np.zeros((N, E))
        member[node_of[single], single] = 1.0
        nl = base + (member @ wl.T).T  # [W+1, N]
        return used, nl

    # --- start: experts by load, each to the node with most co-activation among those with room and
    # no window over the cap; ties to the least loaded
    node_of = np.full(E, -1, dtype=np.int64)
    used = np.zeros(N, dtype=np.int64)
    nl = base.copy()  # [W+1, N]
    if init is not None:  # a given start (e.g. a perturbed earlier result): same slot accounting
        node_of[single] = np.asarray(init, dtype=np.int64)[single]
        used, nl = rebuild(node_of)
    for e in [] if init is not None else single[np.argsort(-wl[0, single], kind="stable")]:
        room = used + r[e] <= cap_slots
        aff = np.array([coact[e, node_of == n].sum() for n in range(N)])
        after = nl + wl[:, e : e + 1]  # [W+1, N] if e went to each node
        over = ((after - lim) > 0).any(axis=0)
        pool = room & ~over
        if not pool.any():
            pool = room
        score = np.where(pool, aff - 1e-6 * (nl[0] / wmean[0]) * (aff.max() + 1.0), -np.inf)
        if not pool.any():
            raise ValueError("no node has room for an expert's replicas; slot accounting is inconsistent")
        if aff[pool].max() <= 0:
            score = np.where(pool, -nl[0], -np.inf)
        n = int(score.argmax())
        node_of[e] = n
        used[n] += r[e]
        nl[:, n] += wl[:, e]
    # --- local search on the token sample: every plain move and every swap of two equal-size experts
    # on different nodes is scored at once with a few matrix products; the best improving one is applied
    scale = 1.0 / max(sid.shape[0], 1)
    budget = as_budget(time_limit)
    rounds = swaps = 0

    def contrib(load):
        """Violation of node loads ``load [V, ...]`` (summed over views)."""
        lv = lim.reshape((-1,) + (1,) * (load.ndim - 1))
        return (wts.reshape(lv.shape) * np.maximum(load - lv, 0.0) / wmean.reshape(lv.shape)).sum(axis=0)

    def step():
        """Apply the best improving move or swap (feasibility first, then remote nodes); False if none."""
        nonlocal v_cur, swaps
        move, kp, _ = reach.deltas(node_of)  # [E, N], [E, E]
        c_now = contrib(nl)  # [N]
        best = (-1e-12, None)
        for b in range(N):  # plain moves into node b
            es = single[(node_of[single] != b) & (used[b] + r[single] <= cap_slots)]
            if es.size == 0:
                continue
            a = node_of[es]
            dv = contrib(nl[:, a] - wl[:, es]) + contrib(nl[:, b : b + 1] + wl[:, es]) - c_now[a] - c_now[b]
            key = np.where(dv <= 1e-12, dv * 1e6 + move[es, b] * scale, np.inf)
            i = int(key.argmin())
            if key[i] < best[0]:
                best = (float(key[i]), ("move", int(es[i]), -1, b))
        for a in range(N):  # swaps between nodes a < b
            ea = single[node_of[single] == a]
            if ea.size == 0:
                continue
            for b in range(a + 1, N):
                fb = single[node_of[single] == b]
                if fb.size == 0:
                    continue
                dl = wl[:, fb][:, None, :] - wl[:, ea][:, :, None]  # [V, na, nb] load change of node a
                dv = (
                    contrib(nl[:, a][:, None, None] + dl)
                    + contrib(nl[:, b][:, None, None] - dl)
                    - c_now[a]
                    - c_now[b]
                )
                d = move[ea, b][:, None] + move[fb, a][None, :] + kp[np.ix_(ea, fb)]
                key = np.where(
                    (dv <= 1e-12) & (r[ea][:, None] == r[fb][None, :]), dv * 1e6 + d * scale, np.inf
                )
                i, j = np.unravel_index(int(key.argmin()), key.shape)
                if key[i, j] < best[0]:
                    best = (float(key[i, j]), ("swap", int(ea[i]), int(fb[j]), b))
        if best[1] is None:
            return False
        kind, e, f, b = best[1]
        a = int(node_of[e])
        relocate(e, a, b)
        if kind == "swap":
            relocate(f, b, a)
        v_cur = viol(nl)
        swaps += 1
        return True

    def relocate(e, a, b):
        """Move single-node expert ``e`` from node ``a`` to ``b`` (all state)."""
        node_of[e] = b
        used[a] -= r[e]
        used[b] += r[e]
        nl[:, a] -= wl[:, e]
        nl[:, b] += wl[:, e]
        reach.relocate(e, a, b)

    def descend():
        nonlocal rounds
        rounds += 1
        while budget.ok() and step():
            budget.tick()

    def fitted():
        return reach.remote()

    def recount():
        reach.recount(node_of)

    recount()
    v_cur = viol(nl)
    descend()
    # iterated local search: perturb the best layout by a few random swaps of equal-size experts on
    # different nodes, descend again, keep the result if it is no less feasible and has fewer remote nodes
    best = (v_cur, fitted(), node_of.copy())
    kicks = kept = 0
    while perturb and budget.ok() and single.size > 1:
        budget.tick()  # a kick costs at least one step, even when its descent finds nothing
        kicks += 1
        for _ in range(int(rng.integers(2, 6))):
            a_e, b_e = rng.choice(single, 2, replace=False)
            if node_of[a_e] != node_of[b_e] and r[a_e] == r[b_e]:
                node_of[a_e], node_of[b_e] = node_of[b_e], node_of[a_e]
        used, nl = rebuild(node_of)
        recount()
        v_cur = viol(nl)
        descend()
        f = fitted()
        if v_cur <= best[0] + 1e-12 and f < best[1]:
            best = (v_cur, f, node_of.copy())
            kept += 1
        else:
            node_of = best[2].copy()
            used, nl = rebuild(node_of)
            v_cur = viol(nl)
            recount()
    info = {
        "rounds": rounds,
        "swaps": swaps,
        "violation": v_cur,
        "kicks": kicks,
        "kicks_kept": kept,
        "node_load_ratio_fit": float(nl[0].max() / wmean[0]),
        "node_load_ratio_windows": float((nl[1:].max(axis=1) / wmean[1:]).max()) if nl.shape[0] > 1 else 1.0,
    }
    return node_of, info


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
    reach = _NodeReach(ids, src_node, every, node_of, num_nodes)
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
    part: dict,
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
        ids: int64 ``[T, k]``; src_node: int64 ``[T]``; every: bool ``[E]``; part: keyword arguments of
            :func:`partition_nodes` other than ``ids, src_node, every, r, time_limit``.

    ``time_limit``: seconds, or a :class:`solver.budget.Budget` (a fixed number of steps: reproducible).

    Returns:
        ``(every bool [E], node_of int64 [E], info)``; info adds ``role_trades`` (kept) and ``role_tries``.
    """
    N = int(part["num_nodes"])
    budget = as_budget(time_limit)

    def run(ev, b, init=None, perturb=True):
        r = np.where(ev, N, 1).astype(np.int64)
        no, inf = partition_nodes(ids, src_node, ev, r, time_limit=b, init=init, perturb=perturb, **part)
        return no, inf, float(remote_nodes_fit(no, ev, ids, src_node, N).mean())

    start = budget.part(0.4)
    node_of, info, rn = run(every, start)
    budget.tick(start.used)
    kept = tried = 0
    while budget.left_fraction() > 0.05:
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
            no2, inf2, rn2 = run(ev2, trial, init=init, perturb=False)
            budget.tick(max(trial.used, 1))
            if inf2["violation"] <= info["violation"] + 1e-12 and rn2 < rn - 1e-12:
                every, node_of, info, rn = ev2, no2, inf2, rn2
                kept += 1
                better = True
                break
        if not better:
            break
    polish = budget.rest()
    if (polish.work or 0) > 0 or polish.seconds > 0.05:
        no2, inf2, rn2 = run(every, polish, init=node_of)
        if inf2["violation"] <= info["violation"] + 1e-12 and rn2 <= rn:
            node_of, info, rn = no2, inf2, rn2
    info = {**info, "role_trades": kept, "role_tries": tried}
    return every, node_of, info


def solve_replicated_layer(
    ids: np.ndarray,
    src_node: np.ndarray,
    win: np.ndarray,
    num_windows: int,
    num_experts: int,
    topology,
    num_everywhere: int,
    slack: float,
    time_limit: float | Budget,
    seed: int = 0,
    window_weight: float = 1.0,
    pack_time: float | Budget = 0.0,
    window_slack: float | None = None,
    gpu_cap: float | None = None,
    repair_time: float | Budget = 1.0,
    exact_pack: bool = True,
    single_margin: int | None = None,
    role_swaps: bool = True,
    share_margin: float = 0.0,
    drift: np.ndarray | None = None,
) -> tuple[np.ndarray, dict]:
    """One layer: int64 ``[P]`` physical-to-logical row and info.

    ``role_swaps``: start from the ``h`` hottest experts everywhere, then trade roles where that cuts
    fitted remote nodes (:func:`choose_everywhere`).

    ``share_margin``: with two slots per GPU, the pairing sees every everywhere replica at
    ``(1 + share_margin) x`` its fitted load. An everywhere replica serves its node's own tokens, so its
    load follows that node's token share, which varies with where long requests land; pairing it with a
    lighter partner keeps the GPU under the peak when its node is the busy one. ``drift`` float64 ``[E]``
    (picks, optional) is added to every single-node expert's load in the same pairing: the change of its
    load that unseen traffic can be expected to bring (see ``solver.locality._load_drift``), so an expert
    whose load is uncertain is split more or gets a lighter partner. The result is kept only if it is no
    worse than the plain start on the fitted loads.

    Args:
        ids: int64 ``[T, k]`` fit picks; src_node: int64 ``[T]``; win: int64 ``[T]`` window of each token
            (``0..num_windows-1``); topology: :class:`placement.topology.Topology`.
    """
    from solver.locality import pack_node_gpus

    E, W = int(num_experts), int(num_windows)
    N, m, S, P = (
        topology.num_nodes,
        topology.gpus_per_node,
        topology.slots_per_gpu,
        topology.num_physical_experts,
    )
    valid = ids >= 0
    e_v = ids[valid]
    t_v = np.broadcast_to(np.arange(ids.shape[0])[:, None], ids.shape)[valid]
    win_src = np.zeros((W, N, E))
    np.add.at(win_src, (win[t_v], src_node[t_v], e_v), 1.0)
    win_load = win_src.sum(axis=1)  # [W, E]
    load = win_load.sum(axis=0)  # [E]
    every, _ = replicated_counts(load, P, N, m, num_everywhere)
    part = {
        "win_load": win_load,
        "win_src": win_src,
        "num_nodes": N,
        "slots_per_node": P // N,
        "slack": slack,
        "seed": seed,
        "window_weight": window_weight,
        "window_slack": window_slack,
        "single_margin": single_margin,
    }
    if role_swaps and 0 < int(every.sum()) < E:
        # any expert may leave the everywhere set: a hot expert that fires inside one cluster is split on
        # its node like any other heavy single-node expert
        every, node_of, info = choose_everywhere(ids, src_node, every, part, time_limit)
    else:
        r = np.where(every, N, 1).astype(np.int64)
        node_of, info = partition_nodes(ids, src_node, every, r, time_limit=time_limit, **part)
    src_tot = win_src.sum(axis=0)  # [N, E]
    views_load = np.concatenate([load[None], win_load], axis=0) if W > 1 else load[None]  # [V, E]
    views_src = np.concatenate([src_tot[None], win_src], axis=0) if W > 1 else src_tot[None]  # [V, N, E]
    row = np.empty(P, dtype=np.int64)
    statuses = []
    for n in range(N):
        on_n = np.concatenate([np.flatnonzero(every), np.flatnonzero(~every & (node_of == n))])
        base = np.where(every[on_n][None, :], views_src[:, n, on_n], views_load[:, on_n])  # [V, n_e]
        rr = np.ones(on_n.size, dtype=np.int64)
        for _ in range(m * S - on_n.size):  # spare slots: extra replicas of the heaviest experts here
            score = np.where(rr < m, base[0] / rr, -np.inf)
            rr[int(score.argmax())] += 1
        items = np.repeat(np.arange(on_n.size), rr).astype(np.int64)
        gpu = pack_node_gpus(
            items,
            np.repeat(base[0] / rr, rr),
            m,
            time_limit=0.0 if exact_pack else as_budget(pack_time).seconds,
            seed=seed,
        )
        slot_expert = np.stack([np.sort(items[gpu == gl]) for gl in range(m)])  # [m, S] local indices
        exhaustive = False
        if (
            S == 2 and base.shape[0] == 1 and on_n.size <= 2 * m <= on_n.size * min(3, m)
        ):  # 2 slots/GPU: pairs
            seen = base[0] * np.where(every[on_n], 1.0 + float(share_margin), 1.0)
            if drift is not None:
                seen = seen + np.where(every[on_n], 0.0, drift[on_n])
            r2, se2, _, exhaustive = pair_pack(seen, m, max_split=min(3, m))
            ref = np.maximum(base.sum(axis=1) / m, 1e-12)
            if _pack_peak(base, r2, se2, ref) <= _pack_peak(base, rr, slot_expert, ref):
                rr, slot_expert = r2, se2
        if exhaustive:
            statuses.append("pairs")
        elif exact_pack:
            rr, slot_expert, st = pack_node_exact(
                base, m, S, pack_time, seed=seed + n, hint=(rr, slot_expert)
            )
            statuses.append(st)
        for gl in range(m):
            g = n * m + gl
            row[g * S : (g + 1) * S] = np.sort(on_n[slot_expert[gl]])
    info["pack_status"] = statuses
    if gpu_cap is not None:
        row, rinfo = gpu_repair(
            row,
            every,
            views_load,
            views_src,
            ids,
            src_node,
            topology,
            np.asarray(gpu_cap, dtype=np.float64),
            repair_time,
            seed=seed,
        )
        info.update(rinfo)
    info["num_everywhere"] = int(every.sum())
    return row, info


def gpu_repair(
    row: np.ndarray,
    every: np.ndarray,
    load: np.ndarray,
    src_tot: np.ndarray,
    ids: np.ndarray,
    src_node: np.ndarray,
    topology,
    gpu_cap: np.ndarray,
    time_limit: float | Budget,
    seed: int = 0,
    sample: int = 20000,
) -> tuple[np.ndarray, dict]:
    """Bring the heaviest GPU under ``gpu_cap`` on every load view, paying few fitted remote nodes.

    A *view* is the fit total or one fit window (robustness: a layout must be balanced on every window,
    not only on their sum). A swap exchanges the experts of two slots on different GPUs: inside a node any
    two (keeping distinct experts per GPU); across nodes only two single-replica, single-node experts (so
    every expert stays on one node or on all). Each step takes, among swaps that lower the total excess
    ``sum_v max(0, peak_v - cap_v) / cap_v``, the one with the smallest increase in fitted remote nodes per
    token (ties: the larger excess reduction).

    Args:
        row: int64 ``[P]`` physical-to-logical row; every: bool ``[E]``; load: float64 ``[V, E]`` picks per view; src_tot: float64 ``[V, N, E]``
            picks per view by source node; ids: int64 ``[T, k]``; src_node: int64 ``[T]``;
            gpu_cap: float64 ``[V]`` absolute peak caps.

    Returns:
        ``(row int64 [P], info)``.
    """
    rng = np.random.default_rng(seed)
    N, m, S, P = (
        topology.num_nodes,
        topology.gpus_per_node,
        topology.slots_per_gpu,
        topology.num_physical_experts,
    )
    G = N * m
    load = np.atleast_2d(load)
    src_tot = src_tot if src_tot.ndim == 3 else src_tot[None]
    cap = np.asarray(gpu_cap, dtype=np.float64).reshape(-1)
    row = row.copy()
    slot_gpu = np.arange(P) // S
    slot_node = slot_gpu // m
    E = every.size
    rn = np.zeros((N, E), dtype=np.int64)  # replicas of each expert on each node
    np.add.at(rn, (slot_node, row), 1)
    # load a node serves for an expert, split over its replicas there: sources for everywhere experts,
    # all picks for single-node experts
    basev = np.where(every[None, None, :], src_tot, load[:, None, :])  # [V, N, E]
    sl = basev[:, slot_node, row] / rn[slot_node, row][None, :]  # [V, P]
    gl = np.stack([np.bincount(slot_gpu, weights=x, minlength=G) for x in sl])  # [V, G]
    node_of = np.full(E, -1, dtype=np.int64)
    node_of[row[~every[row]]] = slot_node[~every[row]]
    T = ids.shape[0]
    tok = np.sort(rng.choice(T, size=sample, replace=False)) if T > sample else np.arange(T)
    sid, ssrc = ids[tok], src_node[tok]
    reach = _NodeReach(sid, ssrc, every, node_of, N)
    scale = 1.0 / max(sid.shape[0], 1)

    def swap_costs():
        """Remote-node change per token ``[E, E]`` of trading the nodes of two single-node experts."""
        move, kp, _ = reach.deltas(node_of)
        a_all = np.maximum(node_of, 0)
        return (move[:, a_all].T + move[:, a_all] + kp) * scale  # [x, y]: x to y's node, y to x's node

    def excess(x):
        return float((np.maximum(x.max(axis=1) - cap, 0.0) / cap).sum())

    budget = as_budget(time_limit)
    steps, cost_sum = 0, 0.0
    start = excess(gl)
    cur = start
    while cur > 0 and budget.ok():
        budget.tick()
        hot = np.unique(gl.argmax(axis=1)[gl.max(axis=1) > cap])  # GPUs at a violated peak
        best = None
        # every swap of a slot p on a hot GPU with any slot q, scored at once
        ps = (hot[:, None] * S + np.arange(S)[None, :]).ravel()  # [np]
        gp, gq = slot_gpu[ps], slot_gpu  # [np], [P]
        d = sl[:, ps][:, :, None] - sl[:, None, :]  # [V, np, P] load leaving GPU gp for GPU gq
        order = np.argsort(-gl, axis=1)[:, :3]  # [V, <=3] the heaviest GPUs per view
        top = np.take_along_axis(gl, order, axis=1)
        peak = np.full(d.shape, -np.inf)
        for j in reversed(range(order.shape[1])):  # heaviest GPU other than gp and gq
            ok = (order[:, j][:, None, None] != gp[None, :, None]) & (
                order[:, j][:, None, None] != gq[None, None, :]
            )
            peak = np.where(ok, top[:, j][:, None, None], peak)
        rest = np.where(np.isfinite(peak), peak, 0.0)
        new_peak = np.maximum(rest, np.maximum(gl[:, gp][:, :, None] - d, gl[:, gq][:, None, :] + d))
        ex_pq = (np.maximum(new_peak - cap[:, None, None], 0.0) / cap[:, None, None]).sum(axis=0)  # [np, P]
        x_p, y_q = row[ps][:, None], row[None, :]
        cross = slot_node[ps][:, None] != slot_node[None, :]
        has = np.zeros((G, E), dtype=bool)
        has[slot_gpu, row] = True
        single_rep = ~every & (rn.sum(axis=0) == 1)  # [E] movable across nodes
        ok = (gq[None, :] != gp[:, None]) & (x_p != y_q) & (ex_pq < cur - 1e-12)
        ok &= np.where(
            cross, single_rep[x_p] & single_rep[y_q], ~has[gq[None, :], x_p] & ~has[gp[:, None], y_q]
        )
        if ok.any():
            cost_pq = np.zeros(ok.shape)
            if (ok & cross).any():
                cost_pq = np.where(cross, swap_costs()[x_p, y_q], 0.0)
            key_cost = np.where(ok, cost_pq, np.inf)
            ip, iq = np.unravel_index(np.lexsort((ex_pq.ravel(), key_cost.ravel()))[0], ok.shape)
            gl2 = gl.copy()
            gl2[:, slot_gpu[ps[ip]]] -= d[:, ip, iq]
            gl2[:, slot_gpu[iq]] += d[:, ip, iq]
            best = ((float(key_cost[ip, iq]), float(ex_pq[ip, iq])), int(ps[ip]), int(iq), gl2)
        # zero-cost re-splits inside a node: a slot holding a second replica of x becomes a replica of y
        for n in np.unique(hot // m):
            slots_n = np.arange(n * m * S, (n + 1) * m * S)
            on_n = np.flatnonzero(rn[n] > 0)
            for q in slots_n[rn[n, row[slots_n]] >= 2]:
                hq = slot_gpu[q]
                here = row[hq * S : (hq + 1) * S]
                for y in on_n:
                    if np.any(here == y):
                        continue
                    x = row[q]
                    rn2 = rn[n].copy()
                    rn2[x] -= 1
                    rn2[y] += 1
                    e_n = row[slots_n].copy()
                    e_n[q - n * m * S] = y
                    sl_n = basev[:, n, e_n] / rn2[e_n][None, :]  # [V, m*S]
                    gl2 = gl.copy()
                    gl2[:, n * m : (n + 1) * m] = sl_n.reshape(sl_n.shape[0], m, S).sum(axis=2)
                    ex = excess(gl2)
                    if ex >= cur - 1e-12:
                        continue
                    key = (0.0, ex)
                    if best is None or key < best[0]:
                        best = (key, -1 - q, int(y), gl2)
        if best is None:
            break
        (cost, ex), p, q, gl = best
        if p < 0:  # re-split: slot -1-p becomes expert q
            qs, y = -1 - p, q
            n = slot_node[qs]
            rn[n, row[qs]] -= 1
            rn[n, y] += 1
            row[qs] = y
            slots_n = np.arange(n * m * S, (n + 1) * m * S)
            sl[:, slots_n] = basev[:, n, row[slots_n]] / rn[n, row[slots_n]][None, :]
            cur = ex
            steps += 1
            continue
        x, y = row[p], row[q]
        a, b = slot_node[p], slot_node[q]
        if a != b:
            reach.relocate(x, a, b)
            reach.relocate(y, b, a)
            node_of[x], node_of[y] = b, a
            rn[a, x] -= 1
            rn[b, x] += 1
            rn[b, y] -= 1
            rn[a, y] += 1
        row[p], row[q] = y, x
        sl[:, [p, q]] = sl[:, [q, p]]
        cur = ex
        steps += 1
        cost_sum += cost
    for g in range(G):  # canonical rows: each GPU's slots sorted
        row[g * S : (g + 1) * S] = np.sort(row[g * S : (g + 1) * S])
    return row, {
        "repair_steps": steps,
        "repair_remote_cost": cost_sum,
        "excess_start": start,
        "excess_end": cur,
    }


def pair_pack(
    load: np.ndarray, num_gpus: int, max_split: int = 3, max_enumerate: int = 20000
) -> tuple[np.ndarray, np.ndarray, float, bool]:
    """Split and pack one node with two slots per GPU: replica counts, then pairs (fast, one load view).

    For fixed replica counts the pairing that minimises the heaviest pair puts the ``i``-th heaviest
    replica with the ``i``-th lightest (exchange argument), so a layout is scored in ``O(P log P)``. When
    there are at most ``max_enumerate`` ways to hand out the extra replicas, all are scored at once (exact
    up to the duplicate rule below); else the replica counts start from "split the heaviest per-replica
    load" and move one replica at a time from one expert to another while the heaviest pair gets
    lighter. A pair that would hold two replicas of one expert (equal loads meeting in the middle) trades
    partners with a neighbour.

    Args:
        load: float64 ``[n]`` the node's load of each of its experts (``n <= 2 * num_gpus``).

    Returns:
        ``(r int64 [n], slot_expert int64 [num_gpus, 2] (local expert index), peak, exhaustive)``: ``peak``
        = heaviest GPU load; ``exhaustive``: every split was scored (the result is optimal unless the
        duplicate rule had to trade partners).
    """
    w = np.asarray(load, dtype=np.float64)
    n, G = w.size, int(num_gpus)
    if n > 2 * G:
        raise ValueError(f"{n} experts do not fit in {G} GPUs x 2 slots")
    cap = max(1, min(int(max_split), G))
    if n * cap < 2 * G:
        raise ValueError(f"{n} experts with at most {cap} replicas each cannot fill {2 * G} slots")

    def layout(r):
        items = np.repeat(np.arange(n), r)
        per = w[items] / r[items]
        order = np.argsort(-per, kind="stable")
        a, b = order[:G], order[::-1][:G]  # heaviest with lightest
        a, b = items[a].copy(), items[b].copy()
        for i in np.flatnonzero(a == b):  # same expert twice on one GPU: trade partners with a neighbour
            for j in sorted(range(G), key=lambda j: abs(j - i)):  # nearest first: the least load change
                if j != i and a[i] != b[j] and a[j] != b[i]:
                    b[i], b[j] = b[j], b[i]
                    break
        pk = float((w[a] / r[a] + w[b] / r[b]).max())
        if np.any(a == b):
            pk = np.inf
        return pk, np.sort(np.stack([a, b], axis=1), axis=1)

    k = 2 * G - n  # replicas beyond one per expert
    if math.comb(n + k - 1, k) <= max_enumerate:  # every split, scored at once (duplicates checked after)
        combos = np.array(list(itertools.combinations_with_replacement(range(n), k)), dtype=np.int64)
        combos = combos.reshape(max(combos.shape[0], 1), k)  # k = 0: one split, one replica each
        R = np.ones((combos.shape[0], n), dtype=np.int64)
        np.add.at(R, (np.repeat(np.arange(combos.shape[0]), k), combos.ravel()), 1)
        R = R[(R <= cap).all(axis=1)]
        per = w[None, :] / R  # [B, n]
        rep = np.repeat(per.ravel(), R.ravel()).reshape(R.shape[0], 2 * G)  # [B, 2G]: every row sums to 2G
        rep = -np.sort(-rep, axis=1)
        peak = (rep[:, :G] + rep[:, ::-1][:, :G]).max(axis=1)  # [B]
        best, se, r = np.inf, None, None
        for i in np.argsort(peak, kind="stable")[:8]:  # the best few, with the duplicate check
            pk, se_i = layout(R[i])
            if pk < best:
                best, se, r = pk, se_i, R[i].copy()
        if r is not None and np.isfinite(best):
            return r, se, best, True
    r = greedy_replica_counts(w[None, :], 2 * G, max_replicas=cap)[0]  # split the heaviest per replica
    best, se = layout(r)
    while True:
        cand = None
        for x in np.flatnonzero(r > 1):
            for y in np.flatnonzero(r < cap):
                if x == y:
                    continue
                r2 = r.copy()
                r2[x] -= 1
                r2[y] += 1
                pk, se2 = layout(r2)
                if pk < best - 1e-9 and (cand is None or pk < cand[0]):
                    cand = (pk, r2, se2)
        if cand is None:
            break
        best, r, se = cand
    return r, se, best, False


def pack_node_exact(
    base: np.ndarray,
    num_gpus: int,
    slots_per_gpu: int,
    time_limit: float | Budget,
    seed: int = 0,
    max_split: int = 3,
    hint: tuple[np.ndarray, np.ndarray] | None = None,
    counts: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, str]:
    """Split and pack one node exactly (CP-SAT): replica counts and GPUs of the node's experts.

    Expert ``i`` of the node serves ``base[v, i]`` tokens in view ``v`` (fit total, windows); with ``r_i``
    replicas on the node each takes ``base / r_i``. Chooses ``r_i in 1..max_split`` (at most one replica per
    GPU, ``sum r_i = num_gpus * slots_per_gpu``) and the GPU of every replica, minimising the largest
    ``GPU load / mean GPU load`` over all views.

    Args:
        base: float64 ``[V, n]``; hint: optional ``(r int64 [n], slot_expert int64 [num_gpus, slots_per_gpu])``
            start (e.g. the heuristic's); the result is never worse than it on the objective.
        counts: optional int64 ``[n]``: fixed replica counts (then only the GPUs are chosen; ``max_split``
            is raised to ``max(counts)``).

    Returns:
        ``(r int64 [n], slot_expert int64 [num_gpus, slots_per_gpu] (local expert index), status)``.
    """
    from ortools.sat.python import cp_model

    base = np.atleast_2d(np.asarray(base, dtype=np.float64))
    V, n = base.shape
    G, S = int(num_gpus), int(slots_per_gpu)
    if n > G * S:
        raise ValueError(f"{n} experts do not fit in {G} GPUs x {S} slots")
    if counts is not None:
        counts = np.asarray(counts, dtype=np.int64)
        if (
            counts.shape != (n,)
            or counts.min(initial=1) < 1
            or counts.max(initial=1) > G
            or counts.sum() != G * S
        ):
            raise ValueError(
                f"counts must be {n} replica counts in [1, {G}] summing to {G * S} slots, got {counts.tolist()}"
            )
        max_split = int(counts.max(initial=1))
    R = max(1, min(int(max_split), G))
    ref = np.maximum(base.sum(axis=1) / G, 1e-12)  # [V] mean GPU load per view
    model = cp_model.CpModel()
    s = [[model.new_bool_var("") for _ in range(R)] for _ in range(n)]  # s[i][j]: r_i = j + 1
    x = [[[model.new_bool_var("") for _ in range(G)] for _ in range(R)] for _ in range(n)]
    for i in range(n):
        model.add_exactly_one(s[i])
        if counts is not None:
            model.add(s[i][int(counts[i]) - 1] == 1)
        for j in range(R):
            model.add(sum(x[i][j]) == (j + 1) * s[i][j])
        for g in range(G):
            model.add(sum(x[i][j][g] for j in range(R)) <= 1)
    model.add(sum((j + 1) * s[i][j] for i in range(n) for j in range(R)) == G * S)
    for g in range(G):
        model.add(sum(x[i][j][g] for i in range(n) for j in range(R)) == S)
    scale = 10000
    z = model.new_int_var(0, 100 * scale, "z")
    for v in range(V):
        coef = np.round(base[v][:, None] / (np.arange(1, R + 1)[None, :] * ref[v]) * scale).astype(
            np.int64
        )  # [n, R]
        for g in range(G):
            model.add(sum(int(coef[i, j]) * x[i][j][g] for i in range(n) for j in range(R)) <= z)
    model.minimize(z)
    if hint is not None:
        hr, hse = hint
        for i in range(n):
            for j in range(R):
                model.add_hint(s[i][j], bool(hr[i] == j + 1))
                for g in range(G):
                    model.add_hint(x[i][j][g], bool(hr[i] == j + 1 and np.any(hse[g] == i)))
    solver = cp_model.CpSolver()
    as_budget(time_limit).cpsat(solver.parameters)
    solver.parameters.random_seed = int(seed)
    solver.parameters.num_workers = 1
    st = solver.solve(model)
    name = solver.status_name(st).lower()
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if hint is None:
            raise RuntimeError(f"node packing found no solution ({name}) and has no start")
        return np.asarray(hint[0]), np.asarray(hint[1]), name
    r = np.array([next(j + 1 for j in range(R) if solver.value(s[i][j])) for i in range(n)], dtype=np.int64)
    slot_expert = np.empty((G, S), dtype=np.int64)
    for g in range(G):
        here = [i for i in range(n) for j in range(R) if solver.value(x[i][j][g])]
        slot_expert[g] = sorted(here)
    if hint is not None and _pack_peak(base, hint[0], hint[1], ref) < _pack_peak(base, r, slot_expert, ref):
        return np.asarray(hint[0]), np.asarray(hint[1]), name
    return r, slot_expert, name


def _pack_peak(base: np.ndarray, r: np.ndarray, slot_expert: np.ndarray, ref: np.ndarray) -> float:
    """Largest GPU load / mean over views of a node packing (see :func:`pack_node_exact`)."""
    per = base / np.asarray(r)[None, :]  # [V, n]
    return float((per[:, slot_expert].sum(axis=2).max(axis=1) / ref).max())
