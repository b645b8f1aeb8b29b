"""Packing one node's replicas onto its GPUs, for the locality solvers (:mod:`solver.locality`).

Shapes: ``r`` replicas on the node, ``n`` distinct experts on the node, ``G`` GPUs of the node (``m``
elsewhere), ``S`` slots per GPU, ``V`` load views (fit total, windows), ``R`` most replicas per expert.

Three packers, from fast to exact:

- :func:`pack_node_gpus`: fixed replicas (expert and load of each) onto GPUs: LPT, pairwise swaps, and
  optionally CP-SAT (:func:`pack_node_exact` with the counts fixed).
- :func:`pair_pack`: two slots per GPU and one view: replica counts and pairs (heaviest with lightest).
- :func:`pack_node_exact`: CP-SAT over replica counts and GPUs at once, minimising the worst
  GPU/mean ratio over all views.

Both :mod:`solver.locality.grouped` and :mod:`solver.locality.replicated` use them; this module imports
neither.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from solver.budget import Budget, as_budget
from solver.greedy import balanced_packing, greedy_replica_counts
from solver.search import run_solve

__all__ = ["pack_node_exact", "pack_node_gpus", "pack_peak", "pair_pack"]


def pack_node_gpus(
    experts: np.ndarray,
    loads: np.ndarray,
    num_gpus: int,
    max_rounds: int = 200,
    time_limit: float = 0.0,
    seed: int = 0,
) -> np.ndarray:
    """Pack one node's replicas onto its GPUs: exactly ``len/num_gpus`` each, distinct experts per GPU.

    LPT (:func:`solver.greedy.balanced_packing` with the expert as key), then pairwise swaps that lower
    the heaviest GPU, then (``time_limit > 0``) CP-SAT minimising the peak, hinted with that.

    Args:
        experts: int64 ``[r]`` logical expert of each replica; loads: float64 ``[r]`` (the replicas of one
            expert on a node split its load evenly, so they must carry equal loads).

    Returns:
        int64 ``[r]`` GPU (0..num_gpus-1 within the node) of each replica.
    """
    experts = np.asarray(experts, dtype=np.int64)
    loads = np.asarray(loads, dtype=np.float64)
    _check_equal_replica_loads(experts, loads)
    pack, _ = balanced_packing(loads[None, :], num_gpus, item_key=experts[None, :])
    gpu = _swap_improve(experts, loads, pack[0].copy(), num_gpus, max_rounds)
    if time_limit > 0 and loads.size > num_gpus:
        gpu = _pack_cpsat(experts, loads, gpu, num_gpus, time_limit, seed)
    return gpu


def _check_equal_replica_loads(experts: np.ndarray, loads: np.ndarray) -> None:
    """Raise ValueError when two replicas of one expert (``experts`` int64 ``[r]``) carry unequal
    ``loads`` float64 ``[r]``."""
    if not experts.size:
        return
    lo = np.full(int(experts.max()) + 1, np.inf)
    hi = np.full(lo.size, -np.inf)
    np.minimum.at(lo, experts, loads)
    np.maximum.at(hi, experts, loads)
    bad = np.flatnonzero(hi - lo > 1e-9 * np.maximum(np.abs(hi), 1.0))
    if bad.size:
        e = int(bad[0])
        raise ValueError(
            f"replicas of expert {e} carry unequal loads ({lo[e]:g} to {hi[e]:g}); a node splits "
            f"an expert's load evenly over its replicas: pass load / replicas for each"
        )


def _pack_cpsat(
    experts: np.ndarray, loads: np.ndarray, gpu0: np.ndarray, num_gpus: int, time_limit: float, seed: int
) -> np.ndarray:
    """CP-SAT packing of one node's replicas (min peak GPU load), hinted with ``gpu0``; never worse than it.

    The replicas of one expert carry equal loads (its node load split evenly), so this is
    :func:`pack_node_exact` with the replica counts fixed.

    Args:
        experts: int64 ``[r]``; loads: float64 ``[r]``; gpu0: int64 ``[r]`` start GPU of each replica.

    Returns:
        int64 ``[r]`` GPU of each replica.
    """
    uniq, local, r = np.unique(experts, return_inverse=True, return_counts=True)
    base = np.bincount(local, weights=loads, minlength=uniq.size)[None, :]  # [1, n]
    per = loads.size // num_gpus
    hint = np.stack([np.sort(local[gpu0 == g]) for g in range(num_gpus)])  # [G, per] local expert indices
    _, slot_expert, _ = pack_node_exact(base, num_gpus, per, time_limit, seed=seed, hint=(r, hint), counts=r)
    gpu = np.empty(loads.size, dtype=np.int64)
    for i in range(uniq.size):  # replicas of expert i take its GPUs in order
        gpu[local == i] = np.flatnonzero((slot_expert == i).any(axis=1))
    return gpu


def _swap_improve(
    experts: np.ndarray, loads: np.ndarray, gpu: np.ndarray, num_gpus: int, max_rounds: int
) -> np.ndarray:
    """Pairwise swaps that lower the heaviest GPU (keeps slot counts and distinct experts per GPU).

    Args:
        experts: int64 ``[r]``; loads: float64 ``[r]``; gpu: int64 ``[r]`` (changed in place).

    Returns:
        ``gpu`` int64 ``[r]``.
    """
    for _ in range(max_rounds):
        gl = np.bincount(gpu, weights=loads, minlength=num_gpus)
        hi = int(gl.argmax())
        best = None
        for i in np.flatnonzero(gpu == hi):
            for j in np.flatnonzero(gpu != hi):
                d = loads[i] - loads[j]
                if d <= 1e-12:
                    continue
                o = gpu[j]
                new_peak = max(gl[hi] - d, gl[o] + d)
                if new_peak >= gl[hi] - 1e-12:
                    continue
                # distinct experts per GPU after the swap
                if experts[j] != experts[i] and (
                    np.any(experts[gpu == hi] == experts[j]) or np.any(experts[gpu == o] == experts[i])
                ):
                    continue
                if best is None or new_peak < best[0]:
                    best = (new_peak, i, j)
        if best is None:
            break
        _, i, j = best
        gpu[i], gpu[j] = gpu[j], gpu[i]
    return gpu


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
    k = 2 * G - n  # replicas beyond one per expert
    if math.comb(n + k - 1, k) <= max_enumerate:  # every split, scored at once (duplicates checked after)
        found = _pair_enumerate(w, G, cap)
        if found is not None:
            return (*found, True)
    return (*_pair_descend(w, G, cap), False)


def _pair_layout(w: np.ndarray, r: np.ndarray, G: int) -> tuple[float, np.ndarray]:
    """Pairs of one node for replica counts ``r`` int64 ``[n]`` of loads ``w`` float64 ``[n]``.

    Returns:
        ``(peak, slot_expert int64 [G, 2])``: the heaviest pair's load (``inf`` when a GPU would hold two
        replicas of one expert) and the local expert index of each slot.
    """
    n = w.size
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


def _pair_enumerate(w: np.ndarray, G: int, cap: int) -> tuple[np.ndarray, np.ndarray, float] | None:
    """Every split of the ``k = 2G - n`` extra replicas (at most ``cap`` per expert), scored at once.

    Args:
        w: float64 ``[n]`` node loads of the experts.

    Returns:
        ``(r int64 [n], slot_expert int64 [G, 2], peak)`` of the best of the 8 best-scored splits after
        the duplicate check, or None when none of them passes it.
    """
    n = w.size
    k = 2 * G - n  # replicas beyond one per expert
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
        pk, se_i = _pair_layout(w, R[i], G)
        if pk < best:
            best, se, r = pk, se_i, R[i].copy()
    if r is not None and np.isfinite(best):
        return r, se, best
    return None


def _pair_descend(w: np.ndarray, G: int, cap: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Greedy split (heaviest per replica first), then single replica moves while the peak drops.

    Args:
        w: float64 ``[n]`` node loads of the experts.

    Returns:
        ``(r int64 [n], slot_expert int64 [G, 2], peak)``.
    """
    r = greedy_replica_counts(w[None, :], 2 * G, max_replicas=cap)[0]  # split the heaviest per replica
    best, se = _pair_layout(w, r, G)
    while True:
        cand = None
        for x in np.flatnonzero(r > 1):
            for y in np.flatnonzero(r < cap):
                if x == y:
                    continue
                r2 = r.copy()
                r2[x] -= 1
                r2[y] += 1
                pk, se2 = _pair_layout(w, r2, G)
                if pk < best - 1e-9 and (cand is None or pk < cand[0]):
                    cand = (pk, r2, se2)
        if cand is None:
            break
        best, r, se = cand
    return r, se, best


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
    n = base.shape[1]
    G, S = int(num_gpus), int(slots_per_gpu)
    if n > G * S:
        raise ValueError(f"{n} experts do not fit in {G} GPUs x {S} slots")
    if counts is not None:
        counts = _check_pack_counts(counts, n, G, S)
        max_split = int(counts.max(initial=1))
    R = max(1, min(int(max_split), G))
    ref = np.maximum(base.sum(axis=1) / G, 1e-12)  # [V] mean GPU load per view
    model, s, x = _pack_model(base, G, S, R, ref, counts)
    if hint is not None:
        _add_pack_hint(model, s, x, hint)
    solver = cp_model.CpSolver()
    as_budget(time_limit).cpsat(solver.parameters)
    solver.parameters.random_seed = int(seed)
    solver.parameters.num_workers = 1
    st = run_solve(solver, model)
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
    if hint is not None and pack_peak(base, hint[0], hint[1], ref) < pack_peak(base, r, slot_expert, ref):
        return np.asarray(hint[0]), np.asarray(hint[1]), name
    return r, slot_expert, name


