"""Modelled time of the forward steps an engine runs (numpy only; described in docs/layout.md).

Shapes: S steps, L MoE layers of the trace, E logical experts, P physical slots, G EP ranks (GPUs),
N nodes, m GPUs per node, T tokens, k top-k.

What each step asks of each GPU (tokens per slot, all-to-all copies over NVLink and RDMA) comes from
the one traffic model, :mod:`placement.cost.traffic` (:class:`~placement.cost.traffic.StepLoads`).
This module prices it (:func:`price_loads`, the one definition every caller shares: ``evaluate``,
``advise``, the layout planner, the per-step fit):

- per MoE layer and step, each GPU's grouped GEMM (:func:`placement.cost.primitives.expert_gemm_time`,
  ``max(6 d f n / (P eta_c), (A W + n act) / (BW eta_m)) + t0`` with ``n`` the GPU's pairs and ``A``
  its active slots; the slowest GPU sets the time), dispatch and combine
  (:func:`placement.cost.primitives.a2a_time`: the kernel's latency plus the busiest GPU's sent or
  received bytes over NVLink and over RDMA; combine moves the dispatch's tokens back at
  ``combine_bytes_per_token``);
- the all-to-all ``kernel`` is an input: ``low_latency`` or ``normal`` (default by phase, DeepEP's
  choice: decode low-latency, prefill normal; ``engine`` batches as decode);
- two-batch overlap (:class:`StepOptions`): ``off`` (every part on the critical path), ``on`` (two micro-batches of half
  the tokens: a MoE layer takes ``2 max(attention + shared + GEMM, dispatch + combine)`` at the half),
  ``auto`` (the faster of the two on the mean);
- per step, where the dispatch model splits each step (``needs_step_counts``), a count all-reduce
  across the EP group plus ``gpu.split_overhead`` per MoE layer (never hidden by overlap);
- the rest of the step (attention reading the KV cache of ``tokens x context_len`` in every layer,
  shared experts, dense layers, LM head; ``tokens`` the mean a rank holds in the priced steps; the
  dense MLPs and the LM head split over ``attn_tp``).

The MoE layers' mean over the trace's layers is scaled to the model's MoE layer count.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from moe_placement.base.limits import check_context_len, check_whole
from moe_placement.base.options import refuse_unknown_keywords
from placement.cost.hardware import ClusterSpec, GpuSpec
from placement.cost.modelspec import ModelSpec
from placement.cost.primitives import (
    KERNELS,
    a2a_time,
    allreduce_time,
    attention_time,
    expert_gemm_time,
    kernel_of_phase,
    lm_head_time,
    mlp_time,
)
from placement.cost.traffic import StepArrays, StepLoads, counted_loads
from placement.steps import PHASES, priced_phase

if TYPE_CHECKING:
    from placement.dispatch import DispatchModel
    from placement.model import Placement
    from placement.steps import Steps
    from profiling.trace import RoutingTrace

__all__ = [
    "DEFAULT_CONTEXT_LEN",
    "OVERLAPS",
    "LayerBreakdown",
    "StepArrays",
    "StepOptions",
    "StepTime",
    "dispatch_overhead_seconds",
    "loads_layer_parts",
    "moe_layer_parts",
    "moe_layer_seconds",
    "price_breakdown",
    "price_loads",
    "priced_kernel",
    "rest_of_step_seconds",
    "step_loads",
    "step_time",
    "step_time_from_arrays",
]

DEFAULT_CONTEXT_LEN = 4096  # cached tokens per sequence (decode) or prompt length (prefill) by default
OVERLAPS = ("off", "on", "auto")  # two-batch overlap: never, always, when faster


@dataclass(frozen=True)
class StepTime:
    """Milliseconds of one whole forward step (all layers), mean over the priced steps.

    ``whole_ms = moe_ms + dispatch_overhead_ms + rest_ms - overlap_saving_ms`` and
    ``moe_ms = gemm_ms + a2a_ms`` (``a2a_ms``: dispatch plus combine; the parts without overlap;
    ``overlap_saving_ms`` is 0 unless two-batch overlap is used, and may be negative when it is
    forced on where it does not pay). ``hardware``: the GPU preset's name; ``preset``: the cluster's
    (GPU/intra/inter link); ``calibrated``: the GPU's GEMM constants were refitted on the device
    (:attr:`placement.cost.hardware.GpuSpec.calibrated`); ``measured``: the preset carries measured
    figures (:func:`placement.cost.hardware.hardware_summary`). ``held_tokens``: mean tokens a rank
    holds per step.
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
    kernel: str = ""
    two_batch_overlap: bool = False
    overlap_saving_ms: float = 0.0
    attn_tp: int = 1
    held_tokens: float = 0.0
    preset: str = ""
    measured: bool = False

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Tokens a rank holds per step over the step's time."""
        return self.held_tokens / (self.whole_ms * 1e-3) if self.whole_ms > 0 else 0.0

    def to_dict(self) -> dict:
        """The fields above (``evaluate --json`` puts them under ``step_time``), with ``hardware`` as
        ``{preset, measured}`` and the GPU's name under ``gpu``, plus ``tokens_per_s_per_gpu``."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["gpu"] = d.pop("hardware")
        d["hardware"] = {"preset": d.pop("preset"), "measured": d.pop("measured")}
        d["tokens_per_s_per_gpu"] = self.tokens_per_s_per_gpu
        return d


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


def _fit_cluster(cluster: ClusterSpec, gpus_per_node: int) -> ClusterSpec:
    """The cluster with the placement's GPUs per node (the topology says how GPUs share nodes)."""
    return (
        cluster if cluster.gpus_per_node == gpus_per_node else replace(cluster, gpus_per_node=gpus_per_node)
    )


