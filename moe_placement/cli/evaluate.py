"""``moe-placement evaluate``: score a placement on a trace (PAR, step PAR, remote traffic, bytes)."""

from __future__ import annotations

import argparse
import json

from moe_placement.cli.common import (
    CliError,
    add_dispatch_args,
    add_phase_args,
    checked_dispatch,
    echo,
    elapsed_bar,
    ep_size_int,
    format_table,
    hidden_size_int,
    model_arg,
    open_placement,
    open_trace,
    source_ranks_file,
)
from moe_placement.cli.step_cost import add_step_time_args, hardware_dict, step_time_dict

__all__ = ["add_parser", "cmd_evaluate"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``evaluate`` sub-command's arguments."""
    from placement.dispatch import DISPATCH

    p = sub.add_parser("evaluate", help="score a placement on a trace")
    p.add_argument("placement")
    p.add_argument("trace")
    add_dispatch_args(p, choices=(*DISPATCH, "all"), extra="; all: every model side by side")
    add_phase_args(p, "for step_par (and vLLM's batch rows)")
    p.add_argument("--hidden-size", type=hidden_size_int, help="model hidden size for bytes_per_token")
    p.add_argument("--ep-size", type=ep_size_int, help="EP ranks, for an engine file without a sidecar")
    p.add_argument("--num-nodes", type=ep_size_int, help="nodes, for an engine file without a sidecar")
    add_step_time_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_evaluate)


def _print_evaluation(placement, trace, dispatch: str, d: dict) -> None:
    """One line per metric family present in the evaluation dict ``d``."""
    echo(f"{placement!r} on {trace!r}, dispatch {dispatch}")
    echo(
        f"par {d['par']:.4f} (worst layer {d['par_worst']:.4f}), balancedness {d['balancedness']:.4f}, "
        f"imbalance_ratio {d['imbalance_ratio']:.4f}, lower bound par {d['lower_bound_par']:.4f}"
    )
    if "step_par" in d:
        echo(
            f"step_par {d['step_par']:.4f} on {d['phase']} steps, {d['step_tokens']} tokens per rank "
            f"({d['num_steps']} steps)"
        )
        for n in d.get("notes", []):
            echo(f"note: {n}")
    if "remote_nodes_per_token" in d:
        echo(
            f"remote_nodes_per_token {d['remote_nodes_per_token']:.4f}, remote_gpus_per_token "
            f"{d['remote_gpus_per_token']:.4f} (source ranks: {d['source_ranks']})"
        )
    if "bytes_per_token" in d:
        echo(f"bytes_per_token {d['bytes_per_token']:.0f}")
    if "step_time" in d:
        st = d["step_time"]
        lo, hi = st["whole_ms_range"]
        hw = st["hardware"]
        echo(
            f"step_time {st['whole_ms']:.3f} ms (range {lo:.3f}-{hi:.3f}) per {st['phase']} step ({st['model']} on "
            f"{hw['preset']}, {_measured_words(d.get('hardware', hw))}"
            f"{', GEMM calibrated' if st['calibrated'] else ''}; {st['kernel']} kernels, two-batch overlap "
            f"{'on' if st['two_batch_overlap'] else 'off'}): MoE {st['moe_ms']:.3f} (GEMM {st['gemm_ms']:.3f}, "
            f"all-to-all {st['a2a_ms']:.3f}), dispatch overhead {st['dispatch_overhead_ms']:.3f}, "
            f"rest {st['rest_ms']:.3f}, overlap saving {st['overlap_saving_ms']:.3f}"
        )


_ALL_COLUMNS = [
    ("dispatch", "dispatch", -1),
    ("par", "PAR", 4),
    ("par_worst", "worst layer", 4),
    ("step_par", "step_par", 4),
    ("remote_nodes_per_token", "remote nodes/token", 4),
    ("remote_gpus_per_token", "remote GPUs/token", 4),
]


