"""Engine-neutral core of the plugins: one rebalance call in numpy, one map out, checked.

Shapes: L layers, E logical experts, P physical slots, G EP ranks, S = P // G slots per rank.

:func:`place` is what both engines' hooks call. It raises on any failure; the hooks catch that and
run the engine's own algorithm instead (they never raise inside the engine). It solves through the
one pipeline, :func:`solver.api.run`, with the engine's dispatch model (:data:`ENGINE_DISPATCH`):
under SGLang's static table the greedy and exact maps are fitted for the table, with every expert's
load taken as split evenly over the ranks (the engine passes all-reduced counts, no source ranks;
``docs/serving.md``). Everything in it is
deterministic: the greedy and migration searches are plain numpy with fixed tie-breaking, the
migration search stops on a work limit (``max_steps``, :func:`migration_steps`), the exact solver
runs one CP-SAT worker with a fixed seed and a deterministic-time limit. Every rank calls the
policy on the same all-reduced load and nothing broadcasts the result, so this matters.

The solver stack is imported inside the functions (never when the engine loads the plugin).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from moe_placement.base.errors import (
    EngineCallError as PolicyError,
)  # re-exported: the family lives in moe_placement.base.errors
from placement.dispatch import SGLANG_STATIC, VLLM_HASH
from runtime_hooks.engine_plugins.scale_down import lost_ranks, scale_down
from runtime_hooks.engine_plugins.spec import MAX_FILE_BYTES, PolicySpec
from runtime_hooks.rebalance_rule import Decision, RuleParams, decide, gpu_peaks

if TYPE_CHECKING:
    from placement.model import Placement
    from placement.topology import Topology
    from solver.problem import Problem

__all__ = [
    "ENGINE_DISPATCH",
    "ENGINE_HORIZON",
    "EngineCall",
    "PolicyError",
    "call_groups",
    "check_groups",
    "check_map",
    "exact_seconds",
    "fit_options",
    "logical_maps",
    "migration_steps",
    "place",
    "rebalance_verdict",
    "rule_params",
    "validate_call",
]

log = logging.getLogger(__name__)

ENGINE_DISPATCH = {"vllm": VLLM_HASH.name, "sglang": SGLANG_STATIC.name}  # each engine's replica choice
# Maps read from ``file:PATH``, one entry per (file version, call shape), the newest last; a rewrite
# of the served file adds a version, so the oldest are dropped beyond FILE_CACHE_ENTRIES.
_FILE_CACHE: OrderedDict[tuple, np.ndarray] = OrderedDict()
FILE_CACHE_ENTRIES = 4
# Windows of load a new map serves before the next rebalance, by default: the engine's rebalance
# interval over its load window (vLLM: step_interval 3000 / window_size 1000; SGLang: taken as 1).
ENGINE_HORIZON = {"vllm": 3.0, "sglang": 1.0}
# Migration search steps per second of budget. Measured at DeepSeek-V3 shape (58 x 256 -> 288 slots
# on 32 ranks and 320 on 64) on the 2-core dev machine: 20-24 ns a step, so 2e7 steps take 0.4-0.5 s
# per budget second and the rest of a call (full re-solve, alignment, checks: 0.3-0.6 s) fits too.
MIGRATION_STEPS_PER_S = 20_000_000
# Wall-clock safety cap of a migration solve: 10x its budget, at least 60 s. It only guards against a
# stalled machine; when it cuts the search, ranks may disagree (logged as a warning).
MIGRATION_SAFETY_CAP = 60.0


# Building and solving one layer's exact model takes 0.3-0.7 s at DeepSeek-V3 shape (256 experts) on
# the 2-core dev machine whatever the limit; scaled by the expert count, this decides (from the shapes
# alone, so every rank decides alike) whether ``exact`` can answer within its budget.
EXACT_SECONDS_PER_LAYER_256 = 0.7
EXACT_GUARD_MARGIN = 8  # the guard's exact candidate runs only when its estimate is this far inside


# One replay of SGLang's static draws for one layer (every rank's Python generator) takes about
# 0.035 s at DeepSeek-V3 shape (256 experts, 32 ranks) on the 2-core dev machine, and grows with
# ranks^2 (each rank without a near replica shuffles a list as long as the ranks in that case). The fit
# step replays it about ``steps + FIT_FIXED_DRAWS`` times per layer; from the shapes alone (so every
# rank decides alike) this picks the steps that fit the budget, or no fit.
FIT_SECONDS_PER_DRAW_256x32 = 0.035
FIT_FIXED_DRAWS = 5
FIT_MAX_STEPS = 60


def fit_options(time_limit: float, num_layers: int, num_experts: int, num_ranks: int):
    """The fit step's :class:`solver.api.FitOptions` for a budget of ``time_limit`` seconds."""
    from solver.api import FitOptions

    draw = FIT_SECONDS_PER_DRAW_256x32 * (num_ranks / 32) ** 2 * max(1.0, num_experts / 256)
    steps = int(time_limit / max(draw * num_layers, 1e-12)) - FIT_FIXED_DRAWS
    if steps < 0:
        return FitOptions(enabled=False)
    return FitOptions(steps=min(steps, FIT_MAX_STEPS))


