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
placement are then polished by the LP of :func:`solver.exact.weighted_shares` (optimal shares on the
fixed placement) and the best is kept, so the result is never worse than greedy with LP shares. A
proven lower bound on the weighted peak is ``max(mean, max_e w_e / min(G, 1 + P - E))``; when the peak
reaches it the layer is ``optimal``.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import numpy as np

from placement.model import Placement
from placement.topology import Topology
from solver.report import LayerReport, SolveReport

__all__ = ["construct_weighted_layer", "weighted_layer", "solve_weighted", "weighted_bound"]

log = logging.getLogger(__name__)

_EPS_GRID = (0.0, 1e-4, 5e-4, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2)


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


def construct_weighted_layer(w: np.ndarray, G: int, S: int, num_flexible: int, target: float):
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
    pool_loads = [c[0] for c in cold_sorted]
    pool_exp = [c[1] for c in cold_sorted]
    cold_left = float(sum(pool_loads))
    tol = 1e-12 * max(1.0, float(w.sum()))
    hi, rem = 0, float(w[hot[0]])  # current flexible expert and its load still to place
    assign = np.full((G, S), -1, dtype=np.int64)
    amount = np.zeros((G, S))

    def pick_cold(k, tau):
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

    for g in range(G):
        gpus_left = G - g
        tau = cold_left / gpus_left
        chosen = None
        n_min = 0 if hi >= h else 1
        for n_hot in range(n_min, S + 1):
            k = min(S - n_hot, len(pool_loads))
            taken, cl = pick_cold(k, tau)
            cap = target - cl
            # flexible pieces needed to fill cap
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
            if len(pieces) <= n_hot or n_hot == S:
                chosen = (taken, cl, pieces[: max(n_hot, 0)] if len(pieces) > n_hot else pieces, j, rr)
                if len(pieces) > n_hot:  # S pieces were not enough: keep the first ones, GPU underfull
                    done = pieces[:n_hot]
                    j2, rr2 = hi, rem
                    for _e, take in done:
                        rr2 -= take
                        if rr2 <= tol:
                            j2 += 1
                            rr2 = float(w[hot[j2]]) if j2 < h else 0.0
                    chosen = (taken, cl, done, j2, rr2)
                break
        taken, cl, pieces, hi, rem = chosen
        s = 0
        for i in sorted(taken, reverse=True):
            assign[g, s] = pool_exp[i]
            amount[g, s] = pool_loads[i]
            cold_left -= pool_loads[i]
            del pool_loads[i]
            del pool_exp[i]
            s += 1
        for e, take in pieces:
            assign[g, s] = e
            amount[g, s] = take
            s += 1
    if pool_loads or hi < h and rem > tol * 1e3:
        return None
    # padding: zero-share replicas of the hottest experts not on the GPU
    for g in range(G):
        present = set(int(e) for e in assign[g] if e >= 0)
        for s in range(S):
            if assign[g, s] < 0:
                e = next(int(e) for e in order if int(e) not in present)
                assign[g, s] = e
                present.add(e)
    if len(np.unique(assign)) != E:
        return None
    tot = np.bincount(assign.ravel(), weights=amount.ravel(), minlength=E)
    shares = np.divide(amount, tot[assign], out=np.zeros_like(amount), where=tot[assign] > 0)
    # an expert with zero load: spread evenly over its replicas
    zero = tot[assign] <= 0
    if zero.any():
        cnt = np.bincount(assign.ravel(), minlength=E)
        shares[zero] = 1.0 / cnt[assign[zero]]
    return assign, shares


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
    from solver.exact import weighted_shares

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
    from solver.exact import weighted_shares
    from solver.greedy import greedy_placement

    t0 = time.perf_counter()
    w_all = np.asarray(load, dtype=np.float64)
    if w_all.ndim != 2:
        raise ValueError(f"load must be [layers, experts], got shape {w_all.shape}")
    L, E = w_all.shape
    G, S, P = topology.ep_size, topology.slots_per_gpu, topology.num_physical_experts
    if E > P:
        raise ValueError(f"{E} logical experts do not fit in {P} physical slots; add {E - P} or more slots")
    g_pl, _ = greedy_placement(w_all, topology, policy="global", layer_ids=layer_ids)
    gmap = g_pl.physical_to_logical_map
    bounds = weighted_bound(w_all, G, P)
    rows, shares, layers = [], [], []
    for l in range(L):
        tl = time.perf_counter()
        w = w_all[l]
        win = None if windows is None else np.asarray(windows, dtype=np.float64)[:, l]
        g_row = gmap[l]
        g_even = float((w[g_row] / np.bincount(g_row, minlength=E)[g_row]).reshape(G, S).sum(axis=1).max())
        gq, _ = weighted_shares(g_row, w if win is None else win, topology)
        g_w = float((w[g_row] * gq).reshape(G, S).sum(axis=1).max())
        if time.perf_counter() - t0 > time_limit:
            row, q, peak, info, status = (
                g_row,
                gq,
                g_w,
                {"method": "greedy", "note": "time limit reached before this layer"},
                "greedy_fallback",
            )
        else:
            cands = [g_row] + ([hint.physical_to_logical_map[l]] if hint is not None else [])
            row, q, peak, info = weighted_layer(w, topology, win, cands)
            status = "optimal" if peak <= bounds[l] * (1 + 1e-9) else "heuristic"
            if status == "optimal":
                info["proved_by"] = "weighted_bound"
        even = float((w[row] / np.bincount(row, minlength=E)[row]).reshape(G, S).sum(axis=1).max())
        rows.append(row)
        shares.append(q)
        layers.append(
            LayerReport(
                layer_id=int(layer_ids[l]) if layer_ids else l,
                status=status,
                objective=peak,
                bound=float(min(bounds[l], peak)),
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
        )
    pl = Placement(np.stack(rows), E, topology, tuple(layer_ids or ()), {"solver": "weighted"})
    rep = SolveReport(
        "weighted",
        tuple(layers),
        time.perf_counter() - t0,
        {"seed": seed, "time_limit": time_limit, "weighted": True},
    )
    return pl, np.stack(shares), rep
