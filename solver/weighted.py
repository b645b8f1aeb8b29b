"""Placement chosen for weighted dispatch (per-replica token shares), LP-polished.

With weighted dispatch an expert's tokens may be split over its replicas in any proportions
(SGLang's ``lp`` dispatch), so one layer's problem is bin packing with item splitting and a
cardinality limit: ``G`` GPUs of capacity ``T`` and ``S`` slots each, every expert cut into pieces
(one piece = one replica with its own share), never two pieces of one expert on one GPU.

Construction (one layer, loads ``w [E]``; target ``T = (1 + eps) * sum(w) / G``):

1. the ``h`` hottest experts are *flexible* (they may be split), the others *fixed* (one replica);
2. GPUs are filled in order 0..G-1. GPU ``g`` takes ``S - n_hot`` fixed experts whose summed load is
   close to the fixed load still to place divided by the GPUs left, and the flexible experts fill the
   rest of its capacity ``T`` in order (the current one continues from the previous GPU; when it runs
   out the next one starts on the same GPU, so a flexible expert's pieces lie on consecutive GPUs);
   ``n_hot`` is the least number of flexible pieces that fills the GPU;
3. every GPU then holds at most ``S`` pieces and at most one piece of each expert. Counting: each
   GPU boundary cuts at most one flexible expert, so ``E + G - 1`` pieces suffice, which fits when
   ``P >= E + G - 1``; spare slots get a zero-share replica of the hottest expert not yet on that GPU
   (they cost nothing and give the LP more freedom).

Several ``(h, eps)`` pairs are tried; the best construction (by its own peak) and the greedy
placement are then polished by the LP of :func:`weighted_shares` (optimal shares on the
fixed placement) and the best is kept, so the result is never worse than greedy with LP shares. A
proven lower bound on the weighted peak is ``max(mean, max_e w_e / min(G, 1 + P - E))``; when the peak
reaches it the layer is ``optimal``.

The LP itself (:func:`weighted_shares`, per-replica shares on a fixed placement) lives here and is
shared with :mod:`solver.exact` (its ``weighted="shares"`` mode), which imports it from this module.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from os import PathLike

import numpy as np

from placement.model import Placement
from placement.topology import Topology
from solver.report import LayerReport, SolveReport

__all__ = [
    "construct_weighted_layer",
    "weighted_layer",
    "solve_weighted",
    "weighted_bound",
    "weighted_shares",
    "replica_weights",
    "write_replica_weights",
    "even_split_peak",
]

log = logging.getLogger(__name__)

_EPS_GRID = (0.0, 1e-4, 5e-4, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2)


def even_split_peak(row: np.ndarray, w: np.ndarray, G: int, S: int) -> float:
    """Peak GPU load of the map ``row`` (int ``[P]``, ``P = G * S``) with loads ``w [E]`` split evenly
    over each expert's replicas."""
    return float((w[row] / np.bincount(row, minlength=len(w))[row]).reshape(G, S).sum(axis=1).max())


def weighted_bound(load: np.ndarray, ep_size: int, num_physical_experts: int) -> np.ndarray:
    """Lower bound on the weighted-dispatch peak, per layer: ``max(mean, max_e w_e / rmax)``.

    ``rmax = min(G, 1 + P - E)`` is the most replicas one expert can have. Args: ``load [L, E]``.
    Returns float64 ``[L]``.
    """
    w = np.atleast_2d(np.asarray(load, dtype=np.float64))
    E = w.shape[1]
    G, P = int(ep_size), int(num_physical_experts)
    rmax = max(1, min(G, 1 + P - E))
    return np.maximum(w.sum(axis=1) / G, w.max(axis=1) / rmax)


@dataclass
class _ColdPool:
    """The fixed (unsplit) experts not yet placed, ascending by load, and their summed load."""

    loads: list[float]
    experts: list[int]
    left: float

    def take(self, i: int) -> tuple[int, float]:
        """Remove pool entry ``i``; returns its (expert, load)."""
        e, load = self.experts[i], self.loads[i]
        self.left -= load
        del self.loads[i]
        del self.experts[i]
        return e, load