def exact_seconds(num_layers: int, num_experts: int) -> float:
    """Estimated wall seconds of an exact solve of ``num_layers`` layers of ``num_experts`` experts."""
    return num_layers * EXACT_SECONDS_PER_LAYER_256 * num_experts / 256


def migration_steps(time_limit: float) -> int:
    """The migration search's work limit (``max_steps``) for a budget of ``time_limit`` seconds."""
    return max(1, int(MIGRATION_STEPS_PER_S * time_limit))


@dataclass(frozen=True)
class EngineCall:
    """One rebalance request, as the engine states it.

    Attributes:
        engine: ``vllm`` or ``sglang`` (chooses the dispatch model and the file's layer axis).
        load: float64 ``[L, E]`` tokens per logical expert (the all-reduced window).
        num_physical: ``P``; num_ranks: ``G``; num_nodes: ``N``.
        num_groups: expert groups of group-limited routing, or None (global policy).
        previous: int64 ``[L, P]`` map in service (``-1``: empty slot), or None.
        dispatch: the dispatch model the engine serves the map with (None: ``ENGINE_DISPATCH[engine]``).
        engine_default: the engine's own default policy on this call (``() -> [L, P]``), or None: our
            re-implementation of it stands in (:mod:`runtime_hooks.engine_plugins.default_guard`).
    """

    engine: str
    load: np.ndarray
    num_physical: int
    num_ranks: int
    num_nodes: int
    num_groups: int | None = None
    previous: np.ndarray | None = None
    dispatch: str | None = None
    engine_default: Callable[[], Any] | None = None

    @property
    def dispatch_model(self) -> str:
        """The name of the dispatch model the map is placed for."""
        return self.dispatch or ENGINE_DISPATCH[self.engine]

    def topology(self) -> Topology:
        """``Topology`` of the call; nodes that do not divide the ranks become one (as vLLM does)."""
        from placement.topology import Topology

        nodes = self.num_nodes if self.num_nodes >= 1 and self.num_ranks % self.num_nodes == 0 else 1
        return Topology(self.num_ranks, self.num_physical, nodes)


