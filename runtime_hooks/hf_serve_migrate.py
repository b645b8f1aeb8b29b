"""Atomic migration of a Hugging Face model's placed experts between ranks, while it serves.

:func:`migrate_model` moves a model that :func:`runtime_hooks.hf.apply_placement_to_model` sharded to a
new placement (all its MoE layers at once), between two forward calls, with the shared protocol of
:mod:`runtime_hooks.migration_core`: plan the slot moves, transfer each moved slot's expert tensors
(the model's own ``gate_up_proj``/``up_proj``/``down_proj`` rows and biases) packed in one flat buffer
with the sender's checksum, stage and verify them, then commit on every rank (staging into the slot
tensors, every layer's routing tables to the new rows) or abort on every rank (the old placement keeps
serving, untouched).

Shapes: L MoE layers, P slots per layer, S slots per rank, E logical experts.

Fault injection (tests, :class:`runtime_hooks.migration_core.FaultSpec`): ``raise``, ``stall`` and
``corrupt``, as :mod:`runtime_hooks.migration_core` describes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from placement.model import Placement
from runtime_hooks.migration_core import (
    FaultSpec,
    MigrationResult,
    SlotBank,
    checksum,
    migrate_slots,
    pack_slot,
)

__all__ = ["migrate_model", "row_checksums", "served_rows", "slot_tensors"]

_ATTEMPTS = itertools.count(1)  # every rank calls migrate_model in the same order: the same numbers


def served_rows(model: torch.nn.Module) -> Placement:
    """The placement rows the model serves now, one per MoE layer in model order (``[L, P]``)."""
    from runtime_hooks.hf import _state, moe_experts

    rows = [_state(m).placement for m in moe_experts(model).values()]
    first = rows[0]
    return Placement(
        np.concatenate([r.physical_to_logical_map for r in rows]),
        first.num_logical_experts,
        first.topology,
        tuple(r.layer_ids[0] for r in rows),
    )


def slot_tensors(module) -> tuple[torch.Tensor, ...]:
    """The module's per-slot expert tensors ``[S, ...]`` in :data:`runtime_hooks.hf._EXPERT_TENSORS` order."""
    from runtime_hooks.hf import _EXPERT_TENSORS

    found = (getattr(module, name, None) for name in _EXPERT_TENSORS)
    return tuple(t for t in found if isinstance(t, torch.Tensor))


def row_checksums(model: torch.nn.Module) -> np.ndarray:
    """int64 ``[L, R, 2]``: :func:`~runtime_hooks.migration_core.checksum` of every row of every MoE
    layer's expert tensors (``R = E`` before :func:`runtime_hooks.hf.apply_placement_to_model`,
    ``R = S`` local slots after)."""
    from runtime_hooks.hf import moe_experts

    out = []
    for module in moe_experts(model).values():
        tensors = slot_tensors(module)
        rows = tensors[0].shape[0]
        out.append(torch.stack([checksum(pack_slot(tensors, r)) for r in range(rows)]).numpy())
    return np.stack(out)


def _switch_rows(modules: list, new: Placement) -> None:
    """Every layer's routing to its row of ``new`` (between forward calls)."""
    from runtime_hooks.ep_layer import build_routing_tables
    from runtime_hooks.hf import _state

    for layer, module in enumerate(modules):
        state = _state(module)
        row = Placement(
            new.physical_to_logical_map[layer : layer + 1],
            new.num_logical_experts,
            new.topology,
            state.placement.layer_ids,
        )
        state.placement = row
        state.tables = build_routing_tables(row, 0, module.down_proj.device)


def migrate_model(
    model: torch.nn.Module,
    new: Placement,
    timeout: float = 10.0,
    faults: Sequence[FaultSpec] = (),
    store=None,
) -> MigrationResult:
    """Collective over the placement's group: move the model to ``new`` (``[L, P]``, one row per MoE
    layer in model order, as :func:`served_rows`). Commits on every rank or on none.

    Args:
        model: a model :func:`runtime_hooks.hf.apply_placement_to_model` sharded.
        new: the placement to serve (same topology and experts as the served rows).
        timeout: seconds for the transfer and the decision; a rank that does not report by then aborts it.
        faults: test-only fault injection (see the module docstring).
        store: the key-value store to decide through (default: the launcher's, else the default group's).

    Returns:
        :class:`runtime_hooks.migration_core.MigrationResult`; ``committed`` and ``reason`` agree on
        every rank.
    """
    import torch.distributed as dist

    from runtime_hooks.hf import _state, moe_experts

    modules = list(moe_experts(model).values())
    state = _state(modules[0])
    bank = SlotBank(
        placement=served_rows(model),
        tensors=tuple(slot_tensors(m) for m in modules),
        rank=state.rank,
        world_size=state.ranks,
        backend=str(dist.get_backend(state.group)),
        device=modules[0].down_proj.device,
    )
    return migrate_slots(
        bank,
        new,
        lambda rows: _switch_rows(modules, rows),
        prefix=f"moe-migrate-hf/{next(_ATTEMPTS)}",
        timeout=timeout,
        faults=faults,
        store=store,
    )
