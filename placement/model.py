"""The placement data model: one canonical ``physical_to_logical_map``, everything else derived.

Shapes (L = layers, P = physical experts per layer, E = logical experts, G = EP ranks, R = max replicas):

- ``physical_to_logical_map``: int64 ``[L, P]``; slot ``p`` of layer ``l`` holds logical expert
  ``physical_to_logical_map[l, p]``. The single source of truth.
- ``logical_to_physical_map``: int64 ``[L, E, R]``; the slots holding each expert, ascending, padded
  with ``-1``. Derived by :func:`compute_logical_maps`.
- ``logical_replica_count``: int64 ``[L, E]``. Derived.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from moe_placement.base.limits import MAX_LAYER_ID, check_sequence, check_whole
from placement.topology import Topology

__all__ = ["Placement", "colocated_replicas", "compute_logical_maps", "hidden_layer_rows", "validate_map"]


def compute_logical_maps(physical_to_logical_map: np.ndarray, num_logical_experts: int):
    """Derive the logical-side maps from the canonical map.

    Args:
        physical_to_logical_map: int ``[L, P]`` with ids in ``[0, E)``.
        num_logical_experts: ``E``.

    Returns:
        ``(logical_to_physical_map int64 [L, E, R] padded with -1, logical_replica_count int64 [L, E])``,
        where ``R`` is the largest replica count of any expert in any layer. Slots are ascending.
    """
    p2l = np.asarray(physical_to_logical_map, dtype=np.int64)
    L, P = p2l.shape
    E = int(num_logical_experts)
    count = np.zeros((L, E), dtype=np.int64)
    np.add.at(count, (np.repeat(np.arange(L), P), p2l.ravel()), 1)
    R = max(int(count.max(initial=0)), 1)
    # Stable sort slots by expert id: slots of one expert become consecutive and ascending.
    order = np.argsort(p2l, axis=1, kind="stable")  # [L, P] slot ids grouped by expert
    sorted_ids = np.take_along_axis(p2l, order, axis=1)  # [L, P]
    starts = np.cumsum(count, axis=1) - count  # [L, E] first position of each expert in `order`
    rank_in_expert = np.arange(P)[None, :] - np.take_along_axis(starts, sorted_ids, axis=1)  # [L, P]
    l2p = np.full((L, E, R), -1, dtype=np.int64)
    l2p[np.repeat(np.arange(L), P), sorted_ids.ravel(), rank_in_expert.ravel()] = order.ravel()
    return l2p, count


def validate_map(
    physical_to_logical_map: np.ndarray,
    num_logical_experts: int,
    topology: Topology,
    *,
    allow_colocated_replicas: bool = False,
) -> np.ndarray:
    """Check a map against the hard rules and return it as a C-contiguous int64 array.

    Raises ValueError naming the offending layer, slot, expert or GPU and a fix when:
    the shape is not ``[L, P]``, ids are out of ``[0, E)``, a logical expert has no replica in a layer,
    or two replicas of one expert share a GPU (unless ``allow_colocated_replicas``, used only to
    reproduce the published greedy packing exactly).
    """
    if not isinstance(topology, Topology):
        raise ValueError(f"topology must be a placement.topology.Topology, got {type(topology).__name__}")
    arr = np.asarray(physical_to_logical_map)
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and arr.size and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise ValueError(f"physical_to_logical_map must hold integer expert ids, got dtype {arr.dtype}")
    if arr.ndim == 1:
        raise ValueError(
            f"physical_to_logical_map must be 2-D [num_layers, num_physical_experts], got shape {arr.shape}; "
            "wrap a single layer as [map]"
        )
    if arr.ndim != 2:
        raise ValueError(
            f"physical_to_logical_map must be 2-D [num_layers, num_physical_experts], got shape {arr.shape}"
        )
    L, P = arr.shape
    if L == 0:
        raise ValueError("physical_to_logical_map has 0 layers; expected at least one")
    if P != topology.num_physical_experts:
        raise ValueError(
            f"physical_to_logical_map has {P} slots per layer but the topology has "
            f"{topology.num_physical_experts} ({topology.ep_size} GPUs x {topology.slots_per_gpu} slots)"
        )
    E = check_whole("num_logical_experts", num_logical_experts, 1, fix="the model's expert count")
    if E > P:
        raise ValueError(
            f"{E} logical experts cannot fit in {P} physical slots; use at least {E} physical experts "
            f"(num_redundant >= 0) with ep_size dividing it"
        )
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    bad = (arr < 0) | (arr >= E)
    if bad.any():
        l, p = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"layer {l} slot {p} holds expert id {int(arr[l, p])}, outside [0, {E}); "
            f"{int(bad.sum())} slot(s) out of range in total"
        )
    _, count = compute_logical_maps(arr, E)
    missing = count == 0
    if missing.any():
        l, e = map(int, np.argwhere(missing)[0])
        raise ValueError(
            f"layer {l}: logical expert {e} has no replica ({int(missing.sum())} expert/layer pair(s) "
            f"without a replica); every expert needs at least one slot in every layer"
        )
    if not allow_colocated_replicas:
        found = colocated_replicas(arr, topology.ep_size)
        if found:
            l, g, e = found[0]
            raise ValueError(
                f"layer {l}: GPU {g} holds two replicas of expert {e}; "
                f"replicas of one expert must sit on different GPUs (move one to another GPU)"
            )
    return arr


def hidden_layer_rows(placement: Placement, num_hidden_layers: int | None = None) -> np.ndarray:
    """The map as SGLang reads it, one row per hidden layer: int64 ``[H, P]``.

    MoE rows sit at their real layer index (``placement.layer_ids``); the other (dense) rows hold the
    trivial map ``p % E``. ``H`` defaults to the largest layer id + 1; both are bounded by
    ``MAX_LAYER_ID`` (:mod:`moe_placement.base.limits`) before the ``[H, P]`` map is allocated.
    """
    ids = list(placement.layer_ids)
    P, E = placement.num_physical_experts, placement.num_logical_experts
    if max(ids) > MAX_LAYER_ID:
        raise ValueError(
            f"the placement has layer id {max(ids)}, outside the accepted range 0..{MAX_LAYER_ID} "
            f"(MAX_LAYER_ID); SGLang's map would need {max(ids) + 1} rows: check the placement's layer_ids"
        )
    H = max(ids) + 1 if num_hidden_layers is None else int(num_hidden_layers)
    if H > MAX_LAYER_ID + 1:
        raise ValueError(
            f"num_hidden_layers={H} is outside the accepted range 1..{MAX_LAYER_ID + 1} (MAX_LAYER_ID + 1); "
            f"pass the model's config.num_hidden_layers"
        )
    if H <= max(ids):
        raise ValueError(
            f"num_hidden_layers={H} but the placement has layer id {max(ids)}; SGLang's map has one "
            f"row per hidden layer, so pass num_hidden_layers >= {max(ids) + 1} (config.num_hidden_layers)"
        )
    full = np.tile(np.arange(P, dtype=np.int64) % E, (H, 1))  # [H, P] dense rows: trivial map
    full[ids] = placement.physical_to_logical_map  # MoE rows at their real layer index
    return full


def colocated_replicas(physical_to_logical_map: np.ndarray, ep_size: int) -> list[tuple[int, int, int]]:
    """``(layer, gpu, expert)`` for every GPU holding two or more replicas of one expert.

    Such maps come from the engines' own balancers; SGLang's static dispatch then sends a GPU's own
    tokens to the first copy only, and with DeepEP its loader may leave the second copy unloaded while
    other ranks still route to it. ``physical_to_logical_map``: int ``[L, P]``.
    """
    arr = np.asarray(physical_to_logical_map, dtype=np.int64)
    L, P = arr.shape
    per_gpu = np.sort(arr.reshape(L, ep_size, P // ep_size), axis=2)  # [L, G, S]
    dup = per_gpu[:, :, 1:] == per_gpu[:, :, :-1]  # [L, G, S-1]
    found = {(int(l), int(g), int(per_gpu[l, g, s])) for l, g, s in np.argwhere(dup)}
    return sorted(found)


@dataclass(frozen=True, eq=False)
class Placement:
    """Where every replica of every logical expert lives, for all MoE layers.

    Attributes:
        physical_to_logical_map: int64 ``[L, P]`` (read-only).
        num_logical_experts: ``E``.
        topology: the :class:`Topology` (``P`` slots over ``G`` GPUs over ``N`` nodes).
        layer_ids: the model's real layer index of each of the ``L`` rows (MoE layers only).
        provenance: free-form metadata (solver, options, trace) kept in the native file.
    """

    physical_to_logical_map: np.ndarray
    num_logical_experts: int
    topology: Topology
    layer_ids: tuple[int, ...] = ()
    provenance: Mapping[str, Any] = field(default_factory=dict)
    allow_colocated_replicas: bool = False

    def __post_init__(self) -> None:
        arr = validate_map(
            self.physical_to_logical_map,
            self.num_logical_experts,
            self.topology,
            allow_colocated_replicas=self.allow_colocated_replicas,
        )
        arr = arr.copy()
        arr.setflags(write=False)
        object.__setattr__(self, "physical_to_logical_map", arr)
        object.__setattr__(self, "num_logical_experts", int(self.num_logical_experts))
        given = check_sequence(self.layer_ids, "layer_ids", "layer ids")  # "01" is not layers 0 and 1
        ids = tuple(check_whole("layer_ids' entry", x, None) for x in (given or range(arr.shape[0])))
        if len(ids) != arr.shape[0]:
            raise ValueError(
                f"layer_ids has {len(ids)} entries but the map has {arr.shape[0]} layers; "
                f"give one real layer index per map row"
            )
        if len(set(ids)) != len(ids):
            raise ValueError(f"layer_ids must be distinct, got {list(ids)}")
        if min(ids) < 0:
            raise ValueError(f"layer_ids must be >= 0, got {list(ids)}")
        object.__setattr__(self, "layer_ids", ids)
        if not isinstance(self.provenance, Mapping):
            raise ValueError(f"provenance must be a mapping (a dict), got {type(self.provenance).__name__}")
        object.__setattr__(self, "provenance", dict(self.provenance))

    # ---- named constructors -------------------------------------------------------------------
    @classmethod
    def trivial(
        cls,
        num_layers: int,
        num_logical_experts: int,
        topology: Topology,
        layer_ids: Sequence[int] | None = None,
    ) -> Placement:
        """Slot ``p`` holds expert ``p % E`` (the engines' default with redundant slots)."""
        if not isinstance(topology, Topology):
            raise ValueError(f"topology must be a placement.topology.Topology, got {type(topology).__name__}")
        P = topology.num_physical_experts
        E = check_whole("num_logical_experts", num_logical_experts, 1, fix="the model's expert count")
        L = check_whole("num_layers", num_layers, 1, MAX_LAYER_ID + 1, fix="the number of MoE layers")
        if E > P:
            raise ValueError(f"{E} logical experts do not fit in {P} physical slots")
        row = np.arange(P, dtype=np.int64) % E
        p2l = np.tile(row, (L, 1))
        # p % E may put two replicas on one GPU when S > E; such topologies need a solver instead.
        return cls(p2l, E, topology, () if layer_ids is None else layer_ids, {"solver": "trivial"})

    @classmethod
    def from_map(
        cls,
        physical_to_logical_map,
        num_logical_experts: int | None = None,
        ep_size: int = 1,
        num_nodes: int = 1,
        layer_ids: Sequence[int] | None = None,
        provenance: Mapping[str, Any] | None = None,
    ) -> Placement:
        """Build from a ``[L, P]`` map; ``num_logical_experts`` defaults to ``max id + 1``."""
        arr = np.asarray(physical_to_logical_map)
        if arr.ndim != 2:
            raise ValueError(
                f"physical_to_logical_map must be 2-D [num_layers, num_physical_experts], got shape {arr.shape}"
            )
        if num_logical_experts is None:
            num_logical_experts = int(arr.max()) + 1 if arr.size else 0
        topo = Topology(ep_size=ep_size, num_physical_experts=arr.shape[1], num_nodes=num_nodes)
        ids = () if layer_ids is None else layer_ids
        return cls(arr, int(num_logical_experts), topo, ids, dict(provenance or {}))

    # ---- derived views ------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.physical_to_logical_map.shape[0])

    @property
    def num_physical_experts(self) -> int:
        return int(self.physical_to_logical_map.shape[1])

    @property
    def num_redundant_experts(self) -> int:
        return self.num_physical_experts - self.num_logical_experts

    @cached_property
    def _logical_maps(self):
        l2p, count = compute_logical_maps(self.physical_to_logical_map, self.num_logical_experts)
        l2p.setflags(write=False)
        count.setflags(write=False)
        return l2p, count

    @property
    def logical_to_physical_map(self) -> np.ndarray:
        """int64 ``[L, E, R]``, slots of each expert ascending, padded with -1."""
        return self._logical_maps[0]

    @property
    def logical_replica_count(self) -> np.ndarray:
        """int64 ``[L, E]``."""
        return self._logical_maps[1]

    @cached_property
    def replica_gpu_mask(self) -> np.ndarray:
        """float64 ``[L, E, G]``: replicas of expert ``e`` on GPU ``g`` (0 or 1 unless colocated)."""
        L, E, G = self.num_layers, self.num_logical_experts, self.topology.ep_size
        mask = np.zeros((L, E, G), dtype=np.float64)
        gpu = np.broadcast_to(self.topology.gpu_of_slot, (L, self.num_physical_experts))
        np.add.at(
            mask,
            (
                np.repeat(np.arange(L), self.num_physical_experts),
                self.physical_to_logical_map.ravel(),
                gpu.ravel(),
            ),
            1.0,
        )
        mask.setflags(write=False)
        return mask

    def select_layers(self, indices: Sequence[int]) -> Placement:
        """A placement over a subset of rows (by row index, not layer id)."""
        idx = [
            check_whole("select_layers' row", i, None, fix="pass whole-number row indices") for i in indices
        ]
        if any(not 0 <= i < self.num_layers for i in idx):
            raise ValueError(f"rows {idx[:8]} are outside this placement's rows 0..{self.num_layers - 1}")
        return Placement(
            self.physical_to_logical_map[idx],
            self.num_logical_experts,
            self.topology,
            tuple(self.layer_ids[i] for i in idx),
            self.provenance,
            self.allow_colocated_replicas,
        )

    def with_provenance(self, **extra) -> Placement:
        prov = dict(self.provenance)
        prov.update(extra)
        return Placement(
            self.physical_to_logical_map,
            self.num_logical_experts,
            self.topology,
            self.layer_ids,
            prov,
            self.allow_colocated_replicas,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return (
            self.num_logical_experts == other.num_logical_experts
            and self.topology == other.topology
            and self.layer_ids == other.layer_ids
            and np.array_equal(self.physical_to_logical_map, other.physical_to_logical_map)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        t = self.topology
        return (
            f"Placement(layers={self.num_layers}, logical={self.num_logical_experts}, "
            f"physical={self.num_physical_experts}, ep_size={t.ep_size}, nodes={t.num_nodes}, "
            f"solver={self.provenance.get('solver', '?')!r})"
        )
