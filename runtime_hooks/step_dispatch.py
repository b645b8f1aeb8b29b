"""Per-step balanced dispatch on real ranks: the one piece the EP layer and Hugging Face models share.

A dispatch model that needs each step's counts (``needs_step_counts`` in :mod:`placement.dispatch`)
splits every expert's tokens of the step over its replicas by integer quotas that every rank computes
from the same all-gathered counts (:class:`runtime_hooks.step_balance.StepBalancer`, bit-identical to
:func:`placement.step_balance.balanced_quotas`). Token-level contract, per step and layer:

1. every rank counts its valid picks per expert and the ranks all-gather them: ``counts [G, E]``;
2. ``quotas [E, R] = StepBalancer.quotas(counts.sum(0))`` (the same bits on every rank);
3. expert ``e``'s picks of the step are ordered by source rank, then by position in the rank's batch
   (token-major, then top-k position); replica ``r`` (ascending slots) takes positions
   ``[Q_r, Q_{r+1})`` of that order, ``Q`` the prefix sums of ``quotas[e]``.

Hence slot ``p`` computes exactly ``quotas[e, r]`` picks when ``p = l2p[e, r]``.

The collective is one ``all_gather_into_tensor`` of ``E`` int32 per rank (``[G, E]`` out, ``4 G E``
bytes per layer call). An ``all_reduce`` of a one-hot-by-rank ``[G, E]`` buffer would give the same
matrix but moves about twice the bytes (reduce-scatter plus all-gather) and adds zeros; the gather
is the smaller of the two. Everything after it is fixed-shape torch on the layer's device, with no host
synchronisation (no ``.item()``, ``.tolist()``, ``nonzero`` or ``bincount``); the exchange that follows
syncs once for its split sizes, as for every dispatch model.

Public API::

    step = StepDispatch(row, device, group)          # row: one-layer Placement; once per placement
    slots = step.slots(topk_ids)                     # [T, k] physical slot of every pick (collective)
    step.timer.median_us(), step.bytes_per_call        # cost of the counts all-gather per layer call
    pick_slots(ids, counts, quotas, l2p, rank)       # the contract alone, no process group
    quota_slot_tokens(row, counts, model)            # numpy oracle: picks per slot the quotas give

Shapes: T = this rank's tokens, k = top-k, E = logical experts, R = most replicas, P = slots, G = ranks.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from placement.model import Placement

__all__ = ["CollectiveTimer", "StepDispatch", "pick_slots", "quota_slot_tokens"]


def pick_slots(
    ids: torch.Tensor, counts: torch.Tensor, quotas: torch.Tensor, l2p: torch.Tensor, rank: int
) -> torch.Tensor:
    """Physical slot of every pick of rank ``rank`` under the step's quotas (the contract above).

    Args:
        ids: int ``[T, k]`` logical ids of this rank's picks, -1 = none.
        counts: int ``[G, E]`` valid picks per expert of every rank this step (row ``rank`` = ``ids``').
        quotas: int64 ``[E, R]`` picks per replica, summing over ``R`` to ``counts.sum(0)``.
        l2p: int64 ``[E, R]`` slots of each expert ascending, -1 padded.
        rank: this rank.

    Returns:
        int64 ``[T, k]`` slots, -1 where the id was -1.
    """
    T, k = ids.shape
    E, R = l2p.shape
    dev = l2p.device
    flat = ids.reshape(-1).to(device=dev, dtype=torch.int64)  # [T*k] pick i is token i // k, top-k i % k
    valid = flat >= 0
    e = torch.where(valid, flat, E)  # [T*k] no pick -> spare bucket E (sorted last)
    counts = counts.to(device=dev, dtype=torch.int64)
    mine = torch.cat([counts[rank], counts.new_zeros(1)])  # [E+1]
    start = mine.cumsum(0) - mine  # [E+1] first position of each expert among this rank's sorted picks
    order = torch.argsort(e, stable=True)  # [T*k] picks grouped by expert, pick order kept inside
    n = torch.arange(flat.numel(), dtype=torch.int64, device=dev)
    local = torch.empty_like(e).scatter_(0, order, n - start[e[order]])  # [T*k] rank among own picks of e
    lower = torch.cat([counts[:rank].sum(0), counts.new_zeros(1)])  # [E+1] picks of e on lower ranks
    pos = lower[e] + local  # [T*k] position in the step's order of expert e
    ec = e.clamp(max=E - 1)
    ends = quotas.to(device=dev, dtype=torch.int64).cumsum(1)  # [E, R] Q_{r+1}
    r = (ends[ec] <= pos[:, None]).sum(1).clamp(max=R - 1)  # [T*k] replica whose range holds pos
    slot = l2p[ec, r]  # [T*k]
    return torch.where(valid, slot, torch.full_like(slot, -1)).view(T, k)


def quota_slot_tokens(row: Placement, counts, dispatch) -> np.ndarray:
    """Picks per slot the model's numpy ``step_load`` gives for each step's counts (the oracle).

    Args:
        row: a one-layer placement. counts: int ``[S, E]`` all-reduced valid picks per expert of each
            step. dispatch: a model with ``needs_step_counts`` (``balanced``: the quotas of
            :func:`placement.step_balance.balanced_quotas` scattered to their slots).

    Returns:
        int64 ``[S, P]``.
    """
    from placement.dispatch import get_dispatch

    c = np.asarray(counts, dtype=np.int64).reshape(-1, row.num_logical_experts)  # [S, E]
    return np.rint(get_dispatch(dispatch).step_load(row, 0, c)).astype(np.int64)


class CollectiveTimer:
    """Wall time around a collective: ``perf_counter`` on CPU, CUDA events on GPU (read lazily, so
    timing never syncs the serving path; reading syncs once). Keeps the last ``keep`` calls."""

    def __init__(self, device, keep: int = 4096):
        self.cuda = torch.device(device).type == "cuda"
        self.samples: deque[float] = deque(maxlen=keep)  # seconds per call, oldest first
        self._events: list = []  # (start, end) CUDA events not read yet

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, token) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((token, end))
        else:
            self.samples.append(time.perf_counter() - token)

    def _read(self) -> list[float]:
        if self._events:
            self._events[-1][1].synchronize()
            self.samples.extend(a.elapsed_time(b) / 1e3 for a, b in self._events)
            self._events.clear()
        return list(self.samples)

    def median_us(self) -> float:
        """Median microseconds per call of the kept calls (0.0 before the first): one call delayed by
        the scheduler (ranks sharing cores) does not decide it."""
        s = self._read()
        return 1e6 * float(np.median(s)) if s else 0.0


class StepDispatch:
    """Balanced per-step slot choice of one layer on one rank (build once per placement row).

    Args:
        row: one-layer :class:`Placement` being served.
        device: where the plan lives and the picks are routed.
        group: process group of the exchange (default group when None).
        rounds, depth: the solver's fixed rounds and hops (default: the numpy reference's).
        timer: where the counts all-gather is timed (a new one when None; pass the old one to keep
            timing across a migration).
    """

    def __init__(
        self,
        row: Placement,
        device,
        group=None,
        *,
        rounds: int | None = None,
        depth: int | None = None,
        timer: CollectiveTimer | None = None,
    ):
        import torch.distributed as dist

        from placement.dispatch.balanced import step_map
        from runtime_hooks.step_balance import StepBalancer

        kw = {k: v for k, v in (("rounds", rounds), ("depth", depth)) if v is not None}
        self.placement = row
        self.device = torch.device(device)
        self.group = group
        self.rank, self.ranks = dist.get_rank(group), dist.get_world_size(group)
        l2p = np.asarray(step_map(row, 0), dtype=np.int64)  # [E, R] the replicas the split uses
        self.balancer = StepBalancer(l2p, row.topology.slots_per_gpu, self.device, **kw)
        self.l2p = torch.tensor(l2p, device=self.device)  # [E, R]
        self.num_experts = int(l2p.shape[0])
        self.timer = timer if timer is not None else CollectiveTimer(self.device)
        self.bytes_per_call = 4 * self.ranks * self.num_experts  # the gathered [G, E] int32
        self.last_counts: torch.Tensor | None = None  # [G, E] int32 of the last step
        self.last_quotas: torch.Tensor | None = None  # [E, R] int64 of the last step

    def gather_counts(self, ids: torch.Tensor) -> torch.Tensor:
        """Valid picks per expert of every rank this step, int32 ``[G, E]`` (collective)."""
        import torch.distributed as dist

        E = self.num_experts
        flat = ids.reshape(-1).to(device=self.device, dtype=torch.int64)
        e = torch.where(flat >= 0, flat, E)  # [T*k] no pick -> spare bucket E
        mine = torch.zeros(E + 1, dtype=torch.int32, device=self.device)
        mine.scatter_add_(0, e, torch.ones_like(e, dtype=torch.int32))  # [E+1]
        out = torch.empty(self.ranks * E, dtype=torch.int32, device=self.device)  # [G*E]
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in 2.13
        token = self.timer.start()
        gather(out, mine[:E].contiguous(), group=self.group)
        self.timer.stop(token)
        return out.view(self.ranks, E)  # [G, E]

    def slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Physical slot of every pick, int64 ``[T, k]`` (-1 where the id is -1). Collective."""
        counts = self.gather_counts(ids)  # [G, E]
        quotas = self.balancer.quotas(counts.sum(0), validate=False)  # [E, R] same bits on every rank
        self.last_counts, self.last_quotas = counts, quotas
        return pick_slots(ids, counts, quotas, self.l2p, self.rank)
