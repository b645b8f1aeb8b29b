"""One layer of the plain exact solve: start -> local search -> backend -> keep the best -> report.

Shapes: ``L`` layers, ``E`` experts, ``G`` GPUs with ``S`` slots, ``P = G * S``, ``W`` windows;
``assign`` int ``[G, S]``, a map ``row`` int ``[P]``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from placement.topology import Topology
from solver.exact.costs import DecodeCost, count_lower_bound, layer_cost_table
from solver.exact.cpsat import _solve_cpsat
from solver.exact.layer_problem import _FULL_MODEL_LIMIT, _counts_of, _Layer, _Result, _Start, _valid_node
from solver.exact.lns import _large_layer
from solver.exact.local_search import _local_search
from solver.exact.milp import _solve_milp
from solver.exact.options import ExactOptions
from solver.report import LayerReport
from solver.weighted import even_split_peak, weighted_shares

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Setup:
    """What every layer's solve shares (built once per solve)."""

    options: ExactOptions
    topology: Topology
    agg: np.ndarray  # [L, E] summed load (tokens)
    wnorm: np.ndarray  # [W, L, E] windows, normalised to mean 1 per GPU when there are several
    greedy_map: np.ndarray  # [L, P] greedy's placement
    hint_map: np.ndarray | None  # [L, P] the hint's placement
    decode: DecodeCost | None
    rmax: int
    robust_m: int  # windows averaged in the objective (1 = max)
    group_of_expert: np.ndarray | None  # [E] when node constrained
    groups_per_node: int
    per_layer: float  # seconds (or deterministic budget) per layer
    deadline: float  # wall-clock end of the whole solve
    ls_iters: int  # local-search moves per layer
    cb_agg: np.ndarray  # [L] count bound of the summed load
    layer_ids: tuple[int, ...] | list[int] | None
    notes: list[str]
    lock: threading.Lock
    out_of_time: list[int] = field(default_factory=list)  # layers whose backend the deadline skipped
    started: list[int] = field(default_factory=lambda: [0])  # layers begun so far (a shared counter)
    skip_cost: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [seconds, layers] of greedy reports


def _solve_layer(ctx: _Setup, l: int) -> tuple[np.ndarray, LayerReport]:
    """Layer ``l``: its map ``[P]`` (never worse than greedy's) and its report."""
    t0 = time.perf_counter()
    with ctx.lock:
        ctx.started[0] += 1
    if _wall_left(ctx, t0) <= 0:  # out of time before the layer begins
        return _out_of_time_layer(ctx, l, t0)
    wl = ctx.wnorm[:, l]  # [W, E]
    pb = _layer_problem(ctx, wl)
    g_val, inc_val, inc, iters = _start(ctx, pb, l, t0)
    # bounds valid for any placement
    lb_true = None
    if ctx.options.objective == "tokens":
        lb_true = np.array(
            [count_lower_bound(wl[w], pb.G, ctx.topology.num_physical_experts) for w in range(pb.W)]
        )
    model_lb = float(pb.agg(lb_true)) if lb_true is not None else 0.0
    res = _run_backend(ctx, pb, l, _Start(inc, inc_val, wl, lb_true), model_lb, t0)
    inc, model_val, model_lb, status = _take_result(ctx, pb, l, res, inc, inc_val, g_val, model_lb)
    row = inc.reshape(-1)
    if model_val >= g_val - 1e-12 * max(1, g_val):
        row = ctx.greedy_map[l]
        model_val = g_val
    outcome = _Outcome(row, res, status, model_val, model_lb, g_val, iters)
    return row, _layer_report(ctx, pb, l, t0, outcome)


def _out_of_time_layer(ctx: _Setup, l: int, t0: float) -> tuple[np.ndarray, LayerReport]:
    """Layer ``l`` with no time left: :func:`greedy_layer` (its cost counted for the reserve)."""
    out = greedy_layer(ctx, l, t0)
    with ctx.lock:
        ctx.out_of_time.append(l)
        ctx.skip_cost[0] += time.perf_counter() - t0
        ctx.skip_cost[1] += 1
    return out


