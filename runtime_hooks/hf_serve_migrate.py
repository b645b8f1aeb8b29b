"""Atomic migration of a Hugging Face model's placed experts between ranks, while it serves.

:func:`migrate_model` moves a model that :func:`runtime_hooks.hf.apply_placement` sharded to a new
placement (all its MoE layers at once), between two forward calls, with the protocol of
:mod:`runtime_hooks.migrate`:

1. Plan with :func:`runtime_hooks.migrate.plan_migration` (deterministic, the same on every rank): each
   slot whose expert changes receives it from an old slot holding it, preferring a local copy.
2. Transfer on a fresh process group made for this attempt. The slot's expert tensors (the model's own
   ``gate_up_proj``/``up_proj``/``down_proj`` rows and biases) travel packed in one flat buffer, with the
   sender's checksum beside it (int64 ``[2]``: word sum and position-weighted word sum of its bytes).
   Every staged buffer, local copies included, is checked against its checksum after the transfer: a
   tensor that arrives corrupted fails the attempt.
3. Decide through the launcher's key-value store (:func:`runtime_hooks.migrate.transfer_and_decide`): commit only
   when every rank reported ``ok`` before the deadline; the first proposal wins everywhere.
4. Commit: staging is copied into the slot tensors and every layer's routing tables switch to the new
   rows, on every rank in the same call. Abort: the old placement keeps serving, untouched.

Shapes: L MoE layers, P slots per layer, S slots per rank, n = packed floats of one expert.

Fault injection (tests, :class:`runtime_hooks.migrate.FaultSpec`): ``raise`` (the rank raises after
posting half its sends), ``stall`` (it waits ``stall_s`` before posting anything), ``corrupt`` (after the
transfer one value of its first staged buffer is changed, as if it arrived corrupted; a rank that
stages nothing corrupts nothing).
"""

from __future__ import annotations

import datetime
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from placement.model import Placement
from runtime_hooks.migrate import FaultSpec, MigrationResult, SlotMove, plan_migration, transfer_and_decide

__all__ = ["checksum", "migrate_model", "row_checksums", "served_rows"]

log = logging.getLogger(__name__)

_ATTEMPTS = itertools.count(1)  # every rank calls migrate_model in the same order: the same numbers


def checksum(flat: torch.Tensor) -> torch.Tensor:
    """int64 ``[2]`` over the bytes of ``flat`` (any dtype): sum of 32-bit words and their sum weighted by
    position (wrapping in int64), so a changed, swapped or shifted value changes it."""
    raw = flat.detach().contiguous().reshape(-1).view(torch.uint8)  # [bytes]
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw  # [w]
    w = words.to(torch.int64)
    pos = torch.arange(1, w.numel() + 1, dtype=torch.int64, device=w.device)
    return torch.stack([w.sum(), (w * pos).sum()]).cpu()


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


# ---------------------------------------------------------------------------------------------------
# Packing one slot's tensors
# ---------------------------------------------------------------------------------------------------
def _tensors(module) -> list[torch.Tensor]:
    """The module's per-slot expert tensors ``[S, ...]`` in :data:`runtime_hooks.hf._EXPERT_TENSORS` order."""
    from runtime_hooks.hf import _EXPERT_TENSORS

    found = (getattr(module, name, None) for name in _EXPERT_TENSORS)
    return [t for t in found if isinstance(t, torch.Tensor)]


def _pack(module, local_slot: int) -> torch.Tensor:
    """Local slot's expert tensors flattened into one new buffer ``[n]``."""
    return torch.cat([t[local_slot].detach().reshape(-1) for t in _tensors(module)])


def _unpack(module, local_slot: int, flat: torch.Tensor) -> None:
    """Copy ``flat [n]`` back into the local slot's rows of every expert tensor."""
    start = 0
    with torch.no_grad():
        for t in _tensors(module):
            row = t[local_slot]
            row.copy_(flat[start : start + row.numel()].view(row.shape))
            start += row.numel()