def loads_layer_parts(
    cluster: ClusterSpec, model: ModelSpec, loads: StepLoads, scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(gemm, dispatch, combine)`` seconds ``[S, L]`` of the MoE layers of ``loads`` (with its
    kernel), for ``scale`` of the batch (0.5: one micro-batch of two-batch overlap)."""
    cluster = _fit_cluster(cluster, loads.gpus_per_node)
    payload = model.dispatch_bytes_per_token
    send, recv = loads.send * scale * payload, loads.recv * scale * payload
    tokens, active = loads.gpu_tokens(scale), loads.active_experts(scale)
    return moe_layer_parts(cluster, model, tokens, active, send, recv, loads.kernel)


def rest_of_step_seconds(
    model: ModelSpec,
    cluster: ClusterSpec,
    step_tokens: float,
    phase: str,
    context_len: float,
    attn_tp: int = 1,
) -> float:
    """The parts of one step the placement does not change: attention in every layer, shared experts
    in the MoE layers, the dense MLP layers (split over ``attn_tp``) and the LM head (seconds,
    ``step_tokens`` per rank)."""
    b = float(step_tokens)
    attn = attention_time(model, cluster, b, phase, context_len, attn_tp)
    shared = mlp_time(model, cluster.gpu, b, model.shared_intermediate_size)
    dense = mlp_time(model, cluster.gpu, b, model.dense_intermediate_size, attn_tp)
    head = lm_head_time(model, cluster.gpu, b, phase, context_len, attn_tp)
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


# ---------------------------------------------------------------------------------------------
# Pricing a step's loads: the one definition of a whole step
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerBreakdown:
    """One MoE layer's parts, seconds ``[S, L]`` (attention and shared expert: per layer, scalars).

    ``gemm``, ``dispatch``, ``combine``: at the full batch; ``no_overlap`` their sum with attention
    and the shared expert; ``overlapped``: ``2 max(attention + shared + GEMM, dispatch + combine)``
    at half the batch (None when not priced); ``used``: the one the step takes.
    """

    attention: float
    shared: float
    gemm: np.ndarray
    dispatch: np.ndarray
    combine: np.ndarray
    no_overlap: np.ndarray
    overlapped: np.ndarray | None
    used: np.ndarray
    overlap_used: bool


def priced_kernel(phase: str, kernel: str | None = None) -> str:
    """The all-to-all kernel a step is priced with: ``kernel`` when given (what the launch selects),
    else by phase (DeepEP's choice; ``engine`` batches as decode)."""
    if kernel is not None:
        if kernel not in KERNELS:
            raise ValueError(f"all-to-all kernel must be one of {KERNELS} or None (by phase), got {kernel!r}")
        return kernel
    return kernel_of_phase(priced_phase(phase))


@refuse_unknown_keywords
@dataclass(frozen=True)
class StepOptions:
    """What the launch chooses for its steps, which the price follows.

    Attributes:
        kernel: the all-to-all kernel (``low_latency`` or ``normal``; a command that sets DeepEP's
            low-latency mode for every batch prices prefill with it too); None: by phase
            (:func:`priced_kernel`).
        overlap: two-batch overlap, ``off``, ``on``, ``auto`` (the faster) or a bool.
        attn_tp: attention tensor-parallel size inside an attention-DP group (1: pure attention DP).
    """

    kernel: str | None = None
    overlap: str | bool = "off"
    attn_tp: int = 1

    def __post_init__(self) -> None:
        priced_kernel("decode", self.kernel)
        ov = self.overlap
        if not isinstance(ov, (bool, np.bool_)) and ov not in OVERLAPS:
            raise ValueError(f"two-batch overlap must be one of {OVERLAPS} or a bool, got {ov!r}")
        t = self.attn_tp
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 1:
            raise ValueError(f"attn_tp must be a whole number >= 1, got {t!r}")

    @property
    def overlap_mode(self) -> str:
        """``off``, ``on`` or ``auto`` (a bool read as on/off)."""
        if isinstance(self.overlap, (bool, np.bool_)):
            return "on" if self.overlap else "off"
        return str(self.overlap)


class _Setting(NamedTuple):
    """One pricing's resolved inputs: phase priced, dispatch model, context, tokens per rank, options."""

    phase: str
    dispatch: DispatchModel
    context_len: float
    tokens: float
    step_tokens: int
    options: StepOptions


def _moe_layers(
    model: ModelSpec, cluster: ClusterSpec, loads: StepLoads, s: _Setting, overlapped: bool
) -> LayerBreakdown:
    """The MoE layers' parts at the full batch and, when overlap is not off or ``overlapped`` asks for
    it, at a two-batch half."""
    b, c, t, ov = s.tokens, s.context_len, s.options.attn_tp, s.options.overlap_mode
    attn = attention_time(model, cluster, b, s.phase, c, t)
    shared = mlp_time(model, cluster.gpu, b, model.shared_intermediate_size)
    gemm, disp, comb = loads_layer_parts(cluster, model, loads)
    no = attn + shared + gemm + disp + comb
    tbo = None
    if ov != "off" or overlapped:
        h_attn = attention_time(model, cluster, b / 2, s.phase, c, t)
        h_shared = mlp_time(model, cluster.gpu, b / 2, model.shared_intermediate_size)
        h_gemm, h_disp, h_comb = loads_layer_parts(cluster, model, loads, 0.5)
        tbo = 2.0 * np.maximum(h_attn + h_shared + h_gemm, h_disp + h_comb)
    on = ov == "on" or (ov == "auto" and bool(tbo.mean() < no.mean()))
    return LayerBreakdown(attn, shared, gemm, disp, comb, no, tbo, tbo if on else no, on)


def _setting(loads: StepLoads, phase: str, dispatch, context_len, step_tokens, options) -> _Setting:
    """Check and resolve the pricing inputs (the kernel the options name must be the loads')."""
    from placement.dispatch import EVEN, get_dispatch

    opts = StepOptions() if options is None else options
    if not isinstance(opts, StepOptions):
        raise ValueError(f"options must be a StepOptions, got {type(opts).__name__}")
    if opts.kernel is not None and opts.kernel != loads.kernel:
        raise ValueError(
            f"the loads were counted for the {loads.kernel} kernels, the options price {opts.kernel}"
        )
    c = float(DEFAULT_CONTEXT_LEN if context_len is None else context_len)
    if not c > 0 or loads.num_steps < 1:
        raise ValueError(f"context_len must be > 0 and num_steps >= 1, got {context_len}, {loads.num_steps}")
    held = loads.held_tokens
    b = held if held > 0 else float(step_tokens or 0)
    asked = int(step_tokens if step_tokens is not None else round(b))
    disp = get_dispatch(EVEN if dispatch is None else dispatch)
    return _Setting(priced_phase(phase), disp, c, b, asked, opts)


def _price(
    loads: StepLoads, model: ModelSpec, cluster: ClusterSpec, s: _Setting, overlapped: bool, phase: str
) -> tuple[StepTime, LayerBreakdown]:
    """The whole step (module docstring) and the MoE layers it was summed from."""
    from placement.cost.hardware import hardware_summary

    cluster = _fit_cluster(cluster, loads.gpus_per_node)
    layers = _moe_layers(model, cluster, loads, s, overlapped)
    scale = model.num_moe_layers  # mean over the trace's layers, times the model's MoE layers
    gemm_s = float(layers.gemm.mean()) * scale
    a2a_s = float((layers.dispatch + layers.combine).mean()) * scale
    saving = (
        (float(layers.no_overlap.mean()) - float(layers.used.mean())) * scale if layers.overlap_used else 0.0
    )
    over = dispatch_overhead_seconds(model, cluster, loads.ep_size, s.dispatch)
    rest = rest_of_step_seconds(model, cluster, s.tokens, s.phase, s.context_len, s.options.attn_tp)
    ms, summary = 1e3, hardware_summary(cluster)
    st = StepTime(
        whole_ms=(gemm_s + a2a_s + over + rest - saving) * ms,
        moe_ms=(gemm_s + a2a_s) * ms,
        gemm_ms=gemm_s * ms,
        a2a_ms=a2a_s * ms,
        dispatch_overhead_ms=over * ms,
        rest_ms=rest * ms,
        phase=phase,
        dispatch=s.dispatch.name,
        hardware=cluster.gpu.name,
        calibrated=bool(cluster.gpu.calibrated),
        num_steps=loads.num_steps,
        step_tokens=s.step_tokens,
        context_len=int(s.context_len),
        model=model.name,
        kernel=loads.kernel,
        two_batch_overlap=layers.overlap_used,
        overlap_saving_ms=saving * ms,
        attn_tp=int(s.options.attn_tp),
        held_tokens=s.tokens,
        preset=str(summary["preset"]),
        measured=bool(summary["measured"]),
    )
    return st, layers


def price_loads(
    loads: StepLoads,
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    phase: str,
    dispatch: DispatchModel | str | None = None,
    context_len: float | None = None,
    step_tokens: int | None = None,
    options: StepOptions | None = None,
) -> StepTime:
    """The whole step of ``loads`` (:mod:`placement.cost.traffic`) on ``cluster``: MoE layers (with or
    without two-batch overlap) + the ``dispatch``'s own per-step cost + the rest of the step.

    The loads carry their all-to-all kernel and do not depend on the hardware constants, so one
    :class:`~placement.cost.traffic.StepLoads` is priced on every constant set of
    :func:`placement.cost.ranges.cluster_sets` without recounting.

    Args:
        phase: ``decode``, ``prefill`` or ``engine`` (priced as decode) for attention and the LM head.
        dispatch: the dispatch model (None: ``even``), for its own per-step cost.
        context_len: cached tokens per sequence in decode, prompt length in prefill (default 4096).
        step_tokens: tokens per rank per step as asked (reported; the rest of the step is priced at the
            tokens the ranks hold, this only when they hold none).
        options: :class:`StepOptions` (overlap, attention TP; its kernel, if named, must be the loads').
    """
    s = _setting(loads, phase, dispatch, context_len, step_tokens, options)
    return _price(loads, model, cluster, s, False, phase)[0]


def price_breakdown(
    loads: StepLoads,
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    phase: str,
    dispatch: DispatchModel | str | None = None,
    context_len: float | None = None,
    step_tokens: int | None = None,
    options: StepOptions | None = None,
) -> tuple[StepTime, LayerBreakdown]:
    """:func:`price_loads` and the MoE layers' :class:`LayerBreakdown` it was summed from (with the
    two-batch halves priced even when overlap is off)."""
    s = _setting(loads, phase, dispatch, context_len, step_tokens, options)
    return _price(loads, model, cluster, s, True, phase)


def step_time_from_arrays(
    placement: Placement,
    arrays: StepArrays,
    dispatch: DispatchModel | str,
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    context_len: float | None = None,
    options: StepOptions | None = None,
) -> StepTime:
    """:func:`step_time` on tokens already cut into steps (:class:`StepArrays`): the traffic model's
    :func:`~placement.cost.traffic.counted_loads`, priced by :func:`price_loads`."""
    _check_arrays(placement, arrays, model, cluster)
    kernel = priced_kernel(arrays.phase, options.kernel if options is not None else None)
    loads = counted_loads(placement, arrays, dispatch, model.top_k, kernel)
    return price_loads(
        loads,
        model,
        cluster,
        phase=arrays.phase,
        dispatch=dispatch,
        context_len=context_len,
        step_tokens=arrays.step_tokens,
        options=options,
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
        if value is None and name == "cluster":
            continue
        if not isinstance(value, cls):
            raise ValueError(f"{name} must be a {cls.__name__} ({how}), got {type(value).__name__}")
    if context_len is not None:
        check_context_len(context_len)  # the bound of the CLI's --context-len


def step_loads(
    placement: Placement,
    trace: RoutingTrace,
    steps: Steps,
    dispatch: DispatchModel | str,
    model: ModelSpec,
    cluster: ClusterSpec | None = None,
    *,
    kernel: str | None = None,
    context_len: float | None = None,
) -> StepLoads:
    """The traffic model's loads of ``steps`` (what :func:`step_time` prices), checked as it checks
    them; ``kernel`` None: by the steps' phase (:func:`priced_kernel`)."""
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
    return counted_loads(placement, arrays, dispatch, model.top_k, priced_kernel(steps.phase, kernel))


def step_time(
    placement: Placement,
    trace: RoutingTrace,
    steps: Steps,
    dispatch: DispatchModel | str,
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    context_len: float | None = None,
    options: StepOptions | None = None,
) -> StepTime:
    """Modelled time of the steps ``steps`` of ``trace`` under ``placement`` and ``dispatch``:
    :func:`step_loads` priced by :func:`price_loads`.

    Args:
        placement: the map priced (its topology gives G, N, slots per GPU).
        trace: a per-token trace whose layers match the placement's rows.
        steps: :class:`placement.steps.Steps` from :func:`placement.steps.make_steps` (which tokens form
            each step on which rank, and the phase; ``engine`` steps, the trace's recorded batches, are
            priced with the decode kernels unless the options name a kernel).
        model, cluster: :class:`~placement.cost.modelspec.ModelSpec` and
            :class:`~placement.cost.hardware.ClusterSpec` presets.
        context_len: cached tokens per sequence in decode, prompt length in prefill (default 4096).
        options: :class:`StepOptions`, what the launch chooses: the all-to-all kernel (default by
            phase), two-batch overlap (default off), attention TP (default 1).
    """
    kernel = options.kernel if options is not None else None
    loads = step_loads(
        placement, trace, steps, dispatch, model, cluster, kernel=kernel, context_len=context_len
    )
    return price_loads(
        loads,
        model,
        cluster,
        phase=steps.phase,
        dispatch=dispatch,
        context_len=context_len,
        step_tokens=steps.step_tokens,
        options=options,
    )
