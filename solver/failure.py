"""Failure domains: copies of the hottest experts spread over GPUs or nodes, so one loss leaves a copy.

Shapes: L layers, E logical experts, G GPUs, N nodes, S slots per GPU, P = G x S slots, D domains
(``gpu``: D = G; ``node``: D = N).

An expert is **protected** when its copies sit in two or more domains: losing any one domain leaves
a copy to serve it. A GPU never holds two copies of one expert, so under ``gpu`` every expert with
two copies is protected; under ``node`` its copies must be on two nodes (greedy's hierarchical mode
keeps every copy of a group on one node). The others are **single points of failure**.

:func:`protect` is the pipeline's failure-domain step (:func:`solver.api.run`, last): from the
placement the pipeline chose (the unconstrained one), per layer

1. **targets**: the ``K`` hottest experts (by load: what a loss would cost), ``K`` at most the
   redundant slots ``P - E`` (each protected expert needs one extra copy) and the experts with load;
2. **copies**: each target with a single copy takes a second one in the slot of a surplus replica (of
   an expert with more copies than it needs), on another domain, the slot that leaves the lowest
   peak GPU load;
3. **spread** (``node``): each target whose copies share one node swaps one copy with a replica on
   another node (an expert that stays protected after the swap), the swap with the lowest new load
   of the two GPUs;
4. **polish**: swaps of a replica of the peak GPU with one of another GPU that keep every target
   protected, while one lowers the peak (by at least :data:`POLISH_MIN_GAIN` of the mean);
5. **cap**: the layer's PAR on the load (even split) must stay within ``(1 + max_par_increase)`` of
   the unconstrained layer's; else ``K`` is lowered (the largest that fits, by bisection; ``K = 0``
   is the unconstrained layer itself) and the layer is named in the report.

Everything is plain numpy with fixed tie-breaking: the same input gives the same placement.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from placement.model import Placement
from placement.topology import Topology
from solver.layer_slots import LayerSlots, best_index

__all__ = [
    "DEFAULT_MAX_PAR_INCREASE",
    "DOMAINS",
    "FailureReport",
    "check_domain",
    "check_max_par_increase",
    "domain_of_gpu",
    "failure_report",
    "protect",
]

log = logging.getLogger(__name__)

DOMAINS = ("gpu", "node")
# The default cap on the balance cost of protection: at most 2% more PAR per layer (on the fitted load,
# even split) than the unconstrained placement.
DEFAULT_MAX_PAR_INCREASE = 0.02
POLISH_MIN_GAIN = 1e-3  # a polish swap must lower the peak of its two GPUs by this share of the mean
POLISH_ROUNDS_PER_GPU = 2  # polish swaps of the layer chosen, at most, per GPU
STEP_ROUNDS_DIVISOR = 4  # after each expert protected one at a time: at most G / 4 polish swaps


def check_domain(domain, topology: Topology | None = None) -> str | None:
    """``domain`` (None, ``gpu`` or ``node``) checked, against ``topology`` when given: a domain needs
    two of them (two GPUs, two nodes); else a one-line ValueError with the fix."""
    if domain is None:
        return None
    if domain not in DOMAINS:
        raise ValueError(f"failure_domain must be one of {', '.join(DOMAINS)} (or None), got {domain!r}")
    if topology is not None:
        count = topology.ep_size if domain == "gpu" else topology.num_nodes
        if count < 2:
            what = "GPU" if domain == "gpu" else "node"
            raise ValueError(
                f"failure domain {domain!r} needs two or more {what}s to spread copies over, the topology has "
                f"{count}; use {'--num-nodes' if domain == 'node' else '--ep-size'} 2 or more, or another domain"
            )
    return domain


def check_max_par_increase(value) -> float | None:
    """The cap on protection's balance cost: None (no cap) or a finite number >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"failure_max_par_increase must be a number >= 0 or None, got {value!r}")
    if not np.isfinite(value) or value < 0:
        raise ValueError(
            f"failure_max_par_increase must be finite and >= 0 (0.02: at most 2% more PAR), got {value!r}"
        )
    return float(value)


