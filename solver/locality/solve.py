"""The locality solver's entry: check the input, cut the trace to the layers, run one method.

:func:`solve_locality` and :func:`run_locality` (the registry's entry, :mod:`solver.api`) both take a
:class:`~solver.locality.options.LocalityOptions`. ``method="replicated"``
with the ``local`` dispatch model runs :func:`solver.locality.fit.solve_replicated`, anything else
:func:`solver.locality.grouped.solve_grouped`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from placement.dispatch import dispatch_names, get_dispatch
from placement.model import Placement
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.locality.fit import solve_replicated
from solver.locality.grouped import solve_grouped
from solver.locality.options import LocalityOptions
from solver.problem import Problem
from solver.report import SolveReport

__all__ = ["run_locality", "solve_locality"]


def solve_locality(
    trace: RoutingTrace,
    topology: Topology,
    options: LocalityOptions | None = None,
    *,
    layer_ids: Sequence[int] | None = None,
) -> tuple[Placement, SolveReport]:
    """Communication-aware placement fitted on a per-token trace.

    Args:
        trace: per-token routing (``topk_ids [T, L, k]``); its ``source_rank`` is used when present,
            else prompts (or tokens) round-robin over the ``G`` attention-DP ranks (see report notes).
        topology: ``P`` slots over ``G`` GPUs over ``N`` nodes.
        options: how to search (:class:`LocalityOptions`, every field documented there; default
            ``LocalityOptions()``).
        layer_ids: the trace's layer ids to solve (default all).

    Returns:
        (Placement, SolveReport). Per layer: ``objective`` = fitted expected remote nodes per token,
        ``baseline_objective`` = the same for the greedy placement (``grouped``), ``bound`` = 0 (no useful
        bound); ``extra`` has the search's counters (``replicated``: partition, role trades, packing and
        repair; ``grouped``: heuristic start, node-load ratio, CP-SAT status and pair objectives).
    """
    return _solve(trace, topology, layer_ids, options if options is not None else LocalityOptions())


def run_locality(problem: Problem, options: LocalityOptions) -> tuple[Placement, SolveReport]:
    """The registry's entry (:mod:`solver.api`): :func:`solve_locality` on ``problem.trace`` (which
    must hold per-token picks) and ``problem.layer_ids``; ``problem.load`` is not used."""
    return _solve(problem.trace, problem.topology, problem.layer_id_list, options)


def _solve(
    trace: RoutingTrace, topology: Topology, layer_ids: Sequence[int] | None, options: LocalityOptions
) -> tuple[Placement, SolveReport]:
    """Check the input -> cut the trace to ``layer_ids`` -> the ``replicated`` or ``grouped`` method."""
    o = options
    t0 = time.perf_counter()
    _validate(trace, topology, o.balance_slack, o.dispatch, o.num_redundant)
    if o.comm_weight is not None and not (o.comm_weight > 0):
        raise ValueError(
            f"comm_weight must be > 0 (or None for a hard balance cap only), got {o.comm_weight}"
        )
    if layer_ids is not None:
        want = [int(x) for x in layer_ids]
        missing = [x for x in want if x not in trace.layer_ids]
        if missing:
            raise ValueError(f"layer ids {missing} are not in the trace (it has {list(trace.layer_ids)})")
        trace = trace.select_layers([trace.layer_ids.index(x) for x in want])
    if o.method not in ("replicated", "grouped"):
        raise ValueError(f"method must be 'replicated' or 'grouped', got {o.method!r}")
    if o.work_limit is not None and not (o.method == "replicated" and get_dispatch(o.dispatch).local_first):
        raise ValueError(
            f"work_limit applies to method='replicated' with dispatch='local' only (got method={o.method!r}, "
            f"dispatch={o.dispatch!r}); use time_limit"
        )
    if o.method == "replicated" and get_dispatch(o.dispatch).local_first:
        return solve_replicated(trace, topology, o, t0)
    return solve_grouped(trace, topology, o, t0)


def _validate(
    trace: RoutingTrace, topology: Topology, balance_slack: float, dispatch: str, num_redundant
) -> None:
    if not isinstance(trace, RoutingTrace) or not trace.has_tokens:
        raise ValueError("the locality solver needs a per-token RoutingTrace (topk_ids), not counts only")
    E, P, G = trace.num_logical_experts, topology.num_physical_experts, topology.ep_size
    if E > P:
        raise ValueError(f"{E} logical experts do not fit in {P} physical slots; add {E - P} or more slots")
    if topology.slots_per_gpu > E:
        raise ValueError(
            f"{topology.slots_per_gpu} slots per GPU exceed the {E} experts; use at most {E * G - E} redundant experts"
        )
    if num_redundant is not None and int(num_redundant) != P - E:
        raise ValueError(
            f"num_redundant={num_redundant} disagrees with the topology ({P} slots - {E} experts = {P - E}); "
            f"build the topology with Topology.from_redundant({E}, {num_redundant}, ep_size, num_nodes)"
        )
    if not (0.0 <= balance_slack <= 10.0) or not np.isfinite(balance_slack):
        raise ValueError(
            f"balance_slack must be in [0, 10] (0.02 = node loads within 2% of the mean), got {balance_slack}"
        )
    fits = dispatch_names(locality_fit=True)  # the models whose node loads the solver can model
    if dispatch not in fits:
        raise ValueError(f"dispatch must be {' or '.join(map(repr, fits))}, got {dispatch!r}")
