"""One registry of solvers by name, used by the CLI, the benchmarks, the rebalancer and the plugins.

Every solver is ``run(problem: Problem, options: <Solver>Options) -> (Placement, SolveReport)``.
The registry names the module, the options class and the function, and imports them only when a
solver is used, so importing this module stays cheap (no ortools, no networkx).

Adding a solver: write ``<Name>Options`` (a frozen dataclass) and ``run_<name>`` in its module, then
add one :class:`SolverSpec` line to :data:`SOLVERS`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from placement.model import Placement
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.problem import Problem, options_from
from solver.report import SolveReport

__all__ = ["SOLVERS", "SolverSpec", "make_options", "run", "solve"]


@dataclass(frozen=True)
class SolverSpec:
    """Where a solver lives and what it needs.

    ``fixed`` options are set by the name (``cpsat`` and ``milp`` are one solver with two backends);
    ``needs`` is ``"tokens"`` (a per-token trace), ``"previous"`` (the placement in service) or empty.
    """

    module: str
    options: str
    run: str
    needs: str = ""
    fixed: Mapping[str, Any] = field(default_factory=dict)

    def load(self) -> tuple[type, Any]:
        mod = importlib.import_module(self.module)
        return getattr(mod, self.options), getattr(mod, self.run)


SOLVERS: dict[str, SolverSpec] = {
    "greedy": SolverSpec("solver.greedy", "GreedyOptions", "run_greedy"),
    "cpsat": SolverSpec("solver.exact", "ExactOptions", "run_exact", fixed={"backend": "cpsat"}),
    "milp": SolverSpec("solver.exact", "ExactOptions", "run_exact", fixed={"backend": "milp"}),
    "locality": SolverSpec("solver.locality", "LocalityOptions", "run_locality", needs="tokens"),
    "migration": SolverSpec("solver.migration", "MigrationOptions", "run_migration", needs="previous"),
}

_NEEDS = {
    "tokens": "the {name} solver needs a per-token trace (topk_ids), not counts only",
    "previous": "the {name} solver needs the current placement (--previous)",
}


def _spec(name: str) -> SolverSpec:
    if name not in SOLVERS:
        raise ValueError(f"unknown solver {name!r}; choose one of {tuple(SOLVERS)}")
    return SOLVERS[name]


def make_options(name: str, values: Mapping[str, Any] | None = None, **common: Any) -> Any:
    """Solver ``name``'s frozen options from ``values``; ``common`` keys (``seed``, ``time_limit``)
    are used only where the solver has such an option. Unknown keys raise ValueError."""
    spec = _spec(name)
    cls, _ = spec.load()
    known = {f.name for f in fields(cls)}
    merged = {k: v for k, v in common.items() if k in known}
    merged.update(values or {})
    merged.update(spec.fixed)
    return options_from(cls, name, merged)


def run(name: str, problem: Problem, options: Any = None) -> tuple[Placement, SolveReport]:
    """Run solver ``name`` on ``problem`` (``options``: its options object, default: its defaults)."""
    spec = _spec(name)
    if spec.needs == "tokens" and (problem.trace is None or not problem.trace.has_tokens):
        raise ValueError(_NEEDS["tokens"].format(name=name))
    if spec.needs == "previous" and problem.previous is None:
        raise ValueError(_NEEDS["previous"].format(name=name))
    _, fn = spec.load()
    return fn(problem, options if options is not None else make_options(name))


def solve(
    name: str,
    *,
    topology: Topology,
    load: np.ndarray | None = None,
    trace: RoutingTrace | None = None,
    num_groups: int | None = None,
    layer_ids: Sequence[int] | None = None,
    previous: Placement | None = None,
    time_limit: float = 10.0,
    seed: int = 0,
    options: Mapping[str, Any] | None = None,
) -> tuple[Placement, SolveReport]:
    """Run solver ``name`` on a load ``[L, E]`` (or a trace, whose counts are the load).

    ``options`` carries solver-specific keywords (the fields of its options class, e.g. ``objective``,
    ``robust``, ``weighted``, ``balance_slack``, ``max_moves``); unknown keys raise ValueError.
    """
    problem = Problem.build(
        topology, load=load, trace=trace, layer_ids=layer_ids, num_groups=num_groups, previous=previous
    )
    return run(name, problem, make_options(name, options, seed=seed, time_limit=time_limit))
