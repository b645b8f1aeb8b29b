"""Validation guard: exact must beat greedy on data it was not fitted on.

A guard is ``(fit part, validation [L, E], how)``: the fit part is windows ``[W', L, E]`` (or loads
``[L, E]`` with binomial thinning), the validation part the held-out load.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from placement.metrics import expected_gpu_load
from placement.model import Placement
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.exact.common import LoadOrTrace, _aggregate, _refresh_shares, _with_layers
from solver.exact.options import ExactOptions
from solver.greedy import greedy_placement
from solver.report import LayerReport, SolveReport
from solver.weighted import even_split_peak

Guard = tuple[np.ndarray, np.ndarray, str]
# solve(load_or_trace, topology, options, num_groups, layer_ids): the exact solve itself
Solve = Callable[
    [LoadOrTrace, Topology, ExactOptions, "int | None", "Sequence[int] | None"], tuple[Placement, SolveReport]
]


def _validation_split(load_or_trace: LoadOrTrace, validation: float | str | None, seed: int) -> Guard | None:
    """``(fit part, validation [L, E], how)`` or None when the guard is off or has nothing to hold out.

    The fit part keeps the input's kind (windows ``[W', L, E]``) so a robust solve still sees windows.
    """
    if (
        validation is None
        or validation is False
        or (not isinstance(validation, str) and float(validation) == 0)
    ):
        return None
    if isinstance(validation, str) and validation not in ("auto", "thin"):
        raise ValueError(
            f"validation must be 'auto', 'thin', a fraction in (0, 0.5] or 0, got {validation!r}"
        )
    frac = 0.2 if isinstance(validation, str) else float(validation)
    if not 0 < frac <= 0.5:
        raise ValueError(f"validation fraction must be in (0, 0.5], got {validation}")
    if validation == "thin":
        agg = (
            load_or_trace.counts()
            if isinstance(load_or_trace, RoutingTrace)
            else np.asarray(load_or_trace, dtype=np.float64)
        )
        if agg.ndim == 3:
            agg = agg.sum(axis=0)
        if not np.all(agg == np.round(agg)):
            raise ValueError("validation='thin' needs integer token counts; pass windows or validation=0.2")
        rng = np.random.default_rng(seed)
        val = rng.binomial(np.round(agg).astype(np.int64), frac).astype(np.float64)  # [L, E]
        return agg - val, val, f"binomial thinning {frac:g}"
    if isinstance(load_or_trace, RoutingTrace):
        wins = load_or_trace.window_load().astype(np.float64)  # [W, L, E]
    else:
        arr = np.asarray(load_or_trace, dtype=np.float64)
        if arr.ndim != 3:
            return None
        wins = arr
    W = wins.shape[0]
    if W < 5:
        return None
    v = max(1, int(round(frac * W)))
    return wins[: W - v], wins[W - v :].sum(axis=0), f"last {v} of {W} windows"


def _validation_guard(
    load_or_trace: LoadOrTrace,
    topology: Topology,
    guard: Guard,
    options: ExactOptions,
    num_groups: int | None,
    layer_ids: Sequence[int] | None,
    t_start: float,
    solve: Solve,
) -> tuple[Placement, SolveReport]:
    """Fit exact and greedy on the fit part, compare them on the held-out part, then solve on everything.

    Layers where the exact placement fitted on the fit part has a higher validation peak than greedy's
    fitted on the same part keep greedy's placement fitted on all the data (status ``greedy_fallback``).
    The guard solve gets 30% of the remaining budget, the final solve the rest. ``options`` are the
    inner solves' (guard and gate off).
    """
    fit_part, val, how = guard
    time_limit = options.time_limit
    # deterministic: budgets from time_limit alone (they reach the inner solves and their provenance)
    det = options.deterministic
    left = time_limit if det else max(0.1, time_limit - (time.perf_counter() - t_start))
    fit_arg = _fit_windows(fit_part, options)
    fit_agg = fit_arg.sum(axis=0) if fit_arg.ndim == 3 else fit_arg
    mode = "hierarchical" if options.node_constraint else "global"
    g_fit, _ = greedy_placement(fit_agg, topology, num_groups, mode=mode)
    e_fit, _ = solve(fit_arg, topology, replace(options, time_limit=0.3 * left), num_groups, layer_ids)
    v_g = expected_gpu_load(g_fit, val).max(axis=1)  # [L]
    v_e = expected_gpu_load(e_fit, val).max(axis=1)
    rest = 0.7 * time_limit if det else max(0.1, time_limit - (time.perf_counter() - t_start))
    pl, rep = solve(load_or_trace, topology, replace(options, time_limit=rest), num_groups, layer_ids)
    agg = _aggregate(load_or_trace)
    g_all, _ = greedy_placement(
        agg, topology, num_groups, mode=mode, layer_ids=layer_ids or pl.layer_ids or None
    )
    rows = pl.physical_to_logical_map.copy()
    layers = []
    fallbacks = 0
    for l, lr in enumerate(rep.layers):
        lose = bool(v_e[l] > v_g[l] * (1 + 1e-9))
        info = {"how": how, "exact_peak": float(v_e[l]), "greedy_peak": float(v_g[l]), "exact_lost": lose}
        extra = {**lr.extra, "validation": info}
        if lose and not np.array_equal(rows[l], g_all.physical_to_logical_map[l]):
            fallbacks += 1
            rows[l] = g_all.physical_to_logical_map[l]
            lr = _fallback_layer(lr, rows[l], agg[l], topology, extra)
        else:
            lr = replace(lr, extra=extra)
        layers.append(lr)
    notes = list(rep.notes)
    if fallbacks:
        notes.append(
            f"validation guard ({how}): {fallbacks} of {len(layers)} layers kept greedy's placement "
            "because the exact one fitted without the held-out part was worse on it"
        )
    params = {**rep.params, "validation": how, "validation_fallbacks": fallbacks}
    return _with_layers(pl, rep, rows, layers, {"validation": how}, params, notes, t_start)


def _fit_windows(fit_part: np.ndarray, options: ExactOptions) -> np.ndarray:
    """The fit part as the solve takes it: a robust solve's windows regrouped into ``num_windows``
    windows ``[num_windows, L, E]``; otherwise as it is."""
    if options.robust and fit_part.ndim == 3 and fit_part.shape[0] != options.num_windows:
        chunks = np.array_split(np.arange(fit_part.shape[0]), min(options.num_windows, fit_part.shape[0]))
        return np.stack([fit_part[c].sum(axis=0) for c in chunks])  # [num_windows, L, E]
    return fit_part


def _fallback_layer(
    lr: LayerReport, g_row: np.ndarray, w: np.ndarray, topology: Topology, extra: dict
) -> LayerReport:
    """The layer's report with greedy's map ``g_row [P]`` (loads ``w [E]``): what exact had reached is
    kept in ``extra["fitted_objective"]``."""
    g_tok = even_split_peak(g_row, w, topology.ep_size, topology.slots_per_gpu)
    extra.update(proved_by=None, fitted_objective=lr.objective)
    _refresh_shares(extra, g_row, w, topology)
    return replace(lr, status="greedy_fallback", objective=g_tok, bound=min(lr.bound, g_tok), extra=extra)