def domain_of_gpu(topology: Topology, domain: str) -> np.ndarray:
    """int64 ``[G]``: the failure domain of each GPU."""
    return np.arange(topology.ep_size, dtype=np.int64) if domain == "gpu" else topology.node_of_gpu


@dataclass(frozen=True)
class FailureReport:
    """What a failure domain protects, and what it costs.

    Attributes:
        domain: ``gpu`` or ``node``.
        protected_experts: per layer, the experts with copies in two or more domains, hottest first.
        single_points_of_failure: per layer, the others (all copies in one domain), hottest first.
        targets: per layer, the hottest experts the step set out to protect (``K``); protectable: the
            most it could (the redundant slots, the experts with load).
        par: PAR of the placement on the fitted load (even split, mean over layers);
            par_unconstrained: the same of the placement without the domain (the pipeline's choice).
        max_par_increase: the cap (None: none); capped_layers: layer ids whose ``K`` the cap lowered.
        at_risk_share: per layer, the load share of the single points of failure.
    """

    domain: str
    protected_experts: tuple[tuple[int, ...], ...]
    single_points_of_failure: tuple[tuple[int, ...], ...]
    targets: tuple[int, ...]
    protectable: tuple[int, ...]
    par: float
    par_unconstrained: float
    max_par_increase: float | None
    capped_layers: tuple[int, ...]
    at_risk_share: tuple[float, ...]

    @property
    def par_increase(self) -> float:
        """``par / par_unconstrained - 1``."""
        return self.par / self.par_unconstrained - 1.0 if self.par_unconstrained > 0 else 0.0

    def note(self) -> str:
        """One line for the solve report's notes."""
        prot = sum(len(p) for p in self.protected_experts)
        spof = sum(len(s) for s in self.single_points_of_failure)
        cap = "no cap" if self.max_par_increase is None else f"the {self.max_par_increase:.1%} cap"
        capped = (
            f"; fewer than the redundant slots allow in {len(self.capped_layers)} layer(s) ({cap}, or no swap "
            "left to spread a copy)"
            if self.capped_layers
            else ""
        )
        return (
            f"failure domain {self.domain}: {prot} of {prot + spof} experts protected (summed over "
            f"{len(self.targets)} layers), the others single points of failure "
            f"({float(np.mean(self.at_risk_share)):.1%} of the load), PAR "
            f"{self.par:.4f} vs {self.par_unconstrained:.4f} unconstrained ({self.par_increase:+.2%}){capped}"
        )

    def to_dict(self) -> dict:
        return {
            "domain": self.domain,
            "protected_experts": [list(p) for p in self.protected_experts],
            "single_points_of_failure": [list(s) for s in self.single_points_of_failure],
            "protected_count": sum(len(p) for p in self.protected_experts),
            "single_points_of_failure_count": sum(len(s) for s in self.single_points_of_failure),
            "at_risk_share": list(self.at_risk_share),
            "targets": list(self.targets),
            "protectable": list(self.protectable),
            "par": self.par,
            "par_unconstrained": self.par_unconstrained,
            "par_increase": self.par_increase,
            "max_par_increase": self.max_par_increase,
            "capped_layers": list(self.capped_layers),
        }


