"""The one traffic model: what one step asks of each GPU (token-expert pairs per slot, all-to-all bytes).

Every all-to-all byte the project prices is counted here; the step-time model
(:mod:`placement.cost.step_time`), the layout planner, advise and the per-step fit's objective read it.

Shapes: S steps, L MoE layers, E logical experts, P physical slots, G EP ranks (GPUs), N nodes,
m GPUs per node, T tokens, k top-k.

- :func:`traffic_bytes`: the dispatch's sent and received copies per GPU over (NVLink, RDMA) from the
  picks each GPU sends each GPU. ``low_latency`` (DeepEP's decode kernels): one copy per pick that
  leaves the GPU, off-node ones over RDMA. ``normal`` (DeepEP's prefill kernels, node-deduplicated):
  one RDMA copy per token and remote node it needs, landing on the GPU of that node with the sender's
  index, then NVLink to each GPU there that needs it (a token's picks taken as independent).
- :class:`StepLoads`: per step and MoE layer, tokens per slot and those copies; from a trace's steps
  (:func:`counted_loads`, token by token through the dispatch model) or from per-expert loads
  (:func:`expected_loads`, an expectation with independent picks).
- :func:`payload_bytes`: bytes of one dispatched and one combined token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from placement.cost.primitives import KERNELS

if TYPE_CHECKING:
    from placement.dispatch import DispatchModel
    from placement.model import Placement

__all__ = [
    "StepArrays",
    "StepLoads",
    "counted_loads",
    "expected_loads",
    "flows_from_counts",
    "layer_flows",
    "payload_bytes",
    "pick_probabilities",
    "token_copy_bytes",
    "traffic_bytes",
    "uniform_source_traffic",
]

# Largest [S, G, G] block of picks traffic_bytes is handed at once by expected_loads (64 MiB of float64).
_BLOCK_CELLS = 1 << 23


def payload_bytes(
    hidden_size: float, dispatch_bytes_per_elem: float = 1.0, combine_bytes_per_elem: float = 2.0
) -> tuple[float, float]:
    """``(dispatch, combine)`` bytes of one token: dispatch ``d x bytes + d/128 x 4`` (FP8 with one FP32
    scale per 128 elements by default), combine ``d x bytes`` (BF16 by default)."""
    d = float(hidden_size)
    return d * dispatch_bytes_per_elem + d / 128 * 4, d * combine_bytes_per_elem


def token_copy_bytes(
    hidden_size: int, dispatch_bytes_per_elem: float = 1.0, combine_bytes_per_elem: float = 2.0
) -> float:
    """Bytes one copy of a token costs to a destination and back: dispatch plus combine of
    :func:`payload_bytes` (FP8 with scales out, BF16 back, by default)."""
    disp, comb = payload_bytes(hidden_size, dispatch_bytes_per_elem, combine_bytes_per_elem)
    return disp + comb


@dataclass(frozen=True)
class StepArrays:
    """Tokens already cut into steps, as :func:`counted_loads` counts them.

    Attributes:
        topk_ids: int ``[T, L, k]`` logical ids of the stepped tokens (-1: none).
        step: int64 ``[T]`` each token's step (-1: in no step).
        src: int64 ``[T]`` each token's rank.
        num_steps: ``S``, the number of steps.
        step_tokens: tokens per rank per step.
        phase: ``"decode"``, ``"prefill"`` or ``"engine"`` (recorded batches, priced as decode).
        rows: int64 ``[T]`` each token's row in its rank's batch (a model that needs batch rows), or None.
    """

    topk_ids: np.ndarray
    step: np.ndarray
    src: np.ndarray
    num_steps: int
    step_tokens: int
    phase: str
    rows: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class StepLoads:
    """What each step asks of each GPU in every MoE layer, for one all-to-all kernel.

    Attributes:
        slot_tokens: float64 ``[S, L, P]`` token-expert pairs per physical slot.
        send, recv: float64 ``[S, L, G, 2]`` tokens the dispatch sends and receives per GPU over
            (NVLink, RDMA); times :func:`payload_bytes` they are bytes (the combine moves them back).
        src_tokens: float64 ``[S, G]`` tokens each rank holds in the step.
        slots_per_gpu, gpus_per_node: the placement's shape.
        kernel: ``low_latency`` or ``normal``, the accounting of ``send`` and ``recv``.
        expected: True for an expectation from per-expert loads (an expert with ``x`` expected pairs
            is active with probability ``1 - exp(-x)``); False for counts of a trace's steps (active
            when it has a pair: ``min(x, 1)`` for a fractional split).
        how: a sentence saying where the numbers come from.
    """

    slot_tokens: np.ndarray
    send: np.ndarray
    recv: np.ndarray
    src_tokens: np.ndarray
    slots_per_gpu: int
    gpus_per_node: int
    kernel: str
    expected: bool
    how: str

    @property
    def num_steps(self) -> int:
        return int(self.slot_tokens.shape[0])

    @property
    def ep_size(self) -> int:
        return int(self.src_tokens.shape[1])

    @property
    def held_tokens(self) -> float:
        """Mean tokens a rank holds per step (sequences can run out before a step is full)."""
        return float(self.src_tokens.mean())

    def gpu_tokens(self, scale: float = 1.0) -> np.ndarray:
        """``[S, L, G]`` token-expert pairs per GPU in ``scale`` of the batch (0.5: a two-batch half)."""
        S, L, P = self.slot_tokens.shape
        return self.slot_tokens.reshape(S, L, P // self.slots_per_gpu, self.slots_per_gpu).sum(axis=3) * scale

    def active_experts(self, scale: float = 1.0) -> np.ndarray:
        """``[S, L, G]`` slots with at least one pair in ``scale`` of the batch.

        Expected loads: ``1 - exp(-x scale)`` (Poisson). Counted: each of a slot's ``x`` pairs kept
        with probability ``scale``, ``min(1 - (1 - scale)^x, x scale)`` (``min(x, 1)`` at ``scale`` 1,
        so an even split of ``n`` tokens over ``c`` replicas activates ``min(n, c)`` of them).
        """
        x = self.slot_tokens
        if self.expected:
            act = -np.expm1(-x * scale)
        else:
            act = np.minimum(1.0 - np.power(1.0 - min(scale, 1.0), x), x * scale)
        S, L, P = x.shape
        return act.reshape(S, L, P // self.slots_per_gpu, self.slots_per_gpu).sum(axis=3)


# ---------------------------------------------------------------------------------------------
# Bytes from picks
# ---------------------------------------------------------------------------------------------
def _distinct(tokens: np.ndarray, picks: np.ndarray, k: int) -> np.ndarray:
    """Expected tokens that need a destination at least once: ``tokens (1 - (1 - p)^k)`` with
    ``p = picks / (k tokens)`` the chance one pick lands there (picks independent)."""
    p = np.divide(picks, k * tokens, out=np.zeros_like(picks), where=tokens > 0)
    return tokens * (1.0 - np.power(1.0 - np.clip(p, 0.0, 1.0), k))


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"all-to-all kernel must be one of {KERNELS}, got {kernel!r}")


def traffic_bytes(
    pair_picks: np.ndarray,
    src_tokens: np.ndarray,
    gpus_per_node: int,
    top_k: int,
    kernel: str,
    payload: float,
) -> tuple[np.ndarray, np.ndarray]:
    """The dispatch's ``(send, recv)`` bytes ``[S, G, 2]`` over (NVLink, RDMA).

    Args:
        pair_picks: float ``[S, G, G]`` picks from source GPU (axis 1) to serving GPU (axis 2).
        src_tokens: float ``[S, G]`` tokens each GPU holds in the step.
        kernel: ``low_latency`` (one copy per pick off the GPU) or ``normal`` (node-deduplicated).
        payload: bytes of one dispatched token (1.0: counts of tokens).
    """
    _check_kernel(kernel)
    S, G, _ = pair_picks.shape
    m = gpus_per_node
    node = np.arange(G) // m
    same = node[:, None] == node[None, :]
    off_self = ~np.eye(G, dtype=bool)
    send, recv = np.zeros((S, G, 2)), np.zeros((S, G, 2))
    if kernel == "low_latency":
        nvl = pair_picks * (same & off_self)
        rdma = pair_picks * ~same
        send[..., 0], send[..., 1] = nvl.sum(axis=2), rdma.sum(axis=2)
        recv[..., 0], recv[..., 1] = nvl.sum(axis=1), rdma.sum(axis=1)
        return send * payload, recv * payload
    N = int(node.max()) + 1
    to_node = np.zeros((S, G, N))
    np.add.at(to_node.transpose(2, 0, 1), node, pair_picks.transpose(2, 0, 1))  # [S, G, N]
    need_node = _distinct(src_tokens[:, :, None], to_node, top_k)  # [S, G, N] tokens crossing to n
    remote = node[:, None] != np.arange(N)[None, :]  # [G, N]
    send[..., 1] = (need_node * remote).sum(axis=2)
    # a token for node n lands on the GPU of n with the sender's index in its node
    land = np.arange(N)[None, :] * m + (np.arange(G) % m)[:, None]  # [G, N] landing GPU
    land = np.minimum(land, G - 1)
    np.add.at(recv[..., 1].T, land[remote], (need_node[:, remote]).T)
    need_gpu = _distinct(src_tokens[:, :, None], pair_picks, top_k)  # [S, G, G] tokens for each GPU
    fwd = node[None, :] * m + (np.arange(G) % m)[:, None]  # [G_src, G_dst] GPU that forwards on NVLink
    fwd = np.minimum(fwd, G - 1)
    hop = fwd != np.arange(G)[None, :]  # the token still has an NVLink hop to its GPU
    recv[..., 0] = (need_gpu * hop).sum(axis=1)
    np.add.at(send[..., 0].T, fwd[hop], need_gpu[:, hop].T)
    return send * payload, recv * payload


def uniform_source_traffic(
    picks: np.ndarray, src_tokens: float, gpus_per_node: int, top_k: int, kernel: str
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`traffic_bytes` (in tokens) when every GPU holds ``src_tokens`` tokens and sends each GPU
    the same picks, ``pair[:, g, h] = picks[:, h]`` for every source ``g`` (an even split whatever the
    source): the same accounting in closed form, ``O(G)`` instead of ``O(G^2)`` per layer.

    Args:
        picks: float ``[S, G]`` picks one source sends each GPU.

    Returns:
        ``(send, recv)`` float ``[S, G, 2]`` over (NVLink, RDMA).
    """
    _check_kernel(kernel)
    q = np.asarray(picks, dtype=np.float64)
    S, G = q.shape
    m = gpus_per_node
    N = G // m
    node = np.arange(G) // m
    per_node = q.reshape(S, N, m).sum(axis=2)  # [S, N] picks one source sends each node
    send, recv = np.zeros((S, G, 2)), np.zeros((S, G, 2))
    if kernel == "low_latency":
        send[..., 0] = per_node[:, node] - q  # the own node's other GPUs
        send[..., 1] = per_node.sum(axis=1, keepdims=True) - per_node[:, node]
        recv[..., 0] = (m - 1) * q
        recv[..., 1] = (G - m) * q
        return send, recv
    b = np.full((S, 1), float(src_tokens))
    need_node = _distinct(b, per_node, top_k)  # [S, N] tokens of one source crossing to each node
    need_gpu = _distinct(b, q, top_k)  # [S, G] tokens of one source each GPU needs
    send[..., 1] = need_node.sum(axis=1, keepdims=True) - need_node[:, node]
    recv[..., 1] = (N - 1) * need_node[:, node]  # one source of each remote node lands here
    recv[..., 0] = (G - N) * need_gpu  # every source but the N with this GPU's index forwards
    per_node_gpu = need_gpu.reshape(S, N, m).sum(axis=2)  # [S, N]
    send[..., 0] = N * (per_node_gpu[:, node] - need_gpu)  # forwarded for the N same-index sources
    return send, recv


