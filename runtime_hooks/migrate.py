"""Applying a new placement to an :class:`~runtime_hooks.ep_layer.EPMoELayer` at run time.

:func:`migrate_layer_placement` moves the layer's slots (``slot_w1 [S, 2f, d]``, ``slot_w2 [S, d, f]``)
to a row of a new placement with the shared protocol of :mod:`runtime_hooks.migration_core` (plan,
packed transfer with checksums into staging, commit on every rank or abort on every rank), then points
the layer's routing at the new row. Every rank of the layer's group calls it between the same two steps.

``MigrationResult.moved_slots`` equals :func:`placement.metrics.moved_slots` (old, new) for the layer;
``moved_bytes = moved_slots x expert bytes`` (docs/metrics.md), ``network_bytes`` counts the moves that
crossed ranks.

Fault injection (tests): ``fault=FaultSpec(rank=r, mode="raise")`` makes rank r raise after posting half
its sends; ``mode="stall"`` makes rank r post nothing for ``stall_s`` seconds (its peers time out);
``mode="corrupt"`` changes one value it staged (the checksum check fails).
"""

from __future__ import annotations

from placement.model import Placement
from runtime_hooks.migration_core import FaultSpec, MigrationResult, SlotBank, migrate_slots

__all__ = ["migrate_layer_placement"]


def migrate_layer_placement(
    layer_obj, new_placement: Placement, layer: int = 0, timeout: float = 10.0, fault: FaultSpec | None = None
) -> MigrationResult:
    """Collective: migrate ``layer_obj`` (an :class:`~runtime_hooks.ep_layer.EPMoELayer`) to row ``layer``
    of ``new_placement``. Commits on every rank or on none; on abort the old row keeps serving.

    Steps: plan -> transfer into staging -> decide through the store -> commit or abort, clean up
    (:func:`runtime_hooks.migration_core.migrate_slots`).
    """
    new1 = new_placement.select_layers([layer])
    bank = SlotBank(
        placement=layer_obj.placement,
        tensors=((layer_obj.slot_w1, layer_obj.slot_w2),),
        rank=layer_obj.rank,
        world_size=layer_obj.world_size,
        backend=layer_obj.backend,
        device=layer_obj.device,
    )
    layer_obj.migration_epoch += 1  # the same count on every rank: the layer's calls are collective
    return migrate_slots(
        bank,
        new1,
        layer_obj._set_placement,
        prefix=f"moe-migrate/{layer_obj.name}/{layer_obj.migration_epoch}",
        timeout=timeout,
        faults=() if fault is None else (fault,),
        store=layer_obj.store,
    )
