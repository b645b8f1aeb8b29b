"""One registry of solvers and the one pipeline every caller reaches a placement through.

The CLI, the engine plugins, the online rebalancer, the benchmarks and library callers all call
:func:`solve` (arrays in) or :func:`run` (a built :class:`Problem` in). Both run the same named
steps, each a short function below:

    baseline (greedy) -> the named solver -> gate on its objective -> fit for the dispatch model
    -> gate under the dispatch model -> report

- baseline: :data:`BASELINE` with its default options on ``problem.load`` (reused as the named
  solver's result when that is the baseline itself).
- solver: ``SOLVERS[name].run(problem, options)``.
- gate, objective (``gated`` solvers): keep the baseline when the solver's even-split peak on the
  fitted load is higher (the solvers' own objective; under ``even`` it is the dispatch gate too).
- fit (``fittable`` solvers, dispatch models with a fixed per-rank ``table``): move replicas for the
  engine's table (:func:`solver.dispatch_fit.fit_for_dispatch`, or
  :func:`~solver.dispatch_fit.fit_for_dispatch_load` when the problem has no per-token or per-window
  routing: the counts are then taken as split evenly over the ranks).
- fit (``fittable`` solvers, dispatch models that split each step's counts, ``needs_step_counts``):
  re-choose which experts hold the redundant slots and where, for the flattest per-step split of
  sampled fit steps (:func:`solver.step.fit.fit_for_steps`; needs a per-token trace).
- gate, dispatch (``gated`` solvers, after a fit): keep the baseline when the fitted placement's peak
  under the table is higher than the baseline's on the same tokens per (rank, expert) (per-step
  models: its mean step peak on the fit's validation steps).
- failure domain (``problem.failure_domain``): the hottest experts' copies spread over GPUs or nodes
  (:func:`solver.failure.protect`) on the placement the gates chose, its balance cost reported against
  that placement and capped by ``problem.failure_max_par_increase``. The gates above compare
  unconstrained placements only (the solver's and greedy's, like with like); the protected placement
  is never swapped back for one that ignores the domain.
- report: the solver's :class:`SolveReport` with the notes of every step, in a :class:`SolveResult`
  that also holds the baseline and its report (and unpacks as ``placement, report``).

Every solver is ``run(problem: Problem, options: <Solver>Options) -> (Placement, SolveReport)``.
:class:`SolverSpec` holds the function and the options class themselves and what the pipeline and
the CLI read (what it needs, whether it is gated or fitted, which CLI flags feed its options, what
the CLI shows). Importing this module imports neither ortools nor networkx (the solvers import them
where they use them).

Adding a solver: write ``<Name>Options`` (a frozen dataclass) and ``run_<name>`` in its module, then
add one :class:`SolverSpec` line to :data:`SOLVERS`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from moe_placement.base.limits import MAX_FIT_STEPS, MAX_SEARCH_SAMPLES, MAX_STEP_TOKENS, MAX_TIME_LIMIT_S
from moe_placement.base.options import refuse_unknown_keywords
from placement.cost.fields import Range, check_fields
from placement.dispatch import EVEN, DispatchModel, get_dispatch
from placement.metrics import expected_gpu_load, rank_expert_counts, rank_gpu_load
from placement.model import Placement
from placement.steps import DEFAULT_STEP_TOKENS, PHASES
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.affinity import AffinityOptions, run_affinity
from solver.budget import Budget, check_time_limit
from solver.dispatch_fit import (
    DispatchFit,
    TableFitOptions,
    even_rank_counts,
    fit_for_dispatch,
    fit_for_dispatch_load,
)
from solver.exact import ExactOptions, run_exact
from solver.failure import DEFAULT_MAX_PAR_INCREASE, FailureReport, protect
from solver.greedy import GreedyOptions, run_greedy
from solver.locality.options import LocalityOptions
from solver.locality.solve import run_locality
from solver.migration import MigrationOptions, run_migration
from solver.problem import Problem, options_from
from solver.report import SolveReport
from solver.step.cost import DEFAULT_HARDWARE, step_cost_for
from solver.step.fit import StepFit, StepFitOptions, fit_for_steps

__all__ = [
    "BASELINE",
    "FitOptions",
    "SOLVERS",
    "SolveResult",
    "SolverSpec",
    "make_options",
    "run",
    "run_solver",
    "solve",
    "solver_names",
]

log = logging.getLogger(__name__)

RunFn = Callable[[Problem, Any], tuple[Placement, SolveReport]]

_EXACT_FLAGS = {
    f: f for f in ("objective", "robust", "num_windows", "weighted", "node_constraint", "workers")
}
_LOCALITY_FLAGS = {
    "balance_slack": "balance_slack",
    "hidden_size": "hidden_size",
    "num_everywhere": "everywhere",
    "gpu_slack": "gpu_slack",
    "source_model": "source_model",
    "work_limit": "work_limit",
    "share_margin": "share_margin",
    "drift_z": "drift_z",
    "share_overload": "share_overload",
}


@refuse_unknown_keywords
@dataclass(frozen=True)
class SolverSpec:
    """One solver: its function, its options class, and what the pipeline and the CLI read.

    Attributes:
        options: the frozen options class (every knob, seed and budget included).
        run: ``run(problem, options) -> (Placement, SolveReport)``.
        fixed: options set by the name (``cpsat`` and ``milp`` are one solver with two backends).
        needs_tokens: needs a per-token trace (``topk_ids``), not counts only.
        needs_previous: needs the placement in service (the CLI picks it with ``--previous``).
        gated: never worse than the baseline: the pipeline keeps the baseline otherwise.
        fittable: its replicas may be moved for an engine's dispatch table (the fit step).
        flags: option field -> the CLI argument (``argparse`` dest) that sets it when given.
        work_per_layer: the CLI's default work limit in steps per layer (the same placement on any
            machine) unless asked for the wall clock; None: the solver has no work limit.
        shows_per_layer: the CLI prints its per-layer table against the baseline.
        shows_remote: it trades balance for fewer remote nodes: the CLI shows held-out remote nodes.
    """

    options: type
    run: RunFn
    fixed: Mapping[str, Any] = field(default_factory=dict)
    needs_tokens: bool = False
    needs_previous: bool = False
    gated: bool = False
    fittable: bool = False
    flags: Mapping[str, str] = field(default_factory=dict)
    work_per_layer: int | None = None
    shows_per_layer: bool = False
    shows_remote: bool = False

    @property
    def option_names(self) -> tuple[str, ...]:
        """The fields of :attr:`options`."""
        return tuple(f.name for f in fields(self.options))


SOLVERS: dict[str, SolverSpec] = {
    "greedy": SolverSpec(GreedyOptions, run_greedy, fittable=True),
    "cpsat": SolverSpec(
        ExactOptions,
        run_exact,
        {"backend": "cpsat"},
        gated=True,
        fittable=True,
        flags=_EXACT_FLAGS,
        shows_per_layer=True,
    ),
    "milp": SolverSpec(
        ExactOptions,
        run_exact,
        {"backend": "milp"},
        gated=True,
        fittable=True,
        flags=_EXACT_FLAGS,
        shows_per_layer=True,
    ),
    "locality": SolverSpec(
        LocalityOptions,
        run_locality,
        needs_tokens=True,
        flags=_LOCALITY_FLAGS,
        work_per_layer=100,
        shows_remote=True,
    ),
    "migration": SolverSpec(
        MigrationOptions,
        run_migration,
        needs_previous=True,
        flags={"max_moves": "max_moves", "move_cost": "move_cost"},
        shows_per_layer=True,
    ),
    "affinity": SolverSpec(AffinityOptions, run_affinity, needs_tokens=True, shows_remote=True),
}

BASELINE = "greedy"  # every pipeline starts from it and gates against it

_NEEDS = {
    "needs_tokens": "the {name} solver needs a per-token trace (topk_ids), not counts only",
    "needs_previous": "the {name} solver needs the current placement (--previous)",
}


def solver_names(**where: bool) -> tuple[str, ...]:
    """Names of the solvers whose spec attributes equal ``where`` (e.g. ``needs_previous=False``)."""
    return tuple(n for n, s in SOLVERS.items() if all(getattr(s, k) == v for k, v in where.items()))


def _spec(name: str) -> SolverSpec:
    if name not in SOLVERS:
        raise ValueError(f"unknown solver {name!r}; choose one of {tuple(SOLVERS)}")
    return SOLVERS[name]


def make_options(name: str, values: Mapping[str, Any] | None = None, **common: Any) -> Any:
    """Solver ``name``'s frozen options from ``values``; ``common`` keys (``seed``, ``time_limit``)
    are used only where the solver has such an option. Unknown keys raise ValueError."""
    spec = _spec(name)
    known = set(spec.option_names)
    anywhere = set().union(*(set(sp.option_names) for sp in SOLVERS.values()))
    unknown = sorted(set(common) - anywhere)
    if unknown:  # a misspelt common key was dropped silently: no solver has it
        raise ValueError(
            f"make_options: no solver has an option {unknown[0]!r}; common keys are the solvers' own "
            f"({', '.join(sorted(anywhere & {'seed', 'time_limit', 'work_limit'}))} ...), or pass it in values"
        )
    if "time_limit" in common:  # checked whatever the solver: a bad limit is never silently dropped
        check_time_limit(common["time_limit"])
    merged = {k: v for k, v in common.items() if k in known}
    merged.update(values or {})
    merged.update(spec.fixed)
    if "time_limit" in merged:  # every solver's: a finite wall-clock budget for the whole solve
        check_time_limit(merged["time_limit"])
    if merged.get("work_limit") is not None:  # a counted-step budget for the whole solve
        Budget(0.0, merged["work_limit"])
    return options_from(spec.options, name, merged)


def run_solver(name: str, problem: Problem, options: Any = None) -> tuple[Placement, SolveReport]:
    """Solver ``name`` alone on ``problem`` (no baseline, fit or gate): the pipeline's solver step."""
    spec = _spec(name)
    for need, message in _NEEDS.items():
        if getattr(spec, need) and not _has(problem, need):
            raise ValueError(message.format(name=name))
    return spec.run(problem, options if options is not None else make_options(name))


