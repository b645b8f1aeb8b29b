"""Failover maps: what to serve on the GPUs left after one GPU or one node is lost.

Shapes: L layers, E logical experts, G GPUs before the loss, S slots per GPU (unchanged by the loss),
``G'`` surviving GPUs, ``P' = S x G'`` surviving slots.

The surviving GPUs keep their order and are renumbered ``0..G'-1`` (vLLM's elastic scale-down always
keeps ranks ``0..G'-1``, so there the numbering is the identity). Per layer:

1. **survivors**: the map in service restricted to the surviving GPUs' slots ``[P']``. A second copy
   of an expert on one GPU (engine maps may hold some) is a free slot.
2. **reloads**: every expert with no surviving copy (``min_reloads`` of them, the fewest any map
   needs) takes one slot, hottest first, each the slot that leaves the lowest peak GPU load: a free
   slot, or a replica of an expert that keeps another surviving copy (a surplus replica is dropped).
   Each such expert arrives on exactly one GPU: it is loaded from host memory or disk.
3. **moves** (balance within a budget): on the peak GPU of a layer, the best of replacing a surplus
   replica (on that GPU by a lighter expert, or elsewhere by a further copy of one of its experts:
   one copy) and exchanging one of its experts with one of another GPU (two copies), scored by the
   load it takes off that GPU without lifting another above it, per copy. Over all layers the move
   that gains most per copy goes first (a heap: the budget goes to the layers that gain most), while
   one gains at least ``min_gain`` of its layer's mean GPU load and the layer's peak is more than
   ``target`` above its lower bound, at most ``max_moves`` copies in all. A move copies an expert
   from a GPU that holds it (a survivor, or a reloaded expert's first GPU): no further reload.

Every other surviving slot keeps its expert. ``reloads`` and ``moves`` in the report are counted
from the maps (arrivals as :mod:`placement.churn` counts them, an expert new on a GPU: the experts
with no surviving copy are the reloads, every other arrival a move), not from the steps. The search
is plain numpy with fixed tie-breaking and no clock: the same input gives the same map on every rank.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moe_placement.base.limits import check_whole
from moe_placement.base.options import refuse_unknown_keywords
from placement.model import Placement
from placement.topology import Topology
from solver.layer_slots import LayerSlots, best_index

__all__ = [
    "DEFAULT_MAX_MOVES",
    "FailoverOptions",
    "FailoverReport",
    "domain_losses",
    "failover_map",
    "survivor_topology",
]

log = logging.getLogger(__name__)

# The default move budget (``max_moves="lost"``): reloads and moves together copy at most what the
# lost GPUs held (their slots x layers): the failover restores that much weight, no more. Measured on
# the DeepSeek-V2-Lite trace (26 layers, 32 GPUs over 4 nodes, 32 redundant slots, failure domain
# node): every node loss then lands within 5% of a full re-solve's PAR (benchmarks/failover.py);
# with reloads only (0) the worst is more than 20% off.
DEFAULT_MAX_MOVES = "lost"
TARGET = 0.02  # a layer whose peak is within this share of its lower bound takes no more moves
MIN_GAIN = 1e-3  # a move must lower its layer's peak by at least this share of its mean GPU load, per copy


@refuse_unknown_keywords
@dataclass(frozen=True)
class FailoverOptions:
    """How :func:`failover_map` balances after the reloads.

    Attributes:
        max_moves: copies of experts onto GPUs that did not hold them, beyond the reloads, over all
            layers: ``"lost"`` (default) as many as the lost GPUs held (slots x layers) less the
            reloads; 0: reloads only; None: every move that gains ``min_gain``.
        min_gain: a move is taken only when it lowers its layer's peak GPU load by at least this
            share of the layer's mean GPU load per copy it makes.
        target: a layer whose peak GPU load is within this share of its lower bound
            (:func:`placement.metrics.peak_lower_bound`) takes no more moves.
        resolve: also report the PAR of a full re-solve on the survivors (greedy through
            :func:`solver.api.solve`, from scratch: every slot may change).
        num_groups: the model's expert groups, for that re-solve (hierarchical when they divide over
            the surviving nodes), or None.
    """

    max_moves: int | str | None = DEFAULT_MAX_MOVES
    min_gain: float = MIN_GAIN
    target: float = TARGET
    resolve: bool = False
    num_groups: int | None = None

    def __post_init__(self) -> None:
        if self.max_moves is not None and self.max_moves != DEFAULT_MAX_MOVES:
            check_whole(
                "FailoverOptions.max_moves",
                self.max_moves,
                0,
                fix=f"0 for reloads only, {DEFAULT_MAX_MOVES!r} or None",
            )
        for name in ("min_gain", "target"):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float, np.integer, np.floating))
                or not 0 <= v < 1
            ):
                raise ValueError(f"FailoverOptions.{name} must be a number in [0, 1), got {v!r}")
        if not isinstance(self.resolve, bool):
            raise ValueError(f"FailoverOptions.resolve must be True or False, got {self.resolve!r}")
        if self.num_groups is not None:
            check_whole("FailoverOptions.num_groups", self.num_groups, 1, fix="the model's expert groups")

    def move_budget(self, lost_slots: int, reloads: int) -> int | None:
        """The moves allowed when the lost GPUs held ``lost_slots`` slots over all layers and
        ``reloads`` experts are reloaded (None: no budget)."""
        if self.max_moves == DEFAULT_MAX_MOVES:
            return max(0, lost_slots - reloads)
        return None if self.max_moves is None else int(self.max_moves)


@dataclass(frozen=True)
class FailoverReport:
    """One failover map, counted from the maps.

    Attributes:
        lost_gpus: the GPUs lost (indices before the loss); survivors: the others, in order (new rank
            ``i`` is old GPU ``survivors[i]``).
        reloads: per layer, experts loaded from host memory or disk (no surviving copy: they arrive
            on a GPU). min_reloads: per layer, experts with no surviving copy (the fewest possible).
        moves: per layer, copies of experts that kept a surviving copy onto another GPU.
        par: PAR of the map on the load (even split over replicas, mean over layers).
        resolve_par: PAR of a full re-solve on the survivors (None unless asked for).
        wall_time_s: seconds spent (the re-solve included). notes: what the steps did.
    """

    lost_gpus: tuple[int, ...]
    survivors: tuple[int, ...]
    reloads: tuple[int, ...]
    min_reloads: tuple[int, ...]
    moves: tuple[int, ...]
    par: float
    resolve_par: float | None
    wall_time_s: float
    notes: tuple[str, ...] = ()

    @property
    def total_reloads(self) -> int:
        return int(sum(self.reloads))

    @property
    def total_min_reloads(self) -> int:
        return int(sum(self.min_reloads))

    @property
    def total_moves(self) -> int:
        return int(sum(self.moves))

    def to_dict(self) -> dict:
        return {
            "lost_gpus": list(self.lost_gpus),
            "survivors": list(self.survivors),
            "reloads": self.total_reloads,
            "min_reloads": self.total_min_reloads,
            "moves": self.total_moves,
            "reloads_per_layer": list(self.reloads),
            "min_reloads_per_layer": list(self.min_reloads),
            "moves_per_layer": list(self.moves),
            "par": self.par,
            "resolve_par": self.resolve_par,
            "wall_time_s": self.wall_time_s,
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------------------------------------
# losses and the survivors' topology
# ---------------------------------------------------------------------------------------------
def domain_losses(topology: Topology, domain: str) -> list[tuple[int, tuple[int, ...]]]:
    """Every single loss of a ``domain`` (``gpu`` or ``node``): ``[(domain index, lost GPUs)]``."""
    from solver.failure import DOMAINS

    if domain not in DOMAINS:
        raise ValueError(f"failure domain must be one of {', '.join(DOMAINS)}, got {domain!r}")
    if domain == "gpu":
        return [(g, (g,)) for g in range(topology.ep_size)]
    m = topology.gpus_per_node
    return [(n, tuple(range(n * m, (n + 1) * m))) for n in range(topology.num_nodes)]


def _checked_lost(topology: Topology, lost_gpus: Sequence[int]) -> tuple[int, ...]:
    """``lost_gpus`` as sorted distinct GPU indices inside the topology, leaving a survivor."""
    if isinstance(lost_gpus, (str, bytes)) or not isinstance(
        lost_gpus, (Sequence, np.ndarray, set, frozenset)
    ):
        raise ValueError(f"lost_gpus must be a sequence of GPU indices, got {type(lost_gpus).__name__}")
    G = topology.ep_size
    lost = [check_whole("a lost GPU", g, 0, G - 1, fix=f"GPUs are 0..{G - 1}") for g in lost_gpus]
    if len(set(lost)) != len(lost):
        raise ValueError(f"lost_gpus names a GPU twice: {sorted(lost)}")
    if not lost:
        raise ValueError("lost_gpus is empty: nothing was lost, so there is nothing to fail over")
    if len(lost) >= G:
        raise ValueError(f"all {G} GPUs are lost: no survivor to serve on")
    return tuple(sorted(lost))


def survivor_topology(topology: Topology, lost_gpus: Sequence[int]) -> Topology:
    """The topology of the survivors: ``G'`` GPUs of ``S`` slots each; the nodes that keep a GPU when
    they keep as many each (a whole node lost), else one node (vLLM's rule when the survivors do not
    split evenly over their nodes)."""
    lost = set(_checked_lost(topology, lost_gpus))
    node = topology.node_of_gpu
    per_node = np.bincount(
        [node[g] for g in range(topology.ep_size) if g not in lost], minlength=topology.num_nodes
    )
    kept = per_node[per_node > 0]
    G_new = int(kept.sum())
    nodes = int(kept.size) if (kept == kept[0]).all() else 1
    return Topology(G_new, G_new * topology.slots_per_gpu, nodes)


# ---------------------------------------------------------------------------------------------
# one layer
# ---------------------------------------------------------------------------------------------
def _reload_missing(lay: LayerSlots) -> int:
    """Step 2: every expert without a copy into a slot, hottest first; returns how many."""
    missing = np.flatnonzero(lay.cnt == 0)
    missing = missing[np.argsort(-lay.w[missing], kind="stable")]
    for e in missing:
        slots = lay.surplus_slots()
        peaks = lay.peaks_if_put(slots, np.full(slots.size, e))
        lay.put(int(slots[best_index(peaks, lay.load[slots // lay.S])]), int(e))
    return int(missing.size)


def _fill_free(lay: LayerSlots) -> None:
    """Free slots left (a co-located copy with nothing to reload) take the expert that lowers the
    peak most among those absent from the slot's GPU."""
    for slot in np.flatnonzero(lay.row < 0):
        g = int(slot) // lay.S
        experts = np.flatnonzero(~lay.hold[:, g])
        peaks = lay.peaks_if_put(np.full(experts.size, slot), experts)
        lay.put(int(slot), int(experts[best_index(peaks, -lay.w[experts])]))