# ---------------------------------------------------------------------------------------------
# one layer
# ---------------------------------------------------------------------------------------------
class _Domains:
    """A layer's copies per (expert, domain) ``dc [E, D]`` and domains per expert ``spans [E]``
    beside its :class:`LayerSlots`, kept up to date by :meth:`put` and :meth:`swap`."""

    def __init__(self, lay: LayerSlots, dom: np.ndarray) -> None:
        self.lay, self.dom = lay, dom  # dom: [G] domain of each GPU
        self.D = int(dom.max()) + 1
        onehot = (dom[:, None] == np.arange(self.D)[None, :]).astype(np.float64)  # [G, D]
        self.dc = np.rint(lay.hold.astype(np.float64) @ onehot).astype(np.int64)  # [E, D]
        self.spans = (self.dc > 0).sum(axis=1)  # [E]

    def _count(self, e: int, d: int, by: int) -> None:
        self.dc[e, d] += by
        self.spans[e] = int((self.dc[e] > 0).sum())

    def put(self, slot: int, e: int) -> None:
        old, d = int(self.lay.row[slot]), int(self.dom[slot // self.lay.S])
        self.lay.put(slot, e)
        if old >= 0:
            self._count(old, d, -1)
        self._count(e, d, +1)

    def swap(self, a: int, b: int) -> None:
        ea, eb = int(self.lay.row[a]), int(self.lay.row[b])
        da, db = int(self.dom[a // self.lay.S]), int(self.dom[b // self.lay.S])
        self.lay.swap(a, b)
        for e, src, dst in ((ea, da, db), (eb, db, da)):
            self._count(e, src, -1)
            self._count(e, dst, +1)

    def spans_after(self, e: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """``[C]`` domains holding ``e[c]`` after one of its copies moves from domain ``src`` to ``dst``."""
        dc = self.dc
        moved = src != dst
        return self.spans[e] - (moved & (dc[e, src] == 1)) + (moved & (dc[e, dst] == 0))


def _add_copies(lay: LayerSlots, doms: _Domains, targets: np.ndarray, need: np.ndarray) -> None:
    """Step 2: each target with one copy takes a surplus replica's slot (of an expert with more copies
    than it ``need``s ``[E]``, a target keeping copies in two domains), on another domain if any."""
    S = lay.S
    for e in targets[lay.cnt[targets] < 2]:
        d = np.maximum(lay.row, 0)
        slots = np.flatnonzero((lay.row >= 0) & (lay.cnt[d] > need[d]))
        d = lay.row[slots]
        spread = doms.spans[d] - (doms.dc[d, doms.dom[slots // S]] == 1) >= 2  # still two domains after
        slots = slots[~lay.hold[e, slots // S] & ((need[d] < 2) | spread)]
        if not slots.size:
            continue
        here = doms.dom[np.flatnonzero(lay.hold[e])]
        away = ~np.isin(doms.dom[slots // S], here)
        if away.any():
            slots = slots[away]
        peaks = lay.peaks_if_put(slots, np.full(slots.size, e))
        doms.put(int(slots[best_index(peaks, lay.load[slots // S])]), int(e))


def _spread(lay: LayerSlots, doms: _Domains, targets: np.ndarray, is_target: np.ndarray) -> None:
    """Step 3: each target with copies in one domain swaps one copy with a replica in another domain
    whose expert stays protected (when a target)."""
    S = lay.S
    for e in targets:
        if lay.cnt[e] < 2 or doms.spans[e] >= 2:
            continue
        mine = np.flatnonzero(lay.row == e)
        home = doms.dom[mine[0] // S]
        other = np.flatnonzero((lay.row >= 0) & (doms.dom[np.arange(lay.row.size) // S] != home))
        x, y = np.repeat(mine, other.size), np.tile(other, mine.size)
        f = lay.row[y]
        ok = ~lay.hold[f, x // S]
        keeps = doms.spans_after(f, doms.dom[y // S], doms.dom[x // S]) >= 2
        ok &= ~is_target[f] | keeps
        x, y, f = x[ok], y[ok], f[ok]
        if not x.size:
            continue
        share = lay.share
        delta = share[x] - share[y]
        peaks = np.maximum(lay.load[x // S] - delta, lay.load[y // S] + delta)
        i = best_index(peaks, np.abs(delta))
        doms.swap(int(x[i]), int(y[i]))


def _polish(lay: LayerSlots, doms: _Domains, is_target: np.ndarray, rounds: int) -> None:
    """Step 4: swaps from the peak GPU that keep every target protected, while one lowers the peak of
    its two GPUs by at least :data:`POLISH_MIN_GAIN` of the mean (at most ``rounds``)."""
    S = lay.S
    for _ in range(rounds):
        top = int(np.argmax(lay.load))
        x, y, peaks = lay.swaps_from(top)
        better = peaks < lay.load[top] - POLISH_MIN_GAIN * lay.load.mean()
        x, y, peaks = x[better], y[better], peaks[better]
        if not x.size:
            return
        ex, ey = lay.row[x], lay.row[y]
        dx, dy = doms.dom[x // S], doms.dom[y // S]
        ok = (~is_target[ex] | (doms.spans_after(ex, dx, dy) >= 2)) & (
            ~is_target[ey] | (doms.spans_after(ey, dy, dx) >= 2)
        )
        if not ok.any():
            return
        x, y, peaks = x[ok], y[ok], peaks[ok]
        i = best_index(peaks, x.astype(np.float64) * lay.row.size + y)
        doms.swap(int(x[i]), int(y[i]))


class _Protecting:
    """One layer being protected, hottest expert first: its slots, domains and targets."""

    def __init__(self, row: np.ndarray, w: np.ndarray, topo: Topology, dom: np.ndarray) -> None:
        self.w, self.topo, self.dom = w, topo, dom
        self.order = np.argsort(-w, kind="stable")  # [E] hottest first
        self.K = 0
        self.restore(row)

    def restore(self, row: np.ndarray) -> None:
        """Start again from ``row [P]`` with the ``K`` hottest experts as targets."""
        self.lay = LayerSlots(row.copy(), self.w, self.topo.ep_size, self.topo.slots_per_gpu)
        self.doms = _Domains(self.lay, self.dom)
        self.is_target = np.zeros(self.w.size, dtype=bool)
        self.is_target[self.order[: self.K]] = True

    def par(self) -> float:
        load = self.lay.load
        return float(load.max() / load.mean()) if load.mean() > 0 else 1.0

    def protect_to(self, K: int, rounds: int) -> None:
        """Steps 2-4 for the hottest experts ``self.K .. K-1``, at most ``rounds`` polish swaps."""
        new = self.order[self.K : K]
        self.K = K
        self.is_target[new] = True
        _add_copies(self.lay, self.doms, new, np.where(self.is_target, 2, 1))
        if self.doms.D < self.topo.ep_size:  # node domains: copies may share one
            _spread(self.lay, self.doms, new, self.is_target)
        _polish(self.lay, self.doms, self.is_target, rounds)


def _layer_par(row: np.ndarray, w: np.ndarray, G: int, S: int) -> float:
    """PAR of one layer's map ``row [P]`` on ``w [E]`` (even split)."""
    cnt = np.bincount(row, minlength=w.size)
    gpu = (w[row] / cnt[row]).reshape(G, S).sum(axis=1)
    mean = gpu.mean()
    return float(gpu.max() / mean) if mean > 0 else 1.0


def _free_prefix(row: np.ndarray, w: np.ndarray, K_max: int) -> int:
    """The most hottest experts that already have two copies in ``row [P]`` (protecting them moves
    copies between domains but changes no replica count), at most ``K_max``."""
    cnt = np.bincount(row, minlength=w.size)
    short = cnt[np.argsort(-w, kind="stable")[:K_max]] < 2
    return int(np.argmax(short)) if short.any() else K_max


def _capped_layer(
    row: np.ndarray, w: np.ndarray, K_max: int, topo: Topology, dom: np.ndarray, cap: float | None
) -> tuple[np.ndarray, int]:
    """Steps 1-5 on one layer: ``(map [P], K)`` with the ``K`` hottest experts protected.

    The hottest experts that already have two copies first, all at once (no replica count changes),
    then one more at a time, each followed by a short polish (a long one when the layer is then over
    the cap), while the layer's PAR stays within the cap: the first expert that would break it is
    left unprotected, and so are the colder ones. A last polish of the layer kept (it only lowers the
    peak). ``K = 0``: ``row`` unchanged."""
    G = topo.ep_size
    limit = np.inf if cap is None else _layer_par(row, w, G, topo.slots_per_gpu) * (1 + cap) + 1e-12
    state = _Protecting(row, w, topo, dom)
    free = _free_prefix(row, w, K_max)
    if free:
        state.protect_to(free, POLISH_ROUNDS_PER_GPU * G)
        if state.par() > limit:  # rare: spreading alone breaks the cap; one at a time from none
            state.K = 0
            state.restore(row)
    rounds = max(1, G // STEP_ROUNDS_DIVISOR)
    while state.K < K_max:
        kept = state.lay.row.copy()
        state.protect_to(state.K + 1, rounds)
        if state.par() > limit:  # a longer polish before giving up on this expert
            _polish(state.lay, state.doms, state.is_target, POLISH_ROUNDS_PER_GPU * G)
        if state.par() > limit:
            state.K -= 1
            state.restore(kept)
            break
    if state.K == 0:
        return row, 0
    _polish(state.lay, state.doms, state.is_target, POLISH_ROUNDS_PER_GPU * G)
    spans = state.doms.spans[state.order[: state.K]]  # a target no swap could spread ends the prefix
    return state.lay.row, int(np.argmin(spans >= 2)) if (spans < 2).any() else state.K


# ---------------------------------------------------------------------------------------------
# the placement
# ---------------------------------------------------------------------------------------------
def protectable(load: np.ndarray, topology: Topology) -> np.ndarray:
    """int64 ``[L]``: the most experts a layer can protect: its redundant slots, its experts with load."""
    w = np.asarray(load, dtype=np.float64)
    redundant = topology.num_physical_experts - w.shape[1]
    return np.minimum((w > 0).sum(axis=1), redundant).astype(np.int64)


def failure_report(
    placement: Placement,
    load: np.ndarray,
    domain: str,
    unconstrained: Placement | None = None,
    targets: Sequence[int] | None = None,
    max_par_increase: float | None = None,
    capped_layers: Sequence[int] = (),
) -> FailureReport:
    """What ``placement`` protects under ``domain`` on ``load [L, E]`` (``unconstrained``: the
    placement it is compared with, default itself; ``targets``: ``K`` per layer, default the experts
    it protects)."""
    from placement.metrics import par

    w = np.asarray(load, dtype=np.float64)
    t = placement.topology
    dom = domain_of_gpu(t, domain)
    mask = placement.replica_gpu_mask > 0  # [L, E, G]
    D = int(dom.max()) + 1
    spans = np.zeros(mask.shape[:2] + (D,), dtype=bool)  # [L, E, D]
    for d in range(D):
        spans[:, :, d] = mask[:, :, dom == d].any(axis=2)
    protected = spans.sum(axis=2) >= 2  # [L, E]
    order = np.argsort(-w, axis=1, kind="stable")  # [L, E] hottest first
    prot = tuple(tuple(int(e) for e in order[l] if protected[l, e]) for l in range(w.shape[0]))
    spof = tuple(tuple(int(e) for e in order[l] if not protected[l, e]) for l in range(w.shape[0]))
    total = np.maximum(w.sum(axis=1), 1e-300)
    at_risk = tuple(float(x) for x in (np.where(protected, 0.0, w).sum(axis=1) / total))
    base = unconstrained if unconstrained is not None else placement
    return FailureReport(
        domain=domain,
        protected_experts=prot,
        single_points_of_failure=spof,
        targets=tuple(int(k) for k in (targets if targets is not None else protected.sum(axis=1))),
        protectable=tuple(int(k) for k in protectable(w, t)),
        par=par(placement, w),
        par_unconstrained=par(base, w),
        max_par_increase=max_par_increase,
        capped_layers=tuple(int(i) for i in capped_layers),
        at_risk_share=at_risk,
    )


def protect(
    placement: Placement,
    load: np.ndarray,
    domain: str,
    max_par_increase: float | None = DEFAULT_MAX_PAR_INCREASE,
) -> tuple[Placement, FailureReport]:
    """The pipeline's failure-domain step (see the module docstring) on ``placement`` for ``load [L, E]``.

    Returns ``(placement with the hottest experts protected, FailureReport)``; the provenance records
    the domain and the cap. Layers where nothing changes keep their map as it is.
    """
    check_domain(domain, placement.topology)
    cap = check_max_par_increase(max_par_increase)
    w = np.asarray(load, dtype=np.float64)
    t = placement.topology
    dom = domain_of_gpu(t, domain)
    rows, Ks, capped = [], [], []
    K_max = protectable(w, t)
    for l in range(placement.num_layers):
        row, K = _capped_layer(placement.physical_to_logical_map[l], w[l], int(K_max[l]), t, dom, cap)
        rows.append(row)
        Ks.append(K)
        if K < K_max[l]:
            capped.append(placement.layer_ids[l])
    prov = {**placement.provenance, "failure_domain": domain, "failure_max_par_increase": cap}
    new = Placement(np.stack(rows), placement.num_logical_experts, t, placement.layer_ids, prov)
    report = failure_report(new, w, domain, placement, Ks, cap, capped)
    log.debug("%s", report.note())
    return new, report
