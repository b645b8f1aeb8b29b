"""GPU-peak repair of one layer's row, for the replicated locality method (:mod:`solver.locality.replicated`).

Shapes: P physical slots, G GPUs, N nodes, m GPUs per node, S slots per GPU, E logical experts,
V load views (fit total, windows), T tokens, k top-k.

:func:`gpu_repair` swaps slots until no GPU is above its cap on any view, each step the cheapest in
fitted remote nodes: swaps inside a node, swaps of two single-replica experts across nodes, and
zero-cost re-splits inside a node (a second replica of one expert becomes a replica of another).
"""

from __future__ import annotations

import numpy as np

from placement.topology import Topology
from solver.budget import Budget, as_budget
from solver.locality.reach import FitViews, NodeReach, token_sample

__all__ = ["gpu_repair"]


def gpu_repair(
    row: np.ndarray,
    every: np.ndarray,
    views: FitViews,
    topology: Topology,
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
        row: int64 ``[P]`` physical-to-logical row; every: bool ``[E]``; views: the layer's fit data
            (:class:`~solver.locality.reach.FitViews`: picks per view, by source node, and the tokens);
            gpu_cap: float64 ``[V]`` absolute peak caps.

    Returns:
        ``(row int64 [P], info)``.
    """
    rng = np.random.default_rng(seed)
    rep = _Repair(row, every, views.load, views.src, topology, gpu_cap)
    tok = token_sample(rng, views.ids.shape[0], sample)
    sid, ssrc = views.ids[tok], views.src_node[tok]
    rep.reach = NodeReach(sid, ssrc, every, rep.node_of, topology.num_nodes)
    rep.scale = 1.0 / max(sid.shape[0], 1)
    budget = as_budget(time_limit)
    steps, cost_sum = 0, 0.0
    start = rep.excess(rep.gl)
    cur = start
    while cur > 0 and budget.ok():
        budget.tick()
        hot = np.unique(rep.gl.argmax(axis=1)[rep.gl.max(axis=1) > rep.cap])  # GPUs at a violated peak
        best = rep.best_swap(hot, cur)
        best = rep.best_resplit(hot, cur, best)
        if best is None:
            break
        (cost, ex), p, q, rep.gl = best
        if p < 0:  # re-split: slot -1-p becomes expert q
            rep.resplit(-1 - p, q)
        else:
            rep.swap(p, q)
            cost_sum += cost
        cur = ex
        steps += 1
    return rep.canonical_row(), {
        "repair_steps": steps,
        "repair_remote_cost": cost_sum,
        "excess_start": start,
        "excess_end": cur,
    }


class _Repair:
    """One layer's row under repair and the loads it implies.

    State: ``row`` int64 ``[P]``; ``rn`` int64 ``[N, E]`` replicas of each expert on each node;
    ``basev`` float64 ``[V, N, E]`` load a node serves for an expert (sources for everywhere experts, all
    picks for single-node experts), split over its replicas there; ``sl`` float64 ``[V, P]`` slot loads;
    ``gl`` float64 ``[V, G]`` GPU loads; ``node_of`` int64 ``[E]`` (-1: everywhere); ``reach`` and
    ``scale`` (1 / sampled tokens) price cross-node trades.
    """

    def __init__(
        self,
        row: np.ndarray,
        every: np.ndarray,
        load: np.ndarray,
        src_tot: np.ndarray,
        topology: Topology,
        gpu_cap: np.ndarray,
    ):
        N, m, S, P = (
            topology.num_nodes,
            topology.gpus_per_node,
            topology.slots_per_gpu,
            topology.num_physical_experts,
        )
        self.N, self.m, self.S, self.G, self.E = N, m, S, N * m, every.size
        load = np.atleast_2d(load)
        src_tot = src_tot if src_tot.ndim == 3 else src_tot[None]
        self.cap = np.asarray(gpu_cap, dtype=np.float64).reshape(-1)  # [V]
        self.every = every
        self.row = row = row.copy()
        self.slot_gpu = slot_gpu = np.arange(P) // S
        self.slot_node = slot_node = slot_gpu // m
        self.rn = np.zeros((N, self.E), dtype=np.int64)  # replicas of each expert on each node
        np.add.at(self.rn, (slot_node, row), 1)
        self.basev = np.where(every[None, None, :], src_tot, load[:, None, :])  # [V, N, E]
        self.sl = self.basev[:, slot_node, row] / self.rn[slot_node, row][None, :]  # [V, P]
        self.gl = np.stack([np.bincount(slot_gpu, weights=x, minlength=self.G) for x in self.sl])  # [V, G]
        self.node_of = np.full(self.E, -1, dtype=np.int64)
        self.node_of[row[~every[row]]] = slot_node[~every[row]]
        self.reach: NodeReach | None = None
        self.scale = 1.0

    def excess(self, x: np.ndarray) -> float:
        """Total relative excess over the caps of GPU loads ``x`` float64 ``[V, G]``."""
        return float((np.maximum(x.max(axis=1) - self.cap, 0.0) / self.cap).sum())

    def swap_costs(self) -> np.ndarray:
        """Remote-node change per token ``[E, E]`` of trading the nodes of two single-node experts."""
        move, kp, _ = self.reach.deltas(self.node_of)
        a_all = np.maximum(self.node_of, 0)
        return (move[:, a_all].T + move[:, a_all] + kp) * self.scale  # [x, y]: x to y's node, y to x's

    def best_swap(self, hot: np.ndarray, cur: float) -> tuple | None:
        """The cheapest swap of a slot on a ``hot`` GPU with any slot that lowers the excess below ``cur``:
        ``((cost, excess), p, q, gl [V, G] after)``, or None. Every pair is scored at once."""
        S, G, row, sl, gl, cap = self.S, self.G, self.row, self.sl, self.gl, self.cap
        slot_gpu, slot_node = self.slot_gpu, self.slot_node
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
        has = np.zeros((G, self.E), dtype=bool)
        has[slot_gpu, row] = True
        single_rep = ~self.every & (self.rn.sum(axis=0) == 1)  # [E] movable across nodes
        ok = (gq[None, :] != gp[:, None]) & (x_p != y_q) & (ex_pq < cur - 1e-12)
        ok &= np.where(
            cross, single_rep[x_p] & single_rep[y_q], ~has[gq[None, :], x_p] & ~has[gp[:, None], y_q]
        )
        if not ok.any():
            return None
        cost_pq = np.zeros(ok.shape)
        if (ok & cross).any():
            cost_pq = np.where(cross, self.swap_costs()[x_p, y_q], 0.0)
        key_cost = np.where(ok, cost_pq, np.inf)
        ip, iq = np.unravel_index(np.lexsort((ex_pq.ravel(), key_cost.ravel()))[0], ok.shape)
        gl2 = gl.copy()
        gl2[:, slot_gpu[ps[ip]]] -= d[:, ip, iq]
        gl2[:, slot_gpu[iq]] += d[:, ip, iq]
        return ((float(key_cost[ip, iq]), float(ex_pq[ip, iq])), int(ps[ip]), int(iq), gl2)

    def best_resplit(self, hot: np.ndarray, cur: float, best: tuple | None) -> tuple | None:
        """``best`` or a better zero-cost re-split inside a node: a slot holding a second replica of ``x``
        becomes a replica of ``y``; as ``((0, excess), -1 - slot, y, gl [V, G] after)``."""
        m, S, row, rn, gl = self.m, self.S, self.row, self.rn, self.gl
        for n in np.unique(hot // m):
            slots_n = np.arange(n * m * S, (n + 1) * m * S)
            on_n = np.flatnonzero(rn[n] > 0)
            for q in slots_n[rn[n, row[slots_n]] >= 2]:
                hq = self.slot_gpu[q]
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
                    sl_n = self.basev[:, n, e_n] / rn2[e_n][None, :]  # [V, m*S]
                    gl2 = gl.copy()
                    gl2[:, n * m : (n + 1) * m] = sl_n.reshape(sl_n.shape[0], m, S).sum(axis=2)
                    ex = self.excess(gl2)
                    if ex >= cur - 1e-12:
                        continue
                    key = (0.0, ex)
                    if best is None or key < best[0]:
                        best = (key, -1 - q, int(y), gl2)
        return best

    def resplit(self, qs: int, y: int) -> None:
        """Slot ``qs`` (a second replica on its node) becomes a replica of expert ``y``."""
        m, S, row, rn = self.m, self.S, self.row, self.rn
        n = self.slot_node[qs]
        rn[n, row[qs]] -= 1
        rn[n, y] += 1
        row[qs] = y
        slots_n = np.arange(n * m * S, (n + 1) * m * S)
        self.sl[:, slots_n] = self.basev[:, n, row[slots_n]] / rn[n, row[slots_n]][None, :]

    def swap(self, p: int, q: int) -> None:
        """Exchange the experts of slots ``p`` and ``q`` (across nodes: the two experts trade nodes)."""
        row, rn = self.row, self.rn
        x, y = row[p], row[q]
        a, b = self.slot_node[p], self.slot_node[q]
        if a != b:
            self.reach.relocate(x, a, b)
            self.reach.relocate(y, b, a)
            self.node_of[x], self.node_of[y] = b, a
            rn[a, x] -= 1
            rn[b, x] += 1
            rn[b, y] -= 1
            rn[a, y] += 1
        row[p], row[q] = y, x
        self.sl[:, [p, q]] = self.sl[:, [q, p]]

    def canonical_row(self) -> np.ndarray:
        """The row with each GPU's slots sorted: int64 ``[P]``."""
        row, S = self.row, self.S
        for g in range(self.G):
            row[g * S : (g + 1) * S] = np.sort(row[g * S : (g + 1) * S])
        return row
