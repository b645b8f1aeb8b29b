"""Applying a new placement at run time: slot-level diff, point-to-point weight moves, atomic swap.

Protocol (every rank of the layer's group calls :func:`apply_placement` between the same two steps):

1. Plan (:func:`plan_migration`, deterministic, identical on every rank): each slot whose logical
   expert changes receives it from a slot that holds the expert in the OLD placement, preferring the
   same rank (a local copy), then the same node, then the source with the fewest sends so far.
2. Transfer on a fresh process group made for this attempt (gloo closes a pair for good after a
   point-to-point timeout, so the serving group must never carry the move): each rank batches its
   ``isend``/``irecv`` with ``batch_isend_irecv`` into staging buffers, local copies go to staging
   too, and waits with one deadline (``timeout``).
3. Decide through the key-value store, not a collective (a collective cannot finish when one rank is
   stuck): each rank posts ``ok``/``fail``; each waits for all flags until the deadline and proposes
   ``commit`` only when it saw every flag ``ok``; the first proposal written with ``compare_set`` wins and
   every rank follows that one decision (a late rank reads it).
4. Commit: staging is copied into the slots and routing switches to the new placement, on every rank in
   the same call. Abort: nothing changes. Either way the staging buffers are dropped and the transfer
   group destroyed; :func:`live_staging_buffers` counts staging tensors still alive (0 after return).

``MigrationResult.moved_slots`` equals :func:`placement.metrics.moved_slots` (old, new) for the layer;
``moved_bytes = moved_slots x expert bytes`` (docs/metrics.md), ``network_bytes`` counts the moves that
crossed ranks.

Fault injection (tests): ``fault=FaultSpec(rank=r, mode="raise")`` makes rank r raise after posting half
its sends; ``mode="stall"`` makes rank r post nothing for ``stall_s`` seconds (its peers time out).
"""

from __future__ import annotations

import datetime
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from placement.model import Placement

log = logging.getLogger(__name__)

