"""``plan(...)``: the deployment of an MoE model on a cluster for a workload and latency targets.

Steps: inputs (model, cluster, trace, workload -> seeded requests) -> the model fits the cluster ->
deployments (:mod:`moe_placement.apps.deploy.candidates`: co-located, replicas, prefill/decode splits,
each pool's layout from the one layout planner) -> per deployment: step-time tables
(:mod:`moe_placement.apps.deploy.tables`), the zero-load breakdown and the goodput search
(:mod:`moe_placement.apps.deploy.goodput` over :mod:`moe_placement.apps.deploy.simulator`) -> the best
split re-placed per phase on the trace's steps (when the trace routes the model's experts) -> rank and
explain (:mod:`moe_placement.apps.deploy.decision`) -> launch commands
(:mod:`moe_placement.apps.deploy.launch`).

:class:`DeploymentPlan` ``.to_dict()`` is the ``moe-placement plan --json`` contract (docs/cli.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from moe_placement.apps.deploy.candidates import Candidate, Planner, fit_phase_placements
from moe_placement.apps.deploy.decision import RuleOfThumb, explain, rank, rule_of_thumb
from moe_placement.apps.deploy.goodput import Goodput, Sampling, at_rate, percentiles_ms, search_goodput
from moe_placement.apps.deploy.launch import launch_commands, placement_name
from moe_placement.apps.deploy.options import DISAGGREGATED, DeployOptions
from moe_placement.apps.deploy.routes import rule_route
from moe_placement.apps.deploy.simulator import (
    PHASE_BOTH,
    DeploymentSim,
    PoolSim,
    Route,
    ZeroLoad,
    zero_load,
)
from moe_placement.apps.deploy.tables import StepTable, build_table, kv_tokens_per_rank
from moe_placement.apps.deploy.workloads import (
    BUILTIN_WORKLOADS,
    MAX_REQUESTS,
    Requests,
    WorkloadSpec,
    load_workload,
    sample_requests,
    trace_workload,
    with_fixed_lengths,
)
from moe_placement.apps.planner.costmodel import CostOptions
from placement.cost.handoff import HandoffSpec
from placement.cost.hardware import ClusterSpec, cluster_preset, hardware_summary
from placement.cost.modelspec import ModelSpec, load_model

__all__ = ["MAX_PLAN_GPUS", "DeploymentPlan", "DeploymentResult", "capacity_estimate", "inflight", "plan"]

log = logging.getLogger(__name__)

MAX_PLAN_GPUS = 2048  # GPUs of one plan (every pool size is planned and costed)


@dataclass(frozen=True, eq=False)
class DeploymentResult:
    """One simulated deployment: its pools, the simulated model of it, the goodput search, the
    zero-load breakdown, the placement file each pool's placement is written to (None: not written),
    whether its goodput is from the refined search (else the coarse one) and how many requests a steady
    state at the reported rate asks for (:class:`~moe_placement.apps.deploy.goodput.Sampling`)."""

    candidate: Candidate
    sim: DeploymentSim
    goodput: Goodput
    breakdown: ZeroLoad
    placement_files: tuple[str | None, ...] = ()
    refined: bool = True
    needed_requests: int = 0

    @property
    def kind(self) -> str:
        return self.candidate.kind

    @property
    def label(self) -> str:
        return self.candidate.label

    @property
    def gpus(self) -> int:
        return self.candidate.gpus

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput.goodput_rps / self.gpus

    def percentiles(self) -> tuple[dict, dict]:
        """``(TTFT, TPOT)`` ms percentiles at the reported rate."""
        with np.errstate(invalid="ignore"):
            return percentiles_ms(self.goodput.at.ttft), percentiles_ms(self.goodput.at.tpot)

    def time_split_ms(self) -> dict[str, float | None]:
        """Mean ms per served request at the reported rate: queueing before the first step, prefill,
        hand-off (and waiting for decode room), decode."""
        r = self.goodput.at
        ok = np.isfinite(r.finish)
        if not ok.any():
            return {"queue": None, "prefill": None, "handoff": None, "decode": None}
        a, s, p, f, e = (x[ok] for x in (r.arrival, r.start, r.prefill_end, r.first_token, r.finish))
        parts = {"queue": s - a, "prefill": p - s, "handoff": f - p, "decode": e - f}
        return {k: round(float(v.mean()) * 1e3, 4) for k, v in parts.items()}

    def to_dict(self, E: int) -> dict:
        ttft, tpot = self.percentiles()
        b, h, at = self.breakdown, self.sim.handoff, self.goodput.at
        rps, tps = at.throughput()
        return {
            "kind": self.kind,
            "label": self.label,
            "gpus": self.gpus,
            "pools": [
                _pool_dict(p, s, f, E) for p, s, f in zip(self.candidate.pools, self.sim.pools, self._files())
            ],
            "goodput_rps_per_gpu": round(self.goodput_per_gpu, 6),
            "goodput_rps": round(self.goodput.goodput_rps, 6),
            "met_targets": self.goodput.met,
            "search": "refined" if self.refined else "coarse",
            "rate_rps": at.rate,
            "requests_simulated": int(at.prompt.size),
            "requests_needed": self.needed_requests,
            "ttft_ms": ttft,
            "tpot_ms": tpot,
            "throughput": {"requests_per_s": round(rps, 6), "output_tokens_per_s": round(tps, 3)},
            "breakdown": {
                "prefill_ms": round(b.prefill_s * 1e3, 6),
                "decode_step_ms": round(b.decode_step_s * 1e3, 6),
                "handoff_ms": round(b.handoff_s * 1e3, 6),
                "handoff_bytes_per_request": round(b.handoff_bytes),
            },
            "handoff": _handoff_dict(h),
            "time_split_ms": self.time_split_ms(),
            "curve": [p.to_dict() for p in self.goodput.curve],
        }

    def _files(self) -> tuple[str | None, ...]:
        return self.placement_files or tuple(None for _ in self.candidate.pools)


def _handoff_dict(h: HandoffSpec | None) -> dict | None:
    if h is None:
        return None
    return {
        "link": h.link,
        "link_bytes_per_s": h.link_bytes_per_s,
        "links": h.links,
        "fixed_ms": h.fixed_s * 1e3,
        "streaming": h.streaming,
    }


def _pool_dict(pool, sim: PoolSim, file: str | None, E: int) -> dict:
    c, m = pool.result.candidate, pool.result.memory
    return {
        "phase": pool.phase,
        "gpus": pool.gpus,
        "nodes": pool.nodes,
        "layout": pool.layout(E),
        "placement_file": file,
        "instances": c.instances,
        "ep_size": c.ep_size,
        "attn_dp": c.attn_dp,
        "attn_tp": c.attn_tp,
        "num_redundant": c.num_redundant,
        "step_tokens": sim.step_tokens,
        "max_seqs_per_rank": sim.max_seqs,
        "kv_tokens_per_rank": sim.kv_tokens,
        "memory_gb": {
            "weights": round((m.non_expert + m.expert) / 1e9, 3),
            "redundant": round(m.redundant / 1e9, 3),
            "kv_free": round(m.kv_free / 1e9, 3),
        },
        "placement": pool.placed,
        "dispatch": pool.dispatch,
    }


@dataclass(frozen=True, eq=False)
class DeploymentPlan:
    """The ranked deployments and the decision (``to_dict()``: the ``--json`` contract)."""

    model: ModelSpec
    cluster: ClusterSpec
    nodes: int
    workload: WorkloadSpec
    options: DeployOptions
    requests: Requests
    results: tuple[DeploymentResult, ...]
    best: DeploymentResult | None
    reason: str
    rule: RuleOfThumb
    assumptions: tuple[str, ...]
    warnings: tuple[str, ...]
    launch: dict | None = None

    @property
    def closest(self) -> DeploymentResult | None:
        return None if self.best is not None or not self.results else self.results[0]

    def median_lengths(self) -> tuple[int, int]:
        return int(np.median(self.requests.prompt)), int(np.median(self.requests.output))

    def to_dict(self) -> dict:
        E = self.model.num_logical_experts
        o, cl = self.options, self.cluster
        p, q = self.median_lengths()
        return {
            "model": self.model.name,
            "cluster": {
                "nodes": self.nodes,
                "gpus_per_node": cl.gpus_per_node,
                "gpus": self.nodes * cl.gpus_per_node,
                "gpu": cl.gpu.name,
                "intra_link": cl.intra.name,
                "inter_link": cl.inter.name,
            },
            "hardware": hardware_summary(cl),
            "workload": {
                "name": self.workload.name,
                "source": self.workload.source,
                "median_prompt": p,
                "median_output": q,
                "sampled_requests": self.requests.n,
                "clipped_to_context": self.requests.clipped,
            },
            "targets": {"ttft_ms": o.ttft_ms, "tpot_ms": o.tpot_ms, "slo_attainment": o.slo_attainment},
            "deployments": [r.to_dict(E) for r in self.results],
            "best": None if self.best is None else self.best.label,
            "closest": None if self.closest is None else self.closest.label,
            "reason": self.reason,
            "rule_of_thumb": self.rule.to_dict(),
            "launch": self.launch,
            "assumptions": list(self.assumptions),
            "warnings": list(self.warnings),
        }


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class _Inputs:
    model: ModelSpec
    cluster: ClusterSpec
    nodes: int
    trace: object
    workload: WorkloadSpec
    requests: Requests
    options: DeployOptions
    route: Route


def _inputs(model, cluster, nodes, workload, trace, options: DeployOptions, route) -> _Inputs:
    """Resolve names and paths, check sizes, sample the requests."""
    from profiling.readers import read_trace

    m = model if isinstance(model, ModelSpec) else load_model(model)
    cl = cluster if isinstance(cluster, ClusterSpec) else cluster_preset(str(cluster))
    if isinstance(nodes, bool) or not isinstance(nodes, (int, np.integer)) or nodes < 1:
        raise ValueError(f"nodes must be a whole number >= 1, got {nodes!r}")
    if nodes * cl.gpus_per_node > MAX_PLAN_GPUS:
        raise ValueError(
            f"{nodes} nodes x {cl.gpus_per_node} GPUs = {nodes * cl.gpus_per_node} GPUs, over the "
            f"{MAX_PLAN_GPUS} one plan may span (MAX_PLAN_GPUS); plan a part of the cluster"
        )
    tr = read_trace(str(trace)) if isinstance(trace, (str, Path)) else trace
    spec = _workload(workload, tr)
    spec = with_fixed_lengths(spec, options.prompt_len, options.output_len)
    reqs = sample_requests(spec, options.max_requests, options.seed, m.max_context_len)
    if route is None:
        route = rule_route(options.route)
    elif not callable(route):
        raise ValueError(f"route must be a callable route(request, view) -> rank, got {route!r}")
    return _Inputs(m, cl, int(nodes), tr, spec, reqs, options, route)


def _workload(workload, trace) -> WorkloadSpec:
    """``workload`` (a name, a JSON path or a spec); None: the trace's prompts when it has them, else chat."""
    if workload is not None:
        return load_workload(workload)
    if trace is not None and getattr(trace, "seq_offsets", None) is not None:
        return trace_workload(trace)
    return BUILTIN_WORKLOADS["chat"]


