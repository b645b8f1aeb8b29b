"""The one migration protocol of both runtimes: slot moves, packed transfer with checksums, staging,
and a commit on every rank or an abort on every rank.

A runtime describes the experts it serves as a :class:`SlotBank` (the rows it serves now and, per row,
the tensors ``[S, ...]`` whose leading index is a local slot) and calls :func:`migrate_slots` with a
``switch`` callback that points its routing at the new rows. The EP layer does so in
:func:`runtime_hooks.migrate.migrate_layer_placement` (tensors ``slot_w1``, ``slot_w2``), Hugging Face
models in :func:`runtime_hooks.hf_serve_migrate.migrate_model` (the model's own expert tensors).

Protocol (every rank of the group calls :func:`migrate_slots` between the same two steps):

1. Plan (:func:`plan_migration`, deterministic, identical on every rank): each slot whose logical
   expert changes receives it from a slot that holds the expert in the OLD placement, preferring the
   same rank (a local copy), then the same node, then the source with the fewest sends so far.
2. Transfer on a fresh process group made for this attempt (gloo closes a pair for good after a
   point-to-point timeout, so the serving group must never carry the move). A slot's tensors travel
   packed in one flat buffer (:func:`pack_slot`) with the sender's :func:`checksum` beside it; each
   rank batches its ``isend``/``irecv`` with ``batch_isend_irecv`` into staging buffers (local copies
   are staged too) and waits with one deadline (``timeout``). Every staged buffer is then checked
   against its checksum: a slot that arrives corrupted fails the attempt.
3. Decide through the key-value store, not a collective (a collective cannot finish when one rank is
   stuck): each rank posts ``ok``/``fail``; each waits for all flags until the deadline and proposes
   ``commit`` only when it saw every flag ``ok``; the first proposal written with ``compare_set`` wins
   and every rank follows that one decision (a late rank reads it).
4. Commit: staging is copied into the slots and ``switch`` moves routing to the new rows, on every rank
   in the same call. Abort: nothing changes. Either way the staging buffers are dropped and the transfer
   group destroyed; :func:`live_staging_buffers` counts staging tensors still alive (0 after return).

``MigrationResult.moved_slots`` equals :func:`placement.metrics.moved_slots` (old, new);
``moved_bytes`` sums the bytes of the moved slots (docs/metrics.md), ``network_bytes`` those of the
moves that crossed ranks.

Fault injection (tests, :class:`FaultSpec` for rank ``r``): ``raise`` (rank r raises after posting half
its sends), ``stall`` (it posts nothing for ``stall_s`` seconds, so its peers time out), ``corrupt``
(after the transfer one value of its first staged buffer is changed, as if it arrived corrupted; a rank
that stages nothing corrupts nothing).

Shapes: L rows, P slots per row, S slots per rank, n packed values of one slot.
"""

from __future__ import annotations

import datetime
import functools
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from placement.model import Placement

log = logging.getLogger(__name__)

__all__ = [
    "FaultSpec",
    "MigrationResult",
    "SlotBank",
    "SlotMove",
    "checksum",
    "live_staging_buffers",
    "migrate_slots",
    "pack_slot",
    "plan_migration",
    "slot_bytes",
    "transfer_and_decide",
    "unpack_slot",
]

_LIVE_STAGING: weakref.WeakSet = weakref.WeakSet()


def live_staging_buffers() -> int:
    """Number of migration staging tensors still referenced anywhere (Python or C++) in this process."""
    import gc

    gc.collect()
    return len(_LIVE_STAGING)


@dataclass(frozen=True)
class SlotMove:
    """Slot ``slot`` (global id) of row ``layer`` gets expert ``expert`` copied from old slot ``src_slot``."""

    layer: int
    slot: int
    expert: int
    src_slot: int
    src_rank: int
    dst_rank: int


@dataclass(frozen=True)
class MigrationResult:
    """How a placement change ended on this rank (identical ``committed`` and ``reason`` on every rank).

    ``moved_slots``/``moved_bytes``/``network_bytes`` describe the plan; its weights are in place only
    when ``committed``. ``reason`` is ``committed``, ``no slot changes`` or ``abort: <first failure>``.
    """

    moved_slots: int
    moved_bytes: int
    committed: bool
    reason: str
    network_bytes: int = 0
    wall_time_s: float = 0.0


@dataclass(frozen=True)
class FaultSpec:
    """Test-only fault injection on ``rank``: ``mode`` ``raise`` (after half the sends), ``stall`` (sleep
    ``stall_s`` before posting anything) or ``corrupt`` (change one staged value after the transfer)."""

    rank: int
    mode: str = "raise"
    stall_s: float = 0.0