def construct_weighted_layer(
    w: np.ndarray, G: int, S: int, num_flexible: int, target: float
) -> tuple[np.ndarray, np.ndarray] | None:
    """One construction (module docstring) for loads ``w [E]``.

    Returns ``(assign int64 [G, S], shares float64 [G, S])`` (``shares`` = the fraction of the
    expert's tokens each slot takes; zero for padding), or ``None`` when the pieces do not fit in the
    slots (then a larger ``target`` or another ``num_flexible`` may work).
    """
    w = np.asarray(w, dtype=np.float64)
    E = len(w)
    if G * S < E:
        return None
    order = np.argsort(-w, kind="stable")
    h = int(min(max(1, num_flexible), E))
    hot = [int(e) for e in order[:h]]
    cold_sorted = sorted((float(w[e]), int(e)) for e in order[h:])  # ascending (load, expert)
    pool = _ColdPool([c[0] for c in cold_sorted], [c[1] for c in cold_sorted], 0.0)
    pool.left = float(sum(pool.loads))
    tol = 1e-12 * max(1.0, float(w.sum()))
    hi, rem = 0, float(w[hot[0]])  # current flexible expert and its load still to place
    assign = np.full((G, S), -1, dtype=np.int64)
    amount = np.zeros((G, S))
    for g in range(G):
        taken, pieces, hi, rem = _fill_gpu(w, hot, pool, (hi, rem), S, target, tol, G - g)
        s = 0
        for i in sorted(taken, reverse=True):
            assign[g, s], amount[g, s] = pool.take(i)
            s += 1
        for e, take in pieces:
            assign[g, s] = e
            amount[g, s] = take
            s += 1
    if pool.loads or hi < h and rem > tol * 1e3:
        return None
    _pad_spare_slots(assign, order)
    if len(np.unique(assign)) != E:
        return None
    return assign, _slot_shares(assign, amount, E)


def _pick_cold(pool_loads: list[float], k: int, tau: float) -> tuple[list[int], float]:
    """Indices into the pool of ``k`` fixed experts whose sum is near ``tau`` (greedy per slot)."""
    taken = []
    cur = 0.0
    avail = list(range(len(pool_loads)))
    for s in range(k):
        if not avail:
            break
        want = (tau - cur) / (k - s)
        loads = [pool_loads[i] for i in avail]
        j = bisect.bisect_left(loads, want)
        cands = [c for c in (j - 1, j) if 0 <= c < len(avail)]
        c = min(cands, key=lambda c: abs(loads[c] - want))
        taken.append(avail.pop(c))
        cur += loads[c]
    return taken, cur


def _fill_gpu(
    w: np.ndarray,
    hot: list[int],
    pool: _ColdPool,
    cursor: tuple[int, float],
    S: int,
    target: float,
    tol: float,
    gpus_left: int,
) -> tuple[list[int], list[tuple[int, float]], int, float]:
    """What the next GPU takes: fixed experts (pool indices) near the fixed load still to place per GPU
    left, and flexible pieces ``(expert, tokens)`` filling it to ``target`` with the least pieces.

    ``cursor = (hi, rem)``: the current flexible expert (index into ``hot``) and its load still to place;
    returns them as they are after this GPU.
    """
    hi, rem = cursor
    h = len(hot)
    tau = pool.left / gpus_left
    n_min = 0 if hi >= h else 1
    for n_hot in range(n_min, S + 1):
        k = min(S - n_hot, len(pool.loads))
        taken, cl = _pick_cold(pool.loads, k, tau)
        # flexible pieces needed to fill cap
        pieces, j, rr = _flexible_pieces(w, hot, hi, rem, target - cl, tol)
        if len(pieces) <= n_hot or n_hot == S:
            if len(pieces) > n_hot:  # S pieces were not enough: keep the first ones, GPU underfull
                done = pieces[:n_hot]
                j2, rr2 = _after_pieces(w, hot, hi, rem, done, tol)
                return taken, done, j2, rr2
            return taken, pieces, j, rr
    raise AssertionError("unreachable: the last n_hot (== S) always returns")