def greedy_layer(ctx: _Setup, l: int, t0: float) -> tuple[np.ndarray, LayerReport]:
    """Layer ``l``'s greedy map ``[P]`` and a report of its peak, built without the layer's cost table
    or search (the model's objective values are then None): what a layer past the deadline gets."""
    topo, opt, w = ctx.topology, ctx.options, ctx.agg[l]  # w: [E]
    row = ctx.greedy_map[l]
    g_tok = even_split_peak(row, w, topo.ep_size, topo.slots_per_gpu)
    extra = {
        "backend": opt.backend,
        "proved_by": None,
        "model_objective": None,
        "model_baseline": None,
        "model_bound": None,
        "local_search_iters": 0,
        "restricted": False,
        "counts_changed": 0,
        "solver_wall_s": 0.0,
        "out_of_time": True,
    }
    if opt.weighted:
        shares, wpeak = weighted_shares(row, w, topo)
        extra.update(replica_shares=shares.tolist(), weighted_objective=wpeak)
        extra["weighted_bound"] = float(max(w.sum() / topo.ep_size, w.max() / ctx.rmax))
    return row, LayerReport(
        layer_id=int(ctx.layer_ids[l]) if ctx.layer_ids else l,
        status="greedy_fallback",
        objective=g_tok,
        bound=float(min(ctx.cb_agg[l], g_tok)),
        wall_time_s=time.perf_counter() - t0,
        baseline_objective=g_tok,
        mean_load=float(w.sum() / topo.ep_size),
        extra=extra,
    )


def _layer_problem(ctx: _Setup, wl: np.ndarray) -> _Layer:
    """The layer's problem from its windows ``wl [W, E]``."""
    topo, node_constraint = ctx.topology, ctx.options.node_constraint
    return _Layer(
        cost=layer_cost_table(wl, ctx.rmax, ctx.options.objective, ctx.decode, topo.ep_size),
        G=topo.ep_size,
        S=topo.slots_per_gpu,
        rmax=ctx.rmax,
        robust_m=ctx.robust_m,
        node_of_gpu=topo.node_of_gpu if node_constraint else None,
        group_of_expert=ctx.group_of_expert,
        groups_per_node=ctx.groups_per_node,
    )


def _start(ctx: _Setup, pb: _Layer, l: int, t0: float) -> tuple[float, float, np.ndarray, int]:
    """Greedy's objective, and the incumbent: the better of greedy and the hint, improved by the local
    search. Returns ``(greedy value, incumbent value, incumbent [G, S], local-search iterations)``."""
    G, S, E = pb.G, pb.S, pb.E
    start = ctx.greedy_map[l].reshape(G, S)
    g_val = pb.value(start, _counts_of(start, E))
    cands = [(g_val, start, "greedy")]
    if ctx.hint_map is not None:
        hm = ctx.hint_map[l].reshape(G, S)
        if _valid_node(hm, pb):
            cands.append((pb.value(hm, _counts_of(hm, E)), hm, "hint"))
    inc_val, inc, _ = min(cands, key=lambda c: c[0])
    # the whole solve's deadline (less the reserve of the layers not yet begun) is a hard wall in both
    # modes; deterministic: iteration counts within it
    wall = time.perf_counter() + _wall_left(ctx, t0)
    ls_deadline = wall if ctx.options.deterministic else min(wall, t0 + ctx.per_layer * 0.5)
    ls_assign, iters = _local_search(pb, inc, ctx.ls_iters, ls_deadline)
    ls_val = pb.value(ls_assign, _counts_of(ls_assign, E))
    if ls_val < inc_val:
        inc, inc_val = ls_assign, ls_val
    return g_val, inc_val, inc, iters


def _run_backend(
    ctx: _Setup, pb: _Layer, l: int, start: _Start, model_lb: float, t0: float
) -> _Result | None:
    """The backend's result from ``start`` (the incumbent ``[G, S]`` and its value), or None when the gap
    is closed or no time is left. Large layers go to the neighbourhood search; a failing backend is a
    result, not an error."""
    opt = ctx.options
    inc, inc_val = start.assign, start.value
    gap_now = (inc_val - model_lb) / inc_val if inc_val > 0 else 0.0
    wall_left = _wall_left(ctx, t0)
    if opt.deterministic:  # the layer's whole share: a budget that does not depend on how long the start took
        remaining = ctx.per_layer
    else:
        remaining = min(ctx.per_layer - (time.perf_counter() - t0), wall_left)
    if gap_now > 1e-9 and wall_left <= 0.02:
        with ctx.lock:
            ctx.out_of_time.append(l)
        return None
    if not (gap_now > 1e-9 and remaining > 0.02):
        return None
    P = ctx.topology.num_physical_experts
    try:
        if pb.E * pb.G * pb.W > _FULL_MODEL_LIMIT:
            return _large_layer(pb, inc, opt.seed, remaining, opt.deterministic, ctx.ls_iters, ctx.deadline)
        if opt.backend == "cpsat":
            return _solve_cpsat(
                pb, start, opt.objective, P, opt.seed, remaining, opt.deterministic, wall_left
            )
        return _solve_milp(pb, start, opt.objective, P, opt.seed, min(remaining, wall_left))
    except Exception as exc:  # a solver failure is data, not an exception
        log.warning("layer %d: %s backend failed: %s", l, opt.backend, exc)
        return _Result(None, "error", None, False, 0.0, f"{type(exc).__name__}: {exc}")