def _check_pack_counts(counts: np.ndarray, n: int, G: int, S: int) -> np.ndarray:
    """``counts`` as int64 ``[n]``; ValueError unless each is in ``[1, G]`` and they sum to ``G * S``."""
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
    return counts


def _pack_model(
    base: np.ndarray, G: int, S: int, R: int, ref: np.ndarray, counts: np.ndarray | None
) -> tuple:
    """The CP-SAT model of :func:`pack_node_exact`: ``(model, s, x)``.

    ``s[i][j]``: expert ``i`` has ``j + 1`` replicas; ``x[i][j][g]``: with ``j + 1`` replicas, one is on
    GPU ``g``. ``base`` float64 ``[V, n]``, ``ref`` float64 ``[V]`` mean GPU load per view, ``counts``
    optional int64 ``[n]`` fixed replica counts.
    """
    from ortools.sat.python import cp_model

    V, n = base.shape
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
    return model, s, x


def _add_pack_hint(model, s: list, x: list, hint: tuple[np.ndarray, np.ndarray]) -> None:
    """Hint ``(r int64 [n], slot_expert int64 [G, S])`` onto the variables of :func:`_pack_model`."""
    hr, hse = hint
    for i in range(len(s)):
        for j in range(len(s[i])):
            model.add_hint(s[i][j], bool(hr[i] == j + 1))
            for g in range(len(x[i][j])):
                model.add_hint(x[i][j][g], bool(hr[i] == j + 1 and np.any(hse[g] == i)))


def pack_peak(base: np.ndarray, r: np.ndarray, slot_expert: np.ndarray, ref: np.ndarray) -> float:
    """Largest GPU load / mean over views of a node packing (see :func:`pack_node_exact`).

    Args:
        base: float64 ``[V, n]``; r: int64 ``[n]``; slot_expert: int64 ``[G, S]``; ref: float64 ``[V]``.
    """
    per = base / np.asarray(r)[None, :]  # [V, n]
    return float((per[:, slot_expert].sum(axis=2).max(axis=1) / ref).max())
