"""Locality by full replication: hot experts on every node, the rest partitioned over nodes.

Shapes: E logical experts, N nodes, m GPUs per node, S slots per GPU, T tokens, k top-k, W windows.

Under the ``local`` replica-selection policy an expert with a replica on every node is always served on
the token's own node, and its load splits over nodes exactly as the tokens' sources do (round-robin
prompts: evenly). So the ``h`` hottest experts get one replica per node ("everywhere" experts); they leave
cross-node traffic and the node-balance problem. Every other expert lives on exactly one node, with
``r_e >= 1`` replicas there on distinct GPUs (extra replicas on the same node cost no locality and help
the GPU packing). Then, per layer:

1. Replica counts: ``h`` everywhere experts, the remaining ``X = P - hN - (E - h)`` spare slots to the
   single-node experts with the largest per-replica load (``r_e <= m``).
2. Node partition of the single-node experts (:func:`partition_nodes`): exact slot counts per node,
   node loads within ``(1 + slack)`` of the mean on every fit window (robust to drift, not only on the
   fit total), minimising the fitted remote nodes per token (exact: distinct nodes other than the own one
   among a token's single-node picks), by greedy affinity start and token-level move/swap search.
3. GPU packing inside each node (:func:`solver.locality.pack_node_gpus`: LPT, swaps, CP-SAT).
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["replicated_counts", "window_node_loads", "partition_nodes", "remote_nodes_fit"]


def replicated_counts(load: np.ndarray, num_slots: int, num_nodes: int, gpus_per_node: int, num_everywhere: int):
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
            raise ValueError(f"{spare} spare slots left with every single-node expert at {m} replicas; "
                             f"raise num_everywhere")
        r[int(score.argmax())] += 1
        spare -= 1
    return every, r


def window_node_loads(node_of: np.ndarray, win_load: np.ndarray, win_src: np.ndarray, every: np.ndarray) -> np.ndarray:
    """Node loads per window ``[W, N]`` under ``local``.

    Args:
        node_of: int64 ``[E]`` node of each single-node expert (ignored for everywhere experts).
        win_load: float64 ``[W, E]`` picks per window; win_src: float64 ``[W, N, E]`` picks per window by
            tokens from each node; every: bool ``[E]``.
    """
    W, N, E = win_src.shape
    out = (win_src * every[None, None, :]).sum(axis=2)  # everywhere experts: served where the token is
    single = np.flatnonzero(~every)
    onehot = np.zeros((E, N))
    onehot[single, node_of[single]] = 1.0
    return out + win_load @ onehot


def remote_nodes_fit(node_of: np.ndarray, every: np.ndarray, ids: np.ndarray, src_node: np.ndarray, num_nodes: int):
    """Remote nodes of each token ``[T]`` (float64): distinct nodes other than its own among its picks."""
    valid = ids >= 0
    e = np.where(valid, ids, 0)
    node = np.where(valid & ~every[e], node_of[e], -1)
    hit = np.zeros((ids.shape[0], num_nodes + 1), dtype=bool)
    hit[np.arange(ids.shape[0])[:, None], node + 1] = True
    hit[np.arange(ids.shape[0]), src_node + 1] = False
    return hit[:, 1:].sum(axis=1).astype(np.float64)


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
    time_limit: float,
    seed: int = 0,
    sample: int = 20000,
    window_weight: float = 1.0,
) -> tuple[np.ndarray, dict]:
    """Assign single-node experts to nodes: exact slots, balanced windows, few remote nodes per token.

    Feasibility is lexicographic first: ``viol`` = sum over windows and nodes of the load above
    ``(1 + slack) x`` that window's mean node load (relative), with ``window_weight`` scaling the per-window
    terms against the fit-total term. Among layouts of equal (normally zero) violation, fewer fitted remote
    nodes per token win.

    Args:
        ids: int64 ``[T, k]`` fit picks (-1 none); src_node: int64 ``[T]``; every: bool ``[E]``; r: int64 ``[E]``.
        win_load: float64 ``[W, E]``; win_src: float64 ``[W, N, E]`` (see :func:`window_node_loads`).

    Returns:
        ``(node_of int64 [E] (-1 for everywhere experts), info dict)``.
    """
    rng = np.random.default_rng(seed)
    N = int(num_nodes)
    E = every.size
    single = np.flatnonzero(~every)
    cap_slots = slots_per_node - int(every.sum())
    if int(r[single].sum()) > cap_slots * N:
        raise ValueError(f"single-node replicas {int(r[single].sum())} exceed {cap_slots} free slots x {N} nodes")
    T = ids.shape[0]
    tok = np.sort(rng.choice(T, size=sample, replace=False)) if T > sample else np.arange(T)
    sid, ssrc = ids[tok], src_node[tok]
    # pair weights among single-node experts (tokens that pick both)
    valid = sid >= 0
    onehot = np.zeros((sid.shape[0], E), dtype=np.float32)
    rows = np.repeat(np.arange(sid.shape[0]), sid.shape[1])
    onehot[rows[valid.ravel()], sid.ravel()[valid.ravel()]] = 1.0
    onehot[:, every] = 0.0
    coact = (onehot.T @ onehot).astype(np.float64)
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
    lim = (1.0 + slack) * wmean[:, None]  # [W+1, 1]

    def viol(nl):
        return float((wts[:, None] * np.maximum(nl - lim, 0.0) / wmean[:, None]).sum())

    # --- start: experts by load, each to the node with most co-activation among those with room and
    # no window over the cap; ties to the least loaded
    node_of = np.full(E, -1, dtype=np.int64)
    used = np.zeros(N, dtype=np.int64)
    nl = base.copy()  # [W+1, N]
    for e in single[np.argsort(-wl[0, single], kind="stable")]:
        room = used + r[e] <= cap_slots
        aff = np.array([coact[e, node_of == n].sum() for n in range(N)])
        after = nl + wl[:, e:e + 1]  # [W+1, N] if e went to each node
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
    # --- token-level local search: swaps of two experts with equal replica counts on different nodes
    cnt = np.zeros((sid.shape[0], N + 1), dtype=np.int16)  # picks of each token on each node (col 0: none)
    node_pick = np.where(valid & ~every[np.where(valid, sid, 0)], node_of[np.where(valid, sid, 0)], -1)
    np.add.at(cnt, (np.repeat(np.arange(sid.shape[0])[:, None], sid.shape[1], axis=1), node_pick + 1), 1)
    cnt = cnt[:, 1:]
    by_expert = [np.flatnonzero((sid == e).any(axis=1)) for e in range(E)]
    scale = 1.0 / max(sid.shape[0], 1)
    v_cur = viol(nl)
    deadline = time.perf_counter() + max(float(time_limit), 0.0)
    rounds = swaps = 0

    def move_delta(t_idx, a, b):
        """Change in remote nodes of tokens ``t_idx`` when one of their picks moves from node a to b."""
        c = cnt[t_idx]
        s = ssrc[t_idx]
        lose = (c[:, a] == 1) & (s != a)
        gain = (c[:, b] == 0) & (s != b)
        return gain.astype(np.int64) - lose.astype(np.int64)

    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        rounds += 1
        for e in rng.permutation(single):
            if time.perf_counter() >= deadline:
                break
            a = node_of[e]
            te = by_expert[e]
            # gains of moving e alone to each node b (ignoring the partner f)
            best = None
            for b in range(N):
                if b == a:
                    continue
                de = move_delta(te, a, b).sum()
                cands = list(single[(node_of[single] == b) & (r[single] == r[e])])
                if used[b] + r[e] <= cap_slots:
                    cands.append(-1)  # a plain move
                for f in cands:
                    if f < 0:
                        nl2 = nl.copy()
                        nl2[:, a] -= wl[:, e]
                        nl2[:, b] += wl[:, e]
                        v2 = viol(nl2)
                        if v2 > v_cur + 1e-12:
                            continue
                        key = (v2 - v_cur) * 1e6 + de * scale
                        if key < -1e-12 and (best is None or key < best[0]):
                            best = (key, f, b, nl2, v2)
                        continue
                    dl = wl[:, f] - wl[:, e]  # load change of node a (b gets the opposite)
                    nl2 = nl.copy()
                    nl2[:, a] += dl
                    nl2[:, b] -= dl
                    v2 = viol(nl2)
                    if v2 > v_cur + 1e-12:
                        continue
                    tf = by_expert[f]
                    # tokens picking both e and f keep their node counts (e and f trade nodes)
                    both = np.intersect1d(te, tf, assume_unique=True)
                    d = de - move_delta(both, a, b).sum() + move_delta(np.setdiff1d(tf, both, assume_unique=True), b, a).sum()
                    key = (v2 - v_cur) * 1e6 + d * scale
                    if key < -1e-12 and (best is None or key < best[0]):
                        best = (key, f, b, nl2, v2)
            if best is not None:
                _, f, b, nl2, v2 = best
                moves = ((te, e),) if f < 0 else ((te, e), (by_expert[f], f))
                for t_idx, x in moves:
                    k_e = (sid[t_idx] == x).sum(axis=1).astype(np.int16)
                    src_n, dst_n = (a, b) if x == e else (b, a)
                    cnt[t_idx, src_n] -= k_e
                    cnt[t_idx, dst_n] += k_e
                node_of[e] = b
                used[b] += r[e]
                used[a] -= r[e]
                if f >= 0:
                    node_of[f] = a
                    used[a] += r[f]
                    used[b] -= r[f]
                nl, v_cur = nl2, v2
                swaps += 1
                improved = True
    info = {"rounds": rounds, "swaps": swaps, "violation": v_cur,
            "node_load_ratio_fit": float(nl[0].max() / wmean[0]),
            "node_load_ratio_windows": float((nl[1:].max(axis=1) / wmean[1:]).max()) if nl.shape[0] > 1 else 1.0}
    return node_of, info



def solve_replicated_layer(
    ids: np.ndarray,
    src_node: np.ndarray,
    win: np.ndarray,
    num_windows: int,
    num_experts: int,
    topology,
    num_everywhere: int,
    slack: float,
    time_limit: float,
    seed: int = 0,
    window_weight: float = 1.0,
    pack_time: float = 0.0,
) -> tuple[np.ndarray, dict]:
    """One layer: int64 ``[P]`` physical-to-logical row and info.

    Args:
        ids: int64 ``[T, k]`` fit picks; src_node: int64 ``[T]``; win: int64 ``[T]`` window of each token
            (``0..num_windows-1``); topology: :class:`placement.topology.Topology`.
    """
    from solver.locality import pack_node_gpus

    E, W = int(num_experts), int(num_windows)
    N, m, S, P = topology.num_nodes, topology.gpus_per_node, topology.slots_per_gpu, topology.num_physical_experts
    valid = ids >= 0
    e_v = ids[valid]
    t_v = np.broadcast_to(np.arange(ids.shape[0])[:, None], ids.shape)[valid]
    win_src = np.zeros((W, N, E))
    np.add.at(win_src, (win[t_v], src_node[t_v], e_v), 1.0)
    win_load = win_src.sum(axis=1)  # [W, E]
    load = win_load.sum(axis=0)  # [E]
    every, _ = replicated_counts(load, P, N, m, num_everywhere)
    r = np.where(every, N, 1).astype(np.int64)
    node_of, info = partition_nodes(ids, src_node, every, r, win_load, win_src, N, P // N, slack,
                                    time_limit, seed=seed, window_weight=window_weight)
    # spare slots of each node: extra replicas (same node, other GPUs) of its heaviest experts
    for n in range(N):
        sg = np.flatnonzero(~every & (node_of == n))
        spare = P // N - int(every.sum()) - int(r[sg].sum())
        for _ in range(spare):
            score = np.where(r[sg] < m, load[sg] / r[sg], -np.inf)
            r[sg[int(score.argmax())]] += 1
    src_tot = win_src.sum(axis=0)  # [N, E]
    row = np.empty(P, dtype=np.int64)
    for n in range(N):
        ev = np.flatnonzero(every)
        sg = np.flatnonzero(~every & (node_of == n))
        experts = np.concatenate([ev, np.repeat(sg, r[sg])]).astype(np.int64)
        loads = np.concatenate([src_tot[n, ev], np.repeat(load[sg] / r[sg], r[sg])])
        gpu = pack_node_gpus(experts, loads, m, time_limit=pack_time, seed=seed)
        for gl in range(m):
            g = n * m + gl
            row[g * S:(g + 1) * S] = np.sort(experts[gpu == gl])
    info["num_everywhere"] = int(every.sum())
    return row, info