def place(spec: PolicySpec, call: EngineCall) -> np.ndarray:
    """The map our policy ``spec`` answers ``call`` with: int64 ``[L, P]``.

    A scale-down (the map in service wider than the call by whole ranks, vLLM's elastic EP) is
    answered with the failover map for the ranks that left (:mod:`.scale_down`), before anything else.
    Otherwise the steps: validate the call -> the map in service as it is (co-located replicas allowed) -> solve
    (``migration`` starts from that map; the solver repairs it and counts the repair toward
    ``max_moves``) -> check (on a hierarchical call, :func:`call_groups`, no expert group over two
    nodes) -> the rebalance rule: with a map in service, a new map that does not pay for its
    migration is dropped and the map in service kept (``always=1``: never), repaired of co-located
    replicas with one moved slot each (:func:`_kept`).
    """
    w = validate_call(call)
    topo = call.topology()
    lost = lost_ranks(call, w.shape[1])
    if lost:  # an elastic scale-down: the failover map for the ranks that left
        rows = scale_down(spec, call, w, lost)
        check_map(rows, w.shape[1], topo.num_physical_experts, topo.ep_size, w.shape[0])
        return rows
    groups = call_groups(call, topo, w.shape[1])
    if groups is not None and spec.failure_domain == "node":
        log.debug("moe_placement %s: copies spread over nodes: expert groups may span nodes", spec.text)
        groups = None
    in_service = _previous(call, topo, w.shape[1])
    engine_rows = None
    if spec.kind == "file":
        phy2log = _from_file(spec.path, call, topo, w.shape)
        _warn_split(spec, phy2log, w.shape[1], groups, topo)  # the user's own map: served as written
    else:
        phy2log = _solve(spec, call, topo, w, in_service, groups)
        fresh = spec.kind != "migration" or in_service is None
        if fresh and spec.failure_domain is None:  # a fresh call: the engine's default guard (not with
            # a failure domain: its cost is capped by failure_max_par_increase, the engine's map ignores it)
            guarded = _guarded(spec, call, topo, w, phy2log, groups)
            phy2log, engine_rows = guarded.phy2log, guarded.engine_rows
    phy2log = np.array(phy2log, dtype=np.int64, order="C")  # a writable copy the engine may own
    check_map(phy2log, w.shape[1], topo.num_physical_experts, topo.ep_size, w.shape[0], engine_rows)
    if spec.kind != "file":
        check_groups(phy2log, w.shape[1], groups, topo)
    if in_service is not None and spec.kind != "file":
        verdict = rebalance_verdict(spec, in_service, phy2log, w, call.engine)
        if not verdict.rebalance:
            kept = _kept(spec, in_service, w, groups, verdict.reason)
            if kept is not None:
                check_map(kept, w.shape[1], topo.num_physical_experts, topo.ep_size, w.shape[0])
                return kept
        else:
            log.info("moe_placement %s: rebalancing (%s)", spec.text, verdict.reason)
    return phy2log


def _guarded(spec: PolicySpec, call: EngineCall, topo: Topology, w: np.ndarray, phy2log, groups):
    """Our fresh map ``[L, P]`` guarded against the engine's default answer
    (:func:`runtime_hooks.engine_plugins.default_guard.guard_fresh`); the exact solver (half the
    budget) is one of the maps tried on the layers ours loses, when its estimate is under
    1/:data:`EXACT_GUARD_MARGIN` of the budget (its wall-clock wall must never cut in: ranks would
    then disagree)."""
    from runtime_hooks.engine_plugins.default_guard import guard_fresh
    from solver.problem import Problem

    def exact(layers: np.ndarray) -> np.ndarray:
        if (
            spec.kind == "exact"
            or exact_seconds(layers.size, w.shape[1]) > spec.time_limit / EXACT_GUARD_MARGIN
        ):
            raise PolicyError("exact would not finish well inside half the budget on these layers")
        num_groups = call.num_groups if call.num_groups and call.num_groups > 1 else None
        problem = Problem.build(topo, load=w[layers], num_groups=num_groups, dispatch=call.dispatch_model)
        values = {"deterministic": True, "workers": 1, "time_limit": spec.time_limit / 2}
        return _run(spec, problem, "cpsat", {**values, "node_constraint": groups is not None}, w[layers])

    return guard_fresh(spec, call, topo, w, phy2log, groups, exact)


def call_groups(call: EngineCall, topo: Topology, E: int) -> int | None:
    """The call's expert groups when it is hierarchical (they divide the ``E`` experts and divide
    over more than one node: the engines then keep each group on one node), else None."""
    from solver.greedy import hierarchical_groups

    return hierarchical_groups(call.num_groups, E, topo.num_nodes)


def check_groups(phy2log: np.ndarray, E: int, groups: int | None, topo: Topology) -> None:
    """Raise :class:`PolicyError` when ``phy2log [L, P]`` puts one of ``groups`` expert groups on two
    nodes (nothing to check when ``groups`` is None)."""
    split = _split_layers(phy2log, E, groups, topo)
    if split.size:
        raise PolicyError(
            f"layer {int(split[0])}: an expert group spans two nodes on a hierarchical call "
            f"({groups} groups over {topo.num_nodes} nodes)"
        )


def _split_layers(phy2log: np.ndarray, E: int, groups: int | None, topo: Topology) -> np.ndarray:
    """int64 indices of the layers of ``phy2log [L, P]`` with a group over several nodes."""
    if groups is None:
        return np.zeros(0, dtype=np.int64)
    from solver.greedy import group_nodes

    return np.flatnonzero((group_nodes(phy2log, E, groups, topo) < 0).any(axis=1))


