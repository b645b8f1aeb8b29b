"""Modelled step time as the per-step fit's objective (:mod:`solver.step.fit`), from the one cost model.

In decode a GPU's grouped GEMM is memory-bound: it reads the weights of every expert that has at least
one token on it, whatever the token count. A replica that takes a few tokens off a hot GPU but makes a
second GPU read a whole expert can make the step slower, so the fit for a phase scores a layer by the
modelled time of its MoE layer (:func:`placement.cost.step_time.moe_layer_seconds`: the slowest GPU's
GEMM from its tokens and active experts, plus dispatch and combine from the busiest GPU's bytes over
NVLink and RDMA, with the phase's kernels), not by the token peak alone.

A :class:`StepCost` names the model and hardware presets and the phase; :func:`step_cost_for` picks
the model from the trace's shape when none is given (the built-in preset with the trace's experts and
top-k), or returns None (the fit then balances tokens, and says so).

Shapes: N steps, G ranks, E logical experts, R most replicas, P slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from placement.cost.hardware import DEFAULT_HARDWARE, ClusterSpec, cluster_preset
from placement.cost.modelspec import BUILTIN_MODELS, ModelSpec, load_model
from placement.cost.step_time import loads_layer_parts, priced_kernel
from placement.cost.traffic import StepLoads, traffic_bytes
from profiling.trace import RoutingTrace

__all__ = ["DEFAULT_HARDWARE", "StepCost", "layer_seconds", "model_for_trace", "slot_loads", "step_cost_for"]


@dataclass(frozen=True)
class StepCost:
    """What a step is priced with: ``model`` and ``cluster`` presets and the ``phase`` (its kernels;
    ``engine`` batches are priced as decode, as :mod:`placement.cost.step_time` does)."""

    model: ModelSpec
    cluster: ClusterSpec
    phase: str = "decode"

    @property
    def kernel(self) -> str:
        return priced_kernel(self.phase)

    def describe(self) -> str:
        return f"modelled {self.phase} step time ({self.model.name} on {self.cluster.name})"


def model_for_trace(trace: RoutingTrace) -> ModelSpec | None:
    """The built-in model with the trace's experts and top-k (the first by name when several), or None."""
    seen = []
    for name in sorted(set(BUILTIN_MODELS.values())):
        m = load_model(next(k for k, v in BUILTIN_MODELS.items() if v == name))
        if m.num_logical_experts == trace.num_logical_experts and m.top_k == trace.top_k:
            seen.append(m)
    return seen[0] if seen else None


def step_cost_for(
    trace: RoutingTrace,
    phase: str,
    gpus_per_node: int,
    model: str | ModelSpec | None = None,
    hardware: str | ClusterSpec = DEFAULT_HARDWARE,
) -> StepCost | None:
    """The :class:`StepCost` of a fit: ``model`` (a name, path or spec; None: :func:`model_for_trace`)
    on ``hardware`` (a GPU preset name, ``gpus_per_node`` to a node as in the placement's topology,
    or a cluster); None when no model fits the trace's shape.

    Raises ValueError when a given model's experts or top-k differ from the trace's.
    """
    spec = load_model(model) if isinstance(model, str) else model
    if spec is None:
        spec = model_for_trace(trace)
        if spec is None:
            return None
    if spec.num_logical_experts != trace.num_logical_experts or spec.top_k != trace.top_k:
        raise ValueError(
            f"model {spec.name!r} has {spec.num_logical_experts} experts, top-{spec.top_k}; the trace has "
            f"{trace.num_logical_experts}, top-{trace.top_k}: pass the model the trace was recorded from"
        )
    cluster = (
        hardware
        if isinstance(hardware, ClusterSpec)
        else cluster_preset(hardware, gpus_per_node=int(gpus_per_node))
    )
    return StepCost(spec, cluster, phase)


def slot_loads(x: np.ndarray, l2p: np.ndarray, num_slots: int) -> np.ndarray:
    """Tokens per slot ``[N, P]`` from tokens per replica ``x [N, E, R]`` on ``l2p [E, R]`` (-1 padded)."""
    out = np.zeros((x.shape[0], num_slots))
    e_idx, r_idx = np.nonzero(l2p >= 0)
    out[:, l2p[e_idx, r_idx]] = x[:, e_idx, r_idx]
    return out


def layer_seconds(
    cost: StepCost, slot: np.ndarray, rank_counts: np.ndarray, p2l: np.ndarray, slots_per_gpu: int
) -> np.ndarray:
    """Modelled seconds ``[N]`` of one MoE layer in each step.

    Args:
        slot: float ``[N, P]`` tokens per slot (the dispatch's split of each step).
        rank_counts: ``[N, G, E]`` picks each rank sends to each expert; each rank's picks of an
            expert split over its replicas in the expert's proportions.
        p2l: int ``[P]`` expert of each slot.
    """
    N, G, E = rank_counts.shape
    c = np.asarray(rank_counts, dtype=np.float64)
    tot = c.sum(axis=1)[:, p2l]  # [N, P] the expert's picks in the step
    share = np.divide(slot, tot, out=np.zeros_like(slot), where=tot > 0)  # [N, P]
    flows = c[:, :, p2l] * share[:, None, :]  # [N, G, P] rank -> slot
    pair = flows.reshape(N, G, G, slots_per_gpu).sum(axis=3)  # [N, G_src, G_dst]
    held = c.sum(axis=2) / max(cost.model.top_k, 1)  # [N, G] tokens each rank holds (picks / k)
    m = cost.cluster.gpus_per_node
    send, recv = traffic_bytes(pair, held, m, cost.model.top_k, cost.kernel, 1.0)  # tokens per GPU
    loads = StepLoads(
        slot[:, None], send[:, None], recv[:, None], held, slots_per_gpu, m, cost.kernel, False, ""
    )
    gemm, disp, comb = loads_layer_parts(cost.cluster, cost.model, loads)  # [N, 1]
    return (gemm + disp + comb)[:, 0]
