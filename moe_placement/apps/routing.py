"""Request routing on held-out requests: place on the fit part, route the rest with each rule, score.

What ``moe-placement route`` and ``benchmarks/routing.py`` run (:func:`evaluate_routing`):

1. split: the trace's requests (``seq_offsets``) into a fit part (the first ``fit_fraction``) and
   held-out requests;
2. place: the placement given, or :func:`solver.api.solve` on the fit part: ``greedy`` (placing for
   uniform arrival), or ``affinity`` (co-optimized with affinity routing, ``co_optimize``);
3. stream: the held-out requests as a decode workload (:func:`placement.routing.simulate.stream_from_trace`:
   Poisson arrivals, ``step_tokens`` requests in flight per rank), or a sessions workload whose
   conversations take their routing from held-out requests
   (:func:`placement.routing.sessions.stream_from_sessions`);
4. route and score: every rule on the same stream (:func:`~placement.routing.simulate.simulate`,
   :func:`~placement.routing.score.score_run`), and, when the placement is not greedy's, round-robin and
   least-loaded on greedy's placement in the same run (the uniform-arrival baseline);
5. TTFT saved: prefill tokens found in the prefix caches x the modelled prefill time per token of a
   rank (:func:`placement.cost.step_time.step_time` on prefill steps of the held-out trace, the built-in
   model matching the trace (or ``model``) and ``hardware``), per request;
6. with that model: each rule's routed decode steps priced by the one cost model (``decode_step_ms``),
   and TTFT, TPOT and goodput per GPU through the request simulator on the co-located deployment of the
   topology (:mod:`moe_placement.apps.routing_sim`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from moe_placement.apps.deploy.options import DeployOptions
from moe_placement.apps.deploy.workloads import MAX_REQUESTS
from moe_placement.apps.routing_sim import SimInputs, SimTargets, simulate_rules
from moe_placement.base.limits import check_whole
from moe_placement.base.options import refuse_unknown_keywords
from placement.cost.modelspec import ModelSpec
from placement.cost.step_time import step_time
from placement.dispatch import LOCAL, get_dispatch
from placement.model import Placement
from placement.routing import DEFAULT_SIGNATURE_TOKENS, Router, RouterOptions, get_rule, rule_names
from placement.routing.router import DEFAULT_CACHE_TOKENS
from placement.routing.score import StepPricing, score_run
from placement.routing.sessions import stream_from_sessions
from placement.routing.simulate import RequestStream, simulate, stream_from_trace
from placement.steps import DEFAULT_STEP_TOKENS, make_steps
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.api import SOLVERS, solve
from solver.step.cost import DEFAULT_HARDWARE, step_cost_for

__all__ = ["RouteOptions", "RouteReport", "evaluate_routing"]

GREEDY = "greedy"  # the placement for uniform arrival the baselines are scored on
CO_OPTIMIZED = "affinity"  # the solver that places for affinity routing
BASELINE_RULES = ("round-robin", "least-loaded")
PREFILL_CHUNK = (
    256  # tokens per rank per prefill step the TTFT figure prices (placement.steps' prefill default)
)


@refuse_unknown_keywords
@dataclass(frozen=True)
class RouteOptions:
    """What :func:`evaluate_routing` runs.

    Attributes:
        ep_size, num_nodes, num_redundant: the GPUs (attention-DP ranks = EP ranks), nodes and
            redundant expert slots per layer.
        rules: routing rule names (:data:`placement.routing.ROUTING_RULES`).
        co_optimize: place with the ``affinity`` solver (else ``greedy``) when no placement is given.
        fit_fraction: share of the requests placed on; the rest are routed and scored.
        step_tokens: requests in flight per rank the arrivals are sized for (None: the decode default).
        hidden_size: for bytes (None: the built-in model matching the trace, else bytes are not given).
        signature_tokens: tokens of a request whose routing makes its signature (its prompt).
        max_imbalance, cache_tokens, kv_capacity: the router's options (:class:`RouterOptions`).
        dispatch: the dispatch model placed for and scored under.
        hardware: the GPU preset the prefill time is priced on.
        baseline_solvers: solvers placing for uniform arrival whose placements round-robin and
            least-loaded are also scored on (``greedy``; ``locality`` too where it is worth its time).
        seed: seeds the arrivals, the router's ties and the solvers.
        model: the model priced (a built-in name, a model JSON or a ModelSpec; None: the built-in with
            the trace's experts and top-k; with none, no time is priced).
        ttft_ms, tpot_ms, slo_attainment: the request simulator's latency targets (goodput).
        sim_requests: requests per simulation of each rule (0: no request simulation).
    """

    ep_size: int
    num_nodes: int
    num_redundant: int
    rules: tuple[str, ...] = field(default_factory=rule_names)
    co_optimize: bool = False
    fit_fraction: float = 0.5
    step_tokens: int | None = None
    hidden_size: int | None = None
    signature_tokens: int = DEFAULT_SIGNATURE_TOKENS
    max_imbalance: float | None = 0.05
    cache_tokens: int = DEFAULT_CACHE_TOKENS
    kv_capacity: int | None = None
    dispatch: str = LOCAL.name
    hardware: str = DEFAULT_HARDWARE
    baseline_solvers: tuple[str, ...] = (GREEDY,)
    seed: int = 0
    model: str | ModelSpec | None = None
    ttft_ms: float = DeployOptions.ttft_ms
    tpot_ms: float = DeployOptions.tpot_ms
    slo_attainment: float = DeployOptions.slo_attainment
    sim_requests: int = SimTargets.requests

    def __post_init__(self) -> None:
        for r in self.rules:
            get_rule(r)
        if not self.rules:
            raise ValueError(f"name at least one routing rule: {', '.join(rule_names())}")
        f = self.fit_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f < 1.0:
            raise ValueError(f"fit_fraction must be in (0, 1), got {f!r}; e.g. 0.5")
        if self.step_tokens is not None:
            check_whole("step_tokens", self.step_tokens, 1, 1 << 16)
        check_whole("signature_tokens", self.signature_tokens, 1, 1 << 20)
        get_dispatch(self.dispatch)
        for name, hi in (("ttft_ms", 1e9), ("tpot_ms", 1e9), ("slo_attainment", 1.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= hi:
                raise ValueError(f"{name} must be a number in (0, {hi:g}], got {v!r}")
        check_whole("sim_requests", self.sim_requests, 0, MAX_REQUESTS, fix="0 turns the simulation off")


@dataclass(frozen=True)
class RouteReport:
    """The figures of every rule (``rules``: name -> figures; ``route --json`` names them under its
    public key), the baselines on greedy's placement, the placement used and every assumption and warning."""

    rules: dict
    baselines: dict
    placement: dict
    held_out_requests: int
    assumptions: tuple[str, ...]
    warnings: tuple[str, ...]
    solved: Placement | None = None
    simulation: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "policies": self.rules,
            "baselines": self.baselines,
            "placement": self.placement,
            "held_out_requests": self.held_out_requests,
            "simulation": self.simulation,
            "assumptions": list(self.assumptions),
            "warnings": list(self.warnings),
        }


