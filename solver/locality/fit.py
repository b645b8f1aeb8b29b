"""``method="replicated"`` of the locality solver over all layers (:func:`solver.locality.solve_locality`).

Shapes: L layers, E logical experts, P physical slots, G GPUs (EP ranks), N nodes, m GPUs per node,
T tokens, k top-k, W fit windows, V load views (the fit total, then each window when W > 1).

Steps: check the method's options -> the sources to fit with and the fit windows -> greedy's GPU peak
on every view (the GPU caps) -> everywhere experts per layer and the experts' load drift
(:mod:`solver.locality.sources`) -> one :func:`solver.locality.replicated.solve_replicated_layer` per
layer -> placement and report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from placement.dispatch import LOCAL
from placement.metrics import communication, source_ranks, trace_gpu_load
from placement.model import Placement
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.budget import Budget
from solver.greedy import greedy_placement
from solver.locality.options import LocalityOptions
from solver.locality.reach import remote_nodes_fit
from solver.locality.replicated import LayerSearch, solve_replicated_layer
from solver.locality.sources import (
    default_everywhere,
    expected_share_excess,
    fit_sources,
    load_drift,
    node_share_excess,
    window_of_tokens,
)
from solver.report import LayerReport, SolveReport

__all__ = ["solve_replicated"]


def solve_replicated(
    trace: RoutingTrace, topology: Topology, options: LocalityOptions, t0: float
) -> tuple[Placement, SolveReport]:
    """``method="replicated"`` of :func:`solver.locality.solve_locality` (dispatch ``local``), on a trace
    already cut to the layers to solve. ``t0``: ``time.perf_counter()`` when the solve began."""
    o = options
    _check_options(trace, topology, o)
    src, how = source_ranks(trace, topology.ep_size)
    share_margin = _share_margin(o.share_margin, src, topology.gpus_per_node, topology.num_nodes)
    if not (0.0 <= float(o.drift_z) <= 10.0):
        raise ValueError(
            f"drift_z must be in [0, 10] (1 = pair single-node experts at their fitted load plus one "
            f"expected drift), got {o.drift_z}"
        )
    fit = _fit_model(trace, topology, src, how, o)
    rows, reports = _solve_layers(trace, topology, fit, o, share_margin, t0)
    # recorded under its former key "policy", so placement files stay byte-identical
    params = {
        "balance_slack": o.balance_slack,
        "policy": LOCAL.name,
        "time_limit": o.time_limit,
        "seed": o.seed,
        "work_limit": o.work_limit,
        "share_margin": round(float(share_margin), 4),
        "drift_z": float(o.drift_z),
        "share_overload": float(o.share_overload),
        "share_excess": None if fit.share_excess is None else round(fit.share_excess, 4),
        "method": "replicated",
        "num_everywhere": fit.hs[0]
        if o.num_everywhere is not None
        else f"auto ({min(fit.hs)}-{max(fit.hs)}, mean {np.mean(fit.hs):.1f})",
        "num_windows": fit.W,
        "window_slack": o.window_slack,
        "gpu_slack": o.gpu_slack,
        "single_margin": o.single_margin,
        "source_model": o.source_model,
        "hidden_size": o.hidden_size,
        "source_ranks": fit.how,
    }
    placement = Placement(
        rows,
        trace.num_logical_experts,
        topology,
        trace.layer_ids,
        {"solver": "locality", **params, "trace": trace.name},
    )
    notes = _notes(placement, trace, fit, reports, o.gpu_slack, o.hidden_size)
    report = SolveReport("locality", tuple(reports), time.perf_counter() - t0, params, tuple(notes))
    return placement, report


def _check_options(trace: RoutingTrace, topology: Topology, o: LocalityOptions) -> None:
    """ValueError naming the option and its range for the first of the method's options out of range."""
    E, P, N = trace.num_logical_experts, topology.num_physical_experts, topology.num_nodes
    if not (0.0 <= o.window_slack <= 10.0):
        raise ValueError(f"window_slack must be in [0, 10], got {o.window_slack}")
    if not (-0.5 < o.gpu_slack <= 10.0):
        raise ValueError(f"gpu_slack must be in (-0.5, 10], got {o.gpu_slack}")
    if int(o.num_windows) < 1:
        raise ValueError(f"num_windows must be >= 1, got {o.num_windows}")
    if o.work_limit is not None and int(o.work_limit) < 1:
        raise ValueError(
            f"work_limit must be >= 1 search steps (or None to use time_limit), got {o.work_limit}"
        )
    h_max = (P - E) // (N - 1) if N > 1 else E
    if o.num_everywhere is not None:
        h = int(o.num_everywhere)
        if h < 0 or h > h_max:
            raise ValueError(
                f"num_everywhere={h} must be in [0, {h_max}] ({P - E} redundant slots, {N} nodes)"
            )
    if not (0.0 <= float(o.share_overload) <= 10.0):
        raise ValueError(
            f"share_overload must be in [0, 10] (0.08: the busiest node's extra token share times the "
            f"everywhere experts' load share at most 8%), got {o.share_overload}"
        )