# ---------------------------------------------------------------------------------------------
# Flows: picks from each source rank to each slot
# ---------------------------------------------------------------------------------------------
def flows_from_counts(
    placement: Placement, layer: int, counts: np.ndarray, dispatch: DispatchModel
) -> np.ndarray:
    """Picks from each source rank to each slot ``[S, G, P]`` from picks per (rank, expert)
    ``counts [S, G, E]``: a per-step split (``step_load``) shares each expert's step total over its
    slots, each rank in the expert's proportions; any other model by its expected ``choices``."""
    G, E, P = placement.topology.ep_size, placement.num_logical_experts, placement.num_physical_experts
    if dispatch.counts_only:  # an even split whatever the source: each slot 1/c of its expert's picks
        p2l = placement.physical_to_logical_map[layer]  # [P]
        cnt = placement.logical_replica_count[layer][p2l]  # [P]
        return counts[:, :, p2l] * (1.0 / cnt)  # as choices' weights 1/c (the same float64 values)
    if dispatch.step_load is not None:
        slot = np.asarray(
            dispatch.step_load(placement, layer, counts.sum(axis=1)), dtype=np.float64
        )  # [S, P]
        p2l = placement.physical_to_logical_map[layer]  # [P]
        tot = counts.sum(axis=1)[:, p2l]  # [S, P]
        share = np.divide(slot, tot, out=np.zeros_like(slot), where=tot > 0)  # [S, P]
        return counts[:, :, p2l] * share[:, None, :]  # each rank's tokens split as the expert's
    from placement.dispatch import rank_choices

    slots, weights = rank_choices(placement, layer, dispatch)  # [G, E, R]
    share = np.zeros((G, E, P))
    gi, ei, ri = np.nonzero(slots >= 0)
    np.add.at(share, (gi, ei, slots[gi, ei, ri]), weights[gi, ei, ri])
    return np.einsum("sge,gep->sgp", counts, share)