def _split(trace: RoutingTrace, fraction: float) -> tuple[RoutingTrace, RoutingTrace]:
    if not isinstance(trace, RoutingTrace) or not trace.has_tokens or trace.seq_offsets is None:
        raise ValueError(
            "routing needs a per-token trace with request boundaries (topk_ids and seq_offsets); a counts-only "
            "trace can be drawn into one with profiling.mixture.mix_from_counts"
        )
    if trace.seq_offsets.size < 3:
        raise ValueError("the trace holds one request; fitting on some and routing others needs at least 2")
    return trace.split(fraction)


def _placement(fit: RoutingTrace, topo: Topology, o: RouteOptions, given: Placement | None, notes: list):
    """The placement routed on: ``given`` (checked against the trace and topology) or solved on ``fit``."""
    if given is not None:
        if (given.num_layers, given.num_logical_experts) != (fit.num_layers, fit.num_logical_experts):
            raise ValueError(
                f"the placement has {given.num_layers} layers x {given.num_logical_experts} experts but the trace "
                f"{fit.num_layers} x {fit.num_logical_experts}"
            )
        if given.topology != topo:
            raise ValueError(
                f"the placement's topology {given.topology} differs from --ep-size {o.ep_size} --num-nodes "
                f"{o.num_nodes} --num-redundant {o.num_redundant}"
            )
        return given, {"co_optimized": False, "source": "given"}
    name = CO_OPTIMIZED if o.co_optimize else GREEDY
    options = {"dispatch": o.dispatch} if o.co_optimize else None
    placed, report = solve(name, topology=topo, trace=fit, dispatch=o.dispatch, seed=o.seed, options=options)
    notes.extend(f"{name}: {n}" for n in report.notes)
    fell = sum(lr.status == "greedy_fallback" for lr in report.layers)
    info = {"co_optimized": bool(o.co_optimize), "source": f"solver {name}", "status": report.status}
    return placed, {**info, "greedy_layers": int(fell)} if o.co_optimize else info


