"""Scores of a routed run (:class:`placement.routing.simulate.RoutedRun`) under a placement.

Shapes: N decoded tokens, L layers, k top-k, G ranks, S steps.

Measured on the steady-state steps (:func:`steady_window`): from the first step at which the requests
in flight reach 90% of their mean over the second half of the arrivals, to the last arrival of a
request that follows none (the warm-up and the drain, when ranks empty out, are left out). The
token-level figures score at most ``max_tokens`` decoded tokens: every ``j``-th step of the window
(whole steps, evenly spaced) when it holds more. The figures (names in docs/metrics.md):

- ``remote_bytes_per_step``: bytes that cross between nodes per decode step, over the trace's MoE
  layers: every (token, layer) sends one copy to each other node holding one of its picks
  (node-deduplicated dispatch; the picks' replicas chosen by the dispatch model,
  :func:`placement.metrics.route_tokens`), and one copy costs :func:`placement.cost.traffic.token_copy_bytes`
  (dispatch in FP8 with scales and combine in BF16 of ``hidden_size`` elements). Without a hidden size
  only ``remote_copies_per_step`` is given.
- ``remote_fraction``: the share of the picks served on another node than the token's.
- ``remote_nodes_per_token``: as :func:`placement.metrics.communication`.
- ``step_par``: the per-step PAR of the decoded steps with their tokens on the ranks the rule chose
  (:func:`placement.metrics.step_par` on the recorded steps).
- ``busiest_rank_load``: mean over steps of the busiest rank's decoded tokens over the serving ranks'
  mean (attention data parallelism waits for its busiest rank every step).
- ``hit_rate``: prompt tokens found in the chosen rank's prefix cache over all prompt tokens, every
  request of the run; ``prefill_tokens_saved``: their sum.
- ``decode_step_ms`` (with a :class:`StepPricing`): the one cost model's whole decode step
  (:func:`placement.cost.step_time.step_time_from_arrays`) of the scored steps, each token dispatched
  from the rank the rule chose: the busiest GPU's grouped GEMM and its NVLink and RDMA bytes follow the
  routing; None without a pricing.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from placement.cost.hardware import ClusterSpec
from placement.cost.modelspec import ModelSpec
from placement.cost.step_time import StepArrays, step_time_from_arrays
from placement.cost.traffic import token_copy_bytes
from placement.dispatch import DispatchModel, get_dispatch
from placement.metrics import communication, route_tokens, step_par
from placement.model import Placement
from placement.routing.simulate import RequestStream, RoutedRun
from profiling.trace import RoutingTrace

__all__ = ["StepPricing", "score_run", "steady_window"]


class StepPricing(NamedTuple):
    """What the scored decode steps are priced with: the model and cluster presets, and the cached
    tokens per sequence the attention reads."""

    model: ModelSpec
    cluster: ClusterSpec
    context_len: float


def steady_window(run: RoutedRun) -> tuple[int, int]:
    """``[lo, hi)`` steps measured: warm (90% of the second half's mean in flight) up to the last arrival."""
    S = run.num_steps
    hi = min(max(run.last_arrival + 1, 1), S)
    active = run.per_rank.sum(axis=1)[:hi] if S else np.zeros(0)
    if active.size < 2:
        return 0, hi
    target = 0.9 * float(active[active.size // 2 :].mean())
    lo = int(np.argmax(active >= target)) if (active >= target).any() else 0
    return lo, hi


DEFAULT_SCORE_TOKENS = 1 << 15  # decoded tokens the token-level figures score at most


def _routed_trace(
    trace: RoutingTrace, run: RoutedRun, lo: int, hi: int, max_tokens: int
) -> tuple[RoutingTrace, np.ndarray, int]:
    """The decoded tokens of every ``j``-th step of ``[lo, hi)`` (at most about ``max_tokens``) as a
    trace stepped by those steps, their ranks ``[N]``, and the number of steps kept."""
    inside = (run.step >= lo) & (run.step < hi)
    j = max(1, -(-int(inside.sum()) // int(max_tokens)))
    keep = inside & ((run.step - lo) % j == 0)
    tok, step, rank = run.token[keep], run.step[keep], run.rank[keep]
    assert trace.topk_ids is not None
    counts = np.bincount(step - lo, minlength=hi - lo)
    offsets = np.concatenate([[0], np.cumsum(counts[counts > 0])])
    routed = RoutingTrace(
        num_logical_experts=trace.num_logical_experts,
        topk_ids=trace.topk_ids[tok],
        layer_ids=trace.layer_ids,
        source_rank=rank,
        step_offsets=offsets,
        name=f"{trace.name}-routed",
    )
    return routed, rank, len(range(0, hi - lo, j))


def _remote(placement: Placement, routed: RoutingTrace, src: np.ndarray, model: DispatchModel) -> dict:
    """Remote node copies in all (token, layer) pairs and the remote share of the picks."""
    comm = communication(placement, routed, model, src=src)
    assert routed.topk_ids is not None
    has = (routed.topk_ids >= 0).any(axis=2).sum(axis=0)  # [L] tokens with a pick per layer
    copies = float(np.dot(comm["remote_nodes_per_layer"], has))
    slots = route_tokens(placement, routed.topk_ids, src, model)  # [N, L, k]
    t = placement.topology
    ok = slots >= 0
    node = t.node_of_slot[np.maximum(slots, 0)]
    remote = ok & (node != (src // t.gpus_per_node)[:, None, None])
    return {
        "remote_nodes_per_token": comm["remote_nodes_per_token"],
        "copies": copies,
        "remote_fraction": float(remote.sum() / max(int(ok.sum()), 1)),
    }


def score_run(
    placement: Placement,
    trace: RoutingTrace,
    stream: RequestStream,
    run: RoutedRun,
    dispatch: str | DispatchModel,
    hidden_size: int | None = None,
    max_tokens: int = DEFAULT_SCORE_TOKENS,
    pricing: StepPricing | None = None,
) -> dict:
    """The routing figures of ``run`` (module docstring) as a dict; ``None`` where a figure needs what
    is missing (bytes without a hidden size, the step time without a pricing)."""
    model = get_dispatch(dispatch)
    lo, hi = steady_window(run)
    routed, src, S = _routed_trace(trace, run, lo, hi, max_tokens)
    if routed.num_tokens == 0:
        raise ValueError("no decode step was measured: the stream has no decode tokens to score")
    rem = _remote(placement, routed, src, model)
    sp = step_par(placement, routed, dispatch=model, phase="engine")
    per = run.per_rank[lo:hi].astype(np.float64)  # [steps, G] every step of the window
    mean = per.mean(axis=1)
    busiest = float(np.mean(np.where(mean > 0, per.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)))
    prompt = np.array([r.prompt_tokens for r in stream.requests], dtype=np.int64)
    copies = rem["copies"] / S
    return {
        "remote_bytes_per_step": None if hidden_size is None else copies * token_copy_bytes(hidden_size),
        "remote_copies_per_step": copies,
        "remote_fraction": rem["remote_fraction"],
        "remote_nodes_per_token": rem["remote_nodes_per_token"],
        "step_par": sp["step_par"],
        "busiest_rank_load": busiest,
        "hit_rate": float(run.hit.sum() / max(int(prompt.sum()), 1)),
        "prefill_tokens_saved": int(run.hit.sum()),
        "decoded_tokens_per_step": float(routed.num_tokens / S),
        "measured_steps": [int(lo), int(hi)],
        "scored_steps": int(S),
        "fallbacks": dict(run.fallbacks),
        "decode_step_ms": None if pricing is None else _step_ms(placement, routed, src, model, pricing),
    }


def _step_ms(
    placement: Placement, routed: RoutingTrace, src, model: DispatchModel, pricing: StepPricing
) -> float:
    """The one cost model's mean whole step of ``routed``'s steps (tokens on their ranks ``src [N]``)."""
    assert routed.step_offsets is not None and routed.topk_ids is not None
    per = np.diff(routed.step_offsets)  # [S'] tokens of each kept step (none is empty)
    S = per.size
    step = np.repeat(np.arange(S, dtype=np.int64), per)
    b = max(1, int(round(routed.num_tokens / (S * placement.topology.ep_size))))
    arrays = StepArrays(np.asarray(routed.topk_ids), step, np.asarray(src, dtype=np.int64), S, b, "decode")
    st = step_time_from_arrays(
        placement, arrays, model, pricing.model, pricing.cluster, context_len=max(1.0, pricing.context_len)
    )
    return float(st.whole_ms)
