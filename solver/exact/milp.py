"""The joint model of one layer as a MILP (``scipy.optimize.milp``, HiGHS), in floats.

The nonlinear share ``w_e / n_e`` is a one-hot ``y[e, r]`` over the allowed counts with products
``s[w, e, g] >= c[w, e, r] * (x[e, g] + y[e, r] - 1)`` (exact: the objective only pushes ``s`` down).

Variables (in this order): ``x[e, g]`` (binary), ``y[e, r]`` (binary, variable-count experts),
``s[w, e, g]``, ``peak[w]``, then ``T`` (max) or ``tau``, ``u[w]`` (CVaR), then ``a[q, k]`` (binary,
group ``q`` on node ``k``, node constrained). Shapes: ``c`` float ``[W, E, R+1]``, ``lo``/``hi`` ``[E]``.
"""

from __future__ import annotations

import time

import numpy as np

from solver.exact.layer_problem import _count_ranges, _Layer, _Result, _Start

_Key = tuple  # ("x", e, g), ("y", e, r), ("s", w, e, g), ("peak", w), ("T",), ("tau",), ("u", w), ("a", q, k)


class _Rows:
    """Sparse constraint rows ``lb <= sum(v * var[key]) <= ub``, added one at a time."""

    def __init__(self, idx: dict[_Key, int]) -> None:
        self.idx = idx
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lbs: list[float] = []
        self.ubs: list[float] = []
        self.count = 0

    def add(self, terms: list[tuple[_Key, float]], lb: float, ub: float) -> None:
        for k, v in terms:
            self.rows.append(self.count)
            self.cols.append(self.idx[k])
            self.vals.append(v)
        self.lbs.append(lb)
        self.ubs.append(ub)
        self.count += 1


def _solve_milp(pb: _Layer, start: _Start, objective: str, P: int, seed: int, limit_s: float) -> _Result:
    """Solve one layer's joint model with HiGHS (same arguments as :func:`solver.exact.cpsat._solve_cpsat`)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    t0 = time.perf_counter()
    incumbent, inc_value, windows, lb_true = start.assign, start.value, start.windows, start.lb_true
    # data
    lo, hi, complete = _count_ranges(pb, incumbent, inc_value, objective, windows, P)
    var_e = [e for e in range(pb.E) if lo[e] != hi[e]]
    # variables
    idx = _milp_variables(pb, lo, hi, var_e)
    nv = len(idx)
    # constraints, family by family
    rows = _Rows(idx)
    _milp_replicas(rows, pb, lo, hi, var_e)
    _milp_loads(rows, pb, lo, hi, var_e)
    _milp_node_groups(rows, pb)
    _milp_symmetry(rows, pb, lo, hi, var_e)
    # objective
    cobj = _milp_objective(rows, pb, idx, nv)
    A = coo_matrix((rows.vals, (rows.rows, rows.cols)), shape=(rows.count, nv)).tocsr()
    lb, ub, integrality = _milp_bounds(idx, nv, lb_true)
    # solve
    res = milp(
        cobj,
        integrality=integrality,
        bounds=Bounds(lb, ub),
        constraints=LinearConstraint(A, rows.lbs, rows.ubs),
        options={
            "time_limit": max(0.1, limit_s - (time.perf_counter() - t0)),
            "mip_rel_gap": 1e-9,
            "disp": False,
        },
    )
    wall = time.perf_counter() - t0
    # check the status before reading values
    if res.x is None:
        return _Result(None, "greedy_fallback", None, complete, wall)
    return _read_milp(res, pb, idx, complete, wall)


def _milp_variables(pb: _Layer, lo: np.ndarray, hi: np.ndarray, var_e: list[int]) -> dict[_Key, int]:
    """Column of every variable (module docstring order)."""
    E, G, W = pb.E, pb.G, pb.W
    idx: dict[_Key, int] = {}

    def var(key: _Key) -> None:
        idx[key] = len(idx)

    for e in range(E):
        for g in range(G):
            var(("x", e, g))
    for e in var_e:
        for r in range(lo[e], hi[e] + 1):
            var(("y", e, r))
    for w in range(W):
        for e in var_e:
            for g in range(G):
                var(("s", w, e, g))
    for w in range(W):
        var(("peak", w))
    if pb.robust_m > 1:
        var(("tau",))
        for w in range(W):
            var(("u", w))
    else:
        var(("T",))
    if pb.node_of_gpu is not None:
        N = int(pb.node_of_gpu.max()) + 1
        ngroups = int(pb.group_of_expert.max()) + 1
        for q in range(ngroups):
            for k in range(N):
                var(("a", q, k))
    return idx


def _milp_replicas(rows: _Rows, pb: _Layer, lo: np.ndarray, hi: np.ndarray, var_e: list[int]) -> None:
    """Each expert's count (one-hot ``y`` when it varies) and each GPU's ``S`` slots."""
    for e in range(pb.E):
        cnt = [(("x", e, g), 1.0) for g in range(pb.G)]
        if e in var_e:
            rows.add([(("y", e, r), 1.0) for r in range(lo[e], hi[e] + 1)], 1, 1)
            rows.add(cnt + [(("y", e, r), -float(r)) for r in range(lo[e], hi[e] + 1)], 0, 0)
        else:
            rows.add(cnt, lo[e], lo[e])
    for g in range(pb.G):
        rows.add([(("x", e, g), 1.0) for e in range(pb.E)], pb.S, pb.S)


def _milp_loads(rows: _Rows, pb: _Layer, lo: np.ndarray, hi: np.ndarray, var_e: list[int]) -> None:
    """Per window: the share products ``s`` and every GPU's load under the window's peak."""
    E, G, c = pb.E, pb.G, pb.cost
    for w in range(pb.W):
        for e in var_e:
            for g in range(G):
                for r in range(lo[e], hi[e] + 1):
                    cc = float(c[w, e, r])
                    rows.add([(("s", w, e, g), 1.0), (("x", e, g), -cc), (("y", e, r), -cc)], -cc, np.inf)
        for g in range(G):
            terms = [(("x", e, g), float(c[w, e, lo[e]])) for e in range(E) if lo[e] == hi[e]]
            terms += [(("s", w, e, g), 1.0) for e in var_e]
            rows.add(terms + [(("peak", w), -1.0)], -np.inf, 0)


def _milp_node_groups(rows: _Rows, pb: _Layer) -> None:
    """Node constraint: each group on one node, ``groups_per_node`` per node, replicas on their group's node."""
    if pb.node_of_gpu is None:
        return
    N = int(pb.node_of_gpu.max()) + 1
    ngroups = int(pb.group_of_expert.max()) + 1
    for q in range(ngroups):
        rows.add([(("a", q, k), 1.0) for k in range(N)], 1, 1)
    for k in range(N):
        rows.add([(("a", q, k), 1.0) for q in range(ngroups)], pb.groups_per_node, pb.groups_per_node)
    for e in range(pb.E):
        q = int(pb.group_of_expert[e])
        for g in range(pb.G):
            rows.add([(("x", e, g), 1.0), (("a", q, int(pb.node_of_gpu[g])), -1.0)], -np.inf, 0)