def _prefill_ms_per_token(
    placement: Placement, held: RoutingTrace, o: RouteOptions, model
) -> tuple[float | None, str]:
    """Modelled milliseconds one rank spends per prompt token in prefill, and what it was priced with."""
    gpn = placement.topology.gpus_per_node
    cost = step_cost_for(held, "prefill", gpn, model=model, hardware=o.hardware)
    if cost is None:
        return None, "no built-in model has the trace's experts and top-k: TTFT saved is not priced"
    b = min(PREFILL_CHUNK, max(1, held.num_tokens // placement.topology.ep_size))
    steps = make_steps(held, placement.topology.ep_size, "prefill", b, max_steps=4)
    st = step_time(placement, held, steps, o.dispatch, cost.model, cost.cluster)
    return (
        st.whole_ms / b,
        f"TTFT saved priced at {st.whole_ms / b:.4f} ms per prompt token: {cost.describe()}, {b}-token chunks per rank (modelled, not measured)",
    )


def _router_options(o: RouteOptions) -> RouterOptions:
    return RouterOptions(
        max_imbalance=o.max_imbalance, kv_capacity=o.kv_capacity, cache_tokens=o.cache_tokens, seed=o.seed
    )


def _run_rules(placement, held, stream, rules, o: RouteOptions, hidden, pricing=None) -> dict:
    out = {}
    for name in rules:
        router = Router(name, o.ep_size, _router_options(o), placement=placement)
        run = simulate(stream, router)
        out[name] = score_run(placement, held, stream, run, o.dispatch, hidden, pricing=pricing)
    return out


def _pricing(trace: RoutingTrace, o: RouteOptions, stream: RequestStream) -> StepPricing | None:
    """The model and cluster the routed steps and the request simulator are priced on (None: no
    built-in model has the trace's experts and top-k, and none was given); the context is the mean
    cached tokens of a held-out request halfway through its decode."""
    cost = step_cost_for(trace, "decode", o.ep_size // o.num_nodes, model=o.model, hardware=o.hardware)
    if cost is None:
        return None
    prompt = np.array([r.prompt_tokens for r in stream.requests], dtype=np.float64)
    ctx = float(prompt.mean() + stream.decode.mean() / 2.0) if prompt.size else 1.0
    return StepPricing(cost.model, cost.cluster, max(1, int(round(ctx))))


def _simulate(placed, scored, bases, held, stream, o: RouteOptions, pricing) -> dict:
    """The request simulator per rule (:func:`moe_placement.apps.routing_sim.simulate_rules`) on the
    placement routed on and on each baseline's; ``{"simulated": False, "why": ...}`` when it cannot run."""
    if pricing is None:
        return {
            "simulated": False,
            "why": "no built-in model has the trace's experts and top-k (give --model)",
        }
    if o.sim_requests == 0:
        return {"simulated": False, "why": "sim_requests is 0"}
    targets = SimTargets(o.ttft_ms, o.tpot_ms, o.slo_attainment, o.sim_requests)
    b = o.step_tokens if o.step_tokens is not None else DEFAULT_STEP_TOKENS["decode"]
    load = held.counts().astype(np.float64)
    x = SimInputs(stream, pricing, load, targets, _router_options(o), b)
    info = simulate_rules(placed, scored, x)
    for _, (pl, rows) in bases.items():
        simulate_rules(pl, rows, x, info.get("rate_rps"))
    return info


def evaluate_routing(
    trace: RoutingTrace,
    options: RouteOptions,
    *,
    placement: Placement | None = None,
    workload: Mapping | None = None,
) -> RouteReport:
    """The steps of the module docstring; ``workload`` a sessions document (checked), else the held-out
    requests themselves are the stream."""
    o = options
    topo = Topology.from_redundant(trace.num_logical_experts, o.num_redundant, o.ep_size, o.num_nodes)
    fit, held = _split(trace, o.fit_fraction)
    notes: list[str] = []
    placed, info = _placement(fit, topo, o, placement, notes)
    stream = _stream(held, o, workload)
    pricing = _pricing(trace, o, stream)
    hidden, hidden_note = _hidden_size(o, pricing)
    scored = _run_rules(placed, held, stream, o.rules, o, hidden, pricing)
    bases = _baselines(fit, held, stream, topo, o, hidden, info["source"], pricing)
    baselines = {k: v for _, rows in bases.values() for k, v in rows.items()}
    sim = _simulate(placed, scored, bases, held, stream, o, pricing)
    for figures in list(scored.values()) + list(baselines.values()):
        for key in ("ttft_ms", "tpot_ms", "goodput_rps_per_gpu", "step_scale"):
            figures.setdefault(key, None)  # not simulated: the keys are there, null
    per_token, ttft_note = _prefill_ms_per_token(placed, held, o, pricing.model if pricing else None)
    Q = stream.num_requests
    for figures in list(scored.values()) + list(baselines.values()):
        saved = figures["prefill_tokens_saved"]
        figures["ttft_saved_ms"] = None if per_token is None else saved * per_token / max(Q, 1)
    assumptions = _assumptions(trace, o, stream, hidden_note, ttft_note) + _sim_notes(sim, pricing) + notes
    warnings = _warnings(scored, stream, o, info) + _sim_warnings({**scored, **baselines}, sim)
    return RouteReport(scored, baselines, info, Q, tuple(assumptions), tuple(warnings), placed, sim)


def _baselines(fit, held, stream, topo: Topology, o: RouteOptions, hidden, skip: str, pricing) -> dict:
    """Round-robin and least-loaded on each baseline solver's placement for uniform arrival (but the
    placement routed on itself): ``{solver: (placement, {"<rule> on <solver>": figures})}``."""
    out = {}
    for name in o.baseline_solvers:
        if skip == f"solver {name}":
            continue
        work = SOLVERS[name].work_per_layer  # a counted budget where the solver has one: reproducible
        opts = {"work_limit": work * fit.num_layers} if work else None
        placed, _ = solve(name, topology=topo, trace=fit, dispatch=o.dispatch, seed=o.seed, options=opts)
        rows = _run_rules(placed, held, stream, BASELINE_RULES, o, hidden, pricing)
        out[name] = (placed, {f"{r} on {name}": v for r, v in rows.items()})
    return out


def _stream(held: RoutingTrace, o: RouteOptions, workload: Mapping | None) -> RequestStream:
    seqs = range(held.seq_offsets.size - 1)  # type: ignore[union-attr]
    if workload is not None:
        return stream_from_sessions(workload, held, seqs, o.signature_tokens)
    b = o.step_tokens if o.step_tokens is not None else DEFAULT_STEP_TOKENS["decode"]
    return stream_from_trace(held, seqs, o.ep_size, b, signature_tokens=o.signature_tokens, seed=o.seed)


def _hidden_size(o: RouteOptions, pricing: StepPricing | None) -> tuple[int | None, str]:
    if o.hidden_size is not None:
        return int(o.hidden_size), f"hidden size {o.hidden_size} (given)"
    if pricing is None:
        return (
            None,
            "no hidden size given and no built-in model matches the trace: bytes are not given (copies are)",
        )
    m = pricing.model
    return m.hidden_size, f"hidden size {m.hidden_size} of the model {m.name!r}"


def _sim_notes(sim: dict, pricing: StepPricing | None) -> list[str]:
    if pricing is None:
        return ["decode_step_ms, ttft_ms, tpot_ms and goodput_rps_per_gpu are not given: " + sim["why"]]
    out = [
        f"decode_step_ms: the one cost model ({pricing.model.name} on {pricing.cluster.name}, modelled, not "
        f"measured) on each rule's routed decode steps, each token dispatched from its rank, "
        f"{pricing.context_len} cached tokens per sequence"
    ]
    if not sim.get("simulated"):
        return out + [f"no request simulation: {sim.get('why', '')}"]
    return out + [
        f"request simulator (moe_placement.apps.routing_sim): the co-located deployment of the topology "
        f"(one instance, attention TP 1, {sim['kv_tokens_per_rank']} KV tokens and at most "
        f"{sim['max_seqs_per_rank']} sequences per rank, {sim['step_tokens']}-token steps), {sim['requests']} "
        "held-out requests drawn cyclically, Poisson arrivals; each rule routes them through the Router fed "
        "the simulated requests in flight and reserved KV per rank (queueing and each rank's batch follow "
        "the rule), and its step table (the one cost model at the placement, uniform arrival, even split) is "
        "scaled so that a decode step of the routed batch costs the rule's decode_step_ms (step_scale: that "
        "price over the table's at the same batch and context; the steps that prefill the short prompts "
        "beside the decode tokens by the same factor); a prefix hit does not shorten the prefill there",
        f"ttft_ms and tpot_ms at {sim['rate_rps']:.4g} requests/s for every rule ({sim['rate_from']}: the same "
        "load for all), the first quarter a warm-up; goodput_rps_per_gpu: the highest rate with "
        f"{sim['targets']['slo_attainment']:.0%} of requests within TTFT {sim['targets']['ttft_ms']:g} ms and TPOT "
        f"{sim['targets']['tpot_ms']:g} ms (searched from the first rule's bracket, one bisection step: rules "
        f"closer than about 10% may tie), {sim['fill']} x the requests a rate holds in flight per simulation",
    ]


def _assumptions(
    trace, o: RouteOptions, stream: RequestStream, hidden_note: str, ttft_note: str
) -> list[str]:
    out = [
        f"dispatch model {o.dispatch}; {o.ep_size} attention-DP ranks = EP ranks on {o.num_nodes} nodes, "
        f"{o.num_redundant} redundant slots per layer",
        f"fit on the first {o.fit_fraction:g} of the requests, routed and scored on the rest (held-out)",
        *stream.notes,
        "remote bytes: node-deduplicated copies of each decoded token per MoE layer of the trace, "
        "dispatch FP8 with scales + combine BF16 per copy",
        f"drift cap {o.max_imbalance} (requests in flight over the mean), prefix cache {o.cache_tokens} tokens per rank",
        hidden_note,
        ttft_note,
    ]
    if trace.metadata.get("synthetic"):
        out.append(f"the trace is synthetic ({trace.metadata.get('generator', 'generated')})")
    return out


def _warnings(scored: dict, stream: RequestStream, o: RouteOptions, info: dict) -> list[str]:
    out = []
    for name, figures in scored.items():
        fb = figures.get("fallbacks", {})
        if fb.get("no cached prefix", 0) >= stream.num_requests:
            out.append(
                f"{name}: no request found a cached prefix (no repeated prefixes): routed by load throughout"
            )
        if fb.get("no signature", 0):
            out.append(f"{name}: {fb['no signature']} request(s) had no signature and were routed by load")
    if stream.num_requests < 3 * o.ep_size:
        out.append(
            f"only {stream.num_requests} held-out requests for {o.ep_size} ranks: the figures are noisy"
        )
    if info.get("greedy_layers"):
        out.append(
            f"{info['greedy_layers']} layer(s) of the co-optimized placement kept greedy's (balance gate)"
        )
    return out


def _sim_warnings(rows: dict, sim: dict) -> list[str]:
    """Goodput figures whose steady state needs more requests than were simulated."""
    if not sim.get("simulated"):
        return []
    short = {
        k: v["goodput_requests_needed"]
        for k, v in rows.items()
        if v.get("goodput_requests_needed", 0) > sim["requests"]
    }
    if not short:
        return []
    worst = max(short, key=short.get)
    return [
        f"{len(short)} rule(s) have no goodput (null): a steady state at the rates they met needs more requests "
        f"than the {sim['requests']} simulated (up to {short[worst]:,}, {worst}); raise --sim-requests or tighten "
        "--ttft-ms"
    ]


def rules_table(report: RouteReport, names: Sequence[str] | None = None) -> list[dict]:
    """One row per rule (and baseline) with each figure and its ratio to round-robin on greedy's
    placement (or on this placement when there are no baselines)."""
    rows = {**report.rules, **report.baselines}
    ref = report.baselines.get("round-robin on greedy") or report.rules.get("round-robin")
    out = []
    for name in names or rows:
        r = dict(rows[name], name=name)
        if ref:
            for k in ("remote_bytes_per_step", "remote_copies_per_step", "busiest_rank_load", "step_par"):
                if r.get(k) is not None and ref.get(k):
                    r[f"{k}_ratio"] = r[k] / ref[k]
        out.append(r)
    return out
