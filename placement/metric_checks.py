"""Input checks of the metrics (:mod:`placement.metrics`): types, shapes that must match the placement,
and loads whose balance is defined. Each raises a ValueError naming the numbers and the fix."""

from __future__ import annotations

import numpy as np

from moe_placement.base.limits import MAX_HIDDEN_SIZE, check_whole
from placement.model import Placement
from profiling.trace import RoutingTrace


def check_types(placement: object, trace: object = None, what: str = "trace") -> None:
    """A :class:`Placement` (and a :class:`RoutingTrace` ``trace`` unless ``what`` is empty), else a ValueError."""
    if not isinstance(placement, Placement):
        raise ValueError(f"placement must be a placement.model.Placement, got {type(placement).__name__}")
    if what and not isinstance(trace, RoutingTrace):
        raise ValueError(
            f"{what} must be a profiling.trace.RoutingTrace (read_trace), got {type(trace).__name__}"
        )


def check_compatible(placement: Placement, num_layers: int, num_experts: int, what: str) -> None:
    if num_experts != placement.num_logical_experts:
        raise ValueError(
            f"{what} has {num_experts} logical experts but the placement has {placement.num_logical_experts}"
        )
    if num_layers != placement.num_layers:
        raise ValueError(
            f"{what} has {num_layers} layers but the placement has {placement.num_layers}; "
            f"select matching layers first"
        )


def check_load_values(g: np.ndarray, what: str) -> None:
    """ValueError unless ``g`` holds finite, non-negative numbers, not all zero."""
    if g.size == 0 or not np.isfinite(g).all() or (g < 0).any():
        bad = "empty" if g.size == 0 else "negative or non-finite values"
        raise ValueError(f"{what} of shape {list(g.shape)} is {bad}; give finite token counts >= 0")
    if not g.any():
        raise ValueError(
            f"{what} is zero everywhere: the PAR of zero load is undefined (nothing was routed); "
            f"score a trace or load that routes tokens"
        )


def check_bytes_args(hidden_size, dispatch_bytes: float, combine_bytes: float) -> None:
    """``hidden_size`` None or a whole number in ``1..MAX_HIDDEN_SIZE``; bytes per element finite, > 0."""
    if hidden_size is not None:
        check_whole("hidden_size", hidden_size, 1, MAX_HIDDEN_SIZE, fix="the model's hidden size (e.g. 7168)")
    for name, v in (("dispatch_bytes_per_elem", dispatch_bytes), ("combine_bytes_per_elem", combine_bytes)):
        real = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
        if not real or not 0 < v <= 64:
            raise ValueError(f"{name} must be a number in (0, 64], got {v!r}; FP8 is 1, BF16 is 2")