def _has(problem: Problem, need: str) -> bool:
    if need == "needs_tokens":
        return problem.trace is not None and problem.trace.has_tokens
    return problem.previous is not None


# accepted ranges of FitOptions' fields (bounded so that a call cannot ask for endless work)
_FIT_RANGES = {
    "steps": Range(0, MAX_FIT_STEPS),
    "seed": Range(0, 2**32 - 1),
    "dealings": Range(0, MAX_SEARCH_SAMPLES),
    "noise_z": Range(0.0, 1e3),
    "step_tokens": Range(1, MAX_STEP_TOKENS),
    "step_moves": Range(0, MAX_FIT_STEPS),
    "time_limit": Range(0.0, MAX_TIME_LIMIT_S, lo_open=True),
}


@refuse_unknown_keywords
@dataclass(frozen=True)
class FitOptions:
    """How the fit step searches (:func:`solver.dispatch_fit.fit_for_dispatch`).

    Attributes:
        enabled: run the fit step at all (False: the solver's replicas stay where it put them).
        steps: swap attempts per layer (``sglang-static``); seed: seeds them.
        dealings: random dealings of the fit prompts to the ranks the search averages over (traces).
        noise_z: standard errors the mean gain over those dealings must exceed to change a layer.
        step_tokens: tokens per rank per step for models that split each step (``--step-tokens``;
            None: the phase's default, :data:`placement.steps.DEFAULT_STEP_TOKENS`);
            step_moves: move attempts per layer of :func:`solver.step.fit.fit_for_steps`.
        phase: the steps such a model is placed for (``--phase``: ``decode`` or ``prefill``).
        model, hardware: the presets that price those steps (``--model``, ``--hardware``;
            :mod:`solver.step.cost`): model None takes the built-in preset with the trace's experts
            and top-k, and with none the fit balances the step peak alone (its note says so).
        time_limit: seconds the per-step fit may search (:func:`solve` sets its ``time_limit``; the
            CLI's ``--time-limit``); it stops there and its note says so. None: its move budget only.
    """

    enabled: bool = True
    steps: int = 60
    seed: int = 0
    dealings: int = 16
    noise_z: float = 0.0
    step_tokens: int | None = None
    step_moves: int = 300
    phase: str = "decode"
    model: str | None = None
    hardware: str = DEFAULT_HARDWARE
    time_limit: float | None = None

    def __post_init__(self) -> None:
        check_fields(self, _FIT_RANGES, "", prefix="FitOptions.")
        if self.phase not in PHASES:
            raise ValueError(f"FitOptions.phase must be one of {', '.join(PHASES)}, got {self.phase!r}")

    @property
    def phase_step_tokens(self) -> int:
        """``step_tokens``, else the phase's default."""
        return int(self.step_tokens) if self.step_tokens is not None else DEFAULT_STEP_TOKENS[self.phase]


