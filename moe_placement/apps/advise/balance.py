"""The balance side of the advice: the options an engine offers, their placements (fitted on the first
half of the trace) and their held-out scores (the second half), per redundant slots per GPU.

Shapes: L layers, E logical experts (the trace's), P physical slots, G EP ranks, r redundant slots per GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moe_placement.apps.advise.engines import min_redundant
from moe_placement.apps.advise.options import AdviseOptions, engine_dispatches, runtime_step_dispatches
from placement.dispatch import EVEN, DispatchModel
from placement.metrics import balance_stats, step_par, trace_gpu_load
from placement.model import Placement
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.api import FitOptions, run
from solver.problem import Problem

__all__ = [
    "ENGINE",
    "NO_EPLB",
    "OURS",
    "RUNTIME",
    "Option",
    "Scores",
    "plan_options",
    "score",
    "trace_topology",
]

NO_EPLB = "no EPLB"  # trivial placement, no redundant slots, the engine's plain routing
ENGINE = "engine EPLB"  # the engine's own balancer (DeepSeek's algorithm = our greedy), its dispatch
OURS = "ours"  # our solver through the pipeline, fitted for the engine's dispatch table
RUNTIME = "ours, our runtime"  # our placement under a per-step dispatch only our runtime executes


@dataclass(frozen=True)
class Option:
    """One row to score: which placement, under which dispatch model, at ``r`` redundant slots per GPU."""

    kind: str
    dispatch: str
    redundant_per_gpu: int
    placement_key: str

    @property
    def key(self) -> str:
        return f"{self.kind}|{self.dispatch}|r{self.redundant_per_gpu}"


@dataclass(frozen=True)
class Scores:
    """Held-out balance of one row: window PAR and per-step PAR at the decode and prefill batches."""

    window_par: float
    step_par_decode: float
    step_par_prefill: float


def trace_topology(num_experts: int, redundant_per_gpu: int, options: AdviseOptions) -> Topology:
    """``E + R0 + r G`` slots over ``G`` GPUs on ``nodes`` nodes, ``R0`` the fewest redundant slots that
    make ``(E + R0) % G == 0`` (the engines' rule; 60 experts on 16 GPUs need 4)."""
    G = options.ep_size
    return Topology.from_redundant(
        num_experts, min_redundant(num_experts, G) + redundant_per_gpu * G, G, options.nodes
    )


def _solve(name: str, topo: Topology, fit: RoutingTrace, dispatch: str, options: AdviseOptions) -> Placement:
    problem = Problem.build(topo, trace=fit, dispatch=dispatch)
    fo = FitOptions(steps=options.fit_steps, seed=options.seed, dealings=options.fit_dealings)
    return run(name, problem, fit=fo).placement


def plan_options(
    fit: RoutingTrace, options: AdviseOptions
) -> tuple[list[Option], list[tuple[str, str, Callable[[], Placement]]]]:
    """The rows and the placements they need: ``(options, [(placement key, description, build)])``.

    ``ours`` rows appear only where they differ from the engine's EPLB: under a table dispatch model
    (fitted for it) or with a solver other than the baseline.
    """
    E, L = fit.num_logical_experts, fit.num_layers
    rows: list[Option] = [Option(NO_EPLB, EVEN.name, 0, "trivial")]
    t0 = trace_topology(E, 0, options)
    builds: list[tuple[str, str, Callable[[], Placement]]] = [
        ("trivial", "trivial placement", lambda: Placement.trivial(L, E, t0, fit.layer_ids))
    ]
    engine = engine_dispatches(options.engine)
    for r in options.redundant_per_gpu:
        topo = trace_topology(E, r, options)
        gk = f"greedy|r{r}"
        builds.append(
            (gk, f"engine EPLB placement, r={r}", _builder("greedy", topo, fit, EVEN.name, options))
        )
        if r == 0:  # one replica per expert: every dispatch model routes alike, one row says it
            rows.append(Option(ENGINE, engine[0].name, 0, gk))
            continue
        rows += [Option(ENGINE, d.name, r, gk) for d in engine]
        for d in engine:
            if d.table or options.solver != "greedy":
                ok = f"{options.solver}|{d.name}|r{r}"
                builds.append(
                    (ok, f"ours for {d.name}, r={r}", _builder(options.solver, topo, fit, d.name, options))
                )
                rows.append(Option(OURS, d.name, r, ok))
        rows += [Option(RUNTIME, d.name, r, gk) for d in runtime_step_dispatches()]
    return rows, builds


def _builder(name: str, topo: Topology, fit: RoutingTrace, dispatch: str, options: AdviseOptions):
    return lambda: _solve(name, topo, fit, dispatch, options)


def prefill_tokens(held: RoutingTrace, options: AdviseOptions) -> int:
    """The prefill chunk per rank, capped so one step fits in the held-out tokens."""
    return max(1, min(options.prefill_step_tokens, held.num_tokens // options.ep_size))


def score(
    placement: Placement, held: RoutingTrace, dispatch: str | DispatchModel, options: AdviseOptions
) -> Scores:
    """Held-out window PAR, and the per-step PAR of the decode steps (the decode batch) and of the
    prefill chunks (:func:`placement.metrics.step_par` with ``phase``)."""
    gl = trace_gpu_load(placement, held, dispatch, step_tokens=options.decode_step_tokens)  # [L, G]
    window = balance_stats(gl)["par"]
    dec = step_par(placement, held, options.decode_step_tokens, dispatch, "decode", seed=options.seed)[
        "step_par"
    ]
    pre = step_par(placement, held, prefill_tokens(held, options), dispatch, "prefill")["step_par"]
    return Scores(float(window), float(dec), float(pre))