def layer_flows(
    placement: Placement,
    layer: int,
    ids: np.ndarray,
    step: np.ndarray,
    src: np.ndarray,
    num_steps: int,
    dispatch: DispatchModel,
    rows: np.ndarray | None = None,
) -> np.ndarray:
    """Token-expert pairs from each source rank to each slot in each step: float64 ``[S, G, P]``.

    Args:
        ids: int ``[T, k]`` logical ids of one layer (-1: none); step: int64 ``[T]`` step of each
            token (-1: in no step); src: int64 ``[T]`` its rank; rows: int64 ``[T]`` its row in the
            rank's batch (for a model that hashes rows).
    """
    G, E, P = placement.topology.ep_size, placement.num_logical_experts, placement.num_physical_experts
    valid = (ids >= 0) & (step >= 0)[:, None]
    tok = np.broadcast_to(np.arange(ids.shape[0])[:, None], ids.shape)[valid]
    key = step[tok] * G + src[tok]  # [n] (step, rank) of each pick
    if dispatch.step_load is None and not dispatch.fractional:
        from placement.dispatch import route_layer

        slots = route_layer(placement, layer, ids, src, dispatch, batch_index=rows)[valid]
        return (
            np.bincount(key * P + slots, minlength=num_steps * G * P).reshape(num_steps, G, P).astype(float)
        )
    e = ids[valid].astype(np.int64)
    counts = np.bincount(key * E + e, minlength=num_steps * G * E).reshape(num_steps, G, E).astype(float)
    return flows_from_counts(placement, layer, counts, dispatch)


