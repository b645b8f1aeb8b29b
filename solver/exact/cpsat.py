"""The joint CP-SAT model of one layer (package docstring), in OR-Tools' sample order.

Data (scaled integer costs, count ranges, the canonical hint), variables, one function per
constraint family, objective, hints, solve, and the status checked before any value is read.

Shapes: ``E`` experts, ``G`` GPUs with ``S`` slots, ``N`` nodes, ``W`` windows, ``R = rmax``;
``tab`` int64 ``[W, E, R+1]`` scaled shares; ``x[e][g]`` bool (a replica of ``e`` on ``g``),
``n[e]`` replicas of ``e`` (an int when its range is a single count).

Ctrl-C and SIGTERM: every CP-SAT search of the project runs through :func:`solver.search.run_solve`
(see there).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from solver.exact.layer_problem import (
    _DET_FACTOR,
    _SAFETY_CAP,
    _canonical,
    _count_ranges,
    _counts_of,
    _integer_costs,
    _Layer,
    _Result,
    _Start,
)
from solver.search import run_solve as _run_solve


@dataclass
class _CpData:
    """The model's data: scaled costs and count ranges of one layer, and the incumbent as a hint."""

    tab: np.ndarray  # [W, E, R+1] int64 scaled shares (index 0 = 0)
    K: float  # scale: model units per token
    exact: bool  # K is the exact lcm scaling (no rounding)
    lo: np.ndarray  # [E] least replica count
    hi: np.ndarray  # [E] largest replica count
    complete: bool  # the ranges were not narrowed: the model's bound is a global bound
    var_e: list[int]  # experts whose count is a variable (lo < hi)
    inc_counts: np.ndarray  # [E] the incumbent's counts
    e0: int  # the hottest expert (symmetry breaking)
    grp0: int | None  # its group (node constrained)
    hint: np.ndarray  # [G, S] the canonicalised incumbent
    hint_x: np.ndarray  # [E, G] bool
    hint_loads: np.ndarray  # [W, G] its scaled loads


@dataclass
class _CpVars:
    """The model's variables (filled family by family)."""

    x: list = field(default_factory=list)  # [E][G] bool vars
    n: list = field(default_factory=list)  # [E] int vars or ints
    a: list = field(default_factory=list)  # [groups][N] bool vars: group q on node k
    t: dict = field(default_factory=dict)  # (w, e) -> share of one replica of e
    s: dict = field(default_factory=dict)  # (w, e, g) -> e's share on g (0 when absent)
    loads: list = field(default_factory=list)  # [W][G] GPU loads
    peak: list = field(default_factory=list)  # [W] window peaks
    obj: Any = None
    hint_obj: int = 0
    num_nodes: int = 0
    num_groups: int = 0


def _cpsat_data(
    pb: _Layer, incumbent: np.ndarray, inc_value: float, objective: str, windows: np.ndarray, P: int
) -> _CpData:
    """Scaled costs, count ranges and the canonical hint from ``incumbent [G, S]`` (``windows [W, E]``)."""
    E, G = pb.E, pb.G
    tab, K, exact = _integer_costs(pb, objective, windows)
    lo, hi, complete = _count_ranges(pb, incumbent, inc_value, objective, windows, P)
    inc_counts = _counts_of(incumbent, E)
    e0 = int(np.argmax(pb.cost[:, :, 1].max(axis=0)))
    grp0 = None if pb.group_of_expert is None else int(pb.group_of_expert[e0])
    hint = _canonical(pb, incumbent, tab, inc_counts, e0, grp0)
    hint_x = np.zeros((E, G), dtype=bool)
    hint_x[hint.T, np.arange(G)[None, :]] = True
    hint_loads = tab[:, np.arange(E), inc_counts][:, hint].sum(axis=2)  # [W, G]
    var_e = [e for e in range(E) if lo[e] != hi[e]]
    return _CpData(tab, K, exact, lo, hi, complete, var_e, inc_counts, e0, grp0, hint, hint_x, hint_loads)


def _solve_cpsat(
    pb: _Layer,
    start: _Start,
    objective: str,
    P: int,
    seed: int,
    limit_s: float,
    deterministic: bool,
    wall_left: float = float("inf"),
) -> _Result:
    """Solve one layer's joint model from ``start`` (the incumbent, its value, the layer's loads and
    lower bounds); never past ``wall_left`` seconds (what is left of the whole solve's time limit).
    Returns the backend's :class:`_Result` (bound in true units)."""
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    incumbent, inc_value, windows, lb_true = start.assign, start.value, start.windows, start.lb_true
    # data
    d = _cpsat_data(pb, incumbent, inc_value, objective, windows, P)
    # model: variables and constraints family by family, objective, symmetry breaking, hints
    m = cp_model.CpModel()
    v = _CpVars()
    _add_replicas(m, pb, d, v, P)
    _add_node_groups(m, pb, d, v)
    _add_loads(m, pb, d, v)
    _add_objective(m, pb, d, v, lb_true)
    _add_symmetry_breaking(m, pb, d, v)
    _add_hints(m, pb, d, v)
    # solve
    build = time.perf_counter() - t0
    wall_left = max(0.01, wall_left - build)
    if deterministic:
        cap = min(max(0.5, _SAFETY_CAP * limit_s), wall_left)
        solver = _cp_solver(seed, max(0.05, _DET_FACTOR * limit_s), cap)
    else:
        solver = _cp_solver(seed, None, min(max(0.05, limit_s - build), wall_left))
    st = _run_solve(solver, m)
    wall = time.perf_counter() - t0
    note = ""
    if deterministic and solver.wall_time >= 0.98 * solver.parameters.max_time_in_seconds:
        note = "wall-clock safety cap reached: this layer may not reproduce exactly"
    # check the status before reading values
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return _Result(
            None, "greedy_fallback" if st == cp_model.UNKNOWN else "infeasible", None, d.complete, wall, note
        )
    return _read_solution(solver, pb, d, v, st == cp_model.OPTIMAL, wall, note)