@dataclass(frozen=True)
class SlotBank:
    """The expert slots one runtime migrates on this rank.

    Attributes:
        placement: the rows served now, ``[L, P]``.
        tensors: per row, the slot tensors ``[S, ...]`` (one slot per leading index), updated in place.
        rank / world_size: this rank and the group size (the transfer group spans ranks ``0..G-1``).
        backend: the group's backend (``gloo`` or ``nccl``). device: where the slot tensors live.
    """

    placement: Placement
    tensors: tuple[tuple[torch.Tensor, ...], ...]
    rank: int
    world_size: int
    backend: str
    device: torch.device


def plan_migration(old: Placement, new: Placement) -> list[SlotMove]:
    """Slot-level diff with a source for every changed slot, over all rows.

    Args:
        old, new: placements with the same topology, experts and number of rows.
    Returns:
        moves sorted by (layer, slot); ``len == placement.metrics.moved_slots(old, new)``.
    """
    if old.topology != new.topology or old.num_logical_experts != new.num_logical_experts:
        raise ValueError(
            f"cannot migrate between placements of different shape: {old.topology} "
            f"E={old.num_logical_experts} vs {new.topology} E={new.num_logical_experts}"
        )
    if old.num_layers != new.num_layers:
        raise ValueError(
            f"old placement has {old.num_layers} rows, new has {new.num_layers}; select matching layers"
        )
    t = old.topology
    gpu_of, node_of_gpu = t.gpu_of_slot, t.node_of_gpu
    moves: list[SlotMove] = []
    for l in range(old.num_layers):
        a, b = old.physical_to_logical_map[l], new.physical_to_logical_map[l]  # [P]
        sends = np.zeros(t.ep_size, dtype=np.int64)  # sends assigned to each rank so far
        for p in np.nonzero(a != b)[0]:
            e, dst = int(b[p]), int(gpu_of[p])
            cands = np.nonzero(a == e)[0]  # old slots of expert e (at least one: old is valid)
            src_gpu = gpu_of[cands]
            # same rank first, then same node, then the least-busy sender, then the lowest slot
            key = np.lexsort(
                (cands, sends[src_gpu], node_of_gpu[src_gpu] != node_of_gpu[dst], src_gpu != dst)
            )
            s = int(cands[key[0]])
            src = int(gpu_of[s])
            if src != dst:
                sends[src] += 1
            moves.append(SlotMove(l, int(p), e, s, src, dst))
    return moves


# ---------------------------------------------------------------------------------------------------
# Packing one slot
# ---------------------------------------------------------------------------------------------------
def checksum(flat: torch.Tensor) -> torch.Tensor:
    """int64 ``[2]`` over the bytes of ``flat`` (any dtype): sum of 32-bit words and their sum weighted by
    position (wrapping in int64), so a changed, swapped or shifted value changes it."""
    raw = flat.detach().contiguous().reshape(-1).view(torch.uint8)  # [bytes]
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw  # [w]
    w = words.to(torch.int64)
    pos = torch.arange(1, w.numel() + 1, dtype=torch.int64, device=w.device)
    return torch.stack([w.sum(), (w * pos).sum()]).cpu()


def pack_slot(tensors: Sequence[torch.Tensor], local_slot: int) -> torch.Tensor:
    """Row ``local_slot`` of every slot tensor ``[S, ...]``, flattened into one new buffer ``[n]``."""
    return torch.cat([t[local_slot].detach().reshape(-1) for t in tensors])


def unpack_slot(tensors: Sequence[torch.Tensor], local_slot: int, flat: torch.Tensor) -> None:
    """Copy ``flat [n]`` (as :func:`pack_slot` made it) back into row ``local_slot`` of every tensor."""
    start = 0
    with torch.no_grad():
        for t in tensors:
            row = t[local_slot]
            row.copy_(flat[start : start + row.numel()].view(row.shape))
            start += row.numel()


def slot_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of one slot's expert: one row of every slot tensor."""
    return sum(t[0].numel() * t.element_size() for t in tensors)


