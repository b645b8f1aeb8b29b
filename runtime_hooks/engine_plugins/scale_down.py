"""An elastic scale-down answered with the failover map for the ranks that left.

Shapes: L layers, E logical experts, S slots per rank (unchanged by the scale-down), ``G_old`` ranks
before and ``G_new`` after, ``P_old = S x G_old`` and ``P_new = S x G_new`` slots.

vLLM (0.33) shrinks an elastic EP deployment by calling its EPLB policy on every old rank with the
map in service ``[L, P_old]`` and ``num_replicas = P_new``, ``num_ranks = G_new``; the survivors are
always ranks ``0..G_new-1`` (new rank ``r`` keeps old rank ``r``'s slots) and every old rank must
return the same ``[L, P_new]`` map. :func:`scale_down` recognises that call and answers it with the
failover map for losing ranks ``G_new..G_old-1`` (:func:`solver.failover.failover_map`): every expert
still served, only the experts with no copy on a survivor brought in, balanced within the failover
move budget. With ``failover=DIR`` in the spec the map of ``DIR`` (``moe-placement solve --failover``)
for that loss is served when it was computed from exactly the map in service (its digest), else the
map is computed on the spot (logged). Deterministic: plain numpy, no clock. Scale-up (``-1`` slots in
the map in service) is not a scale-down: the policy then places as before.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["lost_ranks", "scale_down"]

log = logging.getLogger(__name__)


def lost_ranks(call: Any, E: int) -> tuple[int, ...]:
    """The ranks ``G_new..G_old-1`` a scale-down removes, or ``()`` when ``call`` is not one: its map
    in service is wider than ``call.num_physical`` by whole ranks of ``S`` slots, with every id an
    expert (no ``-1``)."""
    prev = call.previous
    if prev is None:
        return ()
    prev = np.asarray(prev)
    P_new, G_new = int(call.num_physical), int(call.num_ranks)
    S = P_new // G_new
    if prev.ndim != 2 or not np.issubdtype(prev.dtype, np.integer) or prev.shape[0] != np.shape(call.load)[0]:
        return ()
    P_old = prev.shape[1]
    if P_old <= P_new or P_old % S or prev.size == 0 or prev.min() < 0 or prev.max() >= E:
        return ()
    return tuple(range(G_new, P_old // S))


def scale_down(spec: Any, call: Any, w: np.ndarray, lost: tuple[int, ...]) -> np.ndarray:
    """The failover map int64 ``[L, P_new]`` for the scale-down ``call`` removing ``lost`` ranks
    (``w [L, E]``: the call's load, what the map is balanced for)."""
    from moe_placement.base.errors import EngineCallError as PolicyError
    from placement.model import Placement
    from placement.topology import Topology
    from solver.failover import DEFAULT_MAX_MOVES, FailoverOptions, failover_map

    prev = np.asarray(call.previous, dtype=np.int64)
    L, P_old = prev.shape
    E, P_new = w.shape[1], int(call.num_physical)
    G_old = P_old // (P_new // int(call.num_ranks))
    rows = _precomputed(spec, prev, lost, (L, P_new), E) if spec.failover else None
    if rows is not None:
        return rows
    try:
        old = Placement(prev, E, Topology(G_old, P_old, 1), allow_colocated_replicas=True)
    except ValueError as exc:
        raise PolicyError(f"the map in service is not a placement ({exc})") from None
    moves = DEFAULT_MAX_MOVES if spec.failover_moves is None else spec.failover_moves
    new, rep = failover_map(old, w, lost, FailoverOptions(max_moves=moves))
    log.info(
        "moe_placement %s: scale-down from %d to %d ranks: failover map computed (%d experts reloaded, the "
        "fewest possible %d; %d moved; PAR %.4f)",
        spec.text,
        G_old,
        G_old - len(lost),
        rep.total_reloads,
        rep.total_min_reloads,
        rep.total_moves,
        rep.par,
    )
    return np.array(new.physical_to_logical_map, dtype=np.int64, order="C")


def _precomputed(spec: Any, prev: np.ndarray, lost: tuple[int, ...], shape: tuple[int, int], E: int):
    """The map of ``spec.failover`` for losing ``lost``: int64 ``shape``, or None (logged) when the
    folder is unreadable, was computed from another map, lacks that loss or holds another shape."""
    from moe_placement.base.errors import MoePlacementError
    from placement.formats import read_placement
    from placement.formats.failover import find_loss, map_digest, read_failover_index

    folder = Path(spec.failover)
    try:
        doc = read_failover_index(folder)
        entry = find_loss(doc, lost)
        why = ""
        if doc["placement_sha256"] != map_digest(prev):
            why = "it was computed from another map than the one in service"
        elif entry is None:
            why = f"it has no map for losing ranks {list(lost)}"
        else:
            pl = read_placement(folder / entry["file"], num_logical_experts=E)
            rows = np.array(pl.physical_to_logical_map, dtype=np.int64, order="C")
            if rows.shape == shape and pl.num_logical_experts == E:
                log.info(
                    "moe_placement %s: scale-down, ranks %s lost: failover map %s served (%d experts reloaded, "
                    "%d moved, PAR %.4f)",
                    spec.text,
                    list(lost),
                    entry["file"],
                    entry["reloads"],
                    entry.get("moves", 0),
                    entry["par"],
                )
                return rows
            why = f"its map {entry['file']} is {rows.shape}, the engine needs {shape}"
    except (MoePlacementError, ValueError, OSError) as exc:
        why = str(exc)
    log.warning(
        "moe_placement %s: failover folder %s not used (%s); computed on the spot", spec.text, folder, why
    )
    return None