def _warn_split(spec: PolicySpec, phy2log: np.ndarray, E: int, groups: int | None, topo: Topology) -> None:
    split = _split_layers(phy2log, E, groups, topo)
    if split.size:
        log.warning(
            "moe_placement %s: the file splits expert groups over nodes in %d layer(s) on a hierarchical "
            "call; served as written (solve it with --num-groups to keep groups on nodes)",
            spec.text,
            split.size,
        )


def _kept(
    spec: PolicySpec, in_service: Placement, w: np.ndarray, groups: int | None, reason: str
) -> np.ndarray | None:
    """The map in service, kept: int64 ``[L, P]``, its co-located replicas (vLLM's own maps hold
    some) repaired with one moved slot each, the fewest any repair moves (inside each group's node on
    a hierarchical call); None when it splits an expert group over nodes on a hierarchical call
    (the new map is then served)."""
    from solver.migration.slots import repair_colocated

    p2l = in_service.physical_to_logical_map
    topo = in_service.topology
    split = _split_layers(p2l, in_service.num_logical_experts, groups, topo)
    if split.size:
        log.info(
            "moe_placement %s: map in service splits expert groups over nodes in %d layer(s) on a "
            "hierarchical call; rebalancing although it does not pay (%s)",
            spec.text,
            split.size,
            reason,
        )
        return None
    repaired, moved = repair_colocated(in_service, w, groups)
    if moved.sum():
        log.info(
            "moe_placement %s: map in service kept (%s), %d co-located replica(s) repaired with one "
            "moved slot each",
            spec.text,
            reason,
            int(moved.sum()),
        )
    else:
        log.info("moe_placement %s: map in service kept (%s)", spec.text, reason)
    return np.array(repaired.physical_to_logical_map, dtype=np.int64, order="C")


def rule_params(spec: PolicySpec, engine: str) -> RuleParams:
    """The rebalance rule's constants for ``spec`` (its ``always``, ``horizon``, ``stall``,
    ``expert_bytes``; else the rule's defaults, the horizon :data:`ENGINE_HORIZON`)."""
    given = {"horizon": spec.horizon, "stall": spec.stall, "expert_bytes": spec.expert_bytes}
    values = {k: float(v) for k, v in given.items() if v is not None}
    values.setdefault("horizon", ENGINE_HORIZON[engine])
    return RuleParams(always=spec.always, **values)


def rebalance_verdict(
    spec: PolicySpec, in_service: Placement, new_map: np.ndarray, load: np.ndarray, engine: str = "vllm"
) -> Decision:
    """The rule's verdict on switching from ``in_service`` to ``new_map [L, P]`` for the window
    ``load [L, E]`` (the engine's window, split evenly over replicas: vLLM's hash in expectation; for
    SGLang's static table an approximation)."""
    from placement.churn import arrived_per_gpu
    from placement.model import Placement

    topo = in_service.topology
    new = Placement(new_map, in_service.num_logical_experts, topo, allow_colocated_replicas=True)
    peak_now = gpu_peaks(in_service.physical_to_logical_map, load, topo.ep_size)  # [L]
    peak_new = gpu_peaks(new_map, load, topo.ep_size)  # [L]
    return decide(peak_now, peak_new, arrived_per_gpu(in_service, new), rule_params(spec, engine))


def validate_call(call: EngineCall) -> np.ndarray:
    """The call's load as float64 ``[L, E]``, or :class:`PolicyError` naming what the engine passed
    that our policy cannot answer (the hook then runs the engine's own algorithm)."""
    if call.engine not in ENGINE_DISPATCH:
        raise PolicyError(f"unknown engine {call.engine!r}; expected one of {sorted(ENGINE_DISPATCH)}")
    for name in ("num_physical", "num_ranks", "num_nodes"):
        v = getattr(call, name)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise PolicyError(f"{name} must be a positive integer, got {v!r}")
    P, G = int(call.num_physical), int(call.num_ranks)
    if P % G:
        raise PolicyError(f"{P} physical slots do not divide over {G} GPUs")
    try:
        w = np.asarray(call.load, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"load is not numeric ({exc})") from None
    if w.ndim != 2 or 0 in w.shape:
        raise PolicyError(f"load must be [layers, experts], got shape {w.shape}")
    if not np.all(np.isfinite(w)) or w.min() < 0:
        raise PolicyError("load must be finite and >= 0 (found NaN, inf or a negative count)")
    if w.shape[1] > P:
        raise PolicyError(f"{w.shape[1]} experts do not fit on {P} physical slots")
    groups = call.num_groups
    if groups is not None and (
        isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1
    ):
        raise PolicyError(f"num_groups must be a positive integer or None, got {groups!r}")
    return w