@dataclass(frozen=True)
class SolveResult:
    """What the pipeline returns; unpacks as ``placement, report``.

    Attributes:
        placement: the placement to serve (``physical_to_logical_map`` int64 ``[L, P]``).
        report: the named solver's report, with the notes of every step.
        baseline: the baseline's placement (greedy, before any fit), and baseline_report its report.
        fit: what the fit step did, or None when it did not run.
        is_baseline: the named solver is the baseline (its step reused the baseline's result).
        objective_fallback: the objective gate kept the baseline.
        dispatch_fallback: the dispatch gate kept the baseline.
        failure: what the failure-domain step protected and what it cost (None without a domain).
        unconstrained: the placement before that step (the pipeline's answer without the domain), or
            None without a domain.
    """

    placement: Placement
    report: SolveReport
    baseline: Placement
    baseline_report: SolveReport
    fit: DispatchFit | StepFit | None = None
    is_baseline: bool = False
    objective_fallback: bool = False
    dispatch_fallback: bool = False
    failure: FailureReport | None = None
    unconstrained: Placement | None = None

    def __iter__(self) -> Iterator[Any]:
        return iter((self.placement, self.report))

    def __getitem__(self, i: int) -> Any:
        return (self.placement, self.report)[i]


def run(name: str, problem: Problem, options: Any = None, fit: FitOptions | None = None) -> SolveResult:
    """The pipeline on ``problem`` with solver ``name`` (``options``: its options object, default:
    its defaults; ``fit``: the fit step's, default :class:`FitOptions`): baseline -> solver -> gate
    (objective) -> fit -> gate (dispatch) -> failure domain -> report."""
    spec = _spec(name)
    if not isinstance(problem, Problem):
        raise ValueError(
            f"problem must be a solver.problem.Problem (Problem.build(topology, trace=...)), got {type(problem).__name__}"
        )
    options = options if options is not None else make_options(name)
    _check_run_args(name, spec, options, fit)
    if problem.failure_domain is not None and spec.needs_previous:
        raise ValueError(
            f"a failure domain applies to fresh placements, not to the {name} solver (its move budget counts "
            f"against the map in service); solve with greedy, cpsat, milp or locality and failure_domain"
        )
    t0 = time.perf_counter()
    baseline, baseline_report = _baseline(problem)
    is_baseline = name == BASELINE and options == make_options(BASELINE)
    if is_baseline:
        placement, report = baseline, baseline_report
    else:
        placement, report = run_solver(name, problem, options)
    notes: list[str] = []
    placement, objective_fallback = _gate_objective(name, spec, problem, placement, baseline, notes)
    placement, fitted = _fit(spec, problem, placement, fit or FitOptions(), notes)
    placement, dispatch_fallback = _gate_dispatch(name, spec, problem, fitted, placement, baseline, notes)
    unconstrained = placement
    placement, failure = _protect(problem, placement, notes)
    if notes:
        report = replace(report, notes=(*report.notes, *notes))
    log.debug("%s pipeline under %s: %.3fs", name, problem.dispatch, time.perf_counter() - t0)
    return SolveResult(
        placement,
        report,
        baseline,
        baseline_report,
        fitted,
        is_baseline,
        objective_fallback,
        dispatch_fallback,
        failure,
        unconstrained if failure is not None else None,
    )


