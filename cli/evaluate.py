"""``moe-placement evaluate``: score a placement on a trace (PAR, step PAR, remote traffic, bytes)."""

from __future__ import annotations

import argparse
import json

from cli.common import CliError, echo, elapsed_bar, open_placement, open_trace

__all__ = ["add_parser", "cmd_evaluate"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``evaluate`` sub-command's arguments."""
    p = sub.add_parser("evaluate", help="score a placement on a trace")
    p.add_argument("placement")
    p.add_argument("trace")
    p.add_argument("--policy", choices=("even", "local"), default="even")
    p.add_argument("--step-tokens", type=int, help="tokens per rank per step for step_par")
    p.add_argument("--hidden-size", type=int, help="model hidden size for bytes_per_token")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_evaluate)


def _print_evaluation(placement, trace, policy: str, d: dict) -> None:
    """One line per metric family present in the evaluation dict ``d``."""
    echo(f"{placement!r} on {trace!r}, policy {policy}")
    echo(
        f"par {d['par']:.4f} (worst layer {d['par_worst']:.4f}), balancedness {d['balancedness']:.4f}, "
        f"imbalance_ratio {d['imbalance_ratio']:.4f}, lower bound par {d['lower_bound_par']:.4f}"
    )
    if "step_par" in d:
        echo(f"step_par {d['step_par']:.4f} at {d['step_tokens']} tokens per rank ({d['num_steps']} steps)")
    if "remote_nodes_per_token" in d:
        echo(
            f"remote_nodes_per_token {d['remote_nodes_per_token']:.4f}, remote_gpus_per_token "
            f"{d['remote_gpus_per_token']:.4f} (source ranks: {d['source_ranks']})"
        )
    if "bytes_per_token" in d:
        echo(f"bytes_per_token {d['bytes_per_token']:.0f}")


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Steps: read placement and trace (rows matched to the placement's layers) -> evaluate -> print."""
    from placement.metrics import evaluate

    placement = open_placement(args.placement)
    trace = open_trace(args.trace)
    if trace.num_layers != placement.num_layers and set(placement.layer_ids) <= set(trace.layer_ids):
        trace = trace.select_layers([trace.layer_ids.index(i) for i in placement.layer_ids])
    if args.step_tokens is not None and args.step_tokens < 1:
        raise CliError(f"--step-tokens must be >= 1, got {args.step_tokens}")
    with elapsed_bar("evaluating"):
        ev = evaluate(
            placement, trace, args.policy, step_tokens=args.step_tokens, hidden_size=args.hidden_size
        )
    d = ev.to_dict()
    if args.json:
        echo(json.dumps(d, indent=1))
        return 0
    _print_evaluation(placement, trace, args.policy, d)
    return 0