def _wall_left(ctx: _Setup, t0: float) -> float:
    """Seconds this layer's search may still use: the whole solve's time limit is a hard wall, less
    what the layers not yet begun need if they all end as :func:`greedy_layer` (1.5 x its mean cost,
    measured once before the layers and on every such layer)."""
    pending = ctx.agg.shape[0] - ctx.started[0]
    spent, done = ctx.skip_cost
    return ctx.deadline - time.perf_counter() - 1.5 * (spent / max(done, 1)) * pending


def _take_result(
    ctx: _Setup,
    pb: _Layer,
    l: int,
    res: _Result | None,
    inc: np.ndarray,
    inc_val: float,
    g_val: float,
    model_lb: float,
) -> tuple[np.ndarray, float, float, str]:
    """Merge the backend's result into the incumbent: ``(assign [G, S], model value, model bound, status)``."""
    status = "feasible"
    model_val = inc_val
    if res is not None and res.note:
        with ctx.lock:
            ctx.notes.append(f"layer {l}: {res.note}")
    if res is not None and res.assign is not None:
        v = pb.value(res.assign, _counts_of(res.assign, pb.E))
        if v < inc_val - 1e-12 * max(1, inc_val):
            inc, model_val = res.assign, v
        status = res.status
        if res.complete and res.model_bound is not None:
            model_lb = max(model_lb, min(res.model_bound, model_val))
        if not res.complete and status == "optimal":
            status = "feasible"
    elif res is not None:
        # the backend returned nothing (no solution in time, infeasible model, or a failure): the
        # layer keeps a valid placement, so its status says where that placement came from
        status = "feasible" if inc_val < g_val else "greedy_fallback"
        with ctx.lock:
            ctx.notes.append(
                f"layer {l}: {ctx.options.backend} backend ended {res.status!r} without a solution; "
                f"kept the {'local-search' if inc_val < g_val else 'greedy'} placement"
            )
    return inc, model_val, model_lb, status


@dataclass(frozen=True)
class _Outcome:
    """How one layer's search ended: ``row [P]`` the chosen map, the backend's result (None: not run),
    the status, the model objective and bound, greedy's model objective and the local-search iterations."""

    row: np.ndarray
    res: _Result | None
    status: str
    model_val: float
    model_lb: float
    g_val: float
    iters: int


def _layer_report(ctx: _Setup, pb: _Layer, l: int, t0: float, outcome: _Outcome) -> LayerReport:
    """The layer's report in tokens on the summed load (``outcome.row [P]`` the chosen map)."""
    opt, G, S, E = ctx.options, pb.G, pb.S, pb.E
    row, res, status = outcome.row, outcome.res, outcome.status
    model_val, model_lb, g_val, iters = outcome.model_val, outcome.model_lb, outcome.g_val, outcome.iters
    w = ctx.agg[l]  # [E]
    proved_by = None
    if res is not None and res.assign is not None and status == "optimal":
        proved_by = opt.backend
    obj_tok = even_split_peak(row, w, G, S)
    g_row = ctx.greedy_map[l]
    g_tok = even_split_peak(g_row, w, G, S)
    glob_bound = float(ctx.cb_agg[l])
    if (
        opt.objective == "tokens"
        and pb.W == 1
        and res is not None
        and res.complete
        and res.model_bound is not None
    ):
        glob_bound = max(glob_bound, min(res.model_bound, obj_tok))
    if model_lb >= model_val * (1 - 1e-7):
        if status != "optimal" or proved_by is None:
            proved_by = "bound"  # the objective meets a proven lower bound
        status = "optimal"
    extra = {
        "backend": opt.backend,
        "proved_by": proved_by,
        "model_objective": float(model_val),
        "model_baseline": float(g_val),
        "model_bound": float(model_lb),
        "local_search_iters": iters,
        "restricted": bool(res is not None and not res.complete),
        "counts_changed": int((np.bincount(row, minlength=E) != np.bincount(g_row, minlength=E)).sum()),
        "solver_wall_s": float(res.wall) if res is not None else 0.0,
    }
    if opt.weighted:
        shares, wpeak = weighted_shares(row, w, ctx.topology)
        extra["replica_shares"] = shares.tolist()
        extra["weighted_objective"] = wpeak
        extra["weighted_bound"] = float(max(w.sum() / G, w.max() / ctx.rmax))
    return LayerReport(
        layer_id=int(ctx.layer_ids[l]) if ctx.layer_ids else l,
        status=status,
        objective=obj_tok,
        bound=float(min(glob_bound, obj_tok)),
        wall_time_s=time.perf_counter() - t0,
        baseline_objective=g_tok,
        mean_load=float(w.sum() / G),
        extra=extra,
    )