__all__ = [
    "transfer_and_decide",
    "FaultSpec",
    "MigrationResult",
    "SlotMove",
    "apply_placement",
    "live_staging_buffers",
    "plan_migration",
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
    """Test-only fault injection: ``mode`` ``raise`` (after half the sends) or ``stall`` (sleep ``stall_s``)."""

    rank: int
    mode: str = "raise"
    stall_s: float = 0.0


def plan_migration(old: Placement, new: Placement) -> list[SlotMove]:
    """Slot-level diff with a source for every changed slot, over all rows.

    Args:
        old, new: placements with the same topology, experts and number of rows.
    Returns:
        moves sorted by (layer, slot); ``len == placement.metrics.moved_slots(old, new)``.
    """
    if old.topology != new.topology or old.num_logical_experts != new.num_logical_experts:
        raise ValueError(
            f"cannot migrate between placements of different shape: {old.topology} E={old.num_logical_experts} "
            f"vs {new.topology} E={new.num_logical_experts}"
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


@dataclass
class _Transfer:
    """One attempt's transfer state, owned by :func:`apply_placement` so that it outlives failures.

    ``staging``: local slot -> (w1 ``[2f, d]``, w2 ``[d, f]``) received weights; ``reqs``: posted
    point-to-point requests; ``group``: the process group made for this attempt (None until made).
    """

    staging: dict[int, tuple] = field(default_factory=dict)
    reqs: list = field(default_factory=list)
    group: object = None


def _expert_bytes(layer_obj) -> int:
    """Bytes of one expert's weights (``slot_w1 [S, 2f, d]`` and ``slot_w2 [S, d, f]`` rows)."""
    return int(
        layer_obj.slot_w1[0].numel() * layer_obj.slot_w1.element_size()
        + layer_obj.slot_w2[0].numel() * layer_obj.slot_w2.element_size()
    )


def _receive_ops(layer_obj, moves: list[SlotMove], group, staging: dict[int, tuple]) -> list:
    """Staging buffers for every slot this rank receives (local copies done now); the irecv ops.

    Tags: ``2 i`` for w1 and ``2 i + 1`` for w2 of ``moves[i]``.
    """
    import torch
    import torch.distributed as dist

    me, S = layer_obj.rank, layer_obj.slots_per_gpu
    ops = []
    for i, m in enumerate(moves):
        if m.dst_rank == me:
            b1 = torch.empty_like(layer_obj.slot_w1[0])
            b2 = torch.empty_like(layer_obj.slot_w2[0])
            _LIVE_STAGING.add(b1)
            _LIVE_STAGING.add(b2)
            staging[m.slot - me * S] = (b1, b2)
            if m.src_rank == me:  # local copy from the old slot
                b1.copy_(layer_obj.slot_w1[m.src_slot - me * S])
                b2.copy_(layer_obj.slot_w2[m.src_slot - me * S])
            else:
                ops.append(dist.P2POp(dist.irecv, b1, m.src_rank, group, tag=2 * i))
                ops.append(dist.P2POp(dist.irecv, b2, m.src_rank, group, tag=2 * i + 1))
    return ops


def _send_ops(layer_obj, moves: list[SlotMove], group) -> list:
    """The isend ops of this rank's old slots that move to other ranks (tags as in :func:`_receive_ops`)."""
    import torch.distributed as dist

    me, S = layer_obj.rank, layer_obj.slots_per_gpu
    sends = []
    for i, m in enumerate(moves):
        if m.src_rank == me and m.dst_rank != me:
            ls = m.src_slot - me * S
            sends.append(dist.P2POp(dist.isend, layer_obj.slot_w1[ls], m.dst_rank, group, tag=2 * i))
            sends.append(dist.P2POp(dist.isend, layer_obj.slot_w2[ls], m.dst_rank, group, tag=2 * i + 1))
    return sends


def _transfer(
    layer_obj,
    moves: list[SlotMove],
    state: _Transfer,
    timeout: float,
    deadline: float,
    fault: FaultSpec | None,
) -> None:
    """Move the weights into staging on a fresh group, waiting until ``deadline``; raises on any failure.

    ``state`` collects the staging buffers, the requests and the group as they are made, so the caller
    can decide and clean up after a failure.
    """
    import torch
    import torch.distributed as dist

    me = layer_obj.rank
    state.group = group = dist.new_group(
        ranks=list(range(layer_obj.world_size)),
        backend=layer_obj.backend,
        timeout=datetime.timedelta(seconds=max(timeout, 1.0)),
    )
    if layer_obj.backend == "nccl":
        # NCCL builds a communicator lazily; a first batch_isend_irecv that some ranks skip (no moves)
        # is undefined, so initialise it with one collective every rank joins.
        dist.all_reduce(torch.zeros(1, device=layer_obj.device), group=group)
    if fault is not None and fault.rank == me and fault.mode == "stall":
        time.sleep(fault.stall_s)
    my_sends = [m for m in moves if m.src_rank == me and m.dst_rank != me]
    ops = _receive_ops(layer_obj, moves, group, state.staging)
    sends = _send_ops(layer_obj, moves, group)
    if fault is not None and fault.rank == me and fault.mode == "raise":
        half = sends[: 2 * ((len(my_sends) + 1) // 2)]
        if half:
            state.reqs.extend(dist.batch_isend_irecv(half))
        raise RuntimeError(
            f"injected fault on rank {me} after posting {len(half) // 2} of {len(my_sends)} sends"
        )
    ops.extend(sends)
    if ops:
        state.reqs.extend(dist.batch_isend_irecv(ops))
    for r in state.reqs:
        r.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    if layer_obj.device.type == "cuda":
        torch.cuda.synchronize(layer_obj.device)


def _finish(layer_obj, new1: Placement, state: _Transfer, commit: bool, prefix: str) -> None:
    """Commit: copy staging into the slots and switch routing to ``new1``. Always: drop the staging
    buffers and requests, destroy the transfer group."""
    import torch.distributed as dist

    try:
        if commit:
            for ls, (b1, b2) in state.staging.items():  # between steps: swap in the new weights
                layer_obj.slot_w1[ls].copy_(b1)
                layer_obj.slot_w2[ls].copy_(b2)
            layer_obj._set_placement(new1)
    finally:
        state.staging.clear()
        state.reqs.clear()
        if state.group is not None:
            try:
                dist.destroy_process_group(state.group)
            except Exception as exc:  # noqa: BLE001
                log.warning("migration %s: destroying the transfer group failed: %s", prefix, exc)


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


def apply_placement(
    layer_obj, new_placement: Placement, layer: int = 0, timeout: float = 10.0, fault: FaultSpec | None = None
) -> MigrationResult:
    """Collective: migrate ``layer_obj`` (an :class:`~runtime_hooks.ep_layer.EPMoELayer`) to row ``layer``
    of ``new_placement``. Commits on every rank or on none; see the module docstring.

    Steps: plan -> transfer into staging -> decide through the store -> commit or abort, clean up.
    """
    import torch.distributed as dist

    from runtime_hooks.launcher import current_store

    start = time.monotonic()
    deadline = start + float(timeout)
    new1 = new_placement.select_layers([layer])
    moves = plan_migration(layer_obj.placement, new1)
    expert_bytes = _expert_bytes(layer_obj)
    moved = len(moves)
    net = sum(1 for m in moves if m.src_rank != m.dst_rank) * expert_bytes
    if not moves:
        layer_obj._set_placement(new1)
        return MigrationResult(0, 0, True, "no slot changes", 0, time.monotonic() - start)
    store = layer_obj.store or current_store()
    if store is None:
        store = dist.distributed_c10d._get_default_store()
    me, G = layer_obj.rank, layer_obj.world_size
    layer_obj.migration_epoch += 1
    prefix = f"moe-migrate/{layer_obj.name}/{layer_obj.migration_epoch}"
    state = _Transfer()
    commit, decision = transfer_and_decide(
        lambda: _transfer(layer_obj, moves, state, timeout, deadline, fault), store, prefix, me, G, deadline
    )
    _finish(layer_obj, new1, state, commit, prefix)
    wall = time.monotonic() - start
    if commit:
        return MigrationResult(moved, moved * expert_bytes, True, "committed", net, wall)
    log.warning("migration %s aborted: %s", prefix, decision)
    return MigrationResult(moved, moved * expert_bytes, False, decision, net, wall)
