"""``moe-placement layout``: rank attention-DP x EP x redundant-slot layouts with the cost model,
write the best placement and the engines' launch flags."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

from moe_placement.base.limits import MAX_CONTEXT_LEN, MAX_RANKS, MAX_STEP_TOKENS
from moe_placement.cli.common import (
    CliError,
    add_cluster_args,
    bounded_int,
    check_folder_outputs,
    echo,
    expert_count_int,
    model_help,
    non_negative_int,
    open_trace,
    positive_int,
    seconds,
    seed_int,
    warn,
)

# GPUs one plan may span: every EP size and instance split of the cluster is placed and costed, which
# grows faster than the GPU count (2,048 GPUs: about 80 s on one core); a larger cluster is instances
# of at most this size, which the plan already compares
MAX_LAYOUT_GPUS = 2048

# The files --output may get (_output_files), checked against the inputs before anything is computed.
_OUTPUT_FILES = (
    "placement.json",
    "sglang_expert_location.json",
    "sglang_expert_location.json.meta.json",
    "moe_load_balancer.yaml",
    "moe_load_balancer.yaml.meta.json",
    "trtllm_extra_llm_api_options.yaml",
    "launch_flags.sh",
    "layout.json",
)

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from placement.cost.step_time import OVERLAPS
    from placement.steps import PHASES, SIZING_STEP_TOKENS

    p = subparsers.add_parser(
        "layout",
        help="choose attention-DP / EP size / redundant slots with a step-time and memory model",
        description="Enumerate layouts that fit in memory, place experts for each, estimate step time, "
        "throughput per GPU and KV-cache room; print a ranked table and write the best placement and launch flags.",
    )
    p.add_argument(
        "--model",
        required=True,
        help=model_help(),
    )
    add_cluster_args(p)
    p.add_argument(
        "--phase", choices=PHASES, default=PHASES[0], help=f"the phase planned for (default {PHASES[0]})"
    )
    p.add_argument(
        "--step-tokens",
        "--batch-per-rank",
        dest="step_tokens",
        type=positive_int,
        default=None,
        help="tokens per rank per step (default: the size a deployment is sized at, "
        + ", ".join(f"{k} {v}" for k, v in SIZING_STEP_TOKENS.items())
        + "; --batch-per-rank is its older name)",
    )
    p.add_argument(
        "--context-len",
        type=bounded_int(1, MAX_CONTEXT_LEN, "MAX_CONTEXT_LEN"),
        default=4096,
        help="decode: cached tokens per sequence; prefill: prompt length",
    )
    p.add_argument(
        "--trace", default=None, help="routing trace whose skew to use (default: synthetic Zipf skew)"
    )
    p.add_argument("--solver", choices=("greedy", "cpsat"), default="greedy")
    p.add_argument(
        "--max-redundant", type=expert_count_int, default=None, help="cap on redundant experts per layer"
    )
    p.add_argument(
        "--overlap", choices=OVERLAPS, default="auto", help="two-batch overlap (default auto: the faster)"
    )
    p.add_argument(
        "--max-steps",
        type=positive_int,
        default=None,
        help="with --trace of the model's experts: price the first N steps (default all, as evaluate --model)",
    )
    p.add_argument("--no-phase-compare", action="store_true", help="skip evaluating the other phase")
    p.add_argument("--time-limit", type=seconds, help="seconds per exact solve (cpsat; default 10)")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument(
        "--top", type=non_negative_int, default=12, help="rows of the table to print (rejected ones follow)"
    )
    p.add_argument("--output", default=None, help="folder for the best placement and launch flags")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def _options(args, phase: str):
    from moe_placement.apps.planner.costmodel import CostOptions
    from placement.steps import SIZING_STEP_TOKENS

    b = args.step_tokens if (args.step_tokens and phase == args.phase) else SIZING_STEP_TOKENS[phase]
    return CostOptions(
        phase=phase,
        step_tokens=b,
        context_len=args.context_len,
        overlap=args.overlap,
        max_steps=args.max_steps,
    )


def _table(plan, top: int) -> list[str]:
    E = plan.model.num_logical_experts
    head = (
        f"{'#':>3} {'layout':<34} {'step ms':>8} {'tok/s/GPU':>10} {'range':>15} {'vs best':>13} {'PAR':>5} "
        f"{'attn':>6} {'disp':>6} {'moe':>6} {'comb':>6} {'TBO':>3} {'wts GB':>7} {'KV GB':>6} {'maxB':>5}  bottleneck"
    )
    lines = [head, "-" * len(head)]
    ok = plan.feasible
    for i, r in enumerate(ok[:top]):
        c, lc, m = r.cost, r.cost.layer, r.memory
        lo, hi = r.ranges()["tokens_per_s_per_gpu_range"]
        g = plan.gain_vs_best(r)
        vs = "best" if i == 0 else f"{g[1].low * 100:+.0f}..{g[1].high * 100:+.0f}%"
        lines.append(
            f"{i + 1:>3} {r.candidate.label(E):<34} {c.step_time * 1e3:>8.2f} {c.tokens_per_s_per_gpu:>10,.0f} "
            f"{f'{lo:,.0f}-{hi:,.0f}':>15} {vs:>13} {r.par:>5.2f} "
            f"{lc.attention * 1e6:>6.0f} {lc.dispatch * 1e6:>6.0f} {lc.compute * 1e6:>6.0f} {lc.combine * 1e6:>6.0f} "
            f"{'on' if lc.overlap_used else 'off':>3} {(m.non_expert + m.expert) / 1e9:>7.1f} {m.kv_free / 1e9:>6.1f} "
            f"{m.max_step_tokens:>5}  {c.bottleneck}"
        )
    if len(ok) > top:
        lines.append(f"    ... {len(ok) - top} more feasible layouts (--top)")
    bad = [r for r in plan.results if not r.feasible]
    if bad:
        lines.append(f"rejected ({len(bad)}):")
        for r in bad[:top]:
            lines.append(f"    {r.candidate.label(E):<34} {r.reason}")
    return lines


def _output_files(out: Path, plan, model, compare) -> dict[str, bytes]:
    """Every file of ``--output`` as ``{name: bytes}`` (published together: the old set or the new)."""
    from moe_placement.apps.planner.layout import launch_flags
    from moe_placement.base.fileio import json_bytes
    from placement.formats import placement_files

    best = plan.best
    files: list[tuple[Path, bytes]] = []
    pl = best.placement.with_provenance(
        solver=best.solver_status or "greedy",
        layout=best.candidate.label(model.num_logical_experts),
        model=model.name,
        hardware=plan.cluster.name,
        phase=plan.options.phase,
        workload=plan.workload,
    )
    files += placement_files(pl, out / "placement.json", "native")
    sg = out / "sglang_expert_location.json"
    files += placement_files(pl, sg, "sglang", num_hidden_layers=model.num_layers)
    trt = out / "moe_load_balancer.yaml"
    files += placement_files(pl, trt, "trtllm")
    flags = launch_flags(
        best, model, {"sglang": str(sg.name), "trtllm": str(trt.name)}, plan.cluster.gpus_per_node
    )
    import yaml

    trt_opts = out / "trtllm_extra_llm_api_options.yaml"
    files.append((trt_opts, yaml.safe_dump(flags["trtllm_extra_llm_api_options"], sort_keys=False).encode()))
    text = [
        f"# {model.name} on {plan.cluster.name}, {plan.options.phase}: {best.candidate.label(model.num_logical_experts)}",
        f"# estimated {best.cost.tokens_per_s_per_gpu:,.0f} tok/s/GPU (range {_span(best.ranges()['tokens_per_s_per_gpu_range'], ',.0f')}), "
        f"step {best.cost.step_time * 1e3:.2f} ms (range {_span(best.ranges()['step_time_ms_range'], '.2f')}; "
        f"cost model on preset {plan.cluster.name}, {_measured(plan.cluster)})",
        "",
        "# SGLang",
        "python -m sglang.launch_server --model-path <MODEL> " + " ".join(_q(a) for a in flags["sglang"]),
        "",
        "# vLLM",
        "vllm serve <MODEL> " + " ".join(_q(a) for a in flags["vllm"]),
        "",
        f"# TensorRT-LLM: trtllm-serve <MODEL> --tp_size {best.candidate.ep_size} --ep_size {best.candidate.ep_size} --extra_llm_api_options {trt_opts.name}",
    ] + [f"# note: {n}" for n in flags["notes"]]
    lf = out / "launch_flags.sh"
    files.append((lf, ("\n".join(text) + "\n").encode()))
    summary = _plan_dict(plan)
    if compare is not None:
        summary["phase_comparison"] = compare["message"]
        summary["separate_prefill_decode"] = compare["separate_wins"]
    summary["launch_flags"] = flags
    js = out / "layout.json"
    files.append((js, json_bytes(js, summary)))
    return {Path(f).name: data for f, data in files}


def _plan_dict(plan) -> dict:
    """The plan's JSON, its ``hardware`` as ``{preset, measured, measured_parts, name}`` (``name``: the
    cluster's GPU/intra/inter names, the string this key held before)."""
    from placement.cost.hardware import hardware_summary

    d = plan.to_dict()
    d["hardware"] = {**hardware_summary(plan.cluster), "name": plan.cluster.name}
    return d


