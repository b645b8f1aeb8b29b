"""What one serving step asks of each GPU: tokens per physical slot and all-to-all traffic per GPU.

Shapes: S sampled steps, L MoE layers, E logical experts, P physical slots, G EP ranks (GPUs), N nodes,
m = G/N GPUs per node, T' = b x G tokens of one step, k experts per token.

A :class:`Workload` comes either from per-expert loads (:func:`analytic_workload`, an expectation
with independent picks) or from a per-token trace (:func:`trace_workload`, counted token by token);
:mod:`moe_placement.apps.planner.costmodel` turns it into times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from placement.dispatch import EVEN

if TYPE_CHECKING:
    from placement.model import Placement
    from profiling.trace import RoutingTrace

__all__ = ["Workload", "analytic_workload", "trace_workload"]


@dataclass(frozen=True, eq=False)
class Workload:
    """What one step asks of each GPU, per MoE layer (``S`` sampled steps; analytic: ``S = 1``).

    Attributes:
        slot_tokens: float64 ``[S, L, P]`` token-expert pairs per physical slot (expectations or counts).
        nvl_bytes / rdma_bytes: float64 ``[S, L, G]`` payload units per GPU for one all-to-all, the max of
            sent and received (multiply by dispatch or combine bytes per token).
        exact: True when counted from a token trace (then ``slot_tokens`` are integers).
        how: a sentence saying where the numbers come from.
    """

    slot_tokens: np.ndarray
    nvl_units: np.ndarray
    rdma_units: np.ndarray
    slots_per_gpu: int
    exact: bool
    how: str

    def gpu_tokens(self, scale: float = 1.0) -> np.ndarray:
        """``[S, L, G]`` token-expert pairs per GPU (``scale`` = fraction of the batch, 0.5 for a TBO half)."""
        S, L, P = self.slot_tokens.shape
        return self.slot_tokens.reshape(S, L, P // self.slots_per_gpu, self.slots_per_gpu).sum(axis=3) * scale

    def active_experts(self, scale: float = 1.0) -> np.ndarray:
        """``[S, L, G]`` expected slots with at least one token in a batch of ``scale`` x the step.

        Analytic: Poisson, ``1 - exp(-lambda scale)``; counted: each of ``n`` tokens kept with
        probability ``scale``, ``1 - (1 - scale)^n``.
        """
        n = self.slot_tokens
        if self.exact:
            act = 1.0 - np.power(1.0 - min(scale, 1.0), n)
        else:
            act = 1.0 - np.exp(-n * scale)
        S, L, P = n.shape
        return act.reshape(S, L, P // self.slots_per_gpu, self.slots_per_gpu).sum(axis=3)


def _normalized(load: np.ndarray, k: int) -> np.ndarray:
    """Pick probabilities ``[L, E]`` summing to 1 per layer, capped at ``1/k`` (picks are distinct)."""
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


def analytic_workload(
    placement: Placement, load: np.ndarray, top_k: int, step_tokens: int, mode: str
) -> Workload:
    """Expected workload of one step from per-expert loads (picks assumed independent).

    Args:
        placement: :class:`placement.model.Placement` with ``G`` ranks over ``N`` nodes.
        load: ``[L, E]`` relative load per logical expert (any scale; the skew is what matters).
        top_k: ``k``; step_tokens: ``b`` tokens per rank per step; mode: ``normal`` or ``low_latency``.
    """
    from placement.metrics import expected_gpu_load

    t = placement.topology
    G, N, m, k, b = t.ep_size, t.num_nodes, t.gpus_per_node, int(top_k), float(step_tokens)
    p = _normalized(load, k)  # [L, E]
    picks = b * G * k
    cnt = placement.logical_replica_count  # [L, E]
    p2l = placement.physical_to_logical_map  # [L, P]
    slot = np.take_along_axis(p / cnt, p2l, axis=1) * picks  # [L, P] expected pairs per slot
    gpu_pairs = expected_gpu_load(placement, p * picks)  # [L, G]
    pi_g = gpu_pairs / picks  # [L, G] probability that one pick lands on GPU g
    node = t.node_of_gpu
    pi_n = np.zeros((pi_g.shape[0], N))
    np.add.at(pi_n.T, node, pi_g.T)  # [L, N]
    same_node = pi_n[:, node]  # [L, G] mass on the GPU's own node
    if G == 1:
        zero = np.zeros_like(pi_g)
        nvl, rdma = zero, zero
    elif mode == "low_latency":
        # one copy per (token, pick); off-node copies over RDMA, on-node (other GPU) over NVLink
        rdma_send = b * k * (1.0 - same_node)
        nvl_send = b * k * (same_node - pi_g)
        rdma_recv = (G - m) * b * k * pi_g
        nvl_recv = (m - 1) * b * k * pi_g
        nvl, rdma = np.maximum(nvl_send, nvl_recv), np.maximum(rdma_send, rdma_recv)
    elif mode == "normal":
        hit_n = 1.0 - np.power(1.0 - np.clip(pi_n, 0, 1), k)  # [L, N] a token needs node n
        hit_g = 1.0 - np.power(1.0 - np.clip(pi_g, 0, 1), k)  # [L, G] a token needs GPU g
        rdma_send = b * (hit_n.sum(axis=1, keepdims=True) - hit_n[:, node])
        rdma_recv = (G - m) * b * hit_n[:, node] / m  # landing spread over the node's GPUs
        nvl_recv = G * b * hit_g * (m - 1) / m  # forwarded inside the node (1/m lands directly)
        node_mean = np.zeros_like(pi_n)
        np.add.at(node_mean.T, node, nvl_recv.T)
        nvl_send = node_mean[:, node] / m
        nvl, rdma = np.maximum(nvl_send, nvl_recv), np.maximum(rdma_send, rdma_recv)
    else:
        raise ValueError(f"a2a mode must be 'normal' or 'low_latency', got {mode!r}")
    how = f"analytic expectation from per-expert loads ({mode}: independent picks, even replica split)"
    return Workload(slot[None], np.asarray(nvl)[None], np.asarray(rdma)[None], t.slots_per_gpu, False, how)


def trace_workload(
    placement: Placement,
    trace: RoutingTrace,
    step_tokens: int,
    mode: str,
    max_steps: int = 4,
    dispatch: str = EVEN.name,
) -> Workload:
    """Workload counted token by token from a per-token trace.

    Step ``s`` holds ``b x G`` consecutive tokens, token ``t`` of a step on rank ``t // b`` (as
    :func:`placement.metrics.step_par`); replicas are chosen by :func:`placement.metrics.route_tokens`.
    Up to ``max_steps`` steps, evenly spread over the trace.
    """
    from placement.metrics import route_tokens

    if not trace.has_tokens:
        raise ValueError("trace_workload needs a per-token trace (topk_ids); this one has counts only")
    t = placement.topology
    G, P, m = t.ep_size, t.num_physical_experts, t.gpus_per_node
    b = int(step_tokens)
    per_step = b * G
    total = trace.num_tokens // per_step
    if total < 1:
        raise ValueError(
            f"the trace has {trace.num_tokens} tokens, fewer than one step of {b} tokens x {G} ranks = {per_step}; "
            f"use a smaller --step-tokens or a longer trace"
        )
    starts = np.unique(np.linspace(0, total - 1, num=min(max_steps, total)).astype(int)) * per_step
    L = placement.num_layers
    slot_tokens = np.zeros((len(starts), L, P))
    nvl = np.zeros((len(starts), L, G))
    rdma = np.zeros((len(starts), L, G))
    src = np.arange(per_step) // b  # [T'] rank of each token in a step
    for i, s0 in enumerate(starts):
        ids = np.asarray(trace.topk_ids[s0 : s0 + per_step])  # [T', L, k]
        slots = route_tokens(
            placement, ids, src, dispatch, token_index=np.arange(s0, s0 + per_step)
        )  # [T', L, k]
        valid = slots >= 0
        gpu = np.where(valid, t.gpu_of_slot[np.maximum(slots, 0)], -1)  # [T', L, k]
        for l in range(L):
            sl = slots[:, l][valid[:, l]]
            slot_tokens[i, l] = np.bincount(sl, minlength=P)
            rdma[i, l], nvl[i, l] = _layer_traffic(gpu[:, l], valid[:, l], src, G, m, mode)
    how = f"counted from {len(starts)} step(s) of the trace {trace.name!r} via route_tokens ({mode}, dispatch {dispatch})"
    return Workload(slot_tokens, nvl, rdma, t.slots_per_gpu, True, how)


def _layer_traffic(
    g: np.ndarray, v: np.ndarray, src: np.ndarray, G: int, m: int, mode: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(rdma [G], nvl [G])`` units of one layer in one step, the max of sent and received.

    Args:
        g: int ``[T', k]`` GPU of each (token, pick), ``-1`` where unrouted; v: bool ``[T', k]`` routed.
        src: int ``[T']`` rank each token starts on; ``m`` GPUs per node.
    """
    src_node = src // m  # [T']
    n = np.where(v, g // m, -1)  # [T', k] node of each pick
    off_node = v & (n != src_node[:, None])
    on_node = v & (n == src_node[:, None]) & (g != src[:, None])
    if mode == "low_latency":
        rs = np.bincount(src, weights=off_node.sum(axis=1), minlength=G)
        ns = np.bincount(src, weights=on_node.sum(axis=1), minlength=G)
        rr = np.bincount(g[off_node], minlength=G)
        nr = np.bincount(g[on_node], minlength=G)
    else:
        # distinct remote nodes per token (RDMA), distinct GPUs per token (NVLink fan-out)
        key_n, first_n = _first_distinct(np.where(off_node, n, -1))
        rs = np.bincount(src, weights=first_n.sum(axis=1), minlength=G)
        tok_n = np.repeat(np.arange(key_n.shape[0]), key_n.shape[1]).reshape(key_n.shape)
        landing = key_n * m + (src[tok_n] % m)  # lands on the same-index GPU of the remote node
        rr = np.bincount(landing[first_n], minlength=G)
        key_g, first_g = _first_distinct(np.where(v & (g != src[:, None]), g, -1))
        nr = np.bincount(key_g[first_g], minlength=G).astype(float) * (m - 1) / m
        ns = np.full(G, nr.mean())
    return np.maximum(rs, rr), np.maximum(ns, nr)


def _first_distinct(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``key`` int ``[T', k]`` (``-1``: none) sorted per row, and bool ``[T', k]``: the first of each
    distinct non-negative value in its row."""
    key = np.sort(key, axis=1)
    first = (key >= 0) & np.concatenate([np.ones((key.shape[0], 1), bool), key[:, 1:] != key[:, :-1]], axis=1)
    return key, first
