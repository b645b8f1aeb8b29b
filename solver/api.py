"""One entry point for every solver, used by the CLI, the benchmarks and the rebalancer.

Heavy solver stacks (ortools, networkx) are imported lazily inside each branch, so importing this
module stays cheap.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from placement.model import Placement
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.report import SolveReport

__all__ = ["SOLVERS", "solve"]

SOLVERS = ("greedy", "cpsat", "milp", "locality", "migration")


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
    options: dict[str, Any] | None = None,
) -> tuple[Placement, SolveReport]:
    """Run solver ``name`` on a load ``[L, E]`` (or a trace, whose counts are the load).

    ``options`` carries solver-specific keywords (e.g. ``objective``, ``robust``, ``weighted``,
    ``balance_slack``, ``max_moves``, ``move_cost``); unknown keys raise ValueError in the solver.
    """
    opts = dict(options or {})
    if load is None:
        if trace is None:
            raise ValueError("solve needs a load [layers, experts] or a trace")
        load = trace.counts()
        if layer_ids is None:
            layer_ids = trace.layer_ids
    load = np.asarray(load, dtype=np.float64)
    if name == "greedy":
        from solver.greedy import greedy_placement

        policy = opts.pop("greedy_policy", "auto")
        if opts:
            raise ValueError(f"greedy takes no options {sorted(opts)}")
        return greedy_placement(load, topology, num_groups, policy=policy, layer_ids=layer_ids)
    if name in ("cpsat", "milp"):
        from solver.exact import solve_exact

        # the trace (not only its counts) lets the solver see window-to-window noise (noise gate, robust fit)
        return solve_exact(
            load if trace is None else trace,
            topology,
            backend=name,
            num_groups=num_groups,
            layer_ids=layer_ids,
            time_limit=time_limit,
            seed=seed,
            **opts,
        )
    if name == "locality":
        from solver.locality import solve_locality

        if trace is None or not trace.has_tokens:
            raise ValueError("the locality solver needs a per-token trace (topk_ids), not counts only")
        return solve_locality(trace, topology, time_limit=time_limit, seed=seed, **opts)
    if name == "migration":
        from solver.migration import solve_migration

        if previous is None:
            raise ValueError("the migration-aware solver needs the current placement (--previous)")
        return solve_migration(load, previous, time_limit=time_limit, seed=seed, layer_ids=layer_ids, **opts)
    raise ValueError(f"unknown solver {name!r}; choose one of {SOLVERS}")
