"""``advise``: from a user's own routing trace, which EPLB option to run on an engine, with what figures.

Protocol (docs/metrics.md): placements are fitted on the first half of the trace's prompts and scored
on the held-out second half, per phase (decode steps and prefill chunks), as whole-step time from the
one cost model (:mod:`moe_placement.apps.advise.phases`). Steps: inputs and checks -> placements -> held-out prices
-> what the engine can run -> the choice -> rebalancing judged out of sample -> the launch command, as
one frozen :class:`Advice` whose ``to_dict()`` is the JSON contract (docs/cli.md, advise).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import moe_placement.apps.advise.balance as balance
import moe_placement.apps.advise.cost as cost
import moe_placement.apps.advise.phases as phases
import moe_placement.apps.advise.rebalance as rebalance
import moe_placement.apps.advise.recommend as recommend
from moe_placement.apps.advise.engines import ENGINES, min_redundant
from moe_placement.apps.advise.options import AdviseOptions, resolve_model
from placement.cost.hardware import DEFAULT_HARDWARE, ClusterSpec, cluster_preset, hardware_summary
from placement.cost.modelspec import ModelSpec
from placement.model import Placement
from profiling.trace import RoutingTrace

__all__ = ["Advice", "Row", "advise"]

log = logging.getLogger(__name__)
# (items, total, description) -> the same items (a progress bar, or the identity)
Progress = Callable[[Iterable, int, str], Iterable]
NO_BALANCING = "no balancing"
UNSET_OUTPUT = "OUTPUT"  # the folder named in the command when no --output is given


def _identity(items: Iterable, total: int, desc: str) -> Iterable:
    return items


@dataclass(frozen=True)
class Row:
    """One option at ``r`` redundant slots per GPU: held-out balance, per-phase prices, memory."""

    kind: str
    dispatch: str
    redundant_per_gpu: int
    placement_key: str
    scores: balance.Scores
    decode: phases.PhasePrice | None  # None: the phase was not priced (``--phase``)
    prefill: phases.PhasePrice | None
    memory: cost.MemoryCost

    @property
    def key(self) -> str:
        return f"{self.kind}|{self.dispatch}|r{self.redundant_per_gpu}"

    def phase(self, name: str) -> phases.PhasePrice | None:
        return self.decode if name == "decode" else self.prefill

    @property
    def priced(self) -> tuple[str, ...]:
        """The phases this row was priced on (both, or the one ``--phase`` asked for)."""
        return tuple(ph for ph in phases.PHASES if self.phase(ph) is not None)


def _rounded(x: Any) -> Any:
    """Floats to 6 significant digits (stable, readable JSON), recursively."""
    if isinstance(x, float):
        return float(f"{x:.6g}") if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


def phase_figures(row: Row, base: Row, name: str, engine: str) -> dict:
    """One phase of the contract: whole-step and MoE gains over ``base`` (with the band), the dispatch's
    own per-step cost, memory and KV tokens the replicas take."""
    p, b = row.phase(name), base.phase(name)
    g, band = phases.gain(p, b)
    lo, hi, _ = phases.published_band(name)
    return {
        "whole_step_gain": g,
        "band": band,
        "published_band": [lo / 100.0, hi / 100.0],
        "moe_step_gain": b.moe_ms / p.moe_ms - 1.0 if p.moe_ms > 0 else 0.0,
        "dispatch_overhead_ms": p.dispatch_overhead_ms,
        "memory_gb": row.memory.redundant_bytes / 1e9,
        "kv_tokens_lost": row.memory.kv_tokens_lost,
        "whole_ms": p.whole_ms,
        "baseline_whole_ms": b.whole_ms,
        "moe_ms": p.moe_ms,
        "step_tokens": p.step_tokens,
        "held_out_steps": p.num_steps,
        "deepep_mode": ENGINES[engine].deepep_modes[name],
    }


@dataclass(frozen=True)
class Advice:
    """What :func:`advise` found; ``to_dict`` is the ``--json`` payload and the HTML report's data.

    ``placements`` (key -> :class:`Placement`), ``held_out`` and ``files`` (path in ``--output`` ->
    placement and format to write there) are kept for checks and the CLI, left out of ``to_dict``.
    """

    context: Mapping[str, Any]
    rows: tuple[Row, ...]
    baseline: str
    chosen: str
    available: Mapping[str, tuple[bool, str]]
    launch: recommend.Launch
    rebalance: rebalance.Rebalance
    reason: str
    summary: str
    held_out_steps: Mapping[str, int]
    assumptions: tuple[str, ...]
    warnings: tuple[str, ...]
    placements: Mapping[str, Placement] = field(default_factory=dict, repr=False, compare=False)
    held_out: RoutingTrace | None = field(default=None, repr=False, compare=False)
    files: Mapping[str, tuple[Placement, int]] = field(default_factory=dict, repr=False, compare=False)

    def row(self, key: str) -> Row:
        return next(r for r in self.rows if r.key == key)

    def placement_of(self, row: Row) -> Placement:
        return self.placements[row.placement_key]

    def recommendation(self) -> dict:
        """The contract's ``recommendation`` object."""
        row, base, engine = self.row(self.chosen), self.row(self.baseline), self.context["engine"]
        return {
            "option": NO_BALANCING if row is base else row.key,
            "reason": self.reason,
            "flags": list(self.launch.flags),
            "env": list(self.launch.env),
            "launch_command": self.launch.command,
            "files": list(self.launch.files),
            "phases": {ph: phase_figures(row, base, ph, engine) for ph in base.priced},
            "rebalance": self.rebalance.to_dict(),
        }

    def _option(self, r: Row) -> dict:
        base, engine = self.row(self.baseline), self.context["engine"]
        ok, why = self.available[r.key]
        return {
            "key": r.key, "option": r.kind, "dispatch": r.dispatch, "redundant_per_gpu": r.redundant_per_gpu,
            "available": ok, "unavailable_reason": why or None, "fits": r.memory.fits,
            "window_par": r.scores.window_par, "step_par_decode": r.scores.step_par_decode,
            "step_par_prefill": r.scores.step_par_prefill,
            "phases": {ph: phase_figures(r, base, ph, engine) for ph in base.priced},
        }  # fmt: skip

    def to_dict(self) -> dict:
        return _rounded(
            {
                "recommendation": self.recommendation(),
                "summary": self.summary,
                "held_out_steps": dict(self.held_out_steps),
                "assumptions": list(self.assumptions),
                "warnings": list(self.warnings),
                "context": dict(self.context),
                "options": [self._option(r) for r in self.rows],
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
    if "decode" in options.priced_phases and held.num_tokens < options.ep_size * options.decode_step_tokens:
        raise ValueError(
            f"the held-out half has {held.num_tokens} tokens, fewer than one decode step of "
            f"{options.decode_step_tokens} tokens x {options.ep_size} ranks; use a smaller --decode-batch or a longer trace"
        )
    return trace, fit, held


def _step_tokens(held: RoutingTrace, options: AdviseOptions) -> dict[str, int]:
    every = {"decode": options.decode_step_tokens, "prefill": balance.prefill_tokens(held, options)}
    return {ph: every[ph] for ph in options.priced_phases}


def _held_out_checks(held: RoutingTrace, options: AdviseOptions) -> tuple[dict[str, int], list[str]]:
    """Held-out steps per phase; a warning (ValueError with ``strict``) below ``min_held_out_steps``."""
    counts = {
        ph: phases.count_steps(held, options.ep_size, ph, b) for ph, b in _step_tokens(held, options).items()
    }
    warnings = []
    for ph, n in counts.items():
        if n < options.min_held_out_steps:
            msg = (
                f"only {n} held-out {ph} steps (fewer than {options.min_held_out_steps}): the {ph} figures "
                f"rest on too few steps; use a longer trace or a smaller step"
            )
            if options.strict:
                raise ValueError(f"--strict: {msg}")
            warnings.append(msg)
    return counts, warnings


def _run(steps: list[tuple[str, Callable[[], Any]]], progress: Progress, desc: str) -> list[Any]:
    out = []
    for name, fn in progress(steps, len(steps), desc):
        log.debug("advise: %s", name)
        out.append(fn())
    return out


def _rows(fit, held, model, cluster, options, progress) -> tuple[list[Row], dict[str, Placement], dict]:
    """Placements for every option, then each row priced per phase on the held-out steps."""
    opts, builds = balance.plan_options(fit, options)
    built = _run([(d, b) for _, d, b in builds], progress, "placements")
    placements = {k: p for (k, _, _), p in zip(builds, built)}
    steps = {
        ph: phases.held_out_steps(held, options.ep_size, ph, b, options.seed)
        for ph, b in _step_tokens(held, options).items()
    }

    def one(o: balance.Option) -> Row:
        pl = placements[o.placement_key]
        s = balance.score(pl, held, o.dispatch, options)
        price = {
            ph: phases.price_phase(pl, held, st, o.dispatch, model, cluster, options.context_len)
            for ph, st in steps.items()
        }
        # (E + R0) / G = ceil(E / G): the engines' minimum R0 fills the padding; r slots are on top
        r, b = o.redundant_per_gpu, options.decode_step_tokens
        mem = cost.replica_memory(model, cluster, options.ep_size, r, b, options.context_len)
        return Row(
            o.kind,
            o.dispatch,
            o.redundant_per_gpu,
            o.placement_key,
            s,
            price.get("decode"),
            price.get("prefill"),
            mem,
        )

    rows = _run([(o.key, lambda o=o: one(o)) for o in opts], progress, "held-out prices")
    return rows, placements, steps


def _assumptions(
    model: ModelSpec, cluster: ClusterSpec, options, steps: dict, source: str
) -> tuple[str, ...]:
    calibrated = options.hardware_calibrated or cluster.measured
    parts = ", ".join(hardware_summary(cluster)["measured_parts"]) or "asserted by the caller"
    cal = f"measured ({parts}; preset {cluster.preset})" if calibrated else "analytic, not calibrated"
    caps = ENGINES[options.engine]
    out = [
        f"cost model: {cal}; hardware preset {cluster.name} ({cluster.gpu.source})",
        phases.MODEL_NOTE,
        "balance: placements fitted on the first half of the trace's prompts, priced on the held-out second half",
        *(f"held-out {ph}: {st.describe()}" for ph, st in steps.items()),
        "gains are whole-step throughput over the no-EPLB baseline; band = 2 standard errors over blocks of steps",
        f"engine capabilities: {options.engine} {caps.version} (moe_placement/apps/advise/engines.py, read from its code)",
        f"memory: decode at {options.decode_step_tokens} sequences per rank, context {options.context_len}; "
        f"KV tokens lost = redundant expert bytes / {model.name}'s KV bytes per token",
        f"rebalance stall: {source}",
    ]
    if options.phase is not None:
        out.append(f"--phase {options.phase}: priced and recommended on {options.phase} steps only")
    if "prefill" in steps and steps["prefill"].step_tokens < options.prefill_step_tokens:
        out.append(
            f"prefill chunk {options.prefill_step_tokens} tokens per rank capped to {steps['prefill'].step_tokens}"
        )
    if options.quick:
        out.append(f"--quick: the first {options.quick_prompts} prompts only, fewer options and budgets")
    return tuple(out)


def _band_warnings(row: Row, base: Row, E: int, G: int, model: str) -> list[str]:
    """A warning per phase where the chosen row's modelled whole-step gain is outside the published band,
    with what makes this deployment differ (experts per GPU, step PAR, the MoE share of the step)."""
    out = []
    for ph in row.priced if row is not base else ():
        p, b = row.phase(ph), base.phase(ph)
        g = phases.gain(p, b)[0]
        par = {r.key: getattr(r.scores, f"step_par_{ph}") for r in (row, base)}
        why = (
            f"{E} experts on {G} GPUs leave {E / G:.3g} per GPU; without balancing the busiest GPU carries "
            f"{par[base.key]:.2f}x the mean load of a {ph} step ({par[row.key]:.2f}x with this option), and the "
            f"MoE layers are {b.moe_ms / b.whole_ms * 100:.0f}% of the modelled {model} {ph} step; the published "
            f"figures are at DeepSeek-V3 scale (256 experts, 8 per GPU at EP32)"
        )
        msg = phases.band_warning(ph, g, why)
        if msg:
            out.append(msg)
    return out


def _pub(figures: dict) -> str:
    lo, hi = figures["published_band"]
    return f"{lo * 100:g}-{hi * 100:g}%"


def _summary(
    engine: str, row: Row, base: Row, reason: str, rb: rebalance.Rebalance, launch, notes: list[str]
) -> str:
    """One paragraph, built from the same figures as the JSON."""
    if row is base:
        text = f"Run {engine} without expert balancing ({reason})."
    else:
        figs = {ph: phase_figures(row, base, ph, engine) for ph in row.priced}
        gains = ", ".join(
            f"{ph} {f['whole_step_gain'] * 100:+.2f}% (band {f['band'] * 100:.2f}%; published {_pub(f)})"
            for ph, f in figs.items()
        )
        f = next(iter(figs.values()))
        text = (
            f"Run {engine} with {row.kind}, dispatch {row.dispatch}, {row.redundant_per_gpu} redundant slot(s) "
            f"per GPU ({reason}): modelled whole step {gains}, for {f['memory_gb']:.2f} GB per GPU "
            f"({f['kv_tokens_lost']:,.0f} KV tokens)."
        )
    text += (
        f" Rebalance: {'every ' + format(rb.interval_steps, ',') + ' steps' if rb.interval_steps else 'none'}"
    )
    text += f" ({rb.reason})."
    text += "".join(f" Warning: {n[0].upper()}{n[1:]}." for n in notes)
    return text + f" Command: {launch.command}"


def advise(
    trace: RoutingTrace,
    model: str = "auto",
    hardware: str = DEFAULT_HARDWARE,
    options: AdviseOptions | None = None,
    progress: Progress | None = None,
    output: str = UNSET_OUTPUT,
    **kw: Any,
) -> Advice:
    """Advice for serving ``trace``'s model on ``options.engine`` (keywords build :class:`AdviseOptions`).

    Args:
        trace: per-token routing (:class:`RoutingTrace` with ``topk_ids [T, L, k]``).
        model: a built-in model name, a model JSON, or ``auto`` (the built-in with the trace's shape).
        hardware: a GPU preset name or a preset JSON from ``benchmarks/gpu_gemm_fit.py``.
        progress: wraps each stage (``(items, total, description) -> items``), e.g. a progress line.
        output: the folder the launch command's files are named in (the CLI's ``--output``).
    """
    if options is not None and kw:
        raise ValueError(f"advise takes options or keywords, not both (got options and {sorted(kw)[0]}=...)")
    options = options if options is not None else AdviseOptions.from_fields(kw)
    if not isinstance(options, AdviseOptions):
        raise ValueError(f"options must be an AdviseOptions, got {type(options).__name__}")
    if not isinstance(trace, RoutingTrace):
        raise ValueError(
            f"trace must be a profiling.trace.RoutingTrace (read_trace), got {type(trace).__name__}"
        )
    progress = progress or _identity
    trace, fit, held = _inputs(trace, options)
    spec = resolve_model(model, trace)
    cluster = cluster_preset(hardware, gpus_per_node=options.gpus_per_node)
    steps, warnings = _held_out_checks(held, options)
    rows, placements, steps_used = _rows(fit, held, spec, cluster, options, progress)
    base = next(r for r in rows if r.kind == balance.NO_EPLB)
    available = {r.key: recommend.availability(options.engine, spec.name, r) for r in rows}
    choice = recommend.choose(rows, base, available)
    rb = _rebalance(held, choice.row, base, placements, spec, cluster, options, progress)
    E, G = trace.num_logical_experts, options.ep_size
    redundant = min_redundant(E, G) + choice.row.redundant_per_gpu * G
    launch = recommend.launch(
        options.engine, choice.row, spec.name, options, redundant, rb.interval_steps, output
    )
    files = {f: (placements[choice.row.placement_key], spec.num_layers) for f in launch.files}
    if launch.files and output == UNSET_OUTPUT:
        warnings.append(
            f"the command names {', '.join(launch.files)}: pass --output DIR to write the file there"
        )
    above = _band_warnings(choice.row, base, E, G, spec.name)
    warnings += above
    if min_redundant(E, G):
        warnings.append(
            f"{E} experts on {G} GPUs: {min_redundant(E, G)} redundant slots are needed in every option"
        )
    context = {
        "trace": {"name": trace.name, "tokens": trace.num_tokens, "experts": E, "top_k": trace.top_k,
                  "layers": trace.num_layers, "fit_tokens": fit.num_tokens, "held_out_tokens": held.num_tokens},
        "model": spec.name, "hardware": cluster.name, "engine": options.engine,
        "engine_version": ENGINES[options.engine].version, "nodes": options.nodes,
        "gpus_per_node": options.gpus_per_node, "decode_step_tokens": options.decode_step_tokens,
        "prefill_tokens_per_rank": balance.prefill_tokens(held, options), "context_len": options.context_len,
        "phases": list(options.priced_phases),
        "quick": options.quick, "calibrated": options.hardware_calibrated or cluster.measured,
        "replica_gb_limit": (base.memory.spare_bytes + base.memory.redundant_bytes) / 1e9,
    }  # fmt: skip
    return Advice(
        context=context, rows=tuple(rows), baseline=base.key, chosen=choice.row.key, available=available,
        launch=launch, rebalance=rb, reason=choice.reason,
        summary=_summary(options.engine, choice.row, base, choice.reason, rb, launch, above),
        held_out_steps=steps, warnings=tuple(warnings),
        assumptions=_assumptions(spec, cluster, options, steps_used, rebalance.stall(options.engine)[1]),
        placements=placements, held_out=held, files=files,
    )  # fmt: skip


def _rebalance(held, row, base, placements, model, cluster, options, progress) -> rebalance.Rebalance:
    """Periodic rebalancing of the chosen row, judged out of sample on the held-out windows."""
    topo = balance.trace_topology(held.num_logical_experts, row.redundant_per_gpu, options)
    static = None if row is base else placements[row.placement_key]

    ph = options.priced_phases[0]  # decode when it is priced

    def price(pl: Placement, window: RoutingTrace) -> float:
        steps = phases.held_out_steps(
            window, options.ep_size, ph, _step_tokens(window, options)[ph], options.seed
        )
        return phases.price_phase(
            pl, window, steps, row.dispatch, model, cluster, options.context_len
        ).whole_ms

    (out,) = _run(
        [("rebalance", lambda: rebalance.judge(held, static, topo, price, options.engine, options.step_tokens(ph),
                                               options.windows, options.rebalance_margin))],
        progress, "rebalance",
    )  # fmt: skip
    return out