def _read_inputs(args: argparse.Namespace):
    """Placement (engine maps with co-located replicas accepted, with a warning) and the trace, rows
    matched to the placement's layers; the source ranks ``[T]`` and how they were made."""
    from placement.metrics import resolve_source_ranks
    from profiling.readers import require_data

    source_ranks_file(args.source_ranks)  # a FIFO or folder refused before anything is read
    model = model_arg(args)  # an unknown --model, or a --hidden-size it contradicts, before any work
    args.width = args.hidden_size or (model.hidden_size if model is not None else None)  # bytes_per_token
    if args.step_tokens is not None and args.step_tokens < 1:
        raise CliError(f"--step-tokens must be >= 1, got {args.step_tokens}")
    placement = open_placement(
        args.placement, engine_map=True, ep_size=args.ep_size, num_nodes=args.num_nodes
    )
    trace = open_trace(args.trace, experts=(placement.num_logical_experts, f"the placement {args.placement}"))
    if trace.num_layers != placement.num_layers and set(placement.layer_ids) <= set(trace.layer_ids):
        trace = trace.select_layers([trace.layer_ids.index(i) for i in placement.layer_ids])
    require_data(trace, args.trace)
    from placement.steps import PHASES

    phase = args.phase if args.phase != PHASES[0] else None
    for flag, value in (
        ("--hidden-size", args.hidden_size),
        ("--step-tokens", args.step_tokens),
        ("--phase", phase),
    ):
        if value is not None and not trace.has_tokens:  # it would be silently ignored
            raise CliError(
                f"{flag} applies to per-token metrics (communication, step PAR); {args.trace} has counts only: drop it"
            )
    src = None
    how = None
    if args.source_ranks is not None:
        if not trace.has_tokens:
            raise CliError("--source-ranks needs a per-token trace; this trace has counts only")
        src, how = resolve_source_ranks(trace, placement.topology.ep_size, args.source_ranks)
    return placement, trace, src, how


def _evaluate(args, placement, trace, dispatch: str, src, how) -> dict:
    """Every metric under ``dispatch``; step metrics on ``--phase`` steps (named in the dict)."""
    from placement.metrics import evaluate

    ev = evaluate(
        placement,
        trace,
        dispatch,
        step_tokens=args.step_tokens,
        hidden_size=args.width if trace.has_tokens else None,
        src=src,
        phase=args.phase,
    )
    d = ev.to_dict()
    if how is not None and "source_ranks" in d:
        d["source_ranks"] = how
    st = step_time_dict(args, placement, trace, dispatch, _steps(args, placement, trace))
    if st is not None:
        d["step_time"] = st
        d["hardware"] = hardware_dict(args, placement)
    return d


def _steps(args, placement, trace):
    """The ``--phase`` steps step_time prices (those step_par measures), or None without ``--model``."""
    from placement.steps import make_steps

    if args.model is None or not trace.has_tokens:
        return None
    return make_steps(trace, placement.topology.ep_size, args.phase, args.step_tokens)


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Steps: read placement, trace and source ranks -> evaluate under one or every dispatch -> print."""
    from placement.dispatch import DISPATCH

    checked_dispatch(args)
    placement, trace, src, how = _read_inputs(args)
    names = (
        [n for n, m in DISPATCH.items() if m.counts_only or trace.has_tokens]
        if args.dispatch == "all"
        else [args.dispatch]
    )
    with elapsed_bar("evaluating"):
        results = {name: _evaluate(args, placement, trace, name, src, how) for name in names}
    if args.dispatch != "all":
        d = results[args.dispatch]
        if args.json:
            echo(json.dumps(d, indent=1))
        else:
            _print_evaluation(placement, trace, args.dispatch, d)
        return 0
    if args.json:
        echo(json.dumps({"dispatch": results}, indent=1))
        return 0
    echo(f"{placement!r} on {trace!r}, every dispatch model")
    rows = [{"dispatch": name, **d} for name, d in results.items()]
    echo(format_table(rows, [c for c in _ALL_COLUMNS if any(c[0] in r for r in rows)]))
    return 0


def _measured_words(hw: dict) -> str:
    """``measured: a2a_intra, gemm`` for a measured preset, else what the figures are."""
    if not hw.get("measured"):
        return "published figures, not measured"
    parts = hw.get("measured_parts") or []
    return "measured" + (f": {', '.join(parts)}" if parts else "")
