"""The map to serve on the surviving ranks after a rank loss: the solver's failover map, as the runtime
serves it.

:func:`failover_map` is the one entry the runtime calls (:mod:`runtime_hooks.pd.pool`,
:mod:`runtime_hooks.pd.rank_loss`, the CLI's pre-checks). It is :func:`solver.failover.failover_map`
with no move budget beyond the forced reloads (``max_moves=0``): the survivors keep their slots (rank
``g`` of the survivors, in ascending order of their old ranks, keeps its old slot block) and only the
experts with no surviving copy are reloaded, each over a surplus replica; nothing that still has a copy
moves, so the runtime reloads exactly those experts from the checkpoint. The solver is imported when a
rank is lost, never on the serving path.

Shapes: L layers, G ranks before the loss, S slots per rank, E logical experts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from placement.model import Placement

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


def failover_map(
    placement: Placement, lost_ranks: Sequence[int], load: np.ndarray | None = None
) -> tuple[Placement, int]:
    """The placement to serve on the ranks that survive ``lost_ranks``, and the experts to reload.

    Args:
        placement: the placement in service, ``[L, G * S]``.
        lost_ranks: ranks of ``placement`` that are gone.
        load: ``[L, E]`` tokens per expert the reloads are balanced for (None: every expert equally
            popular).

    Returns:
        ``(map on the survivors [L, G' * S] with ep_size G' = G - lost, reloads)``: ``reloads`` counts
        the (layer, expert) pairs with no surviving copy, each loaded into one slot from the checkpoint.

    Raises:
        ValueError: bad ranks, no survivor, or too few surviving slots for the experts.
    """
    from solver.failover import FailoverOptions
    from solver.failover import failover_map as solver_failover_map

    survivors(placement.topology.ep_size, lost_ranks)  # the runtime's own wording for a bad rank
    w = np.ones((placement.num_layers, placement.num_logical_experts)) if load is None else load
    new, report = solver_failover_map(placement, w, list(lost_ranks), FailoverOptions(max_moves=0))
    return new, report.total_reloads
