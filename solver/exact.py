"""Exact joint replication and placement per layer (OR-Tools CP-SAT, scipy MILP / HiGHS), with bounds.

Problem (one layer; E logical experts, G GPUs with S slots each, P = G*S, N nodes):

- replica counts ``n_e >= 1`` (integers, ``sum_e n_e = P``) and ``x[e, g] in {0, 1}`` (at most one
  replica of an expert per GPU), ``sum_e x[e, g] = S``, ``sum_g x[e, g] = n_e``;
- tokens of an expert split evenly over its replicas (the servers' static dispatch), so GPU ``g`` carries
  ``sum_e x[e, g] * c[e, n_e]`` with ``c[e, r] = w_e / r`` (the ``tokens`` objective) or the decode
  cost of one replica (``decode``, below); minimise the peak over GPUs (or over windows, ``robust``).
- optional node constraint (``node_constraint=True``, as the hierarchical policy): expert groups go
  to nodes (``groups / N`` groups per node) and every replica of a group's experts stays in its node;
  enforced inside the model (group-to-node variables), not by packing groups first.

The nonlinear ``w_e / n_e`` is linearised exactly: each expert's cost table ``c[e, r]`` over its
allowed counts ``r in [lo_e, hi_e]`` is an element constraint on ``n_e`` (CP-SAT) or a one-hot
``y[e, r]`` with products ``s[e, g] >= c[e, r] * (x[e, g] + y[e, r] - 1)`` (MILP; exact because the
objective only pushes ``s`` down). ``lo_e = max(1, ceil(w_e / UB))`` with UB the incumbent's peak
(every better solution needs it) and ``hi_e <= min(G, 1 + P - E)``; on large instances the count
range of cold experts is narrowed around the incumbent (``extra["restricted"]``), and then the
model's own bound is not used as a global bound.

Integer scaling (CP-SAT works on integers): with integer loads and ``lcm(1..R_max) * max(w)`` below
2**40 every share is scaled by ``K = lcm(1..R_max)`` and is exact. Otherwise ``K`` is a fixed-point
scale (total load about 1e7 units) and every share is rounded *up* (``ceil(w_e K / r)``): a model
solution's true peak is at most its model peak / K, and the model bound ``B`` certifies a true bound
``(B - S + 1) / K`` (each GPU adds at most ``S`` roundings of < 1 unit). The MILP works in floats.

Bounds reported per layer: the best of the closed-form ``peak_lower_bound`` (mean, hottest expert),
the count bound (the least ``T`` with ``sum_e max(1, ceil(w_e / T)) <= P`` and ``ceil(w_e / T) <= G``;
it dominates the closed form and the LP relaxation of the joint model, which is the mean) and the
complete model's proven bound.

Search: every layer starts from the greedy placement (global policy, or hierarchical with node
constraints), improved by a deterministic local search (swaps between the hottest GPU and the others,
and moving a slot from one expert to another), then CP-SAT hinted with it. The returned layer is the
best of greedy and the solvers' results, so it is never worse than greedy.

Determinism: with ``deterministic=True`` (default) every CP-SAT solve uses one worker, the given seed
and a *deterministic-time* limit (CP-SAT's work units; half a unit per second of the layer's wall
share, since units run about 2x slower than seconds on a loaded core) computed from ``time_limit``
only; the local search and the neighbourhood search are bounded by iterations and rounds, not time.
Two runs then return the same map, whatever the machine load, unless the wall-clock safety cap (4x
the per-layer share) cuts a solve short, which ``notes`` then reports. With ``deterministic=False`` solves use the wall clock.

Decode objective (``objective="decode"``): in memory-bound decode a GPU's time per step is about
``a * tokens + t_read * (experts with at least one token)``. For a step of ``batch`` tokens per GPU
and top-k ``k``, expert ``e`` gets ``lam_e = f_e * k * batch * G`` selections (``f_e`` its load
share); one of its ``r`` replicas is active with probability ``1 - exp(-lam_e / r)`` (Poisson), so
``c[e, r] = a * lam_e / r + t_read * (1 - exp(-lam_e / r))`` microseconds. Replicating a cold expert
adds a weight read for few tokens, so the decode optimum replicates less than the token optimum.
Defaults (see :class:`DecodeCost`) are DeepSeek-V3 on H100 from ../shared/docs/costmodel.md; this
module keeps its own small constants on purpose (no dependency on ``solver.costmodel``).

Robust (``robust="max"`` or ``"qNN"``): per window ``w`` the load is normalised to mean 1 per GPU and
the objective is the max over windows of the window's peak (PAR), or for ``qNN`` the CVaR at NN%: the
mean of the worst ``m = max(1, ceil((1 - NN/100) W))`` windows' peaks (exactly
``min_tau m*tau + sum_w max(0, peak_w - tau)``; an upper bound of the NN-th percentile).

Noise gate (default when the input has windows): the exact optimum of the fitted load beats greedy
by less than the sampling noise on the real traces, and then loses as often as it wins on held-out
traffic. So the default keeps greedy's placement and changes it only where the gain is significant:
per layer ``sigma`` = bootstrap standard deviation of greedy's peak (windows, or label groups, resampled
and rescaled to the fit total), then :func:`solver.migration.solve_migration` from greedy with
``move_cost = noise_k * sigma`` per moved slot, or the exact layer when it scores better on that same
penalised objective. The layer's proven bound is still the exact solve's, so its gap is reported.

Weighted dispatch: ``weighted="shares"`` keeps the even-split optimum and adds per-replica shares
``q[p] >= 0`` (summing to 1 per expert) from an LP that minimises the peak on that placement
(``extra["replica_shares"]``, ``extra["weighted_objective"]``). ``weighted=True`` chooses the placement
*for* weighted dispatch (:mod:`solver.weighted`: bin packing with item splitting, then the same LP):
the report is then the weighted solve's (``objective`` = weighted peak, ``bound`` = ``max(mean,
max_e w_e / rmax)``) with the even-split peak of the same placement beside it in
``extra["even_objective"]``; such a placement is meant only for engines that dispatch by weight.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from placement.metrics import expected_gpu_load, peak_lower_bound
from placement.model import Placement
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.greedy import greedy_placement
from solver.report import LayerReport, SolveReport

__all__ = [
    "DecodeCost",
    "solve_exact",
    "count_lower_bound",
    "replica_weights",
    "weighted_shares",
    "write_replica_weights",
    "layer_cost_table",
    "peak_noise",
]

log = logging.getLogger(__name__)

_EXACT_SCALE_LIMIT = 2**40  # largest scaled share for the exact lcm scaling
_FIXED_POINT_TOTAL = 1e7  # total scaled load per window with fixed-point scaling
_MAX_MODEL_TERMS = 60_000
_FULL_MODEL_LIMIT = 8192  # E * G * W above which the joint model gives way to LNS + local search
_SAFETY_CAP = 4.0  # deterministic mode: wall-clock cap, as a multiple of the layer's share
_DET_FACTOR = 0.5  # deterministic-time units granted per wall second (they run ~2x slower on a loaded core)
_LNS_ROUND_S = 0.08  # CP-SAT limit of one neighbourhood re-pack (deterministic units in deterministic mode)  # (expert, gpu, window) product terms before count ranges are narrowed


# ---------------------------------------------------------------------------------------------
# Decode cost constants (own copy on purpose; see module docstring)
# ---------------------------------------------------------------------------------------------
# DeepSeek-V3 expert, FP8: 3 * d * f bytes with d = 7168, f = 2048.
_DSV3_EXPERT_BYTES = 3 * 7168 * 2048
# Effective HBM bandwidth, bytes/s: datasheet x eta_m = 0.88 (costmodel.md).
_HBM_EFFECTIVE = {"h100": 3.35e12 * 0.88, "h800": 3.35e12 * 0.88, "h200": 4.8e12 * 0.88}
# Dense FP8 FLOP/s x eta_c = 0.54 (costmodel.md; Hopper).
_FLOPS_EFFECTIVE = {"h100": 1979e12 * 0.54, "h800": 1979e12 * 0.54, "h200": 1979e12 * 0.54}


@dataclass(frozen=True)
class DecodeCost:
    """Per-step decode cost of one replica (defaults: DeepSeek-V3 FP8 on H100, costmodel.md).

    Attributes:
        batch_tokens_per_gpu: decode tokens per attention-DP rank in one step.
        top_k: routed experts per token.
        token_time_us: compute time per routed token on one GPU (``6 d f / (FLOP/s * eta_c)``).
        expert_bytes: bytes of one expert's weights (read once per step when it has a token).
        hbm_bytes_per_s: effective HBM bandwidth.
    """

    batch_tokens_per_gpu: float = 128.0
    top_k: int = 8
    token_time_us: float = 6 * 7168 * 2048 / _FLOPS_EFFECTIVE["h100"] * 1e6
    expert_bytes: float = float(_DSV3_EXPERT_BYTES)
    hbm_bytes_per_s: float = _HBM_EFFECTIVE["h100"]

    @property
    def read_time_us(self) -> float:
        return self.expert_bytes / self.hbm_bytes_per_s * 1e6

    @classmethod
    def build(cls, expert_bytes=None, hardware=None, top_k=None) -> DecodeCost:
        """Defaults overridden by ``expert_bytes``, a hardware name (h100, h800, h200) or a dict of fields."""
        dc = cls()
        if isinstance(hardware, str):
            key = hardware.lower()
            if key not in _HBM_EFFECTIVE:
                raise ValueError(
                    f"unknown hardware {hardware!r}; use one of {sorted(_HBM_EFFECTIVE)} or a dict"
                )
            dc = replace(
                dc,
                hbm_bytes_per_s=_HBM_EFFECTIVE[key],
                token_time_us=6 * 7168 * 2048 / _FLOPS_EFFECTIVE[key] * 1e6,
            )
        elif isinstance(hardware, Mapping):
            unknown = set(hardware) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(
                    f"unknown decode cost fields {sorted(unknown)}; use {sorted(cls.__dataclass_fields__)}"
                )
            dc = replace(dc, **dict(hardware))
        elif hardware is not None:
            raise ValueError(
                f"hardware must be a name or a dict of DecodeCost fields, got {type(hardware).__name__}"
            )
        if expert_bytes is not None:
            if not expert_bytes > 0:
                raise ValueError(f"expert_bytes must be > 0, got {expert_bytes}")
            dc = replace(dc, expert_bytes=float(expert_bytes))
        if top_k is not None and not (isinstance(hardware, Mapping) and "top_k" in hardware):
            dc = replace(dc, top_k=int(top_k))
        return dc


# ---------------------------------------------------------------------------------------------
# Bounds and cost tables
# ---------------------------------------------------------------------------------------------
def _max_replicas(E: int, G: int, P: int) -> int:
    return max(1, min(G, 1 + P - E))


def count_lower_bound(load: np.ndarray, ep_size: int, num_physical_experts: int) -> np.ndarray:
    """Lower bound on the even-split peak GPU load, per layer, for any placement.

    ``max(mean, T*)`` with ``T*`` the least ``T`` for which the replica counts every expert needs to
    stay under ``T`` (``max(1, ceil(w_e / T))``, at most ``min(G, 1 + P - E)`` each) fit in ``P``
    slots. Dominates :func:`placement.metrics.peak_lower_bound`.

    Args:
        load: ``[L, E]`` (or ``[E]``). Returns: float64 ``[L]`` (or a float).
    """
    w = np.asarray(load, dtype=np.float64)
    if w.ndim == 1:
        return float(count_lower_bound(w[None], ep_size, num_physical_experts)[0])
    L, E = w.shape
    G, P = int(ep_size), int(num_physical_experts)
    rmax = _max_replicas(E, G, P)
    out = np.empty(L)
    r = np.arange(1, rmax + 1)
    for l in range(L):
        wl = w[l]
        # candidate peaks are the shares w_e / r; the least feasible one is the bound
        cand = np.unique((wl[:, None] / r[None, :]).ravel())
        cand = cand[cand >= wl.max() / rmax]

        def need(T):
            if T <= 0:
                return math.inf
            return np.maximum(1, np.ceil(wl / T - 1e-12)).sum()  # noqa: B023 (called in this iteration)

        lo, hi = 0, len(cand) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if need(cand[mid]) <= P:
                hi = mid
            else:
                lo = mid + 1
        out[l] = max(wl.sum() / G, cand[lo] if len(cand) else 0.0)
    return np.maximum(out, peak_lower_bound(w, G, P))


def layer_cost_table(
    windows: np.ndarray,
    rmax: int,
    objective: str = "tokens",
    decode: DecodeCost | None = None,
    num_gpus: int = 1,
) -> np.ndarray:
    """Per-replica cost ``c[w, e, r]`` for ``r = 0..rmax`` (index 0 unused, set to +inf).

    Args:
        windows: ``[W, E]`` loads of one layer.
        objective: ``tokens`` (``w_e / r``) or ``decode`` (microseconds per step, module docstring).
    Returns:
        float64 ``[W, E, rmax + 1]``.
    """
    w = np.asarray(windows, dtype=np.float64)
    r = np.arange(rmax + 1, dtype=np.float64)
    r[0] = np.nan
    if objective == "tokens":
        c = w[:, :, None] / r[None, None, :]
    elif objective == "decode":
        dc = decode or DecodeCost()
        tot = w.sum(axis=1, keepdims=True)
        frac = np.divide(w, tot, out=np.zeros_like(w), where=tot > 0)
        lam = frac * dc.top_k * dc.batch_tokens_per_gpu * num_gpus  # [W, E] selections per step
        per = lam[:, :, None] / r[None, None, :]
        c = dc.token_time_us * per + dc.read_time_us * (1.0 - np.exp(-per))
    else:
        raise ValueError(f"unknown objective {objective!r}; use 'tokens' or 'decode'")
    c[:, :, 0] = np.inf
    return c


# ---------------------------------------------------------------------------------------------
# One layer's problem
# ---------------------------------------------------------------------------------------------
@dataclass
class _Layer:
    cost: np.ndarray  # [W, E, R+1] float
    G: int
    S: int
    rmax: int
    robust_m: int  # windows averaged in the objective (1 = max)
    node_of_gpu: np.ndarray | None  # [G] when node constrained
    group_of_expert: np.ndarray | None  # [E]
    groups_per_node: int = 0

    @property
    def W(self) -> int:
        return self.cost.shape[0]

    @property
    def E(self) -> int:
        return self.cost.shape[1]

    def loads(self, assign: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """``[W, G]`` loads of ``assign [G, S]`` with ``counts [E]``."""
        per = self.cost[:, np.arange(self.E), counts]  # [W, E]
        return per[:, assign].sum(axis=2)

    def agg(self, peaks: np.ndarray) -> np.ndarray:
        """Objective from window peaks ``[..., W]``: mean of the worst ``robust_m``."""
        if self.robust_m == 1:
            return peaks.max(axis=-1)
        return -np.sort(-peaks, axis=-1)[..., : self.robust_m].mean(axis=-1)

    def value(self, assign, counts) -> float:
        return float(self.agg(self.loads(assign, counts).max(axis=1)))


def _counts_of(assign: np.ndarray, E: int) -> np.ndarray:
    return np.bincount(assign.ravel(), minlength=E).astype(np.int64)


def _local_search(
    pb: _Layer, assign: np.ndarray, max_iters: int, deadline: float | None
) -> tuple[np.ndarray, int]:
    """Deterministic descent on (objective, sum of squared loads) from ``assign [G, S]``.

    Moves: swap an item of the hottest GPU with an item of another GPU (same node when node
    constrained), and re-assign one slot from expert ``a`` (with >= 2 replicas) to expert ``b``.
    Returns the improved assignment and the iterations done.
    """
    G, S, E, W = pb.G, pb.S, pb.E, pb.W
    assign = assign.copy()
    counts = _counts_of(assign, E)
    holds = np.zeros((G, E), dtype=bool)
    holds[np.repeat(np.arange(G), S), assign.ravel()] = True
    node = pb.node_of_gpu
    if node is not None:
        node_of_expert = np.full(E, -1)
        for g in range(G):
            node_of_expert[assign[g]] = node[g]
    ar_e = np.arange(E)

    def score(L):
        return (float(pb.agg(L.max(axis=-1))), float((L * L).sum()))

    L = pb.loads(assign, counts)  # [W, G]
    cur = score(L)
    it = 0
    while it < max_iters and (deadline is None or time.perf_counter() < deadline):
        it += 1
        per = pb.cost[:, ar_e, counts]  # [W, E]
        peaks = L.max(axis=1)
        wcrit = int(np.argmax(peaks))
        h = int(np.argmax(L[wcrit]))
        best = None  # (score, kind, data)
        # --- swaps between h and every other GPU g: item i of h <-> item j of g -----------------
        a_items = assign[h]  # [S]
        d = per[:, a_items][:, :, None, None] - per[:, assign][:, None, :, :]  # [W, S, G, S]
        newLh = L[:, h][:, None, None, None] - d
        newLg = L[:, :][:, None, :, None] + d
        ok = ~holds[:, a_items].T[:, :, None]  # [S(i), G, 1]: a_i not on g
        ok = ok & ~holds[h][assign][None, :, :]  # b_j not on h
        ok[:, h, :] = False
        if node is not None:
            ok &= (node == node[h])[None, :, None]
        if ok.any():
            # peaks per window excluding h and g: top-3 per window
            order = np.argsort(-L, axis=1)[:, :3]  # [W, 3] the three hottest GPUs per window
            gidx = np.arange(G)
            rest = np.full((W, G), -np.inf)  # [W, G] max load over GPUs other than h and g
            for w in range(W):
                for k in reversed(range(order.shape[1])):
                    o = order[w, k]
                    if o != h:
                        rest[w, gidx != o] = L[w, o]
            newpeak = np.maximum(np.maximum(newLh, newLg), rest[:, None, :, None])  # [W, S, G, S]
            obj = pb.agg(np.moveaxis(newpeak, 0, -1))  # [S, G, S]
            sq = ((newLh**2 + newLg**2) - (L[:, h][:, None, None, None] ** 2 + L[:, None, :, None] ** 2)).sum(
                axis=0
            )
            obj = np.where(ok, obj, np.inf)
            sqv = np.where(ok, sq + cur[1], np.inf)
            k = np.lexsort((sqv.ravel(), obj.ravel()))[0]
            cand_score = (float(obj.ravel()[k]), float(sqv.ravel()[k]))
            if _better(cand_score, cur):
                i, g, j = np.unravel_index(k, obj.shape)
                best = (cand_score, "swap", (int(i), int(g), int(j)))
        # --- recount: slot (g, j) from expert a (n_a >= 2) to expert b ---------------------------
        cand_a_slots = []
        hot_experts = assign[h]
        for j in range(S):
            if counts[assign[h, j]] >= 2:
                cand_a_slots.append((h, j))
        gs, js = np.nonzero(counts[assign] >= 2)  # all donor slots
        # (1) donor slots on h x every b; (2) every donor slot x b in h's experts
        C_g, C_j, C_b = [], [], []
        for g, j in cand_a_slots:
            bs = np.flatnonzero(~holds[g] & (counts < pb.rmax))
            C_g.append(np.full(len(bs), g))
            C_j.append(np.full(len(bs), j))
            C_b.append(bs)
        for b in hot_experts:
            if counts[b] >= pb.rmax:
                continue
            sel = ~holds[gs, b]
            C_g.append(gs[sel])
            C_j.append(js[sel])
            C_b.append(np.full(int(sel.sum()), b))
        if C_g:
            cg = np.concatenate(C_g)
            cj = np.concatenate(C_j)
            cb = np.concatenate(C_b)
            ca = assign[cg, cj]
            keep = ca != cb
            if node is not None:
                keep &= node_of_expert[cb] == node[cg]
            cg, cj, cb, ca = cg[keep], cj[keep], cb[keep], ca[keep]
        if C_g and len(cg):
            na, nb = counts[ca], counts[cb]
            da = pb.cost[:, ca, na - 1] - pb.cost[:, ca, na]  # [W, C]
            db = pb.cost[:, cb, nb + 1] - pb.cost[:, cb, nb]
            newL = (
                L[:, None, :] + da[:, :, None] * holds.T[ca][None] + db[:, :, None] * holds.T[cb][None]
            )  # [W, C, G]
            ci = np.arange(len(cg))
            newL[:, ci, cg] += (
                -pb.cost[:, ca, na - 1] + pb.cost[:, cb, nb + 1]
            )  # g: loses a entirely, gains b
            obj = pb.agg(np.moveaxis(newL.max(axis=2), 0, -1))  # [C]
            sq = (newL**2).sum(axis=(0, 2))
            k = np.lexsort((sq, obj))[0]
            cand_score = (float(obj[k]), float(sq[k]))
            if _better(cand_score, cur) and (best is None or _better(cand_score, best[0])):
                best = (cand_score, "recount", (int(cg[k]), int(cj[k]), int(cb[k])))
        if best is None:
            break
        kind, data = best[1], best[2]
        if kind == "swap":
            i, g, j = data
            a, b = assign[h, i], assign[g, j]
            assign[h, i], assign[g, j] = b, a
            holds[h, a] = holds[g, b] = False
            holds[h, b] = holds[g, a] = True
        else:
            g, j, b = data
            a = assign[g, j]
            assign[g, j] = b
            holds[g, a] = False
            holds[g, b] = True
            counts[a] -= 1
            counts[b] += 1
        L = pb.loads(assign, counts)
        cur = score(L)
    return assign, it


def _better(a, b, rel=1e-12) -> bool:
    if a[0] < b[0] - rel * max(1.0, abs(b[0])):
        return True
    if a[0] <= b[0] + rel * max(1.0, abs(b[0])):
        return a[1] < b[1] * (1 - 1e-12) - 1e-12
    return False


# ---------------------------------------------------------------------------------------------
# Integer scaling
# ---------------------------------------------------------------------------------------------
def _integer_costs(pb: _Layer, objective: str, windows: np.ndarray) -> tuple[np.ndarray, float, bool]:
    """Scaled integer table ``[W, E, R+1]`` (index 0 = 0), scale K and whether it is exact."""
    c = pb.cost
    if objective == "tokens" and np.all(windows == np.round(windows)):
        K = math.lcm(*range(1, pb.rmax + 1))
        if K * float(windows.max(initial=0)) < _EXACT_SCALE_LIMIT:
            wi = np.round(windows).astype(np.int64)
            r = np.arange(pb.rmax + 1)
            r[0] = 1
            tab = (wi[:, :, None] * K) // r[None, None, :]
            tab[:, :, 0] = 0
            return tab.astype(np.int64), float(K), True
    finite = np.where(np.isfinite(c), c, 0.0)
    tot = float(finite[:, :, 1].sum(axis=1).max(initial=0))
    K = _FIXED_POINT_TOTAL / tot if tot > 0 else 1.0
    tab = np.ceil(finite * K - 1e-9).astype(np.int64)
    tab[:, :, 0] = 0
    return tab, K, False


# ---------------------------------------------------------------------------------------------
# CP-SAT backend
# ---------------------------------------------------------------------------------------------
@dataclass
class _Result:
    assign: np.ndarray | None
    status: str
    model_bound: float | None  # true units, valid only when complete
    complete: bool
    wall: float
    note: str = ""


def _count_ranges(
    pb: _Layer, incumbent: np.ndarray, inc_value: float, objective: str, windows: np.ndarray, P: int
):
    E, G = pb.E, pb.G
    inc_counts = _counts_of(incumbent, E)
    lo = np.ones(E, dtype=np.int64)
    if objective == "tokens" and pb.W == 1 and inc_value > 0:
        lo = np.maximum(1, np.ceil(windows[0] / inc_value - 1e-9)).astype(np.int64)
        lo = np.minimum(lo, inc_counts)  # the incumbent itself stays feasible
    slack = P - int(lo.sum())
    hi = np.minimum(pb.rmax, lo + slack)
    complete = True

    def terms(lo_, hi_):
        return int(((hi_ > lo_) * G * pb.W).sum())

    if terms(lo, hi) > _MAX_MODEL_TERMS:
        complete = False
        # narrow around the incumbent: hot experts keep a window, cold ones keep the incumbent's count
        hi = np.minimum(hi, np.maximum(inc_counts + 2, lo))
        lo = np.maximum(lo, inc_counts - 2)
        lo = np.minimum(lo, inc_counts)
        order = np.argsort(-pb.cost[:, :, 1].max(axis=0), kind="stable")
        budget = _MAX_MODEL_TERMS // (G * pb.W)
        free = order[:budget]
        fixed = np.setdiff1d(np.arange(E), free)
        lo[fixed] = hi[fixed] = inc_counts[fixed]
    return lo, hi, complete


def _canonical(
    pb: _Layer, assign: np.ndarray, tab: np.ndarray, counts: np.ndarray, e0: int, grp0: int | None
):
    """Permute GPUs (and nodes) of ``assign [G, S]`` so that it meets the symmetry-breaking rules."""
    G = pb.G
    per = tab[:, np.arange(pb.E), counts]
    load0 = per[0][assign].sum(axis=1)
    if pb.node_of_gpu is None:
        has0 = (assign == e0).any(axis=1)
        order = np.lexsort((-load0, ~has0))
        return assign[order]
    m = G // (pb.node_of_gpu.max() + 1)
    N = G // m
    nodes = [np.arange(n * m, (n + 1) * m) for n in range(N)]
    node_has = [bool(np.isin(np.flatnonzero(pb.group_of_expert == grp0), assign[gs]).any()) for gs in nodes]
    node_order = sorted(range(N), key=lambda n: (not node_has[n], n))
    out = []
    for n in node_order:
        gs = nodes[n]
        out.append(assign[gs[np.argsort(-load0[gs], kind="stable")]])
    return np.concatenate(out)


def _solve_cpsat(pb, incumbent, inc_value, objective, windows, P, seed, limit_s, deterministic, lb_true):
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    E, G, S, W = pb.E, pb.G, pb.S, pb.W
    tab, K, exact = _integer_costs(pb, objective, windows)
    lo, hi, complete = _count_ranges(pb, incumbent, inc_value, objective, windows, P)
    inc_counts = _counts_of(incumbent, E)
    e0 = int(np.argmax(pb.cost[:, :, 1].max(axis=0)))
    grp0 = None if pb.group_of_expert is None else int(pb.group_of_expert[e0])
    hint = _canonical(pb, incumbent, tab, inc_counts, e0, grp0)
    hint_x = np.zeros((E, G), dtype=bool)
    hint_x[hint.T, np.arange(G)[None, :]] = True
    hint_loads = tab[:, np.arange(E), inc_counts][:, hint].sum(axis=2)  # [W, G]

    m = cp_model.CpModel()
    x = [[m.new_bool_var(f"x{e}_{g}") for g in range(G)] for e in range(E)]
    n = []
    for e in range(E):
        if lo[e] == hi[e]:
            n.append(int(lo[e]))
        else:
            n.append(m.new_int_var(int(lo[e]), int(hi[e]), f"n{e}"))
    # each expert: its count of replicas, at most one per GPU
    for e in range(E):
        m.add(sum(x[e]) == n[e])
    m.add(sum(n) == P)
    # each GPU: exactly S slots
    for g in range(G):
        m.add(sum(x[e][g] for e in range(E)) == S)
    # node constraint: groups to nodes, replicas inside their group's node
    if pb.node_of_gpu is not None:
        N = int(pb.node_of_gpu.max()) + 1
        ngroups = int(pb.group_of_expert.max()) + 1
        a = [[m.new_bool_var(f"a{q}_{k}") for k in range(N)] for q in range(ngroups)]
        for q in range(ngroups):
            m.add_exactly_one(a[q])
        for k in range(N):
            m.add(sum(a[q][k] for q in range(ngroups)) == pb.groups_per_node)
        for e in range(E):
            q = int(pb.group_of_expert[e])
            for g in range(G):
                m.add_implication(x[e][g], a[q][int(pb.node_of_gpu[g])])
        m.add(a[grp0][0] == 1)  # symmetry: the hottest expert's group on node 0
    # loads: fixed-count experts contribute constants, variable ones through share variables
    var_e = [e for e in range(E) if lo[e] != hi[e]]
    loads = [[None] * G for _ in range(W)]
    t_vars = {}
    s_vars = {}
    for w in range(W):
        for e in var_e:
            vals = [int(tab[w, e, max(r, lo[e])]) for r in range(int(hi[e]) + 1)]
            t = m.new_int_var(min(vals[lo[e] :]), max(vals[lo[e] :]), f"t{w}_{e}")
            m.add_element(n[e], vals, t)
            t_vars[w, e] = t
            for g in range(G):
                s = m.new_int_var(0, max(vals[lo[e] :]), f"s{w}_{e}_{g}")
                m.add(s >= t).only_enforce_if(x[e][g])
                s_vars[w, e, g] = s
    ub = int(tab[:, :, 1].sum(axis=1).max())  # no GPU can carry more than every expert unsplit
    peak = []
    for w in range(W):
        for g in range(G):
            expr = sum(int(tab[w, e, lo[e]]) * x[e][g] for e in range(E) if lo[e] == hi[e])
            expr = expr + sum(s_vars[w, e, g] for e in var_e)
            lv = m.new_int_var(0, ub, f"l{w}_{g}")
            m.add(lv == expr)
            loads[w][g] = lv
        pw = m.new_int_var(0, ub, f"p{w}")
        m.add_max_equality(pw, loads[w])
        peak.append(pw)
    # valid lower bound in model units (normalised token windows or plain tokens)
    if lb_true is not None:
        for w in range(W):
            m.add(peak[w] >= int(math.ceil(lb_true[w] * K - 1e-6)))
    if pb.robust_m == 1:
        obj = m.new_int_var(0, ub, "obj")
        m.add_max_equality(obj, peak)
        hint_obj = int(hint_loads.max(axis=1).max())
    else:
        tau = m.new_int_var(0, ub, "tau")
        u = [m.new_int_var(0, ub, f"u{w}") for w in range(W)]
        for w in range(W):
            m.add(u[w] >= peak[w] - tau)
        obj = m.new_int_var(0, (ub) * W, "obj")
        m.add(obj == pb.robust_m * tau + sum(u))
        pk = np.sort(hint_loads.max(axis=1))[::-1]
        hint_obj = int(pk[: pb.robust_m].sum())
        m.add_hint(tau, int(pk[pb.robust_m - 1]))
        for w in range(W):
            m.add_hint(u[w], int(max(0, hint_loads[w].max() - pk[pb.robust_m - 1])))
    m.add(obj <= hint_obj)
    m.minimize(obj)
    # symmetry breaking among interchangeable GPUs
    if pb.node_of_gpu is None:
        for g in range(G - 1):
            m.add_implication(x[e0][g + 1], x[e0][g])
            m.add(loads[0][g] >= loads[0][g + 1]).only_enforce_if([x[e0][g], x[e0][g + 1]])
            m.add(loads[0][g] >= loads[0][g + 1]).only_enforce_if([~x[e0][g], ~x[e0][g + 1]])
    else:
        for g in range(G - 1):
            if pb.node_of_gpu[g] == pb.node_of_gpu[g + 1]:
                m.add(loads[0][g] >= loads[0][g + 1])
    # hint: the canonicalised incumbent
    for e in range(E):
        for g in range(G):
            m.add_hint(x[e][g], bool(hint_x[e, g]))
        if e in var_e:
            m.add_hint(n[e], int(inc_counts[e]))
    for (w, e), t in t_vars.items():
        m.add_hint(t, int(tab[w, e, inc_counts[e]]))
    for (w, e, g), s in s_vars.items():
        m.add_hint(s, int(tab[w, e, inc_counts[e]]) if hint_x[e, g] else 0)
    for w in range(W):
        for g in range(G):
            m.add_hint(loads[w][g], int(hint_loads[w, g]))
        m.add_hint(peak[w], int(hint_loads[w].max()))
    m.add_hint(obj, hint_obj)
    if pb.node_of_gpu is not None:
        mm = G // N
        for q in range(ngroups):
            es = np.flatnonzero(pb.group_of_expert == q)
            gs = np.flatnonzero(hint_x[es].any(axis=0))
            k = int(gs[0] // mm) if len(gs) else 0
            for kk in range(N):
                m.add_hint(a[q][kk], kk == k)

    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.random_seed = int(seed)
    prm.num_workers = 1
    build = time.perf_counter() - t0
    if deterministic:
        prm.max_deterministic_time = max(0.05, _DET_FACTOR * limit_s)
        prm.max_time_in_seconds = max(0.5, _SAFETY_CAP * limit_s)
    else:
        prm.max_time_in_seconds = max(0.05, limit_s - build)
    st = solver.solve(m)
    wall = time.perf_counter() - t0
    note = ""
    if deterministic and solver.wall_time >= 0.98 * prm.max_time_in_seconds:
        note = "wall-clock safety cap reached: this layer may not reproduce exactly"
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return _Result(
            None, "greedy_fallback" if st == cp_model.UNKNOWN else "infeasible", None, complete, wall, note
        )
    xv = np.array([[solver.boolean_value(x[e][g]) for g in range(G)] for e in range(E)])
    assign = np.stack([np.flatnonzero(xv[:, g]) for g in range(G)])
    # model bound to true units (ceil-rounded shares: at most S units per GPU above K * true load)
    bound_model = solver.best_objective_bound
    if pb.robust_m > 1:
        bound_model = bound_model / pb.robust_m
    bt = bound_model / K if exact else (bound_model - S + 1) / K
    status = "optimal" if st == cp_model.OPTIMAL else "time_limit"
    return _Result(assign, status, bt, complete, wall, note)


def _lns_cpsat(
    pb: _Layer,
    assign: np.ndarray,
    rounds: int,
    sub_limit: float,
    seed: int,
    deterministic: bool,
    deadline: float | None,
    size: int = 8,
) -> tuple[np.ndarray, int]:
    """Large-neighbourhood search with exact CP-SAT sub-solves, for instances too big for the joint model.

    Each round frees the hottest GPU of the critical window, the coolest ones and a seeded random one
    (``size`` GPUs in all, inside one node when node constrained) and re-packs their replicas among
    them optimally (replica counts fixed there: the recount moves of the local search change counts).
    A round is accepted when the freed GPUs' peak drops. Returns the assignment and rounds done.
    """
    from ortools.sat.python import cp_model

    G, S, E, W = pb.G, pb.S, pb.E, pb.W
    rng = np.random.default_rng(seed)
    assign = assign.copy()
    counts = _counts_of(assign, E)
    done = 0
    stale = 0
    for _ in range(rounds):
        if deadline is not None and time.perf_counter() >= deadline:
            break
        done += 1
        L = pb.loads(assign, counts)  # [W, G]
        wc = int(np.argmax(L.max(axis=1)))
        h = int(np.argmax(L[wc]))
        pool = np.arange(G)
        if pb.node_of_gpu is not None:
            pool = np.flatnonzero(pb.node_of_gpu == pb.node_of_gpu[h])
        pool = pool[pool != h]
        k = min(size - 1, len(pool))
        if k < 1:
            break
        cool = pool[np.argsort(L[wc, pool], kind="stable")]
        n_cool = max(1, k - 1 - min(stale, k - 1))
        chosen = list(cool[:n_cool])
        rest = np.setdiff1d(pool, chosen)
        if len(rest) and len(chosen) < k:
            chosen += list(rng.choice(rest, size=min(k - len(chosen), len(rest)), replace=False))
        H = np.array([h] + [int(c) for c in chosen])
        items = assign[H].ravel()  # [|H| * S] experts
        per = pb.cost[:, np.arange(E), counts]  # [W, E]
        scale = 1e6 / max(1e-12, float(per[:, items].sum(axis=1).max()))
        size_i = np.ceil(per[:, items] * scale - 1e-9).astype(np.int64)  # [W, items]
        m = cp_model.CpModel()
        nH, nI = len(H), len(items)
        y = [[m.new_bool_var("") for _ in range(nH)] for _ in range(nI)]
        for i in range(nI):
            m.add_exactly_one(y[i])
        for j in range(nH):
            m.add(sum(y[i][j] for i in range(nI)) == S)
        for e in np.unique(items):
            idx = np.flatnonzero(items == e)
            if len(idx) > 1:
                for j in range(nH):
                    m.add_at_most_one(y[i][j] for i in idx)
        top = int(size_i.sum(axis=1).max())
        pk = m.new_int_var(0, top, "peak")
        for w in range(W):
            for j in range(nH):
                m.add(sum(int(size_i[w, i]) * y[i][j] for i in range(nI)) <= pk)
        m.minimize(pk)
        for i in range(nI):
            for j in range(nH):
                m.add_hint(y[i][j], i // S == j)
        slv = cp_model.CpSolver()
        slv.parameters.num_workers = 1
        slv.parameters.random_seed = int(seed)
        if deterministic:
            slv.parameters.max_deterministic_time = sub_limit
            slv.parameters.max_time_in_seconds = 3 * sub_limit
        else:
            slv.parameters.max_time_in_seconds = sub_limit
        st = slv.solve(m)
        if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            stale += 1
            continue
        new = np.empty((nH, S), dtype=np.int64)
        fill = [0] * nH
        for i in range(nI):
            j = next(j for j in range(nH) if slv.boolean_value(y[i][j]))
            new[j, fill[j]] = items[i]
            fill[j] += 1
        trial = assign.copy()
        trial[H] = new
        old_sub = pb.agg(L[:, H].max(axis=1))
        new_sub = pb.agg(pb.loads(trial, counts)[:, H].max(axis=1))
        if new_sub < old_sub * (1 - 1e-12):
            assign = trial
            stale = 0
        else:
            stale += 1
    return assign, done


def _large_layer(pb, inc, seed, limit_s, deterministic, ls_iters, deadline) -> _Result:
    """Alternate CP-SAT neighbourhood re-packs and the local search until the layer's budget is spent.

    The number of rounds comes from the budget (not the clock) in deterministic mode.
    """
    t0 = time.perf_counter()
    rounds = max(4, int(_DET_FACTOR * limit_s / _LNS_ROUND_S))
    dl = None if deterministic else min(deadline, t0 + limit_s)
    assign = inc
    left = rounds
    k = 0
    while left > 0 and (dl is None or time.perf_counter() < dl):
        step = min(8, left)
        assign, done = _lns_cpsat(pb, assign, step, _LNS_ROUND_S, seed + k, deterministic, dl)
        left -= step
        k += 1
        assign, _ = _local_search(pb, assign, ls_iters, dl)
        if deterministic and time.perf_counter() - t0 > _SAFETY_CAP * limit_s:
            return _Result(
                assign,
                "time_limit",
                None,
                False,
                time.perf_counter() - t0,
                "wall-clock safety cap reached in the neighbourhood search: this layer may not reproduce exactly",
            )
    return _Result(assign, "time_limit", None, False, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# MILP backend (scipy.optimize.milp, HiGHS), floats
# ---------------------------------------------------------------------------------------------
def _solve_milp(pb, incumbent, inc_value, objective, windows, P, seed, limit_s, lb_true):
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    t0 = time.perf_counter()
    E, G, S, W = pb.E, pb.G, pb.S, pb.W
    lo, hi, complete = _count_ranges(pb, incumbent, inc_value, objective, windows, P)
    c = pb.cost
    idx = {}

    def var(key):
        idx[key] = len(idx)
        return idx[key]

    for e in range(E):
        for g in range(G):
            var(("x", e, g))
    var_e = [e for e in range(E) if lo[e] != hi[e]]
    for e in var_e:
        for r in range(lo[e], hi[e] + 1):
            var(("y", e, r))
    for w in range(W):
        for e in var_e:
            for g in range(G):
                var(("s", w, e, g))
    for w in range(W):
        var(("peak", w))
    if pb.robust_m > 1:
        var(("tau",))
        for w in range(W):
            var(("u", w))
    else:
        var(("T",))
    if pb.node_of_gpu is not None:
        N = int(pb.node_of_gpu.max()) + 1
        ngroups = int(pb.group_of_expert.max()) + 1
        for q in range(ngroups):
            for k in range(N):
                var(("a", q, k))
    nv = len(idx)
    rows, cols, vals, lbs, ubs = [], [], [], [], []
    row = [0]

    def add(terms, lb, ub):
        for k, v in terms:
            rows.append(row[0])
            cols.append(idx[k])
            vals.append(v)
        lbs.append(lb)
        ubs.append(ub)
        row[0] += 1

    for e in range(E):
        cnt = [(("x", e, g), 1.0) for g in range(G)]
        if e in var_e:
            add([(("y", e, r), 1.0) for r in range(lo[e], hi[e] + 1)], 1, 1)
            add(cnt + [(("y", e, r), -float(r)) for r in range(lo[e], hi[e] + 1)], 0, 0)
        else:
            add(cnt, lo[e], lo[e])
    for g in range(G):
        add([(("x", e, g), 1.0) for e in range(E)], S, S)
    for w in range(W):
        for e in var_e:
            for g in range(G):
                for r in range(lo[e], hi[e] + 1):
                    cc = float(c[w, e, r])
                    add([(("s", w, e, g), 1.0), (("x", e, g), -cc), (("y", e, r), -cc)], -cc, np.inf)
        for g in range(G):
            terms = [(("x", e, g), float(c[w, e, lo[e]])) for e in range(E) if lo[e] == hi[e]]
            terms += [(("s", w, e, g), 1.0) for e in var_e]
            add(terms + [(("peak", w), -1.0)], -np.inf, 0)
    if pb.node_of_gpu is not None:
        for q in range(ngroups):
            add([(("a", q, k), 1.0) for k in range(N)], 1, 1)
        for k in range(N):
            add([(("a", q, k), 1.0) for q in range(ngroups)], pb.groups_per_node, pb.groups_per_node)
        for e in range(E):
            q = int(pb.group_of_expert[e])
            for g in range(G):
                add([(("x", e, g), 1.0), (("a", q, int(pb.node_of_gpu[g])), -1.0)], -np.inf, 0)
    # symmetry breaking (interchangeable GPUs): the hottest expert on a prefix of GPUs, and window-0
    # loads descending inside the holders and inside the others (big-M relaxed at the boundary)
    if pb.node_of_gpu is None:
        e0 = int(np.argmax(c[:, :, 1].max(axis=0)))
        big = float(np.where(np.isfinite(c[0, :, 1]), c[0, :, 1], 0).sum())

        def load_terms(g, sign):
            t = [(("x", e, g), sign * float(c[0, e, lo[e]])) for e in range(E) if lo[e] == hi[e]]
            return t + [(("s", 0, e, g), sign) for e in var_e]

        for g in range(G - 1):
            add([(("x", e0, g + 1), 1.0), (("x", e0, g), -1.0)], -np.inf, 0)
            terms = load_terms(g, 1.0) + load_terms(g + 1, -1.0)
            add(terms + [(("x", e0, g), big), (("x", e0, g + 1), -big)], 0, np.inf)
    cobj = np.zeros(nv)
    if pb.robust_m == 1:
        cobj[idx[("T",)]] = 1.0
        for w in range(W):
            add([(("peak", w), 1.0), (("T",), -1.0)], -np.inf, 0)
    else:
        cobj[idx[("tau",)]] = pb.robust_m
        for w in range(W):
            cobj[idx[("u", w)]] = 1.0
            add([(("u", w), 1.0), (("peak", w), -1.0), (("tau",), 1.0)], 0, np.inf)
    A = coo_matrix((vals, (rows, cols)), shape=(row[0], nv)).tocsr()
    integrality = np.zeros(nv)
    lb = np.zeros(nv)
    ub = np.full(nv, np.inf)
    for k, i in idx.items():
        if k[0] in ("x", "y", "a"):
            integrality[i] = 1
            ub[i] = 1
        if k[0] == "peak" and lb_true is not None:
            lb[i] = lb_true[k[1]]
    res = milp(
        cobj,
        integrality=integrality,
        bounds=Bounds(lb, ub),
        constraints=LinearConstraint(A, lbs, ubs),
        options={
            "time_limit": max(0.1, limit_s - (time.perf_counter() - t0)),
            "mip_rel_gap": 1e-9,
            "disp": False,
        },
    )
    wall = time.perf_counter() - t0
    if res.x is None:
        return _Result(None, "greedy_fallback", None, complete, wall)
    xv = np.array([[res.x[idx[("x", e, g)]] > 0.5 for g in range(G)] for e in range(E)])
    per_gpu = xv.sum(axis=0)
    if not np.all(per_gpu == S):
        return _Result(None, "error", None, complete, wall, "MILP solution violates slot counts")
    assign = np.stack([np.flatnonzero(xv[:, g]) for g in range(G)])
    bound = getattr(res, "mip_dual_bound", None)
    if bound is not None and pb.robust_m > 1:
        bound = bound / pb.robust_m
    status = "optimal" if res.status == 0 else "time_limit"
    return _Result(assign, status, None if bound is None else float(bound) * (1 - 1e-7), complete, wall)


# ---------------------------------------------------------------------------------------------
# Weighted dispatch: LP on a fixed placement
# ---------------------------------------------------------------------------------------------
def weighted_shares(
    phy2log_row: np.ndarray, windows: np.ndarray, topology: Topology
) -> tuple[np.ndarray, float]:
    """Per-replica token shares minimising the peak on a fixed placement of one layer.

    Args:
        phy2log_row: int ``[P]`` the layer's map.
        windows: ``[W, E]`` (or ``[E]``) loads; the peak is taken per window (max over windows).
    Returns:
        ``(shares float64 [P], peak)``: ``shares`` sum to 1 over each expert's replicas; ``peak`` is the
        largest window's peak GPU load with these shares.
    """
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    w = np.atleast_2d(np.asarray(windows, dtype=np.float64))
    p2l = np.asarray(phy2log_row, dtype=np.int64)
    P, G, E = len(p2l), topology.ep_size, w.shape[1]
    gpu = topology.gpu_of_slot
    W = w.shape[0]
    # variables: q[0..P-1], T; rows: per (window, gpu) load - T <= 0 ; per expert sum q = 1
    r_ub = (np.arange(W)[:, None] * G + gpu[None, :]).ravel()  # [W*P]
    c_ub = np.tile(np.arange(P), W)
    v_ub = w[:, p2l].ravel()
    A_ub = coo_matrix(
        (
            np.concatenate([v_ub, -np.ones(W * G)]),
            (np.concatenate([r_ub, np.arange(W * G)]), np.concatenate([c_ub, np.full(W * G, P)])),
        ),
        shape=(W * G, P + 1),
    )
    A_eq = coo_matrix((np.ones(P), (p2l, np.arange(P))), shape=(E, P + 1))
    cobj = np.zeros(P + 1)
    cobj[P] = 1.0
    res = linprog(
        cobj, A_ub=A_ub, b_ub=np.zeros(W * G), A_eq=A_eq, b_eq=np.ones(E), bounds=(0, None), method="highs"
    )
    cnt = np.bincount(p2l, minlength=E)
    even = 1.0 / cnt[p2l]
    if res.status != 0:
        return even, float((w[:, p2l] * even).reshape(W, G, -1).sum(axis=2).max())
    q = np.clip(res.x[:P], 0, None)
    tot = np.bincount(p2l, weights=q, minlength=E)
    q = q / tot[p2l]
    peak = float(
        np.bincount(
            np.repeat(np.arange(W) * G, P) + np.tile(gpu, W), weights=(w[:, p2l] * q).ravel(), minlength=W * G
        ).max()
    )
    even_peak = float((w[:, p2l] * even).reshape(W, G, -1).sum(axis=2).max())
    if peak > even_peak:
        return even, even_peak
    return q, peak


def replica_weights(placement: Placement, load: np.ndarray) -> np.ndarray:
    """Per-replica dispatch probabilities ``float64 [L, P]`` (sum to 1 over each expert's replicas).

    Args:
        load: ``[L, E]`` or ``[W, L, E]`` (windows: minimise the worst window's peak).
    """
    w = np.asarray(load, dtype=np.float64)
    if w.ndim == 2:
        w = w[None]
    if w.ndim != 3 or w.shape[1:] != (placement.num_layers, placement.num_logical_experts):
        raise ValueError(
            f"load has shape {np.shape(load)}; expected [{placement.num_layers}, {placement.num_logical_experts}] "
            f"or [windows, {placement.num_layers}, {placement.num_logical_experts}]"
        )
    out = np.empty((placement.num_layers, placement.num_physical_experts))
    for l in range(placement.num_layers):
        out[l] = weighted_shares(placement.physical_to_logical_map[l], w[:, l], placement.topology)[0]
    return out


def write_replica_weights(path, weights: np.ndarray, placement: Placement) -> None:
    """Write per-replica dispatch weights as JSON (atomic), next to the map they belong to.

    Fields: ``format`` (``moe-placement/replica-weights``), ``version``, ``layer_ids``,
    ``num_logical_experts``, ``ep_size``, ``physical_to_logical_map`` ``[L, P]`` and
    ``replica_weights`` ``[L, P]`` (slot ``p``'s probability among its expert's replicas).
    """
    from profiling.fileio import atomic_write_json

    wts = np.asarray(weights, dtype=np.float64)
    if wts.shape != placement.physical_to_logical_map.shape:
        raise ValueError(
            f"weights have shape {wts.shape} but the placement map is {placement.physical_to_logical_map.shape}"
        )
    if not np.all(np.isfinite(wts)) or wts.min(initial=0) < 0:
        raise ValueError("replica weights must be finite and >= 0")
    p2l = placement.physical_to_logical_map
    for l in range(p2l.shape[0]):
        tot = np.bincount(p2l[l], weights=wts[l], minlength=placement.num_logical_experts)
        if not np.allclose(tot, 1.0, atol=1e-6):
            e = int(np.argmax(np.abs(tot - 1)))
            raise ValueError(f"layer {l}: weights of expert {e}'s replicas sum to {tot[e]:.6f}, not 1")
    atomic_write_json(
        path,
        {
            "format": "moe-placement/replica-weights",
            "version": 1,
            "layer_ids": list(placement.layer_ids),
            "num_logical_experts": placement.num_logical_experts,
            "ep_size": placement.topology.ep_size,
            "physical_to_logical_map": p2l.tolist(),
            "replica_weights": wts.tolist(),
        },
    )


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------
def _parse_robust(robust, W: int) -> int:
    if robust is None or robust is False:
        return 1
    if robust == "max" or robust is True:
        return 1
    if isinstance(robust, str) and robust.startswith("q") and robust[1:].isdigit():
        q = int(robust[1:])
        if not 0 < q < 100:
            raise ValueError(f"robust quantile {robust!r} must be q1..q99")
        return max(1, math.ceil((1 - q / 100) * W - 1e-9))
    raise ValueError(f"unknown robust mode {robust!r}; use None, 'max' or 'qNN' (e.g. 'q90')")


def _as_windows(load_or_trace, robust, num_windows: int):
    """Returns (aggregate [L, E], windows [W, L, E], layer_ids or None, top_k or None)."""
    if isinstance(load_or_trace, RoutingTrace):
        tr = load_or_trace
        agg = tr.counts().astype(np.float64)
        if robust:
            wins = tr.window_load()
            if wins.shape[0] != num_windows:
                wins = np.stack([t.counts() for t in tr.windows(num_windows)]).astype(np.float64)
        else:
            wins = agg[None]
        return agg, wins, tuple(tr.layer_ids), tr.top_k
    arr = np.asarray(load_or_trace, dtype=np.float64)
    if arr.ndim == 2:
        return arr, arr[None], None, None
    if arr.ndim == 3:
        return arr.sum(axis=0), (arr if robust else arr.sum(axis=0)[None]), None, None
    raise ValueError(
        f"load must be [layers, experts], [windows, layers, experts] or a RoutingTrace, got shape {arr.shape}"
    )


def solve_exact(
    load_or_trace,
    topology: Topology,
    *,
    backend: str = "cpsat",
    num_groups: int | None = None,
    node_constraint: bool = False,
    objective: str = "tokens",
    robust: str | None = None,
    num_windows: int = 4,
    weighted: bool | str = False,
    layer_ids: Sequence[int] | None = None,
    time_limit: float = 10.0,
    seed: int = 0,
    workers: int | None = None,
    hint: Placement | None = None,
    expert_bytes: float | None = None,
    hardware: Any = None,
    deterministic: bool = True,
    batch_tokens_per_gpu: float | None = None,
    local_search_iters: int | None = None,
    validation: float | str | None = None,
    noise_gate: str | None = "auto",
    noise_k: float = 1.0,
) -> tuple[Placement, SolveReport]:
    """Joint replica counts and placement per layer, with proven bounds.

    Args:
        load_or_trace: ``[L, E]`` loads, ``[W, L, E]`` windows, or a :class:`RoutingTrace`.
        topology: ``P`` slots over ``G`` GPUs over ``N`` nodes.
        backend: ``cpsat`` (OR-Tools CP-SAT) or ``milp`` (scipy.optimize.milp / HiGHS; small instances).
        num_groups, node_constraint: keep expert groups inside nodes (groups divide over nodes).
        objective: ``tokens`` (peak GPU tokens) or ``decode`` (peak per-step decode time).
        robust: None, ``max`` or ``qNN``: fit on ``num_windows`` windows (module docstring).
        weighted: ``False``; ``"shares"`` (LP shares on the even-split optimum, in ``extra``); ``True``
            (placement chosen for weighted dispatch, :func:`solver.weighted.solve_weighted`; the report's
            ``objective`` is then the weighted peak and ``extra["even_objective"]`` the even-split one).
        time_limit: total wall budget in seconds for all layers (solved in parallel on ``workers`` threads).
        seed: CP-SAT random seed (also seeds the neighbourhood search).
        deterministic: ``True`` (default): one CP-SAT worker and deterministic-time limits derived from
            ``time_limit`` only, local and neighbourhood search bounded by iteration counts, so two runs
            with the same inputs and seed return the same map whatever the machine load (unless the
            wall-clock safety cap of 4x a layer's share cuts a solve, which ``notes`` reports).
            ``False``: wall-clock limits (uses the budget fully, not reproducible).
        hint: an extra starting placement (used when better than greedy).
        expert_bytes, hardware, batch_tokens_per_gpu: decode cost overrides (:class:`DecodeCost`).
        local_search_iters: cap on local-search moves per layer (default ``20 * G``).
        validation: guard against over-fitting (:func:`_validation_guard`). ``"auto"`` (default): when the
            input has windows (a trace or ``[W, L, E]``, ``W >= 5``) the last 20% of them are held out, exact
            and greedy are fitted on the rest and compared there; layers where exact loses keep greedy's
            placement (status ``greedy_fallback``, ``extra["validation"]``). A float in (0, 0.5] sets the
            held-out fraction; ``"thin"`` splits integer counts by seeded binomial thinning (20%) instead
            of windows; ``0`` or ``None`` (default) turns the guard off. It costs 30% of ``time_limit``. When
            it is on, the noise gate is off.
        noise_gate: keep greedy's placement unless the fitted gain beats the sampling noise
            (:func:`_noise_gate`). ``"auto"`` (default): on when the input has windows (a trace or
            ``[W, L, E]`` with ``W >= 5``) and the solve is the plain even-split token one (no ``robust``,
            ``node_constraint``, ``decode``, ``weighted=True``); noise from a bootstrap over windows (over
            window labels when a trace's labels repeat, e.g. MMLU subjects); a trace with fewer windows
            (e.g. one domain's counts) uses Poisson noise of its counts; a bare ``[L, E]`` load is solved
            as given (no gate). ``"windows"``: the same, an
            error without windows. ``"poisson"``: Poisson resampling of integer counts (for counts-only
            loads; it cannot see a domain shift). ``None``/``"off"``: the plain exact optimum.
        noise_k: move cost per moved slot in units of the noise ``sigma`` of a layer's peak (default 1).

    Returns:
        (Placement, SolveReport). Layer ``objective`` is the peak GPU load in tokens with even split on the
        aggregate load; ``bound`` a proven lower bound on it; ``baseline_objective`` greedy's peak.
        ``extra`` holds ``model_objective`` / ``model_baseline`` (the optimised objective: decode us, or
        robust window PAR), ``counts_changed``, ``restricted``, ``replica_shares`` and ``weighted_objective``.
    """
    t_start = time.perf_counter()
    if backend not in ("cpsat", "milp"):
        raise ValueError(f"unknown backend {backend!r}; use 'cpsat' or 'milp'")
    if objective not in ("tokens", "decode"):
        raise ValueError(f"unknown objective {objective!r}; use 'tokens' or 'decode'")
    if not time_limit > 0:
        raise ValueError(f"time_limit must be > 0 seconds, got {time_limit}")
    agg, wins, trace_layers, top_k = _as_windows(load_or_trace, robust, num_windows)
    robust_m = _parse_robust(robust, wins.shape[0])
    if not np.all(np.isfinite(wins)) or wins.min(initial=0) < 0:
        raise ValueError("load must be finite and >= 0 (found NaN, inf or a negative count)")
    L, E = agg.shape
    G, P, N = topology.ep_size, topology.num_physical_experts, topology.num_nodes
    S = topology.slots_per_gpu
    if layer_ids is None:
        layer_ids = trace_layers
    if E > P:
        raise ValueError(f"{E} logical experts do not fit in {P} physical slots; add {E - P} or more slots")
    if S > E:
        raise ValueError(
            f"{S} slots per GPU exceed the {E} experts; use at most {E * G - E} redundant experts"
        )
    if weighted not in (False, True, "shares"):
        raise ValueError(f"weighted must be False, True or 'shares', got {weighted!r}")
    if weighted is True:
        if node_constraint or objective != "tokens":
            raise ValueError(
                "weighted=True (placement for weighted dispatch) supports objective='tokens' without "
                "node_constraint; use weighted='shares' for LP shares on the even-split optimum"
            )
        from solver.weighted import solve_weighted

        w_pl, _, w_rep = solve_weighted(
            agg,
            topology,
            windows=wins if robust else None,
            layer_ids=layer_ids,
            hint=hint,
            seed=seed,
            time_limit=time_limit,
        )
        params = {
            "backend": "weighted",
            "seed": seed,
            "time_limit": time_limit,
            "weighted": True,
            "robust": robust,
        }
        return w_pl.with_provenance(**params), replace(w_rep, params=params)
    guard = _validation_split(load_or_trace, validation, seed)
    gate = (
        None
        if guard is not None
        else _gate_noise_source(load_or_trace, noise_gate, robust, node_constraint, objective, weighted)
    )
    if gate is not None:
        if not (np.isfinite(noise_k) and noise_k >= 0):
            raise ValueError(f"noise_k must be a finite number >= 0 (sigmas per moved slot), got {noise_k!r}")
        kw = dict(
            backend=backend,
            num_groups=num_groups,
            node_constraint=node_constraint,
            objective=objective,
            robust=robust,
            num_windows=num_windows,
            weighted=weighted,
            layer_ids=layer_ids,
            seed=seed,
            workers=workers,
            hint=hint,
            expert_bytes=expert_bytes,
            hardware=hardware,
            deterministic=deterministic,
            batch_tokens_per_gpu=batch_tokens_per_gpu,
            local_search_iters=local_search_iters,
            validation=0,
            noise_gate=None,
        )
        pl, rep = solve_exact(load_or_trace, topology, **{**kw, "time_limit": 0.85 * time_limit})
        return _noise_gate(load_or_trace, topology, pl, rep, gate, float(noise_k), seed, time_limit, t_start)
    if guard is not None:
        kw = dict(
            backend=backend,
            num_groups=num_groups,
            node_constraint=node_constraint,
            objective=objective,
            robust=robust,
            num_windows=num_windows,
            weighted=weighted,
            layer_ids=layer_ids,
            seed=seed,
            workers=workers,
            hint=hint,
            expert_bytes=expert_bytes,
            hardware=hardware,
            deterministic=deterministic,
            batch_tokens_per_gpu=batch_tokens_per_gpu,
            local_search_iters=local_search_iters,
            validation=0,
            noise_gate=None,
        )
        return _validation_guard(load_or_trace, topology, guard, time_limit, t_start, kw)
    decode = DecodeCost.build(expert_bytes, hardware, top_k) if objective == "decode" else None
    if decode is not None and batch_tokens_per_gpu is not None:
        decode = replace(decode, batch_tokens_per_gpu=float(batch_tokens_per_gpu))
    if node_constraint:
        if not num_groups or E % num_groups or num_groups % N:
            raise ValueError(
                f"node_constraint needs num_groups dividing the {E} experts and divisible by num_nodes={N}, got num_groups={num_groups}"
            )
        greedy_policy = "hierarchical"
    else:
        greedy_policy = "global"
    g_pl, g_rep = greedy_placement(agg, topology, num_groups, policy=greedy_policy, layer_ids=layer_ids)
    greedy_map = g_pl.physical_to_logical_map
    hint_map = None
    if hint is not None:
        if hint.physical_to_logical_map.shape != greedy_map.shape or hint.num_logical_experts != E:
            raise ValueError(
                f"hint placement has map shape {hint.physical_to_logical_map.shape}, expected {greedy_map.shape}"
            )
        hint_map = hint.physical_to_logical_map
    rmax = _max_replicas(E, G, P)
    workers = int(
        workers
        or max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    )
    workers = max(1, min(workers, L))
    setup = time.perf_counter() - t_start
    per_layer = max(0.05, (time_limit - setup) * workers / L * 0.85)
    deadline = t_start + time_limit
    ls_iters = int(local_search_iters if local_search_iters is not None else 20 * G)
    group_of_expert = np.arange(E) // (E // num_groups) if node_constraint else None
    cb_agg = count_lower_bound(agg, G, P)
    # per-window normalisation (robust) or plain tokens
    if robust_m > 1 or wins.shape[0] > 1:
        means = wins.sum(axis=2) / G  # [W, L]
        wnorm = wins / np.where(means > 0, means, 1.0)[:, :, None]
    else:
        wnorm = wins
    notes: list[str] = []
    lock = threading.Lock()

    def solve_layer(l: int):
        t0 = time.perf_counter()
        wl = wnorm[:, l]  # [W, E]
        pb = _Layer(
            cost=layer_cost_table(wl, rmax, objective, decode, G),
            G=G,
            S=S,
            rmax=rmax,
            robust_m=robust_m,
            node_of_gpu=topology.node_of_gpu if node_constraint else None,
            group_of_expert=group_of_expert,
            groups_per_node=(num_groups // N) if node_constraint else 0,
        )
        start = greedy_map[l].reshape(G, S)
        g_val = pb.value(start, _counts_of(start, E))
        cands = [(g_val, start, "greedy")]
        if hint_map is not None:
            hm = hint_map[l].reshape(G, S)
            if _valid_node(hm, pb):
                cands.append((pb.value(hm, _counts_of(hm, E)), hm, "hint"))
        inc_val, inc, _ = min(cands, key=lambda c: c[0])
        ls_deadline = None if deterministic else min(deadline, t0 + per_layer * 0.5)
        ls_assign, iters = _local_search(pb, inc, ls_iters, ls_deadline)
        ls_val = pb.value(ls_assign, _counts_of(ls_assign, E))
        if ls_val < inc_val:
            inc, inc_val = ls_assign, ls_val
        # bounds valid for any placement
        lb_true = None
        if objective == "tokens":
            lb_true = np.array([count_lower_bound(wl[w], G, P) for w in range(pb.W)])
        glob_bound = float(cb_agg[l])
        model_lb = float(pb.agg(lb_true)) if lb_true is not None else 0.0
        status = "feasible"
        res = None
        gap_now = (inc_val - model_lb) / inc_val if inc_val > 0 else 0.0
        if deterministic:  # the layer's whole share: a budget that does not depend on how long the start took
            remaining = per_layer
        else:
            remaining = min(per_layer - (time.perf_counter() - t0), deadline - time.perf_counter())
        if gap_now > 1e-9 and remaining > 0.02:
            try:
                if E * G * pb.W > _FULL_MODEL_LIMIT:
                    res = _large_layer(pb, inc, seed, remaining, deterministic, ls_iters, deadline)
                elif backend == "cpsat":
                    res = _solve_cpsat(
                        pb, inc, inc_val, objective, wl, P, seed, remaining, deterministic, lb_true
                    )
                else:
                    res = _solve_milp(pb, inc, inc_val, objective, wl, P, seed, remaining, lb_true)
            except Exception as exc:  # a solver failure is data, not an exception
                log.warning("layer %d: %s backend failed: %s", l, backend, exc)
                res = _Result(None, "error", None, False, 0.0, f"{type(exc).__name__}: {exc}")
        model_val = inc_val
        if res is not None and res.note:
            with lock:
                notes.append(f"layer {l}: {res.note}")
        if res is not None and res.assign is not None:
            v = pb.value(res.assign, _counts_of(res.assign, E))
            if v < inc_val - 1e-12 * max(1, inc_val):
                inc, model_val = res.assign, v
            status = res.status
            if res.complete and res.model_bound is not None:
                model_lb = max(model_lb, min(res.model_bound, model_val))
            if not res.complete and status == "optimal":
                status = "feasible"
        elif res is not None:
            # the backend returned nothing (no solution in time, infeasible model, or a failure): the
            # layer keeps a valid placement, so its status says where that placement came from
            status = "feasible" if inc_val < g_val else "greedy_fallback"
            with lock:
                notes.append(
                    f"layer {l}: {backend} backend ended {res.status!r} without a solution; "
                    f"kept the {'local-search' if inc_val < g_val else 'greedy'} placement"
                )
        row = inc.reshape(-1)
        if model_val >= g_val - 1e-12 * max(1, g_val):
            row = greedy_map[l]
            model_val = g_val
        proved_by = None
        if res is not None and res.assign is not None and status == "optimal":
            proved_by = backend
        # report in tokens on the aggregate load
        per_slot = agg[l][row] / np.bincount(row, minlength=E)[row]
        gpu_tok = per_slot.reshape(G, S).sum(axis=1)
        obj_tok = float(gpu_tok.max())
        g_row = greedy_map[l]
        g_tok = float(
            (agg[l][g_row] / np.bincount(g_row, minlength=E)[g_row]).reshape(G, S).sum(axis=1).max()
        )
        if (
            objective == "tokens"
            and pb.W == 1
            and res is not None
            and res.complete
            and res.model_bound is not None
        ):
            glob_bound = max(glob_bound, min(res.model_bound, obj_tok))
        if model_lb >= model_val * (1 - 1e-7):
            if status != "optimal" or proved_by is None:
                proved_by = "bound"  # the objective meets a proven lower bound
            status = "optimal"
        extra = {
            "backend": backend,
            "proved_by": proved_by,
            "model_objective": float(model_val),
            "model_baseline": float(g_val),
            "model_bound": float(model_lb),
            "local_search_iters": iters,
            "restricted": bool(res is not None and not res.complete),
            "counts_changed": int((np.bincount(row, minlength=E) != np.bincount(g_row, minlength=E)).sum()),
            "solver_wall_s": float(res.wall) if res is not None else 0.0,
        }
        if weighted:
            shares, wpeak = weighted_shares(row, agg[l], topology)
            extra["replica_shares"] = shares.tolist()
            extra["weighted_objective"] = wpeak
            extra["weighted_bound"] = float(max(agg[l].sum() / G, agg[l].max() / rmax))
        rep = LayerReport(
            layer_id=int(layer_ids[l]) if layer_ids else l,
            status=status,
            objective=obj_tok,
            bound=float(min(glob_bound, obj_tok)),
            wall_time_s=time.perf_counter() - t0,
            baseline_objective=g_tok,
            mean_load=float(agg[l].sum() / G),
            extra=extra,
        )
        return row, rep

    if workers == 1:
        results = [solve_layer(l) for l in range(L)]
    else:
        with ThreadPoolExecutor(max_workers=workers) as ex:
            results = list(ex.map(solve_layer, range(L)))
    phy2log = np.stack([r[0] for r in results])
    params = {
        "backend": backend,
        "seed": seed,
        "time_limit": time_limit,
        "objective": objective,
        "robust": robust,
        "num_windows": int(wins.shape[0]) if robust else 1,
        "weighted": weighted,
        "workers": workers,
        "deterministic": deterministic,
        "node_constraint": node_constraint,
        "num_groups": num_groups,
        "greedy_policy": greedy_policy,
        "per_layer_limit_s": per_layer,
    }
    if decode is not None:
        params["decode_cost"] = {k: getattr(decode, k) for k in decode.__dataclass_fields__}
    placement = Placement(
        phy2log,
        E,
        topology,
        tuple(layer_ids or ()),
        {"solver": backend, **{k: v for k, v in params.items() if k != "decode_cost"}},
    )
    report = SolveReport(
        solver=backend,
        layers=tuple(r[1] for r in results),
        wall_time_s=time.perf_counter() - t_start,
        params=params,
        notes=tuple(sorted(notes)),
    )
    return placement, report


def _valid_node(assign: np.ndarray, pb: _Layer) -> bool:
    """True when ``assign [G, S]`` keeps each group inside one node (always true without nodes)."""
    if pb.node_of_gpu is None:
        return True
    node_of = {}
    for g in range(pb.G):
        for e in assign[g]:
            q = int(pb.group_of_expert[e])
            if node_of.setdefault(q, int(pb.node_of_gpu[g])) != int(pb.node_of_gpu[g]):
                return False
    counts = np.bincount(list(node_of.values()), minlength=int(pb.node_of_gpu.max()) + 1)
    return bool(np.all(counts == pb.groups_per_node))


# ---------------------------------------------------------------------------------------------
# Validation guard: exact must beat greedy on data it was not fitted on
# ---------------------------------------------------------------------------------------------
def _validation_split(load_or_trace, validation, seed: int):
    """``(fit part, validation [L, E], how)`` or None when the guard is off or has nothing to hold out.

    The fit part keeps the input's kind (windows ``[W', L, E]``) so a robust solve still sees windows.
    """
    if (
        validation is None
        or validation is False
        or (not isinstance(validation, str) and float(validation) == 0)
    ):
        return None
    if isinstance(validation, str) and validation not in ("auto", "thin"):
        raise ValueError(
            f"validation must be 'auto', 'thin', a fraction in (0, 0.5] or 0, got {validation!r}"
        )
    frac = 0.2 if isinstance(validation, str) else float(validation)
    if not 0 < frac <= 0.5:
        raise ValueError(f"validation fraction must be in (0, 0.5], got {validation}")
    if validation == "thin":
        agg = (
            load_or_trace.counts()
            if isinstance(load_or_trace, RoutingTrace)
            else np.asarray(load_or_trace, dtype=np.float64)
        )
        if agg.ndim == 3:
            agg = agg.sum(axis=0)
        if not np.all(agg == np.round(agg)):
            raise ValueError("validation='thin' needs integer token counts; pass windows or validation=0.2")
        rng = np.random.default_rng(seed)
        val = rng.binomial(np.round(agg).astype(np.int64), frac).astype(np.float64)  # [L, E]
        return agg - val, val, f"binomial thinning {frac:g}"
    if isinstance(load_or_trace, RoutingTrace):
        wins = load_or_trace.window_load().astype(np.float64)  # [W, L, E]
    else:
        arr = np.asarray(load_or_trace, dtype=np.float64)
        if arr.ndim != 3:
            return None
        wins = arr
    W = wins.shape[0]
    if W < 5:
        return None
    v = max(1, int(round(frac * W)))
    return wins[: W - v], wins[W - v :].sum(axis=0), f"last {v} of {W} windows"


def _validation_guard(load_or_trace, topology: Topology, guard, time_limit: float, t_start: float, kw: dict):
    """Fit exact and greedy on the fit part, compare them on the held-out part, then solve on everything.

    Layers where the exact placement fitted on the fit part has a higher validation peak than greedy's
    fitted on the same part keep greedy's placement fitted on all the data (status ``greedy_fallback``).
    The guard solve gets 30% of the remaining budget, the final solve the rest.
    """
    fit_part, val, how = guard
    left = max(0.1, time_limit - (time.perf_counter() - t_start))
    fit_arg = fit_part
    if kw.get("robust") and fit_part.ndim == 3 and fit_part.shape[0] != kw["num_windows"]:
        chunks = np.array_split(np.arange(fit_part.shape[0]), min(kw["num_windows"], fit_part.shape[0]))
        fit_arg = np.stack([fit_part[c].sum(axis=0) for c in chunks])  # [num_windows, L, E]
    fit_agg = fit_arg.sum(axis=0) if fit_arg.ndim == 3 else fit_arg
    policy = "hierarchical" if kw.get("node_constraint") else "global"
    g_fit, _ = greedy_placement(fit_agg, topology, kw.get("num_groups"), policy=policy)
    e_fit, _ = solve_exact(fit_arg, topology, **{**kw, "time_limit": 0.3 * left})
    v_g = expected_gpu_load(g_fit, val).max(axis=1)  # [L]
    v_e = expected_gpu_load(e_fit, val).max(axis=1)
    pl, rep = solve_exact(
        load_or_trace,
        topology,
        **{**kw, "time_limit": max(0.1, time_limit - (time.perf_counter() - t_start))},
    )
    agg = (
        load_or_trace.counts().astype(np.float64)
        if isinstance(load_or_trace, RoutingTrace)
        else np.asarray(load_or_trace, dtype=np.float64)
    )
    if agg.ndim == 3:
        agg = agg.sum(axis=0)
    g_all, _ = greedy_placement(
        agg,
        topology,
        kw.get("num_groups"),
        policy=policy,
        layer_ids=kw.get("layer_ids") or pl.layer_ids or None,
    )
    rows = pl.physical_to_logical_map.copy()
    layers = []
    fallbacks = 0
    G, S, E = topology.ep_size, topology.slots_per_gpu, agg.shape[1]
    for l, lr in enumerate(rep.layers):
        lose = bool(v_e[l] > v_g[l] * (1 + 1e-9))
        info = {"how": how, "exact_peak": float(v_e[l]), "greedy_peak": float(v_g[l]), "exact_lost": lose}
        extra = {**lr.extra, "validation": info}
        if lose and not np.array_equal(rows[l], g_all.physical_to_logical_map[l]):
            fallbacks += 1
            rows[l] = g_all.physical_to_logical_map[l]
            g_row = rows[l]
            g_tok = float(
                (agg[l][g_row] / np.bincount(g_row, minlength=E)[g_row]).reshape(G, S).sum(axis=1).max()
            )
            extra.update(proved_by=None, fitted_objective=lr.objective)
            if "replica_shares" in extra:  # shares belong to the map: recompute them for greedy's
                q, wpeak = weighted_shares(g_row, agg[l], topology)
                extra.update(replica_shares=q.tolist(), weighted_objective=wpeak)
            lr = replace(
                lr, status="greedy_fallback", objective=g_tok, bound=min(lr.bound, g_tok), extra=extra
            )
        else:
            lr = replace(lr, extra=extra)
        layers.append(lr)
    notes = list(rep.notes)
    if fallbacks:
        notes.append(
            f"validation guard ({how}): {fallbacks} of {len(layers)} layers kept greedy's placement "
            "because the exact one fitted without the held-out part was worse on it"
        )
    params = {**rep.params, "validation": how, "validation_fallbacks": fallbacks}
    out = Placement(
        rows, pl.num_logical_experts, topology, pl.layer_ids, {**pl.provenance, "validation": how}
    )
    return out, replace(
        rep,
        layers=tuple(layers),
        wall_time_s=time.perf_counter() - t_start,
        params=params,
        notes=tuple(notes),
    )


# ---------------------------------------------------------------------------------------------
# Noise gate: leave greedy's placement unless the fitted gain beats the sampling noise
# ---------------------------------------------------------------------------------------------
_GATE_BOOTSTRAP = 200  # resamples used to estimate the noise of a layer's peak


def _gate_noise_source(load_or_trace, noise_gate, robust, node_constraint, objective, weighted):
    """``("windows", [W, L, E], groups [W] or None)``, ``("poisson", [L, E], None)`` or None (gate off)."""
    if noise_gate is None or noise_gate is False or noise_gate == "off":
        return None
    if noise_gate not in ("auto", "windows", "poisson"):
        raise ValueError(f"noise_gate must be 'auto', 'windows', 'poisson' or None, got {noise_gate!r}")
    plain = not robust and not node_constraint and objective == "tokens" and weighted is not True
    if not plain:
        if noise_gate == "auto":
            return None
        raise ValueError(
            f"noise_gate={noise_gate!r} applies to the plain even-split token solve; drop robust, "
            "node_constraint, objective='decode' and weighted=True, or set noise_gate=None"
        )
    groups = None
    if isinstance(load_or_trace, RoutingTrace):
        wins = load_or_trace.window_load().astype(np.float64)
        labels = load_or_trace.window_labels
        if labels is not None and len(labels) == wins.shape[0]:
            _, inv = np.unique(np.asarray(labels, dtype=str), return_inverse=True)
            if 5 <= inv.max() + 1 < wins.shape[0]:
                groups = inv
        agg = load_or_trace.counts().astype(np.float64)
    else:
        arr = np.asarray(load_or_trace, dtype=np.float64)
        wins = arr if arr.ndim == 3 else None
        agg = arr.sum(axis=0) if arr.ndim == 3 else arr
    if noise_gate == "poisson":
        if not np.all(agg == np.round(agg)):
            raise ValueError(
                "noise_gate='poisson' needs integer token counts; pass windows (noise_gate='windows')"
            )
        return ("poisson", agg, None)
    if wins is None or wins.shape[0] < 5:
        if noise_gate == "windows":
            n = 0 if wins is None else wins.shape[0]
            raise ValueError(
                f"noise_gate='windows' needs at least 5 windows, got {n}; pass [W, L, E] windows or a trace"
            )
        # A trace is a sample of traffic: with too few windows to resample, its counts' Poisson noise is
        # the only noise estimate. A bare load array is a problem statement and is solved as given.
        if isinstance(load_or_trace, RoutingTrace) and np.all(agg == np.round(agg)):
            return ("poisson", agg, None)
        return None
    return ("windows", wins, groups)


def peak_noise(
    source, placement: Placement, seed: int = 0, num_resamples: int = _GATE_BOOTSTRAP
) -> np.ndarray:
    """Sampling noise (standard deviation) of each layer's even-split peak GPU load, in tokens of the fit total.

    ``source`` is what :func:`_gate_noise_source` returns: windows are resampled with replacement (whole
    label groups when ``groups`` is given), counts by Poisson; every resample is rescaled to the fit's
    total per layer, so the noise is that of the peak's *balance*, not of the traffic volume.

    Returns: float64 ``[L]``.
    """
    kind, data, groups = source
    rng = np.random.default_rng(seed)
    B = int(num_resamples)
    if kind == "windows":
        units = data
        if groups is not None:
            units = np.stack(
                [data[groups == c].sum(axis=0) for c in range(int(groups.max()) + 1)]
            )  # [C, L, E]
        U = units.shape[0]
        wts = rng.multinomial(U, np.full(U, 1.0 / U), size=B).astype(np.float64)  # [B, U]
        total = data.sum(axis=0)  # [L, E]
        res = np.einsum("bu,ule->ble", wts, units)
    else:
        total = data
        res = rng.poisson(data, size=(B,) + data.shape).astype(np.float64)
    scale = total.sum(axis=1)[None, :, None] / np.maximum(res.sum(axis=2, keepdims=True), 1e-12)
    res = res * scale  # [B, L, E]
    p2l = placement.physical_to_logical_map
    L = p2l.shape[0]
    G, S = placement.topology.ep_size, placement.topology.slots_per_gpu
    E = total.shape[1]
    out = np.empty(L)
    for l in range(L):
        cnt = np.bincount(p2l[l], minlength=E)
        M = np.zeros((E, G))
        np.add.at(M, (p2l[l], np.arange(p2l.shape[1]) // S), 1.0 / cnt[p2l[l]])
        out[l] = (res[:, l] @ M).max(axis=1).std()
    return out


def _noise_gate(
    load_or_trace,
    topology: Topology,
    pl: Placement,
    rep: SolveReport,
    source,
    k: float,
    seed: int,
    time_limit: float,
    t_start: float,
):
    """Per layer: greedy's placement changed only where the fitted gain beats ``k`` sigma per moved slot.

    Re-places each layer with :func:`solver.migration.solve_migration` from greedy's placement with
    ``move_cost = k * sigma_l`` (``sigma_l``: :func:`peak_noise` of greedy's layer), then keeps the exact
    layer instead when it is at least as good on that same objective (peak + move cost x moved slots).
    The exact solve's bound stays the layer's bound; the exact objective is kept in ``extra``.
    """
    from solver.migration import moved_pairs, solve_migration

    agg = (
        load_or_trace.counts().astype(np.float64)
        if isinstance(load_or_trace, RoutingTrace)
        else np.asarray(load_or_trace, dtype=np.float64)
    )
    if agg.ndim == 3:
        agg = agg.sum(axis=0)
    L, E = agg.shape
    G, S = topology.ep_size, topology.slots_per_gpu
    g_pl, _ = greedy_placement(agg, topology, policy="global", layer_ids=pl.layer_ids or None)
    sigma = peak_noise(source, g_pl, seed)
    exact_moved = moved_pairs(g_pl, pl)  # [L]
    rows = pl.physical_to_logical_map.copy()
    layers, changed, kept_exact = [], 0, 0
    per = max(0.05, (time_limit - (time.perf_counter() - t_start)) / max(L, 1))

    def peak(row, w):
        return float((w[row] / np.bincount(row, minlength=E)[row]).reshape(G, S).sum(axis=1).max())

    for l, lr in enumerate(rep.layers):
        mc = k * float(sigma[l])
        g_row = g_pl.physical_to_logical_map[l]
        m_pl, m_rep = solve_migration(
            agg[l : l + 1], g_pl.select_layers([l]), move_cost=mc, time_limit=per, seed=seed
        )
        m_row = m_pl.physical_to_logical_map[0]
        m_obj = peak(m_row, agg[l]) + mc * int(m_rep.layers[0].extra["moved_slots"])
        e_obj = lr.objective + mc * int(exact_moved[l])
        row = rows[l] if e_obj <= m_obj else m_row
        obj = peak(row, agg[l])
        info = {
            "sigma": float(sigma[l]),
            "move_cost": mc,
            "k": k,
            "source": source[0] + ("/groups" if source[2] is not None else ""),
            "exact_objective": float(lr.objective),
            "greedy_objective": float(lr.baseline_objective),
            "moved_slots_vs_greedy": int(
                moved_pairs(g_pl.select_layers([l]), Placement(row[None], E, topology))[0]
            ),
            "took": "greedy" if np.array_equal(row, g_row) else ("exact" if row is rows[l] else "migration"),
        }
        extra = {**lr.extra, "noise_gate": info}
        if row is rows[l]:
            kept_exact += 1
            layers.append(replace(lr, extra=extra))
            continue
        rows[l] = row
        changed += info["took"] != "greedy"
        extra.update(proved_by=None, fitted_objective=float(lr.objective))
        if "replica_shares" in extra:
            q, wpeak = weighted_shares(row, agg[l], topology)
            extra.update(replica_shares=q.tolist(), weighted_objective=wpeak)
        status = "greedy_fallback" if info["took"] == "greedy" else "heuristic"
        layers.append(replace(lr, status=status, objective=obj, bound=min(lr.bound, obj), extra=extra))
    desc = f"{source[0]}{'/groups' if source[2] is not None else ''}, k={k:g}"
    notes = list(rep.notes)
    if kept_exact < L:
        notes.append(
            f"noise gate ({desc}): {kept_exact} of {L} layers took the exact placement, {changed} a partial "
            f"move from greedy, {L - kept_exact - changed} kept greedy's (gain within the sampling noise)"
        )
    params = {**rep.params, "noise_gate": desc, "noise_gate_exact_layers": kept_exact}
    out = Placement(rows, E, topology, pl.layer_ids, {**pl.provenance, "noise_gate": desc})
    return out, replace(
        rep,
        layers=tuple(layers),
        wall_time_s=time.perf_counter() - t_start,
        params=params,
        notes=tuple(notes),
    )
