"""``advise``: from a user's own routing trace, which EPLB option to run on an engine, with what figures.

Protocol (docs/metrics.md): placements are fitted on the first half of the trace's prompts and scored
on the held-out second half, per phase (decode steps and prefill chunks), as whole-step time from the
one cost model (:mod:`moe_placement.apps.advise.phases`). Steps: inputs and checks -> placements -> held-out prices
-> what the engine can run -> the choice -> rebalancing judged out of sample -> the launch command, as
one frozen :class:`Advice` whose ``to_dict()`` is the JSON contract (docs/cli.md, advise).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any, NamedTuple

import moe_placement.apps.advise.balance as balance
import moe_placement.apps.advise.choice as choice_
import moe_placement.apps.advise.cost as cost
import moe_placement.apps.advise.notes as notes
import moe_placement.apps.advise.phases as phases
import moe_placement.apps.advise.pricing as pricing
import moe_placement.apps.advise.rebalance as rebalance
import moe_placement.apps.advise.recommend as recommend
import moe_placement.apps.advise.stability as stability
from moe_placement.apps.advise.advice import NO_BALANCING, Advice, Row
from moe_placement.apps.advise.engines import ENGINES, min_redundant
from moe_placement.apps.advise.options import AdviseOptions, resolve_model
from placement.cost.hardware import DEFAULT_HARDWARE, ClusterSpec, cluster_preset, hardware_summary
from placement.cost.modelspec import ModelSpec
from placement.model import Placement
from profiling.from_counts import DEFAULT_MAX_TOKENS, tokens_from_counts
from profiling.trace import RoutingTrace

__all__ = ["NO_BALANCING", "Advice", "Row", "advise"]

log = logging.getLogger(__name__)
Progress = pricing.Progress
UNSET_OUTPUT = "OUTPUT"  # the folder named in the command when no --output is given


def _identity(items: Iterable, total: int, desc: str) -> Iterable:
    return items


def _inputs(trace: RoutingTrace, options: AdviseOptions) -> tuple[RoutingTrace, RoutingTrace, RoutingTrace]:
    """``(trace used, fit half, held-out half)``; ValueError when the trace cannot be advised on."""
    if options.quick and len(trace.natural_windows()) > options.quick_prompts:
        trace = trace.select_windows(range(options.quick_prompts))
    fit, held = trace.split(0.5)
    if options.fit_half == "second":
        fit, held = held, fit
    if "decode" in options.priced_phases and held.num_tokens < options.ep_size * options.decode_step_tokens:
        raise ValueError(
            f"the held-out half has {held.num_tokens} tokens, fewer than one decode step of "
            f"{options.decode_step_tokens} tokens x {options.ep_size} ranks; use a smaller --decode-batch or a longer trace"
        )
    return trace, fit, held


def _held_out_checks(held: RoutingTrace, options: AdviseOptions) -> tuple[dict[str, int], list[str]]:
    """Held-out steps per phase; a warning (ValueError with ``strict``) below ``min_held_out_steps``."""
    counts = {
        ph: phases.count_steps(held, options.ep_size, ph, b)
        for ph, b in pricing.step_tokens(held, options).items()
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


class _Inputs(NamedTuple):
    """What the advice is computed from: the trace used (``--quick`` may cut it), its fit and held-out
    halves, the cost-side model and the cluster."""

    trace: RoutingTrace
    fit: RoutingTrace
    held: RoutingTrace
    model: ModelSpec
    cluster: ClusterSpec


class _Decision(NamedTuple):
    """Every option priced, the baseline, what the engine can run and the choice."""

    rows: list[Row]
    base: Row
    available: dict[str, tuple[bool, str]]
    choice: choice_.Choice
    placements: dict[str, Placement]
    steps_used: dict


def _checked_call(trace: Any, options: AdviseOptions | None, kw: dict, progress, output) -> AdviseOptions:
    """The options of one call (an :class:`AdviseOptions` or keywords, not both), the other arguments'
    types checked."""
    if progress is not None and not callable(progress):
        raise ValueError(
            f"progress must be None or a callable (items, total, description) -> items, got {progress!r}"
        )
    if not isinstance(output, (str, os.PathLike)) or not os.fspath(output):
        raise ValueError(
            f"output must be a folder path (the launch command names its files there), got {output!r}"
        )
    if options is not None and kw:
        raise ValueError(f"advise takes options or keywords, not both (got options and {sorted(kw)[0]}=...)")
    options = options if options is not None else AdviseOptions.from_fields(kw)
    if not isinstance(options, AdviseOptions):
        raise ValueError(f"options must be an AdviseOptions, got {type(options).__name__}")
    if not isinstance(trace, RoutingTrace):
        raise ValueError(
            f"trace must be a profiling.trace.RoutingTrace (read_trace), got {type(trace).__name__}"
        )
    return options


def _absolute(output: str | os.PathLike) -> str:
    """The folder the command names, absolute: an engine started elsewhere reads the same files."""
    out = os.fspath(output)
    return out if out == UNSET_OUTPUT else os.path.abspath(out)


def _drawn(counts: RoutingTrace, top_k: int, options: AdviseOptions) -> RoutingTrace:
    """Tokens drawn from a counts-only trace (:func:`profiling.from_counts.tokens_from_counts`); with
    ``quick``, from its first ``quick_prompts`` windows and a tenth of the tokens."""
    if options.quick and len(counts.natural_windows()) > options.quick_prompts:
        counts = counts.select_windows(range(options.quick_prompts))
    most = DEFAULT_MAX_TOKENS // 10 if options.quick else DEFAULT_MAX_TOKENS
    return tokens_from_counts(counts, top_k, max_tokens=most, seed=options.seed)


def _prepare(
    trace: RoutingTrace, model: str, hardware: str, options: AdviseOptions
) -> tuple[_Inputs, AdviseOptions]:
    """The cluster preset, the options with every knob set, the trace's halves and the model the trace
    was recorded from."""
    cluster = cluster_preset(hardware, gpus_per_node=options.gpus_per_node)
    options = options.resolved(cluster.gpu.hbm_bytes)
    spec = resolve_model(model, trace)
    if not trace.has_tokens:  # window counts only: tokens drawn from them, with the caveat said
        trace = _drawn(trace, spec.top_k, options)
    trace, fit, held = _inputs(trace, options)
    cost.check_something_fits(spec, cluster, options.ep_size, options.decode_step_tokens, options.context_len)
    return _Inputs(trace, fit, held, spec, cluster), options


def _decide(inp: _Inputs, options: AdviseOptions, progress: Progress) -> _Decision:
    """Every option placed and priced on the held-out half, what the engine can run, and the choice."""
    rows, placements, steps_used = pricing.rows(inp.fit, inp.held, inp.model, inp.cluster, options, progress)
    base = next(r for r in rows if r.kind == balance.NO_EPLB)
    rows = pricing.with_ranges(rows, base, placements, steps_used, inp.held, inp.model, inp.cluster, options)
    base = next(r for r in rows if r.kind == balance.NO_EPLB)
    available = {r.key: recommend.availability(options.engine, inp.model.name, r) for r in rows}
    choice = choice_.choose(rows, base, available, options.min_gain)
    return _Decision(rows, base, available, choice, placements, steps_used)


def _decision(dec: _Decision, stab: stability.Stability, options: AdviseOptions) -> dict:
    """The recommendation's decision keys: the net gain and its range, the threshold, stability, and the
    best option not picked with why."""
    row, base = dec.choice.row, dec.base
    g = choice_.net_gain(row, base) if row is not base else None
    runner = dec.choice.runner_up
    out = {
        "net_gain": g["net"] if g else 0.0,
        "net_gain_range": [g["low"], g["high"]] if g else [0.0, 0.0],
        "net_gain_sure": choice_.sure(g) if g else 0.0,
        **stab.to_dict(options.min_gain),
        "runner_up": None,
    }
    if runner is not None:
        rg = choice_.net_gain(runner, base)
        out["runner_up"] = {
            "option": runner.key,
            "net_gain": rg["net"],
            "net_gain_range": [rg["low"], rg["high"]],
            "why_not": dec.choice.runner_up_why,
        }
    return out


def _launch(inp: _Inputs, dec: _Decision, rb: rebalance.Rebalance, options: AdviseOptions, output: str):
    """``(launch, files to write, warnings)`` for the chosen row."""
    E, G = inp.trace.num_logical_experts, options.ep_size
    row = dec.choice.row
    redundant = min_redundant(E, G) + row.redundant_per_gpu * G
    launch = recommend.launch(
        options.engine, row, inp.model.name, options, redundant, rb.interval_steps, output
    )
    files = {f: (dec.placements[row.placement_key], inp.model.num_layers) for f in launch.files}
    warnings = []
    if launch.files and output == UNSET_OUTPUT:
        warnings.append(
            f"the command names {', '.join(launch.files)}: pass --output DIR to write the file there"
        )
    return launch, files, warnings


def _context(inp: _Inputs, dec: _Decision, options: AdviseOptions) -> dict:
    """The contract's ``context``: what was advised on, with which settings."""
    trace, fit, held, cluster = inp.trace, inp.fit, inp.held, inp.cluster
    counts_only = bool(trace.metadata.get("from_counts"))
    shape = {
        "name": trace.metadata.get("source", trace.name) if counts_only else trace.name,
        "counts_only": counts_only,
        "tokens": trace.num_tokens,
        "experts": trace.num_logical_experts,
        "top_k": trace.top_k,
        "layers": trace.num_layers,
        "fit_tokens": fit.num_tokens,
        "held_out_tokens": held.num_tokens,
    }
    base = dec.base.memory
    return {
        "trace": shape,
        "model": inp.model.name,
        "hardware": cluster.name,
        "engine": options.engine,
        "engine_version": ENGINES[options.engine].version,
        "nodes": options.nodes,
        "gpus_per_node": options.gpus_per_node,
        "decode_step_tokens": options.decode_step_tokens,
        "prefill_tokens_per_rank": balance.prefill_tokens(held, options),
        "context_len": options.context_len,
        "phases": list(options.priced_phases),
        "quick": options.quick,
        "calibrated": hardware_summary(cluster)["measured"],
        "replica_gb_limit": (base.spare_bytes + base.redundant_bytes) / 1e9,
    }


