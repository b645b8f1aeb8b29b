"""The exact step of migration-aware re-placement: one layer as a CP-SAT model.

Shapes: E logical experts, G GPUs, S slots per GPU, P = G x S slots, C allowed replica counts.

Variables ``x[e, g]`` (a replica of ``e`` on ``g``), ``z[e, c]`` (``e`` has ``c`` replicas) and
``t[e, g, c] = x[e, g] AND z[e, c]``; the objective is ``peak + move_cost * moved`` in integer units
(loads scaled so the heaviest expert is 1e6), moved = pairs the previous placement lacks. The
incremental result is the hint. :func:`exact_layer` is called by :mod:`solver.migration` per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from solver.search import run_solve

__all__ = ["ExactLayer", "exact_layer"]

DET_UNITS_PER_S = 0.5  # deterministic-time units per second of share (as solver.exact's _DET_FACTOR)
WALL_SAFETY_CAP = 4.0  # deterministic mode: wall-clock cap, as a multiple of the share


@dataclass(frozen=True)
class ExactLayer:
    """One layer's CP-SAT problem, as :func:`exact_layer` takes it.

    Attributes:
        w: float64 ``[E]`` the layer's load; prev_x / hint_x: bool ``[E, G]`` previous and hint pairs.
        S: slots per GPU; move_cost: objective cost of one moved slot (load units).
        budget: most moved slots in this layer (None: no budget).
        time_limit: seconds of share; seed: CP-SAT's seed.
        max_bool_vars: past ``E x G x cmax`` of these, replica counts are restricted around the hint.
        deterministic: limit CP-SAT by deterministic time (``DET_UNITS_PER_S`` x ``time_limit``),
            with a wall-clock safety cap of ``WALL_SAFETY_CAP`` x ``time_limit``; else by wall time.
    """

    w: np.ndarray
    prev_x: np.ndarray
    hint_x: np.ndarray
    S: int
    move_cost: float
    budget: int | None
    time_limit: float
    seed: int
    max_bool_vars: int = 20000
    deterministic: bool = False


def exact_layer(layer: ExactLayer) -> tuple[np.ndarray | None, str, float | None, str]:
    """CP-SAT on one layer (:class:`ExactLayer`): allowed counts -> model -> hint -> solve -> read back.

    Returns:
        ``(x bool [E, G] or None, status, bound_on_objective or None, note)``.
    """
    w, prev_x, hint_x, S = layer.w, layer.prev_x, layer.hint_x, layer.S
    move_cost, budget, time_limit, deterministic = (
        layer.move_cost,
        layer.budget,
        layer.time_limit,
        layer.deterministic,
    )
    from ortools.sat.python import cp_model

    E, G = prev_x.shape
    hint_cnt = hint_x.sum(axis=1)  # [E]
    allowed, restricted = _allowed_counts(prev_x, hint_cnt, S, layer.max_bool_vars)
    scale = 1e6 / max(float(w.max()), 1e-12)
    model, x, z, t = _build_model(cp_model, w, prev_x, S, move_cost, budget, allowed, scale)
    _add_hint(model, x, z, t, hint_x, hint_cnt, allowed)
    solver = cp_model.CpSolver()
    limit = max(0.05, float(time_limit))
    solver.parameters.max_time_in_seconds = WALL_SAFETY_CAP * limit if deterministic else limit
    if deterministic:
        solver.parameters.max_deterministic_time = DET_UNITS_PER_S * limit
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = int(layer.seed)
    code = run_solve(solver, model)
    note = "replica counts restricted to +-2 around the hint" if restricted else ""
    if deterministic and solver.wall_time >= 0.98 * solver.parameters.max_time_in_seconds:
        cap = "CP-SAT hit its wall-clock safety cap (result may differ between runs)"
        note = f"{note}; {cap}" if note else cap
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


def _allowed_counts(
    prev_x: np.ndarray, hint_cnt: np.ndarray, S: int, max_bool_vars: int
) -> tuple[list[list[int]], bool]:
    """Replica counts each expert may take (``1..cmax``; within +-2 of the hint, plus the previous
    count, when ``E x G x cmax`` would exceed ``max_bool_vars``), and whether they were restricted."""
    E, G = prev_x.shape
    P = G * S
    cmax = max(1, min(G, 1 + P - E))
    prev_cnt = prev_x.sum(axis=1)  # [E]
    restricted = E * G * cmax > max_bool_vars
    allowed = []
    for e in range(E):
        if restricted:
            cs = set(range(max(1, hint_cnt[e] - 2), min(cmax, hint_cnt[e] + 2) + 1)) | {int(prev_cnt[e])}
        else:
            cs = set(range(1, cmax + 1))
        allowed.append(sorted(cs))
    return allowed, restricted


def _build_model(
    cp_model: Any,
    w: np.ndarray,
    prev_x: np.ndarray,
    S: int,
    move_cost: float,
    budget: int | None,
    allowed: list[list[int]],
    scale: float,
) -> tuple[Any, dict, dict, dict]:
    """The CP-SAT model and its variables ``(model, x, z, t)`` (one comment per constraint family)."""
    E, G = prev_x.shape
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
    return model, x, z, t


def _add_hint(
    model: Any,
    x: dict,
    z: dict,
    t: dict,
    hint_x: np.ndarray,
    hint_cnt: np.ndarray,
    allowed: list[list[int]],
) -> None:
    """Hint every variable with the incremental result ``hint_x [E, G]`` (counts ``hint_cnt [E]``)."""
    E, G = hint_x.shape
    for e in range(E):
        for g in range(G):
            model.add_hint(x[e, g], bool(hint_x[e, g]))
        for c in allowed[e]:
            model.add_hint(z[e, c], int(hint_cnt[e]) == c)
            for g in range(G):
                model.add_hint(t[e, g, c], bool(hint_x[e, g]) and int(hint_cnt[e]) == c)
