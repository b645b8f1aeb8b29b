"""One layer of the ``affinity`` solver: which experts each node holds, given each node's demand.

Shapes: N nodes, m GPUs per node, S slots per GPU, C = m x S slots per node, E logical experts.

``demand [N, E]`` is the picks each node's requests (the group routed there) make to each expert. Under
a local-first dispatch a node's picks of an expert it holds stay on the node, and the picks of nodes
that do not hold it spread over all its replicas. The steps (:func:`place_layer`):

1. select (:func:`select_sets`): (node, expert) pairs by decreasing demand, each node up to its ``C``
   slots, one replica per node, always leaving enough free slots for the experts no node holds yet;
   then each uncovered expert on the node with room that wants it most. An expert every group uses
   ends on every node; one group's expert on that group's node.
2. balance nodes (:func:`balance_nodes`): while the busiest node's load (its own picks of what it
   holds plus its share of the others' picks) is over ``(1 + slack)`` x the mean, swap one expert of
   it with one of a lighter node, the swap that lowers the pair's peak most per demand made remote.
3. split (:func:`split_heavy`): slots left over (a node with more slots than experts to choose) take
   second replicas of its heaviest; then a replica heavier than ``split_at`` x its node's mean GPU load gets a
   second replica on the node (another GPU) in place of the node's least demanded expert that has a
   replica elsewhere.
4. pack (:func:`pack_nodes`): each node's replicas onto its GPUs, heaviest first onto the lightest GPU
   with room that does not hold that expert yet (:func:`solver.greedy.balanced_packing`).
"""

from __future__ import annotations

import numpy as np

from solver.greedy import balanced_packing

__all__ = ["balance_nodes", "item_loads", "pack_nodes", "place_layer", "select_sets", "split_heavy"]


def item_loads(demand: np.ndarray, hold: np.ndarray) -> np.ndarray:
    """float64 ``[N, E]``: the load node ``n``'s replicas of ``e`` take (all of them together).

    Args:
        demand: ``[N, E]``; hold: int ``[N, E]`` replicas of each expert on each node.
    """
    held = hold > 0
    remote = (demand * ~held).sum(axis=0)  # [E] picks from nodes that hold no replica
    per_replica = remote / np.maximum(hold.sum(axis=0), 1)
    return held * demand + hold * per_replica[None, :]


def select_sets(demand: np.ndarray, slots_per_node: int) -> np.ndarray:
    """Step 1: int64 ``[N, E]`` one replica per chosen (node, expert), every expert on some node."""
    N, E = demand.shape
    hold = np.zeros((N, E), dtype=np.int64)
    free = np.full(N, int(slots_per_node))
    covered = np.zeros(E, dtype=bool)
    for idx in np.argsort(-demand, axis=None, kind="stable"):
        n, e = divmod(int(idx), E)
        if free[n] == 0 or hold[n, e]:
            continue
        if covered[e] and free.sum() - 1 < int((~covered).sum()):
            continue  # the slot is needed for an expert no node holds yet
        hold[n, e], covered[e] = 1, True
        free[n] -= 1
    for e in np.flatnonzero(~covered):
        room = np.flatnonzero(free > 0)
        n = int(room[np.argmax(demand[room, e])])
        hold[n, e] = 1
        free[n] -= 1
    return hold


def _best_swap(demand, hold, hi: int, lo: int) -> tuple[float, int, int] | None:
    """The swap of expert ``e`` (on ``hi``, not on ``lo``) with ``f`` (on ``lo``, not on ``hi``) that lowers
    ``max(load hi, load lo)`` most per pick made remote: ``(score, e, f)`` or None. All pairs at once:
    a swap changes the two nodes' own picks of ``e`` and ``f`` and those experts' remote shares."""
    d, held = demand, hold > 0
    cnt = np.maximum(hold.sum(axis=0), 1)
    remote = (d * ~held).sum(axis=0)  # [E]
    loads = item_loads(d, hold).sum(axis=1)
    A = np.flatnonzero(held[hi] & ~held[lo])  # experts leaving hi
    B = np.flatnonzero(held[lo] & ~held[hi])  # experts leaving lo
    if not A.size or not B.size:
        return None
    re_new = remote[A] + d[hi, A] - d[lo, A]  # [A] e's remote picks once lo holds it instead of hi
    rf_new = remote[B] + d[lo, B] - d[hi, B]
    out_hi = d[hi, A] + remote[A] / cnt[A]  # [A] what hi sheds
    in_hi = d[hi, B] + rf_new / cnt[B]  # [B] what hi takes
    out_lo = d[lo, B] + remote[B] / cnt[B]
    in_lo = d[lo, A] + re_new / cnt[A]
    new_hi = loads[hi] - out_hi[:, None] + in_hi[None, :]  # [A, B]
    new_lo = loads[lo] - out_lo[None, :] + in_lo[:, None]
    gain = max(loads[hi], loads[lo]) - np.maximum(new_hi, new_lo)
    lost = np.maximum(d[hi, A][:, None] + d[lo, B][None, :] - d[lo, A][:, None] - d[hi, B][None, :], 0.0)
    score = np.where(gain > 1e-9, gain / (lost + 1e-9 * max(loads[hi], 1.0)), -np.inf)
    i, j = np.unravel_index(int(np.argmax(score)), score.shape)
    return None if not np.isfinite(score[i, j]) else (float(score[i, j]), int(A[i]), int(B[j]))