def _cp_solver(seed: int, deterministic_time: float | None, wall_s: float) -> Any:
    """A one-worker CP-SAT solver with ``seed``, a deterministic-time limit (or None) and a wall limit."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.random_seed = int(seed)
    prm.num_workers = 1
    prm.catch_sigint_signal = False  # Ctrl-C is Python's (see the module docstring)
    if deterministic_time is not None:
        prm.max_deterministic_time = deterministic_time
    prm.max_time_in_seconds = wall_s
    return solver


def _add_replicas(m: Any, pb: _Layer, d: _CpData, v: _CpVars, P: int) -> None:
    """Variables ``x [E][G]``, ``n [E]``; each expert's count and each GPU's ``S`` slots."""
    E, G = pb.E, pb.G
    v.x = [[m.new_bool_var(f"x{e}_{g}") for g in range(G)] for e in range(E)]
    for e in range(E):
        if d.lo[e] == d.hi[e]:
            v.n.append(int(d.lo[e]))
        else:
            v.n.append(m.new_int_var(int(d.lo[e]), int(d.hi[e]), f"n{e}"))
    # each expert: its count of replicas, at most one per GPU
    for e in range(E):
        m.add(sum(v.x[e]) == v.n[e])
    m.add(sum(v.n) == P)
    # each GPU: exactly S slots
    for g in range(G):
        m.add(sum(v.x[e][g] for e in range(E)) == pb.S)


def _add_node_groups(m: Any, pb: _Layer, d: _CpData, v: _CpVars) -> None:
    """Node constraint: groups to nodes (``a [groups][N]``), replicas inside their group's node."""
    if pb.node_of_gpu is None:
        return
    N = int(pb.node_of_gpu.max()) + 1
    ngroups = int(pb.group_of_expert.max()) + 1
    v.num_nodes, v.num_groups = N, ngroups
    v.a = a = [[m.new_bool_var(f"a{q}_{k}") for k in range(N)] for q in range(ngroups)]
    # each group on exactly one node
    for q in range(ngroups):
        m.add_exactly_one(a[q])
    # each node holds groups_per_node groups
    for k in range(N):
        m.add(sum(a[q][k] for q in range(ngroups)) == pb.groups_per_node)
    # a replica only on its group's node
    for e in range(pb.E):
        q = int(pb.group_of_expert[e])
        for g in range(pb.G):
            m.add_implication(v.x[e][g], a[q][int(pb.node_of_gpu[g])])
    m.add(a[d.grp0][0] == 1)  # symmetry: the hottest expert's group on node 0


def _add_loads(m: Any, pb: _Layer, d: _CpData, v: _CpVars) -> None:
    """GPU loads ``[W][G]`` and window peaks ``[W]``.

    Fixed-count experts contribute constants, variable ones through share variables: ``t[w, e]`` =
    ``tab[w, e, n_e]`` (an element constraint on ``n_e``) and ``s[w, e, g] >= t[w, e]`` where ``x[e][g]``.
    """
    E, G, W = pb.E, pb.G, pb.W
    tab, lo, hi = d.tab, d.lo, d.hi
    for w in range(W):
        for e in d.var_e:
            vals = [int(tab[w, e, max(r, lo[e])]) for r in range(int(hi[e]) + 1)]
            t = m.new_int_var(min(vals[lo[e] :]), max(vals[lo[e] :]), f"t{w}_{e}")
            m.add_element(v.n[e], vals, t)
            v.t[w, e] = t
            for g in range(G):
                s = m.new_int_var(0, max(vals[lo[e] :]), f"s{w}_{e}_{g}")
                m.add(s >= t).only_enforce_if(v.x[e][g])
                v.s[w, e, g] = s
    ub = int(tab[:, :, 1].sum(axis=1).max())  # no GPU can carry more than every expert unsplit
    v.loads = [[None] * G for _ in range(W)]
    for w in range(W):
        for g in range(G):
            expr = sum(int(tab[w, e, lo[e]]) * v.x[e][g] for e in range(E) if lo[e] == hi[e])
            expr = expr + sum(v.s[w, e, g] for e in d.var_e)
            lv = m.new_int_var(0, ub, f"l{w}_{g}")
            m.add(lv == expr)
            v.loads[w][g] = lv
        pw = m.new_int_var(0, ub, f"p{w}")
        m.add_max_equality(pw, v.loads[w])
        v.peak.append(pw)