def _share_margin(share_margin: float | None, src: np.ndarray, m: int, N: int) -> float:
    """``share_margin`` checked, or its default: the busiest node's token share under the scoring sources
    ``src`` int64 ``[T]``, over the mean, minus 1."""
    if share_margin is None:  # the busiest node's token share under the scoring sources, over the mean
        return node_share_excess(src, m, N)
    if not (0.0 <= float(share_margin) <= 10.0):
        raise ValueError(
            f"share_margin must be in [0, 10] (0.3 = pair everywhere replicas as 30% heavier), "
            f"got {share_margin}"
        )
    return share_margin


@dataclass(frozen=True)
class _FitModel:
    """What the layers are fitted to.

    Attributes:
        src: int64 ``[T]`` source rank of each token to fit with; how: its description.
        win: int64 ``[T]`` fit window of each token; W: the number of windows.
        load: float64 ``[L, E]`` picks per expert; greedy: greedy's placement of ``load`` (the baseline).
        g_peak: float64 ``[L, V]`` greedy's GPU peak on the fit total and on every window.
        share_excess: the expected share excess of unseen traffic (None when ``num_everywhere`` is given).
        hs: everywhere experts of each layer (``L`` ints).
        drift: float64 ``[L, E]`` expected load drift times ``drift_z``, or None (pairing off).
    """

    src: np.ndarray
    how: str
    win: np.ndarray
    W: int
    load: np.ndarray
    greedy: Placement
    g_peak: np.ndarray
    share_excess: float | None
    hs: list[int]
    drift: np.ndarray | None


def _fit_model(
    trace: RoutingTrace, topology: Topology, src: np.ndarray, how: str, o: LocalityOptions
) -> _FitModel:
    """Fit sources (from the scoring sources ``src`` int64 ``[T]``), windows, greedy's GPU peaks, the
    everywhere counts and the load drift."""
    P, G, N, m = topology.num_physical_experts, topology.ep_size, topology.num_nodes, topology.gpus_per_node
    src_fit, how_fit = fit_sources(src, how, o.source_model, G, m)
    win = window_of_tokens(trace, o.num_windows)
    W = int(win.max()) + 1 if win.size else 1
    load = trace.counts().astype(np.float64)
    greedy, _ = greedy_placement(load, topology, layer_ids=trace.layer_ids)
    # greedy's GPU peaks on the fit total and on every window: the GPU caps (same dispatch, same sources)
    g_views = [trace_gpu_load(greedy, trace, LOCAL.name, src=src_fit)]
    if W > 1:
        for w in range(W):
            idx = np.flatnonzero(win == w)
            sub = trace.slice_tokens(int(idx[0]), int(idx[-1]) + 1)
            g_views.append(trace_gpu_load(greedy, sub, LOCAL.name, src=src_fit[idx]))
    g_peak = np.stack([v.max(axis=1) for v in g_views], axis=1)  # [L, V]
    # expected share excess of unseen traffic: only the default everywhere count needs it
    share_excess = (
        None if o.num_everywhere is not None else expected_share_excess(trace, src, how, m, N, o.seed)
    )
    hs = [
        int(o.num_everywhere)
        if o.num_everywhere is not None
        else default_everywhere(
            load[l], P, N, m, share_excess=share_excess, share_overload=float(o.share_overload)
        )
        for l in range(trace.num_layers)
    ]
    # expected load drift of every expert (used by the two-slot pairing, which runs on one view only)
    pairs = topology.slots_per_gpu == 2 and W == 1
    drift = load_drift(trace, o.seed) * float(o.drift_z) if o.drift_z and pairs else None  # [L, E]
    return _FitModel(src_fit, how_fit, win, W, load, greedy, g_peak, share_excess, hs, drift)


class _CallBudget:
    """The whole call's budget, spent layer by layer: ``time_limit`` seconds from the call's start
    ``t0``, or ``work_limit`` steps (counted as each layer's budgets are handed out). A layer gets its
    even share (:func:`_layer_budgets`), less when the call has less left (the per-layer floors of one
    step or CP-SAT's shortest limit no longer add up over many layers: the call is bounded, not each
    layer); a layer with nothing left gets zero budgets (its start, no search)."""

    def __init__(self, time_limit: float, work_limit: int | None, L: int, N: int, t0: float):
        self.time_limit, self.work_limit, self.L, self.N = float(time_limit), work_limit, max(L, 1), N
        self.deadline, self.used = t0 + max(float(time_limit), 0.0), 0

    def layer(self, l: int) -> tuple[float | Budget, float | Budget, float | Budget]:
        """Layer ``l``'s budgets ``(partition, packing of one node, repair)``; call once per layer."""
        if self.work_limit is None:  # seconds: the even share, at most what is left over the layers left
            left = max(self.deadline - time.perf_counter(), 0.0) / (self.L - l)
            return _layer_budgets(min(self.time_limit / self.L, left) * self.L, None, self.L, self.N)
        b = _layer_budgets(self.time_limit, self.work_limit, self.L, self.N)
        need = b[0].work + self.N * b[1].work + b[2].work
        left = max(int(self.work_limit) - self.used, 0)
        if need > left:  # the floors of one step would pass the call's limit: what is left, then none
            f = left / need
            b = tuple(Budget(0.0, int(x.work * f)) for x in b)
            need = b[0].work + self.N * b[1].work + b[2].work
        self.used += need
        return b


