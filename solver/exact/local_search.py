"""Deterministic local search on one layer: swaps with the hottest GPU and slot re-counts.

Shapes: ``E`` experts, ``G`` GPUs with ``S`` slots, ``W`` windows; ``assign`` int ``[G, S]``,
``counts`` int64 ``[E]``, ``holds`` bool ``[G, E]`` (GPU ``g`` holds a replica of ``e``), ``L`` float
``[W, G]`` GPU loads per window. A move is ``(score, kind, data)`` with ``score`` = (objective, sum of
squared loads), ``kind`` ``"swap"`` (data ``(i, g, j)``: slot ``i`` of the hottest GPU ``h`` <-> slot
``j`` of ``g``) or ``"recount"`` (data ``(g, j, b)``: slot ``(g, j)`` goes to expert ``b``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from solver.exact.layer_problem import _better, _counts_of, _Layer

_Move = tuple[tuple[float, float], str, tuple[int, int, int]]


@dataclass
class _SearchState:
    """The assignment being improved, with its counts, the holds matrix and (nodes) each expert's node."""

    assign: np.ndarray  # [G, S]
    counts: np.ndarray  # [E]
    holds: np.ndarray  # [G, E] bool
    node_of_expert: np.ndarray | None  # [E] when node constrained


def _search_state(pb: _Layer, assign: np.ndarray) -> _SearchState:
    """A copy of ``assign [G, S]`` with its counts ``[E]``, holds ``[G, E]`` and experts' nodes ``[E]``."""
    G, S, E = pb.G, pb.S, pb.E
    assign = assign.copy()
    counts = _counts_of(assign, E)
    holds = np.zeros((G, E), dtype=bool)
    holds[np.repeat(np.arange(G), S), assign.ravel()] = True
    node_of_expert = None
    node = pb.node_of_gpu
    if node is not None:
        node_of_expert = np.full(E, -1)
        for g in range(G):
            node_of_expert[assign[g]] = node[g]
    return _SearchState(assign, counts, holds, node_of_expert)


def _score(pb: _Layer, L: np.ndarray) -> tuple[float, float]:
    """(objective, sum of squared loads) of the loads ``L [W, G]``."""
    return (float(pb.agg(L.max(axis=-1))), float((L * L).sum()))


def _local_search(
    pb: _Layer, assign: np.ndarray, max_iters: int, deadline: float | None
) -> tuple[np.ndarray, int]:
    """Deterministic descent on (objective, sum of squared loads) from ``assign [G, S]``.

    Moves: swap an item of the hottest GPU with an item of another GPU (same node when node
    constrained), and re-assign one slot from expert ``a`` (with >= 2 replicas) to expert ``b``.
    Returns the improved assignment and the iterations done.
    """
    st = _search_state(pb, assign)
    ar_e = np.arange(pb.E)
    L = pb.loads(st.assign, st.counts)  # [W, G]
    cur = _score(pb, L)
    it = 0
    while it < max_iters and (deadline is None or time.perf_counter() < deadline):
        it += 1
        per = pb.cost[:, ar_e, st.counts]  # [W, E]
        peaks = L.max(axis=1)
        wcrit = int(np.argmax(peaks))
        h = int(np.argmax(L[wcrit]))
        best = _best_swap(pb, st, L, per, h, cur)
        recount = _best_recount(pb, st, L, h, cur)
        if recount is not None and (best is None or _better(recount[0], best[0])):
            best = recount
        if best is None:
            break
        _apply_move(st, h, best)
        L = pb.loads(st.assign, st.counts)
        cur = _score(pb, L)
    return st.assign, it


def _best_swap(
    pb: _Layer, st: _SearchState, L: np.ndarray, per: np.ndarray, h: int, cur: tuple[float, float]
) -> _Move | None:
    """The best swap between GPU ``h`` and another GPU when it beats ``cur``, else None.

    ``per``: ``[W, E]`` cost of one replica of each expert at its current count.
    """
    G, W = pb.G, pb.W
    assign, holds, node = st.assign, st.holds, pb.node_of_gpu
    a_items = assign[h]  # [S]
    d = per[:, a_items][:, :, None, None] - per[:, assign][:, None, :, :]  # [W, S, G, S]
    newLh = L[:, h][:, None, None, None] - d
    newLg = L[:, :][:, None, :, None] + d
    ok = ~holds[:, a_items].T[:, :, None]  # [S(i), G, 1]: a_i not on g
    ok = ok & ~holds[h][assign][None, :, :]  # b_j not on h
    ok[:, h, :] = False
    if node is not None:
        ok &= (node == node[h])[None, :, None]
    if not ok.any():
        return None
    # peaks per window excluding h and g: top-3 per window
    order = np.argsort(-L, axis=1)[:, :3]  # [W, 3] the three hottest GPUs per window
    gidx = np.arange(G)
    rest = np.full((W, G), -np.inf)  # [W, G] max load over GPUs other than h and g
    for w in range(W):
        for k in reversed(range(order.shape[1])):
            o = order[w, k]
            if o != h:
                rest[w, gidx != o] = L[w, o]
    newpeak = np.maximum(np.maximum(newLh, newLg), rest[:, None, :, None])  # [W, S, G, S]
    obj = pb.agg(np.moveaxis(newpeak, 0, -1))  # [S, G, S]
    sq = ((newLh**2 + newLg**2) - (L[:, h][:, None, None, None] ** 2 + L[:, None, :, None] ** 2)).sum(axis=0)
    obj = np.where(ok, obj, np.inf)
    sqv = np.where(ok, sq + cur[1], np.inf)
    k = np.lexsort((sqv.ravel(), obj.ravel()))[0]
    cand_score = (float(obj.ravel()[k]), float(sqv.ravel()[k]))
    if not _better(cand_score, cur):
        return None
    i, g, j = np.unravel_index(k, obj.shape)
    return (cand_score, "swap", (int(i), int(g), int(j)))


