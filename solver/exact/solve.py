"""The exact solver's entry points: :func:`solve_exact` (keywords), :func:`run_exact` (the registry's).

Pipeline: check the input -> one of (placement for weighted dispatch | noise gate over an inner solve |
validation guard over inner solves | the plain solve). The plain solve: greedy start -> every layer
(:func:`solver.exact.per_layer._solve_layer`, in parallel) -> placement and report.

Shapes: ``L`` layers, ``E`` experts, ``G`` GPUs with ``S`` slots, ``P = G * S``, ``N`` nodes, ``W`` windows.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np

from moe_placement.base.limits import MAX_SEARCH_SAMPLES, check_memory
from moe_placement.base.options import options_or_fields
from placement.model import Placement
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.budget import check_time_limit
from solver.exact.common import LoadOrTrace, _as_windows, _parse_robust
from solver.exact.costs import DecodeCost, _max_replicas, count_lower_bound
from solver.exact.gate import _gate_noise_source, _gate_prepare, _noise_gate
from solver.exact.guard import _validation_guard, _validation_split
from solver.exact.options import ExactOptions
from solver.exact.per_layer import _Setup, _solve_layer, greedy_layer
from solver.greedy import greedy_placement
from solver.problem import Problem
from solver.report import LayerReport, SolveReport
from solver.search import interrupt_solves as _interrupt_solves
from solver.search import reset_interrupt as _reset_interrupt
from solver.weighted import solve_weighted

__all__ = ["ExactOptions", "run_exact", "solve_exact"]


def solve_exact(
    load_or_trace: LoadOrTrace,
    topology: Topology,
    options: ExactOptions | None = None,
    *,
    num_groups: int | None = None,
    layer_ids: Sequence[int] | None = None,
    **fields: Any,
) -> tuple[Placement, SolveReport]:
    """Joint replica counts and placement per layer, with proven bounds.

    Args:
        load_or_trace: ``[L, E]`` loads, ``[W, L, E]`` windows, or a :class:`RoutingTrace`.
        topology: ``P`` slots over ``G`` GPUs over ``N`` nodes.
        options: how the search runs (:class:`ExactOptions`, documented field by field there); or
            its fields as keywords (``backend="milp", time_limit=30.0``), not both.
        num_groups: expert groups (kept inside nodes with ``node_constraint``).
        layer_ids: the model's layer index of each row (default: the trace's, else ``0..L-1``).

    Returns:
        (Placement, SolveReport). Layer ``objective`` is the peak GPU load in tokens with even split on the
        aggregate load; ``bound`` a proven lower bound on it; ``baseline_objective`` greedy's peak.
        ``extra`` holds ``model_objective`` / ``model_baseline`` (the optimised objective: decode us, or
        robust window PAR), ``counts_changed``, ``restricted``, ``replica_shares`` and ``weighted_objective``.

    Raises:
        ValueError: both ``options`` and keywords, a keyword that is not a field of :class:`ExactOptions`,
            or a bad input (one line naming it).
    """
    return _solve(
        load_or_trace,
        topology,
        options_or_fields(ExactOptions, options, fields, "solve_exact"),
        num_groups,
        layer_ids,
    )


def run_exact(problem: Problem, options: ExactOptions) -> tuple[Placement, SolveReport]:
    """The registry's entry (:mod:`solver.api`): the problem's trace when it has one (the noise gate
    needs its windows), else its load."""
    data = problem.trace if problem.trace is not None else problem.load
    return _solve(data, problem.topology, options, problem.num_groups, problem.layer_id_list)


def _solve(
    load_or_trace: LoadOrTrace,
    topology: Topology,
    options: ExactOptions,
    num_groups: int | None,
    layer_ids: Sequence[int] | None,
    deadline: float | None = None,
) -> tuple[Placement, SolveReport]:
    """Check the input, then solve for weighted dispatch, through the noise gate or the validation
    guard (each over inner plain solves), or plainly. ``deadline``: a wall-clock end (``perf_counter``)
    earlier than ``time_limit`` gives (an outer step's reserve)."""
    t_start = time.perf_counter()
    agg, wins, robust_m, top_k, layer_ids = _check_inputs(load_or_trace, topology, options, layer_ids)
    if options.weighted is True:
        return _solve_for_weighted_dispatch(agg, wins, topology, options, layer_ids)
    inner = replace(options, validation=0, noise_gate=None)
    guard = _validation_split(load_or_trace, options.validation, options.seed)
    gate = (
        None
        if guard is not None
        else _gate_noise_source(
            load_or_trace,
            options.noise_gate,
            options.robust,
            options.node_constraint,
            options.objective,
            options.weighted,
        )
    )
    if gate is not None:
        noise_k = options.noise_k
        if not (np.isfinite(noise_k) and noise_k >= 0):
            raise ValueError(f"noise_k must be a finite number >= 0 (sigmas per moved slot), got {noise_k!r}")
        inner = replace(inner, time_limit=0.85 * options.time_limit)
        # the gate's greedy start and noise first: their time comes out of the wall before the layers'
        prepared = _gate_prepare(load_or_trace, topology, gate, options.seed, layer_ids)
        pl, rep = _solve(
            load_or_trace, topology, inner, num_groups, layer_ids, deadline=t_start + inner.time_limit
        )
        return _noise_gate(load_or_trace, topology, (pl, rep), gate, options, t_start, prepared)
    if guard is not None:
        return _validation_guard(
            load_or_trace, topology, guard, inner, num_groups, layer_ids, t_start, _solve
        )
    checked = _Checked(agg, wins, robust_m, top_k)
    return _solve_plain(checked, topology, options, num_groups, layer_ids, t_start, deadline)


def _check_inputs(
    load_or_trace: LoadOrTrace, topology: Topology, options: ExactOptions, layer_ids: Sequence[int] | None
) -> tuple[np.ndarray, np.ndarray, int, int | None, Sequence[int] | None]:
    """Validate the options and the load; returns ``(agg [L, E], windows [W, L, E], robust_m, top_k,
    layer_ids)`` (the trace's layer ids when none are given)."""
    if options.backend not in ("cpsat", "milp"):
        raise ValueError(f"unknown backend {options.backend!r}; use 'cpsat' or 'milp'")
    if options.objective not in ("tokens", "decode"):
        raise ValueError(f"unknown objective {options.objective!r}; use 'tokens' or 'decode'")
    check_time_limit(options.time_limit)  # finite and bounded: the solve's hard wall
    _check_num_windows(load_or_trace, options)
    agg, wins, trace_layers, top_k = _as_windows(load_or_trace, options.robust, options.num_windows)
    robust_m = _parse_robust(options.robust, wins.shape[0])
    if not np.all(np.isfinite(wins)) or wins.min(initial=0) < 0:
        raise ValueError("load must be finite and >= 0 (found NaN, inf or a negative count)")
    if agg.shape[0] < 1 or agg.shape[1] < 1:
        raise ValueError(f"the load has shape {agg.shape}: it needs at least one layer and one expert")
    E = agg.shape[1]
    G, P, S = topology.ep_size, topology.num_physical_experts, topology.slots_per_gpu
    if layer_ids is None:
        layer_ids = trace_layers
    if E > P:
        raise ValueError(f"{E} logical experts do not fit in {P} physical slots; add {E - P} or more slots")
    if S > E:
        raise ValueError(
            f"{S} slots per GPU exceed the {E} experts; use at most {E * G - E} redundant experts"
        )
    if options.weighted not in (False, True, "shares"):
        raise ValueError(f"weighted must be False, True or 'shares', got {options.weighted!r}")
    return agg, wins, robust_m, top_k, layer_ids


def _check_num_windows(load_or_trace: LoadOrTrace, options: ExactOptions) -> None:
    """``num_windows`` an integer in ``1..MAX_SEARCH_SAMPLES`` whose ``[W, L, E]`` windows (a robust
    fit on a trace builds them) fit in memory, checked before they are built."""
    W = options.num_windows
    if isinstance(W, bool) or not isinstance(W, (int, np.integer)) or not 1 <= W <= MAX_SEARCH_SAMPLES:
        raise ValueError(
            f"num_windows is {W!r}; accepted: an integer in 1..{MAX_SEARCH_SAMPLES} (MAX_SEARCH_SAMPLES)"
        )
    if options.robust and isinstance(load_or_trace, RoutingTrace):
        L, E = load_or_trace.num_layers, load_or_trace.num_logical_experts
        check_memory(2 * 8.0 * W * L * E, f"num_windows={W} windows of {L} x {E} loads", "use fewer windows")


def _solve_for_weighted_dispatch(
    agg: np.ndarray,
    wins: np.ndarray,
    topology: Topology,
    options: ExactOptions,
    layer_ids: Sequence[int] | None,
) -> tuple[Placement, SolveReport]:
    """``weighted=True``: the placement chosen for weighted dispatch (:func:`solver.weighted.solve_weighted`)."""
    if options.node_constraint or options.objective != "tokens":
        raise ValueError(
            "weighted=True (placement for weighted dispatch) supports objective='tokens' without "
            "node_constraint; use weighted='shares' for LP shares on the even-split optimum"
        )
    w_pl, _, w_rep = solve_weighted(
        agg,
        topology,
        windows=wins if options.robust else None,
        layer_ids=layer_ids,
        hint=options.hint,
        seed=options.seed,
        time_limit=options.time_limit,
    )
    params = {
        "backend": "weighted",
        "seed": options.seed,
        "time_limit": options.time_limit,
        "weighted": True,
        "robust": options.robust,
    }
    return w_pl.with_provenance(**params), replace(w_rep, params=params)


class _Checked(NamedTuple):
    """The checked load: ``agg [L, E]``, ``wins [W, L, E]``, the robust window count and the trace's top-k."""

    agg: np.ndarray
    wins: np.ndarray
    robust_m: int
    top_k: int | None


def _solve_plain(
    checked: _Checked,
    topology: Topology,
    options: ExactOptions,
    num_groups: int | None,
    layer_ids: Sequence[int] | None,
    t_start: float,
    deadline: float | None = None,
) -> tuple[Placement, SolveReport]:
    """The plain solve: greedy start -> every layer (on ``workers`` threads) -> placement and report."""
    agg, wins, robust_m, top_k = checked
    L, E = agg.shape
    G, P, N = topology.ep_size, topology.num_physical_experts, topology.num_nodes
    decode = _decode_cost(options, top_k)
    greedy_mode = _greedy_mode(options.node_constraint, num_groups, E, N)
    g_pl, _ = greedy_placement(agg, topology, num_groups, mode=greedy_mode, layer_ids=layer_ids)
    greedy_map = g_pl.physical_to_logical_map
    hint_map = _hint_map(options.hint, greedy_map, E)
    rmax = _max_replicas(E, G, P)
    workers = _worker_count(options.workers, L)
    # deterministic: the budget comes from time_limit alone (nothing wall-clock-derived reaches the
    # solves or the provenance); otherwise what the setup left of it
    budget = (
        options.time_limit if options.deterministic else options.time_limit - (time.perf_counter() - t_start)
    )
    ctx = _Setup(
        options=options,
        topology=topology,
        agg=agg,
        wnorm=_normalised_windows(wins, robust_m, G),
        greedy_map=greedy_map,
        hint_map=hint_map,
        decode=decode,
        rmax=rmax,
        robust_m=robust_m,
        group_of_expert=np.arange(E) // (E // num_groups) if options.node_constraint else None,
        groups_per_node=(num_groups // N) if options.node_constraint else 0,
        per_layer=max(0.05, budget * workers / L * 0.85),
        deadline=min(t_start + options.time_limit, deadline or np.inf),
        ls_iters=int(options.local_search_iters if options.local_search_iters is not None else 20 * G),
        cb_agg=count_lower_bound(agg, G, P),
        layer_ids=layer_ids,
        notes=[],
        lock=threading.Lock(),
    )
    if L:  # one greedy report timed: the deadline's reserve per layer not yet begun
        t0 = time.perf_counter()
        greedy_layer(ctx, 0, t0)
        ctx.skip_cost[:] = [time.perf_counter() - t0, 1]
    _reset_interrupt()
    if workers == 1:
        results = [_solve_layer(ctx, l) for l in range(L)]
    else:
        with ThreadPoolExecutor(max_workers=workers) as ex:
            try:
                results = list(ex.map(lambda l: _solve_layer(ctx, l), range(L)))
            except KeyboardInterrupt:  # stop the running searches; the pool then winds down at once
                _interrupt_solves()
                raise
    return _plain_result(ctx, results, wins, workers, greedy_mode, num_groups, t_start)


def _decode_cost(options: ExactOptions, top_k: int | None) -> DecodeCost | None:
    """The decode cost model (``objective="decode"``) with the options' overrides, else None."""
    decode = (
        DecodeCost.build(options.expert_bytes, options.hardware, top_k)
        if options.objective == "decode"
        else None
    )
    if decode is not None and options.step_tokens is not None:
        decode = replace(decode, step_tokens=float(options.step_tokens))
    return decode


def _greedy_mode(node_constraint: bool, num_groups: int | None, E: int, N: int) -> str:
    """Greedy's mode for the start: hierarchical under the node constraint (groups must divide)."""
    if node_constraint:
        if not num_groups or E % num_groups or num_groups % N:
            raise ValueError(
                f"node_constraint needs num_groups dividing the {E} experts and divisible by num_nodes={N}, got num_groups={num_groups}"
            )
        return "hierarchical"
    return "global"


def _hint_map(hint: Placement | None, greedy_map: np.ndarray, E: int) -> np.ndarray | None:
    """The hint's map ``[L, P]`` (checked against greedy's shape), or None."""
    if hint is None:
        return None
    if hint.physical_to_logical_map.shape != greedy_map.shape or hint.num_logical_experts != E:
        raise ValueError(
            f"hint placement has map shape {hint.physical_to_logical_map.shape}, expected {greedy_map.shape}"
        )
    return hint.physical_to_logical_map


def _worker_count(workers: int | None, L: int) -> int:
    """Threads for the layers: ``workers`` (1..1024) or the usable CPUs, at most one per layer."""
    if workers is not None and (
        isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or not 1 <= workers <= 1024
    ):
        raise ValueError(
            f"workers is {workers!r}; accepted: an integer in 1..1024 threads, or None for the CPUs"
        )
    workers = int(
        workers
        or max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    )
    return max(1, min(workers, L))


def _normalised_windows(wins: np.ndarray, robust_m: int, G: int) -> np.ndarray:
    """``wins [W, L, E]`` normalised to mean 1 per GPU in every window (robust or several windows),
    else as they are (plain tokens)."""
    if robust_m > 1 or wins.shape[0] > 1:
        means = wins.sum(axis=2) / G  # [W, L]
        return wins / np.where(means > 0, means, 1.0)[:, :, None]
    return wins


def _out_of_time_note(time_limit: float, skipped: int, L: int) -> str:
    return (
        f"time limit {time_limit:g} s reached: {skipped} of {L} layers kept their start (greedy or local "
        f"search) without the exact search; raise time_limit for those layers to be searched"
    )


def _plain_result(
    ctx: _Setup,
    results: list[tuple[np.ndarray, LayerReport]],
    wins: np.ndarray,
    workers: int,
    greedy_mode: str,
    num_groups: int | None,
    t_start: float,
) -> tuple[Placement, SolveReport]:
    """The placement ``[L, P]`` of the layers' maps and the solve's report with its parameters."""
    opt = ctx.options
    phy2log = np.stack([r[0] for r in results])
    if ctx.out_of_time:
        ctx.notes.append(_out_of_time_note(opt.time_limit, len(ctx.out_of_time), len(results)))
    params = {
        "backend": opt.backend,
        "seed": opt.seed,
        "time_limit": opt.time_limit,
        "objective": opt.objective,
        "robust": opt.robust,
        "num_windows": int(wins.shape[0]) if opt.robust else 1,
        "weighted": opt.weighted,
        "workers": workers,
        "deterministic": opt.deterministic,
        "node_constraint": opt.node_constraint,
        "num_groups": num_groups,
        "greedy_policy": greedy_mode,  # the file key keeps its name (docs/formats.md)
        "per_layer_limit_s": ctx.per_layer,
    }
    if ctx.decode is not None:
        params["decode_cost"] = ctx.decode.to_params()
    placement = Placement(
        phy2log,
        ctx.agg.shape[1],
        ctx.topology,
        tuple(ctx.layer_ids or ()),
        {"solver": opt.backend, **{k: v for k, v in params.items() if k != "decode_cost"}},
    )
    report = SolveReport(
        solver=opt.backend,
        layers=tuple(r[1] for r in results),
        wall_time_s=time.perf_counter() - t_start,
        params=params,
        notes=tuple(sorted(ctx.notes)),
    )
    return placement, report
