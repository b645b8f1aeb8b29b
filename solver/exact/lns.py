"""Large layers: CP-SAT neighbourhood re-packs alternated with the local search.

Shapes: ``E`` experts, ``G`` GPUs with ``S`` slots, ``W`` windows; ``assign`` int ``[G, S]``,
``counts`` int64 ``[E]``; a neighbourhood ``H`` is int ``[|H|]`` GPUs whose ``|H| * S`` items are
re-packed among them (replica counts fixed).
"""

from __future__ import annotations

import time

import numpy as np

from solver.exact.cpsat import _cp_solver
from solver.exact.layer_problem import _DET_FACTOR, _LNS_ROUND_S, _SAFETY_CAP, _counts_of, _Layer, _Result
from solver.exact.local_search import _local_search
from solver.search import run_solve as _run_solve


def _large_layer(
    pb: _Layer,
    inc: np.ndarray,
    seed: int,
    limit_s: float,
    deterministic: bool,
    ls_iters: int,
    deadline: float,
) -> _Result:
    """Alternate CP-SAT neighbourhood re-packs and the local search until the layer's budget is spent.

    The number of rounds comes from the budget (not the clock) in deterministic mode.
    """
    t0 = time.perf_counter()
    rounds = max(4, int(_DET_FACTOR * limit_s / _LNS_ROUND_S))
    dl = deadline if deterministic else min(deadline, t0 + limit_s)  # the solve's deadline: a hard wall
    assign = inc
    left = rounds
    k = 0
    while left > 0 and (dl is None or time.perf_counter() < dl):
        step = min(8, left)
        assign, done = _lns_cpsat(pb, assign, step, _LNS_ROUND_S, seed + k, deterministic, dl)
        left -= step
        k += 1
        assign, _ = _local_search(pb, assign, ls_iters, dl)
        if deterministic and time.perf_counter() - t0 > _SAFETY_CAP * limit_s:
            return _Result(
                assign,
                "time_limit",
                None,
                False,
                time.perf_counter() - t0,
                "wall-clock safety cap reached in the neighbourhood search: this layer may not reproduce exactly",
            )
    return _Result(assign, "time_limit", None, False, time.perf_counter() - t0)


def _lns_cpsat(
    pb: _Layer,
    assign: np.ndarray,
    rounds: int,
    sub_limit: float,
    seed: int,
    deterministic: bool,
    deadline: float | None,
    size: int = 8,
) -> tuple[np.ndarray, int]:
    """Large-neighbourhood search with exact CP-SAT sub-solves, for instances too big for the joint model.

    Each round frees the hottest GPU of the critical window, the coolest ones and a seeded random one
    (``size`` GPUs in all, inside one node when node constrained) and re-packs their replicas among
    them optimally (replica counts fixed there: the recount moves of the local search change counts).
    A round is accepted when the freed GPUs' peak drops. Returns the assignment and rounds done.
    """
    rng = np.random.default_rng(seed)
    assign = assign.copy()
    counts = _counts_of(assign, pb.E)
    done = 0
    stale = 0
    for _ in range(rounds):
        if deadline is not None and time.perf_counter() >= deadline:
            break
        done += 1
        L = pb.loads(assign, counts)  # [W, G]
        H = _neighbourhood(pb, L, rng, stale, size)
        if H is None:
            break
        new = _repack(pb, assign[H].ravel(), counts, sub_limit, seed, deterministic)
        if new is None:
            stale += 1
            continue
        trial = assign.copy()
        trial[H] = new
        old_sub = pb.agg(L[:, H].max(axis=1))
        new_sub = pb.agg(pb.loads(trial, counts)[:, H].max(axis=1))
        if new_sub < old_sub * (1 - 1e-12):
            assign = trial
            stale = 0
        else:
            stale += 1
    return assign, done


def _neighbourhood(
    pb: _Layer, L: np.ndarray, rng: np.random.Generator, stale: int, size: int
) -> np.ndarray | None:
    """GPUs to re-pack: the hottest of the critical window, the coolest, and seeded random ones.

    ``L``: ``[W, G]`` loads. The more rounds in a row failed (``stale``), the fewer cool GPUs and the
    more random ones. Returns int ``[|H|]`` (hottest first), or None when ``h`` has no partner.
    """
    wc = int(np.argmax(L.max(axis=1)))
    h = int(np.argmax(L[wc]))
    pool = np.arange(pb.G)
    if pb.node_of_gpu is not None:
        pool = np.flatnonzero(pb.node_of_gpu == pb.node_of_gpu[h])
    pool = pool[pool != h]
    k = min(size - 1, len(pool))
    if k < 1:
        return None
    cool = pool[np.argsort(L[wc, pool], kind="stable")]
    n_cool = max(1, k - 1 - min(stale, k - 1))
    chosen = list(cool[:n_cool])
    rest = np.setdiff1d(pool, chosen)
    if len(rest) and len(chosen) < k:
        chosen += list(rng.choice(rest, size=min(k - len(chosen), len(rest)), replace=False))
    return np.array([h] + [int(c) for c in chosen])


def _repack(
    pb: _Layer, items: np.ndarray, counts: np.ndarray, sub_limit: float, seed: int, deterministic: bool
) -> np.ndarray | None:
    """Optimal re-pack of ``items [|H| * S]`` (experts) onto ``|H|`` GPUs, minimising their peak.

    Returns int64 ``[|H|, S]`` or None when CP-SAT found no solution.
    """
    from ortools.sat.python import cp_model

    S, W = pb.S, pb.W
    nH, nI = len(items) // S, len(items)
    # data: integer sizes of the items per window, scaled to 1e6 for the fullest window
    per = pb.cost[:, np.arange(pb.E), counts]  # [W, E]
    scale = 1e6 / max(1e-12, float(per[:, items].sum(axis=1).max()))
    size_i = np.ceil(per[:, items] * scale - 1e-9).astype(np.int64)  # [W, items]
    # variables: item i on GPU j
    m = cp_model.CpModel()
    y = [[m.new_bool_var("") for _ in range(nH)] for _ in range(nI)]
    # each item on one GPU
    for i in range(nI):
        m.add_exactly_one(y[i])
    # each GPU takes S items
    for j in range(nH):
        m.add(sum(y[i][j] for i in range(nI)) == S)
    # at most one replica of an expert per GPU
    for e in np.unique(items):
        idx = np.flatnonzero(items == e)
        if len(idx) > 1:
            for j in range(nH):
                m.add_at_most_one(y[i][j] for i in idx)
    # objective: the peak over windows and GPUs
    top = int(size_i.sum(axis=1).max())
    pk = m.new_int_var(0, top, "peak")
    for w in range(W):
        for j in range(nH):
            m.add(sum(int(size_i[w, i]) * y[i][j] for i in range(nI)) <= pk)
    m.minimize(pk)
    # hint: the current packing
    for i in range(nI):
        for j in range(nH):
            m.add_hint(y[i][j], i // S == j)
    # solve, and check the status before reading values
    if deterministic:
        slv = _cp_solver(seed, sub_limit, 3 * sub_limit)
    else:
        slv = _cp_solver(seed, None, sub_limit)
    st = _run_solve(slv, m)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    new = np.empty((nH, S), dtype=np.int64)
    fill = [0] * nH
    for i in range(nI):
        j = next(j for j in range(nH) if slv.boolean_value(y[i][j]))
        new[j, fill[j]] = items[i]
        fill[j] += 1
    return new