def _check_fits(planner: Planner, ins: _Inputs) -> None:
    """ValueError when one instance over the whole cluster cannot hold the model's weights."""
    total = ins.nodes * ins.cluster.gpus_per_node
    if planner.ranked(PHASE_BOTH, ins.nodes, total):
        return
    from moe_placement.apps.planner.layout import plan_layout

    opts = CostOptions(phase="decode", step_tokens=1, context_len=1)
    lp = plan_layout(ins.model, ins.cluster, ins.nodes, opts, plan=planner.search)
    full = [r for r in lp.results if r.candidate.ep_size == total] or list(lp.results)
    why = full[0].reason if full else "no layout"
    raise ValueError(
        f"the cluster ({ins.nodes} x {ins.cluster.gpus_per_node} {ins.cluster.gpu.name}) is too small to hold "
        f"{ins.model.name}: {why}; use more nodes or GPUs with more memory"
    )


# ---------------------------------------------------------------------------------------------
# simulating one deployment
# ---------------------------------------------------------------------------------------------
class _Tables:
    """Step-time tables per pool layout (a layout's table serves every chunk size up to its grid)."""

    def __init__(self, ins: _Inputs, planner: Planner):
        self.ins, self.planner, self.done = ins, planner, {}
        self.longest = int(ins.requests.prompt.max())

    def __call__(self, pool) -> StepTable:
        o = self.ins.options
        chunk = max(o.colocated_step_tokens) if pool.phase == PHASE_BOTH else pool.step_tokens
        if pool.phase == "decode":
            chunk = 1
        key = (id(pool.result), pool.phase, chunk, pool.cluster.gpus_per_node, pool.dispatch)
        if key not in self.done:
            shape = (o.decode_step_tokens, chunk, self.longest)
            base = CostOptions(dispatch=pool.dispatch)  # priced under the split it was placed for
            table = build_table(self.ins.model, pool.cluster, pool.result, self.planner.load(), shape, base)
            self.done[key] = (pool.result, table)  # the result is kept: its id stays unique
        return self.done[key][1]