def _previous(call: EngineCall, topo: Topology, E: int) -> Placement | None:
    """The map in service as a ``Placement`` of the same shape, whatever it holds (two replicas of one
    expert on one GPU included: the solvers repair it), else None: no map, another shape, an id
    outside ``[0, E)`` (``-1``: an empty slot under elastic EP) or an expert on no slot (logged)."""
    from placement.model import Placement

    if call.previous is None:
        return None
    prev = np.asarray(call.previous)
    if prev.shape != (call.load.shape[0], topo.num_physical_experts) or not np.issubdtype(
        prev.dtype, np.integer
    ):
        log.info(
            "moe_placement: map in service is %s %s, not int [L, P]: placed from scratch",
            prev.dtype,
            prev.shape,
        )
        return None
    try:
        return Placement(prev.astype(np.int64), E, topo, allow_colocated_replicas=True)
    except ValueError as exc:  # empty slots (-1), a missing expert
        log.info("moe_placement: map in service is not a placement (%s): placed from scratch", exc)
        return None


def _solve(
    spec: PolicySpec,
    call: EngineCall,
    topo: Topology,
    w: np.ndarray,
    previous: Placement | None,
    hierarchical: int | None = None,
) -> np.ndarray:
    """``greedy``/``exact``/``migration`` through the pipeline under the engine's dispatch model;
    int64 ``[L, P]``. On a hierarchical call (``hierarchical``: its groups) every expert group stays
    on one node: greedy's hierarchical mode, exact's node constraint, a fit inside nodes; migration's
    moves know no groups, so its layers that split one are replaced (:func:`_unsplit`, logged)."""
    from solver.failure import DEFAULT_MAX_PAR_INCREASE
    from solver.problem import Problem

    groups = call.num_groups if call.num_groups and call.num_groups > 1 else None
    cap = spec.failure_max_par_increase
    problem = Problem.build(
        topo,
        load=w,
        num_groups=groups,
        previous=previous,
        dispatch=call.dispatch_model,
        failure_domain=spec.failure_domain if spec.kind != "migration" else None,
        failure_max_par_increase=DEFAULT_MAX_PAR_INCREASE if cap is None else cap,
    )
    name, values = _solver_for(spec, problem, w, hierarchical)
    phy2log = _run(spec, problem, name, values, w)
    split = _split_layers(phy2log, w.shape[1], hierarchical, topo)
    if name == "migration" and split.size:
        phy2log = _unsplit(spec, problem, phy2log, split, w)
    return phy2log


def _unsplit(spec: PolicySpec, problem: Problem, phy2log: np.ndarray, split: np.ndarray, w: np.ndarray):
    """Migration's map ``[L, P]`` with its ``split`` layers (an expert group over two nodes on a
    hierarchical call: its moves know no groups) replaced, logged: without a move budget by greedy's
    hierarchical layer, with one by the map in service (repaired of co-located replicas inside each
    group's node; greedy's layer where that map splits groups too); :class:`PolicyError` when the
    result moves more than ``max_moves`` slots."""
    from solver.migration.slots import repair_colocated

    previous = problem.previous
    E, topo = w.shape[1], problem.topology
    greedy = _run(spec, problem, "greedy", {}, w)  # [L, P]
    rows = greedy
    if spec.max_moves is not None:
        kept = repair_colocated(previous, w, problem.num_groups)[0].physical_to_logical_map
        rows = kept.copy()
        bad = _split_layers(kept, E, problem.num_groups, topo)
        rows[bad] = greedy[bad]
    out = phy2log.copy()
    out[split] = rows[split]
    log.info(
        "moe_placement %s: migration split expert groups over nodes in %d layer(s) of a hierarchical call; "
        "those layers are %s",
        spec.text,
        split.size,
        "greedy's" if spec.max_moves is None else "the map in service's (repaired)",
    )
    moved = int((out != previous.physical_to_logical_map).sum())
    if spec.max_moves is not None and moved > spec.max_moves:
        raise PolicyError(
            f"migration kept expert groups on nodes with {moved} moved slots, over max_moves={spec.max_moves}"
        )
    return out