def _empty_slot(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """An uninitialised receive buffer ``[n]`` of :func:`pack_slot`'s dtype and length."""
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    return torch.empty(sum(t[0].numel() for t in tensors), dtype=dtype, device=tensors[0].device)


# ---------------------------------------------------------------------------------------------------
# Transfer into staging
# ---------------------------------------------------------------------------------------------------
@dataclass
class _Attempt:
    """One attempt's state, kept by :func:`migrate_slots` so that it outlives a failure.

    ``staging``: (row, local slot) -> (buffer ``[n]``, expected checksum int64 ``[2]``, move);
    ``keep``: send buffers that must stay alive until their requests finish; ``reqs``: posted requests;
    ``group``: the process group made for this attempt (None until made).
    """

    staging: dict = field(default_factory=dict)
    keep: list = field(default_factory=list)
    reqs: list = field(default_factory=list)
    group: object = None


def _ops(bank: SlotBank, moves: list[SlotMove], group, attempt: _Attempt) -> tuple[list, list]:
    """Staging for the slots this rank receives (local copies done now): ``(irecv ops, isend ops)``.

    Tags: ``2 i`` for the buffer and ``2 i + 1`` for the checksum of ``moves[i]``.
    """
    import torch.distributed as dist

    me, S = bank.rank, bank.placement.topology.slots_per_gpu
    recvs, sends = [], []
    for i, m in enumerate(moves):
        tensors = bank.tensors[m.layer]
        if m.dst_rank == me:
            if m.src_rank == me:  # local copy from the old slot
                buf = pack_slot(tensors, m.src_slot - me * S)
                cks = checksum(buf)
            else:
                buf = _empty_slot(tensors)
                cks = torch.empty(2, dtype=torch.int64, device=buf.device)
                recvs.append(dist.P2POp(dist.irecv, buf, m.src_rank, group, tag=2 * i))
                recvs.append(dist.P2POp(dist.irecv, cks, m.src_rank, group, tag=2 * i + 1))
            _LIVE_STAGING.add(buf)
            attempt.staging[(m.layer, m.slot - me * S)] = (buf, cks, m)
        elif m.src_rank == me:
            buf = pack_slot(tensors, m.src_slot - me * S)
            cks = checksum(buf).to(buf.device)
            attempt.keep.extend((buf, cks))
            sends.append(dist.P2POp(dist.isend, buf, m.dst_rank, group, tag=2 * i))
            sends.append(dist.P2POp(dist.isend, cks, m.dst_rank, group, tag=2 * i + 1))
    return recvs, sends


def _transfer(
    bank: SlotBank,
    moves: list[SlotMove],
    attempt: _Attempt,
    timeout: float,
    deadline: float,
    faults: Sequence[FaultSpec],
) -> None:
    """Move the slots into staging on a fresh group, waiting until ``deadline``, and verify them.

    Raises on any failure; ``attempt`` collects the staging buffers, the requests and the group as they
    are made, so the caller can decide and clean up after a failure.
    """
    import torch.distributed as dist

    me = bank.rank
    fault = next((f for f in faults if f.rank == me), None)
    attempt.group = group = dist.new_group(
        ranks=list(range(bank.world_size)),
        backend=bank.backend,
        timeout=datetime.timedelta(seconds=max(timeout, 1.0)),
    )
    if bank.backend == "nccl":
        # NCCL builds a communicator lazily; a first batch_isend_irecv that some ranks skip (no moves)
        # is undefined, so initialise it with one collective every rank joins.
        dist.all_reduce(torch.zeros(1, device=bank.device), group=group)
    if fault is not None and fault.mode == "stall":
        time.sleep(fault.stall_s)
    recvs, sends = _ops(bank, moves, group, attempt)
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
    if bank.device.type == "cuda":
        torch.cuda.synchronize(bank.device)
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


def _finish(
    bank: SlotBank,
    new: Placement,
    switch: Callable[[Placement], None],
    attempt: _Attempt,
    commit: bool,
    prefix: str,
) -> None:
    """Commit: staging into the slots, ``switch(new)``. Always: drop the buffers, destroy the group."""
    import torch.distributed as dist

    try:
        if commit:
            for (row, ls), (buf, _, _) in attempt.staging.items():  # between steps: the new weights
                unpack_slot(bank.tensors[row], ls, buf)
            switch(new)
    finally:
        attempt.staging.clear()
        attempt.keep.clear()
        attempt.reqs.clear()
        if attempt.group is not None:
            try:
                dist.destroy_process_group(attempt.group)
            except Exception as exc:  # noqa: BLE001
                log.warning("migration %s: destroying the transfer group failed: %s", prefix, exc)


# ---------------------------------------------------------------------------------------------------
# Deciding
# ---------------------------------------------------------------------------------------------------
def _decide(
    store, prefix: str, rank: int, world: int, ok: bool, reason: str, deadline: float
) -> tuple[bool, str]:
    """Agree on commit/abort through the store (first compare_set wins). Returns (commit, reason)."""
    store.set(f"{prefix}/flag/{rank}", "ok" if ok else f"fail: {reason}"[:500])
    keys = [f"{prefix}/flag/{r}" for r in range(world)]
    proposal = "commit"
    if not ok:
        proposal = f"abort: rank {rank}: {reason}"[:500]
    else:
        try:
            store.wait(keys, datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.05)))
            for r, key in enumerate(keys):
                v = store.get(key).decode()
                if v != "ok":
                    proposal = f"abort: rank {r}: {v}"[:500]
                    break
        except Exception as exc:  # noqa: BLE001 - a missing flag is a timeout, whatever the store raises
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            proposal = f"abort: ranks {missing} did not report before the timeout ({type(exc).__name__})"
    decision = store.compare_set(f"{prefix}/decision", "", proposal).decode()
    return decision == "commit", decision


