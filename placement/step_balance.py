"""Per-step balanced dispatch: integer quotas per replica that minimize the peak GPU load.

The ``balanced`` dispatch model (docs/metrics.md): every step, each MoE layer's all-reduced token
counts ``c [E]`` are split over the replicas of each expert so that the most loaded GPU gets as few
tokens as possible. Every rank computes the split from the same counts, so the algorithm uses integer
arithmetic only (no floating point, no randomness, ties broken by index): the numpy code here and the
torch code in ``runtime_hooks/step_balance.py`` give the same bits on every device.

Shapes (E = logical experts, R = max replicas, P = physical slots, G = GPUs, S = P // G, N = batch):

- ``counts``: int ``[..., E]`` (one placement layer) or ``[..., L, E]`` (per-layer placement).
- ``logical_to_physical_map``: int ``[E, R]`` or ``[L, E, R]``, ascending slots padded with -1.
- quotas: int64 ``[..., E, R]`` (``[..., L, E, R]``), 0 on padding, summing over ``R`` to the counts.

Algorithm (a fixed number of rounds, so a serving step never waits on the host):

1. Split each expert's tokens evenly over its replicas (remainder to the lowest replica index).
2. Lower bound ``T`` on the optimal peak: the largest of the mean GPU load, the largest
   ``ceil(c_e / n_e)``, and the largest load a GPU must carry from experts with one replica.
3. ``rounds`` push rounds on the GPU graph (an edge ``u -> v`` exists when an expert has tokens on
   ``u`` and a replica on ``v``), aiming at ``Tp = T + (best - T) // 2``, halfway between the bound and
   the lowest peak seen so far (a binary search that needs no host decision):
   a. ``depth`` relabel sweeps of warm labels kept across rounds (``label = 1 + min`` over the
      neighbours, 0 below ``Tp``); a label of ``min(G, CAP)`` or more means no path. Warm labels reach
      any depth over the rounds, which the long chain-like paths of sparse replica graphs need;
   b. if the GPUs with no path form a closed set ``H`` (no expert with tokens in ``H`` has a replica
      outside it), every split must put ``load(H)`` on ``H``, so ``T`` rises to ``ceil(load(H)/|H|)``;
   c. every GPU with a path pushes all its excess over ``Tp`` one label down, replica by replica in
      slot order, each to its expert's replica with the lowest label, then the most room below ``Tp``,
      then the lowest slot; a GPU below ``Tp`` offered more than its room takes each offer scaled by
      ``room / offered`` (rounded up), so excess flows on without piling up at the first sink.
4. Return the split with the lowest peak seen. A row whose best peak meets ``T`` is optimal: with
   ``early_exit`` (the default here, and the torch code's on CPU) it leaves the batch, and the loop
   ends when no row is left, with the same bits as the fixed rounds.

The integer optimum is ``ceil(lp_peak)`` (the max-flow polytope is integral), and ``T`` is a
certificate: a result whose peak equals ``T`` is optimal. Accuracy against HiGHS and speed are
measured by ``benchmarks/step_balance_speed.py --traces`` (figures in docs/results.md).

:func:`lp_peak` gives the exact fractional optimum ``max_A c(A) / |GPUs(A)|`` by Dinkelbach's method
over integer max flows (a reference for tests and benchmarks, not for the serving path).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

__all__ = ["StepPlan", "balanced_gpu_load", "balanced_quotas", "lp_peak", "step_plan"]

ROUNDS = 64  # push rounds
DEPTH = 3  # relabel sweeps per round
CAP = 20  # a label this high means no path (labels count up one per sweep when a path breaks)
LCAP, RB = 1 << 12, 20  # packing of the (label, room, slot) key of a replica
ROOM = 1 << RB
INF = 1 << 40  # label of a GPU with no path to a GPU below the target


@dataclass(frozen=True, eq=False)
class StepPlan:
    """Slot-space view of a placement, built once per placement (host side).

    Attributes:
        l2p: int64 ``[L, E, R]`` logical-to-physical map, -1 padded.
        slot_expert: int64 ``[L, P]`` logical expert of each slot.
        slot_rank: int64 ``[L, P]`` replica index of each slot within its expert (ascending slots).
        replicas: int64 ``[L, E]`` replica count per expert.
        slots_per_gpu: ``S``; ``num_gpus``: ``G``.
        slot_live: bool ``[L, P]``: the slot holds a replica the split uses. A slot the map leaves
            out (a co-located duplicate dropped by :func:`placement.dispatch.balanced.step_map`) gets
            no tokens and is never a target; its ``slot_expert``/``slot_rank`` are 0.
    """

    l2p: np.ndarray
    slot_expert: np.ndarray
    slot_rank: np.ndarray
    replicas: np.ndarray
    slots_per_gpu: int
    num_gpus: int
    slot_live: np.ndarray


def _check_l2p(l2p, slots_per_gpu: int) -> tuple[np.ndarray, int]:
    """The map as int64 ``[L, E, R]`` plus the slot count ``P`` (a multiple of ``S``)."""
    arr = np.asarray(l2p)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"logical_to_physical_map must hold integer slots, got dtype {arr.dtype}")
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3 or 0 in arr.shape:
        raise ValueError(
            f"logical_to_physical_map must be [E, R] or [L, E, R] (non-empty), got shape {arr.shape}; "
            "pass Placement.logical_to_physical_map"
        )
    S = int(slots_per_gpu)
    if S < 1:
        raise ValueError(f"slots_per_gpu must be >= 1, got {slots_per_gpu}")
    arr = arr.astype(np.int64)
    n = (arr >= 0).sum(-1)  # [L, E]
    if (n == 0).any():
        l, e = map(int, np.argwhere(n == 0)[0])
        raise ValueError(f"layer {l}: expert {e} has no replica; every expert needs at least one slot")
    used = np.sort(arr.reshape(arr.shape[0], -1), axis=1)  # [L, E*R] ascending, -1 first
    if ((np.diff(used, axis=1) == 0) & (used[:, 1:] >= 0)).any():
        raise ValueError(
            "logical_to_physical_map lists one slot twice in a layer; derive it with compute_logical_maps"
        )
    P = -(-(int(arr.max()) + 1) // S) * S
    return arr, P


def step_plan(logical_to_physical_map, slots_per_gpu: int) -> StepPlan:
    """Build the slot-space plan of a placement (once per placement, on the host).

    Args:
        logical_to_physical_map: int ``[E, R]`` or ``[L, E, R]``, ascending slots padded with -1.
        slots_per_gpu: ``S``; GPU ``g`` owns slots ``[g*S, (g+1)*S)``.
    """
    l2p, P = _check_l2p(logical_to_physical_map, slots_per_gpu)
    L, E, R = l2p.shape
    S = int(slots_per_gpu)
    gpu = l2p // S  # [L, E, R]
    same = (gpu[:, :, :, None] == gpu[:, :, None, :]) & (l2p[:, :, :, None] >= 0) & ~np.eye(R, dtype=bool)
    if same.any():
        l, e, r, _ = map(int, np.argwhere(same)[0])
        raise ValueError(
            f"layer {l}: expert {e} has two replicas on GPU {int(gpu[l, e, r])}; "
            "replicas of one expert must sit on different GPUs"
        )
    slot_expert = np.zeros((L, P), np.int64)
    slot_rank = np.zeros((L, P), np.int64)
    live = np.zeros((L, P), bool)
    ll, ee, rr = np.nonzero(l2p >= 0)  # one entry per replica
    slot_expert[ll, l2p[ll, ee, rr]] = ee
    slot_rank[ll, l2p[ll, ee, rr]] = rr
    live[ll, l2p[ll, ee, rr]] = True
    return StepPlan(l2p, slot_expert, slot_rank, (l2p >= 0).sum(-1), S, P // S, live)


def batch_counts(counts, plan: StepPlan) -> tuple[np.ndarray, tuple[int, ...]]:
    """Counts as int64 ``[B, L, E]`` plus their leading shape ``[...]``; raises ValueError on bad input."""
    c = np.asarray(counts)
    if c.dtype.kind not in "iu":
        if c.dtype.kind == "f" and np.all(np.isfinite(c)) and np.all(c == np.round(c)):
            c = c.astype(np.int64)
        else:
            raise ValueError(f"counts must be integer token counts, got dtype {c.dtype}")
    L, E = plan.replicas.shape
    tail = (L, E) if L > 1 else (E,)
    if c.ndim < len(tail) or c.shape[c.ndim - len(tail) :] != tail:
        raise ValueError(
            f"counts have shape {c.shape} but the placement needs [..., {', '.join(map(str, tail))}] "
            f"({L} layer(s) x {E} experts); pass one count per logical expert"
        )
    if c.size and int(c.min()) < 0:
        raise ValueError(f"counts must be >= 0, got minimum {int(c.min())}; pass token counts, not deltas")
    if c.size and float(c.sum(-1, dtype=np.float64).max()) >= INF:  # labels and peaks are int64 below INF
        raise ValueError(f"counts sum to over {INF} tokens in one step (2**40); pass one step's token counts")
    lead = c.shape[: c.ndim - len(tail)]
    return c.astype(np.int64).reshape(-1, L, E), lead


def _take(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``a [N, M]`` gathered at ``idx [N, ...]`` along axis 1."""
    return np.take_along_axis(a, idx.reshape(idx.shape[0], -1), axis=1).reshape(idx.shape)


