"""The words of the advice: its assumptions, its warnings and the one-paragraph summary, each built from the
same figures as the JSON (nothing here computes a figure).
"""

from __future__ import annotations

import moe_placement.apps.advise.phases as phases
import moe_placement.apps.advise.rebalance as rebalance
from moe_placement.apps.advise.advice import Row, phase_figures
from moe_placement.apps.advise.choice import net_gain
from moe_placement.apps.advise.engines import ENGINES, default_prefill_chunk
from placement.cost.hardware import ClusterSpec
from placement.cost.modelspec import ModelSpec
from profiling.trace import RoutingTrace

__all__ = [
    "assumptions",
    "band_warnings",
    "caveats",
    "padding_warning",
    "routing_warnings",
    "split_unit",
    "summary",
]


def split_unit(trace: RoutingTrace) -> str:
    """What the fit / held-out split cuts the trace at, in words (:meth:`RoutingTrace.split`): its prompts,
    its recorded engine batches, or its tokens when it has one window only."""
    n = len(trace.natural_windows())
    if n >= 2:
        return "prompts" if trace.seq_offsets is not None else "recorded engine batches"
    if trace.seq_offsets is not None:
        return "tokens (the trace has one prompt)"
    return "tokens (the trace has no prompt boundaries)"


def _halves(fit_half: str) -> tuple[str, str]:
    return ("first", "second") if fit_half == "first" else ("second", "first")


def _setup_lines(options, steps: dict, cluster: ClusterSpec) -> list[str]:
    """How the steps are run, as the command runs them: kernels, overlap, prefill chunk, decode routing."""
    caps = ENGINES[options.engine]
    kernels = ", ".join(f"{ph} {caps.deepep_modes[ph]}" for ph in options.priced_phases)
    out = [f"all-to-all priced on the kernels the command selects: {kernels}"]
    if options.overlap == "on":
        out.append(f"two-batch overlap: on ({caps.overlap_flag} in the command), priced as two micro-batches")
    else:
        out.append(
            f"two-batch overlap: off (the command does not set {caps.overlap_flag}); priced without it"
        )
    if "prefill" in steps:
        if "prefill_step_tokens" in (options.pinned or ()):
            out.append(f"prefill chunk: {options.prefill_step_tokens} tokens per rank, set in the command")
        else:
            per, source = default_prefill_chunk(options.engine, cluster.gpu.hbm_bytes, options.ep_size)
            out.append(f"prefill chunk: the engine's default, {per} tokens per rank ({source})")
    return out