def _deployment_sim(ins: _Inputs, cand: Candidate, tables: _Tables) -> DeploymentSim:
    m, o = ins.model, ins.options
    pools = []
    for p in cand.pools:
        c = p.result.candidate
        kv = kv_tokens_per_rank(m, p.result)
        pools.append(
            PoolSim(
                p.phase,
                c.instances,
                c.attn_dp,
                kv,
                p.step_tokens,
                o.decode_step_tokens,
                tables(p),
                p.result.placement,
                c.attn_tp,
            )
        )
    if cand.kind != DISAGGREGATED:
        return DeploymentSim(tuple(pools))
    link = ins.cluster.inter if ins.nodes > 1 else ins.cluster.intra
    spec = HandoffSpec.from_link(
        link, cand.pools[0].result.candidate.attn_tp, o.kv_streaming, o.handoff_fixed_s
    )
    return DeploymentSim(tuple(pools), spec, m.kv_bytes_per_token, m.num_layers)


def capacity_estimate(dep: DeploymentSim, prompt: float, output: float) -> float:
    """Requests/s a deployment could serve when every step is full (where the goodput search starts)."""
    rates = []
    for pool in dep.pools:
        t = pool.table
        pre = dec = np.inf
        if pool.phase != "decode":
            c = pool.step_tokens
            pre = pool.ranks * c / max(t.prefill(c, c), 1e-12) / max(prompt, 1.0)
        if pool.phase != "prefill":
            ctx = prompt + output / 2
            b = max(1.0, min(pool.max_seqs, pool.kv_tokens / max(ctx, 1.0)))
            dec = pool.ranks * b / max(t.decode(b, b * ctx), 1e-12) / max(output, 1.0)
        rates.append(1.0 / (1.0 / pre + 1.0 / dec))
    return float(min(rates))