def _solver_for(
    spec: PolicySpec, problem: Problem, w: np.ndarray, hierarchical: int | None
) -> tuple[str, dict]:
    """The pipeline's solver name and options for ``spec`` on ``problem``."""
    previous = problem.previous
    if spec.kind == "exact":
        need = exact_seconds(*w.shape)
        if need > spec.time_limit:
            raise PolicyError(
                f"exact needs about {need:.0f} s for {w.shape[0]} layers x {w.shape[1]} experts, over its "
                f"{spec.time_limit:g} s budget; raise time_limit, use migration, or solve offline and "
                "serve the result with file:PATH"
            )
        values = {"deterministic": True, "workers": 1, "time_limit": spec.time_limit}
        return "cpsat", {**values, "node_constraint": hierarchical is not None}
    if spec.kind == "migration" and previous is not None:
        # from the map in service whatever it holds: co-located replicas are repaired by the solver
        # (one moved slot each), counted toward max_moves (a hard cap: ValueError when the repair alone
        # exceeds it, and the engine's algorithm answers)
        return "migration", {
            "method": "incremental",
            "max_moves": spec.max_moves,
            # without a move budget, balance comes first: a layer whose incremental result is less
            # balanced (on the window) than a full re-solve takes the re-solve, relabelled to keep slots
            "drift_guard": 1.5 if spec.max_moves is not None else 1.0,
            "max_steps": migration_steps(spec.time_limit),
            "time_limit": max(MIGRATION_SAFETY_CAP, 10 * spec.time_limit),  # wall safety cap only
        }
    if spec.kind == "migration":
        log.info("moe_placement migration: no map in service; greedy from scratch instead")
    return "greedy", {}


def _run(spec: PolicySpec, problem: Problem, name: str, values: dict, w: np.ndarray) -> np.ndarray:
    """Solver ``name`` with ``values`` through the pipeline (fit step sized to the budget), slots of
    experts that stay on a GPU kept; int64 ``[L, P]``."""
    from placement.dispatch import get_dispatch
    from solver.api import make_options, run
    from solver.migration.slots import keep_slots_batched, repair_colocated

    topo, previous = problem.topology, problem.previous
    fit = fit_options(spec.time_limit, w.shape[0], w.shape[1], topo.ep_size)
    if not fit.enabled and get_dispatch(problem.dispatch).table:
        log.info(
            "moe_placement %s: fitting %d layers x %d experts on %d ranks for %s would exceed the %g s "
            "budget; the map is not fitted (raise time_limit)",
            spec.text,
            w.shape[0],
            w.shape[1],
            topo.ep_size,
            problem.dispatch,
            spec.time_limit,
        )
    result = run(name, problem, make_options(name, values, seed=0), fit)
    placement, report = result.placement, result.report
    for note in report.notes:
        wall_cut = "time limit" in note or "safety cap" in note  # ranks may disagree
        level = logging.WARNING if wall_cut else logging.DEBUG
        log.log(level, "moe_placement %s: %s", spec.text, note)
    if previous is not None and name != "migration" and result.fit is None:
        # experts staying on a GPU keep their slot (not after a fit: slot order decides a table's draws);
        # against the cheapest repair of a map with co-located replicas
        valid = repair_colocated(previous, w)[0] if previous.allow_colocated_replicas else previous
        placement = keep_slots_batched(placement, valid)
    phy2log = placement.physical_to_logical_map
    if name == "migration" and spec.max_moves is not None:
        moved = int((phy2log != previous.physical_to_logical_map).sum())
        if moved > spec.max_moves:  # the solver asserts this too; never hand the engine more
            raise PolicyError(f"migration moved {moved} slots, over max_moves={spec.max_moves}")
    return phy2log