def assumptions(
    model: ModelSpec,
    cluster: ClusterSpec,
    options,
    steps: dict,
    hardware: dict,
    unit: str,
) -> tuple[str, ...]:
    """The assumptions list of the contract, one line each."""
    parts = ", ".join(hardware.get("measured_parts") or ()) or "figures in the preset"
    cal = (
        f"measured ({parts}; preset {hardware['preset']})"
        if hardware["measured"]
        else "analytic, not calibrated"
    )
    caps = ENGINES[options.engine]
    fit, held = _halves(options.fit_half)
    out = [
        f"cost model: {cal}; hardware preset {cluster.name} ({cluster.gpu.source})",
        phases.MODEL_NOTE,
        f"balance: placements fitted on the {fit} half of the trace's {unit}, priced on the held-out {held} half",
        *(f"held-out {ph}: {st.describe()}" for ph, st in steps.items()),
        "gains are whole-step throughput over the no-EPLB baseline; band = 2 standard errors over blocks of "
        "steps; range = the gain over the cost model's low / central / high constants",
        *_setup_lines(options, steps, cluster),
        f"engine capabilities: {options.engine} {caps.version} (moe_placement/apps/advise/engines.py, read from its code)",
        f"memory: decode at {options.decode_step_tokens} sequences per rank, context {options.context_len}; "
        f"KV tokens lost = redundant expert bytes / {model.name}'s KV bytes per token",
        f"rebalance stall: {rebalance.stall(options.engine)[1]}",
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


def caveats(trace: RoutingTrace) -> list[str]:
    """What the figures cannot be, said first: a counts-only trace has window-level routing only."""
    if not trace.metadata.get("from_counts"):
        return []
    m = trace.metadata
    return [
        f"counts-only trace {m['source']}: window-level figures. It records expert counts per window, no "
        f"token, so tokens were drawn from each of its {m['windows']:,} windows' per-layer counts (scaled by "
        f"{m['scale']:.3g}; each token's experts independent of the others and across layers, "
        "profiling.from_counts): window balance is the trace's own, but step-level balance is that of "
        "independent routing (no experts firing together, no topic shared by a prompt's tokens), likely more "
        "even than real tokens, so the step-level gains are likely a low estimate"
    ]


def routing_warnings(trace: RoutingTrace, held: RoutingTrace, options) -> list[str]:
    """The counts-only caveat, and a warning when decode is priced on prompt tokens (no decode step)."""
    out = caveats(trace)
    if "decode" not in options.priced_phases or held.step_offsets is not None:
        return out  # recorded engine batches: decode steps are the engine's own
    return out + [
        "decode is priced on prompt tokens: the trace records no decode routing, so each decode step takes "
        "the next prompt token of each sequence as if it were generated; record the engine's decode steps "
        "(a trace with its batches) to price decode on decode routing"
    ]


def padding_warning(engine: str, E: int, G: int, R0: int) -> str:
    """What ``E`` experts on ``G`` GPUs that do not divide cost, per engine."""
    if engine == "vllm":
        return (
            f"{E} experts on {G} GPUs: every EPLB option needs {R0} redundant slots; without EPLB vLLM places "
            f"{E // G} or {E // G + 1} experts per GPU with none redundant (priced as {E + R0} slots, {R0} of "
            f"them duplicates)"
        )
    return f"{E} experts on {G} GPUs: {R0} redundant slots are needed in every option (SGLang's rule)"


def band_warnings(row: Row, base: Row, E: int, G: int, model: str) -> list[str]:
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


def _gain_text(ph: str, f: dict) -> str:
    lo, hi = f["whole_step_gain_range"]
    return (
        f"{ph} {f['whole_step_gain'] * 100:+.2f}% (range {lo * 100:+.2f}% to {hi * 100:+.2f}%; "
        f"{phases.band_text(f['band'])}; published {_pub(f)})"
    )


def _runner_text(choice, base: Row) -> str:
    r = choice.runner_up
    if r is None:
        return ""
    g = net_gain(r, base)
    return f" Best option not picked: {r.key} (net {g['net'] * 100:+.2f}%): {choice.runner_up_why}."


def summary(options, choice, base: Row, rb, launch, notes: list[str], stab) -> str:
    """One paragraph, built from the same figures as the JSON."""
    engine, row = options.engine, choice.row
    if row is base:
        text = f"Run {engine} without expert balancing ({choice.reason})."
    else:
        figs = {ph: phase_figures(row, base, ph, engine) for ph in row.priced}
        gains = ", ".join(_gain_text(ph, f) for ph, f in figs.items())
        f = next(iter(figs.values()))
        text = (
            f"Run {engine} with {row.kind}, dispatch {row.dispatch}, {row.redundant_per_gpu} redundant slot(s) "
            f"per GPU ({choice.reason}): modelled whole step {gains}, for {f['memory_gb']:.2f} GB per GPU "
            f"({f['kv_tokens_lost']:,.0f} KV tokens)."
        )
    text += _runner_text(choice, base) + " " + stab.line()
    every = "every " + format(rb.interval_steps, ",") + " steps" if rb.interval_steps else "none"
    text += f" Rebalance: {every if rb.judged else 'not judged'} ({rb.reason})."
    text += "".join(f" Warning: {n[0].upper()}{n[1:]}." for n in notes)
    return text + f" Command: {launch.command}"