COARSE_ITERS = 2  # bisection steps of the first, coarse search of every deployment


def inflight(dep: DeploymentSim, prompt: float, output: float) -> float:
    """Requests the deployment's pools hold at once: per rank the sequence cap or the KV budget over a
    mean request (a prefill pool holds prompts only), whichever is smaller."""
    total = 0.0
    for pool in dep.pools:
        tokens = prompt if pool.phase == "prefill" else prompt + output
        total += pool.ranks * max(1.0, min(pool.max_seqs, pool.kv_tokens / max(tokens, 1.0)))
    return total


def _simulate(
    ins: _Inputs, cand: Candidate, tables: _Tables, start: Goodput | None = None, coarse: bool = False
):
    """One deployment's goodput: ``coarse`` (:data:`COARSE_ITERS` bisection steps), or refined (from
    ``start``'s bracket when given); one rate when ``--rate`` is set."""
    dep = _deployment_sim(ins, cand, tables)
    o, req = ins.options, ins.requests
    targets = (*o.targets_s, o.slo_attainment)
    zl = zero_load(dep, int(np.median(req.prompt)), int(np.median(req.output)))
    mean_p, mean_o = float(req.prompt.mean()), float(req.output.mean())
    longest = (
        targets[0] + max(mean_o - 1.0, 0.0) * targets[1]
    )  # a request meeting both targets takes at most this
    sampling = Sampling(o.requests, inflight(dep, mean_p, mean_o), targets[0], longest, o.fill)
    if o.rate is not None:
        g = at_rate(dep, req, targets, o.rate, sampling, ins.route)
        return DeploymentResult(cand, dep, g, zl, needed_requests=sampling.count(g.at.rate, MAX_REQUESTS))
    if coarse:
        est = capacity_estimate(dep, mean_p, mean_o)
        g = search_goodput(dep, req, targets, est, sampling, min(COARSE_ITERS, o.search_iters), ins.route)
        wanted = sampling.count(g.at.rate, MAX_REQUESTS)
        return DeploymentResult(cand, dep, g, zl, refined=False, needed_requests=wanted)
    begin = (
        start.bracket
        if start is not None and start.met and start.bracket
        else capacity_estimate(dep, mean_p, mean_o)
    )
    g = search_goodput(dep, req, targets, begin, sampling, o.search_iters, ins.route)
    return DeploymentResult(cand, dep, g, zl, needed_requests=sampling.count(g.at.rate, MAX_REQUESTS))