def _pairs(flows: np.ndarray, slots_per_gpu: int) -> np.ndarray:
    """Picks from each source GPU to each serving GPU ``[S, G, G]`` from flows ``[S, G, P]``."""
    S, G, P = flows.shape
    return flows.reshape(S, G, G, slots_per_gpu).sum(axis=3)


# ---------------------------------------------------------------------------------------------
# Loads of a step: counted from a trace, or expected from per-expert loads
# ---------------------------------------------------------------------------------------------
def counted_loads(
    placement: Placement, arrays: StepArrays, dispatch: DispatchModel | str, top_k: int, kernel: str
) -> StepLoads:
    """Per-step loads of tokens already cut into steps, counted token by token through ``dispatch``.

    Steps: per layer the dispatch's flows ``[S, G, P]`` -> tokens per slot and picks per GPU pair
    -> :func:`traffic_bytes` in tokens.
    """
    from placement.dispatch import get_dispatch

    _check_kernel(kernel)
    disp = get_dispatch(dispatch)
    t = placement.topology
    step, src = arrays.step, arrays.src
    S, L, G, P = int(arrays.num_steps), arrays.topk_ids.shape[1], t.ep_size, t.num_physical_experts
    slot = np.zeros((S, L, P))
    send, recv = np.zeros((S, L, G, 2)), np.zeros((S, L, G, 2))
    ok = step >= 0
    src_tokens = np.bincount(step[ok] * G + src[ok], minlength=S * G).reshape(S, G).astype(float)
    for l in range(L):
        ids = np.asarray(arrays.topk_ids[:, l, :])
        flows = layer_flows(placement, l, ids, step, src, S, disp, arrays.rows)
        slot[:, l] = flows.sum(axis=1)
        pair = _pairs(flows, t.slots_per_gpu)
        send[:, l], recv[:, l] = traffic_bytes(pair, src_tokens, t.gpus_per_node, top_k, kernel, 1.0)
    how = f"counted from {S} {arrays.phase} step(s) of the trace (dispatch {disp.name}, {kernel} kernels)"
    return StepLoads(slot, send, recv, src_tokens, t.slots_per_gpu, t.gpus_per_node, kernel, False, how)


