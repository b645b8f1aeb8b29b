"""The plan's assumptions and warnings, in words (every modelled figure says where it comes from)."""

from __future__ import annotations

import numpy as np

from moe_placement.apps.deploy.options import DISAGGREGATED
from moe_placement.apps.planner.costmodel import CostOptions

__all__ = ["assumptions", "warnings"]


def _hardware(ins) -> str:
    from placement.cost.hardware import hardware_summary

    hw = hardware_summary(ins.cluster)
    how = (
        f"measured: {', '.join(hw['measured_parts'])}"
        if hw["measured"]
        else "datasheet figures and published fits, not measured"
    )
    c = ins.cluster
    return f"hardware preset {hw['preset']} ({how}), {c.gpus_per_node} GPUs per node, links {c.intra.name} / {c.inter.name}"


def _handoff(ins, ranked) -> str:
    split = next((r for r in ranked if r.kind == DISAGGREGATED), None)
    if split is None:
        return "hand-off: no prefill/decode split simulated"
    h = split.sim.handoff
    return (
        f"hand-off (placement.cost.handoff): KV bytes = kv_bytes_per_token_layer x {ins.model.num_layers} layers x "
        f"prompt tokens ({ins.model.kv_bytes_per_token_layer:g} B per token and layer) over {h.link} at "
        f"{h.link_bytes_per_s / 1e9:.1f} GB/s per GPU ({h.links} GPU(s) per request in parallel), {h.fixed_s * 1e3:g} ms "
        f"fixed per transfer (ASSUMED), streamed per {h.streaming} behind the prefill (SGLang 0.5.23 sends per "
        "prefill chunk and vLLM 0.33.0's NIXL connector after the prefill: --kv-streaming chunk|none price "
        "those); one transfer at a time per prefill rank; a request waits in its prefill rank (holding its KV) "
        "until its decode rank has room"
    )


def assumptions(ins, planner, ranked, fit_notes: list[str]) -> list[str]:
    """What every figure of the plan assumes."""
    o = ins.options
    out = [
        "every time is modelled (cost model + simulator), none measured; " + _hardware(ins),
        "step times: the one cost model (the layout planner's evaluate_candidate on placement.cost) at each "
        "pool's layout and placement, tabulated over sequences x cached tokens per rank (decode) and chunk "
        "tokens x attention span (prefill) and interpolated; a step mixing prefill and decode costs the "
        "prefill step of all its tokens plus the decode sequences' KV reads",
        f"each pool's placement is priced on the per-expert load ({planner.load_how()}) under the dispatch it "
        "was placed for: the planner's placements under the even split over replicas, the pools fitted on the "
        "trace's steps under the per-step balanced split (its split of the expected step, plus its count "
        "all-reduce and split time per MoE layer)",
        _ranking(ins),
        "attention-DP ranks of one instance step in lockstep at the largest per-rank sizes of the step "
        "(the all-to-all joins them); instances are independent",
        f"admission: first come first served per rank while prompt + output tokens fit the rank's KV budget "
        f"(free HBM after weights, redundant slots and the {_reserve()} reserve) and fewer than "
        f"{o.decode_step_tokens} sequences run; no preemption, no prefix cache; a request larger than a rank's "
        "budget is rejected",
        "chunked prefill: a co-located step spends its tokens per rank on one token per running sequence, the "
        f"rest on prompt chunks (vLLM's token budget; SGLang's mixed chunks); a prefill pool runs chunks of "
        f"{o.prefill_step_tokens} tokens per rank",
        _handoff(ins, ranked),
        _routing(ins),
        f"workload: {ins.workload.describe()}; arrivals Poisson, seeded ({o.seed}) (a recorded request list: "
        f"its pattern scaled to the rate); {ins.requests.n} requests per rate, the same at every rate",
        f"goodput: the highest rate with at least {o.slo_attainment:.0%} of requests meeting both targets, "
        f"bracketed from a capacity estimate, then {o.search_iters} bisection steps in log space; latency "
        "percentiles are at that rate (nothing met: at the lowest rate simulated)",
        "breakdown: one request of the median lengths alone on the deployment (zero load)",
        *fit_notes,
    ]
    return out