def _initial(c: np.ndarray, se: np.ndarray, sr: np.ndarray, n: np.ndarray, live: np.ndarray) -> np.ndarray:
    """Even split in slot space: ``c [N, E]``, ``se, sr, live [N, P]``, ``n [N, E]`` -> ``q [N, P]``."""
    ce, ne = _take(c, se), _take(n, se)  # [N, P]
    return np.where(live, ce // ne + (sr < ce % ne), 0)


def _lower_bound(c, q, n, se, G: int) -> np.ndarray:
    """``[N]``: max(ceil(mean GPU load), max ceil(c_e / n_e), largest single-replica GPU load)."""
    N = c.shape[0]
    T = np.maximum(-(-c.sum(-1) // G), (-(-c // n)).max(-1))
    single = np.where(_take(n, se) == 1, q, 0).reshape(N, G, -1).sum(-1).max(-1)  # [N]
    return np.maximum(T, single)


def _labels(dist, ld, q, Tp, gpu_er, se, hops: int) -> np.ndarray:
    """``hops`` relabel sweeps of the warm labels ``dist [N, G]``: hops to a GPU below ``Tp [N]``.

    ``ld [N, G]``, ``q [N, P]``, ``gpu_er [N, E, R]`` (GPU of each replica, ``G`` on padding),
    ``se [N, P]``. A hop goes from a GPU through an expert it holds tokens of to any of its replicas;
    a sweep sets ``label = 1 + min(neighbour labels)`` (0 below ``Tp``); after the sweeps a label of
    ``min(G, CAP)`` or more becomes ``INF`` (no path).
    """
    N, G = ld.shape
    sink = np.where(ld < Tp[:, None], 0, INF + hops)  # [N, G]
    has = q > 0
    pad = np.full((N, 1), INF)
    for _ in range(hops):
        de = _take(np.concatenate([dist, pad], axis=1), gpu_er).min(-1)  # [N, E] nearest replica
        dist = np.minimum(np.where(has, _take(de, se), INF).reshape(N, G, -1).min(-1) + 1, sink)
    return np.where(dist >= min(G, CAP), INF, dist)


def _targets(ld, Tp, dist, gslot, se, live, P: int) -> tuple[np.ndarray, np.ndarray]:
    """Per slot ``[N, P]``: label of its expert's best replica and that replica's slot.

    Best: lowest label, then most room below ``Tp``, then lowest slot (one packed int64 key); a slot
    that is not ``live [N, P]`` is no replica and never a target.
    """
    N, E = ld.shape[0], int(se.max()) + 1
    sb = max(P - 1, 1).bit_length()
    room = np.clip(Tp[:, None] - ld, 0, ROOM - 1)  # [N, G]
    key = ((np.minimum(dist, LCAP) << RB) | (ROOM - 1 - room)) << sb  # [N, G]
    best = np.full((N, E), INF << sb)
    cand = np.where(live, _take(key, gslot) | np.arange(P), INF << sb)  # [N, P]
    np.minimum.at(best, (np.broadcast_to(np.arange(N)[:, None], se.shape), se), cand)
    kp = _take(best, se)  # [N, P]
    return kp >> (sb + RB), kp & ((1 << sb) - 1)


def _push(q, ld, Tp, dist, gslot, se, live) -> tuple[np.ndarray, np.ndarray]:
    """Move every GPU's excess over ``Tp`` one hop downhill: new ``q [N, P]`` and a bound ``[N]``.

    Each loaded slot sends to its expert's best replica one label lower (:func:`_targets`), earlier
    slots of a GPU first; a GPU below ``Tp`` offered more than its room accepts each offer scaled by
    ``room / offered``, rounded up. The bound is ``ceil(load(H)/|H|)`` when the GPUs with no path,
    ``H``, form a closed set (no expert with tokens in ``H`` has a replica outside it), else 0.
    """
    N, G = ld.shape
    P = q.shape[1]
    rows = np.broadcast_to(np.arange(N)[:, None], q.shape)
    dmin, tgt = _targets(ld, Tp, dist, gslot, se, live, P)
    du = _take(dist, gslot)  # [N, P] label of each slot's GPU
    stuck = dist >= INF  # [N, G]
    leak = np.where(q > 0, du - dmin, 0).max(-1) > INF - LCAP  # a stuck slot's expert reaches out
    ns = stuck.sum(-1)
    bound = np.where((ns > 0) & ~leak, -(-np.where(stuck, ld, 0).sum(-1) // np.maximum(ns, 1)), 0)
    x = np.where(stuck, 0, np.maximum(ld - Tp[:, None], 0))  # [N, G] excess with a path
    qa = np.where(dmin == du - 1, q, 0).reshape(N, G, -1)  # [N, G, S] admissible
    before = np.cumsum(qa, -1) - qa  # admissible tokens on earlier slots of the GPU
    a = np.clip(x[:, :, None] - before, 0, qa).reshape(N, -1)  # [N, P] offered
    rg = _take(gslot, tgt)  # [N, P] receiving GPU
    offered = np.zeros((N, G), np.int64)
    np.add.at(offered, (rows, rg), a)
    room = np.where(dist == 0, np.maximum(Tp[:, None] - ld, 0), INF)  # [N, G]
    tot, cap = _take(offered, rg), _take(room, rg)  # [N, P]
    a = np.where(tot > cap, -(-a * cap // np.maximum(tot, 1)), a)  # accepted
    out = q - a
    np.add.at(out, (rows, tgt), a)
    return out, bound


def solve_slots(
    c: np.ndarray, plan: StepPlan, rounds: int = ROUNDS, depth: int = DEPTH, early_exit: bool = True
) -> np.ndarray:
    """Integer slot quotas ``[B, L, P]`` for counts ``c`` int64 ``[B, L, E]`` (steps 1-4 above).

    ``early_exit``: a row whose best peak meets its lower bound ``T`` is optimal and can no longer
    change, so it leaves the batch, and the loop ends when none is left (the same bits as the fixed
    ``rounds``; the host decides, which is free here and is what the CUDA path must not do).
    """
    B, L, E = c.shape
    P, G, S = plan.slot_expert.shape[1], plan.num_gpus, plan.slots_per_gpu
    N = B * L

    def rows(a: np.ndarray) -> np.ndarray:  # [L, ...] -> [N, ...], layer-major inside each step
        return np.broadcast_to(a[None], (B,) + a.shape).reshape((N,) + a.shape[1:])

    se, sr, n, l2p = rows(plan.slot_expert), rows(plan.slot_rank), rows(plan.replicas), rows(plan.l2p)
    live = rows(plan.slot_live)  # [N, P]
    gpu_er = np.where(l2p >= 0, l2p // S, G)  # [N, E, R]
    gslot = np.broadcast_to(np.arange(P, dtype=np.int64) // S, (N, P))
    cf = c.reshape(N, E)
    q = _initial(cf, se, sr, n, live)  # [N, P]
    T = _lower_bound(cf, q, n, se, G)
    out = np.empty((N, P), np.int64)
    active = np.arange(N)  # rows still searching
    best, best_peak = q, np.full(N, INF)
    dist = np.full((N, G), INF)  # [N, G] warm labels
    for _ in range(rounds + 1):
        ld = q.reshape(q.shape[0], G, -1).sum(-1)  # [N', G]
        peak = ld.max(-1)
        better = peak < best_peak
        best, best_peak = np.where(better[:, None], q, best), np.minimum(peak, best_peak)
        if early_exit and (done := best_peak <= T).any():  # proven optimal: final
            out[active[done]] = best[done]
            keep = ~done
            active, q, T, best, best_peak, dist, ld = (
                a[keep] for a in (active, q, T, best, best_peak, dist, ld)
            )
            se, gpu_er, gslot, live = se[keep], gpu_er[keep], gslot[keep], live[keep]
            if active.size == 0:
                break
        Tp = T + (best_peak - T) // 2  # aim halfway between the bound and the best peak
        dist = _labels(dist, ld, q, Tp, gpu_er, se, depth)
        q, bound = _push(q, ld, Tp, dist, gslot, se, live)
        T = np.maximum(T, bound)
    out[active] = best
    return out.reshape(B, L, P)


def _solve(counts, logical_to_physical_map, slots_per_gpu, rounds, depth):
    if isinstance(rounds, bool) or int(rounds) != rounds or rounds < 0 or int(depth) != depth or depth < 1:
        raise ValueError(f"rounds must be an integer >= 0 and depth >= 1, got rounds={rounds}, depth={depth}")
    plan = step_plan(logical_to_physical_map, slots_per_gpu)
    c, lead = batch_counts(counts, plan)
    squeeze = np.asarray(logical_to_physical_map).ndim == 2
    return solve_slots(c, plan, int(rounds), int(depth)), plan, lead, squeeze


def slot_to_replica(qs: np.ndarray, l2p: np.ndarray) -> np.ndarray:
    """Slot quotas ``[B, L, P]`` -> replica quotas ``[B, L, E, R]`` (0 on padding)."""
    B = qs.shape[0]
    L, E, R = l2p.shape
    idx = np.broadcast_to(np.maximum(l2p, 0).reshape(1, L, E * R), (B, L, E * R))
    q = np.take_along_axis(qs, idx, axis=2).reshape(B, L, E, R)
    return np.where(l2p[None] >= 0, q, 0)


def balanced_quotas(
    counts, logical_to_physical_map, slots_per_gpu: int, *, rounds: int = ROUNDS, depth: int = DEPTH
) -> np.ndarray:
    """Integer tokens per replica minimizing the peak GPU load (the ``balanced`` dispatch model).

    Args:
        counts: int ``[..., E]`` (with an ``[E, R]`` map) or ``[..., L, E]`` (with ``[L, E, R]``):
            tokens of each logical expert in one step, summed over all ranks.
        logical_to_physical_map: int ``[E, R]`` or ``[L, E, R]``, ascending slots, -1 padded.
        slots_per_gpu: ``S``; GPU ``g`` owns slots ``[g*S, (g+1)*S)``.
        rounds, depth: push rounds and relabel sweeps per round (at most; a row proven optimal
            stops early with the bits the full rounds give).

    Returns:
        int64 ``[..., E, R]`` or ``[..., L, E, R]``: ``q >= 0``, ``q.sum(-1) == counts``, 0 on padding.
    """
    qs, plan, lead, squeeze = _solve(counts, logical_to_physical_map, slots_per_gpu, rounds, depth)
    q = slot_to_replica(qs, plan.l2p)  # [B, L, E, R]
    return q.reshape(lead + (q.shape[2:] if squeeze else q.shape[1:]))


def balanced_gpu_load(
    counts, logical_to_physical_map, slots_per_gpu: int, *, rounds: int = ROUNDS, depth: int = DEPTH
) -> np.ndarray:
    """Tokens per GPU under :func:`balanced_quotas`: int64 ``[..., G]`` (``[..., L, G]`` per layer)."""
    qs, plan, lead, squeeze = _solve(counts, logical_to_physical_map, slots_per_gpu, rounds, depth)
    B, L, P = qs.shape
    ld = qs.reshape(B, L, plan.num_gpus, plan.slots_per_gpu).sum(-1)  # [B, L, G]
    return ld.reshape(lead + (ld.shape[2:] if squeeze else ld.shape[1:]))


def _augment(u: int, f: int, t: int, cap, adj, level: list[int], nxt: list[int]) -> int:
    """Push up to ``f`` along one level-increasing residual path from ``u`` to ``t`` (Dinic)."""
    if u == t:
        return f
    while nxt[u] < len(adj[u]):
        v = adj[u][nxt[u]]
        if level[v] == level[u] + 1 and cap[u][v] > 0:
            got = _augment(v, min(f, cap[u][v]), t, cap, adj, level, nxt)
            if got:
                cap[u][v] -= got
                cap[v][u] += got
                return got
        nxt[u] += 1
    return 0


def _max_flow(cap: list[list[int]], adj: list[list[int]], s: int, t: int) -> tuple[int, list[bool]]:
    """Dinic's max flow on the residual matrix ``cap`` (changed in place); returns (flow, reachable from s)."""
    n, flow = len(cap), 0
    while True:
        level = [-1] * n
        level[s], frontier = 0, [s]
        for u in frontier:
            for v in adj[u]:
                if level[v] < 0 and cap[u][v] > 0:
                    level[v] = level[u] + 1
                    frontier.append(v)
        if level[t] < 0:
            return flow, [lv >= 0 for lv in level]
        nxt = [0] * n
        while f := _augment(s, 1 << 62, t, cap, adj, level, nxt):
            flow += f


def _lp_peak_one(c: np.ndarray, gpus: list[list[int]], G: int) -> Fraction:
    """Exact min-max fractional load of one layer: ``c [E]``; ``gpus[e]``: the GPUs of expert ``e``."""
    E, total = len(c), int(c.sum())
    if total == 0:
        return Fraction(0)
    s, t = E + G, E + G + 1
    adj: list[list[int]] = [[] for _ in range(E + G + 2)]
    for e in range(E):
        adj[s].append(e)
        adj[e].append(s)
        for g in gpus[e]:
            adj[e].append(E + g)
            adj[E + g].append(e)
    for g in range(G):
        adj[E + g].append(t)
        adj[t].append(E + g)
    T = Fraction(total, G)
    while True:  # Dinkelbach: T rises to c(A)/|GPUs(A)| of the min cut's experts until the flow saturates
        den = T.denominator
        cap = [[0] * (E + G + 2) for _ in range(E + G + 2)]  # capacities scaled by T's denominator
        for e in range(E):
            cap[s][e] = int(c[e]) * den
            for g in gpus[e]:
                cap[e][E + g] = total * den
        for g in range(G):
            cap[E + g][t] = T.numerator
        flow, reach = _max_flow(cap, adj, s, t)
        if flow == total * den:
            return T
        A = [e for e in range(E) if reach[e]]
        T = Fraction(sum(int(c[e]) for e in A), len({g for e in A for g in gpus[e]}))


def lp_peak(counts, logical_to_physical_map, slots_per_gpu: int) -> np.ndarray:
    """Exact fractional optimum of the min-max split (the LP value), float64 ``[...]`` (``[..., L]``).

    ``counts`` and the map as in :func:`balanced_quotas`. The integer optimum is ``ceil`` of it.
    Pure Python max flows: a reference for tests and benchmarks (milliseconds per layer).
    """
    plan = step_plan(logical_to_physical_map, slots_per_gpu)
    c, lead = batch_counts(counts, plan)
    B, L, E = c.shape
    gpu = plan.l2p // plan.slots_per_gpu  # [L, E, R]
    gpus = [
        [[int(g) for g, p in zip(gpu[l, e], plan.l2p[l, e]) if p >= 0] for e in range(E)] for l in range(L)
    ]
    out = np.array(
        [[float(_lp_peak_one(c[b, l], gpus[l], plan.num_gpus)) for l in range(L)] for b in range(B)]
    ).reshape(B, L)
    squeeze = np.asarray(logical_to_physical_map).ndim == 2
    return out.reshape(lead + (() if squeeze else (L,)))
