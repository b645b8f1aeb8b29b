"""Node partition of the single-node experts, for the replicated locality method.

Shapes: E logical experts, N nodes, T tokens (T' in the token sample), k top-k, W fit windows, V = W + 1
balance views (the fit total, then every window).

:func:`partition_nodes` assigns every expert that is not on all nodes to one node: a greedy affinity
start, a descent over every plain move and every equal-size swap (scored at once, best improvement:
balance violation first, then fitted remote nodes), then iterated local search (random swaps, descend
again, keep improvements) while the budget lasts. Used by :mod:`solver.locality.replicated`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solver.budget import Budget, as_budget
from solver.locality.reach import NodeReach, token_sample

__all__ = ["PartitionSpec", "partition_nodes"]


@dataclass(frozen=True)
class PartitionSpec:
    """What :func:`partition_nodes` balances, and how it searches (fixed for one layer).

    Attributes:
        win_load: float64 ``[W, E]`` picks per fit window; win_src: float64 ``[W, N, E]`` the same by
            source node (see :func:`solver.locality.replicated.window_node_loads`).
        num_nodes: ``N``; slots_per_node: ``P / N``.
        slack: node loads within ``(1 + slack) x`` the mean on the fit total.
        seed: seeds the token sample and the kicks; sample: tokens in the sample that prices moves.
        window_weight: scales the per-window violation terms against the fit-total term.
        window_slack: node loads within ``(1 + window_slack) x`` each window's mean (None: ``slack``).
        single_margin: single-node experts per node at most ``ceil(n_single / N) + single_margin``
            (None: only the slot limit).
    """

    win_load: np.ndarray
    win_src: np.ndarray
    num_nodes: int
    slots_per_node: int
    slack: float
    seed: int = 0
    sample: int = 20000
    window_weight: float = 1.0
    window_slack: float | None = None
    single_margin: int | None = None


def partition_nodes(
    ids: np.ndarray,
    src_node: np.ndarray,
    every: np.ndarray,
    r: np.ndarray,
    spec: PartitionSpec,
    time_limit: float | Budget,
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
        spec: the views, node sizes, slacks and search settings (:class:`PartitionSpec`).
        init: optional int64 ``[E]`` start layout (node of each single-node expert) instead of the greedy start.
        perturb: run the kicks after the first descent.

    Returns:
        ``(node_of int64 [E] (-1 for everywhere experts), info dict)``.
    """
    rng = np.random.default_rng(spec.seed)
    N = int(spec.num_nodes)
    single = np.flatnonzero(~every)
    cap_slots = _single_slots(every, r, single, N, spec.slots_per_node, spec.single_margin)
    tok = token_sample(rng, ids.shape[0], spec.sample)
    sid, ssrc = ids[tok], src_node[tok]
    reach = NodeReach(sid, ssrc, every, np.full(every.size, -1, dtype=np.int64), N)
    views = _Views.build(
        spec.win_load, spec.win_src, every, N, spec.slack, spec.window_slack, spec.window_weight
    )
    search = _PartitionSearch(reach, views, r, single, cap_slots, N)
    if init is not None:  # a given start (e.g. a perturbed earlier result): same slot accounting
        search.start_from(init)
    else:
        search.start_greedy(every)
    search.budget = as_budget(time_limit)
    search.first_descent()
    search.kick_loop(rng, perturb)
    return search.node_of, search.info()