def _milp_symmetry(rows: _Rows, pb: _Layer, lo: np.ndarray, hi: np.ndarray, var_e: list[int]) -> None:
    """Symmetry breaking (interchangeable GPUs): the hottest expert on a prefix of GPUs, and window-0
    loads descending inside the holders and inside the others (big-M relaxed at the boundary)."""
    if pb.node_of_gpu is not None:
        return
    E, c = pb.E, pb.cost
    e0 = int(np.argmax(c[:, :, 1].max(axis=0)))
    big = float(np.where(np.isfinite(c[0, :, 1]), c[0, :, 1], 0).sum())

    def load_terms(g: int, sign: float) -> list[tuple[_Key, float]]:
        t = [(("x", e, g), sign * float(c[0, e, lo[e]])) for e in range(E) if lo[e] == hi[e]]
        return t + [(("s", 0, e, g), sign) for e in var_e]

    for g in range(pb.G - 1):
        rows.add([(("x", e0, g + 1), 1.0), (("x", e0, g), -1.0)], -np.inf, 0)
        terms = load_terms(g, 1.0) + load_terms(g + 1, -1.0)
        rows.add(terms + [(("x", e0, g), big), (("x", e0, g + 1), -big)], 0, np.inf)


def _milp_objective(rows: _Rows, pb: _Layer, idx: dict[_Key, int], nv: int) -> np.ndarray:
    """Objective vector ``[nv]``: ``T >= peak[w]``, or the CVaR ``m * tau + sum_w u[w]``, ``u[w] >= peak[w] - tau``."""
    cobj = np.zeros(nv)
    if pb.robust_m == 1:
        cobj[idx[("T",)]] = 1.0
        for w in range(pb.W):
            rows.add([(("peak", w), 1.0), (("T",), -1.0)], -np.inf, 0)
    else:
        cobj[idx[("tau",)]] = pb.robust_m
        for w in range(pb.W):
            cobj[idx[("u", w)]] = 1.0
            rows.add([(("u", w), 1.0), (("peak", w), -1.0), (("tau",), 1.0)], 0, np.inf)
    return cobj


def _milp_bounds(
    idx: dict[_Key, int], nv: int, lb_true: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Variable bounds ``lb, ub [nv]`` (binaries in [0, 1], window peaks >= ``lb_true``) and integrality."""
    integrality = np.zeros(nv)
    lb = np.zeros(nv)
    ub = np.full(nv, np.inf)
    for k, i in idx.items():
        if k[0] in ("x", "y", "a"):
            integrality[i] = 1
            ub[i] = 1
        if k[0] == "peak" and lb_true is not None:
            lb[i] = lb_true[k[1]]
    return lb, ub, integrality


def _read_milp(res: object, pb: _Layer, idx: dict[_Key, int], complete: bool, wall: float) -> _Result:
    """The solved assignment ``[G, S]`` and HiGHS's dual bound (slightly relaxed for float noise)."""
    E, G, S = pb.E, pb.G, pb.S
    xv = np.array([[res.x[idx[("x", e, g)]] > 0.5 for g in range(G)] for e in range(E)])
    per_gpu = xv.sum(axis=0)
    if not np.all(per_gpu == S):
        return _Result(None, "error", None, complete, wall, "MILP solution violates slot counts")
    assign = np.stack([np.flatnonzero(xv[:, g]) for g in range(G)])
    bound = getattr(res, "mip_dual_bound", None)
    if bound is not None and pb.robust_m > 1:
        bound = bound / pb.robust_m
    status = "optimal" if res.status == 0 else "time_limit"
    return _Result(assign, status, None if bound is None else float(bound) * (1 - 1e-7), complete, wall)
