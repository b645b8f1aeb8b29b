"""Deployments to simulate, each pool's layout from the one layout planner.

Every pool is planned by :func:`moe_placement.apps.planner.layout.plan_layout` on its own GPUs (the same
candidate enumeration, memory check, placement and cost model as ``moe-placement layout``), ranked for
the phase it serves:

- ``prefill``: tokens/s per GPU of prefill steps of ``prefill_step_tokens`` tokens per rank of the
  median prompt;
- ``decode``: tokens/s per GPU of decode steps of ``placement.steps.SIZING_STEP_TOKENS["decode"]``
  sequences per rank at the median context (halved until a layout's KV cache holds it);
- ``both``: requests/s per GPU when a GPU spends ``prompt / prefill rate + output / decode rate`` on a
  median request (the two rankings above combined per layout).

Deployments: **co-located** = one instance over every GPU (``instances == 1``); **replicas** =
layouts of several independent instances behind a router (``instances > 1``); **disaggregated** = a
prefill pool and a decode pool for each prefill:decode split tried (whole nodes on a cluster of
several nodes; GPUs of the one node otherwise), each pool with its own best layout.

:func:`fit_phase_placements` re-places a disaggregated deployment's pools on their phase's steps of a
routing trace (prefill-shaped chunks for the prefill pool, continuous-batching decode steps for the
decode pool) through :func:`solver.api.solve` with :class:`solver.api.FitOptions` ``phase``; two pools of one
topology then trade rows per layer where the other pool's row is faster on this pool's phase
(:func:`exchange_layers`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np

from moe_placement.apps.deploy.options import COLOCATED, DISAGGREGATED, REPLICAS, DeployOptions
from moe_placement.apps.planner.costmodel import CostOptions
from moe_placement.apps.planner.layout import (
    LayoutResult,
    PlanOptions,
    evaluate_candidate,
    plan_layout,
    workload_load,
)
from placement.cost.hardware import HARDWARE_NAMES, ClusterSpec
from placement.cost.modelspec import BUILTIN_MODELS, ModelSpec
from placement.dispatch import BALANCED, EVEN
from placement.steps import DEFAULT_STEP_TOKENS, SIZING_STEP_TOKENS

__all__ = ["Candidate", "PoolChoice", "Planner", "exchange_layers", "fit_phase_placements", "splits"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class PoolChoice:
    """One pool of a deployment: ``phase`` (both, prefill, decode), ``gpus``, the cluster its layout
    was planned on (``gpus_per_node`` of the pool when it is part of one node), its nodes, the planner's
    ``result`` (layout, memory, placement), its tokens per rank per step, how its placement was made
    (``placed``) and the dispatch model it was placed for and is priced under (``dispatch``: the
    planner's even split, or the per-step ``balanced`` split a placement fitted on the trace's steps
    serves under)."""

    phase: str
    gpus: int
    cluster: ClusterSpec
    nodes: int
    result: LayoutResult
    step_tokens: int
    placed: str = "planner (greedy on the workload's per-expert load)"
    dispatch: str = EVEN.name

    def layout(self, E: int) -> str:
        return self.result.candidate.label(E)


@dataclass(frozen=True, eq=False)
class Candidate:
    """A deployment to simulate: its kind, pools and a short label."""

    kind: str
    pools: tuple[PoolChoice, ...]
    label: str

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in self.pools)


def splits(total: int, most: int) -> list[int]:
    """Prefill shares tried of ``total`` units (nodes or GPUs): every one of ``1..total-1`` when they
    are at most ``most``, else ``most`` values evenly spread inside (the lopsided ends left out)."""
    if total < 2:
        return []
    if most >= total - 1:
        return list(range(1, total))
    vals = np.unique(np.round(np.linspace(1, total - 1, most + 2)[1:-1]).astype(int))
    return [int(v) for v in vals]


class Planner:
    """The planner's rankings per pool size and phase, cached (module docstring)."""

    def __init__(
        self, model: ModelSpec, cluster: ClusterSpec, trace, options: DeployOptions, lengths: tuple[int, int]
    ):
        self.model, self.cluster, self.trace, self.options = model, cluster, trace, options
        self.prompt, self.output = lengths
        self.search = PlanOptions(solver=options.solver, seed=options.seed)
        self.cache: dict = {}
        self.notes: list[str] = []

    def _cluster(self, nodes: int, gpus: int) -> ClusterSpec:
        return (
            self.cluster if gpus >= self.cluster.gpus_per_node else replace(self.cluster, gpus_per_node=gpus)
        )

    def cost_options(self, phase: str, step_tokens: int | None = None) -> CostOptions:
        """The planner's pricing of ``phase`` (a trace's steps: the first ``layout_steps``)."""
        cap = self.options.layout_steps
        if phase == "prefill":
            b = step_tokens or self.options.prefill_step_tokens
            return CostOptions(phase="prefill", step_tokens=b, context_len=max(1, self.prompt), max_steps=cap)
        ctx = max(1, self.prompt + self.output // 2)
        b = step_tokens or SIZING_STEP_TOKENS["decode"]
        return CostOptions(phase="decode", step_tokens=b, context_len=ctx, max_steps=cap)

    def ranked(self, phase: str, nodes: int, gpus: int) -> list[LayoutResult]:
        """Feasible layouts of a pool of ``gpus`` GPUs on ``nodes`` nodes for ``phase``, best first."""
        key = (phase, nodes, gpus)
        if key not in self.cache:
            self.cache[key] = self._rank(phase, nodes, gpus)
        return self.cache[key]

    def _plan(self, phase: str, nodes: int, gpus: int):
        cl = self._cluster(nodes, gpus)
        b = None
        while True:
            plan = plan_layout(
                self.model, cl, nodes, self.cost_options(phase, b), trace=self.trace, plan=self.search
            )
            if plan.feasible or phase == "prefill":
                return plan
            b = (b or SIZING_STEP_TOKENS["decode"]) // 2
            if b < 1:
                return plan

    def _rank(self, phase: str, nodes: int, gpus: int) -> list[LayoutResult]:
        if phase != "both":
            return list(self._plan(phase, nodes, gpus).feasible)
        dec = self._plan("decode", nodes, gpus)
        cl, pre_opts, load = self._cluster(nodes, gpus), self.cost_options("prefill"), self.load()
        scored = []
        for r in dec.feasible:
            p = evaluate_candidate(
                self.model, cl, r.candidate, pre_opts, load, None, self.search, r.placement
            )
            if not p.feasible:
                continue
            per_request = self.prompt / p.tokens_per_s_per_gpu + self.output / r.tokens_per_s_per_gpu
            scored.append((per_request, len(scored), r))
        return [r for _, _, r in sorted(scored)]

    def load(self) -> np.ndarray:
        """``[L_moe, E]`` per-expert load every pool is priced on (the planner's, from the trace or
        synthetic)."""
        if "load" not in self.cache:
            self.cache["load"], self.cache["load_how"] = workload_load(
                self.model, self.trace, self.options.seed
            )
        return self.cache["load"]

    def load_how(self) -> str:
        """Where :meth:`load` comes from, in words."""
        self.load()
        return self.cache["load_how"]

    # ---- deployments --------------------------------------------------------------------------
    def candidates(self, nodes: int) -> list[Candidate]:
        """Every deployment of the kinds asked for (module docstring)."""
        o, m = self.options, self.cluster.gpus_per_node
        total, out = nodes * m, []
        E = self.model.num_logical_experts
        if COLOCATED in o.deployments or REPLICAS in o.deployments:
            both = self.ranked("both", nodes, total)
            for kind, one in ((COLOCATED, True), (REPLICAS, False)):
                if kind not in o.deployments:
                    continue
                chosen = [r for r in both if (r.candidate.instances == 1) == one][: o.layouts_per_pool]
                if not chosen:
                    self.notes.append(f"no {kind} layout fits on {total} GPUs")
                for r in chosen:
                    for st in o.colocated_step_tokens:
                        pool = PoolChoice("both", total, self.cluster, nodes, r, int(st))
                        label = _label(kind, (pool,), E)
                        out.append(Candidate(kind, (pool,), label))
        if DISAGGREGATED in o.deployments:
            out += self._disaggregated(nodes)
        return out

    def _disaggregated(self, nodes: int) -> list[Candidate]:
        o, m = self.options, self.cluster.gpus_per_node
        E = self.model.num_logical_experts
        out = []
        units = nodes if nodes > 1 else m
        for p in splits(units, o.max_splits):
            shapes = ((p, p * m), (nodes - p, (nodes - p) * m)) if nodes > 1 else ((1, p), (1, m - p))
            pre = self.ranked("prefill", *shapes[0])[: o.layouts_per_pool]
            dec = self.ranked("decode", *shapes[1])[: o.layouts_per_pool]
            if not pre or not dec:
                self.notes.append(
                    f"disaggregated {shapes[0][1]}:{shapes[1][1]} GPUs skipped: the "
                    f"{'prefill' if not pre else 'decode'} pool holds no layout of the model"
                )
                continue
            for rp in pre:
                for rd in dec:
                    pools = (
                        self._pool("prefill", shapes[0], rp, o.prefill_step_tokens),
                        self._pool("decode", shapes[1], rd, o.decode_step_tokens),
                    )
                    out.append(Candidate(DISAGGREGATED, pools, _label(DISAGGREGATED, pools, E)))
        return out

    def _pool(self, phase: str, shape: tuple[int, int], result: LayoutResult, step_tokens: int) -> PoolChoice:
        nodes, gpus = shape
        return PoolChoice(phase, gpus, self._cluster(nodes, gpus), nodes, result, step_tokens)


def _label(kind: str, pools: tuple[PoolChoice, ...], E: int) -> str:
    def short(p: PoolChoice) -> str:
        c = p.result.candidate
        inst = f"{c.instances} x " if c.instances > 1 else ""
        return f"{inst}EP{c.ep_size} DP{c.attn_dp}xTP{c.attn_tp} R{c.num_redundant}"

    if kind == DISAGGREGATED:
        return f"{kind} P{pools[0].gpus}:D{pools[1].gpus} [{short(pools[0])} | {short(pools[1])}]"
    return f"{kind} {short(pools[0])}, chunk {pools[0].step_tokens}/rank"


def fit_phase_placements(planner: Planner, cand: Candidate, trace) -> tuple[Candidate, list[str]]:
    """``cand`` with each pool's placement fitted on its phase's steps of the first half of ``trace``
    (:func:`solver.api.solve`, the per-step ``balanced`` dispatch, :class:`solver.api.FitOptions` with
    the pool's phase), and notes. The trace must route the model's experts in all its MoE layers.

    When the two pools share a topology, each pool's fitted placement is one more candidate per layer
    for the other pool (:func:`exchange_layers`): a layer takes the other pool's row where that row's
    modelled time on this pool's phase is lower on the fit half's steps of that phase."""
    fit, _ = trace.split(0.5)
    fitted = [_fit_pool(planner, pool, fit) for pool in cand.pools]
    placements = [f[0] if f is not None else None for f in fitted]
    taken: list[tuple[int, ...]] = [()] * len(fitted)
    if len(fitted) == 2 and all(f is not None for f in fitted) and _same_topology(*placements):
        phases = tuple(p.phase for p in cand.pools)
        tokens = tuple(f[1] for f in fitted)
        placements, taken = exchange_layers(
            placements, phases, tokens, fit, planner.model, cand.pools[0].cluster, planner.options.seed
        )
    pools, notes = [], []
    for i, pool in enumerate(cand.pools):
        if fitted[i] is None:  # one GPU holds every expert: nothing to place
            pools.append(pool)
            continue
        how = fitted[i][2] + _taken_text(taken[i], cand.pools[1 - i].phase if taken[i] else "", pool.phase)
        fitted_pool = replace(pool, placed=how, dispatch=BALANCED.name)
        pools.append(replace(fitted_pool, result=_priced(planner, fitted_pool, placements[i])))
        notes.append(f"{pool.phase} pool: {how}")
    return Candidate(cand.kind, tuple(pools), cand.label), notes


def _fit_pool(planner: Planner, pool: PoolChoice, fit):
    """``(placement, tokens per rank, how)`` of ``pool`` fitted on its phase's steps of ``fit``; None
    when one GPU holds every expert."""
    from solver.api import FitOptions, solve

    model, o = planner.model, planner.options
    topo = pool.result.placement.topology
    if topo.ep_size == 1:
        return None
    b = _fit_step_tokens(fit.num_tokens, topo.ep_size, pool.phase)
    fo = FitOptions(
        phase=pool.phase,
        step_tokens=b,
        step_moves=o.fit_moves,
        seed=o.seed,
        model=model.name if model.name in BUILTIN_MODELS else None,
        hardware=pool.cluster.gpu.name if pool.cluster.gpu.name in HARDWARE_NAMES else FitOptions.hardware,
        time_limit=FIT_TIME_LIMIT_S,
    )
    ids = model.moe_layer_ids
    res = solve(
        o.solver, topology=topo, trace=fit, dispatch=BALANCED.name, layer_ids=ids, seed=o.seed, fit=fo
    )
    how = (
        f"fitted on {pool.phase} steps of the trace's first half ({b} tokens per rank, "
        f"{o.fit_moves} moves per layer, per-step balanced split; solver.api.solve)"
    )
    return res.placement, b, how


def _priced(planner: Planner, pool: PoolChoice, placement) -> LayoutResult:
    """The planner's figures of ``pool``'s layout with ``placement``, under the pool's dispatch."""
    opts = replace(planner.cost_options(pool.phase), dispatch=pool.dispatch)
    c = pool.result.candidate
    r = evaluate_candidate(
        planner.model, pool.cluster, c, opts, planner.load(), None, planner.search, placement
    )
    if not r.feasible:  # the sizing batch of the ranking no longer fits: keep the memory of the layout
        r = replace(pool.result, placement=placement)
    return r


def _same_topology(a, b) -> bool:
    return a.topology == b.topology and a.physical_to_logical_map.shape == b.physical_to_logical_map.shape


def _taken_text(layers: tuple[int, ...], other: str, phase: str) -> str:
    if not layers:
        return ""
    return (
        f"; {len(layers)} layer(s) ({', '.join(map(str, layers))}) taken from the {other} pool's fit, whose "
        f"rows have the lower modelled {phase} time on the fit half's {phase} steps"
    )


def exchange_layers(placements, phases, step_tokens, fit, model, cluster, seed: int = 0):
    """Each placement with, per layer, the other placement's row where that row is faster on its own
    phase: ``(placements, taken layers per placement)``.

    Two placements of one topology, fitted for ``phases`` with ``step_tokens`` per rank, are scored as
    the per-step fit scores a layer (:func:`solver.step.fit.step_seconds`: the modelled MoE layer time
    under the ``balanced`` split, :mod:`solver.step.cost` on ``model`` and ``cluster``) on every step of
    the phase in ``fit`` (one :func:`placement.steps.make_steps` pass; prefill: the disjoint steps).
    Both rows are scored on the same steps and a layer changes only where the other row is strictly
    faster; a pool's own row was searched on part of these steps, so the other row must beat it despite
    that advantage. No layer gets slower on those steps, and the placements still differ wherever their
    phases prefer different rows. Skipped (unchanged) when no model prices the trace's shape.
    """
    from placement.model import Placement
    from solver.step.cost import step_cost_for
    from solver.step.fit import sample_step_counts, step_seconds

    out, taken = list(placements), [(), ()]
    G = placements[0].topology.ep_size
    L = placements[0].num_layers
    for i, j in ((0, 1), (1, 0)):
        mine, other = placements[i], placements[j]
        spec = model if model.top_k == fit.top_k else None
        cost = step_cost_for(fit, phases[i], G, spec, cluster)
        if cost is None:
            continue
        counts = sample_step_counts(fit, G, step_tokens[i], None, seed, phases[i], per_rank=True)
        own, alt = (step_seconds(p, counts, BALANCED.name, cost, range(L)) for p in (mine, other))
        faster = alt < own * (1 - 1e-12)
        take = faster & (other.physical_to_logical_map != mine.physical_to_logical_map).any(axis=1)
        if not take.any():
            continue
        p2l = mine.physical_to_logical_map.copy()
        p2l[take] = other.physical_to_logical_map[take]
        layers = tuple(int(l) for l in np.flatnonzero(take))
        out[i] = Placement(p2l, mine.num_logical_experts, mine.topology, mine.layer_ids, mine.provenance)
        out[i] = out[i].with_provenance(layers_from_other_pool={"phase": phases[j], "layers": list(layers)})
        taken[i] = layers
    return out, taken


# The per-step fit of a pool is bounded by its moves (DeployOptions.fit_moves), not the clock: a wall-clock
# limit that a loaded machine could reach would make the same seed give another plan.
FIT_TIME_LIMIT_S = 3600.0


def _fit_step_tokens(tokens: int, ep_size: int, phase: str) -> int:
    """The phase's default tokens per rank, capped so the fit half holds at least 8 steps."""
    return int(max(1, min(DEFAULT_STEP_TOKENS[phase], tokens // (8 * ep_size))))