def _refine(ins: _Inputs, tables: _Tables, results: list) -> list:
    """Refine the best coarse deployment of each kind, then the leader until it is a refined one."""
    targets = (*ins.options.targets_s, ins.options.slo_attainment)
    out = list(results)

    def refine(r: DeploymentResult) -> None:
        out[out.index(r)] = _simulate(ins, r.candidate, tables, start=r.goodput)

    for kind in dict.fromkeys(r.kind for r in results):
        refine(rank([r for r in out if r.kind == kind], targets)[0])
    for _ in range(len(out)):
        lead = rank(out, targets)[0]
        if lead.refined:
            break
        refine(lead)
    return out


def _per_phase(ins: _Inputs, planner: Planner, results: list, tables: _Tables) -> tuple[list, list[str]]:
    """The best split's pools re-placed on their phase's steps of the trace (module docstring), when the
    trace routes the model's experts in every MoE layer; ``(results, notes)``."""
    tr, m = ins.trace, ins.model
    splits = [r for r in results if r.kind == DISAGGREGATED]
    if tr is None or not splits:
        return results, []
    if not (
        tr.has_tokens
        and tr.num_logical_experts == m.num_logical_experts
        and tr.num_layers == m.num_moe_layers
    ):
        return results, [
            f"per-phase placements not fitted: the trace routes {tr.num_logical_experts} experts in {tr.num_layers} "
            f"layers (per token: {tr.has_tokens}), the model has {m.num_logical_experts} in {m.num_moe_layers} MoE "
            "layers; every pool keeps the planner's placement"
        ]
    best = max(splits, key=lambda r: r.goodput_per_gpu)
    cand, notes = fit_phase_placements(planner, best.candidate, tr)
    new = _simulate(ins, cand, tables, start=best.goodput)
    return [new if r is best else r for r in results], notes


