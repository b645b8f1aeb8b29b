"""Layout planner: attention-DP x expert-EP x redundant slots, ranked by the cost model.

A layout says, for one serving instance: how many GPUs it spans (``ep_size``, over ``num_nodes``
nodes), the attention tensor-parallel size inside each attention-DP group (``attn_tp``; attention-DP
size ``ep_size / attn_tp``), and how many redundant expert slots it holds. The cluster runs
``instances = total GPUs // ep_size`` independent copies, so throughput per GPU is the figure to
compare: spanning more GPUs only helps if it raises it.

For every candidate the planner checks memory (weights + redundant slots + reserve + the KV cache the
batch needs), places experts (greedy by default) on the workload's skew, counts what each step asks
of each GPU with the one traffic model (:mod:`placement.cost.traffic`) and prices it with the one
step-time model (:mod:`placement.cost.step_time`, through :mod:`moe_placement.apps.planner.costmodel`):
the same figure ``evaluate --model --hardware`` gives the same placement on the same steps. Each
layout's time is also priced on every constant set of :func:`placement.cost.ranges.cluster_sets`
(``*_range`` in the JSON): the ranking can be read with its uncertainty.

Steps with a trace of the model's expert count: :func:`placement.steps.make_steps` of the trace for
the phase and tokens per rank (the steps ``evaluate`` prices; ``CostOptions.max_steps`` first ones,
all by default), split over replicas by the ``even`` dispatch model. Otherwise one expected step from
the per-expert loads.

Workload skew, in order of preference: a trace with the model's expert count (its per-layer counts;
token-level routing when it has ``topk_ids``); a trace with another expert count (its sorted
per-layer load curve resampled to the model's ``E``: the skew, not the identities); else a SYNTHETIC
Zipf load (exponent :data:`SYNTHETIC_ZIPF`, one seeded permutation per layer).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from moe_placement.apps.planner.costmodel import (
    CostOptions,
    LayoutCost,
    MemoryBreakdown,
    layout_loads,
    memory_per_gpu,
    price_layout,
    step_cost,
)
from moe_placement.base.options import refuse_unknown_keywords
from placement.cost.hardware import ClusterSpec, hardware_summary
from placement.cost.modelspec import ModelSpec
from placement.cost.ranges import Range3, set_values

__all__ = [
    "SYNTHETIC_ZIPF",
    "LayoutCandidate",
    "LayoutResult",
    "LayoutPlan",
    "PlanOptions",
    "synthetic_load",
    "workload_load",
    "enumerate_candidates",
    "evaluate_candidate",
    "plan_layout",
    "compare_phases",
    "launch_flags",
]

log = logging.getLogger(__name__)

# Same exponent as profiling.synthetic's default: hottest expert about 2.5-5x the mean.
SYNTHETIC_ZIPF = 0.4
# Extra slots per GPU tried on top of the minimum that makes the slots divide.
EXTRA_SLOTS_PER_GPU = (0, 1, 2, 4)
# Throughput differences below this fraction are called ties.
TIE = 0.03


@refuse_unknown_keywords
@dataclass(frozen=True)
class PlanOptions:
    """How the planner searches and places (the cost model's knobs are :class:`CostOptions`).

    Attributes:
        solver: ``greedy`` or an exact solver of ``solver.api.solve`` for each candidate's placement.
        max_redundant: cap on redundant experts per layer (None: no cap).
        extra_slots: redundant slots per GPU tried above the least that divides (``R0 + j*G``).
        attn_tp: attention-TP sizes tried (None: by attention type, see :func:`enumerate_candidates`).
        seed: solver seed and synthetic-skew seed.
        time_limit: seconds per exact solve.
    """

    solver: str = "greedy"
    max_redundant: int | None = None
    extra_slots: tuple[int, ...] = EXTRA_SLOTS_PER_GPU
    attn_tp: tuple[int, ...] | None = None
    seed: int = 0
    time_limit: float = 10.0


@dataclass(frozen=True)
class LayoutCandidate:
    """One instance layout. ``instances`` copies fill the cluster."""

    ep_size: int
    num_nodes: int
    attn_tp: int
    num_redundant: int
    instances: int

    @property
    def attn_dp(self) -> int:
        return self.ep_size // self.attn_tp

    def label(self, E: int) -> str:
        return (
            f"EP{self.ep_size} ({self.num_nodes}n) DP{self.attn_dp}xTP{self.attn_tp} "
            f"R{self.num_redundant} ({(E + self.num_redundant) // self.ep_size}/gpu)"
        )


@dataclass(frozen=True, eq=False)
class LayoutResult:
    """A candidate with its verdict. ``cost`` and ``placement`` are None when it does not fit."""

    candidate: LayoutCandidate
    memory: MemoryBreakdown
    feasible: bool
    reason: str = ""
    cost: LayoutCost | None = None
    par: float | None = None
    placement: Any = None
    solver_status: str = ""
    set_step_s: dict[str, float] | None = None

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.cost.tokens_per_s_per_gpu if self.cost else 0.0

    def set_throughput(self) -> dict[str, float]:
        """Tokens per second per GPU on each constant set (:func:`placement.cost.ranges.cluster_sets`);
        empty when the layout does not fit."""
        if not self.cost or not self.set_step_s:
            return {}
        held = self.cost.time.held_tokens
        return {k: held / v if v > 0 else 0.0 for k, v in self.set_step_s.items()}

    def ranges(self) -> dict[str, list[float]]:
        """``step_time_ms_range`` and ``tokens_per_s_per_gpu_range`` (``[low, high]`` over the sets)."""
        if not self.cost or not self.set_step_s:
            return {}
        ms = Range3.of({k: v * 1e3 for k, v in self.set_step_s.items()})
        return {
            "step_time_ms_range": ms.span(),
            "tokens_per_s_per_gpu_range": Range3.of(self.set_throughput()).span(),
        }

    def to_dict(self, E: int) -> dict:
        c, m = self.candidate, self.memory
        d = {
            "layout": c.label(E),
            "ep_size": c.ep_size,
            "num_nodes": c.num_nodes,
            "attn_dp": c.attn_dp,
            "attn_tp": c.attn_tp,
            "num_redundant": c.num_redundant,
            "slots_per_gpu": (E + c.num_redundant) // c.ep_size,
            "instances": c.instances,
            "feasible": self.feasible,
            "reason": self.reason,
            "weights_gb": (m.non_expert + m.expert) / 1e9,
            "redundant_gb": m.redundant / 1e9,
            "kv_free_gb": m.kv_free / 1e9,
            "kv_needed_gb": m.kv_needed / 1e9,
            "max_batch_per_rank": m.max_step_tokens,  # --json key kept (docs/cli.md, layout)
        }
        if self.cost:
            lc = self.cost.layer
            d.update(
                {
                    "step_time_ms": self.cost.step_time * 1e3,
                    "tokens_per_s_per_gpu": self.cost.tokens_per_s_per_gpu,
                    **self.ranges(),
                    "par": self.par,
                    "two_batch_overlap": lc.overlap_used,
                    "bottleneck": self.cost.bottleneck,
                    "layer_us": {
                        k: getattr(lc, k) * 1e6
                        for k in ("attention", "shared", "dispatch", "compute", "combine", "used")
                    },
                    "tokens_per_expert": lc.tokens_per_expert,
                    "memory_bound_experts": lc.memory_bound,
                    "solver_status": self.solver_status,
                }
            )
        return d


@dataclass(frozen=True, eq=False)
class LayoutPlan:
    """Ranked results (feasible by throughput per GPU, then the rejected ones) and plain-language notes."""

    model: ModelSpec
    cluster: ClusterSpec
    options: CostOptions
    total_gpus: int
    results: tuple[LayoutResult, ...]
    notes: tuple[str, ...]
    workload: str
    more_gpus_help: bool = True

    @property
    def feasible(self) -> tuple[LayoutResult, ...]:
        return tuple(r for r in self.results if r.feasible)

    @property
    def best(self) -> LayoutResult | None:
        f = self.feasible
        return f[0] if f else None

    def gain_vs_best(self, result: LayoutResult) -> tuple[float, Range3] | None:
        """``(gain, range)`` of ``result``'s throughput over the best layout's, set by set (negative: slower
        than the best; a range reaching above 0 means some constant set ranks it first); None when
        either does not fit."""
        best = self.best
        if best is None or not result.feasible or not result.set_step_s or not best.set_step_s:
            return None
        mine, top = result.set_throughput(), best.set_throughput()
        g = {k: mine[k] / top[k] - 1.0 if top[k] > 0 else 0.0 for k in top}
        return g["central"], Range3.of(g)

    def to_dict(self) -> dict:
        E = self.model.num_logical_experts
        rows = []
        for r in self.results:
            d = r.to_dict(E)
            gain = self.gain_vs_best(r)
            if gain is not None:
                d["gain_vs_best"], d["gain_vs_best_range"] = gain[0], gain[1].span()
            rows.append(d)
        return {
            "model": self.model.name,
            "hardware": hardware_summary(self.cluster),
            "phase": self.options.phase,
            "batch_per_rank": self.options.step_tokens,  # --json key kept (docs/cli.md, layout)
            "context_len": self.options.context_len,
            "total_gpus": self.total_gpus,
            "workload": self.workload,
            "more_gpus_help": self.more_gpus_help,
            "notes": list(self.notes),
            "results": rows,
        }


# ---------------------------------------------------------------------------------------------
# Workload skew
# ---------------------------------------------------------------------------------------------
def synthetic_load(
    num_layers: int, num_experts: int, zipf: float = SYNTHETIC_ZIPF, seed: int = 0
) -> np.ndarray:
    """SYNTHETIC per-expert load ``[L, E]``: ``1/rank^zipf`` permuted per layer (seeded)."""
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, num_experts + 1) ** zipf
    return np.stack([base[rng.permutation(num_experts)] for _ in range(num_layers)])


def workload_load(model: ModelSpec, trace=None, seed: int = 0) -> tuple[np.ndarray, str]:
    """Per-expert load ``[L_moe, E]`` for the model's MoE layers and a sentence saying where it came from.

    Model layer ``i`` takes trace layer ``i mod L_trace``.
    """
    L, E = model.num_moe_layers, model.num_logical_experts
    if trace is None:
        return synthetic_load(L, E, seed=seed), f"SYNTHETIC Zipf({SYNTHETIC_ZIPF}) skew, seed {seed}"
    counts = np.asarray(trace.counts(), dtype=np.float64)  # [L_t, E_t]
    Lt, Et = counts.shape
    rows = counts[np.arange(L) % Lt]  # [L, E_t]
    if Et == E:
        return rows, f"trace {trace.name!r} counts ({Lt} layers, tiled over {L} MoE layers)"
    # Transfer the skew: the sorted load curve resampled to E experts, then a seeded permutation.
    rng = np.random.default_rng(seed)
    out = np.empty((L, E))
    q = (np.arange(E) + 0.5) / E
    qt = (np.arange(Et) + 0.5) / Et
    for l in range(L):
        curve = np.sort(rows[l])[::-1]
        out[l] = np.interp(q, qt, curve)[rng.permutation(E)]
    return out, (
        f"skew of trace {trace.name!r} ({Et} experts) resampled to {E} experts "
        f"(identities are synthetic; counts of {Lt} layers tiled over {L})"
    )


# ---------------------------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_candidates(
    model: ModelSpec,
    num_nodes: int,
    gpus_per_node: int,
    max_redundant: int | None = None,
    extra_slots: Sequence[int] = EXTRA_SLOTS_PER_GPU,
    attn_tp: Sequence[int] | None = None,
) -> list[LayoutCandidate]:
    """Every instance size that tiles the cluster (whole nodes dividing ``num_nodes``, and GPU counts
    dividing one node), with redundant counts ``R0 + j*G`` (``R0`` the least that makes the
    ``E + R`` slots divide over ``G``; ``j`` in ``extra_slots``) up to ``max_redundant``.

    ``attn_tp`` defaults to ``(1,)`` (pure attention DP) for MLA models, whose latent KV cache would be
    replicated by TP, and to ``(1, gpus_per_node)`` for GQA models whose KV heads split that far.
    """
    E = model.num_logical_experts
    total = num_nodes * gpus_per_node
    sizes = [(g, 1) for g in _divisors(gpus_per_node)] + [
        (n * gpus_per_node, n) for n in _divisors(num_nodes) if n > 1
    ]
    if attn_tp is None:
        attn_tp = (
            (1,)
            if model.attention == "mla"
            else tuple(sorted({1, gpus_per_node} if model.num_kv_heads % gpus_per_node == 0 else {1}))
        )
    out = []
    for G, N in sizes:
        r0 = (-E) % G
        for j in sorted(set(extra_slots)):
            R = r0 + j * G
            if max_redundant is not None and R > max_redundant:
                continue
            if (E + R) // G > E:  # a GPU would need two replicas of one expert
                continue
            for t in attn_tp:
                if G % t:
                    continue
                out.append(LayoutCandidate(G, N, int(t), R, total // G))
    return out


def _place(
    model: ModelSpec, load: np.ndarray, cand: LayoutCandidate, solver: str, seed: int, time_limit: float
):
    from placement.topology import Topology

    topo = Topology.from_redundant(
        model.num_logical_experts, cand.num_redundant, cand.ep_size, cand.num_nodes
    )
    from solver.api import solve

    pl, rep = solve(
        solver,
        topology=topo,
        load=load,
        num_groups=model.num_groups,
        layer_ids=model.moe_layer_ids,
        time_limit=time_limit,
        seed=seed,
    )
    return pl, rep.status


def evaluate_candidate(
    model: ModelSpec,
    cluster: ClusterSpec,
    cand: LayoutCandidate,
    options: CostOptions,
    load: np.ndarray,
    trace=None,
    plan: PlanOptions | None = None,
    placement=None,
) -> LayoutResult:
    """Memory check, placement (unless given, with ``plan``'s solver), the step's loads and its cost
    on the cluster and on every constant set of :func:`placement.cost.ranges.cluster_sets`."""
    from placement.metrics import balance_stats, expected_gpu_load

    opts = replace(options, attn_tp=cand.attn_tp)
    mem = memory_per_gpu(
        model, cluster.gpu, cand.ep_size, model.num_logical_experts + cand.num_redundant, opts
    )
    if not mem.fits:
        return LayoutResult(cand, mem, False, mem.explain())
    status = "given"
    if placement is None:
        plan = plan or PlanOptions()
        placement, status = _place(model, load, cand, plan.solver, plan.seed, plan.time_limit)
    priced, loads = layout_loads(model, placement, load, trace, opts)
    cost = step_cost(model, cluster, priced, loads, opts)
    # the launch runs the overlap the central figures chose (launch_flags): every set prices that one
    fixed = replace(opts, overlap="on" if cost.layer.overlap_used else "off")
    sets = set_values(lambda c: price_layout(model, c, loads, fixed).whole_ms * 1e-3, cluster)
    par = balance_stats(expected_gpu_load(placement, load))["par"]
    return LayoutResult(cand, mem, True, "", cost, float(par), placement, status, sets)


def _fmt_rate(x: float) -> str:
    return f"{x:,.0f} tok/s/GPU"


def _check_plan_inputs(model, cluster, num_nodes, options, plan) -> None:
    """ValueError naming the argument whose type or value plan_layout cannot use."""
    expected = {
        "model": (model, ModelSpec),
        "cluster": (cluster, ClusterSpec),
        "options": (options, CostOptions),
    }
    expected["plan"] = (plan, (PlanOptions, type(None)))
    for name, (value, kind) in expected.items():
        if not isinstance(value, kind):
            raise ValueError(
                f"plan_layout: {name} must be a {getattr(kind, '__name__', kind)}, got {value!r}"
            )
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, (int, np.integer)) or num_nodes < 1:
        raise ValueError(f"num_nodes must be a whole number >= 1, got {num_nodes!r}")


def plan_layout(
    model: ModelSpec,
    cluster: ClusterSpec,
    num_nodes: int,
    options: CostOptions,
    trace=None,
    load: np.ndarray | None = None,
    plan: PlanOptions | None = None,
    placements: dict | None = None,
) -> LayoutPlan:
    """Enumerate, evaluate and rank layouts; say plainly whether more GPUs help.

    Args:
        load: ``[L_moe, E]`` per-expert load (default: from ``trace`` or synthetic, see module doc).
        plan: how to search and place (:class:`PlanOptions`; default its defaults).
        placements: optional cache ``{(ep_size, num_nodes, R): Placement}`` shared between calls.
    """
    _check_plan_inputs(model, cluster, num_nodes, options, plan)
    m = cluster.gpus_per_node
    plan = plan or PlanOptions()
    how = "given per-expert load"
    if load is None:
        load, how = workload_load(model, trace, plan.seed)
    load = np.asarray(load, dtype=np.float64)
    if load.shape != (model.num_moe_layers, model.num_logical_experts):
        raise ValueError(
            f"load must be [{model.num_moe_layers}, {model.num_logical_experts}] (MoE layers x experts), got {load.shape}"
        )
    cands = enumerate_candidates(model, num_nodes, m, plan.max_redundant, plan.extra_slots, plan.attn_tp)
    if not cands:
        raise ValueError(
            f"no layout: max_redundant={plan.max_redundant} admits no redundant count for {model.num_logical_experts} experts "
            f"on {num_nodes} x {m} GPUs; raise --max-redundant"
        )
    cache = {} if placements is None else placements
    results = []
    for c in cands:
        key = (c.ep_size, c.num_nodes, c.num_redundant)
        r = evaluate_candidate(model, cluster, c, options, load, trace, plan, cache.get(key))
        if r.feasible and key not in cache:
            cache[key] = r.placement
        results.append(r)
    ok = sorted((r for r in results if r.feasible), key=lambda r: -r.tokens_per_s_per_gpu)
    bad = [r for r in results if not r.feasible]
    total = num_nodes * m
    notes, helps = _notes(model, ok, bad, total, options)
    wl_how = how + ("; " + ok[0].cost.workload_how if ok else "")
    return LayoutPlan(model, cluster, options, total, tuple(ok + bad), tuple(notes), wl_how, helps)


def _notes(model, ok, bad, total, options) -> tuple[list[str], bool]:
    E = model.num_logical_experts
    notes: list[str] = []
    if not ok:
        worst = bad[0].reason if bad else ""
        notes.append(
            f"no layout fits in memory on {total} GPUs ({worst}); use more GPUs, fewer redundant slots, "
            f"a smaller batch or a shorter context"
        )
        return notes, False
    best = ok[0]
    by_size: dict[int, LayoutResult] = {}
    for r in ok:
        by_size.setdefault(r.candidate.ep_size, r)
    helps = True
    if best.candidate.ep_size < total:
        full = by_size.get(total)
        bc = best.candidate
        if full is None:
            why = next((r.reason for r in bad if r.candidate.ep_size == total), "no candidate")
            notes.append(f"one instance over all {total} GPUs does not fit ({why})")
        else:
            loss = 1 - full.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu
            if loss > TIE:
                helps = False
                lc = full.cost.layer
                notes.append(
                    f"MORE GPUS DO NOT HELP: one instance over {total} GPUs gives {_fmt_rate(full.tokens_per_s_per_gpu)}, "
                    f"{loss:.0%} less than {bc.ep_size} GPU(s) per instance ({_fmt_rate(best.tokens_per_s_per_gpu)}); "
                    f"at {total} GPUs dispatch+combine take {(lc.dispatch + lc.combine) * 1e6:.0f} us per layer vs "
                    f"{lc.compute * 1e6:.0f} us expert compute. Run {total // bc.ep_size} independent instances of {bc.ep_size} GPUs."
                )
            else:
                notes.append(f"{bc.ep_size} and {total} GPUs per instance are within {TIE:.0%} of each other")
    else:
        # best uses all GPUs: report how much each doubling gave
        sizes = sorted(by_size)
        if len(sizes) > 1:
            prev = by_size[sizes[-2]]
            gain = best.tokens_per_s_per_gpu / prev.tokens_per_s_per_gpu - 1
            notes.append(
                f"spanning all {total} GPUs gives {gain:+.0%} throughput per GPU over {sizes[-2]} GPUs per instance"
            )
    lc = best.cost.layer
    if lc.memory_bound:
        notes.append(
            f"expert GEMMs are memory-bound at {lc.tokens_per_expert:.0f} tokens per expert per step: weight reads "
            f"dominate, so extra replicas of an expert cost a full weight read each"
        )
    notes.append(
        f"two-batch overlap {'pays' if lc.overlap_used else 'does not pay'} for the best layout "
        f"({lc.overlapped * 1e6:.0f} us vs {lc.no_overlap * 1e6:.0f} us per MoE layer)"
    )
    rejected = (
        [r for r in bad if r.candidate.ep_size == best.candidate.ep_size]
        or [r for r in bad if r.candidate.ep_size == max(x.candidate.ep_size for x in bad)]
        if bad
        else []
    )
    if rejected:
        r = min(rejected, key=lambda r: r.candidate.num_redundant)
        notes.append(f"rejected for memory: {r.candidate.label(E)}: {r.reason}")
    return notes, helps


def compare_phases(
    model: ModelSpec,
    cluster: ClusterSpec,
    num_nodes: int,
    decode: CostOptions,
    prefill: CostOptions,
    trace=None,
    plan: PlanOptions | None = None,
    plans: dict | None = None,
) -> dict:
    """Best layout of each phase, each evaluated on the other phase (``plan``: how each is searched;
    ``plans``: phases already planned).

    Steps: plan each phase -> evaluate each best layout on the other phase -> losses -> message.

    Returns a dict with both plans, the cross-evaluated throughputs, ``separate_wins`` (True when
    either phase's best layout, used for both phases, loses more than :data:`TIE` on the other) and a
    ``message``.
    """
    plan = plan or PlanOptions()
    load, _ = workload_load(model, trace, plan.seed)
    plans = _phase_plans(model, cluster, num_nodes, decode, prefill, trace, plan, plans)
    bd, bp = plans["decode"].best, plans["prefill"].best
    if bd is None or bp is None:
        return {
            "plans": plans,
            "separate_wins": False,
            "message": "a phase has no feasible layout; no comparison",
        }
    pd_on_prefill = evaluate_candidate(model, cluster, bd.candidate, prefill, load, trace, plan, bd.placement)
    pp_on_decode = evaluate_candidate(model, cluster, bp.candidate, decode, load, trace, plan, bp.placement)
    E = model.num_logical_experts
    if bd.candidate == bp.candidate:
        msg = f"one layout serves both phases best: {bd.candidate.label(E)}"
        return {"plans": plans, "separate_wins": False, "message": msg}
    loss_prefill = _cross_loss(pd_on_prefill, bp)
    loss_decode = _cross_loss(pp_on_decode, bd)
    # a single layout for both phases is the better of the two bests; separate pools win when even it loses
    wins = min(loss_prefill, loss_decode) > TIE
    return {
        "plans": plans,
        "separate_wins": wins,
        "message": _phase_message(wins, loss_prefill, loss_decode, bd, bp, pd_on_prefill, pp_on_decode, E),
        "loss_prefill": loss_prefill,
        "loss_decode": loss_decode,
        "decode_on_prefill": pd_on_prefill,
        "prefill_on_decode": pp_on_decode,
    }


def _phase_plans(
    model: ModelSpec,
    cluster: ClusterSpec,
    num_nodes: int,
    decode: CostOptions,
    prefill: CostOptions,
    trace,
    plan: PlanOptions,
    plans: dict | None,
) -> dict:
    """``{"decode": LayoutPlan, "prefill": LayoutPlan}``: the given plans, the missing ones planned
    (sharing one placement cache)."""
    plans = dict(plans or {})
    cache: dict = {}
    for name, opts in (("decode", decode), ("prefill", prefill)):
        if name not in plans:
            plans[name] = plan_layout(
                model, cluster, num_nodes, opts, trace=trace, plan=plan, placements=cache
            )
    return plans


def _cross_loss(on_other: LayoutResult, best_other: LayoutResult) -> float:
    """Throughput a phase loses running the other phase's best layout (1.0 when it cannot run it)."""
    return 1 - on_other.tokens_per_s_per_gpu / best_other.tokens_per_s_per_gpu if on_other.feasible else 1.0


def _phase_message(
    wins: bool,
    loss_prefill: float,
    loss_decode: float,
    bd: LayoutResult,
    bp: LayoutResult,
    pd_on_prefill: LayoutResult,
    pp_on_decode: LayoutResult,
    E: int,
) -> str:
    """The verdict of :func:`compare_phases` in one sentence."""
    return (
        f"{'SEPARATE PREFILL AND DECODE LAYOUTS WIN' if wins else 'ONE LAYOUT SERVES BOTH PHASES (separate pools gain at most ' + format(min(loss_prefill, loss_decode), '.0%') + ')'}: "
        f"decode best {bd.candidate.label(E)}, prefill best {bp.candidate.label(E)}; the decode layout "
        + (
            f"loses {loss_prefill:.0%} on prefill"
            if pd_on_prefill.feasible
            else f"cannot run prefill ({pd_on_prefill.reason})"
        )
        + ", the prefill layout "
        + (
            f"loses {loss_decode:.0%} on decode"
            if pp_on_decode.feasible
            else f"cannot run decode ({pp_on_decode.reason})"
        )
    )


def launch_flags(
    result: LayoutResult, model: ModelSpec, placement_files: dict[str, str], gpus_per_node: int
) -> dict[str, Any]:
    """Engine launch flags for one layout (``docs/formats.md``, "Launch flags").

    Args:
        placement_files: ``{"sglang": path, "trtllm": path}`` written next to the flags.
    """
    c = result.candidate
    R = c.num_redundant
    tbo = bool(result.cost and result.cost.layer.overlap_used)
    sglang = [
        "--tp-size",
        str(c.ep_size),
        "--dp-size",
        str(c.attn_dp),
        "--enable-dp-attention",
        "--moe-a2a-backend",
        "deepep",
        "--ep-num-redundant-experts",
        str(R),
        "--init-expert-location",
        placement_files.get("sglang", "expert_location.json"),
        "--ep-dispatch-algorithm",
        "static",
    ]
    if c.num_nodes > 1:
        sglang += ["--nnodes", str(c.num_nodes)]
    if tbo:
        sglang += ["--enable-two-batch-overlap"]
    eplb = {"window_size": 1000, "step_interval": 3000, "num_redundant_experts": R, "log_balancedness": True}
    import json

    vllm = [
        "--data-parallel-size",
        str(c.attn_dp),
        "--enable-expert-parallel",
        "--enable-eplb",
        "--eplb-config",
        json.dumps(eplb, separators=(",", ":")),
    ]
    if c.attn_tp > 1:
        vllm += ["--tensor-parallel-size", str(c.attn_tp)]
    trt = {
        "tensor_parallel_size": c.ep_size,
        "moe_expert_parallel_size": c.ep_size,
        "enable_attention_dp": c.attn_tp == 1,
        "moe_config": {
            "backend": "WideEP",
            "load_balancer": placement_files.get("trtllm", "moe_load_balancer.yaml"),
        },
    }
    return {
        "sglang": sglang,
        "vllm": vllm,
        "trtllm_extra_llm_api_options": trt,
        "notes": [
            "vLLM has no offline placement file: its EPLB rebalances online with num_redundant_experts slots",
            f"{c.instances} instance(s) of {c.ep_size} GPU(s) fill the cluster",
        ],
    }
