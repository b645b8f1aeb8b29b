"""The engine's-default guard of a fresh call: our map is never more than 0.5% less balanced than the
engine's own default answer in any layer, and co-located replicas only where the engine's own rows
are served (logged).

Shapes: L layers, E logical experts, P physical slots, G EP ranks.

Steps (:func:`guard_fresh`): the engine's default map (the engine's own function when the plugin runs
inside the engine, else our re-implementation of the published algorithm, ``greedy(parity=True)``)
-> peak GPU load per layer of ours and the engine's under the engine's dispatch (max/mean: the mean
is the same for both maps) -> in the layers where ours is more than :data:`TOLERANCE` worse, other
maps without co-located replicas are tried (the engine's map repaired with one moved slot per extra
copy; the exact solver on those layers when its estimate fits half the budget) and the best taken
-> where none comes within :data:`TOLERANCE`, the engine's own row is served, with one warning
naming both figures. Under a static table (SGLang's) layers are judged summed, whole maps compared
(:func:`_table_guard`). Every step is deterministic (ranks must agree: nothing broadcasts the map).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime_hooks.rebalance_rule import gpu_peaks

if TYPE_CHECKING:
    from placement.topology import Topology
    from runtime_hooks.engine_plugins.spec import PolicySpec

EngineCall = Any  # runtime_hooks.engine_plugins.policy.EngineCall (that module imports this one)

__all__ = ["TOLERANCE", "Guarded", "dispatch_peaks", "engine_default_map", "guard_fresh"]

log = logging.getLogger(__name__)

TOLERANCE = 0.005  # ours may be at most 0.5% less balanced (max/mean, per layer) than the engine's default


class Guarded:
    """The guard's answer: ``phy2log`` int64 ``[L, P]`` and ``engine_rows`` bool ``[L]`` (layers
    served with the engine's own row, which may co-locate replicas)."""

    __slots__ = ("engine_rows", "phy2log")

    def __init__(self, phy2log: np.ndarray, engine_rows: np.ndarray) -> None:
        self.phy2log = phy2log
        self.engine_rows = engine_rows


def dispatch_peaks(dispatch: str, load: np.ndarray, phy2log: np.ndarray, topo: Topology) -> np.ndarray:
    """Peak GPU load per layer ``[L]`` of ``phy2log [L, P]`` for ``load [L, E]`` under ``dispatch``:
    a table (SGLang's static one) with every expert's tokens split evenly over the source ranks,
    else each expert's tokens split evenly over its replicas (vLLM's hash in expectation)."""
    from placement.dispatch import get_dispatch

    phy2log, load = _checked(load, phy2log, topo)
    if not get_dispatch(dispatch).table:
        return gpu_peaks(phy2log, load, topo.ep_size)
    from placement.metrics import rank_gpu_load
    from placement.model import Placement
    from solver.dispatch_fit import even_rank_counts

    pl = Placement(np.asarray(phy2log, dtype=np.int64), load.shape[1], topo, allow_colocated_replicas=True)
    return rank_gpu_load(pl, even_rank_counts(load, topo.ep_size), dispatch).max(axis=1)


def _checked(load, phy2log, topo) -> tuple[np.ndarray, np.ndarray]:
    """``(phy2log int64 [L, P], load float64 [L, E])`` when they fit each other and ``topo``, else a
    ValueError naming the numbers (an IndexError from inside before)."""
    from placement.metric_checks import check_map_load
    from placement.topology import Topology

    if not isinstance(topo, Topology):
        raise ValueError(f"topo must be a placement.topology.Topology, got {type(topo).__name__}")
    p2l, w = check_map_load(phy2log, load, topo.ep_size)
    if p2l.shape[1] != topo.num_physical_experts:
        raise ValueError(
            f"the map has {p2l.shape[1]} slots per layer but the topology has {topo.num_physical_experts} "
            f"({topo.ep_size} GPUs x {topo.slots_per_gpu} slots)"
        )
    return p2l, w


def engine_default_map(call: EngineCall, topo: Topology, load: np.ndarray) -> np.ndarray:
    """The engine's default answer int64 ``[L, P]``: ``call.engine_default()`` when the plugin gave
    one (the engine's own function) and it answers a valid map, else our re-implementation of the
    published algorithm (DeepSeek EPLB, which vLLM's default policy and SGLang's ``deepseek`` run)."""
    if call.engine_default is not None:
        try:
            rows = np.asarray(call.engine_default(), dtype=np.int64)
            _check_rows(rows, load.shape, topo.num_physical_experts)
            return np.array(rows, dtype=np.int64, order="C")
        except Exception as exc:  # any failure: the re-implementation answers instead
            log.debug("moe_placement: engine's default unavailable (%s); re-implementation used", exc)
    from solver.greedy import greedy_placement

    groups = call.num_groups if call.num_groups and call.num_groups > 1 else None
    return greedy_placement(load, topo, groups, parity=True)[0].physical_to_logical_map


def _check_rows(rows: np.ndarray, shape: tuple[int, int], P: int) -> None:
    L, E = shape
    if rows.shape != (L, P) or rows.min() < 0 or rows.max() >= E:
        raise ValueError(f"engine map {rows.shape} is not [{L}, {P}] with ids in [0, {E})")
    if any(np.unique(row).size != E for row in rows):
        raise ValueError("engine map leaves an expert without a replica")