def _single_slots(
    every: np.ndarray,
    r: np.ndarray,
    single: np.ndarray,
    N: int,
    slots_per_node: int,
    single_margin: int | None,
) -> int:
    """Slots per node for single-node replicas (``r`` int64 ``[E]``), after the everywhere experts
    (``every`` bool ``[E]``) and the ``single_margin`` cap; ValueError when they cannot fit."""
    cap_slots = slots_per_node - int(every.sum())
    if int(r[single].sum()) > cap_slots * N:
        raise ValueError(
            f"single-node replicas {int(r[single].sum())} exceed {cap_slots} free slots x {N} nodes"
        )
    if single_margin is not None:  # keep spare slots on every node for splitting its heavy experts
        cap_slots = min(cap_slots, -(-int(r[single].sum()) // N) + int(single_margin))
    return cap_slots


@dataclass(frozen=True)
class _Views:
    """The balance views of a partition: the fit total (row 0), then every fit window.

    Attributes:
        wl: float64 ``[V, E]`` picks per view; wmean: float64 ``[V]`` mean node load per view (1 where 0);
        wts: float64 ``[V]`` weight of each view's violation; base: float64 ``[V, N]`` node loads of the
        everywhere experts (served where the token is); lim: float64 ``[V, 1]`` node-load cap per view.
    """

    wl: np.ndarray
    wmean: np.ndarray
    wts: np.ndarray
    base: np.ndarray
    lim: np.ndarray

    @classmethod
    def build(
        cls,
        win_load: np.ndarray,
        win_src: np.ndarray,
        every: np.ndarray,
        N: int,
        slack: float,
        window_slack: float | None,
        window_weight: float,
    ) -> _Views:
        """Views from ``win_load`` float64 ``[W, E]`` and ``win_src`` float64 ``[W, N, E]``."""
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
        return cls(wl, wmean, wts, base, lim)

    def viol(self, nl: np.ndarray) -> float:
        """Balance violation of node loads ``nl`` float64 ``[V, N]``."""
        return float((self.wts[:, None] * np.maximum(nl - self.lim, 0.0) / self.wmean[:, None]).sum())

    def contrib(self, load: np.ndarray) -> np.ndarray:
        """Violation of node loads ``load [V, ...]`` (summed over views): float64 ``[...]``."""
        lv = self.lim.reshape((-1,) + (1,) * (load.ndim - 1))
        return (self.wts.reshape(lv.shape) * np.maximum(load - lv, 0.0) / self.wmean.reshape(lv.shape)).sum(
            axis=0
        )


class _PartitionSearch:
    """A node layout of the single-node experts and its local search.

    State: ``node_of`` int64 ``[E]`` (-1: everywhere), ``used`` int64 ``[N]`` slots taken, ``nl``
    float64 ``[V, N]`` node loads per view, ``v_cur`` the layout's violation, ``reach`` the token
    sample's node counts; counters ``rounds`` (descents), ``swaps`` (steps taken), ``kicks``, ``kept``.
    """

    def __init__(
        self, reach: NodeReach, views: _Views, r: np.ndarray, single: np.ndarray, cap_slots: int, N: int
    ):
        self.reach, self.views, self.r, self.single = reach, views, r, single
        self.cap_slots, self.N = cap_slots, N
        self.node_of = np.full(views.wl.shape[1], -1, dtype=np.int64)
        self.used = np.zeros(N, dtype=np.int64)
        self.nl = views.base.copy()  # [W+1, N]
        self.scale = 1.0 / max(reach.X.shape[0], 1)
        self.budget: Budget | None = None
        self.v_cur = 0.0
        self.rounds = self.swaps = self.kicks = self.kept = 0

    def rebuild(self) -> None:
        """Recompute ``used [N]`` and ``nl [V, N]`` from ``node_of``."""
        r, single = self.r, self.single
        self.used = np.zeros(self.N, dtype=np.int64)
        np.add.at(self.used, self.node_of[single], r[single])
        member = np.zeros((self.N, self.node_of.size))
        member[self.node_of[single], single] = 1.0
        self.nl = self.views.base + (member @ self.views.wl.T).T  # [W+1, N]

    def start_from(self, init: np.ndarray) -> None:
        """Start from a given layout ``init`` int64 ``[E]`` (its single-node entries)."""
        self.node_of[self.single] = np.asarray(init, dtype=np.int64)[self.single]
        self.rebuild()

    def start_greedy(self, every: np.ndarray) -> None:
        """Experts by load, each to the node with most co-activation among those with room and no window
        over the cap; ties to the least loaded."""
        xs = self.reach.X * ~every[None, :]  # pair weights among single-node experts (tokens picking both)
        coact = (xs.T @ xs).astype(np.float64)
        np.fill_diagonal(coact, 0.0)
        wl, lim, wmean, nl, node_of = self.views.wl, self.views.lim, self.views.wmean, self.nl, self.node_of
        for e in self.single[np.argsort(-wl[0, self.single], kind="stable")]:
            room = self.used + self.r[e] <= self.cap_slots
            aff = np.array([coact[e, node_of == n].sum() for n in range(self.N)])
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
            self.used[n] += self.r[e]
            nl[:, n] += wl[:, e]

    def relocate(self, e: int, a: int, b: int) -> None:
        """Move single-node expert ``e`` from node ``a`` to ``b`` (all state)."""
        self.node_of[e] = b
        self.used[a] -= self.r[e]
        self.used[b] += self.r[e]
        self.nl[:, a] -= self.views.wl[:, e]
        self.nl[:, b] += self.views.wl[:, e]
        self.reach.relocate(e, a, b)

    def best_move(self, move: np.ndarray, c_now: np.ndarray, best: tuple) -> tuple:
        """``best`` or a better plain move ``(key, ("move", e, -1, b))``; ``move`` float ``[E, N]``
        remote-node changes, ``c_now`` float64 ``[N]`` violation per node."""
        single, wl, nl, node_of, r = self.single, self.views.wl, self.nl, self.node_of, self.r
        for b in range(self.N):  # plain moves into node b
            es = single[(node_of[single] != b) & (self.used[b] + r[single] <= self.cap_slots)]
            if es.size == 0:
                continue
            a = node_of[es]
            dv = (
                self.views.contrib(nl[:, a] - wl[:, es])
                + self.views.contrib(nl[:, b : b + 1] + wl[:, es])
                - c_now[a]
                - c_now[b]
            )
            key = np.where(dv <= 1e-12, dv * 1e6 + move[es, b] * self.scale, np.inf)
            i = int(key.argmin())
            if key[i] < best[0]:
                best = (float(key[i]), ("move", int(es[i]), -1, b))
        return best

    def best_swap(self, move: np.ndarray, kp: np.ndarray, c_now: np.ndarray, best: tuple) -> tuple:
        """``best`` or a better swap of two equal-size experts on nodes ``a < b``:
        ``(key, ("swap", e, f, b))``; ``kp`` float ``[E, E]`` pair corrections (:meth:`NodeReach.deltas`)."""
        single, wl, nl, node_of, r = self.single, self.views.wl, self.nl, self.node_of, self.r
        for a in range(self.N):  # swaps between nodes a < b
            ea = single[node_of[single] == a]
            if ea.size == 0:
                continue
            for b in range(a + 1, self.N):
                fb = single[node_of[single] == b]
                if fb.size == 0:
                    continue
                dl = wl[:, fb][:, None, :] - wl[:, ea][:, :, None]  # [V, na, nb] load change of node a
                dv = (
                    self.views.contrib(nl[:, a][:, None, None] + dl)
                    + self.views.contrib(nl[:, b][:, None, None] - dl)
                    - c_now[a]
                    - c_now[b]
                )
                d = move[ea, b][:, None] + move[fb, a][None, :] + kp[np.ix_(ea, fb)]
                key = np.where(
                    (dv <= 1e-12) & (r[ea][:, None] == r[fb][None, :]), dv * 1e6 + d * self.scale, np.inf
                )
                i, j = np.unravel_index(int(key.argmin()), key.shape)
                if key[i, j] < best[0]:
                    best = (float(key[i, j]), ("swap", int(ea[i]), int(fb[j]), b))
        return best

    def step(self) -> bool:
        """Apply the best improving move or swap (feasibility first, then remote nodes); False if none."""
        move, kp, _ = self.reach.deltas(self.node_of)  # [E, N], [E, E]
        c_now = self.views.contrib(self.nl)  # [N]
        best = self.best_move(move, c_now, (-1e-12, None))
        best = self.best_swap(move, kp, c_now, best)
        if best[1] is None:
            return False
        kind, e, f, b = best[1]
        a = int(self.node_of[e])
        self.relocate(e, a, b)
        if kind == "swap":
            self.relocate(f, b, a)
        self.v_cur = self.views.viol(self.nl)
        self.swaps += 1
        return True

    def descend(self) -> None:
        """Steps while they improve and the budget lasts (one budget tick per step)."""
        self.rounds += 1
        while self.budget.ok() and self.step():
            self.budget.tick()

    def first_descent(self) -> None:
        """Count the start layout's reach and violation, then descend."""
        self.reach.recount(self.node_of)
        self.v_cur = self.views.viol(self.nl)
        self.descend()

    def kick_loop(self, rng: np.random.Generator, perturb: bool) -> None:
        """Iterated local search: perturb the best layout by a few random swaps of equal-size experts on
        different nodes, descend again, keep the result if it is no less feasible and has fewer remote
        nodes; else restore the best layout."""
        single, r = self.single, self.r
        best = (self.v_cur, self.reach.remote(), self.node_of.copy())
        while perturb and self.budget.ok() and single.size > 1:
            self.budget.tick()  # a kick costs at least one step, even when its descent finds nothing
            self.kicks += 1
            node_of = self.node_of
            for _ in range(int(rng.integers(2, 6))):
                a_e, b_e = rng.choice(single, 2, replace=False)
                if node_of[a_e] != node_of[b_e] and r[a_e] == r[b_e]:
                    node_of[a_e], node_of[b_e] = node_of[b_e], node_of[a_e]
            self.rebuild()
            self.reach.recount(self.node_of)
            self.v_cur = self.views.viol(self.nl)
            self.descend()
            f = self.reach.remote()
            if self.v_cur <= best[0] + 1e-12 and f < best[1]:
                best = (self.v_cur, f, self.node_of.copy())
                self.kept += 1
            else:
                self.node_of = best[2].copy()
                self.rebuild()
                self.v_cur = self.views.viol(self.nl)
                self.reach.recount(self.node_of)

    def info(self) -> dict:
        """Search counters, the final violation and node-load ratios (fit total, worst window)."""
        nl, wmean = self.nl, self.views.wmean
        return {
            "rounds": self.rounds,
            "swaps": self.swaps,
            "violation": self.v_cur,
            "kicks": self.kicks,
            "kicks_kept": self.kept,
            "node_load_ratio_fit": float(nl[0].max() / wmean[0]),
            "node_load_ratio_windows": float((nl[1:].max(axis=1) / wmean[1:]).max())
            if nl.shape[0] > 1
            else 1.0,
        }
