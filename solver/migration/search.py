"""The incremental local search of migration-aware re-placement (see :mod:`solver.migration`).

Shapes: E logical experts, G GPUs, S slots per GPU, A experts with >= 2 replicas, B candidate pairs.

:class:`Layer` is one layer's mutable search state (membership ``x [E, G]``, replica counts, even-split
GPU loads); :func:`incremental` runs the global best-efficiency-first search over all layers: replace
(1 moved slot) and swap (2 moved slots) moves, always the one with the best net gain per moved slot,
within a total move budget.
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from solver.migration.slots import membership as _membership

__all__ = ["Layer", "incremental"]


class Layer:
    """Mutable search state of one layer: membership ``x [E, G]``, counts ``[E]``, loads ``[G]``."""

    def __init__(self, w: np.ndarray, prev_row: np.ndarray, E: int, G: int, S: int):
        self.w = w  # [E]
        self.S = S
        self.prev = _membership(prev_row, E, G, S)  # [E, G]
        self.x = self.prev.copy()
        self.cnt = self.x.sum(axis=1).astype(np.int64)  # [E]
        self.moved = 0
        self.moves = {"replace": 0, "swap": 0}
        self.work = 0  # search steps spent: candidate-array elements scored (see MigrationOptions.max_steps)
        self._refresh()
        self.prev_peak = self.peak  # the previous placement's peak
        self.tol = 1e-12 * (float(w.sum()) + 1.0)

    def _refresh(self) -> None:
        u = self.w / self.cnt  # [E] per-replica load
        self.load = (self.x * u[:, None]).sum(axis=0)  # [G]
        self.peak = float(self.load.max())

    def best_move(self, move_cost: float, budget_left: float):
        """Best (efficiency, net, gain, dmoved, move) or None. ``efficiency = net / max(dmoved, 1)``.

        Candidates: every replace, then every swap off the hottest GPU; on equal efficiency the first
        (replace before swap) wins.
        """
        u = self.w / self.cnt  # [E]
        cands = self._replace_candidates(u) + self._swap_candidates(u)
        self.work += sum(c[1].size for c in cands)
        best = None
        for kind, newpeak, valid, dm, idx in cands:
            gain = self.peak - newpeak
            net = gain - move_cost * dm
            ok = valid & (gain > self.tol) & (net > self.tol) & (dm <= budget_left)
            if not ok.any():
                continue
            eff = np.where(ok, net / np.maximum(dm, 1), -np.inf)
            i, j = np.unravel_index(int(np.argmax(eff)), eff.shape)
            cand = (float(eff[i, j]), float(net[i, j]), float(gain[i, j]), int(dm[i, j]), (kind, idx, i, j))
            if best is None or cand[0] > best[0]:
                best = cand
        return best

    def _replace_candidates(self, u: np.ndarray) -> list[tuple]:
        """Replace: on GPU h, expert a (cnt >= 2) -> expert b (not on h).

        Returns ``[("replace", newpeak, valid, dm, (ai, h))]`` with ``[pairs, E]`` arrays (pairs: the
        (A-index, GPU) pairs holding an expert with >= 2 replicas), or ``[]``.
        """
        w, x, cnt, load, prev = self.w, self.x, self.cnt, self.load, self.prev
        E, G = x.shape
        A = np.flatnonzero(cnt >= 2)
        if not A.size:
            return []
        da = w[A] / (cnt[A] - 1) - u[A]  # [A] load rise on a's other GPUs
        ub = w / (cnt + 1)  # [E] b's per-replica load after gaining one
        db = u - ub  # [E] load drop on b's GPUs
        base = (
            load[None, None, :] + da[:, None, None] * x[A][:, None, :] - db[None, :, None] * x[None, :, :]
        )  # [A, E, G]
        self.work += base.size
        if G >= 2:
            part = np.argpartition(-base, 1, axis=2)[:, :, :2]  # [A, E, 2] two largest
            v = np.take_along_axis(base, part, axis=2)
            order = np.argsort(-v, axis=2)
            top_i = np.take_along_axis(part, order, axis=2)  # [A, E, 2]
            top_v = np.take_along_axis(v, order, axis=2)
        ai, h = np.nonzero(x[A])  # pairs: A-index, GPU holding it
        if not ai.size:
            return []
        excl = (
            np.where(top_i[ai, :, 0] == h[:, None], top_v[ai, :, 1], top_v[ai, :, 0])
            if G >= 2
            else np.full((ai.size, E), -np.inf)
        )
        newh = load[h][:, None] - u[A[ai]][:, None] + ub[None, :]  # [pairs, E]
        newpeak = np.maximum(excl, newh)
        valid = ~x[:, h].T  # [pairs, E] b not on h (excludes b == a)
        dm = (~prev[:, h].T).astype(np.int64) - (~prev[A[ai], h]).astype(np.int64)[:, None]  # [pairs, E]
        return [("replace", newpeak, valid, dm, (ai, h))]

    def _swap_candidates(self, u: np.ndarray) -> list[tuple]:
        """Swap: expert a on the hottest GPU g1 <-> expert b on GPU g2.

        Returns ``[("swap", newpeak, valid, dm, (a_list, b_e, b_g, g1))]`` with ``[S, B]`` arrays (B: the
        (expert, GPU) pairs off g1 whose expert g1 lacks), or ``[]``.
        """
        x, load, prev = self.x, self.load, self.prev
        G = x.shape[1]
        g1 = int(np.argmax(load))
        if G < 2:
            return []
        ords = np.argsort(-load, kind="stable")
        a_list = np.flatnonzero(x[:, g1])  # [S]
        b_e, b_g = np.nonzero(x)  # all pairs
        keep = (b_g != g1) & ~x[b_e, g1]
        b_e, b_g = b_e[keep], b_g[keep]
        if not (a_list.size and b_e.size):
            return []
        new1 = load[g1] - u[a_list][:, None] + u[b_e][None, :]  # [S, B]
        new2 = load[b_g][None, :] + u[a_list][:, None] - u[b_e][None, :]
        if G >= 3:
            second, third = ords[1], ords[2]
            other = np.where(b_g == second, load[third], load[second])[None, :]
        else:
            other = np.full((1, b_e.size), -np.inf)
        newpeak = np.maximum(np.maximum(new1, new2), other)
        valid = ~x[a_list][:, b_g]  # [S, B] a not on g2
        dm = (
            (~prev[b_e, g1]).astype(np.int64)[None, :]
            + (~prev[a_list][:, b_g]).astype(np.int64)
            - (~prev[a_list, g1]).astype(np.int64)[:, None]
            - (~prev[b_e, b_g]).astype(np.int64)[None, :]
        )
        return [("swap", newpeak, valid, dm, (a_list, b_e, b_g, g1))]

    def apply(self, move, dm: int) -> None:
        kind, idx, i, j = move
        if kind == "replace":
            ai, h = idx
            A = np.flatnonzero(self.cnt >= 2)
            a, g, b = int(A[ai[i]]), int(h[i]), int(j)
            self.x[a, g], self.x[b, g] = False, True
            self.cnt[a] -= 1
            self.cnt[b] += 1
        else:
            a_list, b_e, b_g, g1 = idx
            a, b, g2 = int(a_list[i]), int(b_e[j]), int(b_g[j])
            self.x[a, g1], self.x[b, g1] = False, True
            self.x[b, g2], self.x[a, g2] = False, True
        self.moved += dm
        self.moves[kind] += 1
        self._refresh()


def incremental(
    states: list[Layer],
    move_cost: float,
    max_moves: float,
    deadline: float,
    max_iters: int,
    max_steps: float = float("inf"),
) -> tuple[int, str]:
    """Run the global best-efficiency-first search in place. Returns ``(iterations, stop)``, ``stop``
    being ``""`` (converged, or ``max_iters``), ``"time"`` (wall deadline) or ``"steps"`` (work limit:
    the layers' summed :attr:`Layer.work` passed ``max_steps``; checked where the deadline is, so the
    result depends on the input only)."""
    budget = max_moves
    heap: list = []
    limited = max_steps < float("inf")
    work = 0.0  # the proposals' work so far (summed over the layers before this one)
    for l, st in enumerate(states):
        if limited and work > max_steps:
            return 0, "steps"  # the first proposals alone used the work limit up: no move taken
        if time.perf_counter() > deadline:
            return 0, "time"  # the wall clock ran out before every layer had a proposal: no move taken
        bm = st.best_move(move_cost, budget)
        work += st.work
        if bm is not None:
            heapq.heappush(heap, (-bm[0], l, bm))
    it = 0
    while heap and it < max_iters:
        if limited and sum(st.work for st in states) > max_steps:
            return it, "steps"
        if time.perf_counter() > deadline:
            return it, "time"
        _, l, bm = heapq.heappop(heap)
        st = states[l]
        if bm[3] > budget:  # budget shrank since this proposal: re-propose
            bm = st.best_move(move_cost, budget)
            if bm is not None:
                heapq.heappush(heap, (-bm[0], l, bm))
            continue
        st.apply(bm[4], bm[3])
        budget -= bm[3]
        it += 1
        nb = st.best_move(move_cost, budget)
        if nb is not None:
            heapq.heappush(heap, (-nb[0], l, nb))
    return it, ""