def _best_replace(lay: LayerSlots, top: int) -> tuple[float, int, int]:
    """The replace move that lowers the peak most: ``(new peak, slot, expert)`` (slot -1: none).

    Candidates: a surplus replica on the peak GPU ``top`` replaced by any expert absent from it; a
    surplus replica on another GPU replaced by an expert of the peak GPU (splitting it further)."""
    S, w, cnt, share = lay.S, lay.w, lay.cnt, lay.share
    surplus = lay.surplus_slots()
    on_top = surplus[surplus // S == top]
    absent = np.flatnonzero(~lay.hold[:, top])
    a_slots, a_exp = np.repeat(on_top, absent.size), np.tile(absent, on_top.size)
    a_ok = w[a_exp] / (cnt[a_exp] + 1) < share[a_slots]  # the peak GPU must get lighter
    mine = lay.row[top * S : (top + 1) * S]
    elsewhere = surplus[surplus // S != top]
    c_slots, c_exp = np.repeat(elsewhere, mine.size), np.tile(mine, elsewhere.size)
    g = c_slots // S
    c_ok = ~lay.hold[c_exp, g] & (lay.load[g] - share[c_slots] + w[c_exp] / (cnt[c_exp] + 1) < lay.load[top])
    slots = np.concatenate([a_slots[a_ok], c_slots[c_ok]])
    experts = np.concatenate([a_exp[a_ok], c_exp[c_ok]])
    if not slots.size:
        return np.inf, -1, -1
    peaks = lay.peaks_if_put(slots, experts, changed_only=True)
    i = best_index(peaks, slots.astype(np.float64))
    return float(peaks[i]), int(slots[i]), int(experts[i])


def _best_swap(lay: LayerSlots, top: int) -> tuple[float, int, int]:
    """The exchange of an expert of the peak GPU ``top`` with one of another GPU (two copies) that
    lowers the peak most: ``(new peak of the two GPUs, slot on top, other slot)`` (-1: none)."""
    x, y, peaks = lay.swaps_from(top)
    if not x.size:
        return np.inf, -1, -1
    i = best_index(peaks, x.astype(np.float64) * lay.row.size + y)
    return float(peaks[i]), int(x[i]), int(y[i])


def _best_move(lay: LayerSlots) -> tuple[float, tuple[str, int, int]]:
    """The better of :func:`_best_replace` and :func:`_best_swap` per copy made: ``(peak lowered per
    copy, move)``; a move is ``("put", slot, expert)`` or ``("swap", slot, slot)``."""
    top = int(np.argmax(lay.load))
    peak = float(lay.load[top])
    p1, slot, expert = _best_replace(lay, top)
    p2, x, y = _best_swap(lay, top)
    g1, g2 = peak - p1, (peak - p2) / 2
    if g1 >= g2:
        return g1, ("put", slot, expert)
    return g2, ("swap", x, y)


def _apply(lay: LayerSlots, move: tuple[str, int, int]) -> int:
    """Make ``move`` (see :func:`_best_move`); returns the copies it makes."""
    kind, a, b = move
    if kind == "put":
        lay.put(a, b)
        return 1
    lay.swap(a, b)
    return 2


def _balance(layers: list[LayerSlots], budget: int | None, min_gain: float, target: float) -> int:
    """Step 3: the best move over all layers (by peak lowered per copy, in shares of the layer's mean
    GPU load) while it gains at least ``min_gain`` per copy and the budget lasts; a layer whose peak
    is within ``target`` of its lower bound (:func:`placement.metrics.peak_lower_bound`) stops.
    Returns the copies made."""
    from placement.metrics import peak_lower_bound

    heap: list[tuple[float, int, tuple[str, int, int]]] = []
    G, P = layers[0].G, layers[0].row.size
    bound = peak_lower_bound(np.stack([lay.w for lay in layers]), G, P) * (1 + target)  # [L]

    def push(l: int) -> None:
        lay = layers[l]
        mean = lay.load.sum() / lay.G
        if mean <= 0 or lay.load.max() <= bound[l]:
            return
        gain, move = _best_move(lay)
        gain = gain / mean
        if move[1] >= 0 and gain >= max(min_gain, 1e-12):
            heapq.heappush(heap, (-gain, l, move))

    for l in range(len(layers)):
        push(l)
    made = 0
    while heap:
        _, l, move = heapq.heappop(heap)
        if budget is not None and made + (1 if move[0] == "put" else 2) > budget:
            break
        made += _apply(layers[l], move)
        push(l)
    return made


# ---------------------------------------------------------------------------------------------
# the map
# ---------------------------------------------------------------------------------------------
def _survivor_rows(placement: Placement, survivors: np.ndarray) -> np.ndarray:
    """int64 ``[L, P']``: the map on the surviving GPUs, a second copy of an expert on one GPU -1."""
    t = placement.topology
    L, S = placement.num_layers, t.slots_per_gpu
    rows = placement.physical_to_logical_map.reshape(L, t.ep_size, S)[:, survivors].copy()  # [L, G', S]
    order = np.argsort(rows, axis=2, kind="stable")
    srt = np.take_along_axis(rows, order, axis=2)
    dup = np.zeros_like(srt, dtype=bool)
    dup[..., 1:] = srt[..., 1:] == srt[..., :-1]  # the later copy of a pair
    np.put_along_axis(rows, order, np.where(dup, -1, srt), axis=2)
    return rows.reshape(L, -1)


def _checked_load(placement: Placement, load) -> np.ndarray:
    try:
        w = np.asarray(load, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"load must be numbers [layers, experts], got {type(load).__name__}") from None
    want = (placement.num_layers, placement.num_logical_experts)
    if w.shape != want:
        raise ValueError(f"load has shape {w.shape}; the placement needs {list(want)} (layers x experts)")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("load must be finite and >= 0 (found NaN, inf or a negative count)")
    return w


def _arrivals(before: np.ndarray, after: np.ndarray, E: int, G: int, S: int) -> tuple[np.ndarray, np.ndarray]:
    """Per layer ``(reloads [L], moves [L])`` of ``after [L, P']`` against ``before [L, P']`` (-1:
    an empty slot): reloads are the experts with no copy before (each loaded once from host memory or
    disk), moves every other arrival of an expert on a GPU that did not hold it (copies from a GPU
    that holds it, a reloaded expert's further copies included)."""
    L, P = after.shape
    held = np.zeros((L, E + 1, G), dtype=bool)  # row E: the -1 slots
    gpu = np.broadcast_to(np.arange(P) // S, (L, P))
    lid = np.broadcast_to(np.arange(L)[:, None], (L, P))
    held[lid, np.where(before < 0, E, before), gpu] = True
    held = held[:, :E]  # [L, E, G']
    new = np.zeros_like(held)
    new[lid, after, gpu] = True
    arrived = (new & ~held).sum(axis=(1, 2))  # [L]
    reloads = (new.any(axis=2) & ~held.any(axis=2)).sum(axis=1)  # [L]
    return reloads.astype(np.int64), (arrived - reloads).astype(np.int64)


def failover_map(
    placement: Placement, load: np.ndarray, lost_gpus: Sequence[int], options: FailoverOptions | None = None
) -> tuple[Placement, FailoverReport]:
    """The map to serve on the GPUs left when ``lost_gpus`` are lost (see the module docstring).

    Args:
        placement: the placement in service (``G`` GPUs of ``S`` slots; co-located copies allowed).
        load: ``[L, E]`` tokens per expert the map is balanced for (e.g. the load it was solved on).
        lost_gpus: the lost GPUs' indices (one GPU, or every GPU of a node, or any other set).
        options: :class:`FailoverOptions` (default: the default move budget, no re-solve).

    Returns:
        ``(Placement on survivor_topology(...), FailoverReport)``; its provenance names the loss.
        A ValueError when the survivors have fewer slots than experts or an argument is malformed.
    """
    t0 = time.perf_counter()
    o = options if options is not None else FailoverOptions()
    if not isinstance(o, FailoverOptions):
        raise ValueError(f"options must be a FailoverOptions, got {type(o).__name__}")
    if not isinstance(placement, Placement):
        raise ValueError(f"placement must be a Placement, got {type(placement).__name__}")
    w = _checked_load(placement, load)
    t = placement.topology
    lost = _checked_lost(t, lost_gpus)
    topo = survivor_topology(t, lost)
    E, S = placement.num_logical_experts, t.slots_per_gpu
    if topo.num_physical_experts < E:
        raise ValueError(
            f"the {topo.ep_size} surviving GPUs hold {topo.num_physical_experts} slots ({S} each), fewer than "
            f"the {E} experts: no map serves every expert; fail over to more GPUs"
        )
    survivors = np.array([g for g in range(t.ep_size) if g not in set(lost)], dtype=np.int64)
    before = _survivor_rows(placement, survivors)  # [L, P']
    layers = [LayerSlots(before[l].copy(), w[l], topo.ep_size, S) for l in range(placement.num_layers)]
    min_reloads = [_reload_missing(lay) for lay in layers]
    for lay in layers:
        _fill_free(lay)
    budget = o.move_budget(len(lost) * S * placement.num_layers, sum(min_reloads))
    made = _balance(layers, budget, float(o.min_gain), float(o.target))
    after = np.stack([lay.row for lay in layers])
    reloads, moves = _arrivals(before, after, E, topo.ep_size, S)
    prov = {"solver": "failover", "lost_gpus": list(lost), "from": dict(placement.provenance)}
    new = Placement(after, E, topo, placement.layer_ids, prov)
    return new, _report(new, w, lost, survivors, (reloads, min_reloads, moves, made), o, t0)


def _report(new, w, lost, survivors, tallies: tuple, o, t0) -> FailoverReport:
    """The report of map ``new`` on load ``w``; ``tallies``: ``(reloads [L], min_reloads [L], moves [L],
    balance moves made)``."""
    from placement.metrics import par

    reloads, min_reloads, moves, made = tallies
    notes = [f"{int(sum(min_reloads))} expert(s) had no surviving copy; {made} balance move(s)"]
    resolve = None
    if o.resolve:
        from solver.api import solve

        groups = o.num_groups if o.num_groups and w.shape[1] % o.num_groups == 0 else None
        re = solve("greedy", topology=new.topology, load=w, num_groups=groups, layer_ids=new.layer_ids)
        resolve = par(re.placement, w)
    wall = time.perf_counter() - t0
    log.debug(
        "failover of GPUs %s: %d reloads, %d moves in %.3fs",
        list(lost),
        int(reloads.sum()),
        int(moves.sum()),
        wall,
    )
    return FailoverReport(
        lost_gpus=tuple(lost),
        survivors=tuple(int(g) for g in survivors),
        reloads=tuple(int(x) for x in reloads),
        min_reloads=tuple(int(x) for x in min_reloads),
        moves=tuple(int(x) for x in moves),
        par=par(new, w),
        resolve_par=resolve,
        wall_time_s=wall,
        notes=tuple(notes),
    )
