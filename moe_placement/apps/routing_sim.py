"""TPOT and goodput of each routing rule through the request simulator (issue 43).

For the placement and topology routed on, the co-located deployment of that topology (one instance:
``G`` attention-DP ranks = EP ranks on ``N`` nodes, attention TP 1, the placement's slots, at most the
stream's requests in flight per rank as each rank's sequence cap) runs in the request simulator of
``plan`` (:mod:`moe_placement.apps.deploy.simulator`), its step times from the one cost model
(:func:`moe_placement.apps.deploy.tables.build_table`: the layout planner's pricing of the placement on
the held-out per-expert load, tokens arriving uniformly, even split). Steps:

1. requests: the held-out requests of the routed stream, cyclically up to ``sim_requests`` (a copy's
   prefix segments renamed): prompt = the stream's prompt tokens, output = its decoded tokens + 1 (the
   prompt's last step gives the first), Poisson arrivals (seeded) scaled to each simulated rate;
2. per rule: the rule routes every request (:func:`moe_placement.apps.deploy.routes.rule_route`: a
   :class:`placement.routing.Router` told the simulated requests in flight and reserved KV of every rank
   before each decision, with each request's expert signature and prefix chain), so queueing, each
   rank's batch and KV follow the rule and the instance steps at its busiest rank's sizes; and the
   table is scaled so that a decode step of the routed batch costs the rule's ``decode_step_ms`` (its
   steps that prefill the short prompts beside the decode tokens by the same factor: the prompts are
   dispatched from the rank the rule chose too)
   (:func:`placement.routing.score.score_run`: the one cost model on the rule's routed decode steps,
   each token dispatched from the rank the rule chose: the busiest GPU's experts and NVLink/RDMA bytes);
3. figures: goodput per GPU, the highest rate at which ``slo_attainment`` of the requests meet both
   targets (:func:`moe_placement.apps.deploy.goodput.search_goodput`; the first rule, round-robin where
   it is asked, from the capacity estimate, the others from its bracket); TTFT and TPOT p50/p90/p99 at
   one rate for every rule (that first rule's goodput), the first quarter of the requests a warm-up.

What the simulator does not see: a prefix hit does not shorten the prefill (``ttft_saved_ms`` prices it
apart); the step scale is one mean per rule, not a price per simulated step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from moe_placement.apps.deploy.goodput import Goodput, Sampling, at_rate, percentiles_ms, search_goodput
from moe_placement.apps.deploy.options import DeployOptions
from moe_placement.apps.deploy.plan import capacity_estimate, inflight
from moe_placement.apps.deploy.routes import rule_route
from moe_placement.apps.deploy.simulator import PHASE_BOTH, DeploymentSim, PoolSim
from moe_placement.apps.deploy.tables import build_table, kv_tokens_per_rank
from moe_placement.apps.deploy.workloads import MAX_REQUESTS, Requests
from moe_placement.apps.planner.costmodel import CostOptions
from moe_placement.apps.planner.layout import LayoutCandidate, evaluate_candidate
from placement.model import Placement
from placement.routing import Request, RouterOptions
from placement.routing.rules import LEAST_LOADED, PREFIX, ROUND_ROBIN
from placement.routing.score import StepPricing
from placement.routing.simulate import RequestStream

__all__ = ["SIM_SEARCH_ITERS", "SimInputs", "SimTargets", "simulate_rules"]

SIM_SEARCH_ITERS = 2  # bisection steps of each rule's goodput search (a ratio of 1.19 left)
_MIN_PER_RATE = 300  # the fewest requests of one goodput simulation (as plan --quick)
_MIN_AT = 1000  # the fewest requests of the simulation at the common rate


@dataclass(frozen=True)
class SimTargets:
    """The latency targets and the simulation's size (:class:`moe_placement.apps.routing.RouteOptions`).

    Attributes:
        ttft_ms, tpot_ms, slo_attainment: the targets (``plan``'s defaults).
        requests: the most requests of one simulation (held-out requests drawn cyclically).
        fill: a goodput simulation at rate ``r`` holds ``fill x (r x TTFT + requests in flight)``
            requests, the first ``1 / fill`` a warm-up (:class:`moe_placement.apps.deploy.goodput.Sampling`;
            ``plan`` uses 4: here 2, every rule is searched on the same rates and requests, and a rate
            whose TTFT trends up by half the target over the run is not met).
        chunk: tokens per rank per step (decode tokens plus prompt chunks; ``plan``'s first size).
    """

    ttft_ms: float = DeployOptions.ttft_ms
    tpot_ms: float = DeployOptions.tpot_ms
    slo_attainment: float = DeployOptions.slo_attainment
    requests: int = 20000
    fill: int = 2
    chunk: int = DeployOptions.colocated_step_tokens[0]

    @property
    def targets(self) -> tuple[float, float, float]:
        return self.ttft_ms / 1e3, self.tpot_ms / 1e3, self.slo_attainment


@dataclass(frozen=True, eq=False)
class SimInputs:
    """What every rule's simulation shares: the routed ``stream``, the ``pricing`` (model, cluster), the
    per-expert ``load [L, E]`` the table prices the placement on, the ``targets``, the ``router``'s
    options and the requests in flight per rank the stream was sized for (``per_rank``: each rank's
    sequence cap in the simulator, the batch the routed steps were priced at)."""

    stream: RequestStream
    pricing: StepPricing
    load: np.ndarray
    targets: SimTargets
    router: RouterOptions
    per_rank: int


def _requests(stream: RequestStream, n: int, seed: int) -> tuple[Requests, tuple]:
    """``n`` requests drawn cyclically from the stream, Poisson unit arrivals, and what the router sees
    of each (by index). A request drawn again is a new request: its prefix segments are renamed per
    round (a copy shares no cached prefix with the request it copies)."""
    Q = stream.num_requests
    idx = np.arange(n) % Q
    prompt = np.array([max(1, int(stream.requests[i].prompt_tokens)) for i in idx], dtype=np.int64)
    output = stream.decode[idx].astype(np.int64) + 1
    gaps = np.random.default_rng(seed).exponential(1.0, size=n)
    arrival = np.cumsum(gaps) - gaps[0]
    known = []
    for j, i in enumerate(idx.tolist()):
        r, lap = stream.requests[i], j // Q
        prefix = r.prefix if lap == 0 else tuple(((key, lap), t) for key, t in r.prefix)
        known.append(Request(j, r.prompt_tokens, r.signature, prefix, r.conversation))
    return Requests(prompt, output, arrival), tuple(known)


def _repeats(known) -> bool:
    """Whether any prefix segment occurs twice (else no prefix cache can ever hit)."""
    keys = [key for r in known for key, _ in r.prefix]
    return len(set(keys)) < len(keys)


def _pool(placement: Placement, pricing: StepPricing, load: np.ndarray, seqs: int, chunk: int, longest: int):
    """``(PoolSim, "")`` of the co-located deployment of ``placement``'s topology (``seqs`` sequences per
    rank at most, ``chunk`` tokens per rank per step), or ``(None, why)``."""
    t = placement.topology
    redundant = t.num_physical_experts - placement.num_logical_experts
    cand = LayoutCandidate(t.ep_size, t.num_nodes, 1, redundant, 1)
    opts = CostOptions(phase="decode", step_tokens=seqs, context_len=max(1, longest))
    r = evaluate_candidate(pricing.model, pricing.cluster, cand, opts, load, None, None, placement)
    kv = kv_tokens_per_rank(pricing.model, r) if r.feasible else 0
    if kv < 1:
        label = cand.label(placement.num_logical_experts)
        return None, f"{pricing.model.name} does not fit {label}: {r.reason or 'no KV room'}"
    table = build_table(pricing.model, pricing.cluster, r, load, (seqs, chunk, longest), CostOptions())
    return PoolSim(PHASE_BOTH, 1, t.ep_size, kv, chunk, seqs, table, placement, 1), ""


def _latency(req: Requests, s: SimTargets) -> float:
    """Seconds a mean request meeting both targets takes at most."""
    return s.targets[0] + max(float(req.output.mean()) - 1.0, 0.0) * s.targets[1]


def _sampling(dep, req: Requests, s: SimTargets, least: int) -> Sampling:
    held = inflight(dep, float(req.prompt.mean()), float(req.output.mean()))
    return Sampling(least, held, s.targets[0], _latency(req, s), s.fill)


def _goodput(dep, req: Requests, route, s: SimTargets, start: Goodput | None) -> tuple[dict, Goodput]:
    """The goodput figures of one row and its search: from the capacity estimate with
    :data:`SIM_SEARCH_ITERS` bisection steps, or, given ``start`` (round-robin's search on the same
    requests), from its bracket (each end checked) with one step."""
    search = _sampling(dep, req, s, min(_MIN_PER_RATE, req.n))
    if start is not None and start.met and start.bracket:
        g = search_goodput(dep, req, s.targets, start.bracket, search, 1, route)
    else:
        begin = capacity_estimate(dep, float(req.prompt.mean()), float(req.output.mean()))
        g = search_goodput(dep, req, s.targets, begin, search, SIM_SEARCH_ITERS, route)
    needed = search.count(g.goodput_rps, MAX_REQUESTS) if g.met else 0
    figures = {
        "goodput_rps_per_gpu": round(g.goodput_rps / dep.pools[0].ranks, 6) if needed <= req.n else None,
        "goodput_met": g.met,
        "goodput_requests_needed": needed,
    }
    return figures, g


def _percentiles(dep, req: Requests, route, s: SimTargets, rate: float) -> dict:
    """TTFT and TPOT percentiles (ms) at ``rate``: 4 x the requests in flight there (at least
    :data:`_MIN_AT`, at most all), the first quarter a warm-up."""
    held = inflight(dep, float(req.prompt.mean()), float(req.output.mean()))
    n = int(min(req.n, max(_MIN_AT, math.ceil(4 * min(held, rate * _latency(req, s))))))
    fixed = Sampling(n, held, s.targets[0], _latency(req, s))
    with np.errstate(invalid="ignore"):
        at = at_rate(dep, req.head(n), s.targets, rate, fixed, route).at
        return {"ttft_ms": percentiles_ms(at.ttft), "tpot_ms": percentiles_ms(at.tpot)}


def _order(rows: dict[str, dict]) -> list[str]:
    """Round-robin first (the others' goodput search starts from its bracket), then least-loaded."""
    rank = {ROUND_ROBIN.name: 0, LEAST_LOADED.name: 1}
    return sorted(rows, key=lambda k: rank.get(k.split(" on ")[0], 2))


def _twin(name: str, done: dict, known, rows: dict) -> str | None:
    """A row already simulated whose routing ``name``'s provably repeats: ``prefix`` where no prefix
    segment repeats routes as ``least-loaded`` (its documented fallback, the same seeded draws) and
    prices the same routed steps."""
    rule, _, where = name.partition(" on ")
    if rule != PREFIX.name or _repeats(known):
        return None
    twin = LEAST_LOADED.name + (f" on {where}" if where else "")
    same = twin in done and rows[twin].get("decode_step_ms") == rows[name].get("decode_step_ms")
    return twin if same else None


def _scale(table, row: dict, ranks: int, context: float) -> float:
    """The factor that makes ``table``'s decode step of the routed batch (the row's decoded tokens per
    rank per step, ``context`` cached tokens each) cost the row's ``decode_step_ms``; 1 without one."""
    ms = row.get("decode_step_ms")
    b = float(row.get("decoded_tokens_per_step") or 0.0) / max(ranks, 1)
    base = table.decode(b, b * context) if b > 0 else 0.0
    return ms * 1e-3 / base if ms and base > 0 else 1.0


def simulate_rules(
    placement: Placement, rows: dict[str, dict], x: SimInputs, rate: float | None = None
) -> dict:
    """Add ``goodput_rps_per_gpu``, ``ttft_ms``, ``tpot_ms`` and ``step_scale`` to each row of ``rows``
    (rule name, or ``"<rule> on <solver>"``, -> figures with ``decode_step_ms``) routed on
    ``placement`` (module docstring); the percentiles at ``rate`` (None: the first row's goodput here,
    round-robin's where it is a row, or half the capacity estimate when it has none). Returns what was
    simulated (``{"simulated": False, "why": ...}`` when the model does not fit)."""
    s = x.targets
    req, known = _requests(x.stream, s.requests, x.router.seed)
    pool, why = _pool(placement, x.pricing, x.load, x.per_rank, s.chunk, int(req.prompt.max()))
    if pool is None:
        return {"simulated": False, "why": why}
    runs: dict = {}
    first: Goodput | None = None  # round-robin's search (None when its goodput is not resolved)
    for name in _order(rows):
        scale = _scale(pool.table, rows[name], pool.ranks, x.pricing.context_len)
        dep = DeploymentSim((replace(pool, table=pool.table.scaled(scale, scale)),))
        route = rule_route(name.split(" on ")[0], x.router, known)
        twin = _twin(name, runs, known, rows)
        figures, g = (runs[twin][2], runs[twin][3]) if twin else _goodput(dep, req, route, s, first)
        rows[name].update(figures, step_scale=round(scale, 6))
        if not runs and figures["goodput_rps_per_gpu"] is not None:
            first = g
        runs[name] = (dep, route, figures, g)
    lead = _order(rows)[0]
    rate_from = "given"
    if rate is None:
        met = first is not None and first.met
        p, o = float(req.prompt.mean()), float(req.output.mean())
        rate = first.goodput_rps if met else capacity_estimate(runs[lead][0], p, o) / 2.0
        rate_from = f"{lead}'s goodput" if met else f"half of {lead}'s capacity estimate"
    for name, (dep, route, _, _) in runs.items():
        rows[name].update(_percentiles(dep, req, route, s, float(rate)))
    return {
        "simulated": True,
        "rate_rps": round(float(rate), 6),
        "rate_from": rate_from,
        "requests": req.n,
        "kv_tokens_per_rank": pool.kv_tokens,
        "max_seqs_per_rank": pool.max_seqs,
        "step_tokens": pool.step_tokens,
        "fill": s.fill,
        "targets": {"ttft_ms": s.ttft_ms, "tpot_ms": s.tpot_ms, "slo_attainment": s.slo_attainment},
    }
