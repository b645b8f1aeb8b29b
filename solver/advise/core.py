"""``advise``: from a user's own routing trace, which EPLB option to run on an engine, with what figures.

Protocol (docs/metrics.md): placements are fitted on the first half of the trace's prompts and scored
on the held-out second half; every figure names its dispatch model, its cost model and its assumptions.
Steps: inputs -> placements -> held-out scores and cost rows -> choice -> drift, migration front and
break-even -> recommendation, as one frozen :class:`Advice`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import solver.advise.balance as balance
import solver.advise.cost as cost
import solver.advise.migration as migration
import solver.advise.recommend as recommend
from placement.cost.hardware import ClusterSpec, cluster_preset
from placement.cost.modelspec import ModelSpec
from placement.model import Placement
from profiling.trace import RoutingTrace
from solver.advise.options import AdviseOptions, resolve_model

__all__ = ["Advice", "Row", "advise"]

log = logging.getLogger(__name__)
# (items, total, description) -> the same items (a progress bar, or the identity)
Progress = Callable[[Iterable, int, str], Iterable]
BATCHES = tuple(2**i for i in range(15))  # tokens per rank of the step-time curve


def _identity(items: Iterable, total: int, desc: str) -> Iterable:
    return items


@dataclass(frozen=True)
class Row:
    """One option at ``r`` redundant slots per GPU: held-out balance, modelled step times, memory."""

    kind: str
    dispatch: str
    redundant_per_gpu: int
    placement_key: str
    scores: balance.Scores
    decode: cost.StepTime
    prefill: cost.StepTime
    memory: cost.MemoryCost

    @property
    def key(self) -> str:
        return f"{self.kind}|{self.dispatch}|r{self.redundant_per_gpu}"

    def to_dict(self) -> dict:
        return _rounded(
            {
                "option": self.kind,
                "dispatch": self.dispatch,
                "redundant_per_gpu": self.redundant_per_gpu,
                **asdict(self.scores),
                "decode_moe_ms": self.decode.step_s * 1e3,
                "decode_memory_bound": self.decode.memory_bound,
                "prefill_moe_ms": self.prefill.step_s * 1e3,
                "prefill_memory_bound": self.prefill.memory_bound,
                "redundant_gb_per_gpu": self.memory.redundant_bytes / 1e9,
                "kv_tokens_lost_per_gpu": self.memory.kv_tokens_lost,
                "kv_tokens_left_per_gpu": self.memory.kv_tokens_left,
                "fits": self.memory.fits,
            }
        )


def _rounded(x: Any) -> Any:
    """Floats to 6 significant digits (stable, readable JSON), recursively."""
    if isinstance(x, float):
        return float(f"{x:.6g}") if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


@dataclass(frozen=True)
class Advice:
    """What :func:`advise` found; ``to_dict`` is the ``--json`` payload and the HTML report's data.

    ``placements`` (key -> :class:`Placement`, the trace's experts) and ``held_out`` are kept for
    checks (``placement.metrics.evaluate``) and left out of ``to_dict``.
    """

    context: Mapping[str, Any]
    rows: tuple[Row, ...]
    chosen: str
    drift: Mapping[str, Any]
    front: tuple[Mapping[str, Any], ...]
    break_even: Mapping[str, Any]
    step_curve: Mapping[str, Any]
    flags: tuple[str, ...]
    recommendation: str
    assumptions: tuple[str, ...]
    placements: Mapping[str, Placement] = field(default_factory=dict, repr=False, compare=False)
    held_out: RoutingTrace | None = field(default=None, repr=False, compare=False)

    def row(self, key: str) -> Row:
        return next(r for r in self.rows if r.key == key)

    def placement_of(self, row: Row) -> Placement:
        return self.placements[row.placement_key]

    def to_dict(self) -> dict:
        return _rounded(
            {
                "context": dict(self.context),
                "rows": [{"key": r.key, **r.to_dict()} for r in self.rows],
                "chosen": self.chosen,
                "recommendation": self.recommendation,
                "flags": list(self.flags),
                "drift": dict(self.drift),
                "break_even": dict(self.break_even),
                "migration_front": [dict(p) for p in self.front],
                "step_curve": dict(self.step_curve),
                "assumptions": list(self.assumptions),
            }
        )


def _inputs(trace: RoutingTrace, options: AdviseOptions) -> tuple[RoutingTrace, RoutingTrace, RoutingTrace]:
    """``(trace used, fit half, held-out half)``; ValueError when the trace cannot be advised on."""
    if not trace.has_tokens:
        raise ValueError(
            f"advise needs a per-token trace (topk_ids): {trace.name!r} has counts only, and step PAR, the "
            f"engines' token-level dispatch and the drift windows need tokens"
        )
    if options.quick and len(trace.natural_windows()) > options.quick_prompts:
        trace = trace.select_windows(range(options.quick_prompts))
    fit, held = trace.split(0.5)
    if held.num_tokens < options.ep_size * options.decode_batch:
        raise ValueError(
            f"the held-out half has {held.num_tokens} tokens, fewer than one decode step of "
            f"{options.decode_batch} tokens x {options.ep_size} ranks; use a smaller --decode-batch or a longer trace"
        )
    return trace, fit, held


def _run(steps: list[tuple[str, Callable[[], Any]]], progress: Progress, desc: str) -> list[Any]:
    out = []
    for name, fn in progress(steps, len(steps), desc):
        log.debug("advise: %s", name)
        out.append(fn())
    return out


def _rows(fit, held, model, cluster, options, progress) -> tuple[list[Row], dict[str, Placement]]:
    """Placements for every option, then each row scored on the held-out half and costed."""
    opts, builds = balance.plan_options(fit, options)
    built = _run([(d, b) for _, d, b in builds], progress, "placements")
    placements = {k: p for (k, _, _), p in zip(builds, built)}
    prefill_b = balance.prefill_tokens(held, options)
    G, N = options.ep_size, options.nodes

    def one(o: balance.Option) -> Row:
        s = balance.score(placements[o.placement_key], held, o.dispatch, options)
        S = cost.model_slots_per_gpu(model, G, o.redundant_per_gpu)
        dec = cost.moe_step_time(model, cluster, N, S, s.step_par_decode, options.decode_batch)
        pre = cost.moe_step_time(model, cluster, N, S, s.step_par_prefill, prefill_b)
        mem = cost.replica_memory(
            model, cluster, G, o.redundant_per_gpu, options.decode_batch, options.context_len
        )
        return Row(o.kind, o.dispatch, o.redundant_per_gpu, o.placement_key, s, dec, pre, mem)

    rows = _run([(o.key, lambda o=o: one(o)) for o in opts], progress, "held-out scores")
    return rows, placements


def _migration(trace, fit, held, row, model, cluster, options, progress):
    """Drift, the migration front and the break-even at the chosen row's slots and dispatch."""
    topo = balance.trace_topology(trace.num_logical_experts, row.redundant_per_gpu, options)
    N = options.nodes
    dsteps, drift_of = migration.drift_steps(trace, topo, row.dispatch, options.windows, model, cluster, N)
    fsteps, front_of = migration.front_steps(
        fit, held, topo, row.dispatch, options.move_fractions, options.windows, (model, cluster, N)
    )
    _run(dsteps + fsteps, progress, "migration")
    drift, front = drift_of(), front_of()
    S = cost.model_slots_per_gpu(model, options.ep_size, row.redundant_per_gpu)
    be = migration.break_even(drift, model, cluster, N, S, row.scores.step_par_decode, options.decode_batch)
    return drift, front, be


def _step_curve(rows: list[Row], chosen: Row, baseline: Row, model, cluster, options) -> dict:
    """Decode MoE step time over batch sizes for the chosen row and no EPLB, with the crossovers."""
    out: dict[str, Any] = {"batch_per_rank": list(BATCHES), "series": []}
    for r in (baseline, chosen) if chosen is not baseline else (chosen,):
        S = cost.model_slots_per_gpu(model, options.ep_size, r.redundant_per_gpu)
        times = [
            cost.moe_step_time(model, cluster, options.nodes, S, r.scores.step_par_decode, b).step_s * 1e3
            for b in BATCHES
        ]
        x = cost.crossover_batch(model, cluster, S, r.scores.step_par_decode)
        out["series"].append({"key": r.key, "step_ms": times, "crossover_batch": x})
    return out


def _assumptions(model: ModelSpec, cluster: ClusterSpec, exact_note: str | None, options, held, prefill_b):
    cal = (
        "calibrated (benchmarks/gpu_gemm_fit.py data)"
        if options.hardware_calibrated
        else "analytic, not calibrated"
    )
    out = [
        f"cost model: {cal}; hardware preset {cluster.name} ({cluster.gpu.source})",
        cost.FORMULA,
        "balance: placements fitted on the first half of the trace's prompts, scored on the held-out second half",
        f"per-step PAR: {options.decode_batch} tokens per rank per decode step, {prefill_b} per prefill step "
        f"(consecutive held-out tokens on each of the {options.ep_size} ranks)",
        "engine EPLB = DeepSeek's replicate-then-pack algorithm (our greedy); no EPLB = trivial placement, "
        "one replica per expert",
        f"memory: decode at {options.decode_batch} sequences per rank, context {options.context_len}; "
        f"KV tokens lost = redundant expert bytes / {model.name}'s KV bytes per token",
    ]
    if prefill_b < options.prefill_chunk:
        out.append(
            f"prefill chunk {options.prefill_chunk} tokens per rank capped to {prefill_b}: one step of "
            f"{options.ep_size} ranks must fit in the {held.num_tokens} held-out tokens"
        )
    out.append("at 0 redundant slots every expert has one replica: all dispatch models route alike (one row)")
    if exact_note:
        out.insert(0, exact_note)
    if options.quick:
        out.append(f"--quick: the first {options.quick_prompts} prompts only, fewer options and budgets")
    return tuple(out)


def advise(
    trace: RoutingTrace,
    model: str = "auto",
    hardware: str = "h200",
    options: AdviseOptions | None = None,
    progress: Progress | None = None,
    **kw: Any,
) -> Advice:
    """Advice for serving ``trace``'s model on ``options.engine`` (keywords build :class:`AdviseOptions`).

    Args:
        trace: per-token routing (:class:`RoutingTrace` with ``topk_ids [T, L, k]``).
        model: a built-in model name, a model JSON, or ``auto`` (the built-in with the trace's experts).
        hardware: a GPU preset name or a preset JSON from ``benchmarks/gpu_gemm_fit.py``.
        progress: wraps each loop (``(items, total, description) -> items``), e.g. a progress bar.
    """
    options = options or AdviseOptions(**kw)
    progress = progress or _identity
    spec, exact, note = resolve_model(model, trace)
    cluster = cluster_preset(hardware, gpus_per_node=options.gpus_per_node)
    trace, fit, held = _inputs(trace, options)
    rows, placements = _rows(fit, held, spec, cluster, options, progress)
    chosen = recommend.choose_row(rows)
    baseline = next(r for r in rows if r.kind == balance.NO_EPLB)
    drift, front, be = _migration(trace, fit, held, chosen, spec, cluster, options, progress)
    steps = None if be.interval_steps is None else int(math.ceil(be.interval_steps))
    flags = recommend.launch_flags(options.engine, chosen, options.ep_size, steps)
    text = recommend.recommendation_text(options.engine, chosen, baseline, rows, be, flags, spec.name)
    prefill_b = balance.prefill_tokens(held, options)
    context = {
        "trace": {"name": trace.name, "tokens": trace.num_tokens, "experts": trace.num_logical_experts,
                  "top_k": trace.top_k, "layers": trace.num_layers, "fit_tokens": fit.num_tokens,
                  "held_out_tokens": held.num_tokens},
        "model": spec.name, "exact": exact, "hardware": cluster.name, "engine": options.engine,
        "nodes": options.nodes, "gpus_per_node": options.gpus_per_node, "decode_batch": options.decode_batch,
        "prefill_tokens_per_rank": prefill_b, "quick": options.quick,
    }  # fmt: skip
    return Advice(
        context=context,
        rows=tuple(rows),
        chosen=chosen.key,
        drift={
            "dispatch": chosen.dispatch,
            "redundant_per_gpu": chosen.redundant_per_gpu,
            "stale_par": list(drift.stale_par),
            "fresh_par": list(drift.fresh_par),
            "ratio": drift.ratio,
            "window_tokens": drift.window_tokens,
            "moves": [asdict(m) for m in drift.moves],
        },  # fmt: skip
        front=tuple({**asdict(p), "move": asdict(p.move)} for p in front),
        break_even=asdict(be),
        step_curve=_step_curve(rows, chosen, baseline, spec, cluster, options),
        flags=tuple(flags),
        recommendation=text,
        assumptions=_assumptions(spec, cluster, note, options, held, prefill_b),
        placements=placements,
        held_out=held,
    )
