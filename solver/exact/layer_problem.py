"""One layer's problem (:class:`_Layer`), its integer scaling and count ranges, shared by the backends.

Shapes: ``E`` experts, ``G`` GPUs with ``S`` slots, ``W`` windows, ``R = rmax``; an assignment
``assign`` is int ``[G, S]`` (the expert in each slot), ``counts`` int64 ``[E]`` replicas per expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Search budgets and scaling (the package docstring explains each).
_EXACT_SCALE_LIMIT = 2**40  # largest scaled share for the exact lcm scaling
_FIXED_POINT_TOTAL = 1e7  # total scaled load per window with fixed-point scaling
_MAX_MODEL_TERMS = 60_000  # (expert, gpu, window) product terms before count ranges are narrowed
_FULL_MODEL_LIMIT = 8192  # E * G * W above which the joint model gives way to LNS + local search
_SAFETY_CAP = 4.0  # deterministic mode: wall-clock cap, as a multiple of the layer's share
_DET_FACTOR = 0.5  # deterministic-time units granted per wall second (they run ~2x slower on a loaded core)
_LNS_ROUND_S = 0.08  # CP-SAT limit of one neighbourhood re-pack (deterministic units in deterministic mode)


@dataclass
class _Layer:
    """One layer's problem: the cost table, the topology and the objective's window aggregation."""

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

    def value(self, assign: np.ndarray, counts: np.ndarray) -> float:
        """The objective of ``assign [G, S]`` with ``counts [E]``."""
        return float(self.agg(self.loads(assign, counts).max(axis=1)))


def _counts_of(assign: np.ndarray, E: int) -> np.ndarray:
    """Replicas per expert: int64 ``[E]`` from ``assign [G, S]``."""
    return np.bincount(assign.ravel(), minlength=E).astype(np.int64)


def _better(a: tuple[float, float], b: tuple[float, float], rel: float = 1e-12) -> bool:
    """``a`` beats ``b`` on (objective, sum of squared loads), the objective compared with tolerance ``rel``."""
    if a[0] < b[0] - rel * max(1.0, abs(b[0])):
        return True
    if a[0] <= b[0] + rel * max(1.0, abs(b[0])):
        return a[1] < b[1] * (1 - 1e-12) - 1e-12
    return False


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
# What a backend starts from, and what it returns
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Start:
    """What a backend starts one layer from.

    Attributes:
        assign: the incumbent, int64 ``[G, S]`` logical expert of every slot.
        value: the incumbent's objective value (model units).
        windows: float64 ``[W, E]``, the layer's loads.
        lb_true: float64 ``[W]``, valid lower bounds on the window peaks in true units, or None.
    """

    assign: np.ndarray
    value: float
    windows: np.ndarray
    lb_true: np.ndarray | None


@dataclass
class _Result:
    """A backend's answer for one layer (``assign [G, S]`` or None when it found no solution)."""

    assign: np.ndarray | None
    status: str
    model_bound: float | None  # true units, valid only when complete
    complete: bool
    wall: float
    note: str = ""


# ---------------------------------------------------------------------------------------------
# Integer scaling and count ranges
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


def _count_ranges(
    pb: _Layer, incumbent: np.ndarray, inc_value: float, objective: str, windows: np.ndarray, P: int
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Allowed replica counts ``lo, hi`` int64 ``[E]`` and whether they are complete (package docstring).

    ``windows``: ``[W, E]`` the layer's (normalised) loads; ``incumbent``: ``[G, S]`` with objective
    ``inc_value``, kept feasible.
    """
    E, G = pb.E, pb.G
    inc_counts = _counts_of(incumbent, E)
    lo = np.ones(E, dtype=np.int64)
    if objective == "tokens" and pb.W == 1 and inc_value > 0:
        lo = np.maximum(1, np.ceil(windows[0] / inc_value - 1e-9)).astype(np.int64)
        lo = np.minimum(lo, inc_counts)  # the incumbent itself stays feasible
    slack = P - int(lo.sum())
    hi = np.minimum(pb.rmax, lo + slack)
    complete = True

    def terms(lo_: np.ndarray, hi_: np.ndarray) -> int:
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
) -> np.ndarray:
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