def transfer_and_decide(
    transfer: Callable[[], None], store, prefix: str, rank: int, world: int, deadline: float
) -> tuple[bool, str]:
    """Run this rank's part of a migration, then agree with every rank: ``(commit, decision)``.

    Any failure in ``transfer`` aborts the migration everywhere; a decision store that cannot be
    reached never lets a rank commit alone.
    """
    ok, reason = True, ""
    try:
        transfer()
    except Exception as exc:  # noqa: BLE001 - any failure here aborts the migration everywhere
        ok, reason = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        log.warning("migration %s: rank %d failed during transfer: %s", prefix, rank, reason)
    try:
        return _decide(store, prefix, rank, world, ok, reason, deadline)
    except Exception as exc:  # noqa: BLE001 - store unreachable: never commit alone
        return False, f"abort: decision store failed on rank {rank}: {exc}"


def _decision_store(store):
    """``store``, else the launcher's store, else the default process group's."""
    import torch.distributed as dist

    from runtime_hooks.launcher import current_store

    if store is None:
        store = current_store()
    if store is None:
        store = dist.distributed_c10d._get_default_store()
    return store


# ---------------------------------------------------------------------------------------------------
# The collective call
# ---------------------------------------------------------------------------------------------------
def migrate_slots(
    bank: SlotBank,
    new: Placement,
    switch: Callable[[Placement], None],
    *,
    prefix: str,
    timeout: float = 10.0,
    faults: Sequence[FaultSpec] = (),
    store=None,
) -> MigrationResult:
    """Collective: move ``bank`` from the rows it serves to ``new`` (``[L, P]``). Commits on every rank
    or on none; see the module docstring.

    Args:
        bank: this rank's slots and the rows they serve.
        new: the rows to serve (same topology, experts and number of rows as ``bank.placement``).
        switch: points the runtime's routing at ``new``; called on commit, or at once when no slot moves.
        prefix: store-key prefix, unique per attempt and the same on every rank.
        timeout: seconds for the transfer and the decision; a rank that does not report by then aborts it.
        faults: test-only fault injection (see the module docstring).
        store: the key-value store to decide through (default: the launcher's, else the default group's).

    Returns:
        :class:`MigrationResult`; ``committed`` and ``reason`` agree on every rank.
    """
    start = time.monotonic()
    deadline = start + float(timeout)
    moves = plan_migration(bank.placement, new)  # ValueError when the shapes differ
    if not moves:
        switch(new)
        return MigrationResult(0, 0, True, "no slot changes", 0, time.monotonic() - start)
    sizes = [slot_bytes(bank.tensors[m.layer]) for m in moves]  # [moves]
    moved_bytes = sum(sizes)
    net = sum(b for b, m in zip(sizes, moves) if m.src_rank != m.dst_rank)
    attempt = _Attempt()
    commit, decision = transfer_and_decide(
        lambda: _transfer(bank, moves, attempt, timeout, deadline, tuple(faults)),
        _decision_store(store),
        prefix,
        bank.rank,
        bank.world_size,
        deadline,
    )
    _finish(bank, new, switch, attempt, commit, prefix)
    wall = time.monotonic() - start
    if commit:
        log.info("migration %s committed: %d slots, %d network bytes", prefix, len(moves), net)
        return MigrationResult(len(moves), moved_bytes, True, "committed", net, wall)
    log.warning("migration %s aborted: %s", prefix, decision)
    return MigrationResult(len(moves), moved_bytes, False, decision, net, wall)