def _ranking(ins) -> str:
    """What each pool's layouts are ranked on (the trace's steps, capped, or the per-expert load)."""
    tr, m, cap = ins.trace, ins.model, ins.options.layout_steps
    steps = (
        tr is not None
        and tr.has_tokens
        and tr.num_logical_experts == m.num_logical_experts
        and tr.top_k == m.top_k
    )
    if not steps:
        return "layouts ranked by the one cost model on the expected step of the per-expert load"
    which = (
        "every step" if cap is None else f"the first {cap} steps (layout_steps; layout --trace prices all)"
    )
    return (
        f"layouts ranked by the one cost model on {which} of the trace per layout and phase, where the trace "
        "holds a step of the pool's size; else on the expected step of its per-expert load"
    )


def _routing(ins) -> str:
    """What the routing rule sees in the simulator."""
    from moe_placement.apps.deploy.routes import RuleRoute

    route = ins.route
    if not isinstance(route, RuleRoute):
        return "routing: a given route(request, view) over the ranks of each pool"
    rule = route.rule
    out = (
        f"routing: the {rule.name} rule ({rule.summary}; placement.routing's Router) over the ranks of each "
        "pool (a router across replicas, the engine's DP balancer inside an instance), told each rank's "
        "requests in flight and reserved KV tokens by the simulator before every decision"
    )
    if rule.uses_prefix or rule.uses_affinity:
        out += (
            "; the simulated requests carry no prefix chain and no expert signature, so prefix routes by load "
            "(no cached prefix), affinity by load (no signature) and combined by load and free KV: their "
            "documented fallbacks"
        )
    return out


def _reserve() -> str:
    return f"{CostOptions().reserve_fraction:.0%}"


def warnings(ins, planner, ranked, met: bool) -> list[str]:
    """What the reader must know before trusting the answer."""
    out = []
    if ins.trace is None:
        out.append(
            "no routing trace: the experts' skew is SYNTHETIC (the planner's Zipf load); pass --trace for your "
            "own routing and per-phase placements"
        )
    if ins.requests.clipped:
        out.append(
            f"{ins.requests.clipped} of {ins.requests.n} sampled requests were shortened to the model's context "
            f"({ins.model.max_context_len} tokens)"
        )
    out += planner.notes
    short = [r for r in ranked if r.needed_requests > ins.requests.n]
    if short:
        worst = max(short, key=lambda r: r.needed_requests)
        out.append(
            f"{len(short)} deployment(s) need more requests per rate for a steady state than the {ins.requests.n} "
            f"simulated (up to {worst.needed_requests:,}, {worst.label}): their goodput may be optimistic; raise "
            "max_requests (--max-requests)"
        )
    if not met and ranked:
        out.append(
            f"no deployment meets the targets (TTFT <= {ins.options.ttft_ms:g} ms, TPOT <= {ins.options.tpot_ms:g} ms "
            f"for {ins.options.slo_attainment:.0%}); the closest is {ranked[0].label}; nothing is written but "
            "plan.json and plan.html"
        )
    for r in ranked[:1]:
        if r.goodput.met and r.goodput.bracket and r.goodput.bracket[1] is None:
            out.append(
                f"{r.label}: every rate tried up to {r.goodput.goodput_rps:.4g} req/s met the targets; its goodput is a "
                f"lower bound (the {r.goodput.at.prompt.size} requests simulated per rate may not fill it: raise "
                "max_requests)"
            )
        lost = int((~np.isfinite(r.goodput.zero.first_token)).sum())
        if lost:
            out.append(
                f"{r.label}: {lost} request(s) are larger than a rank's KV budget and are never served"
            )
    if ins.model.max_context_len is None:
        out.append(f"{ins.model.name} states no context length: request lengths are not checked against one")
    return out