# ---------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------
def plan(
    model: ModelSpec | str,
    cluster: ClusterSpec | str,
    nodes: int,
    workload: WorkloadSpec | str | None = None,
    *,
    trace=None,
    options: DeployOptions | None = None,
    route: Route | None = None,
    output: str | None = None,
) -> DeploymentPlan:
    """Search deployments and rank them by goodput per GPU (module docstring).

    Args:
        model: a ModelSpec, a built-in name, a model JSON or a HF config.json (folder).
        cluster: a ClusterSpec (:func:`placement.cost.hardware.cluster_preset`: GPU, links, GPUs per
            node) or a GPU preset name (its NVLink, RDMA between nodes, 8 GPUs per node).
        nodes: nodes of the cluster.
        workload: ``chat``, ``summarization``, ``code``, a JSON workload path or a WorkloadSpec; None:
            the trace's prompts when it has prompt boundaries, else ``chat``.
        trace: a routing trace (RoutingTrace or path): the experts' skew, prompt lengths, and the
            per-phase placements of the best split when it routes the model's experts.
        options: :class:`DeployOptions`.
        route: ``route(request, view) -> rank`` for every pool (overrides ``options.route``, a rule of
            :data:`placement.routing.ROUTING_RULES`; :func:`moe_placement.apps.deploy.simulator.simulate`).
        output: the folder the placements will be written to (``launch.write_plan``): names the
            files in the result; nothing is written here.
    """
    o = options or DeployOptions()
    if not isinstance(o, DeployOptions):
        raise ValueError(f"options must be a DeployOptions, got {type(o).__name__}")
    ins = _inputs(model, cluster, nodes, workload, trace, o, route)
    p50 = (int(np.median(ins.requests.prompt)), int(np.median(ins.requests.output)))
    planner = Planner(ins.model, ins.cluster, ins.trace, o, p50)
    _check_fits(planner, ins)
    cands = planner.candidates(ins.nodes)
    if not cands:
        raise ValueError("no deployment to simulate: " + "; ".join(planner.notes or ["no layout fits"]))
    tables = _Tables(ins, planner)
    results = [_simulate(ins, c, tables, coarse=o.rate is None) for c in cands]
    if o.rate is None:
        results = _refine(ins, tables, results)
    results, fit_notes = _per_phase(ins, planner, results, tables)
    return _decide(ins, planner, results, fit_notes, output)


def _decide(
    ins: _Inputs, planner: Planner, results: list, fit_notes: list[str], output: str | None
) -> DeploymentPlan:
    from moe_placement.apps.deploy.report_text import assumptions, warnings

    o = ins.options
    targets = (*o.targets_s, o.slo_attainment)
    ranked = rank(results, targets)
    met = bool(ranked) and ranked[0].goodput.met
    best = ranked[0] if met else None
    if best is not None and output is not None:
        files = tuple(str(Path(output) / placement_name(p.phase)) for p in best.candidate.pools)
        best = replace(best, placement_files=files)
        ranked[0] = best
    p50 = (int(np.median(ins.requests.prompt)), int(np.median(ins.requests.output)))
    rule = _rule(ins, p50)
    reason = explain(ranked, targets, p50[0], rule, met)
    launch = launch_commands(best, ins.model, ins.cluster, output) if best is not None else None
    notes = tuple(assumptions(ins, planner, ranked, fit_notes))
    warned = tuple(warnings(ins, planner, ranked, met))
    return DeploymentPlan(
        ins.model,
        ins.cluster,
        ins.nodes,
        ins.workload,
        o,
        ins.requests,
        tuple(ranked),
        best,
        reason,
        rule,
        notes,
        warned,
        launch,
    )


def _rule(ins: _Inputs, p50: tuple[int, int]) -> RuleOfThumb:
    m, cl = ins.model, ins.cluster
    weights = m.non_expert_bytes() + m.expert_bytes * m.num_logical_experts * m.num_moe_layers
    fits_one = weights <= (1 - CostOptions().reserve_fraction) * cl.gpu.hbm_bytes
    link = cl.inter if ins.nodes > 1 else cl.intra
    bw = HandoffSpec.from_link(link).link_bytes_per_s
    return rule_of_thumb(p50[0], p50[1], fits_one, link.name, bw, ins.nodes)