def guard_fresh(
    spec: PolicySpec,
    call: EngineCall,
    topo: Topology,
    load: np.ndarray,
    ours: np.ndarray,
    groups: int | None,
    exact: Callable[[np.ndarray], np.ndarray] | None = None,
) -> Guarded:
    """Our fresh map ``ours [L, P]`` for ``load [L, E]``, guarded against the engine's default (see the
    module docstring). ``groups``: expert groups kept on nodes (hierarchical call) or None; ``exact``:
    the exact solver on a layer subset (``layers [K]`` -> ``[K, P]``), or None to skip it."""
    from placement.dispatch import get_dispatch

    dispatch = call.dispatch_model
    engine = engine_default_map(call, topo, load)
    peak_eng = dispatch_peaks(dispatch, load, engine, topo)  # [L]
    peak = dispatch_peaks(dispatch, load, ours, topo)  # [L]
    if get_dispatch(dispatch).table:
        return _table_guard(spec, call, topo, load, (ours, peak), (engine, peak_eng), groups, exact)
    out, served = ours.copy(), np.zeros(load.shape[0], dtype=bool)
    bad = np.flatnonzero(peak > peak_eng * (1 + TOLERANCE) + 1e-12)
    if not bad.size:
        return Guarded(out, served)
    for rows in _candidates(call, topo, load, engine, bad, groups, exact):
        cand = dispatch_peaks(dispatch, load[bad], rows, topo)  # [K]: layers are independent here
        take = cand < peak[bad] - 1e-12
        out[bad[take]], peak[bad[take]] = rows[take], cand[take]
    still = bad[peak[bad] > peak_eng[bad] * (1 + TOLERANCE) + 1e-12]
    out[still], served[still] = engine[still], True
    if still.size:
        _warn(spec, load, topo, still, peak[still], peak_eng[still])
    log.info(
        "moe_placement %s: %d layer(s) over %.1f%% of the engine's default re-placed, %d served as the engine's",
        spec.text,
        bad.size,
        100 * TOLERANCE,
        still.size,
    )
    return Guarded(out, served)


def _table_guard(spec, call, topo, load, ours, default, groups, exact) -> Guarded:
    """Under a static table (one generator per rank, drawn through the layers in order) a layer's
    figure depends on every earlier layer's map, so rows cannot be judged or swapped one by one: whole
    maps are, by their peaks summed over layers. Ours, ours with its layers over :data:`TOLERANCE`
    taken from each candidate, and the engine's whole map repaired of co-located replicas: the lowest
    sum is served when within :data:`TOLERANCE` of the engine's (single layers then differ by the
    draws, logged), else the engine's whole map (warned). ``ours`` / ``default``: ``(map [L, P],
    peaks [L])``."""
    (best, peak), (engine, peak_eng) = ours, default
    L, dispatch = load.shape[0], call.dispatch_model
    bad = np.flatnonzero(peak > peak_eng * (1 + TOLERANCE) + 1e-12)
    trials = []
    for rows in _candidates(call, topo, load, engine, bad, groups, exact) if bad.size else ():
        trial = best.copy()
        trial[bad] = rows
        trials.append(trial)
    if peak.sum() > peak_eng.sum() * (1 + TOLERANCE) + 1e-12:
        trials.extend(_candidates(call, topo, load, engine, np.arange(L), groups, None))
    for trial in trials:
        cand = dispatch_peaks(dispatch, load, trial, topo)
        if cand.sum() < peak.sum() - 1e-9:
            best, peak = trial, cand
    if peak.sum() <= peak_eng.sum() * (1 + TOLERANCE) + 1e-12:
        worse = int((peak > peak_eng * (1 + TOLERANCE) + 1e-12).sum())
        if worse:
            log.info(
                "moe_placement %s: %d layer(s) over %.1f%% of the engine's default under the table's draws; "
                "peaks summed over layers %.0f ours, %.0f the engine's: ours served",
                spec.text,
                worse,
                100 * TOLERANCE,
                peak.sum(),
                peak_eng.sum(),
            )
        return Guarded(best, np.zeros(L, dtype=bool))
    _warn(spec, load, topo, np.arange(L), peak, peak_eng, summed=True)
    return Guarded(engine.copy(), np.ones(L, dtype=bool))


def _candidates(call, topo, load, engine, bad, groups, exact):
    """Maps ``[K, P]`` without co-located replicas for the ``bad`` layers: the engine's rows repaired
    (one moved slot per extra copy, inside each group's node on a hierarchical call), then exact's."""
    from placement.model import Placement
    from solver.migration.slots import repair_colocated

    try:
        pl = Placement(engine[bad], load.shape[1], topo, allow_colocated_replicas=True)
        yield repair_colocated(pl, load[bad], groups)[0].physical_to_logical_map
    except ValueError as exc:  # e.g. more slots per GPU than experts: no repair exists
        log.debug("moe_placement: engine's map not repairable (%s)", exc)
    if exact is not None:
        try:
            yield np.asarray(exact(bad), dtype=np.int64)
        except Exception as exc:  # a refused or failed exact solve leaves the other candidates
            log.debug("moe_placement: exact candidate skipped (%s)", exc)


def _warn(spec, load, topo, layers, peak, peak_eng, summed: bool = False) -> None:
    """One warning naming both figures (max/mean) where the engine's map is served: of the worst
    layer, or (``summed``) of the mean over layers."""
    mean = np.maximum(load[layers].sum(axis=1) / topo.ep_size, 1e-300)
    ours, eng = peak / mean, peak_eng / mean
    i = int(np.argmax(ours / eng))
    where = "mean over layers" if summed else f"worst layer {int(layers[i])}"
    a, b = (ours.mean(), eng.mean()) if summed else (ours[i], eng[i])
    log.warning(
        "moe_placement %s: the engine's default map used in %d layer(s) (co-located replicas allowed): "
        "no map without co-location came within %.1f%% of it (%s: max/mean %.4f ours, %.4f the engine's)",
        spec.text,
        layers.size,
        100 * TOLERANCE,
        where,
        a,
        b,
    )
