"""Per-step balanced dispatch in torch: the serving-side twin of ``placement/step_balance.py``.

Each step, every rank all-reduces the token counts ``c [L, E]`` of its MoE layers and calls
:meth:`StepBalancer.quotas`: integer tokens per replica ``[L, E, R]`` that minimize the peak GPU load.
The algorithm is the one documented in :mod:`placement.step_balance` (even split, lower bound, fixed
push rounds over breadth-first distances on the GPU graph, keep the best split), written once for CPU
and CUDA:

- integer (int64) arithmetic only, so every rank and device gets the same bits as the numpy reference;
- fixed iteration counts and no host synchronisation on the hot path (no ``.item()``, ``.tolist()``,
  data-dependent shapes or Python branches on tensor values);
- ties broken by index (lowest slot).

The plan (expert and replica index of every slot) is built on the host once per placement by
:func:`placement.step_balance.step_plan` and moved to the device.

Shapes: ``E`` logical experts, ``R`` max replicas, ``P`` slots, ``G`` GPUs, ``S = P // G``,
``L`` layers of the placement, ``N`` = batch x layers.
"""

from __future__ import annotations

import torch

from placement.step_balance import DEPTH, INF, PUSH_DEN, PUSH_NUM, ROUNDS, step_plan

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


def _distances(ld, q, T, gslot, se, E: int, depth: int) -> torch.Tensor:
    """Hops ``[N, G]`` from each GPU to a GPU below ``T`` (``ld [N, G]``, ``q [N, P]``, ``se [N, P]``).

    Kept negated so every minimum is a max; a hop goes from a GPU through an expert it holds tokens
    of to any replica of that expert (a scatter-max over the expert's slots, then a gather back).
    """
    N, G = ld.shape
    nd = torch.where(ld < T[:, None], 0, -INF)  # [N, G] minus distance
    se_has = torch.where(q > 0, se, E)  # [N, P] unloaded slots read the spare column E (never reached)
    for _ in range(depth):
        de = _per_expert_max(torch.gather(nd, 1, gslot), se, E + 1, -INF)  # [N, E+1] nearest GPU per expert
        hop = torch.gather(de, 1, se_has)  # [N, P]
        nd = torch.maximum(nd, hop.reshape(N, G, -1).amax(-1) - 1)
    return -nd


def _closed_bound(ld, q, dist, gslot, se, E: int) -> torch.Tensor:
    """``[N]``: ceil(load(H)/|H|) when the GPUs with no path, ``H``, form a closed set, else 0."""
    stuck = dist >= INF  # [N, G]
    stuck_p = torch.gather(stuck, 1, gslot)  # [N, P]
    outside = _per_expert_max((~stuck_p).to(torch.int64), se, E, 0)  # [N, E] a replica outside H
    leak = (q > 0) & stuck_p & (torch.gather(outside, 1, se) > 0)  # [N, P] tokens that could leave H
    ns = stuck.sum(-1)
    hl = torch.where(stuck, ld, 0).sum(-1)
    return torch.where((ns > 0) & (leak.sum(-1) == 0), -(-hl // ns.clamp(min=1)), 0)


def _push(q, ld, T, dist, gslot, se, slot, E: int) -> torch.Tensor:
    """Move excess one hop downhill; ``q [N, P]`` -> new ``q [N, P]``. ``slot``: ``arange(P)``."""
    N, G = ld.shape
    P = q.shape[1]
    x = torch.where(dist < INF, (ld - T[:, None]).clamp(min=0), 0)  # [N, G] excess with a path
    x = (x * PUSH_NUM + PUSH_DEN - 1) // PUSH_DEN
    du = torch.gather(dist, 1, gslot)  # [N, P]
    ke = -_per_expert_max(
        -(du * P + slot), se, E, -INF * P
    )  # [N, E] (distance, slot) key of the best replica
    kp = torch.gather(ke, 1, se)  # [N, P]
    dmin, tgt = kp // P, kp % P
    adm = (q > 0) & (du < INF) & (dmin == du - 1)
    qa = torch.where(adm, q, 0).reshape(N, G, -1)  # [N, G, S]
    before = qa.cumsum(-1) - qa  # admissible tokens on earlier slots of the GPU
    a = torch.minimum((x[:, :, None] - before).clamp(min=0), qa).reshape(N, -1)  # [N, P] tokens moved
    return (q - a).scatter_add_(1, tgt, a)


class StepBalancer:
    """Balanced quotas for one placement, on one device.

    Args:
        logical_to_physical_map: int ``[E, R]`` or ``[L, E, R]`` (numpy or torch), ascending, -1 padded.
        slots_per_gpu: ``S``; GPU ``g`` owns slots ``[g*S, (g+1)*S)``.
        device: where the plan lives and the solve runs (CPU or CUDA).
        rounds, depth: fixed push rounds and breadth-first hops per round (as in the numpy reference).
    """

    def __init__(
        self,
        logical_to_physical_map,
        slots_per_gpu: int,
        device: torch.device | str = "cpu",
        *,
        rounds: int = ROUNDS,
        depth: int = DEPTH,
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
        as_t = lambda a: torch.as_tensor(a, dtype=torch.int64, device=dev)  # noqa: E731
        self.l2p = as_t(plan.l2p)  # [L, E, R]
        self.slot_expert, self.slot_rank = as_t(plan.slot_expert), as_t(plan.slot_rank)  # [L, P]
        self.replicas = as_t(plan.replicas)  # [L, E]
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
        gslot = self.gslot.expand(N, -1).contiguous()  # [N, P]
        slot = self.slot.expand(N, -1)  # [N, P]
        cf = c.reshape(N, E)
        ce, ne = _take(cf, se), _take(n, se)  # [N, P]
        q = ce // ne + (sr < ce % ne).to(torch.int64)  # even split, remainder to the first replicas
        T = _lower_bound(cf, q, n, se, G)
        best, best_peak = q, torch.full((N,), INF, dtype=torch.int64, device=q.device)
        for _ in range(self.rounds + 1):
            ld = q.reshape(N, G, -1).sum(-1)  # [N, G]
            peak = ld.amax(-1)
            best = torch.where((peak < best_peak)[:, None], q, best)
            best_peak = torch.minimum(peak, best_peak)
            dist = _distances(ld, q, T, gslot, se, E, self.depth)
            bound = _closed_bound(ld, q, dist, gslot, se, E)
            q = _push(q, ld, T, dist, gslot, se, slot, E)
            T = torch.maximum(T, bound)
        return best.reshape(B, L, -1)

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