def _recount_candidates(
    pb: _Layer, st: _SearchState, h: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Re-count moves ``(g [C], j [C], b [C], a [C])``: slot ``(g, j)`` from expert ``a`` to ``b``.

    (1) donor slots on ``h`` x every ``b``; (2) every donor slot x ``b`` in ``h``'s experts. None when
    there are none.
    """
    assign, counts, holds, node = st.assign, st.counts, st.holds, pb.node_of_gpu
    cand_a_slots = []
    hot_experts = assign[h]
    for j in range(pb.S):
        if counts[assign[h, j]] >= 2:
            cand_a_slots.append((h, j))
    gs, js = np.nonzero(counts[assign] >= 2)  # all donor slots
    C_g, C_j, C_b = [], [], []
    for g, j in cand_a_slots:
        bs = np.flatnonzero(~holds[g] & (counts < pb.rmax))
        C_g.append(np.full(len(bs), g))
        C_j.append(np.full(len(bs), j))
        C_b.append(bs)
    for b in hot_experts:
        if counts[b] >= pb.rmax:
            continue
        sel = ~holds[gs, b]
        C_g.append(gs[sel])
        C_j.append(js[sel])
        C_b.append(np.full(int(sel.sum()), b))
    if not C_g:
        return None
    cg = np.concatenate(C_g)
    cj = np.concatenate(C_j)
    cb = np.concatenate(C_b)
    ca = assign[cg, cj]
    keep = ca != cb
    if node is not None:
        keep &= st.node_of_expert[cb] == node[cg]
    if not keep.any():
        return None
    return cg[keep], cj[keep], cb[keep], ca[keep]


def _best_recount(
    pb: _Layer, st: _SearchState, L: np.ndarray, h: int, cur: tuple[float, float]
) -> _Move | None:
    """The best re-count move (:func:`_recount_candidates`) when it beats ``cur``, else None."""
    cands = _recount_candidates(pb, st, h)
    if cands is None:
        return None
    cg, cj, cb, ca = cands
    holds, counts = st.holds, st.counts
    na, nb = counts[ca], counts[cb]
    da = pb.cost[:, ca, na - 1] - pb.cost[:, ca, na]  # [W, C]
    db = pb.cost[:, cb, nb + 1] - pb.cost[:, cb, nb]
    newL = (
        L[:, None, :] + da[:, :, None] * holds.T[ca][None] + db[:, :, None] * holds.T[cb][None]
    )  # [W, C, G]
    ci = np.arange(len(cg))
    newL[:, ci, cg] += -pb.cost[:, ca, na - 1] + pb.cost[:, cb, nb + 1]  # g: loses a entirely, gains b
    obj = pb.agg(np.moveaxis(newL.max(axis=2), 0, -1))  # [C]
    sq = (newL**2).sum(axis=(0, 2))
    k = np.lexsort((sq, obj))[0]
    cand_score = (float(obj[k]), float(sq[k]))
    if not _better(cand_score, cur):
        return None
    return (cand_score, "recount", (int(cg[k]), int(cj[k]), int(cb[k])))


def _apply_move(st: _SearchState, h: int, move: _Move) -> None:
    """Apply a swap or re-count move (module docstring) to ``st`` in place."""
    assign, holds, counts = st.assign, st.holds, st.counts
    kind, data = move[1], move[2]
    if kind == "swap":
        i, g, j = data
        a, b = assign[h, i], assign[g, j]
        assign[h, i], assign[g, j] = b, a
        holds[h, a] = holds[g, b] = False
        holds[h, b] = holds[g, a] = True
    else:
        g, j, b = data
        a = assign[g, j]
        assign[g, j] = b
        holds[g, a] = False
        holds[g, b] = True
        counts[a] -= 1
        counts[b] += 1