def _add_objective(m: Any, pb: _Layer, d: _CpData, v: _CpVars, lb_true: np.ndarray | None) -> None:
    """Peak lower bounds, then minimise the max window peak or the CVaR of the worst ``robust_m``."""
    W, peak = pb.W, v.peak
    ub = int(d.tab[:, :, 1].sum(axis=1).max())
    # valid lower bound in model units (normalised token windows or plain tokens)
    if lb_true is not None:
        for w in range(W):
            m.add(peak[w] >= int(math.ceil(lb_true[w] * d.K - 1e-6)))
    if pb.robust_m == 1:
        v.obj = m.new_int_var(0, ub, "obj")
        m.add_max_equality(v.obj, peak)
        v.hint_obj = int(d.hint_loads.max(axis=1).max())
    else:
        # CVaR: m * tau + sum_w max(0, peak_w - tau)
        tau = m.new_int_var(0, ub, "tau")
        u = [m.new_int_var(0, ub, f"u{w}") for w in range(W)]
        for w in range(W):
            m.add(u[w] >= peak[w] - tau)
        v.obj = m.new_int_var(0, (ub) * W, "obj")
        m.add(v.obj == pb.robust_m * tau + sum(u))
        pk = np.sort(d.hint_loads.max(axis=1))[::-1]
        v.hint_obj = int(pk[: pb.robust_m].sum())
        m.add_hint(tau, int(pk[pb.robust_m - 1]))
        for w in range(W):
            m.add_hint(u[w], int(max(0, d.hint_loads[w].max() - pk[pb.robust_m - 1])))
    # no worse than the incumbent
    m.add(v.obj <= v.hint_obj)
    m.minimize(v.obj)


def _add_symmetry_breaking(m: Any, pb: _Layer, d: _CpData, v: _CpVars) -> None:
    """Interchangeable GPUs: the hottest expert on a prefix, window-0 loads descending (inside nodes)."""
    x, loads, e0 = v.x, v.loads, d.e0
    if pb.node_of_gpu is None:
        for g in range(pb.G - 1):
            m.add_implication(x[e0][g + 1], x[e0][g])
            m.add(loads[0][g] >= loads[0][g + 1]).only_enforce_if([x[e0][g], x[e0][g + 1]])
            m.add(loads[0][g] >= loads[0][g + 1]).only_enforce_if([~x[e0][g], ~x[e0][g + 1]])
    else:
        for g in range(pb.G - 1):
            if pb.node_of_gpu[g] == pb.node_of_gpu[g + 1]:
                m.add(loads[0][g] >= loads[0][g + 1])


def _add_hints(m: Any, pb: _Layer, d: _CpData, v: _CpVars) -> None:
    """Hint every variable with the canonicalised incumbent."""
    E, G, W = pb.E, pb.G, pb.W
    tab, inc_counts, hint_x = d.tab, d.inc_counts, d.hint_x
    for e in range(E):
        for g in range(G):
            m.add_hint(v.x[e][g], bool(hint_x[e, g]))
        if e in d.var_e:
            m.add_hint(v.n[e], int(inc_counts[e]))
    for (w, e), t in v.t.items():
        m.add_hint(t, int(tab[w, e, inc_counts[e]]))
    for (w, e, g), s in v.s.items():
        m.add_hint(s, int(tab[w, e, inc_counts[e]]) if hint_x[e, g] else 0)
    for w in range(W):
        for g in range(G):
            m.add_hint(v.loads[w][g], int(d.hint_loads[w, g]))
        m.add_hint(v.peak[w], int(d.hint_loads[w].max()))
    m.add_hint(v.obj, v.hint_obj)
    if pb.node_of_gpu is not None:
        N = v.num_nodes
        mm = G // N
        for q in range(v.num_groups):
            es = np.flatnonzero(pb.group_of_expert == q)
            gs = np.flatnonzero(hint_x[es].any(axis=0))
            k = int(gs[0] // mm) if len(gs) else 0
            for kk in range(N):
                m.add_hint(v.a[q][kk], kk == k)


def _read_solution(
    solver: Any, pb: _Layer, d: _CpData, v: _CpVars, optimal: bool, wall: float, note: str
) -> _Result:
    """The solved assignment ``[G, S]`` and the model bound in true units (ceil-rounded shares: at most
    ``S`` units per GPU above ``K`` x the true load)."""
    E, G = pb.E, pb.G
    xv = np.array([[solver.boolean_value(v.x[e][g]) for g in range(G)] for e in range(E)])
    assign = np.stack([np.flatnonzero(xv[:, g]) for g in range(G)])
    bound_model = solver.best_objective_bound
    if pb.robust_m > 1:
        bound_model = bound_model / pb.robust_m
    bt = bound_model / d.K if d.exact else (bound_model - pb.S + 1) / d.K
    status = "optimal" if optimal else "time_limit"
    return _Result(assign, status, bt, d.complete, wall, note)