def _more_warnings(inp: _Inputs, dec: _Decision, options: AdviseOptions) -> tuple[list[str], list[str]]:
    """``(published-band warnings of the chosen row, the routing and padding warnings)``."""
    E, G = inp.trace.num_logical_experts, options.ep_size
    above = notes.band_warnings(dec.choice.row, dec.base, E, G, inp.model.name)
    more = notes.routing_warnings(inp.trace, inp.held, options)
    if min_redundant(E, G):
        more.append(notes.padding_warning(options.engine, E, G, min_redundant(E, G)))
    return above, more


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

    Steps: options -> inputs (halves, model, cluster) -> held-out checks -> placements, prices and the
    choice -> rebalancing -> the launch command -> warnings, context, summary -> :class:`Advice`.

    Args:
        trace: per-token routing (:class:`RoutingTrace` with ``topk_ids [T, L, k]``).
        model: a built-in model name, a model JSON, or ``auto`` (the built-in with the trace's shape).
        hardware: a GPU preset name or a preset JSON from ``benchmarks/gpu_gemm_fit.py``.
        progress: wraps each stage (``(items, total, description) -> items``), e.g. a progress line.
        output: the folder the launch command's files are named in (the CLI's ``--output``).
    """
    options = _checked_call(trace, options, kw, progress, output)
    output = _absolute(output)
    progress = progress or _identity
    inp, options = _prepare(trace, model, hardware, options)
    steps, warnings = _held_out_checks(inp.held, options)
    dec = _decide(inp, options, progress)
    stab = stability.check(inp, dec, options, progress)
    rb = _rebalance(inp, dec.choice.row, dec.base, dec.placements, options, progress)
    launch, files, launch_warnings = _launch(inp, dec, rb, options, output)
    above, more = _more_warnings(inp, dec, options)
    hardware = hardware_summary(inp.cluster)
    return Advice(
        context=_context(inp, dec, options),
        rows=tuple(dec.rows),
        baseline=dec.base.key,
        chosen=dec.choice.row.key,
        available=dec.available,
        launch=launch,
        rebalance=rb,
        reason=dec.choice.reason,
        summary=notes.summary(
            options, dec.choice, dec.base, rb, launch, notes.caveats(inp.trace) + above, stab
        ),
        held_out_steps=steps,
        warnings=tuple(warnings + launch_warnings + above + more),
        assumptions=notes.assumptions(
            inp.model, inp.cluster, options, dec.steps_used, hardware, notes.split_unit(inp.trace)
        ),
        hardware=hardware,
        decision=_decision(dec, stab, options),
        placements=dec.placements,
        held_out=inp.held,
        files=files,
    )


def _rebalance(inp: _Inputs, row: Row, base: Row, placements, options, progress) -> rebalance.Rebalance:
    """Periodic rebalancing of the chosen row, judged out of sample on the held-out windows."""
    held, model, cluster = inp.held, inp.model, inp.cluster
    topo = balance.trace_topology(held.num_logical_experts, row.redundant_per_gpu, options)
    static = None if row is base else placements[row.placement_key]
    ph = options.priced_phases[0]  # decode when it is priced

    def price_on(c):
        def price(pl: Placement, window: RoutingTrace) -> float:
            b = pricing.step_tokens(window, options)[ph]
            steps = {ph: phases.held_out_steps(window, options.ep_size, ph, b, options.seed)}
            return pricing.price(pl, window, steps, row.dispatch, model, c, options)[ph].whole_ms

        return price

    def judge() -> rebalance.Rebalance:
        return rebalance.judge(
            held,
            static,
            topo,
            price_on(cluster),
            rebalance.JudgeSpec(
                options.engine,
                options.step_tokens(ph),
                options.windows,
                options.rebalance_margin,
                options.rebalance_min_steps,
            ),
            price_on=price_on,
            cluster=cluster,
        )

    (out,) = pricing.run_stage([("rebalance", judge)], progress, "rebalance")
    return out
