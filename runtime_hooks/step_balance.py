"""Per-step balanced dispatch in torch: the serving-side twin of ``placement/step_balance.py``.

Each step, every rank all-reduces the token counts ``c [L, E]`` of its MoE layers and calls
:meth:`StepBalancer.quotas`: integer tokens per replica ``[L, E, R]`` that minimize the peak GPU load.
The algorithm is the one documented in :mod:`placement.step_balance` (even split, lower bound, fixed
push rounds toward the midpoint between the bound and the best peak, over warm labels relabelled a few
hops per round on the GPU graph, keep the best split), written once for CPU and CUDA:

- integer (int64) arithmetic only, so every rank and device gets the same bits as the numpy reference;
- on CUDA, fixed iteration counts and no host synchronisation on the hot path (no ``.item()``,
  ``.tolist()``, data-dependent shapes or Python branches on tensor values); on CPU, where a host
  decision costs nothing, rows proven optimal leave the batch and the loop stops when none is left
  (``early_exit``: the same bits);
- ties broken by index (lowest slot);
- per-slot work uses expand (not gather) to spread GPU values over slots and scatter-reduce or negated
  ``amax`` for minima (``amin`` over a short last dim is ~15x slower than ``amax`` on CPU).

The plan (expert and replica index of every slot) is built on the host once per placement by
:func:`placement.step_balance.step_plan` and moved to the device.

Shapes: ``E`` logical experts, ``R`` max replicas, ``P`` slots, ``G`` GPUs, ``S = P // G``,
``L`` layers of the placement, ``N`` = batch x layers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from placement.step_balance import CAP, DEPTH, INF, LCAP, RB, ROOM, ROUNDS, step_plan

__all__ = ["StepBalancer"]


def _take(a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``a [N, M]`` gathered at ``idx [N, ...]`` along dim 1."""
    return torch.gather(a, 1, idx.reshape(idx.shape[0], -1)).reshape(idx.shape)


