"""A direct locality call's budget bounds the whole call, not each layer (issue 36): the per-layer
floors (one step of each search, CP-SAT's shortest limit per node) no longer add up over many layers."""

from __future__ import annotations

import time

import pytest

from placement.topology import Topology
from profiling.synthetic import synthetic_trace
from solver.locality import LocalityOptions, solve_locality
from solver.locality.fit import _CallBudget, _layer_budgets


def _handed_out(b, N: int) -> int:
    return b[0].work + N * b[1].work + b[2].work


@pytest.mark.parametrize(("L", "work", "N"), [(64, 64, 2), (200, 50, 4), (10, 10_000, 2)])
def test_work_limit_bounds_the_whole_call(L, work, N):
    call = _CallBudget(10.0, work, L, N, time.perf_counter())
    total = sum(_handed_out(call.layer(l), N) for l in range(L))
    assert total <= work
    per_layer = _handed_out(_layer_budgets(10.0, work, L, N), N)
    if per_layer * L <= work:  # no floor binds: every layer gets its even share, as before
        assert total == per_layer * L


@pytest.mark.parametrize("method", ["replicated", "grouped"])
def test_time_limit_bounds_the_whole_call(method):
    """48 layers at a 1 s limit took 8-10 s before (CP-SAT's 0.05 s floor per layer and node)."""
    trace = synthetic_trace(num_tokens=400, num_layers=48, num_logical_experts=16, top_k=2)
    topo = Topology.from_redundant(16, 8, 8, 2)
    dispatch = "local" if method == "replicated" else "even"
    solve_locality(
        trace.select_layers([0]), topo, LocalityOptions(time_limit=1.0, method=method, dispatch=dispatch)
    )
    t0 = time.perf_counter()
    pl, _ = solve_locality(trace, topo, LocalityOptions(time_limit=1.0, method=method, dispatch=dispatch))
    wall = time.perf_counter() - t0
    assert pl.num_layers == 48
    assert wall <= 2.5 * 1.0, wall  # the limit plus the fit and each layer's start (no search)