def row_checksums(model: torch.nn.Module) -> np.ndarray:
    """int64 ``[L, R, 2]``: :func:`checksum` of every row of every MoE layer's expert tensors (``R = E``
    before :func:`runtime_hooks.hf.apply_placement`, ``R = S`` local slots after)."""
    from runtime_hooks.hf import moe_experts

    out = []
    for module in moe_experts(model).values():
        rows = _tensors(module)[0].shape[0]
        out.append(torch.stack([checksum(_pack(module, r)) for r in range(rows)]).numpy())
    return np.stack(out)


def _slot_bytes(module) -> int:
    """Bytes of one slot's expert (all its tensors)."""
    return sum(t[0].numel() * t.element_size() for t in _tensors(module))


# ---------------------------------------------------------------------------------------------------
# Transfer
# ---------------------------------------------------------------------------------------------------
@dataclass
class _Attempt:
    """One attempt's state, kept by :func:`migrate_model` so that it outlives a failure.

    ``staging``: (layer, local slot) -> (buffer ``[n]``, expected checksum int64 ``[2]``, move);
    ``keep``: send buffers that must stay alive until their requests finish; ``reqs``: posted requests.
    """

    staging: dict = field(default_factory=dict)
    keep: list = field(default_factory=list)
    reqs: list = field(default_factory=list)
    group: object = None


def _ops(
    modules: list, moves: list[SlotMove], me: int, S: int, group, attempt: _Attempt
) -> tuple[list, list]:
    """Staging for the slots this rank receives (local copies done now): ``(irecv ops, isend ops)``.

    Tags: ``2 i`` for the buffer and ``2 i + 1`` for the checksum of ``moves[i]``.
    """
    import torch.distributed as dist

    recvs, sends = [], []
    for i, m in enumerate(moves):
        module = modules[m.layer]
        if m.dst_rank == me:
            if m.src_rank == me:  # local copy from the old slot
                buf = _pack(module, m.src_slot - me * S)
                cks = checksum(buf)
            else:
                buf = torch.empty_like(_pack(module, 0))
                cks = torch.empty(2, dtype=torch.int64)
                recvs.append(dist.P2POp(dist.irecv, buf, m.src_rank, group, tag=2 * i))
                recvs.append(dist.P2POp(dist.irecv, cks, m.src_rank, group, tag=2 * i + 1))
            attempt.staging[(m.layer, m.slot - me * S)] = (buf, cks, m)
        elif m.src_rank == me:
            buf = _pack(module, m.src_slot - me * S)
            cks = checksum(buf).to(buf.device)
            attempt.keep.extend((buf, cks))
            sends.append(dist.P2POp(dist.isend, buf, m.dst_rank, group, tag=2 * i))
            sends.append(dist.P2POp(dist.isend, cks, m.dst_rank, group, tag=2 * i + 1))
    return recvs, sends


