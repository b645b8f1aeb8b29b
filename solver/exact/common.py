"""Shared by the pipeline, the validation guard and the noise gate: what the exact solver accepts
(loads ``[L, E]``, windows ``[W, L, E]`` or a :class:`RoutingTrace`) and how a post-pass rebuilds
the placement and report after changing some layers."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np

from placement.model import Placement
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.report import LayerReport, SolveReport
from solver.weighted import weighted_shares

LoadOrTrace = np.ndarray | RoutingTrace


def _parse_robust(robust: str | bool | None, W: int) -> int:
    """Windows averaged in the objective: 1 (plain or ``max``) or ``ceil((1 - NN/100) W)`` for ``qNN``."""
    if robust is None or robust is False:
        return 1
    if robust == "max" or robust is True:
        return 1
    if isinstance(robust, str) and robust.startswith("q") and robust[1:].isdigit():
        q = int(robust[1:])
        if not 0 < q < 100:
            raise ValueError(f"robust quantile {robust!r} must be q1..q99")
        return max(1, math.ceil((1 - q / 100) * W - 1e-9))
    raise ValueError(f"unknown robust mode {robust!r}; use None, 'max' or 'qNN' (e.g. 'q90')")


def _as_windows(
    load_or_trace: LoadOrTrace, robust: str | bool | None, num_windows: int
) -> tuple[np.ndarray, np.ndarray, tuple[int, ...] | None, int | None]:
    """Returns (aggregate [L, E], windows [W, L, E], layer_ids or None, top_k or None)."""
    if isinstance(load_or_trace, RoutingTrace):
        tr = load_or_trace
        agg = tr.counts().astype(np.float64)
        if robust:
            wins = tr.window_load()
            if wins.shape[0] != num_windows:
                wins = np.stack([t.counts() for t in tr.windows(num_windows)]).astype(np.float64)
        else:
            wins = agg[None]
        return agg, wins, tuple(tr.layer_ids), tr.top_k
    arr = np.asarray(load_or_trace, dtype=np.float64)
    if arr.ndim == 2:
        return arr, arr[None], None, None
    if arr.ndim == 3:
        return arr.sum(axis=0), (arr if robust else arr.sum(axis=0)[None]), None, None
    raise ValueError(
        f"load must be [layers, experts], [windows, layers, experts] or a RoutingTrace, got shape {arr.shape}"
    )


def _aggregate(load_or_trace: LoadOrTrace) -> np.ndarray:
    """The summed load float64 ``[L, E]`` of a trace, ``[L, E]`` loads or ``[W, L, E]`` windows."""
    agg = (
        load_or_trace.counts().astype(np.float64)
        if isinstance(load_or_trace, RoutingTrace)
        else np.asarray(load_or_trace, dtype=np.float64)
    )
    if agg.ndim == 3:
        agg = agg.sum(axis=0)
    return agg


def _refresh_shares(extra: dict, row: np.ndarray, w: np.ndarray, topology: Topology) -> None:
    """When ``extra`` holds LP shares, recompute them for the new map ``row [P]`` (loads ``w [E]``)."""
    if "replica_shares" in extra:  # shares belong to the map
        q, wpeak = weighted_shares(row, w, topology)
        extra.update(replica_shares=q.tolist(), weighted_objective=wpeak)


def _with_layers(
    pl: Placement,
    rep: SolveReport,
    rows: np.ndarray,
    layers: list[LayerReport],
    provenance: dict,
    params: dict,
    notes: list[str],
    t_start: float,
) -> tuple[Placement, SolveReport]:
    """``pl`` with the map ``rows [L, P]`` and ``provenance`` added; ``rep`` with new layers, params, notes."""
    out = Placement(rows, pl.num_logical_experts, pl.topology, pl.layer_ids, {**pl.provenance, **provenance})
    return out, replace(
        rep,
        layers=tuple(layers),
        wall_time_s=time.perf_counter() - t_start,
        params=params,
        notes=tuple(notes),
    )