def _layer_budgets(
    time_limit: float, work_limit: int | None, L: int, N: int
) -> tuple[float | Budget, float | Budget, float | Budget]:
    """One layer's budgets ``(partition, packing of one node, repair)``: seconds (60/20/20% of the layer's
    share of ``time_limit``), or with ``work_limit`` counted steps (the same placement on any machine).
    A budget of steps is spent as it is used: call once per layer."""
    if work_limit is None:  # seconds
        per_layer = max(float(time_limit), 0.0) / max(L, 1)
        return 0.6 * per_layer, 0.2 * per_layer / N, 0.2 * per_layer
    wl = int(work_limit) / max(L, 1)
    b_part, b_pack, b_rep = (Budget(0.0, max(int(round(f * wl)), 1)) for f in (0.6, 0.2 / N, 0.2))
    return b_part, b_pack, b_rep


def _solve_layers(
    trace: RoutingTrace,
    topology: Topology,
    fit: _FitModel,
    o: LocalityOptions,
    share_margin: float,
    t0: float,
) -> tuple[np.ndarray, list[LayerReport]]:
    """One :func:`solve_replicated_layer` per layer: rows int64 ``[L, P]`` and the layers' reports
    (``objective``: fitted remote nodes per token)."""
    E, P, G, N = (
        trace.num_logical_experts,
        topology.num_physical_experts,
        topology.ep_size,
        topology.num_nodes,
    )
    L = trace.num_layers
    src_node = fit.src // topology.gpus_per_node
    rows = np.empty((L, P), dtype=np.int64)
    reports = []
    call = _CallBudget(o.time_limit, o.work_limit, L, N, t0)
    for l in range(L):
        tl = time.perf_counter()
        ids = trace.topk_ids[:, l, :].astype(np.int64)  # [T, k]
        b_part, b_pack, b_rep = call.layer(l)
        search = LayerSearch(
            fit.hs[l],
            o.balance_slack,
            b_part,
            seed=o.seed + l,
            window_slack=o.window_slack,
            pack_time=b_pack,
            gpu_cap=fit.g_peak[l] * (1.0 + o.gpu_slack),
            repair_time=b_rep,
            single_margin=o.single_margin,
            share_margin=share_margin,
        )
        drift = None if fit.drift is None else fit.drift[l]
        row, info = solve_replicated_layer(ids, src_node, fit.win, fit.W, E, topology, search, drift)
        rows[l] = row
        reports.append(
            LayerReport(
                layer_id=trace.layer_ids[l],
                status="heuristic",
                objective=_remote_nodes(row, ids, src_node, topology, E),
                bound=0.0,
                wall_time_s=time.perf_counter() - tl,
                baseline_objective=None,
                mean_load=float(fit.load[l].sum() / G),
                extra=info,
            )
        )
    return rows, reports


def _remote_nodes(
    row: np.ndarray, ids: np.ndarray, src_node: np.ndarray, topology: Topology, E: int
) -> float:
    """Fitted remote nodes per token of a row int64 ``[P]`` (every expert on one node or on all)."""
    on_node = np.zeros((E, topology.num_nodes), dtype=bool)
    on_node[row, topology.node_of_slot] = True
    every = on_node.all(axis=1)
    node_of = on_node.argmax(axis=1)
    return (
        float(remote_nodes_fit(node_of, every, ids, src_node, topology.num_nodes).mean()) if ids.size else 0.0
    )


def _notes(
    placement: Placement,
    trace: RoutingTrace,
    fit: _FitModel,
    reports: list[LayerReport],
    gpu_slack: float,
    hidden_size: int | None,
) -> list[str]:
    """The report's notes: sources, the everywhere counts and fitted remote nodes against greedy's,
    fitted bytes per token, and the layers left above the GPU cap."""
    src, how, hs = fit.src, fit.how, fit.hs
    g_comm = communication(fit.greedy, trace, LOCAL.name, src=src, hidden_size=hidden_size)
    comm = communication(placement, trace, LOCAL.name, src=src, hidden_size=hidden_size)
    h_txt = str(hs[0]) if len(set(hs)) == 1 else f"{min(hs)}-{max(hs)} (per layer)"
    fitted = (
        f"method replicated: {h_txt} experts on every node; fitted remote_nodes_per_token "
        f"{comm['remote_nodes_per_token']:.3f} vs greedy {g_comm['remote_nodes_per_token']:.3f}"
    )
    notes = [f"source ranks: {how}", fitted]
    if hidden_size is not None:
        notes.append(f"fitted bytes_per_token={comm['bytes_per_token']:.0f} (hidden_size={hidden_size})")
    over = [r.layer_id for r in reports if r.extra.get("excess_end", 0.0) > 1e-9]
    if over:
        notes.append(
            f"GPU peak above (1+{gpu_slack}) x greedy's on some fit view in layers {over}: best effort"
        )
    return notes