def _flexible_pieces(
    w: np.ndarray, hot: list[int], hi: int, rem: float, cap: float, tol: float
) -> tuple[list[tuple[int, float]], int, float]:
    """Pieces ``(expert, tokens)`` of the flexible experts, in order from ``hot[hi]`` (``rem`` left),
    filling ``cap``; returns them with the flexible expert and its load left after them."""
    h = len(hot)
    pieces = []
    j, rr = hi, rem
    while cap > tol and j < h:
        take = min(rr, cap)
        pieces.append((hot[j], take))
        cap -= take
        rr -= take
        if rr <= tol:
            j += 1
            rr = float(w[hot[j]]) if j < h else 0.0
    return pieces, j, rr


def _after_pieces(
    w: np.ndarray, hot: list[int], hi: int, rem: float, done: list[tuple[int, float]], tol: float
) -> tuple[int, float]:
    """The flexible expert and its load left after placing the pieces ``done`` from ``hot[hi]``."""
    h = len(hot)
    j2, rr2 = hi, rem
    for _e, take in done:
        rr2 -= take
        if rr2 <= tol:
            j2 += 1
            rr2 = float(w[hot[j2]]) if j2 < h else 0.0
    return j2, rr2


def _pad_spare_slots(assign: np.ndarray, order: np.ndarray) -> None:
    """Spare slots (``-1`` in ``assign [G, S]``) get zero-share replicas of the hottest experts
    (``order [E]``, hottest first) not on the GPU, in place."""
    G, S = assign.shape
    for g in range(G):
        present = set(int(e) for e in assign[g] if e >= 0)
        for s in range(S):
            if assign[g, s] < 0:
                e = next(int(e) for e in order if int(e) not in present)
                assign[g, s] = e
                present.add(e)


def _slot_shares(assign: np.ndarray, amount: np.ndarray, E: int) -> np.ndarray:
    """Each slot's fraction ``[G, S]`` of its expert's tokens (``amount [G, S]``: tokens per slot);
    an expert with zero load is spread evenly over its replicas."""
    tot = np.bincount(assign.ravel(), weights=amount.ravel(), minlength=E)
    shares = np.divide(amount, tot[assign], out=np.zeros_like(amount), where=tot[assign] > 0)
    zero = tot[assign] <= 0
    if zero.any():
        cnt = np.bincount(assign.ravel(), minlength=E)
        shares[zero] = 1.0 / cnt[assign[zero]]
    return shares