def _transfer(
    modules: list, moves: list[SlotMove], attempt: _Attempt, timeout: float, deadline: float, faults
) -> None:
    """Move the weights into staging on a fresh group and verify them; raises on any failure."""
    import torch.distributed as dist

    from runtime_hooks.hf import _state

    state = _state(modules[0])
    me, G, S = state.rank, state.ranks, state.placement.topology.slots_per_gpu
    fault = next((f for f in faults if f.rank == me), None)
    attempt.group = group = dist.new_group(
        ranks=list(range(G)),
        backend=dist.get_backend(state.group),
        timeout=datetime.timedelta(seconds=max(timeout, 1.0)),
    )
    if fault is not None and fault.mode == "stall":
        time.sleep(fault.stall_s)
    recvs, sends = _ops(modules, moves, me, S, group, attempt)
    if fault is not None and fault.mode == "raise":
        half = sends[: 2 * ((len(sends) // 2 + 1) // 2)]
        if half:
            attempt.reqs.extend(dist.batch_isend_irecv(half))
        raise RuntimeError(
            f"injected fault on rank {me} after posting {len(half) // 2} of {len(sends) // 2} sends"
        )
    if recvs or sends:
        attempt.reqs.extend(dist.batch_isend_irecv(recvs + sends))
    for r in attempt.reqs:
        r.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    if fault is not None and fault.mode == "corrupt" and attempt.staging:
        buf = attempt.staging[min(attempt.staging)][0]
        buf[0] += 1  # as if one value arrived changed
    _verify(attempt.staging)


def _verify(staging: dict) -> None:
    """RuntimeError naming the first staged buffer whose checksum differs from the sender's."""
    for (layer, _), (buf, cks, m) in sorted(staging.items(), key=lambda kv: kv[0]):
        if not torch.equal(checksum(buf), cks.cpu()):
            raise RuntimeError(
                f"checksum mismatch: expert {m.expert} of MoE layer {layer} (slot {m.slot}) from rank "
                f"{m.src_rank} arrived corrupted"
            )


def _finish(modules: list, new: Placement, attempt: _Attempt, commit: bool, prefix: str) -> None:
    """Commit: staging into the slots, routing tables to ``new``. Always: drop buffers, destroy the group."""
    import torch.distributed as dist

    try:
        if commit:
            for (layer, ls), (buf, _, _) in attempt.staging.items():
                _unpack(modules[layer], ls, buf)
            _switch_rows(modules, new)
    finally:
        attempt.staging.clear()
        attempt.keep.clear()
        attempt.reqs.clear()
        if attempt.group is not None:
            try:
                dist.destroy_process_group(attempt.group)
            except Exception as exc:  # noqa: BLE001
                log.warning("migration %s: destroying the transfer group failed: %s", prefix, exc)


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


# ---------------------------------------------------------------------------------------------------
# The collective call
# ---------------------------------------------------------------------------------------------------
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
        model: a model :func:`runtime_hooks.hf.apply_placement` sharded.
        new: the placement to serve (same topology and experts as the served rows).
        timeout: seconds for the transfer and the decision; a rank that does not report by then aborts it.
        faults: test-only fault injection (see the module docstring).
        store: the key-value store to decide through (default: the launcher's, else the default group's).

    Returns:
        :class:`runtime_hooks.migrate.MigrationResult`; ``committed`` and ``reason`` agree on every rank.
    """
    import torch.distributed as dist

    from runtime_hooks.hf import moe_experts
    from runtime_hooks.launcher import current_store

    start = time.monotonic()
    deadline = start + float(timeout)
    modules = list(moe_experts(model).values())
    old = served_rows(model)
    moves = plan_migration(old, new)  # ValueError when the shapes differ
    attempt_no = next(_ATTEMPTS)
    slot_bytes = _slot_bytes(modules[0])
    if not moves:
        _switch_rows(modules, new)
        return MigrationResult(0, 0, True, "no slot changes", 0, time.monotonic() - start)
    store = store or current_store() or dist.distributed_c10d._get_default_store()
    me, G = dist.get_rank(), dist.get_world_size()
    prefix = f"moe-migrate-hf/{attempt_no}"
    attempt = _Attempt()
    commit, decision = transfer_and_decide(
        lambda: _transfer(modules, moves, attempt, timeout, deadline, tuple(faults)),
        store,
        prefix,
        me,
        G,
        deadline,
    )
    _finish(modules, new, attempt, commit, prefix)
    moved, net = len(moves), sum(1 for m in moves if m.src_rank != m.dst_rank) * slot_bytes
    wall = time.monotonic() - start
    if commit:
        log.info("migration %s committed: %d slots, %d network bytes", prefix, moved, net)
        return MigrationResult(moved, moved * slot_bytes, True, "committed", net, wall)
    log.warning("migration %s aborted: %s", prefix, decision)
    return MigrationResult(moved, moved * slot_bytes, False, decision, net, wall)