def balance_nodes(demand: np.ndarray, hold: np.ndarray, slack: float, max_swaps: int) -> np.ndarray:
    """Step 2: ``hold`` with swaps until the busiest node is within ``(1 + slack)`` x the mean."""
    hold = hold.copy()
    for _ in range(int(max_swaps)):
        loads = item_loads(demand, hold).sum(axis=1)
        hi = int(np.argmax(loads))
        if loads[hi] <= (1.0 + slack) * loads.mean():
            break
        swap = None
        for lo in np.argsort(loads, kind="stable")[:2]:
            if lo != hi:
                cand = _best_swap(demand, hold, hi, int(lo))
                if cand is not None and (swap is None or cand[0] > swap[0]):
                    swap = (*cand, int(lo))
        if swap is None:
            break
        _, e, f, lo = swap
        hold[hi, e], hold[lo, e], hold[lo, f], hold[hi, f] = 0, 1, 0, 1
    return hold


def _fill(demand: np.ndarray, hold: np.ndarray, slots_per_node: int, m: int) -> np.ndarray:
    """Free slots (a node with more slots than experts to choose) take second replicas of its heaviest."""
    hold = hold.copy()
    for n in range(hold.shape[0]):
        while hold[n].sum() < slots_per_node:
            per = np.where(hold[n] < m, item_loads(demand, hold)[n] / np.maximum(hold[n], 1), -np.inf)
            hold[n, int(np.argmax(per))] += 1
    return hold


def split_heavy(demand: np.ndarray, hold: np.ndarray, gpus_per_node: int, split_at: float) -> np.ndarray:
    """Step 3: ``hold`` with extra same-node replicas for replicas over ``split_at`` x the node's mean
    GPU load (at most one per GPU of the node)."""
    hold = hold.copy()
    m, (N, E) = int(gpus_per_node), hold.shape
    for _ in range(N * E):
        load = item_loads(demand, hold)
        per_gpu = load.sum(axis=1) / m  # [N]
        ratio = np.where(hold > 0, load / np.maximum(hold, 1), 0.0) / np.maximum(per_gpu, 1e-12)[:, None]
        n, e = np.unravel_index(int(np.argmax(np.where(hold < m, ratio, 0.0))), ratio.shape)
        if ratio[n, e] <= split_at:
            break
        removable = (hold[n] > 0) & (hold.sum(axis=0) > 1) & (np.arange(E) != e)
        if not removable.any():
            break
        r = int(np.argmin(np.where(removable, demand[n] / np.maximum(hold[n], 1), np.inf)))
        hold[n, r] -= 1
        hold[n, e] += 1
    return hold


def pack_nodes(demand: np.ndarray, hold: np.ndarray, gpus_per_node: int) -> np.ndarray:
    """Step 4: int64 ``[P]`` the physical-to-logical row, node by node, GPU by GPU."""
    m = int(gpus_per_node)
    load = item_loads(demand, hold)
    row = []
    for n in range(hold.shape[0]):
        items = np.repeat(np.arange(hold.shape[1]), hold[n])
        w = np.repeat(load[n] / np.maximum(hold[n], 1), hold[n])
        pack, _ = balanced_packing(w[None, :], m, item_key=items[None, :])
        for g in range(m):
            row.extend(items[pack[0] == g].tolist())
    return np.asarray(row, dtype=np.int64)


def place_layer(
    demand: np.ndarray, gpus_per_node: int, slots_per_gpu: int, node_slack: float, split_at: float
) -> np.ndarray:
    """One layer's physical-to-logical row ``[P]`` from the nodes' demand ``[N, E]`` (module docstring)."""
    d = np.asarray(demand, dtype=np.float64)
    hold = select_sets(d, int(gpus_per_node) * int(slots_per_gpu))
    hold = balance_nodes(d, hold, node_slack, max_swaps=4 * d.shape[0])
    hold = _fill(d, hold, int(gpus_per_node) * int(slots_per_gpu), int(gpus_per_node))
    hold = split_heavy(d, hold, gpus_per_node, split_at)
    return pack_nodes(d, hold, gpus_per_node)
