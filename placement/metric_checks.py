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


def check_counts(counts, what: str) -> np.ndarray:
    """``counts`` (token counts of any shape) as float64 when numeric, finite and >= 0, else a
    ValueError naming ``what`` and the first bad entry (a NaN load would give NaN peaks)."""
    try:
        arr = np.asarray(counts, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must hold numbers (token counts), got {type(counts).__name__}") from None
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{what} holds {arr[at]:g} at index {list(at)} ({int(bad.sum())} entries NaN, infinite or negative); "
            f"loads are token counts >= 0"
        )
    return arr


def check_map_load(p2l, load, ep_size: int, what: str = "the map") -> tuple[np.ndarray, np.ndarray]:
    """A map ``p2l [L, P]`` and the load ``[L, E]`` it is scored on, checked against each other before
    any indexing: ``(p2l int64, load float64)``, else a ValueError naming the numbers.

    Refused: a load that is not ``[L, E]`` counts (:func:`check_counts`), a map that is not a 2-D
    integer array, a map whose layers are not the load's, slots that do not divide over ``ep_size``,
    and an expert id outside ``0..E-1`` (-1 is no expert: numpy would wrap it to expert ``E - 1``).
    """
    w = check_counts(load, "load")
    if w.ndim != 2 or 0 in w.shape:
        raise ValueError(f"load must be [layers, experts] with both >= 1, got shape {w.shape}")
    m = np.asarray(p2l)
    if m.dtype.kind == "f" and m.size and np.isfinite(m).all() and (m == np.round(m)).all():
        m = m.astype(
            np.int64
        )  # whole numbers held as floats (a tensor converted), as validate_map reads them
    if m.dtype.kind not in "iu" or m.ndim != 2 or 0 in m.shape:
        raise ValueError(
            f"{what} must be a 2-D integer array [layers, slots], got {m.dtype} of shape {m.shape}"
        )
    (L, E), (Lm, P) = w.shape, m.shape
    if Lm != L:
        raise ValueError(
            f"{what} has {Lm} layers but the load has {L}; pass the load of the map's layers (one row each)"
        )
    G = check_whole("ep_size", ep_size, 1, fix="the EP ranks (GPUs)")
    if P % G:
        raise ValueError(f"{what} has {P} slots per layer, which do not divide over {G} GPUs")
    bad = (m < 0) | (m >= E)
    if bad.any():
        l, p = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{what}: layer row {l} slot {p} holds expert id {int(m[l, p])}, outside 0..{E - 1} for the "
            f"load's {E} experts ({int(bad.sum())} slot(s) out of range); every slot names an expert"
        )
    return m.astype(np.int64), w
