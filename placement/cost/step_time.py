"""Modelled time of the forward steps an engine runs on a trace (numpy only; described in docs/layout.md).

Shapes: S steps, L MoE layers of the trace, E logical experts, P physical slots, G EP ranks (GPUs),
N nodes, m GPUs per node, T tokens, k top-k.

Per MoE layer and step (:func:`moe_layer_seconds`, the array core):

- each GPU's grouped GEMM, :func:`placement.cost.primitives.expert_gemm_time`:
  ``max(6 d f n / (P eta_c), (A W + n act) / (BW eta_m)) + t0`` with ``n`` the GPU's token-expert
  pairs and ``A`` its active experts (a slot with ``x`` tokens counts ``min(x, 1)``: an even split of
  ``n`` tokens over ``c`` replicas activates ``min(n, c)`` of them); the slowest GPU sets the time;
- dispatch and combine, :func:`placement.cost.primitives.a2a_time`: latency plus the busiest GPU's
  sent or received bytes over NVLink and over RDMA (each its own bandwidth). Decode uses the
  low-latency kernels (one copy per token and pick off the GPU); prefill the normal kernels (one RDMA
  copy per token and remote node, landing on the same-index GPU there, then NVLink to each GPU it
  needs; a token's picks are taken as independent for the de-duplication). Combine moves the
  dispatch's bytes back at ``combine_bytes_per_token``.

Per step (:func:`step_time`): the MoE layers (the trace's layers, their mean scaled to the model's
MoE layer count), the per-step dispatch's own cost where the dispatch model splits each step
(``needs_step_counts``: a count all-reduce across the EP group plus ``gpu.split_overhead`` per MoE
layer), and the rest of the step from the model preset (attention reading the KV cache of
``tokens x context_len`` in every layer, shared experts, dense layers, LM head; ``tokens`` the mean
a rank holds in the priced steps, at most ``step_tokens`` when sequences run out). No two-batch
overlap: every part is on the critical path.

The dispatch model decides each step's slot loads (its ``step_load`` from the step's counts, its
expected ``choices`` per source rank, or its token-level ``route``); this module never spells a
model's name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from moe_placement.base.limits import check_context_len, check_whole
from placement.cost.hardware import ClusterSpec, GpuSpec
from placement.cost.modelspec import ModelSpec
from placement.cost.primitives import (
    PHASES,
    a2a_time,
    allreduce_time,
    attention_time,
    expert_gemm_time,
    kernel_of_phase,
    lm_head_time,
    mlp_time,
)

if TYPE_CHECKING:
    from placement.dispatch import DispatchModel
    from placement.model import Placement
    from placement.steps import Steps
    from profiling.trace import RoutingTrace

__all__ = [
    "DEFAULT_CONTEXT_LEN",
    "StepArrays",
    "StepTime",
    "layer_flows",
    "moe_layer_parts",
    "moe_layer_seconds",
    "rest_of_step_seconds",
    "step_time",
    "step_time_from_arrays",
    "traffic_bytes",
]

DEFAULT_CONTEXT_LEN = 4096  # cached tokens per sequence (decode) or prompt length (prefill) by default


@dataclass(frozen=True)
class StepTime:
    """Milliseconds of one whole forward step (all layers), mean over the priced steps.

    ``whole_ms = moe_ms + dispatch_overhead_ms + rest_ms`` and ``moe_ms = gemm_ms + a2a_ms``
    (``a2a_ms``: dispatch plus combine). ``calibrated``: the GPU's GEMM constants were refitted on the
    device (:attr:`placement.cost.hardware.GpuSpec.calibrated`).
    """

    whole_ms: float
    moe_ms: float
    gemm_ms: float
    a2a_ms: float
    dispatch_overhead_ms: float
    rest_ms: float
    phase: str
    dispatch: str
    hardware: str
    calibrated: bool
    num_steps: int
    step_tokens: int = 0
    context_len: int = DEFAULT_CONTEXT_LEN
    model: str = ""

    def to_dict(self) -> dict:
        """The fields above (``evaluate --json`` puts them under ``step_time``)."""
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# Array core
# ---------------------------------------------------------------------------------------------
def moe_layer_parts(
    cluster: ClusterSpec,
    model: ModelSpec,
    gpu_tokens: np.ndarray,
    gpu_active: np.ndarray,
    send_bytes: np.ndarray,
    recv_bytes: np.ndarray,
    kernel: str = "low_latency",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(gemm, dispatch, combine)`` seconds ``[S, L]`` of one MoE layer per step.

    Args:
        gpu_tokens, gpu_active: float ``[S, L, G]`` token-expert pairs and active experts per GPU.
        send_bytes, recv_bytes: float ``[S, L, G, 2]`` the dispatch's bytes per GPU over
            (NVLink, RDMA); the combine sends back what the dispatch received.
        kernel: ``low_latency`` (decode) or ``normal`` (prefill) link figures.
    """
    G = gpu_tokens.shape[-1]
    gemm = expert_gemm_time(cluster.gpu, model, gpu_tokens, gpu_active).max(axis=-1)
    N = max(1, -(-G // cluster.gpus_per_node))
    busiest = np.maximum(send_bytes, recv_bytes)  # [S, L, G, 2]
    disp = a2a_time(cluster, busiest[..., 0], busiest[..., 1], N, G, kernel).max(axis=-1)
    ratio = model.combine_bytes_per_token / model.dispatch_bytes_per_token
    comb = a2a_time(cluster, busiest[..., 0] * ratio, busiest[..., 1] * ratio, N, G, kernel).max(axis=-1)
    return gemm, disp, comb


def moe_layer_seconds(
    gpu: GpuSpec | ClusterSpec,
    model: ModelSpec,
    gpu_tokens: np.ndarray,
    gpu_active: np.ndarray,
    send_bytes: np.ndarray,
    recv_bytes: np.ndarray,
    cluster: ClusterSpec | None = None,
    kernel: str = "low_latency",
) -> np.ndarray:
    """Seconds ``[S, L]`` of one MoE layer per step: GEMM of the slowest GPU + dispatch + combine.

    ``gpu``: the GPU (then ``cluster`` gives the links) or the cluster itself; inputs as
    :func:`moe_layer_parts`.
    """
    if isinstance(gpu, ClusterSpec):
        cluster = gpu
    elif cluster is None:
        raise ValueError("moe_layer_seconds needs a cluster (links) besides the GPU")
    elif cluster.gpu != gpu:
        cluster = replace(cluster, gpu=gpu)
    gemm, disp, comb = moe_layer_parts(cluster, model, gpu_tokens, gpu_active, send_bytes, recv_bytes, kernel)
    return gemm + disp + comb


def _distinct(tokens: np.ndarray, picks: np.ndarray, k: int) -> np.ndarray:
    """Expected tokens that need a destination at least once: ``tokens (1 - (1 - p)^k)`` with
    ``p = picks / (k tokens)`` the chance one pick lands there (picks independent)."""
    p = np.divide(picks, k * tokens, out=np.zeros_like(picks), where=tokens > 0)
    return tokens * (1.0 - np.power(1.0 - np.clip(p, 0.0, 1.0), k))


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
        payload: bytes of one dispatched token.
    """
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


# ---------------------------------------------------------------------------------------------
# From a trace's steps to per-GPU loads
# ---------------------------------------------------------------------------------------------
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


def _gpu_loads(placement: Placement, flows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(gpu_tokens [S, G], gpu_active [S, G], pair_picks [S, G, G])`` from flows ``[S, G, P]``."""
    t = placement.topology
    S, G, P = flows.shape
    slot = flows.sum(axis=1)  # [S, P]
    gpu_tokens = slot.reshape(S, G, t.slots_per_gpu).sum(axis=2)
    gpu_active = np.minimum(slot, 1.0).reshape(S, G, t.slots_per_gpu).sum(axis=2)
    pair = flows.reshape(S, G, G, t.slots_per_gpu).sum(axis=3)  # [S, G_src, G_dst]
    return gpu_tokens, gpu_active, pair


def rest_of_step_seconds(
    model: ModelSpec, cluster: ClusterSpec, step_tokens: float, phase: str, context_len: float
) -> float:
    """The parts of one step the placement does not change: attention in every layer, shared experts
    in the MoE layers, the dense MLP layers and the LM head (seconds, ``step_tokens`` per rank)."""
    b = float(step_tokens)
    attn = attention_time(model, cluster, b, phase, context_len)
    shared = mlp_time(model, cluster.gpu, b, model.shared_intermediate_size)
    dense = mlp_time(model, cluster.gpu, b, model.dense_intermediate_size)
    head = lm_head_time(model, cluster.gpu, b, phase, context_len)
    return model.num_layers * attn + model.num_moe_layers * shared + model.num_dense_layers * dense + head


def dispatch_overhead_seconds(
    model: ModelSpec, cluster: ClusterSpec, ep_size: int, dispatch: DispatchModel
) -> float:
    """Seconds per step a dispatch model that splits every step adds (0 for the others): per MoE layer
    an all-reduce of the ``E`` int32 expert counts across the EP group plus the split's compute."""
    if not dispatch.needs_step_counts:
        return 0.0
    nodes = max(1, -(-ep_size // cluster.gpus_per_node))
    per_layer = allreduce_time(cluster, 4.0 * model.num_logical_experts, nodes, ep_size)
    return model.num_moe_layers * (per_layer + cluster.gpu.split_overhead)


@dataclass(frozen=True)
class StepArrays:
    """Tokens already cut into steps, as :func:`step_time_from_arrays` prices them.

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


def step_time_from_arrays(
    placement: Placement,
    arrays: StepArrays,
    dispatch: DispatchModel | str,
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    context_len: float | None = None,
) -> StepTime:
    """:func:`step_time` on tokens already cut into steps (:class:`StepArrays`).

    Steps: per layer the dispatch's flows -> per-GPU tokens, active experts and bytes -> per-layer
    seconds ``[S, L]`` -> mean step, scaled to the model's MoE layers -> overhead and rest of step.
    """
    from placement.dispatch import get_dispatch

    _check_arrays(placement, arrays, model, cluster)
    topk_ids, step, src, rows = arrays.topk_ids, arrays.step, arrays.src, arrays.rows
    num_steps, step_tokens, phase = arrays.num_steps, arrays.step_tokens, arrays.phase
    disp = get_dispatch(dispatch)
    priced = phase if phase in PHASES else "decode"  # engine batches: the decode kernels
    kernel = kernel_of_phase(priced)
    c = check_context_len(DEFAULT_CONTEXT_LEN if context_len is None else context_len)
    t = placement.topology
    if cluster.gpus_per_node != t.gpus_per_node:  # the placement's topology says how GPUs share nodes
        cluster = replace(cluster, gpus_per_node=t.gpus_per_node)
    S, L, G = int(num_steps), topk_ids.shape[1], t.ep_size
    tokens, active = np.zeros((S, L, G)), np.zeros((S, L, G))
    send, recv = np.zeros((S, L, G, 2)), np.zeros((S, L, G, 2))
    ok = step >= 0
    src_tokens = np.bincount(step[ok] * G + src[ok], minlength=S * G).reshape(S, G).astype(float)
    for l in range(L):
        flows = layer_flows(placement, l, np.asarray(topk_ids[:, l, :]), step, src, S, disp, rows)
        tokens[:, l], active[:, l], pair = _gpu_loads(placement, flows)
        send[:, l], recv[:, l] = traffic_bytes(
            pair, src_tokens, t.gpus_per_node, model.top_k, kernel, model.dispatch_bytes_per_token
        )
    gemm, d, cb = moe_layer_parts(cluster, model, tokens, active, send, recv, kernel)
    scale = model.num_moe_layers  # mean over the trace's layers, times the model's MoE layers
    gemm_s, a2a_s = float(gemm.mean()) * scale, float((d + cb).mean()) * scale
    over = dispatch_overhead_seconds(model, cluster, G, disp)
    held = float(src_tokens.mean())  # tokens per rank per step actually held (sequences can run out)
    rest = rest_of_step_seconds(model, cluster, held if held > 0 else step_tokens, priced, c)
    ms = 1e3
    return StepTime(
        whole_ms=(gemm_s + a2a_s + over + rest) * ms,
        moe_ms=(gemm_s + a2a_s) * ms,
        gemm_ms=gemm_s * ms,
        a2a_ms=a2a_s * ms,
        dispatch_overhead_ms=over * ms,
        rest_ms=rest * ms,
        phase=phase,
        dispatch=disp.name,
        hardware=cluster.gpu.name,
        calibrated=bool(cluster.gpu.calibrated),
        num_steps=S,
        step_tokens=int(step_tokens),
        context_len=int(c),
        model=model.name,
    )


def _check_arrays(placement, arrays, model, cluster) -> None:
    """:func:`step_time_from_arrays`' inputs against each other, before any indexing: a ValueError
    naming the field and the numbers (an IndexError or a reshape error from inside before)."""
    from placement.model import Placement
    from placement.steps import ENGINE

    for name, value, cls in (
        ("placement", placement, Placement),
        ("arrays", arrays, StepArrays),
        ("model", model, ModelSpec),
        ("cluster", cluster, ClusterSpec),
    ):
        if not isinstance(value, cls):
            raise ValueError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
    S = check_whole("StepArrays.num_steps", arrays.num_steps, 1, fix="the steps the arrays hold")
    check_whole("StepArrays.step_tokens", arrays.step_tokens, 1, fix="tokens per rank per step")
    if arrays.phase not in (*PHASES, ENGINE):
        raise ValueError(
            f"StepArrays.phase must be one of {', '.join((*PHASES, ENGINE))}, got {arrays.phase!r}"
        )
    ids = np.asarray(arrays.topk_ids)
    L, E, G = placement.num_layers, placement.num_logical_experts, placement.topology.ep_size
    if ids.dtype.kind not in "iu" or ids.ndim != 3 or ids.shape[1] != L:
        raise ValueError(
            f"StepArrays.topk_ids must be integer [tokens, {L} layers, top_k], got {ids.dtype} {ids.shape}"
        )
    fields = [("topk_ids", ids, -1, E - 1), ("step", arrays.step, -1, S - 1), ("src", arrays.src, 0, G - 1)]
    if arrays.rows is not None:
        fields.append(("rows", arrays.rows, 0, None))
    for name, a, lo, hi in fields:
        a = np.asarray(a)
        if name != "topk_ids" and (a.dtype.kind not in "iu" or a.shape != ids.shape[:1]):
            raise ValueError(
                f"StepArrays.{name} must be {ids.shape[0]} integers (one per token), got {a.dtype} {a.shape}"
            )
        if a.size and (int(a.min()) < lo or (hi is not None and int(a.max()) > hi)):
            raise ValueError(
                f"StepArrays.{name} holds values in [{int(a.min())}, {int(a.max())}], outside {lo}..{'' if hi is None else hi} "
                f"({'the placement' if name != 'step' else 'num_steps'} sets the range)"
            )


def _stepped(steps: Steps, trace: RoutingTrace, ep_size: int):
    """``(ids [N, L, k], step [N], rank [N], row [N])`` of the stepped tokens, checked against the map."""
    if steps.ep_size != ep_size:
        raise ValueError(
            f"the steps were built for {steps.ep_size} ranks, the placement has {ep_size}: "
            f"make_steps(trace, {ep_size}, ...)"
        )
    assert trace.topk_ids is not None
    ids = np.asarray(trace.topk_ids)[steps.token]
    return ids, np.asarray(steps.step), np.asarray(steps.rank), np.asarray(steps.row)


def _check_types(placement, trace, steps, model, cluster, context_len) -> None:
    """A ValueError naming the :func:`step_time` argument of the wrong type (an AttributeError from
    inside before), or a context length that is not a finite number > 0."""
    from placement.model import Placement
    from placement.steps import Steps
    from profiling.trace import RoutingTrace

    for name, value, cls, how in (
        ("placement", placement, Placement, "placement.formats.read_placement"),
        ("trace", trace, RoutingTrace, "profiling.readers.read_trace"),
        ("steps", steps, Steps, "placement.steps.make_steps"),
        ("model", model, ModelSpec, "placement.cost.modelspec.load_model"),
        ("cluster", cluster, ClusterSpec, "placement.cost.hardware.cluster_preset"),
    ):
        if not isinstance(value, cls):
            raise ValueError(f"{name} must be a {cls.__name__} ({how}), got {type(value).__name__}")
    if context_len is not None:
        check_context_len(context_len)  # the bound of the CLI's --context-len


def step_time(
    placement: Placement,
    trace: RoutingTrace,
    steps: Steps,
    dispatch: DispatchModel | str,
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    context_len: float | None = None,
) -> StepTime:
    """Modelled time of the steps ``steps`` of ``trace`` under ``placement`` and ``dispatch``.

    Args:
        placement: the map priced (its topology gives G, N, slots per GPU).
        trace: a per-token trace whose layers match the placement's rows.
        steps: :class:`placement.steps.Steps` from :func:`placement.steps.make_steps` (which tokens form
            each step on which rank, and the phase; ``engine`` steps, the trace's recorded batches, are
            priced with the decode kernels).
        model, cluster: :class:`~placement.cost.modelspec.ModelSpec` and
            :class:`~placement.cost.hardware.ClusterSpec` presets.
        context_len: cached tokens per sequence in decode, prompt length in prefill (default 4096).
    """
    _check_types(placement, trace, steps, model, cluster, context_len)
    if not trace.has_tokens:
        raise ValueError("step_time needs a per-token trace (topk_ids); this trace has counts only")
    if trace.num_logical_experts != placement.num_logical_experts or trace.num_layers != placement.num_layers:
        raise ValueError(
            f"the trace has {trace.num_layers} layers x {trace.num_logical_experts} experts, the placement "
            f"{placement.num_layers} x {placement.num_logical_experts}; select matching layers first"
        )
    if trace.top_k != model.top_k or placement.num_logical_experts != model.num_logical_experts:
        raise ValueError(
            f"model {model.name!r} has {model.num_logical_experts} experts, top-{model.top_k}; the trace has "
            f"{trace.num_logical_experts}, top-{trace.top_k}: pass the model the trace was recorded from"
        )
    from placement.steps import check_steps_of

    check_steps_of(steps, trace)
    ids, step, src, rows = _stepped(steps, trace, placement.topology.ep_size)
    arrays = StepArrays(ids, step, src, steps.num_steps, steps.step_tokens, steps.phase, rows)
    return step_time_from_arrays(placement, arrays, dispatch, model, cluster, context_len=context_len)