def _lower_bound(c, q, n, se, G: int) -> torch.Tensor:
    """``[N]``: max(ceil(mean GPU load), max ceil(c_e / n_e), largest single-replica GPU load)."""
    N = c.shape[0]
    T = torch.maximum(-(-c.sum(-1) // G), (-(-c // n)).amax(-1))
    single = torch.where(_take(n, se) == 1, q, 0).reshape(N, G, -1).sum(-1).amax(-1)  # [N]
    return torch.maximum(T, single)


def _per_expert_max(v: torch.Tensor, se: torch.Tensor, E: int, fill: int) -> torch.Tensor:
    """``[N, E]``: max of slot values ``v [N, P]`` over each expert's slots ``se [N, P]``."""
    out = torch.full((v.shape[0], E), fill, dtype=v.dtype, device=v.device)
    return out.scatter_reduce_(1, se, v, "amax")


def _per_slot(a: torch.Tensor, gslot: torch.Tensor) -> torch.Tensor:
    """``a [N, G]`` repeated to every slot of each GPU: ``[N, P]`` (``gslot [N, P]`` gives ``P``)."""
    return a[:, :, None].expand(-1, -1, gslot.shape[1] // a.shape[1]).reshape(gslot.shape)


class _Slots(NamedTuple):
    """The slot layout of the rows being solved (each ``[N, P]``, rows filtered together).

    ``gslot``: GPU of each slot; ``se``: its expert; ``se_live``: ``se``, or ``E + 1`` on a slot that
    holds no replica (its label reaches no expert); ``slot``: ``arange(P)``; ``E``: logical experts.
    """

    gslot: torch.Tensor
    se: torch.Tensor
    se_live: torch.Tensor
    slot: torch.Tensor
    E: int

    def keep(self, rows: torch.Tensor) -> _Slots:
        """The layout of the rows ``rows`` (a bool ``[N]`` mask) only."""
        return _Slots(self.gslot[rows], self.se[rows], self.se_live[rows], self.slot[rows], self.E)


def _labels(dist, ld, q, Tp, slots: _Slots, hops: int) -> torch.Tensor:
    """``hops`` relabel sweeps of the warm labels ``dist [N, G]`` (hops to a GPU below ``Tp [N]``).

    ``ld [N, G]``, ``q [N, P]``, ``slots``: the rows' slot layout. Kept negated so every minimum is a max.
    """
    gslot, se, se_live, E = slots.gslot, slots.se, slots.se_live, slots.E
    N, G = ld.shape
    sink = torch.where(ld < Tp[:, None], 0, -INF - hops)  # [N, G]
    se_has = torch.where(q > 0, se, E)  # [N, P] unloaded slots read the spare column E
    nd = -dist
    for _ in range(hops):
        de = _per_expert_max(_per_slot(nd, gslot), se_live, E + 2, -INF)  # [N, E+2] nearest replica
        nd = torch.maximum(torch.gather(de, 1, se_has).reshape(N, G, -1).amax(-1) - 1, sink)
    return torch.where(nd <= -min(G, CAP), INF, -nd)


def _targets(ld, Tp, dist, slots: _Slots) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slot ``[N, P]``: label of its expert's best replica (lowest label, most room, lowest slot), slot.

    A slot holding no replica (``se_live == E + 1``) is never a target: it reduces into a spare column.
    """
    gslot, se, se_live, slot, E = slots
    sb = max(slot.shape[1] - 1, 1).bit_length()
    room = (Tp[:, None] - ld).clamp(min=0, max=ROOM - 1)  # [N, G]
    key = ((dist.clamp(max=LCAP) << RB) | (ROOM - 1 - room)) << sb  # [N, G]
    best = torch.full((ld.shape[0], E + 2), INF << sb, dtype=ld.dtype, device=ld.device)
    kp = torch.gather(best.scatter_reduce_(1, se_live, _per_slot(key, gslot) | slot, "amin"), 1, se)
    return kp >> (sb + RB), kp & ((1 << sb) - 1)


def _push(q, ld, Tp, dist, slots: _Slots) -> tuple[torch.Tensor, torch.Tensor]:
    """Move every GPU's excess over ``Tp`` one hop downhill: new ``q [N, P]`` and the closed bound ``[N]``.

    As in the numpy reference: earlier slots of a GPU first; a GPU below ``Tp`` offered more than its
    room accepts the offers scaled down (rounded down), the rest of its room to its lowest offering slot.
    ``slots``: the rows' slot layout.
    """
    N, G = ld.shape
    gslot = slots.gslot
    dmin, tgt = _targets(ld, Tp, dist, slots)
    du = _per_slot(dist, gslot)  # [N, P]
    stuck = dist >= INF  # [N, G] no path: closed unless a loaded slot's expert has a replica outside
    leak = torch.where(q > 0, du - dmin, 0).amax(-1) > INF - LCAP  # a stuck slot's expert reaches out
    ns = stuck.sum(-1)
    bound = torch.where((ns > 0) & ~leak, -(-torch.where(stuck, ld, 0).sum(-1) // ns.clamp(min=1)), 0)
    x = torch.where(stuck, 0, (ld - Tp[:, None]).clamp(min=0))  # [N, G] excess with a path
    qa = torch.where(dmin == du - 1, q, 0).reshape(N, G, -1)  # [N, G, S] admissible
    before = qa.cumsum(-1) - qa  # admissible tokens on earlier slots of the GPU
    a = (x[:, :, None] - before).clamp(min=torch.zeros_like(qa), max=qa).reshape(N, -1)  # [N, P] offered
    rg = torch.gather(gslot, 1, tgt)  # [N, P] receiving GPU
    offered = torch.zeros_like(ld).scatter_add_(1, rg, a)  # [N, G]
    room = torch.where(dist == 0, (Tp[:, None] - ld).clamp(min=0), INF)  # [N, G]
    tot, cap = torch.gather(offered, 1, rg), torch.gather(room, 1, rg)  # [N, P]
    a = torch.where(tot > cap, -(-a * cap // tot.clamp(min=1)), a)  # offers scaled down, rounded up
    return (q - a).scatter_add_(1, tgt, a), bound


class StepBalancer:
    """Balanced quotas for one placement, on one device.

    Args:
        logical_to_physical_map: int ``[E, R]`` or ``[L, E, R]`` (numpy or torch), ascending, -1 padded.
        slots_per_gpu: ``S``; GPU ``g`` owns slots ``[g*S, (g+1)*S)``.
        device: where the plan lives and the solve runs (CPU or CUDA).
        rounds, depth: fixed push rounds and relabel sweeps per round (as in the numpy reference).
        early_exit: let rows proven optimal (best peak at the lower bound) leave the batch and stop
            when none is left; the same bits as the fixed rounds, but a host decision each round.
            None (default): on for CPU, off for CUDA, whose loop must not synchronise.
    """

    def __init__(
        self,
        logical_to_physical_map,
        slots_per_gpu: int,
        device: torch.device | str = "cpu",
        *,
        rounds: int = ROUNDS,
        depth: int = DEPTH,
        early_exit: bool | None = None,
    ) -> None:
        l2p = logical_to_physical_map
        if isinstance(l2p, torch.Tensor):
            l2p = l2p.detach().cpu().numpy()
        if (
            isinstance(rounds, bool)
            or int(rounds) != rounds
            or rounds < 0
            or int(depth) != depth
            or depth < 1
        ):
            raise ValueError(
                f"rounds must be an integer >= 0 and depth >= 1, got rounds={rounds}, depth={depth}"
            )
        plan = step_plan(l2p, slots_per_gpu)
        self.squeeze = len(getattr(l2p, "shape", ())) == 2
        self.rounds, self.depth = int(rounds), int(depth)
        self.num_gpus, self.slots_per_gpu = plan.num_gpus, plan.slots_per_gpu
        L, E, R = plan.l2p.shape
        self.shape = (L, E, R)
        dev = torch.device(device)
        self.early_exit = dev.type == "cpu" if early_exit is None else bool(early_exit)
        as_t = lambda a: torch.as_tensor(a, dtype=torch.int64, device=dev)  # noqa: E731
        self.l2p = as_t(plan.l2p)  # [L, E, R]
        self.slot_expert, self.slot_rank = as_t(plan.slot_expert), as_t(plan.slot_rank)  # [L, P]
        self.replicas = as_t(plan.replicas)  # [L, E]
        self.live = torch.as_tensor(plan.slot_live, device=dev)  # [L, P] bool: the slot holds a replica
        self.slot_expert_live = torch.where(self.live, self.slot_expert, E + 1)  # [L, P]: E + 1 where none
        P = plan.slot_expert.shape[1]
        self.gslot = torch.arange(P, dtype=torch.int64, device=dev) // self.slots_per_gpu  # [P]
        self.slot = torch.arange(P, dtype=torch.int64, device=dev)  # [P]

    def _counts(self, counts: torch.Tensor, validate: bool) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Counts as int64 ``[B, L, E]`` plus their leading shape."""
        L, E, _ = self.shape
        tail = (E,) if self.squeeze else (L, E)
        if counts.dtype.is_floating_point or counts.dtype == torch.bool or counts.is_complex():
            raise ValueError(f"counts must be an integer tensor, got dtype {counts.dtype}")
        if counts.ndim < len(tail) or tuple(counts.shape[counts.ndim - len(tail) :]) != tail:
            raise ValueError(
                f"counts have shape {tuple(counts.shape)} but the placement needs [..., "
                f"{', '.join(map(str, tail))}]; pass one count per logical expert"
            )
        if validate and counts.numel() and bool((counts < 0).any()):  # host sync: off the hot path
            raise ValueError(
                f"counts must be >= 0, got minimum {int(counts.min())}; pass token counts, not deltas"
            )
        if validate and counts.numel() and float(counts.double().sum(-1).max()) >= INF:  # as the numpy twin
            raise ValueError(
                f"counts sum to over {INF} tokens in one step (2**40); pass one step's token counts"
            )
        lead = tuple(counts.shape[: counts.ndim - len(tail)])
        return counts.to(device=self.l2p.device, dtype=torch.int64).reshape(-1, L, E), lead

    def _solve_slots(self, c: torch.Tensor) -> torch.Tensor:
        """Slot quotas ``[B, L, P]`` for counts ``c [B, L, E]``."""
        B, L, E = c.shape
        G = self.num_gpus
        N = B * L

        def rows(a: torch.Tensor) -> torch.Tensor:  # [L, ...] -> [N, ...], layer-major inside each step
            return (
                a.unsqueeze(0).expand((B,) + tuple(a.shape)).reshape((N,) + tuple(a.shape[1:])).contiguous()
            )

        se, sr, n = rows(self.slot_expert), rows(self.slot_rank), rows(self.replicas)  # [N, P], [N, E]
        live, se_live = rows(self.live), rows(self.slot_expert_live)  # [N, P]
        gslot = self.gslot.expand(N, -1).contiguous()  # [N, P]
        slots = _Slots(gslot, se, se_live, self.slot.expand(N, -1), E)  # the loop's rows' layout
        cf = c.reshape(N, E)
        ce, ne = _take(cf, se), _take(n, se)  # [N, P]
        q = torch.where(live, ce // ne + (sr < ce % ne).to(torch.int64), 0)  # even split, remainder first
        T = _lower_bound(cf, q, n, se, G)
        out = torch.empty_like(q)
        active = torch.arange(N, device=q.device)  # rows still searching (all of them on CUDA)
        best, best_peak = q, torch.full((N,), INF, dtype=torch.int64, device=q.device)
        dist = torch.full((N, G), INF, dtype=torch.int64, device=q.device)  # [N, G] warm labels
        for _ in range(self.rounds + 1):
            ld = q.reshape(q.shape[0], G, -1).sum(-1)  # [N', G]
            peak = ld.amax(-1)
            best = torch.where((peak < best_peak)[:, None], q, best)
            best_peak = torch.minimum(peak, best_peak)
            if self.early_exit:  # host decision: CPU only (the CUDA path never syncs in the loop)
                done = best_peak <= T  # proven optimal: final
                if bool(done.any()):
                    out[active[done]] = best[done]
                    keep = ~done
                    active, q, T, best, best_peak, dist, ld = (
                        a[keep] for a in (active, q, T, best, best_peak, dist, ld)
                    )
                    slots = slots.keep(keep)
                    if active.numel() == 0:
                        break
            Tp = T + (best_peak - T) // 2  # aim halfway between the bound and the best peak
            dist = _labels(dist, ld, q, Tp, slots, self.depth)
            q, bound = _push(q, ld, Tp, dist, slots)
            T = torch.maximum(T, bound)
        if not self.early_exit:
            return best.reshape(B, L, -1)
        out[active] = best
        return out.reshape(B, L, -1)

    def quotas(self, counts: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
        """Tokens per replica, int64 ``[..., E, R]`` (or ``[..., L, E, R]``), on the plan's device.

        ``counts``: int ``[..., E]`` (or ``[..., L, E]``), this step's all-reduced counts. ``validate``
        checks for negative counts with one host sync; the serving path passes ``validate=False``.
        """
        c, lead = self._counts(counts, validate)
        qs = self._solve_slots(c)  # [B, L, P]
        B = qs.shape[0]
        L, E, R = self.shape
        idx = self.l2p.clamp(min=0).reshape(1, L, E * R).expand(B, -1, -1)  # [B, L, E*R]
        q = torch.gather(qs, 2, idx).reshape(B, L, E, R)
        q = torch.where(self.l2p >= 0, q, 0)
        return q.reshape(lead + ((E, R) if self.squeeze else (L, E, R)))

    def gpu_load(self, counts: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
        """Tokens per GPU under :meth:`quotas`, int64 ``[..., G]`` (or ``[..., L, G]``)."""
        c, lead = self._counts(counts, validate)
        qs = self._solve_slots(c)  # [B, L, P]
        ld = qs.reshape(qs.shape[0], qs.shape[1], self.num_gpus, -1).sum(-1)  # [B, L, G]
        return ld.reshape(lead + ((self.num_gpus,) if self.squeeze else (ld.shape[1], self.num_gpus)))
