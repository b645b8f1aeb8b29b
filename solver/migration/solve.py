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

``max_moves`` is a TOTAL over all layers and a hard cap on moved slots counted against the map in
service, whatever it holds. An engine map with two replicas of an expert on one GPU is repaired first
(:func:`repair_colocated`: each extra copy overwritten by an expert its GPU lacks, one moved slot each,
the fewest possible); the repair counts toward ``max_moves`` (a smaller budget raises ValueError
naming both numbers). Under a dispatch model with fixed per-rank shares (``problem.dispatch``), each
layer then takes the best of staying put, the searched layer and the full re-solve as that model
scores them (:mod:`solver.migration.dispatch`); under ``even`` nothing changes. The report gives per
layer ``moved_slots``, ``arrived_experts`` (experts new on a GPU: what crosses a link) and
``repair_moved_slots``. No method returns a placement worse than keeping the (repaired) previous one
on the objective.

Layout: slot bookkeeping (:func:`keep_slots`, :func:`moved_pairs`, :func:`align_to_previous`, the
repair) lives in :mod:`solver.migration.slots` and is re-exported by the package; the local search is
:mod:`solver.migration.search`, the per-layer CP-SAT model :mod:`solver.migration.cpsat`, the
dispatch-model scoring :mod:`solver.migration.dispatch`. :func:`solve_migration` (arrays and a
:class:`MigrationOptions`) and :func:`run_migration` (the registry's ``(Problem, MigrationOptions)``) both run
one pipeline, :func:`_migrate`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from moe_placement.base.options import refuse_unknown_keywords
from placement.dispatch import get_dispatch
from placement.metrics import expected_gpu_load, peak_lower_bound
from placement.model import Placement
from solver.budget import check_time_limit
from solver.greedy import greedy_placement
from solver.migration.cpsat import ExactLayer
from solver.migration.cpsat import exact_layer as _exact_layer
from solver.migration.dispatch import Scorer, choose_layers, dispatch_scorer
from solver.migration.search import Layer, incremental
from solver.migration.slots import align_to_previous, keep_slots, moved_pairs, repair_colocated
from solver.migration.slots import fill_slots as _fill_slots
from solver.migration.slots import membership as _membership
from solver.report import LayerReport, SolveReport

if TYPE_CHECKING:
    from solver.problem import Problem

__all__ = [
    "MigrationOptions",
    "align_to_previous",
    "keep_slots",
    "moved_pairs",
    "run_migration",
    "solve_migration",
]

log = logging.getLogger(__name__)

METHODS = ("auto", "exact", "incremental")


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------
@refuse_unknown_keywords
@dataclass(frozen=True)
class MigrationOptions:
    """How the migration-aware re-placement searches (the ``options`` of :func:`solve_migration`).

    Attributes:
        max_moves: total moved slots allowed over all layers (None: no budget).
        move_cost: objective cost of one moved slot, in load units (None means 0).
        time_limit: seconds for the whole solve (exact: split over layers).
        seed: CP-SAT seed (the incremental search is deterministic).
        method: ``incremental`` (also ``auto``) or ``exact`` (CP-SAT seeded with the incremental result).
        drift_guard: multiple of the full re-solve's gap past which a layer takes the full re-solve.
        max_steps: work limit of the incremental search, in steps (None: none, the search then stops on
            convergence, the move budget or wall time only). A step is one element of the candidate
            arrays a move proposal scores (about ``A x E x G + pairs x E + S x B`` per proposal), so
            the search stops at the same point for the same input on any machine; ``time_limit``
            stays a wall-clock safety cap (a note says when it cut the search). With ``exact``, CP-SAT
            then runs on deterministic time (see :func:`solver.migration.cpsat.exact_layer`).
    """

    max_moves: int | None = None
    move_cost: float | None = None
    time_limit: float = 5.0
    seed: int = 0
    method: Literal["auto", "exact", "incremental"] = "auto"
    drift_guard: float = 1.5
    max_steps: int | None = None


# The time limit is a hard wall: the incremental search stops at INCREMENTAL_SHARE of it (its first
# proposals too), the drift guard's full re-solve runs in chunks of WALL_CHUNK layers until
# FULL_SHARE, the final slot filling checks the clock every WALL_CHUNK layers until FINAL_SHARE and
# the layers left keep the previous placement. Measured on the 2-core dev machine (8 experts, 12 slots
# on 4 GPUs, scipy already imported): 10,000 layers at limit 5 s took 27.7 s before, 5.8 s with the
# wall at the limit; the report's assembly of 10,000 layers takes about 0.8 s, hence FINAL_SHARE.
WALL_CHUNK = 64
INCREMENTAL_SHARE = 0.75  # of the time limit, without exact (with it: 0.6, the full re-solve to 0.7)
FULL_SHARE = 0.8
FINAL_SHARE = 0.9  # slots filled until then; the layers left keep the previous placement


def run_migration(problem: Problem, options: MigrationOptions) -> tuple[Placement, SolveReport]:
    """The registry's entry (:mod:`solver.api`): re-place ``problem.load`` from ``problem.previous``,
    candidate layers scored under ``problem.dispatch`` (:mod:`solver.migration.dispatch`)."""
    return _migrate(problem.load, problem.previous, options, problem.layer_id_list, problem)


def solve_migration(
    load: np.ndarray,
    previous: Placement,
    options: MigrationOptions | None = None,
    *,
    layer_ids: Sequence[int] | None = None,
) -> tuple[Placement, SolveReport]:
    """Re-place for a new load starting from ``previous``, trading balance against moved slots.

    Args:
        load: ``[L, E]`` tokens per logical expert (the window the new placement should serve).
        previous: the placement in service (``L`` layers, ``E`` experts).
        options: the move budget, the move cost, the time and step limits, the method and the drift
            guard (:class:`MigrationOptions`, every field documented there; default
            ``MigrationOptions()``). With ``max_steps`` the result is the same for the same input
            whatever the machine's speed (unless the wall-clock ``time_limit`` cuts in first, which the
            report's notes say).
        layer_ids: real layer index per row (default: ``previous.layer_ids``).

    Returns:
        ``(placement, report)``; ``report.layers[l].objective`` is ``peak + move_cost * moved``, the
        baseline objective is the previous placement's peak, ``bound`` the closed-form peak lower
        bound (or CP-SAT's bound), and ``extra`` holds ``moved_slots``, ``peak``, ``previous_peak``,
        ``full_resolve_peak``, ``full_resolve_moved_slots``, ``drift_fallback`` and move counts.
    """
    return _migrate(load, previous, options if options is not None else MigrationOptions(), layer_ids)


def _migrate(
    load: np.ndarray,
    previous: Placement,
    options: MigrationOptions,
    layer_ids: Sequence[int] | None,
    problem: Problem | None = None,
) -> tuple[Placement, SolveReport]:
    """The pipeline: validate -> repair the map in service (counted) -> incremental search -> drift
    guard -> exact refinement (``exact``) -> candidate layers under the dispatch model -> never worse
    than staying put, slots kept -> report. ``max_moves`` caps moved slots against the map in service."""
    t0 = time.perf_counter()
    w, mc, ids = _validated(load, previous, options, layer_ids)
    L, E = w.shape
    in_service = previous
    previous, repaired, repair_note = _valid_start(previous, w, options.max_moves)
    budget = float("inf") if options.max_moves is None else float(options.max_moves - repaired.sum())

    # 1) Incremental search over all layers (budget to the best gain per slot first).
    states, notes = _incremental_pass(w, previous, mc, budget, options, t0)
    notes[:0] = repair_note
    # 2) Drift guard: compare with a full re-solve relabelled to the previous placement.
    full_end = 0.7 if options.method == "exact" else FULL_SHARE
    full = _full_resolve(w, previous, ids, states, t0 + full_end * options.time_limit, notes)
    fallback = _drift_fallback(states, full, mc, budget, options.drift_guard)
    x_final = [full.x[l] if fallback[l] else st.x for l, st in enumerate(states)]
    if fallback.any():
        notes.append(f"drift guard: {int(fallback.sum())} layer(s) took the full re-solve")
    out = _Outcome(x_final, ["heuristic"] * L, full.lb.astype(float).copy(), fallback, notes)
    # 3) Exact refinement per layer (budget per layer = what the incremental pass spent there).
    if options.method == "exact":
        _exact_refinement(w, states, out, ids, mc, options, t0)
    # 4) Under a dispatch model with fixed per-rank shares, each layer takes its best candidate there.
    scorer, dispatch_note = dispatch_scorer(problem, E, ids)
    notes.extend([dispatch_note] if dispatch_note else [])
    dpeak = None if scorer is None else _dispatch_layers(previous, states, x_final, full, mc, budget, scorer)
    # 5) Never worse than staying put; keep slots of unchanged experts; churn against the map in service.
    guard = scorer is None  # under a dispatch model step 4 already compared each layer with staying put
    final_end = t0 + FINAL_SHARE * options.time_limit  # the rest: the report's assembly
    rows, layers = _final_layers(w, previous, states, out, full, mc, ids, guard, final_end)
    _churn_extras(layers, in_service, rows, repaired, dpeak)
    total = sum(lr.extra["moved_slots"] for lr in layers)
    assert options.max_moves is None or total <= options.max_moves, (total, options.max_moves)

    params = _params(options, mc)
    if scorer is not None:
        params["dispatch"] = get_dispatch(problem.dispatch).name
    placement = Placement(np.stack(rows), E, previous.topology, ids, {"solver": "migration", **params})
    wall = time.perf_counter() - t0
    log.debug(
        "migration: %d moved slots over %d layers in %.3fs",
        sum(lr.extra["moved_slots"] for lr in layers),
        L,
        wall,
    )
    return placement, SolveReport("migration", tuple(layers), wall, params, tuple(notes))


def _valid_start(
    previous: Placement, w: np.ndarray, max_moves: int | None
) -> tuple[Placement, np.ndarray, list[str]]:
    """``(valid start, repair moved slots int64 [L], notes)``.

    An engine map with two replicas of an expert on one GPU starts from its cheapest repair
    (:func:`repair_colocated`: one moved slot per extra copy, the fewest possible). The repair is part
    of the plan and counts toward ``max_moves``; a budget smaller than the repair raises ValueError.
    """
    L = previous.num_layers
    if not previous.allow_colocated_replicas:
        return previous, np.zeros(L, dtype=np.int64), []
    valid, moved = repair_colocated(previous, w)
    total = int(moved.sum())
    if not total:
        return valid, moved, []
    if max_moves is not None and total > max_moves:
        raise ValueError(
            f"the map in service holds an expert twice on a GPU in {int((moved > 0).sum())} layer(s): a valid "
            f"map needs at least {total} moved slot(s), more than max_moves={max_moves}; "
            f"raise max_moves to {total} or more"
        )
    return (
        valid,
        moved,
        [
            f"the map in service holds an expert twice on a GPU: {total} slot(s) moved to separate them "
            f"(one per extra copy, counted in max_moves)"
        ],
    )


def _dispatch_layers(
    previous: Placement,
    states: list[Layer],
    x_final: list[np.ndarray],
    full: _FullResolve,
    mc: float,
    budget: float,
    scorer: Scorer,
) -> np.ndarray:
    """Per layer the best of (stay, ``x_final``, full re-solve) under ``scorer``, within ``budget``
    (:func:`solver.migration.dispatch.choose_layers`); ``x_final`` is updated in place. Returns the
    chosen map's per-layer peaks under the dispatch model, float64 ``[L]``."""
    S = previous.topology.slots_per_gpu
    prev_map = previous.physical_to_logical_map  # [L, P]
    L = prev_map.shape[0]
    cands = [[st.prev for st in states], list(x_final), full.x]  # C=3 x L x bool [E, G]
    maps = [np.stack([_fill_slots(xs[l], prev_map[l], S) for l in range(L)]) for xs in cands]  # C x [L, P]
    peaks = np.stack([scorer(m) for m in maps])  # [C, L]
    moved = np.array([[moved_pairs_x(states[l].prev, xs[l]) for l in range(L)] for xs in cands])  # [C, L]
    choice = choose_layers(peaks, moved, budget, mc)  # [L]
    for l in range(L):
        x_final[l] = cands[choice[l]][l]
    # The mix scored once more: a table drawn layer after layer (SGLang's) couples a layer to those before.
    return scorer(np.stack([maps[choice[l]][l] for l in range(L)]))


def _churn_extras(
    layers: list[LayerReport],
    in_service: Placement,
    rows: list[np.ndarray],
    repaired: np.ndarray,
    dispatch_peak: np.ndarray | None,
) -> None:
    """Per layer, against the map in service (``in_service``, possibly with co-located replicas) and
    the final ``rows`` (L x ``[P]``): ``moved_slots``, ``arrived_experts`` (experts new on a GPU) and
    ``repair_moved_slots``; ``dispatch_peak`` where candidates were scored under a dispatch model."""
    t = in_service.topology
    E, G, S = in_service.num_logical_experts, t.ep_size, t.slots_per_gpu
    for l, lr in enumerate(layers):
        old = in_service.physical_to_logical_map[l]  # [P]
        lr.extra["moved_slots"] = int((old != rows[l]).sum())
        arrived = _membership(rows[l], E, G, S) & ~_membership(old, E, G, S)  # [E, G]
        lr.extra["arrived_experts"] = int(arrived.sum())
        lr.extra["repair_moved_slots"] = int(repaired[l])
        if dispatch_peak is not None:
            lr.extra["dispatch_peak"] = float(dispatch_peak[l])


def _validated(
    load: np.ndarray, previous: Placement, options: MigrationOptions, layer_ids: Sequence[int] | None
) -> tuple[np.ndarray, float, tuple[int, ...]]:
    """``(w float64 [L, E], move cost, layer ids)``, or a ValueError naming the bad input and a fix."""
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
    if options.method not in METHODS:
        raise ValueError(f"unknown method {options.method!r}; use one of {METHODS}")
    max_moves, move_cost = options.max_moves, options.move_cost
    if max_moves is not None and (
        isinstance(max_moves, bool) or int(max_moves) != max_moves or max_moves < 0
    ):
        raise ValueError(f"max_moves must be a non-negative integer (total over layers), got {max_moves!r}")
    mc = 0.0 if move_cost is None else float(move_cost)
    if not np.isfinite(mc) or mc < 0:
        raise ValueError(f"move_cost must be finite and >= 0 (load units per moved slot), got {move_cost!r}")
    if not options.drift_guard >= 1.0:
        raise ValueError(
            f"drift_guard must be >= 1 (a multiple of the full re-solve's gap), got {options.drift_guard!r}"
        )
    steps = options.max_steps
    if steps is not None and (isinstance(steps, bool) or int(steps) != steps or steps < 0):
        raise ValueError(f"max_steps must be a non-negative integer (search work limit), got {steps!r}")
    check_time_limit(options.time_limit)
    ids = tuple(layer_ids) if layer_ids is not None else previous.layer_ids
    if len(ids) != L:
        raise ValueError(f"layer_ids has {len(ids)} entries for {L} layers")
    return w, mc, ids


def _incremental_pass(
    w: np.ndarray, previous: Placement, mc: float, budget: float, options: MigrationOptions, t0: float
) -> tuple[list[Layer], list[str]]:
    """One :class:`Layer` per row of ``w [L, E]``, searched in place until no move pays, the budget is
    spent, ``options.max_steps`` is used up or the search's share of the time limit (0.6 before an
    exact pass, else 0.9) runs out."""
    topo = previous.topology
    L, E = w.shape
    G, S, P = topo.ep_size, topo.slots_per_gpu, topo.num_physical_experts
    prev_map = previous.physical_to_logical_map  # [L, P]
    states = [Layer(w[l], prev_map[l], E, G, S) for l in range(L)]
    inc_share = 0.6 if options.method == "exact" else INCREMENTAL_SHARE
    deadline = t0 + inc_share * options.time_limit
    steps = float("inf") if options.max_steps is None else float(options.max_steps)
    iters, stop = incremental(states, mc, budget, deadline, 8 * P * L, steps)
    notes: list[str] = []
    if stop == "time":
        notes.append(f"incremental search stopped at the time limit after {iters} moves")
    elif stop == "steps":
        notes.append(f"incremental search stopped at max_steps={options.max_steps} after {iters} moves")
    return states, notes


@dataclass(frozen=True)
class _Outcome:
    """What the pipeline decides per layer, filled step by step (the lists and arrays change in place).

    Attributes:
        x_final: L x bool ``[E, G]`` the chosen membership; statuses: L statuses (``heuristic`` until
            CP-SAT says otherwise); bounds: float64 ``[L]`` peak lower bounds; fallback: bool ``[L]``
            layers that took the full re-solve (drift guard); notes: the report's notes.
    """

    x_final: list[np.ndarray]
    statuses: list[str]
    bounds: np.ndarray
    fallback: np.ndarray
    notes: list[str]


@dataclass(frozen=True)
class _FullResolve:
    """A greedy solve from scratch relabelled to the previous placement, per layer.

    Attributes:
        x: L x bool ``[E, G]`` membership; peak: float64 ``[L]``; moved: int64 ``[L]`` moved slots
        from the previous placement; lb: ``[L]`` closed-form peak lower bound.
    """

    x: list[np.ndarray]
    peak: np.ndarray
    moved: np.ndarray
    lb: np.ndarray


def _full_resolve(
    w: np.ndarray,
    previous: Placement,
    ids: tuple[int, ...],
    states: list[Layer],
    deadline: float,
    notes: list[str],
) -> _FullResolve:
    """Greedy on ``w [L, E]``, then :func:`align_to_previous` so it moves as few slots as it can, in
    chunks of :data:`WALL_CHUNK` layers while the wall clock is before ``deadline``; a layer not
    reached stands in with its incremental result ``states[l]`` (its drift guard then never fires;
    a note says how many)."""
    topo = previous.topology
    L, E = w.shape
    G, S, P = topo.ep_size, topo.slots_per_gpu, topo.num_physical_experts
    x = [st.x for st in states]  # L x bool [E, G]
    peak = np.array([st.peak for st in states], dtype=np.float64)  # [L]
    moved = np.array([st.moved for st in states], dtype=np.int64)  # [L]
    prev_map = previous.physical_to_logical_map
    for lo in range(0, L, WALL_CHUNK):
        if time.perf_counter() >= deadline:
            notes.append(f"time limit: the drift guard's full re-solve skipped {L - lo} of {L} layers")
            break
        part = slice(lo, min(L, lo + WALL_CHUNK))
        before = Placement(prev_map[part], E, topo, ids[part])
        full = align_to_previous(greedy_placement(w[part], topo, layer_ids=ids[part])[0], before)
        peak[part] = expected_gpu_load(full, w[part]).max(axis=1)
        moved[part] = moved_pairs(before, full)
        for l, row in zip(range(part.start, part.stop), full.physical_to_logical_map):
            x[l] = _membership(row, E, G, S)
    return _FullResolve(x, peak, moved, peak_lower_bound(w, G, P))


def _drift_fallback(
    states: list[Layer], full: _FullResolve, mc: float, budget: float, drift_guard: float
) -> np.ndarray:
    """bool ``[L]``: layers that take the full re-solve (gap past ``drift_guard`` x the full re-solve's,
    better on the objective, largest objective gain first while the move budget allows)."""
    spent = sum(st.moved for st in states)
    fallback = np.zeros(len(states), dtype=bool)
    cand = []
    for l, st in enumerate(states):
        denom = max(full.lb[l], 1e-12)
        gap_inc, gap_full = st.peak / denom - 1.0, full.peak[l] / denom - 1.0
        obj_inc, obj_full = st.peak + mc * st.moved, full.peak[l] + mc * full.moved[l]
        if gap_inc > drift_guard * gap_full + 1e-9 and obj_full < obj_inc - st.tol:
            cand.append((obj_inc - obj_full, l))
    for _, l in sorted(cand, reverse=True):
        extra_moves = full.moved[l] - states[l].moved
        if spent + extra_moves <= budget:
            fallback[l] = True
            spent += extra_moves
    return fallback


def _exact_refinement(
    w: np.ndarray,
    states: list[Layer],
    out: _Outcome,
    ids: tuple[int, ...],
    mc: float,
    options: MigrationOptions,
    t0: float,
) -> None:
    """CP-SAT per layer in the time left, hinted with ``out.x_final``; sets ``out.statuses``.

    With ``options.max_steps`` set every layer gets the same share of the exact part (0.4 x
    ``time_limit``) as deterministic time instead of the wall time left, so the result does not
    depend on how fast the machine is.

    Updates in place: ``out.x_final[l]`` (bool ``[E, G]``) when CP-SAT's result is better on the
    objective, ``out.bounds [L]`` with CP-SAT's bound, ``out.statuses`` and ``out.notes``.
    """
    L = w.shape[0]
    x_final, statuses, bounds, notes = out.x_final, out.statuses, out.bounds, out.notes
    no_solution: list[int] = []
    remaining = max(0.05, options.time_limit - (time.perf_counter() - t0))
    deterministic = options.max_steps is not None
    for l in range(L):
        if time.perf_counter() >= t0 + options.time_limit:  # the time limit is a hard wall
            notes.append(f"time limit: CP-SAT skipped {L - l} of {L} layers (their incremental result kept)")
            break
        per_layer_budget = (
            None if options.max_moves is None else int(moved_pairs_x(states[l].prev, x_final[l]))
        )
        tl = 0.4 * options.time_limit / L if deterministic else remaining / (L - l)
        ts = time.perf_counter()
        layer = ExactLayer(
            w[l],
            states[l].prev,
            x_final[l],
            states[l].S,
            mc,
            per_layer_budget,
            tl,
            options.seed + l,
            deterministic=deterministic,
        )
        xe, status, bnd, note = _exact_layer(layer)
        remaining = max(0.05, remaining - (time.perf_counter() - ts))
        if note and note not in notes:
            notes.append(note)
        if xe is None:  # CP-SAT found nothing in its share of the time: the incremental result stays
            no_solution.append(ids[l])
            continue
        statuses[l] = status
        if bnd is not None:
            bounds[l] = max(bounds[l], bnd)
        if _objective_x(w[l], xe, states[l].prev, mc) < _objective_x(w[l], x_final[l], states[l].prev, mc):
            x_final[l] = xe
    if no_solution:
        notes.append(
            f"CP-SAT found no solution within its time share on layer(s) {no_solution}; "
            f"their incremental result was kept (status heuristic)"
        )


def _final_layers(
    w: np.ndarray,
    previous: Placement,
    states: list[Layer],
    out: _Outcome,
    full: _FullResolve,
    mc: float,
    ids: tuple[int, ...],
    guard: bool = True,
    deadline: float = float("inf"),
) -> tuple[list[np.ndarray], list[LayerReport]]:
    """``(rows: L x int64 [P] physical-to-logical maps, one LayerReport per layer)``.

    With ``guard``, a layer whose objective would exceed staying put keeps the previous placement
    (``out.x_final`` is updated in place); every expert that stays on a GPU keeps its slot. Past the
    wall-clock ``deadline`` (the time limit: a hard wall) the layers left keep the previous placement
    as it is (no slot filling; a note says how many).
    """
    x_final, statuses, bounds, fallback = out.x_final, out.statuses, out.bounds, out.fallback
    G, S = previous.topology.ep_size, previous.topology.slots_per_gpu
    prev_map = previous.physical_to_logical_map  # [L, P]
    rows, layers = [], []
    cut = None
    for l, st in enumerate(states):
        prev_x, prev_peak = st.prev, st.prev_peak
        if cut is None and l % WALL_CHUNK == 0 and time.perf_counter() >= deadline:
            cut = l
            out.notes.append(
                f"time limit: {len(states) - l} of {len(states)} layers keep the previous placement"
            )
        if cut is not None:
            x_final[l], statuses[l] = prev_x, "heuristic"
        obj = prev_peak if cut is not None else _objective_x(w[l], x_final[l], prev_x, mc)
        if guard and obj > prev_peak:  # cannot happen by construction; kept as the contract's guard
            x_final[l] = prev_x
            obj = prev_peak
        rows.append(prev_map[l].copy() if cut is not None else _fill_slots(x_final[l], prev_map[l], S))
        layers.append(
            LayerReport(
                layer_id=ids[l],
                status=statuses[l],
                objective=float(obj),
                bound=float(min(bounds[l], obj)),
                wall_time_s=0.0,
                baseline_objective=float(prev_peak),
                mean_load=float(w[l].sum() / G),
                extra={
                    "moved_slots": 0 if cut is not None else int(moved_pairs_x(prev_x, x_final[l])),
                    "peak": float(prev_peak if cut is not None else _peak_x(w[l], x_final[l])),
                    "previous_peak": float(prev_peak),
                    "full_resolve_peak": float(full.peak[l]),
                    "full_resolve_moved_slots": int(full.moved[l]),
                    "drift_fallback": bool(fallback[l]),
                    "replace_moves": st.moves["replace"],
                    "swap_moves": st.moves["swap"],
                },
            )
        )
    return rows, layers


def _params(options: MigrationOptions, mc: float) -> dict[str, Any]:
    """The report's and the placement provenance's parameters (``auto`` recorded as ``incremental``)."""
    return {
        "method": "incremental" if options.method == "auto" else options.method,
        "max_moves": options.max_moves,
        "max_moves_scope": "total over layers",
        "move_cost": mc,
        "time_limit": options.time_limit,
        "seed": options.seed,
        "drift_guard": options.drift_guard,
        **({} if options.max_steps is None else {"max_steps": options.max_steps}),
    }


def moved_pairs_x(prev_x: np.ndarray, x: np.ndarray) -> int:
    """Moved slots of one layer: pairs of ``x [E, G]`` that ``prev_x [E, G]`` lacks."""
    return int((x & ~prev_x).sum())


def _peak_x(w: np.ndarray, x: np.ndarray) -> float:
    cnt = x.sum(axis=1)
    return float((x * (w / cnt)[:, None]).sum(axis=0).max())


def _objective_x(w: np.ndarray, x: np.ndarray, prev_x: np.ndarray, mc: float) -> float:
    return _peak_x(w, x) + mc * moved_pairs_x(prev_x, x)