def _flexible_counts(w: np.ndarray, G: int, S: int) -> list[int]:
    E = len(w)
    mean = w.sum() / G
    n_over = int((w > mean).sum())
    cands = {max(1, n_over), max(1, n_over * 2), G // 4, G // 2, G, 2 * G, max(1, E - G * (S - 1))}
    return sorted(c for c in cands if 1 <= c <= E)


def weighted_layer(
    w: np.ndarray,
    topology: Topology,
    windows: np.ndarray | None = None,
    candidates: Sequence[np.ndarray] = (),
) -> tuple[np.ndarray, np.ndarray, float, dict]:
    """Best placement of one layer for weighted dispatch.

    Args:
        w: ``[E]`` loads fitted on. windows: optional ``[W, E]`` loads the LP minimises the worst of.
        candidates: other ``[P]`` maps to polish and compare (e.g. greedy's, the even-split optimum).
    Returns:
        ``(row int64 [P], shares float64 [P], weighted peak on w, info dict)``.
    """
    G, S = topology.ep_size, topology.slots_per_gpu
    w = np.asarray(w, dtype=np.float64)
    mean = w.sum() / G
    lp_load = w if windows is None else windows
    best_con = None
    tried = 0
    for h in _flexible_counts(w, G, S):
        for eps in _EPS_GRID:
            res = construct_weighted_layer(w, G, S, h, mean * (1 + eps))
            tried += 1
            if res is None:
                continue
            assign, shares = res
            peak = float((w[assign] * shares).sum(axis=1).max())
            if best_con is None or peak < best_con[0] - 1e-12 * mean:
                best_con = (peak, assign.reshape(-1), shares.reshape(-1), h, eps)
            if peak <= mean * (1 + 1e-9):
                break
        if best_con is not None and best_con[0] <= mean * (1 + 1e-9):
            break
    rows = []
    if best_con is not None:
        rows.append(("constructed", best_con[1]))
    rows += [(f"candidate{i}", np.asarray(c, dtype=np.int64)) for i, c in enumerate(candidates)]
    best = None
    for name, row in rows:
        q, _ = weighted_shares(row, lp_load, topology)
        if name == "constructed" and windows is None:
            # the construction's own shares are feasible; keep the better of them and the LP's
            own = best_con[2]
            if (w[row] * own).reshape(G, S).sum(axis=1).max() < (w[row] * q).reshape(G, S).sum(axis=1).max():
                q = own
        peak = float((w[row] * q).reshape(G, S).sum(axis=1).max())
        if best is None or peak < best[2] - 1e-12 * mean:
            best = (row, q, peak, name)
    info = {
        "method": best[3],
        "constructions_tried": tried,
        "construction_peak": None if best_con is None else best_con[0],
        "num_flexible": None if best_con is None else best_con[3],
        "eps": None if best_con is None else best_con[4],
    }
    return best[0], best[1], best[2], info


def solve_weighted(
    load: np.ndarray,
    topology: Topology,
    *,
    windows: np.ndarray | None = None,
    layer_ids: Sequence[int] | None = None,
    hint: Placement | None = None,
    seed: int = 0,
    time_limit: float = 60.0,
) -> tuple[Placement, np.ndarray, SolveReport]:
    """Placement and per-replica shares for weighted dispatch, every layer.

    Args:
        load: ``[L, E]`` fitted loads. windows: optional ``[W, L, E]`` (the LP minimises the worst window).
        hint: an extra placement to polish and compare (e.g. the even-split optimum).
        seed: unused (the construction is deterministic); kept for the solver signature.
        time_limit: budget in seconds; layers past it keep greedy's placement with LP shares
            (status ``greedy_fallback``).
    Returns:
        ``(Placement, shares float64 [L, P], SolveReport)``. Layer ``objective``: the weighted peak GPU
        load (tokens); ``bound``: :func:`weighted_bound`; ``baseline_objective``: greedy's even-split
        peak; ``extra``: ``even_objective`` (even-split peak of the returned placement),
        ``greedy_weighted_objective`` (greedy placement with LP shares), ``replica_shares``, ``method``.
    """
    from solver.greedy import greedy_placement

    t0 = time.perf_counter()
    w_all = np.asarray(load, dtype=np.float64)
    if w_all.ndim != 2:
        raise ValueError(f"load must be [layers, experts], got shape {w_all.shape}")
    L, E = w_all.shape
    P = topology.num_physical_experts
    if E > P:
        raise ValueError(f"{E} logical experts do not fit in {P} physical slots; add {E - P} or more slots")
    g_pl, _ = greedy_placement(w_all, topology, mode="global", layer_ids=layer_ids)
    gmap = g_pl.physical_to_logical_map
    bounds = weighted_bound(w_all, topology.ep_size, P)
    rows, shares, layers = [], [], []
    for l in range(L):
        win = None if windows is None else np.asarray(windows, dtype=np.float64)[:, l]
        hint_row = hint.physical_to_logical_map[l] if hint is not None else None
        layer_id = int(layer_ids[l]) if layer_ids else l
        row, q, lr = _solve_weighted_layer(
            w_all[l], win, gmap[l], hint_row, topology, bounds[l], layer_id, t0 + time_limit
        )
        rows.append(row)
        shares.append(q)
        layers.append(lr)
    pl = Placement(np.stack(rows), E, topology, tuple(layer_ids or ()), {"solver": "weighted"})
    rep = SolveReport(
        "weighted",
        tuple(layers),
        time.perf_counter() - t0,
        {"seed": seed, "time_limit": time_limit, "weighted": True},
    )
    return pl, np.stack(shares), rep


def _solve_weighted_layer(
    w: np.ndarray,
    win: np.ndarray | None,
    g_row: np.ndarray,
    hint_row: np.ndarray | None,
    topology: Topology,
    bound: float,
    layer_id: int,
    t_end: float,
) -> tuple[np.ndarray, np.ndarray, LayerReport]:
    """One layer: ``w [E]`` loads, ``win [W, E]`` windows or None, greedy's map ``g_row [P]``.

    Returns the map ``[P]``, its shares ``[P]`` and the layer's report. Past ``t_end`` (the solve's
    start plus its time limit), greedy's map with LP shares (status ``greedy_fallback``).
    """
    tl = time.perf_counter()
    G, S = topology.ep_size, topology.slots_per_gpu
    g_even = even_split_peak(g_row, w, G, S)
    gq, _ = weighted_shares(g_row, w if win is None else win, topology)
    g_w = float((w[g_row] * gq).reshape(G, S).sum(axis=1).max())
    if time.perf_counter() > t_end:
        row, q, peak, info, status = (
            g_row,
            gq,
            g_w,
            {"method": "greedy", "note": "time limit reached before this layer"},
            "greedy_fallback",
        )
    else:
        cands = [g_row] + ([hint_row] if hint_row is not None else [])
        row, q, peak, info = weighted_layer(w, topology, win, cands)
        status = "optimal" if peak <= bound * (1 + 1e-9) else "heuristic"
        if status == "optimal":
            info["proved_by"] = "weighted_bound"
    even = even_split_peak(row, w, G, S)
    lr = LayerReport(
        layer_id=layer_id,
        status=status,
        objective=peak,
        bound=float(min(bound, peak)),
        wall_time_s=time.perf_counter() - tl,
        baseline_objective=g_even,
        mean_load=float(w.sum() / G),
        extra={
            "even_objective": even,
            "greedy_weighted_objective": g_w,
            "replica_shares": q.tolist(),
            **info,
        },
    )
    return row, q, lr


# ---------------------------------------------------------------------------------------------
# Weighted dispatch: LP on a fixed placement
# ---------------------------------------------------------------------------------------------
def weighted_shares(
    phy2log_row: np.ndarray, windows: np.ndarray, topology: Topology
) -> tuple[np.ndarray, float]:
    """Per-replica token shares minimising the peak on a fixed placement of one layer.

    Args:
        phy2log_row: int ``[P]`` the layer's map.
        windows: ``[W, E]`` (or ``[E]``) loads; the peak is taken per window (max over windows).
    Returns:
        ``(shares float64 [P], peak)``: ``shares`` sum to 1 over each expert's replicas; ``peak`` is the
        largest window's peak GPU load with these shares.
    """
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    w = np.atleast_2d(np.asarray(windows, dtype=np.float64))
    p2l = np.asarray(phy2log_row, dtype=np.int64)
    P, G, E = len(p2l), topology.ep_size, w.shape[1]
    gpu = topology.gpu_of_slot
    W = w.shape[0]
    # variables: q[0..P-1], T; rows: per (window, gpu) load - T <= 0 ; per expert sum q = 1
    r_ub = (np.arange(W)[:, None] * G + gpu[None, :]).ravel()  # [W*P]
    c_ub = np.tile(np.arange(P), W)
    v_ub = w[:, p2l].ravel()
    A_ub = coo_matrix(
        (
            np.concatenate([v_ub, -np.ones(W * G)]),
            (np.concatenate([r_ub, np.arange(W * G)]), np.concatenate([c_ub, np.full(W * G, P)])),
        ),
        shape=(W * G, P + 1),
    )
    A_eq = coo_matrix((np.ones(P), (p2l, np.arange(P))), shape=(E, P + 1))
    cobj = np.zeros(P + 1)
    cobj[P] = 1.0
    res = linprog(
        cobj, A_ub=A_ub, b_ub=np.zeros(W * G), A_eq=A_eq, b_eq=np.ones(E), bounds=(0, None), method="highs"
    )
    cnt = np.bincount(p2l, minlength=E)
    even = 1.0 / cnt[p2l]
    if res.status != 0:
        return even, float((w[:, p2l] * even).reshape(W, G, -1).sum(axis=2).max())
    q = np.clip(res.x[:P], 0, None)
    tot = np.bincount(p2l, weights=q, minlength=E)
    q = q / tot[p2l]
    peak = float(
        np.bincount(
            np.repeat(np.arange(W) * G, P) + np.tile(gpu, W), weights=(w[:, p2l] * q).ravel(), minlength=W * G
        ).max()
    )
    even_peak = float((w[:, p2l] * even).reshape(W, G, -1).sum(axis=2).max())
    if peak > even_peak:
        return even, even_peak
    return q, peak


def replica_weights(placement: Placement, load: np.ndarray) -> np.ndarray:
    """Per-replica dispatch probabilities ``float64 [L, P]`` (sum to 1 over each expert's replicas).

    Args:
        load: ``[L, E]`` or ``[W, L, E]`` (windows: minimise the worst window's peak).
    """
    w = np.asarray(load, dtype=np.float64)
    if w.ndim == 2:
        w = w[None]
    if w.ndim != 3 or w.shape[1:] != (placement.num_layers, placement.num_logical_experts):
        raise ValueError(
            f"load has shape {np.shape(load)}; expected [{placement.num_layers}, {placement.num_logical_experts}] "
            f"or [windows, {placement.num_layers}, {placement.num_logical_experts}]"
        )
    out = np.empty((placement.num_layers, placement.num_physical_experts))
    for l in range(placement.num_layers):
        out[l] = weighted_shares(placement.physical_to_logical_map[l], w[:, l], placement.topology)[0]
    return out


def write_replica_weights(path: str | PathLike, weights: np.ndarray, placement: Placement) -> None:
    """Write per-replica dispatch weights as JSON (atomic), next to the map they belong to.

    Fields: ``format`` (``moe-placement/replica-weights``), ``version``, ``layer_ids``,
    ``num_logical_experts``, ``ep_size``, ``physical_to_logical_map`` ``[L, P]`` and
    ``replica_weights`` ``[L, P]`` (slot ``p``'s probability among its expert's replicas).
    """
    from moe_placement.base.fileio import atomic_write_json

    wts = np.asarray(weights, dtype=np.float64)
    if wts.shape != placement.physical_to_logical_map.shape:
        raise ValueError(
            f"weights have shape {wts.shape} but the placement map is {placement.physical_to_logical_map.shape}"
        )
    if not np.all(np.isfinite(wts)) or wts.min(initial=0) < 0:
        raise ValueError("replica weights must be finite and >= 0")
    p2l = placement.physical_to_logical_map
    for l in range(p2l.shape[0]):
        tot = np.bincount(p2l[l], weights=wts[l], minlength=placement.num_logical_experts)
        if not np.allclose(tot, 1.0, atol=1e-6):
            e = int(np.argmax(np.abs(tot - 1)))
            raise ValueError(f"layer {l}: weights of expert {e}'s replicas sum to {tot[e]:.6f}, not 1")
    atomic_write_json(
        path,
        {
            "format": "moe-placement/replica-weights",
            "version": 1,
            "layer_ids": list(placement.layer_ids),
            "num_logical_experts": placement.num_logical_experts,
            "ep_size": placement.topology.ep_size,
            "physical_to_logical_map": p2l.tolist(),
            "replica_weights": wts.tolist(),
        },
    )