def _span(pair: list[float], fmt: str) -> str:
    return f"{pair[0]:{fmt}}-{pair[1]:{fmt}}"


def _measured(cluster) -> str:
    from placement.cost.hardware import hardware_summary

    return "measured" if hardware_summary(cluster)["measured"] else "published figures, not measured"


def _q(a: str) -> str:
    return f"'{a}'" if any(ch in a for ch in ' {}"') else a


def _read_inputs(args):
    """Check the cluster flags -> (model, cluster, trace or None); a trace's expert count may differ."""
    from placement.cost.hardware import cluster_preset
    from placement.cost.modelspec import load_model
    from profiling.readers import require_data
    from solver.api import SOLVERS

    if args.nodes * args.gpus_per_node > MAX_RANKS:
        raise CliError(
            f"--nodes {args.nodes} x --gpus-per-node {args.gpus_per_node} = {args.nodes * args.gpus_per_node} "
            f"GPUs, over the accepted {MAX_RANKS} (MAX_RANKS)"
        )
    if args.nodes * args.gpus_per_node > MAX_LAYOUT_GPUS:
        raise CliError(
            f"--nodes {args.nodes} x --gpus-per-node {args.gpus_per_node} = {args.nodes * args.gpus_per_node} "
            f"GPUs, over the {MAX_LAYOUT_GPUS} one plan may span (MAX_LAYOUT_GPUS: every EP size is placed "
            f"and costed); plan one instance of at most {MAX_LAYOUT_GPUS} GPUs, e.g. --nodes "
            f"{MAX_LAYOUT_GPUS // args.gpus_per_node}"
        )
    if args.time_limit is not None and "time_limit" not in SOLVERS[args.solver].option_names:
        raise CliError(f"--time-limit bounds the exact solves (--solver cpsat), not {args.solver}; drop it")
    if args.step_tokens is not None and args.step_tokens > MAX_STEP_TOKENS:
        raise CliError(
            f"--step-tokens/--batch-per-rank {args.step_tokens} is over the accepted {MAX_STEP_TOKENS} tokens "
            f"(MAX_STEP_TOKENS)"
        )
    if args.output:
        model_files = [args.model, str(Path(args.model) / "config.json")]
        check_folder_outputs(args.output, _OUTPUT_FILES, inputs=[*model_files, args.trace, args.hardware])
    try:
        model = load_model(args.model)
        cluster = cluster_preset(args.hardware, args.intra_link, args.inter_link, args.gpus_per_node)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    trace = None
    if args.trace:
        trace = open_trace(args.trace, experts=(model.num_logical_experts, f"model {model.name}"))
        require_data(trace, args.trace)
        if trace.num_logical_experts != model.num_logical_experts:
            warn(
                f"trace has {trace.num_logical_experts} experts, {model.name} has {model.num_logical_experts}: "
                f"only the trace's skew is used (expert identities are synthetic)"
            )
    return model, cluster, trace