def pick_probabilities(load: np.ndarray, top_k: int) -> np.ndarray:
    """Pick probabilities ``[L, E]`` from relative loads ``[L, E]``: summing to 1 per layer, capped at
    ``1 / k`` (a token's ``k`` picks are distinct experts), the excess water-filled over the others."""
    k = int(top_k)
    w = np.asarray(load, dtype=np.float64)
    s = w.sum(axis=1, keepdims=True)
    p = np.where(s > 0, w / np.where(s > 0, s, 1), 1.0 / w.shape[1])
    for _ in range(8):  # water-fill the cap
        over = p > 1.0 / k
        if not over.any():
            break
        excess = (p - 1.0 / k).clip(min=0).sum(axis=1, keepdims=True)
        p = np.minimum(p, 1.0 / k)
        free = np.where(p < 1.0 / k, p, 0)
        p = p + excess * free / np.maximum(free.sum(axis=1, keepdims=True), 1e-300)
    return p


def _expected_pairs(placement: Placement, p: np.ndarray, b: float, k: int, kernel: str, disp: DispatchModel):
    """``(slot [1, L, P], send [L, G, 2], recv [L, G, 2])``: every source's expected picks through
    ``disp`` and :func:`traffic_bytes`, layers in blocks of bounded size."""
    t = placement.topology
    L, G, P = placement.num_layers, t.ep_size, t.num_physical_experts
    slot = np.zeros((1, L, P))
    send, recv = np.zeros((L, G, 2)), np.zeros((L, G, 2))
    block = max(1, _BLOCK_CELLS // (G * G))
    for lo in range(0, L, block):  # layers as traffic_bytes' step axis, in bounded blocks
        hi = min(L, lo + block)
        pair = np.zeros((hi - lo, G, G))
        for l in range(lo, hi):
            counts = np.ascontiguousarray(np.broadcast_to(b * k * p[l], (1, G, p.shape[1])))  # [1, G, E]
            flows = flows_from_counts(placement, l, counts, disp)  # [1, G, P]
            slot[0, l] = flows[0].sum(axis=0)
            pair[l - lo] = _pairs(flows, t.slots_per_gpu)[0]
        held = np.full((hi - lo, G), b)
        send[lo:hi], recv[lo:hi] = traffic_bytes(pair, held, t.gpus_per_node, k, kernel, 1.0)
    return slot, send, recv


def expected_loads(
    placement: Placement,
    load: np.ndarray,
    top_k: int,
    step_tokens: float,
    kernel: str,
    dispatch: DispatchModel | str | None = None,
) -> StepLoads:
    """Expected loads of one step (``S = 1``) from per-expert loads: every rank holds ``step_tokens``
    tokens whose ``k`` picks land on expert ``e`` with probability :func:`pick_probabilities`
    (independent picks), split over replicas by ``dispatch`` (None: ``even``); bytes by
    :func:`traffic_bytes`.

    Args:
        load: ``[L, E]`` relative load per logical expert (any scale; the skew is what matters).
    """
    from placement.dispatch import EVEN, get_dispatch

    _check_kernel(kernel)
    disp = get_dispatch(EVEN if dispatch is None else dispatch)
    t = placement.topology
    L, G, k, b = placement.num_layers, t.ep_size, int(top_k), float(step_tokens)
    p = pick_probabilities(load, k)  # [L, E]
    if p.shape != (L, placement.num_logical_experts):
        raise ValueError(f"load must be [{L}, {placement.num_logical_experts}], got {np.shape(load)}")
    if disp.counts_only and G % t.gpus_per_node == 0:  # every source alike: the closed form
        p2l, cnt = placement.physical_to_logical_map, placement.logical_replica_count  # [L, P], [L, E]
        one = np.take_along_axis(b * k * p / cnt, p2l, axis=1)  # [L, P] one source's picks per slot
        q = one.reshape(L, G, t.slots_per_gpu).sum(axis=2)  # [L, G]
        send, recv = uniform_source_traffic(q, b, t.gpus_per_node, k, kernel)
        slot = (G * one)[None]
    else:
        slot, send, recv = _expected_pairs(placement, p, b, k, kernel, disp)
    how = f"expectation from per-expert loads (independent picks, dispatch {disp.name}, {kernel} kernels)"
    return StepLoads(
        slot, send[None], recv[None], np.full((1, G), b), t.slots_per_gpu, t.gpus_per_node, kernel, True, how
    )
