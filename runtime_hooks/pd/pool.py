"""A pool of ranks that serve in lockstep and survive losing one: step agreement, liveness, failover.

Every step of a pool starts with :meth:`Pool.sync`: each member posts its state for the step in the
launcher's key-value store and reads every member's. A member whose state does not come within
``liveness`` seconds is taken as lost: the store, not a collective, finds it (a gloo collective with a
dead member may fail late or hang), and no collective of the step has started. The survivors then agree
on the lost set (the first proposal written with ``compare_set`` wins; a member it names exits, fenced),
make a process group of their own (``new_group(..., use_local_synchronization=True)``: only they join)
and :func:`fail_over` the model: the failover map on the survivors
(:func:`runtime_hooks.pd.failover_map.failover_map`), every slot that takes another expert loaded from
the checkpoint (the seeded model for a config), the routing tables and the group switched.

Shapes: L MoE layers, P slots per layer (G ranks x S), E logical experts.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from moe_placement.base.errors import MoePlacementError
from placement.model import Placement

__all__ = ["AFTER_FAILOVER_S", "FailoverRecord", "Pool", "RankLost", "fail_over"]

log = logging.getLogger(__name__)

AFTER_FAILOVER_S = 60.0  # the first step after a failover waits this long for peers still reloading


class RankLost(MoePlacementError):
    """Members that did not reach a step in time (global ranks)."""

    def __init__(self, missing: list[int]):
        super().__init__(f"ranks {missing} did not reach the step in time")
        self.missing = missing


@dataclass
class Pool:
    """The members (global ranks, ascending) serving in lockstep over ``group``; ``me`` is this rank."""

    name: str
    members: list[int]
    group: object
    me: int
    store: object
    liveness: float
    epoch: int = 0
    step: int = 0
    lost: list[int] = field(default_factory=list)

    @property
    def index(self) -> int:
        return self.members.index(self.me)

    def sync(self, state: dict) -> list[dict]:
        """Post this member's ``state`` for the step, return every member's (in member order). The
        first step after a failover waits up to :data:`AFTER_FAILOVER_S` (a peer may still be loading
        experts from the checkpoint), every other ``liveness`` seconds.

        Raises:
            RankLost: members whose state did not come within ``liveness`` seconds.
        """
        base = f"{self.name}/s/{self.epoch}/{self.step}/"
        self.store.set(base + str(self.me), json.dumps(state))
        keys = [base + str(r) for r in self.members]
        wait = self.liveness
        if self.epoch > 0 and self.step == 0:  # right after a failover: peers may still be reloading
            wait = max(wait, AFTER_FAILOVER_S)
        try:
            self.store.wait(keys, datetime.timedelta(seconds=wait))
        except Exception:  # noqa: BLE001 - the store raises its own error type on a timeout
            missing = [r for r, k in zip(self.members, keys) if not self.store.check([k])]
            if missing:
                raise RankLost(missing) from None
        states = [json.loads(v) for v in self.store.multi_get(keys)]
        if self.step >= 2:  # every member has read step - 2 (it posted step - 1 after reading it)
            self.store.delete_key(f"{self.name}/s/{self.epoch}/{self.step - 2}/{self.me}")
        self.step += 1
        return states

    def shrink(self, missing: list[int]) -> list[int]:
        """Agree on the lost members and continue without them (a new group, a new epoch); the lost
        ranks. A member the agreed set names exits at once (fenced)."""
        import torch.distributed as dist

        from runtime_hooks.launcher import LOST_RANK_EXIT_CODE

        proposal = json.dumps(sorted(missing))
        lost = json.loads(self.store.compare_set(f"{self.name}/lost/{self.epoch}", "", proposal))
        if self.me in lost:
            log.warning("%s: rank %d was declared lost by its peers; exiting", self.name, self.me)
            os._exit(LOST_RANK_EXIT_CODE)
        alive = [r for r in self.members if r not in lost]
        self.group = dist.new_group(
            alive, backend="gloo", use_local_synchronization=True, timeout=datetime.timedelta(seconds=60)
        )
        self.members, self.lost = alive, self.lost + lost
        self.epoch, self.step = self.epoch + 1, 0
        return lost


@dataclass(frozen=True)
class FailoverRecord:
    """What a failover did on this rank: the lost ranks (global), the maps before and after (``[L, P]``,
    ``[L, P']``), experts reloaded from the checkpoint in the whole map (no surviving copy), slots this
    rank loaded (reloads and any other expert a slot took), the wall time."""

    lost: tuple[int, ...]
    before: np.ndarray
    after: np.ndarray
    reloads: int
    loaded_here: int
    seconds: float


def fail_over(model, pool: Pool, old_members: list[int], lost: list[int], load_full, remap) -> FailoverRecord:
    """Switch ``model`` to the failover map on ``pool``'s (already shrunk) members.

    Args:
        model: a model :func:`runtime_hooks.hf.apply_placement_to_model` sharded over ``old_members``.
        pool: the pool after :meth:`Pool.shrink`.
        old_members / lost: global ranks before the loss, and those lost.
        load_full: ``() -> model`` with every expert (the checkpoint, or the seeded model).
        remap: ``(placement, lost local ranks) -> (placement on the survivors, reloads)``.
    """
    from runtime_hooks.hf import moe_experts
    from runtime_hooks.hf_serve_migrate import served_rows, slot_tensors

    t0 = time.monotonic()
    old = served_rows(model)
    new, reloads = remap(old, [old_members.index(r) for r in lost])
    S = old.topology.slots_per_gpu
    if new.topology.slots_per_gpu != S or new.topology.ep_size != len(pool.members):
        raise ValueError(
            f"the failover map has {new.topology.ep_size} ranks x {new.topology.slots_per_gpu} slots; "
            f"the survivors are {len(pool.members)} ranks x {S} slots"
        )
    me_old, me_new = old_members.index(pool.me), pool.index
    mine_old = old.physical_to_logical_map[:, me_old * S : (me_old + 1) * S]  # [L, S]
    mine_new = new.physical_to_logical_map[:, me_new * S : (me_new + 1) * S]  # [L, S]
    changed = np.argwhere(mine_old != mine_new)  # [n, 2] (layer, local slot)
    modules = list(moe_experts(model).values())
    if len(changed):
        full = list(moe_experts(load_full()).values())
        with torch.no_grad():
            for l, s in changed.tolist():
                e = int(mine_new[l, s])
                for mine, src in zip(slot_tensors(modules[l]), slot_tensors(full[l])):
                    mine[s].copy_(src[e])
    _switch(modules, new, pool)
    return FailoverRecord(
        tuple(lost),
        old.physical_to_logical_map.copy(),
        new.physical_to_logical_map.copy(),
        int(reloads),
        len(changed),
        time.monotonic() - t0,
    )


def _switch(modules: list, new: Placement, pool: Pool) -> None:
    """Every layer's state to its row of ``new``, the survivors' group and this rank's index in it."""
    from runtime_hooks.ep_layer import build_routing_tables

    for l, module in enumerate(modules):
        state = module._moe_placement
        row = Placement(
            new.physical_to_logical_map[l : l + 1],
            new.num_logical_experts,
            new.topology,
            state.placement.layer_ids,
        )
        state.placement, state.group = row, pool.group
        state.rank, state.ranks = pool.index, len(pool.members)
        state.tables = build_routing_tables(row, 0, module.down_proj.device)
        state.step = None  # a per-step dispatch rebuilds on the new row and group
