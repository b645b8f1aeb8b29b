"""Migration-aware re-placement: rebalance for new loads while moving few expert weights.

Shapes: L layers, E logical experts, P physical slots, G EP ranks (GPUs), S = P // G slots per GPU.

The problem, per layer: the current placement holds a set of (GPU, expert) pairs (``S`` per GPU).
A new placement is scored by

    objective = peak GPU load (even split over replicas) + move_cost * moved slots

where a moved slot is a (GPU, expert) pair of the new placement that the previous one did not have
(a weight copy onto that GPU). A slot-permutation post-pass keeps every expert that stays on a GPU
in its slot index, so ``placement.metrics.moved_slots(previous, new)`` equals that pair count exactly.

Two methods:

- ``incremental`` (the serving default, also used by ``auto``): bounded local moves, always the one
  with the best net gain per moved slot over all layers (a move budget therefore goes to the layers
  that gain most):

  * replace: on any GPU, swap out one replica of an expert with >= 2 replicas for a new replica of
    an expert not on that GPU (1 moved slot; replica counts change, e.g. a cold expert's extra
    replica becomes a hot expert's new one);
  * swap: exchange an expert on the hottest GPU with an expert on another GPU (2 moved slots).

  A move is taken only while the peak improves by more than its move cost. A drift guard then
  compares each layer with a full re-solve (the greedy balancer, relabelled to the previous placement
  by :func:`align_to_previous`); when the incremental peak gap over the lower bound is more than
  ``drift_guard`` times the full re-solve's gap, and the full re-solve is better on the objective
  (and fits the move budget), the layer takes the full re-solve.
- ``exact``: CP-SAT per layer with the incremental result as hint (variables ``x[e, g]`` for a
  replica of ``e`` on ``g``, one-hot replica counts, moved = new pairs); a total ``max_moves`` is
  split over layers as the incremental pass spent it. The better of the two is kept per layer.

``max_moves`` is a TOTAL over all layers. No method returns a placement worse than keeping the
previous one (zero moves) on the objective.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Sequence
from typing import Literal

import numpy as np

from placement.metrics import expected_gpu_load, peak_lower_bound
from placement.model import Placement
from solver.report import LayerReport, SolveReport

__all__ = ["align_to_previous", "keep_slots", "moved_pairs", "solve_migration"]

log = logging.getLogger(__name__)

METHODS = ("auto", "exact", "incremental")


# ---------------------------------------------------------------------------------------------
# Slot bookkeeping
# ---------------------------------------------------------------------------------------------
def _membership(row: np.ndarray, E: int, G: int, S: int) -> np.ndarray:
    """bool ``[E, G]``: expert ``e`` has a replica on GPU ``g`` (row is one layer's ``[P]`` map)."""
    x = np.zeros((E, G), dtype=bool)
    x[row, np.arange(row.size) // S] = True
    return x


def _fill_slots(x: np.ndarray, prev_row: np.ndarray, S: int) -> np.ndarray:
    """A ``[P]`` map holding the pairs of ``x [E, G]``, with every expert kept on a GPU in its old slot.

    Experts new on a GPU take that GPU's freed slots in ascending expert order.
    """
    E, G = x.shape
    out = np.empty_like(prev_row)
    for g in range(G):
        old = prev_row[g * S : (g + 1) * S]  # [S]
        want = np.flatnonzero(x[:, g])
        keep = x[old, g]  # [S] slot keeps its expert
        new = np.setdiff1d(want, old[keep], assume_unique=True)
        seg = old.copy()
        seg[~keep] = new
        out[g * S : (g + 1) * S] = seg
    return out


def keep_slots(new: Placement, previous: Placement) -> Placement:
    """Permute slots within each GPU of ``new`` so experts that stay on a GPU keep their slot.

    GPU contents (and so all loads) are unchanged; ``moved_slots(previous, result)`` becomes the
    number of (GPU, expert) pairs of ``new`` that ``previous`` lacks.
    """
    _check_same_shape(new, previous)
    t = new.topology
    E, G, S = new.num_logical_experts, t.ep_size, t.slots_per_gpu
    p2l = np.stack(
        [
            _fill_slots(
                _membership(new.physical_to_logical_map[l], E, G, S), previous.physical_to_logical_map[l], S
            )
            for l in range(new.num_layers)
        ]
    )
    return Placement(p2l, E, t, new.layer_ids, new.provenance)


def moved_pairs(previous: Placement, new: Placement) -> np.ndarray:
    """int64 ``[L]``: (GPU, expert) pairs of ``new`` absent from ``previous`` (the least moved slots
    any slot order within GPUs can reach)."""
    _check_same_shape(new, previous)
    t = new.topology
    E, G, S = new.num_logical_experts, t.ep_size, t.slots_per_gpu
    out = np.zeros(new.num_layers, dtype=np.int64)
    for l in range(new.num_layers):
        a = _membership(previous.physical_to_logical_map[l], E, G, S)
        b = _membership(new.physical_to_logical_map[l], E, G, S)
        out[l] = int((b & ~a).sum())
    return out


def _check_same_shape(new: Placement, previous: Placement) -> None:
    if new.topology != previous.topology or new.num_logical_experts != previous.num_logical_experts:
        raise ValueError(
            f"placements differ: {new.num_logical_experts} vs {previous.num_logical_experts} logical experts, "
            f"topology {new.topology} vs {previous.topology}; align needs the same experts and topology"
        )
    if new.num_layers != previous.num_layers:
        raise ValueError(
            f"placements have {new.num_layers} vs {previous.num_layers} layers; select matching layers first"
        )


def align_to_previous(new: Placement, previous: Placement) -> Placement:
    """Relabel GPUs within nodes (and nodes) and slots within GPUs to minimise moved slots.

    Loads do not change: each GPU's set of experts is kept whole and only renamed, so the multiset of
    per-GPU loads (and every balance metric) is the same. Node relabelling and GPU relabelling inside
    nodes are both linear assignments (scipy ``linear_sum_assignment``) maximising kept pairs; slots
    inside a GPU then follow :func:`keep_slots`.

    Args:
        new: the placement to relabel (e.g. a greedy solve from scratch).
        previous: the placement now in service (same topology, experts and layer count).

    Returns:
        A placement with the same per-GPU expert sets as ``new`` up to GPU renaming.
    """
    from scipy.optimize import linear_sum_assignment

    _check_same_shape(new, previous)
    t = new.topology
    E, G, S, N, m = new.num_logical_experts, t.ep_size, t.slots_per_gpu, t.num_nodes, t.gpus_per_node
    rows = []
    for l in range(new.num_layers):
        xn = _membership(new.physical_to_logical_map[l], E, G, S)  # [E, G]
        xp = _membership(previous.physical_to_logical_map[l], E, G, S)
        overlap = xn.T.astype(np.int64) @ xp.astype(np.int64)  # [G new, G old] kept pairs
        # Best GPU matching for every (new node, old node) pair, then the node matching.
        node_score = np.zeros((N, N))
        node_match: dict[tuple[int, int], np.ndarray] = {}
        for a in range(N):
            for b in range(N):
                block = overlap[a * m : (a + 1) * m, b * m : (b + 1) * m]  # [m, m]
                ri, ci = linear_sum_assignment(block, maximize=True)
                node_score[a, b] = block[ri, ci].sum()
                node_match[(a, b)] = ci  # new GPU a*m+ri[i] -> old GPU b*m+ci[i]; ri is arange
        na, nb = linear_sum_assignment(node_score, maximize=True)
        new_to_old = np.empty(G, dtype=np.int64)
        for a, b in zip(na, nb):
            new_to_old[a * m + np.arange(m)] = b * m + node_match[(a, b)]
        x_relabelled = np.zeros_like(xn)
        x_relabelled[:, new_to_old] = xn
        rows.append(_fill_slots(x_relabelled, previous.physical_to_logical_map[l], S))
    prov = dict(new.provenance)
    prov["aligned_to_previous"] = True
    return Placement(np.stack(rows), E, t, new.layer_ids, prov)


# ---------------------------------------------------------------------------------------------
# Incremental local search
# ---------------------------------------------------------------------------------------------
class _Layer:
    """Mutable search state of one layer: membership ``x [E, G]``, counts ``[E]``, loads ``[G]``."""

    def __init__(self, w: np.ndarray, prev_row: np.ndarray, E: int, G: int, S: int):
        self.w = w  # [E]
        self.S = S
        self.prev = _membership(prev_row, E, G, S)  # [E, G]
        self.x = self.prev.copy()
        self.cnt = self.x.sum(axis=1).astype(np.int64)  # [E]
        self.moved = 0
        self.moves = {"replace": 0, "swap": 0}
        self._refresh()
        self.tol = 1e-12 * (float(w.sum()) + 1.0)

    def _refresh(self) -> None:
        u = self.w / self.cnt  # [E] per-replica load
        self.load = (self.x * u[:, None]).sum(axis=0)  # [G]
        self.peak = float(self.load.max())

    def best_move(self, move_cost: float, budget_left: float):
        """Best (efficiency, net, gain, dmoved, move) or None. ``efficiency = net / max(dmoved, 1)``."""
        w, x, cnt, load, prev = self.w, self.x, self.cnt, self.load, self.prev
        E, G = x.shape
        u = w / cnt  # [E]
        cands = []

        # -- replace: on GPU h, expert a (cnt >= 2) -> expert b (not on h) ------------------------
        A = np.flatnonzero(cnt >= 2)
        if A.size:
            da = w[A] / (cnt[A] - 1) - u[A]  # [A] load rise on a's other GPUs
            ub = w / (cnt + 1)  # [E] b's per-replica load after gaining one
            db = u - ub  # [E] load drop on b's GPUs
            base = (
                load[None, None, :] + da[:, None, None] * x[A][:, None, :] - db[None, :, None] * x[None, :, :]
            )  # [A, E, G]
            if G >= 2:
                part = np.argpartition(-base, 1, axis=2)[:, :, :2]  # [A, E, 2] two largest
                v = np.take_along_axis(base, part, axis=2)
                order = np.argsort(-v, axis=2)
                top_i = np.take_along_axis(part, order, axis=2)  # [A, E, 2]
                top_v = np.take_along_axis(v, order, axis=2)
            ai, h = np.nonzero(x[A])  # pairs: A-index, GPU holding it
            if ai.size:
                excl = (
                    np.where(top_i[ai, :, 0] == h[:, None], top_v[ai, :, 1], top_v[ai, :, 0])
                    if G >= 2
                    else np.full((ai.size, E), -np.inf)
                )
                newh = load[h][:, None] - u[A[ai]][:, None] + ub[None, :]  # [pairs, E]
                newpeak = np.maximum(excl, newh)
                valid = ~x[:, h].T  # [pairs, E] b not on h (excludes b == a)
                dm = (~prev[:, h].T).astype(np.int64) - (~prev[A[ai], h]).astype(np.int64)[
                    :, None
                ]  # [pairs, E]
                cands.append(("replace", newpeak, valid, dm, (ai, h)))

        # -- swap: expert a on the hottest GPU g1 <-> expert b on GPU g2 --------------------------
        g1 = int(np.argmax(load))
        if G >= 2:
            ords = np.argsort(-load, kind="stable")
            a_list = np.flatnonzero(x[:, g1])  # [S]
            b_e, b_g = np.nonzero(x)  # all pairs
            keep = (b_g != g1) & ~x[b_e, g1]
            b_e, b_g = b_e[keep], b_g[keep]
            if a_list.size and b_e.size:
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
                cands.append(("swap", newpeak, valid, dm, (a_list, b_e, b_g, g1)))

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


def _incremental(
    states: list[_Layer], move_cost: float, max_moves: float, deadline: float, max_iters: int
) -> tuple[int, bool]:
    """Run the global best-efficiency-first search in place. Returns (iterations, hit_deadline)."""
    budget = max_moves
    heap: list = []
    for l, st in enumerate(states):
        bm = st.best_move(move_cost, budget)
        if bm is not None:
            heapq.heappush(heap, (-bm[0], l, bm))
    it = 0
    while heap and it < max_iters:
        if time.perf_counter() > deadline:
            return it, True
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
    return it, False


# ---------------------------------------------------------------------------------------------
# Exact (CP-SAT)
# ---------------------------------------------------------------------------------------------
def _exact_layer(w, prev_x, hint_x, S, move_cost, budget, time_limit, seed, max_bool_vars=20000):
    """CP-SAT on one layer. Returns (x [E, G] or None, status, bound_on_objective or None, note)."""
    from ortools.sat.python import cp_model

    E, G = prev_x.shape
    P = G * S
    cmax = max(1, min(G, 1 + P - E))
    hint_cnt = hint_x.sum(axis=1)
    prev_cnt = prev_x.sum(axis=1)
    restricted = E * G * cmax > max_bool_vars
    allowed = []
    for e in range(E):
        if restricted:
            cs = set(range(max(1, hint_cnt[e] - 2), min(cmax, hint_cnt[e] + 2) + 1)) | {int(prev_cnt[e])}
        else:
            cs = set(range(1, cmax + 1))
        allowed.append(sorted(cs))
    scale = 1e6 / max(float(w.max()), 1e-12)
    q = {(e, c): int(round(w[e] / c * scale)) for e in range(E) for c in allowed[e]}
    mcq = int(round(move_cost * scale))

    model = cp_model.CpModel()
    # Variables: x[e, g] replica of e on g; z[e, c] e has c replicas; t[e, g, c] = x AND z.
    x = {(e, g): model.new_bool_var(f"x{e}_{g}") for e in range(E) for g in range(G)}
    z = {(e, c): model.new_bool_var(f"z{e}_{c}") for e in range(E) for c in allowed[e]}
    t = {
        (e, g, c): model.new_bool_var(f"t{e}_{g}_{c}") for e in range(E) for g in range(G) for c in allowed[e]
    }
    peak = model.new_int_var(0, int(sum(max(q[e, c] for c in allowed[e]) for e in range(E))), "peak")
    # One replica count per expert, matching its replicas.
    for e in range(E):
        model.add_exactly_one(z[e, c] for c in allowed[e])
        model.add(sum(x[e, g] for g in range(G)) == sum(c * z[e, c] for c in allowed[e]))
    # Every GPU holds exactly S distinct experts.
    for g in range(G):
        model.add(sum(x[e, g] for e in range(E)) == S)
    # t[e, g, c] is x[e, g] with count c (exactly one c per held pair).
    for e in range(E):
        for g in range(G):
            model.add(sum(t[e, g, c] for c in allowed[e]) == x[e, g])
            for c in allowed[e]:
                model.add_implication(t[e, g, c], z[e, c])
    # Peak bounds every GPU's load.
    for g in range(G):
        model.add(sum(q[e, c] * t[e, g, c] for e in range(E) for c in allowed[e]) <= peak)
    # Moved slots: pairs the previous placement lacks.
    moved = sum(x[e, g] for e in range(E) for g in range(G) if not prev_x[e, g])
    if budget is not None:
        model.add(moved <= int(budget))
    model.minimize(peak + mcq * moved)
    # Hint: the incremental result.
    for e in range(E):
        for g in range(G):
            model.add_hint(x[e, g], bool(hint_x[e, g]))
        for c in allowed[e]:
            model.add_hint(z[e, c], int(hint_cnt[e]) == c)
            for g in range(G):
                model.add_hint(t[e, g, c], bool(hint_x[e, g]) and int(hint_cnt[e]) == c)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, float(time_limit))
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = int(seed)
    code = solver.solve(model)
    note = "replica counts restricted to +-2 around the hint" if restricted else ""
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, "time_limit" if code == cp_model.UNKNOWN else "infeasible", None, note
    out = np.array([[bool(solver.value(x[e, g])) for g in range(G)] for e in range(E)])
    status = (
        "optimal"
        if code == cp_model.OPTIMAL and not restricted
        else ("feasible" if code == cp_model.OPTIMAL else "time_limit")
    )
    bound = None if restricted else solver.best_objective_bound / scale
    return out, status, bound, note


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------
def solve_migration(
    load: np.ndarray,
    previous: Placement,
    *,
    max_moves: int | None = None,
    move_cost: float | None = None,
    time_limit: float = 5.0,
    seed: int = 0,
    method: Literal["auto", "exact", "incremental"] = "auto",
    drift_guard: float = 1.5,
    layer_ids: Sequence[int] | None = None,
) -> tuple[Placement, SolveReport]:
    """Re-place for a new load starting from ``previous``, trading balance against moved slots.

    Args:
        load: ``[L, E]`` tokens per logical expert (the window the new placement should serve).
        previous: the placement in service (``L`` layers, ``E`` experts).
        max_moves: total moved slots allowed over all layers (None: no budget).
        move_cost: objective cost of one moved slot, in load units (tokens of peak); None means 0,
            so only the peak and ``max_moves`` matter.
        time_limit: seconds for the whole solve (exact: split over layers).
        seed: CP-SAT seed (the incremental search is deterministic).
        method: ``incremental`` (also ``auto``) or ``exact`` (CP-SAT seeded with the incremental result).
        drift_guard: fall back to a full re-solve (greedy + :func:`align_to_previous`) for a layer whose
            incremental peak gap over the lower bound exceeds ``drift_guard`` x the full re-solve's gap.
        layer_ids: real layer index per row (default: ``previous.layer_ids``).

    Returns:
        ``(placement, report)``; ``report.layers[l].objective`` is ``peak + move_cost * moved``, the
        baseline objective is the previous placement's peak, ``bound`` the closed-form peak lower
        bound (or CP-SAT's bound), and ``extra`` holds ``moved_slots``, ``peak``, ``previous_peak``,
        ``full_resolve_peak``, ``full_resolve_moved_slots``, ``drift_fallback`` and move counts.
    """
    t0 = time.perf_counter()
    if not isinstance(previous, Placement):
        raise ValueError(f"previous must be a Placement, got {type(previous).__name__}")
    w = np.asarray(load, dtype=np.float64)
    L, E = previous.num_layers, previous.num_logical_experts
    if w.shape != (L, E):
        raise ValueError(
            f"load has shape {w.shape} but the previous placement has {L} layers x {E} experts; "
            f"pass a [{L}, {E}] load (select matching layers)"
        )
    if not np.all(np.isfinite(w)) or (w.size and w.min() < 0):
        raise ValueError("load must be finite and >= 0 (found NaN, inf or a negative count)")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {METHODS}")
    if max_moves is not None and (
        isinstance(max_moves, bool) or int(max_moves) != max_moves or max_moves < 0
    ):
        raise ValueError(f"max_moves must be a non-negative integer (total over layers), got {max_moves!r}")
    mc = 0.0 if move_cost is None else float(move_cost)
    if not np.isfinite(mc) or mc < 0:
        raise ValueError(f"move_cost must be finite and >= 0 (load units per moved slot), got {move_cost!r}")
    if not drift_guard >= 1.0:
        raise ValueError(
            f"drift_guard must be >= 1 (a multiple of the full re-solve's gap), got {drift_guard!r}"
        )
    if time_limit <= 0:
        raise ValueError(f"time_limit must be > 0 seconds, got {time_limit}")
    if previous.allow_colocated_replicas:
        raise ValueError(
            "previous placement co-locates replicas of one expert; migrate from a valid placement"
        )
    ids = tuple(layer_ids) if layer_ids is not None else previous.layer_ids
    if len(ids) != L:
        raise ValueError(f"layer_ids has {len(ids)} entries for {L} layers")
    topo = previous.topology
    G, S, P = topo.ep_size, topo.slots_per_gpu, topo.num_physical_experts
    budget = float("inf") if max_moves is None else float(max_moves)
    prev_map = previous.physical_to_logical_map

    # 1) Incremental search over all layers (budget to the best gain per slot first).
    states = [_Layer(w[l], prev_map[l], E, G, S) for l in range(L)]
    prev_peak = np.array([st.peak for st in states])
    inc_share = 0.6 if method == "exact" else 0.9
    iters, hit_deadline = _incremental(states, mc, budget, t0 + inc_share * time_limit, max_iters=8 * P * L)
    notes: list[str] = []
    if hit_deadline:
        notes.append(f"incremental search stopped at the time limit after {iters} moves")

    # 2) Drift guard: compare with a full re-solve relabelled to the previous placement.
    from solver.greedy import greedy_placement

    full, _ = greedy_placement(w, topo, layer_ids=ids)
    full = align_to_previous(full, previous)
    full_peak = expected_gpu_load(full, w).max(axis=1)  # [L]
    full_moved = moved_pairs(previous, full)  # [L]
    lb = peak_lower_bound(w, G, P)  # [L]
    spent = sum(st.moved for st in states)
    fallback = np.zeros(L, dtype=bool)
    cand = []
    for l, st in enumerate(states):
        denom = max(lb[l], 1e-12)
        gap_inc, gap_full = st.peak / denom - 1.0, full_peak[l] / denom - 1.0
        obj_inc, obj_full = st.peak + mc * st.moved, full_peak[l] + mc * full_moved[l]
        if gap_inc > drift_guard * gap_full + 1e-9 and obj_full < obj_inc - st.tol:
            cand.append((obj_inc - obj_full, l))
    for _, l in sorted(cand, reverse=True):
        extra_moves = full_moved[l] - states[l].moved
        if spent + extra_moves <= budget:
            fallback[l] = True
            spent += extra_moves
    x_final = [
        full_x if fallback[l] else st.x
        for l, (st, full_x) in enumerate(
            zip(states, (_membership(full.physical_to_logical_map[l], E, G, S) for l in range(L)))
        )
    ]
    if fallback.any():
        notes.append(f"drift guard: {int(fallback.sum())} layer(s) took the full re-solve")

    # 3) Exact refinement per layer (budget per layer = what the incremental pass spent there).
    statuses = ["heuristic"] * L
    bounds = lb.astype(float).copy()
    no_solution: list[int] = []
    if method == "exact":
        remaining = max(0.05, time_limit - (time.perf_counter() - t0))
        for l in range(L):
            per_layer_budget = None if max_moves is None else int(moved_pairs_x(states[l].prev, x_final[l]))
            tl = remaining / (L - l) if l < L else remaining
            ts = time.perf_counter()
            xe, status, bnd, note = _exact_layer(
                w[l], states[l].prev, x_final[l], S, mc, per_layer_budget, tl, seed + l
            )
            remaining = max(0.05, remaining - (time.perf_counter() - ts))
            if note and note not in notes:
                notes.append(note)
            if xe is None:  # CP-SAT found nothing in its share of the time: the incremental result stays
                no_solution.append(ids[l])
                continue
            statuses[l] = status
            if bnd is not None:
                bounds[l] = max(bounds[l], bnd)
            if _objective_x(w[l], xe, states[l].prev, mc) < _objective_x(
                w[l], x_final[l], states[l].prev, mc
            ):
                x_final[l] = xe
        if no_solution:
            notes.append(
                f"CP-SAT found no solution within its time share on layer(s) {no_solution}; "
                f"their incremental result was kept (status heuristic)"
            )

    # 4) Never worse than staying put; keep slots of unchanged experts.
    rows, layers = [], []
    for l in range(L):
        prev_x = states[l].prev
        obj = _objective_x(w[l], x_final[l], prev_x, mc)
        if obj > prev_peak[l]:  # cannot happen by construction; kept as the contract's guard
            x_final[l] = prev_x
            obj = prev_peak[l]
        rows.append(_fill_slots(x_final[l], prev_map[l], S))
        peak_l = _peak_x(w[l], x_final[l])
        moved_l = moved_pairs_x(prev_x, x_final[l])
        layers.append(
            LayerReport(
                layer_id=ids[l],
                status=statuses[l],
                objective=float(obj),
                bound=float(min(bounds[l], obj)),
                wall_time_s=0.0,
                baseline_objective=float(prev_peak[l]),
                mean_load=float(w[l].sum() / G),
                extra={
                    "moved_slots": int(moved_l),
                    "peak": float(peak_l),
                    "previous_peak": float(prev_peak[l]),
                    "full_resolve_peak": float(full_peak[l]),
                    "full_resolve_moved_slots": int(full_moved[l]),
                    "drift_fallback": bool(fallback[l]),
                    "replace_moves": states[l].moves["replace"],
                    "swap_moves": states[l].moves["swap"],
                },
            )
        )
    params = {
        "method": "incremental" if method == "auto" else method,
        "max_moves": max_moves,
        "max_moves_scope": "total over layers",
        "move_cost": mc,
        "time_limit": time_limit,
        "seed": seed,
        "drift_guard": drift_guard,
    }
    placement = Placement(np.stack(rows), E, topo, ids, {"solver": "migration", **params})
    wall = time.perf_counter() - t0
    log.debug(
        "migration: %d moved slots over %d layers in %.3fs",
        sum(lr.extra["moved_slots"] for lr in layers),
        L,
        wall,
    )
    return placement, SolveReport("migration", tuple(layers), wall, params, tuple(notes))


def moved_pairs_x(prev_x: np.ndarray, x: np.ndarray) -> int:
    return int((x & ~prev_x).sum())


def _peak_x(w: np.ndarray, x: np.ndarray) -> float:
    cnt = x.sum(axis=1)
    return float((x * (w / cnt)[:, None]).sum(axis=0).max())


def _objective_x(w, x, prev_x, mc) -> float:
    return _peak_x(w, x) + mc * moved_pairs_x(prev_x, x)
