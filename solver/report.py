"""Frozen solve reports: how every solve ended is data, never an exception."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["LayerReport", "SolveReport", "STATUSES", "relative_gap", "combine_status"]

# Ordered from best to worst: the overall status is the worst of the layers'.
STATUSES = ("optimal", "feasible", "time_limit", "heuristic", "greedy_fallback", "infeasible", "error")


def relative_gap(objective: float, bound: float) -> float:
    """``(objective - bound) / objective``, 0 when both are 0, clipped at 0."""
    if objective <= 0:
        return 0.0
    return max(0.0, (objective - bound) / objective)


def combine_status(statuses: Sequence[str]) -> str:
    if not statuses:
        return "optimal"
    return max(statuses, key=lambda s: STATUSES.index(s) if s in STATUSES else len(STATUSES))


@dataclass(frozen=True)
class LayerReport:
    """One layer's result. Loads are tokens (the objective's unit, e.g. peak GPU load)."""

    layer_id: int
    status: str
    objective: float
    bound: float
    wall_time_s: float = 0.0
    baseline_objective: float | None = None
    mean_load: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def gap(self) -> float:
        return relative_gap(self.objective, self.bound)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gap"] = self.gap
        d["extra"] = dict(self.extra)
        return d


@dataclass(frozen=True)
class SolveReport:
    """How a solve ended, per layer and overall.

    ``objective`` and ``bound`` are sums over layers (step time adds the layers' peaks up); ``gap`` is
    relative to the objective. ``params`` keeps every option that shaped the result (seed, time limit,
    backend, policy) so a run can be reproduced.
    """

    solver: str
    layers: tuple[LayerReport, ...]
    wall_time_s: float
    params: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def status(self) -> str:
        return combine_status([lr.status for lr in self.layers])

    @property
    def objective(self) -> float:
        return float(sum(lr.objective for lr in self.layers))

    @property
    def bound(self) -> float:
        return float(sum(lr.bound for lr in self.layers))

    @property
    def gap(self) -> float:
        return relative_gap(self.objective, self.bound)

    @property
    def max_layer_gap(self) -> float:
        return max((lr.gap for lr in self.layers), default=0.0)

    def per_layer(self, key: str) -> np.ndarray:
        return np.array([getattr(lr, key) for lr in self.layers], dtype=float)

    def to_dict(self) -> dict:
        return {
            "solver": self.solver,
            "status": self.status,
            "objective": self.objective,
            "bound": self.bound,
            "gap": self.gap,
            "max_layer_gap": self.max_layer_gap,
            "wall_time_s": self.wall_time_s,
            "params": dict(self.params),
            "notes": list(self.notes),
            "layers": [lr.to_dict() for lr in self.layers],
        }