def _protect(problem: Problem, placement: Placement, notes: list) -> tuple[Placement, FailureReport | None]:
    """Step 6: with a failure domain, the hottest experts' copies spread over its domains
    (:func:`solver.failure.protect` on ``problem.load [L, E]``), the cost against ``placement``."""
    if problem.failure_domain is None:
        return placement, None
    placement, report = protect(
        placement, problem.load, problem.failure_domain, problem.failure_max_par_increase
    )
    notes.append(report.note())
    return placement, report


def _check_run_args(name: str, spec: SolverSpec, options: Any, fit: Any) -> None:
    """``options`` the solver's options object and ``fit`` a :class:`FitOptions` (or None), else a
    one-line ValueError naming what came and how to build the right one."""
    if not isinstance(options, spec.options):
        raise ValueError(
            f"options must be a {spec.options.__name__} for the {name} solver, got {type(options).__name__}; "
            f"build it with solver.api.make_options({name!r}, {{...}})"
        )
    if fit is not None and not isinstance(fit, FitOptions):
        raise ValueError(
            f"fit must be a solver.api.FitOptions or None, got {type(fit).__name__}; e.g. FitOptions(steps=60)"
        )


def _check_solve_args(seed: Any, options: Any) -> None:
    """``seed`` a whole number >= 0 and ``options`` a mapping of option names (or None), else a ValueError."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if options is not None and not isinstance(options, Mapping):
        raise ValueError(
            f"options must be a mapping of option names to values (e.g. {{'max_moves': 4}}), got {type(options).__name__}"
        )


def _baseline(problem: Problem) -> tuple[Placement, SolveReport]:
    """Step 1: the baseline solver with its default options on ``problem.load [L, E]``."""
    return SOLVERS[BASELINE].run(problem, make_options(BASELINE))


def _gate_objective(
    name: str, spec: SolverSpec, problem: Problem, placement: Placement, baseline: Placement, notes: list
) -> tuple[Placement, bool]:
    """Step 3: a gated solver's even-split peak (summed over layers, on ``problem.load [L, E]``) no
    higher than the baseline's, else the baseline (with ``fallback_from`` in its provenance)."""
    if not spec.gated or placement is baseline:
        return placement, False
    peak_new = expected_gpu_load(placement, problem.load).max(axis=1).sum()
    peak_base = expected_gpu_load(baseline, problem.load).max(axis=1).sum()
    if peak_new > peak_base * (1 + 1e-9):
        notes.append(f"{name} placed worse than {BASELINE} on the fitted load: {BASELINE} kept")
        return baseline.with_provenance(fallback_from=name), True
    return placement, False


