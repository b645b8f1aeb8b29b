"""Slot bookkeeping between two placements of the same experts and topology.

Shapes: L layers, E logical experts, P physical slots, G GPUs, S = P // G slots per GPU.

A placement row is a ``[P]`` physical-to-logical map; its membership is bool ``[E, G]`` (expert ``e``
has a replica on GPU ``g``). A weight copy is needed for each (GPU, expert) pair of the new placement
that the previous one lacks: :func:`moved_pairs` counts them, :func:`keep_slots` keeps every expert that
stays on a GPU in its slot (so ``placement.metrics.moved_slots`` equals that count), and
:func:`align_to_previous` also renames GPUs and nodes to keep as many pairs as it can.
"""

from __future__ import annotations

import numpy as np

from placement.model import Placement

__all__ = [
    "colocated_extra_copies",
    "repair_colocated",
    "align_to_previous",
    "fill_slots",
    "keep_slots",
    "keep_slots_batched",
    "membership",
    "moved_pairs",
]


def membership(row: np.ndarray, E: int, G: int, S: int) -> np.ndarray:
    """bool ``[E, G]``: expert ``e`` has a replica on GPU ``g`` (row is one layer's ``[P]`` map)."""
    x = np.zeros((E, G), dtype=bool)
    x[row, np.arange(row.size) // S] = True
    return x


def fill_slots(x: np.ndarray, prev_row: np.ndarray, S: int) -> np.ndarray:
    """A ``[P]`` map holding the pairs of ``x [E, G]``, with every expert kept on a GPU in its old slot.

    Experts new on a GPU take that GPU's freed slots in ascending expert order.
    """
    E, G = x.shape
    out = np.empty_like(prev_row)
    for g in range(G):
        old = prev_row[g * S : (g + 1) * S]  # [S]
        want = np.flatnonzero(x[:, g])
        keep = x[old, g]  # [S] slot keeps its expert
        new = np.setdiff1d(want, old[keep], assume_unique=True)
        seg = old.copy()
        seg[~keep] = new
        out[g * S : (g + 1) * S] = seg
    return out


def keep_slots(new: Placement, previous: Placement) -> Placement:
    """Permute slots within each GPU of ``new`` so experts that stay on a GPU keep their slot.

    GPU contents (and so all loads) are unchanged; ``moved_slots(previous, result)`` becomes the
    number of (GPU, expert) pairs of ``new`` that ``previous`` lacks.
    """
    _check_same_shape(new, previous)
    t = new.topology
    E, G, S = new.num_logical_experts, t.ep_size, t.slots_per_gpu
    p2l = np.stack(
        [
            fill_slots(
                membership(new.physical_to_logical_map[l], E, G, S), previous.physical_to_logical_map[l], S
            )
            for l in range(new.num_layers)
        ]
    )
    return Placement(p2l, E, t, new.layer_ids, new.provenance)


def _home_nodes(row: np.ndarray, E: int, num_groups: int | None, t) -> np.ndarray | None:
    """int64 ``[E]``: the node holding each expert's group in map ``row [P]``, or None (no groups, or
    a group already over several nodes: nothing to keep)."""
    if not num_groups or t.num_nodes <= 1 or E % num_groups:
        return None
    from solver.greedy import group_nodes

    nodes = group_nodes(row[None, :], E, num_groups, t)[0]  # [groups]
    if (nodes < 0).any() or (nodes >= t.num_nodes).any():
        return None
    return np.repeat(nodes, E // num_groups)


def keep_slots_batched(new: Placement, previous: Placement) -> Placement:
    """:func:`keep_slots`, batched over layers and GPUs (the same map; no Python loop per GPU).

    Both placements must hold distinct experts on each GPU (``allow_colocated_replicas`` off).
    """
    _check_same_shape(new, previous)
    t = new.topology
    L, G, S = new.num_layers, t.ep_size, t.slots_per_gpu
    want = new.physical_to_logical_map.reshape(L, G, S)  # [L, G, S] the new GPU contents
    old = previous.physical_to_logical_map.reshape(L, G, S)  # [L, G, S] the slots in service
    same = old[..., :, None] == want[..., None, :]  # [L, G, S old, S new]
    keep = same.any(axis=3)  # [L, G, S] old slot's expert stays on the GPU
    incoming = ~same.any(axis=2)  # [L, G, S] new expert not on the GPU before
    # Incoming experts ascending, then into the freed slots in slot order (as fill_slots does).
    big = np.iinfo(np.int64).max
    arriving = np.sort(np.where(incoming, want, big), axis=2)  # [L, G, S] ascending, padding last
    rank = np.cumsum(~keep, axis=2) - 1  # [L, G, S] index of each freed slot among the freed ones
    filled = np.take_along_axis(arriving, np.maximum(rank, 0), axis=2)
    p2l = np.where(keep, old, filled).reshape(L, G * S)  # [L, P]
    return Placement(p2l, new.num_logical_experts, t, new.layer_ids, new.provenance)


def moved_pairs(previous: Placement, new: Placement) -> np.ndarray:
    """int64 ``[L]``: (GPU, expert) pairs of ``new`` absent from ``previous`` (the least moved slots
    any slot order within GPUs can reach)."""
    _check_same_shape(new, previous)
    t = new.topology
    E, G, S = new.num_logical_experts, t.ep_size, t.slots_per_gpu
    out = np.zeros(new.num_layers, dtype=np.int64)
    for l in range(new.num_layers):
        a = membership(previous.physical_to_logical_map[l], E, G, S)
        b = membership(new.physical_to_logical_map[l], E, G, S)
        out[l] = int((b & ~a).sum())
    return out


def _check_same_shape(new: Placement, previous: Placement) -> None:
    if new.topology != previous.topology or new.num_logical_experts != previous.num_logical_experts:
        raise ValueError(
            f"placements differ: {new.num_logical_experts} vs {previous.num_logical_experts} logical experts, "
            f"topology {new.topology} vs {previous.topology}; align needs the same experts and topology"
        )
    if new.num_layers != previous.num_layers:
        raise ValueError(
            f"placements have {new.num_layers} vs {previous.num_layers} layers; select matching layers first"
        )


def align_to_previous(new: Placement, previous: Placement) -> Placement:
    """Relabel GPUs within nodes (and nodes) and slots within GPUs to minimise moved slots.

    Loads do not change: each GPU's set of experts is kept whole and only renamed, so the multiset of
    per-GPU loads (and every balance metric) is the same. Node relabelling and GPU relabelling inside
    nodes are both linear assignments (scipy ``linear_sum_assignment``) maximising kept pairs; slots
    inside a GPU then follow :func:`keep_slots`.

    Args:
        new: the placement to relabel (e.g. a greedy solve from scratch).
        previous: the placement now in service (same topology, experts and layer count).

    Returns:
        A placement with the same per-GPU expert sets as ``new`` up to GPU renaming.
    """
    from scipy.optimize import linear_sum_assignment

    _check_same_shape(new, previous)
    t = new.topology
    E, G, S, N, m = new.num_logical_experts, t.ep_size, t.slots_per_gpu, t.num_nodes, t.gpus_per_node
    rows = []
    for l in range(new.num_layers):
        xn = membership(new.physical_to_logical_map[l], E, G, S)  # [E, G]
        xp = membership(previous.physical_to_logical_map[l], E, G, S)
        overlap = xn.T.astype(np.int64) @ xp.astype(np.int64)  # [G new, G old] kept pairs
        # Best GPU matching for every (new node, old node) pair, then the node matching.
        node_score = np.zeros((N, N))
        node_match: dict[tuple[int, int], np.ndarray] = {}
        for a in range(N):
            for b in range(N):
                block = overlap[a * m : (a + 1) * m, b * m : (b + 1) * m]  # [m, m]
                ri, ci = linear_sum_assignment(block, maximize=True)
                node_score[a, b] = block[ri, ci].sum()
                node_match[(a, b)] = ci  # new GPU a*m+ri[i] -> old GPU b*m+ci[i]; ri is arange
        na, nb = linear_sum_assignment(node_score, maximize=True)
        new_to_old = np.empty(G, dtype=np.int64)
        for a, b in zip(na, nb):
            new_to_old[a * m + np.arange(m)] = b * m + node_match[(a, b)]
        x_relabelled = np.zeros_like(xn)
        x_relabelled[:, new_to_old] = xn
        rows.append(fill_slots(x_relabelled, previous.physical_to_logical_map[l], S))
    prov = dict(new.provenance)
    prov["aligned_to_previous"] = True
    return Placement(np.stack(rows), E, t, new.layer_ids, prov)


def colocated_extra_copies(placement: Placement) -> np.ndarray:
    """int64 ``[L]``: slots holding a second (third, ...) copy of an expert already on the same GPU.

    Each such slot must change for the map to be valid, so their total is the fewest moved slots any
    repair needs (:func:`repair_colocated` moves exactly that many).
    """
    t = placement.topology
    L, G, S = placement.num_layers, t.ep_size, t.slots_per_gpu
    gpu = np.sort(placement.physical_to_logical_map.reshape(L, G, S), axis=2)  # [L, G, S] sorted per GPU
    return (gpu[..., 1:] == gpu[..., :-1]).sum(axis=(1, 2)).astype(np.int64)


def repair_colocated(
    placement: Placement, load: np.ndarray, num_groups: int | None = None
) -> tuple[Placement, np.ndarray]:
    """The cheapest valid placement from a map holding an expert twice on a GPU, and its moved slots.

    Every extra copy (a slot whose expert already sits in an earlier slot of its GPU) is overwritten
    with an expert that GPU lacks: the one with the highest per-replica load ``load / replicas`` (ties:
    lowest id), replica counts updated as it goes. One moved slot per extra copy, the least any repair
    can move (:func:`colocated_extra_copies`); every other slot keeps its expert and its index. With
    ``num_groups`` (a hierarchical map: every expert group on one node) the expert taken is one of the
    GPU's own node's groups, so the repair splits no group over nodes.

    Args:
        placement: the map in service (``allow_colocated_replicas`` may be set), ``[L, P]``.
        load: ``[L, E]`` the load the re-placement is for (which expert takes a freed slot).
        num_groups: expert groups kept on nodes, or None.

    Returns:
        ``(valid placement, moved int64 [L])`` with ``moved[l]`` slots changed in layer ``l``.
    """
    t = placement.topology
    E, G, S = placement.num_logical_experts, t.ep_size, t.slots_per_gpu
    w = np.asarray(load, dtype=np.float64)
    if w.shape != (placement.num_layers, E):
        raise ValueError(f"load has shape {w.shape}; the placement needs [{placement.num_layers}, {E}]")
    if S > E:
        raise ValueError(
            f"{S} slots per GPU exceed the {E} experts: no map without an expert twice on a GPU exists; "
            f"use at most {E * G - E} redundant experts"
        )
    rows = placement.physical_to_logical_map.copy()  # [L, P]
    moved = np.zeros(placement.num_layers, dtype=np.int64)
    for l, row in enumerate(rows):
        home = _home_nodes(row, E, num_groups, t)  # [E] node of each expert's group, or None
        cnt = np.bincount(row, minlength=E).astype(np.float64)  # [E] replicas
        for g in range(G):
            seg = row[g * S : (g + 1) * S]  # [S] a view: writes go to rows
            for s in range(1, S):
                if seg[s] not in seg[:s]:
                    continue
                barred = np.isin(np.arange(E), seg)  # [E]
                if home is not None and (~barred & (home == g // t.gpus_per_node)).any():
                    barred |= home != g // t.gpus_per_node  # stay inside the node's own groups
                score = np.where(barred, -np.inf, w[l] / cnt)  # [E] per-replica load
                b = int(np.argmax(score))
                cnt[seg[s]] -= 1
                cnt[b] += 1
                seg[s] = b
                moved[l] += 1
    return Placement(rows, E, t, placement.layer_ids, placement.provenance), moved
