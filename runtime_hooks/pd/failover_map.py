"""The map to serve on the surviving ranks after a rank loss (the runtime's stand-in for the solver's).

:func:`failover_map` is the one entry the runtime calls (:mod:`runtime_hooks.pd.pool`); a solver's
failover map with the same signature can replace it. The rule here is the minimal one: the survivors
keep their slots (rank ``g`` of the survivors, in ascending order of their old ranks, keeps its old slot
block), and every expert with no surviving copy in a layer overwrites one surplus replica (a slot whose
expert keeps two or more surviving copies): on the survivor with the least expected load (each slot
carries ``1 / copies`` of its expert's load, all experts equally popular), the replica there whose
expert has the most copies. Only those experts are reloaded; nothing else moves.

Shapes: L layers, G ranks before the loss, S slots per rank, E logical experts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from placement.model import Placement
from placement.topology import Topology

__all__ = ["failover_map", "survivors"]


def survivors(ep_size: int, lost_ranks: Sequence[int]) -> list[int]:
    """The ranks ``0..ep_size-1`` not in ``lost_ranks``, ascending (ValueError on a bad rank or when none survive)."""
    lost = sorted({int(r) for r in lost_ranks})
    bad = [r for r in lost if not 0 <= r < ep_size]
    if bad or not lost:
        raise ValueError(
            f"lost ranks {list(lost_ranks)} must be one or more of the placement's ranks 0..{ep_size - 1}"
        )
    alive = [g for g in range(ep_size) if g not in lost]
    if not alive:
        raise ValueError(f"losing ranks {lost} leaves no rank of {ep_size} to serve on")
    return alive


def _surviving_nodes(topology: Topology, alive: list[int]) -> int:
    """Nodes of the survivors' topology: the surviving nodes when they keep equal GPU counts, else 1."""
    per_node = np.bincount(topology.node_of_gpu[alive], minlength=topology.num_nodes)  # [N]
    kept = per_node[per_node > 0]
    return int(kept.size) if np.all(kept == kept[0]) else 1


def _fill_row(row: np.ndarray, S: int, E: int) -> tuple[np.ndarray, int]:
    """One layer: ``row`` int64 ``[G' * S]`` of the survivors' slots -> (the row with every expert
    present, experts reloaded). ValueError when a lost expert finds no surplus replica."""
    row = row.copy()
    copies = np.bincount(row, minlength=E)  # [E]
    lost = np.nonzero(copies == 0)[0]
    for e in lost:
        share = (1.0 / np.maximum(copies, 1))[row].reshape(-1, S)  # [G', S] expected load of each slot
        surplus = (copies[row] >= 2).reshape(-1, S)  # [G', S]
        ranks = np.nonzero(surplus.any(axis=1))[0]
        if ranks.size == 0:
            raise ValueError(
                f"expert {int(e)} has no surviving copy and no surplus replica is left to overwrite "
                f"({lost.size} experts lost in this layer); serve with more redundant slots"
            )
        g = ranks[np.argmin(share.sum(axis=1)[ranks])]  # least-loaded survivor with a surplus replica
        local = np.nonzero(surplus[g])[0]
        s = local[np.argmax(copies[row[g * S + local]])]  # its replica whose expert has the most copies
        copies[row[g * S + s]] -= 1
        row[g * S + s] = e
        copies[e] = 1
    return row, int(lost.size)


def failover_map(placement: Placement, lost_ranks: Sequence[int]) -> tuple[Placement, int]:
    """The placement to serve on the ranks that survive ``lost_ranks``, and the experts to reload.

    Args:
        placement: the placement in service, ``[L, G * S]``.
        lost_ranks: ranks of ``placement`` that are gone.

    Returns:
        ``(map on the survivors [L, G' * S] with ep_size G' = G - lost, reloads)``: ``reloads`` counts
        the (layer, expert) pairs with no surviving copy, each loaded into one slot from the checkpoint.

    Raises:
        ValueError: bad ranks, no survivor, or an expert that cannot be placed without dropping the last
            copy of another (too few redundant slots).
    """
    t = placement.topology
    S, E = t.slots_per_gpu, placement.num_logical_experts
    alive = survivors(t.ep_size, lost_ranks)
    kept = placement.physical_to_logical_map.reshape(placement.num_layers, t.ep_size, S)[
        :, alive
    ]  # [L, G', S]
    rows, reloads = [], 0
    for l in range(placement.num_layers):
        row, n = _fill_row(kept[l].reshape(-1), S, E)
        rows.append(row)
        reloads += n
    topo = Topology(len(alive), len(alive) * S, _surviving_nodes(t, alive))
    lost = sorted({int(r) for r in lost_ranks})
    prov = {"failover": {"lost_ranks": lost, "survivors": alive, "reloads": reloads}}
    return Placement(np.stack(rows), E, topo, placement.layer_ids, prov), reloads