def _plan(args, model, cluster, trace):
    """The ranked layouts for ``--phase`` and, unless ``--no-phase-compare``, the other phase's verdict."""
    from moe_placement.apps.planner.layout import PlanOptions, compare_phases, plan_layout

    opts = _options(args, args.phase)
    search = PlanOptions(
        solver=args.solver,
        max_redundant=args.max_redundant,
        seed=args.seed,
        time_limit=PlanOptions.time_limit if args.time_limit is None else args.time_limit,
    )
    plan = plan_layout(model, cluster, args.nodes, opts, trace=trace, plan=search)
    compare = None
    if not args.no_phase_compare and plan.best is not None:
        other = "prefill" if args.phase == "decode" else "decode"
        o = _options(args, other)
        compare = compare_phases(
            model,
            cluster,
            args.nodes,
            opts if args.phase == "decode" else o,
            o if args.phase == "decode" else opts,
            trace=trace,
            plan=search,
            plans={args.phase: plan},
        )
    return plan, compare


def _print_plan(args, plan, model, cluster, compare, files) -> None:
    """The ranked table with its header, the plan's notes, the phase verdict and the files written."""
    o = plan.options
    echo(
        f"{model.name} on {args.nodes} x {args.gpus_per_node} {cluster.name}, {o.phase}, {o.step_tokens} tokens/GPU/step, "
        f"context {o.context_len}"
    )
    echo(f"workload: {plan.workload}")
    echo(
        f"times per MoE layer in us; throughput = batch / step time per GPU (cost model on preset {cluster.name}, "
        f"{_measured(cluster)}); range: over the all-to-all constant sets the published tables allow "
        f"(placement/cost/ranges.py); vs best: throughput against the best layout on each set"
    )
    for line in _table(plan, args.top):
        echo(line)
    for n in plan.notes:
        echo(f"* {n}")
    if compare is not None:
        echo(f"* {compare['message']}")
    if files:
        echo(f"wrote {', '.join(str(f) for f in files)}")