def _routed(trace: RoutingTrace | None) -> bool:
    """The trace says which rank each token (or window) comes from."""
    return trace is not None and (trace.has_tokens or trace.window_counts is not None)


def _fit(
    spec: SolverSpec, problem: Problem, placement: Placement, o: FitOptions, notes: list
) -> tuple[Placement, DispatchFit | None]:
    """Step 4: under a dispatch model with a fixed per-rank table, a fittable solver's replicas moved
    for it (from the trace's source ranks, else the counts split evenly over the ranks); under one
    that splits each step's counts, its slots re-chosen for per-step balance (:func:`_fit_steps`)."""
    model = get_dispatch(problem.dispatch)
    if o.enabled and spec.fittable and model.needs_step_counts:
        return _fit_steps(problem, placement, o, notes)
    if not (o.enabled and spec.fittable and model.table):
        return placement, None
    if _routed(problem.trace):
        placement, fit = fit_for_dispatch(
            placement,
            problem.trace,
            problem.dispatch,
            problem.source_ranks,
            num_groups=problem.num_groups,
            options=TableFitOptions(steps=o.steps, seed=o.seed, dealings=o.dealings, noise_z=o.noise_z),
        )
    else:
        placement, fit = fit_for_dispatch_load(
            placement,
            problem.load,
            problem.dispatch,
            steps=o.steps,
            seed=o.seed,
            num_groups=problem.num_groups,
        )
    notes.append(fit.note())
    return placement, fit


def _fit_steps(
    problem: Problem, placement: Placement, o: FitOptions, notes: list
) -> tuple[Placement, StepFit | None]:
    """Step 4 for a per-step model: :func:`solver.step.fit.fit_for_steps` on the fit trace's tokens."""
    if problem.trace is None or not problem.trace.has_tokens:
        notes.append(f"{problem.dispatch}: no per-token trace, so no steps to place for: replicas kept")
        return placement, None
    trace = problem.trace
    cost = step_cost_for(trace, o.phase, problem.topology.gpus_per_node, o.model, o.hardware)
    if cost is None:
        notes.append(
            f"no built-in model has {trace.num_logical_experts} experts, top-{trace.top_k}: the {o.phase} fit "
            "balances the step peak only (pass --model to price the steps)"
        )
    options = StepFitOptions(
        step_tokens=o.phase_step_tokens,
        moves=o.step_moves,
        seed=o.seed,
        phase=o.phase,
        cost=cost,
        time_limit=o.time_limit,
    )
    placement, fit = fit_for_steps(placement, trace, problem.dispatch, options)
    notes.append(fit.note())
    return placement, fit


def _rank_counts(problem: Problem) -> np.ndarray:
    """Tokens per (source rank, expert) ``[L, G, E]`` the fit placed for."""
    G = problem.topology.ep_size
    if _routed(problem.trace):
        return rank_expert_counts(problem.trace, G, problem.source_ranks)
    return even_rank_counts(problem.load, G)