def _from_file(path: str, call: EngineCall, topo: Topology, shape: tuple[int, int]) -> np.ndarray:
    """The map in ``path`` as the engine's ``[L, P]`` rows (cached per file version and shape)."""
    from placement.formats import read_placement

    L, E = shape
    stat = _file_stat(path)
    key = (os.path.abspath(path), stat.st_mtime_ns, stat.st_size, call.engine, L, E, topo)
    if key in _FILE_CACHE:
        _FILE_CACHE.move_to_end(key)
        return _FILE_CACHE[key]
    placement = read_placement(path, ep_size=topo.ep_size, num_nodes=topo.num_nodes, num_logical_experts=E)
    _FILE_CACHE[key] = _engine_rows(placement, call.engine, L, E, topo.num_physical_experts)
    while len(_FILE_CACHE) > FILE_CACHE_ENTRIES:
        _FILE_CACHE.popitem(last=False)  # the least recently used version
    log.info("moe_placement file:%s: %d layers x %d slots", path, L, topo.num_physical_experts)
    return _FILE_CACHE[key]


def _file_stat(path: str) -> os.stat_result:
    """``os.stat`` of a placement file we may read: a regular file (no FIFO, device or folder, which
    could block or never end) of at most :data:`MAX_FILE_BYTES`; else :class:`PolicyError`."""
    import stat as st

    try:
        info = os.stat(path)
    except OSError as exc:
        raise PolicyError(f"file:{path}: cannot stat ({exc.strerror or exc})") from None
    if not st.S_ISREG(info.st_mode):
        raise PolicyError(f"file:{path}: not a regular file")
    if info.st_size > MAX_FILE_BYTES:
        raise PolicyError(
            f"file:{path}: {info.st_size} bytes, over the {MAX_FILE_BYTES}-byte cap of a placement file"
        )
    return info


def _engine_rows(placement: Placement, engine: str, L: int, E: int, P: int) -> np.ndarray:
    """``[L, P]`` rows: the file's layers when it has ``L``; for SGLang (one row per hidden layer) the
    MoE layers go to the rows their real ids name and the other rows hold the trivial ``p % E``."""
    p2l = placement.physical_to_logical_map
    if placement.num_physical_experts != P or placement.num_logical_experts != E:
        raise PolicyError(
            f"file placement has {placement.num_logical_experts} experts x {placement.num_physical_experts} "
            f"slots, the engine {E} x {P}"
        )
    if placement.num_layers == L:
        return p2l
    ids = placement.layer_ids
    if engine == "sglang" and ids and max(ids) < L:
        rows = np.tile(np.arange(P, dtype=np.int64) % E, (L, 1))  # [L, P]
        rows[list(ids)] = p2l
        return rows
    raise PolicyError(f"file placement has {placement.num_layers} layers, the engine {L}")


def check_map(
    phy2log: np.ndarray, E: int, P: int, G: int, L: int, engine_rows: np.ndarray | None = None
) -> None:
    """Raise :class:`PolicyError` unless ``phy2log`` is int64 ``[L, P]`` with ids in ``[0, E)``, every
    expert on at least one slot and no two replicas of one expert on one GPU, in every layer but the
    ``engine_rows`` (bool ``[L]``: the engine's own rows, served by the guard and logged)."""
    if phy2log.dtype != np.int64 or phy2log.shape != (L, P):
        raise PolicyError(f"map is {phy2log.dtype} {phy2log.shape}, expected int64 ({L}, {P})")
    if phy2log.size and (phy2log.min() < 0 or phy2log.max() >= E):
        raise PolicyError(f"map holds ids outside [0, {E})")
    count = np.zeros((L, E), dtype=np.int64)
    np.add.at(count, (np.repeat(np.arange(L), P), phy2log.ravel()), 1)
    if (count == 0).any():
        l, e = map(int, np.argwhere(count == 0)[0])
        raise PolicyError(f"layer {l}: expert {e} has no replica")
    per_gpu = np.sort(phy2log.reshape(L, G, P // G), axis=2)  # [L, G, S]
    dup = per_gpu[:, :, 1:] == per_gpu[:, :, :-1]
    if engine_rows is not None:
        dup[np.asarray(engine_rows, dtype=bool)] = False
    if dup.any():
        l, g, _ = map(int, np.argwhere(dup)[0])
        raise PolicyError(f"layer {l}: GPU {g} holds two replicas of one expert")


def logical_maps(phy2log: np.ndarray, E: int) -> tuple[np.ndarray, np.ndarray]:
    """``(log2phy int64 [L, E, R] ascending slots padded with -1, logcnt int64 [L, E])``, ``R`` the
    largest replica count (SGLang's convention; it pads to ``P`` itself)."""
    from placement.model import compute_logical_maps

    return compute_logical_maps(phy2log, E)