def _show(args, plan, model, cluster, compare, files) -> None:
    """The plan as JSON (``--json``) or as the ranked table (:func:`_print_plan`)."""
    if not args.json:
        _print_plan(args, plan, model, cluster, compare, files)
        return
    d = _plan_dict(plan)
    if compare is not None:
        d["phase_comparison"] = compare["message"]
        d["separate_prefill_decode"] = compare["separate_wins"]
    d["files"] = [str(f) for f in files]
    echo(json.dumps(d, indent=1))


def run(args: argparse.Namespace) -> int:
    """Steps: model, cluster and trace -> claim ``--output`` (refused before any work when another run
    holds it, or it holds files this command did not write) -> plan (and phase comparison) -> publish
    the best -> print. When no layout fits, the table (or JSON) still shows why each was rejected, and
    the run ends as bad input: one line naming the cause and the fix, exit code 2, nothing written."""
    from moe_placement.base.folders import claim_folder

    model, cluster, trace = _read_inputs(args)
    claimed = claim_folder(args.output, "layout", _OUTPUT_FILES) if args.output is not None else None
    with claimed or contextlib.nullcontext() as claim:
        plan, compare = _plan(args, model, cluster, trace)
        files = []
        if claim is not None and plan.best is not None:
            files = claim.publish(_output_files(Path(args.output), plan, model, compare))
        _show(args, plan, model, cluster, compare, files)
    if plan.best is None:
        raise CliError(
            f"{model.name} on {args.nodes} x {args.gpus_per_node} {cluster.name}: {plan.notes[0]}"
            + (" (nothing written)" if args.output is not None else "")
        )
    return 0