def _gate_dispatch(
    name: str,
    spec: SolverSpec,
    problem: Problem,
    fit: DispatchFit | StepFit | None,
    placement: Placement,
    baseline: Placement,
    notes: list,
) -> tuple[Placement, bool]:
    """Step 5: after a fit, a gated solver's peak under the table (summed over layers) no higher than
    the baseline's on the same tokens per (rank, expert), else the baseline."""
    if fit is None or not spec.gated:
        return placement, False
    dispatch = problem.dispatch
    if isinstance(fit, StepFit):  # per-step model: modelled time (or step peak) on the validation steps
        a, b = placement.physical_to_logical_map, baseline.physical_to_logical_map
        differ = [l for l in range(a.shape[0]) if not np.array_equal(a[l], b[l])]  # the others score alike
        peak = lambda pl: fit.score(pl, differ)  # noqa: E731
    else:
        counts = _rank_counts(problem)  # [L, G, E]
        peak = lambda pl: rank_gpu_load(pl, counts, dispatch).max(axis=1).sum()  # noqa: E731
    if peak(placement) > peak(baseline) * (1 + 1e-9):
        notes.append(
            f"{name} placed worse than {BASELINE} under {dispatch} on the fit trace: {BASELINE} kept"
        )
        return baseline.with_provenance(fallback_from=name, dispatch=dispatch), True
    return placement, False


@refuse_unknown_keywords(fix="a solver's own options go in options={...}, e.g. options={'max_moves': 4}")
def solve(
    name: str,
    *,
    topology: Topology,
    load: np.ndarray | None = None,
    trace: RoutingTrace | None = None,
    dispatch: str | DispatchModel = EVEN.name,
    source_ranks: str | None = None,
    num_groups: int | None = None,
    layer_ids: Sequence[int] | None = None,
    previous: Placement | None = None,
    time_limit: float = 10.0,
    seed: int = 0,
    options: Mapping[str, Any] | None = None,
    fit: FitOptions | None = None,
    failure_domain: str | None = None,
    failure_max_par_increase: float | None = DEFAULT_MAX_PAR_INCREASE,
) -> SolveResult:
    """The pipeline (:func:`run`) with solver ``name`` on a load ``[L, E]`` (or a trace, whose counts
    are the load), placed for ``dispatch`` (a name in :data:`placement.dispatch.DISPATCH`).

    ``source_ranks``: where ``dispatch`` needs them, how the trace's tokens map to ranks (a
    ``--source-ranks`` spec; None: the trace's own, else prompts round-robin; without per-token or
    per-window routing the counts are split evenly over the ranks). ``options`` carries
    solver-specific keywords (the fields of its options class, e.g. ``objective``, ``robust``,
    ``weighted``, ``balance_slack``, ``max_moves``); unknown keys raise ValueError. ``fit``: the fit
    step's options (e.g. ``step_tokens`` for a per-step model), default :class:`FitOptions`.
    ``time_limit`` (seconds, checked whatever the solver) bounds the solver where it has a limit, and
    the per-step fit unless ``fit`` sets its own. A ``load`` given with a ``trace`` must be the trace's
    counts (the solver places the load, the fit uses the trace's tokens: two different inputs would be
    placed for one and fitted for the other). ``failure_domain`` (``gpu`` or ``node``): the hottest
    experts get copies in two such domains, at most ``failure_max_par_increase`` more PAR per layer
    than without (None: no cap); the result's ``failure`` says what is protected and what it cost. An
    unknown keyword raises ValueError naming the accepted ones.
    """
    _check_solve_args(seed, options)
    check_time_limit(time_limit)
    if fit is None or (isinstance(fit, FitOptions) and fit.time_limit is None):
        fit = replace(fit or FitOptions(), time_limit=time_limit)
    problem = Problem.build(
        topology,
        load=load,
        trace=trace,
        layer_ids=layer_ids,
        num_groups=num_groups,
        previous=previous,
        dispatch=dispatch,
        source_ranks=source_ranks,
        failure_domain=failure_domain,
        failure_max_par_increase=failure_max_par_increase,
    )
    if not float(problem.load.sum()) > 0:
        L, E = problem.load.shape
        raise ValueError(
            f"every expert load is 0 (all {L} layers x {E} experts): nothing is routed, so there is no balance "
            f"to place for; pass a load or trace with routed tokens"
        )
    return run(name, problem, make_options(name, options, seed=seed, time_limit=time_limit), fit)
