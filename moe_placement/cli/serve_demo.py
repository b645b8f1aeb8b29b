"""``moe-placement serve-demo``: serve a real transformers MoE model on G ranks and rebalance it live.

Every rank greedily decodes its own prompts with the placement applied (routed experts sharded,
attention data-parallel); every ``--rebalance-every`` steps the online rebalancer re-places from the
counted routing and the changed experts move between ranks atomically, without stopping generation.
Prints per-rank load before and after each rebalance and whether the generated tokens equal the
single-process model's. Exit code 0 when they do (and every rank's weights are the right experts), 1
otherwise, 2 on bad input.

``--disaggregated`` serves with a prefill pool and a decode pool instead (each on its own placement,
the KV cache handed off layer by layer, faults injectable); ``--kill-rank R --at-step S`` loses a rank
mid-serving (``moe_placement.cli.serve_pd``).
"""

from __future__ import annotations

import argparse
import json

from moe_placement.cli import serve_pd
from moe_placement.cli.common import (
    CliError,
    echo,
    elapsed_bar,
    layer_row_int,
    non_negative_int,
    open_placement,
    positive_int,
)

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from moe_placement.cli.validate import MAX_RANKS
    from placement.dispatch import EVEN, dispatch_names

    p = subparsers.add_parser(
        "serve-demo",
        help="serve a transformers MoE model on G ranks with live rebalancing; print per-rank load",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="DIR_OR_CONFIG",
        help="a checkpoint folder, or a config.json for seeded random weights",
    )
    p.add_argument("--ranks", type=int, help=f"gloo ranks to launch (1..{MAX_RANKS}; default 4)")
    p.add_argument(
        "--rebalance-every", type=non_negative_int, help="steps between re-solves (0: never; default 4)"
    )
    p.add_argument(
        "--placement", help="initial placement file (default: contiguous blocks plus --redundant replicas)"
    )
    p.add_argument("--redundant", type=int, help="redundant slots per layer (default: --ranks)")
    p.add_argument(
        "--layers",
        type=layer_row_int,
        nargs="+",
        help="with --placement: the placement row (0-based) serving each MoE layer of the model, in model "
        "order (default: rows matched by layer id)",
    )
    p.add_argument("--new-tokens", type=int, default=16, help="greedy steps per prompt (default 16)")
    p.add_argument("--prompts-per-rank", type=positive_int)
    p.add_argument("--prompt-len", type=positive_int, default=8)
    p.add_argument(
        "--dispatch",
        metavar="{" + ",".join(dispatch_names(runtime=True)) + "}",
        default=EVEN.name,
        help=f"replica selection the runtime applies (default {EVEN.name})",
    )
    p.add_argument("--max-moves", type=int, help="moved slots allowed per rebalance (default: no budget)")
    p.add_argument(
        "--gain-gate",
        action="store_true",
        help="apply a re-solve only when the rebalancer's cost model says it pays (default: always apply)",
    )
    p.add_argument(
        "--no-wait", action="store_true", help="poll re-solves without blocking (change lands when ready)"
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds (> 0) before the ranks are stopped")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    serve_pd.add_arguments(p)
    p.set_defaults(func=run)


MAX_SERVE_TOKENS = 1 << 24  # tokens all ranks process in one demo (prompts and generated), about 16.8M


def _check_work(args: argparse.Namespace) -> None:
    """The demo's whole token count (ranks x prompts per rank x (prompt + new tokens)) is bounded before
    any rank starts: a flag of 10**12 is refused, never run until the timeout."""
    total = args.ranks * args.prompts_per_rank * (args.prompt_len + args.new_tokens)
    if total > MAX_SERVE_TOKENS:
        raise CliError(
            f"--ranks {args.ranks} x --prompts-per-rank {args.prompts_per_rank} x (--prompt-len {args.prompt_len} "
            f"+ --new-tokens {args.new_tokens}) = {total:,} tokens is over the accepted {MAX_SERVE_TOKENS:,} "
            "(MAX_SERVE_TOKENS); lower one of them"
        )


def _defaults(args: argparse.Namespace, mode: str) -> None:
    """The co-located run's defaults, once the flags given were checked against the mode."""
    args.ranks = 4 if args.ranks is None else args.ranks
    args.prompts_per_rank = 2 if args.prompts_per_rank is None else args.prompts_per_rank
    if args.rebalance_every is None:
        args.rebalance_every = 0 if mode == "kill" else 4


def _spec(args: argparse.Namespace):
    """The :class:`runtime_hooks.hf_serve.ServeSpec` the arguments describe (CliError on bad numbers)."""
    from moe_placement.cli.validate import check_numbers
    from runtime_hooks.ep_layer import runtime_dispatch
    from runtime_hooks.hf_serve import ServeSpec, contiguous_placement
    from runtime_hooks.hf_validate import describe_model

    check_numbers(
        args,
        positive=("timeout",),
        at_least_one=("ranks", "new_tokens", "prompts_per_rank", "prompt_len"),
        non_negative=("rebalance_every", "redundant", "seed", "max_moves"),
    )
    runtime_dispatch(args.dispatch)
    _check_work(args)
    if args.layers and not args.placement:
        raise CliError("--layers maps the rows of --placement; pass --placement FILE or drop --layers")
    if args.redundant is not None and args.placement:
        raise CliError("--redundant shapes the default placement; --placement FILE brings its own: drop one")
    given = [
        f
        for f, v in (
            ("--max-moves", args.max_moves),
            ("--gain-gate", args.gain_gate),
            ("--no-wait", args.no_wait),
        )
        if v
    ]
    if args.rebalance_every == 0 and given:
        raise CliError(f"{given[0]} applies to re-solves, and --rebalance-every 0 runs none: drop one")
    info = describe_model(args.model)
    if args.placement:
        placement = open_placement(args.placement)
        if placement.topology.ep_size != args.ranks:
            raise CliError(
                f"--ranks {args.ranks} differs from the placement's ep_size {placement.topology.ep_size}"
            )
    else:
        redundant = args.ranks if args.redundant is None else args.redundant
        placement = contiguous_placement(len(info.layer_ids), info.num_experts, args.ranks, redundant)
    return info, ServeSpec(
        args.model,
        placement,
        rebalance_every=args.rebalance_every,
        new_tokens=args.new_tokens,
        prompts_per_rank=args.prompts_per_rank,
        prompt_len=args.prompt_len,
        dispatch=args.dispatch,
        seed=args.seed,
        dtype=args.dtype,
        wait_for_solve=not args.no_wait,
        always_apply=not args.gain_gate,
        max_moves=args.max_moves,
        rows=tuple(args.layers) if args.layers else None,
    )


def _loads(values) -> str:
    return "[" + " ".join(f"{v:g}" for v in values) + "]"


def _print_report(rep) -> None:
    """Per-rank load around each placement change, then the verdict."""
    echo(f"model {rep.model_class}: {rep.ranks} ranks, MoE layers {list(rep.layer_ids)}, {rep.steps} steps")
    if not rep.events:
        echo("no rebalance ran")
    for e in rep.events:
        status = "committed" if e.committed else "ABORTED"
        echo(
            f"step {e.step}: {status}, {e.moved_slots} slots moved ({e.network_bytes} bytes over the network)"
        )
        if not e.committed:
            echo(f"  reason: {e.reason}")
        echo(f"  per-rank load before ({e.steps_before} steps): {_loads(e.load_before)}")
        echo(f"  per-rank load after  ({e.steps_after} steps): {_loads(e.load_after)}")
        if e.predicted_before:
            echo(
                f"  window load spread over the old placement {_loads(round(x, 1) for x in e.predicted_before)}"
                f" -> new {_loads(round(x, 1) for x in e.predicted_after)}"
            )
    echo(f"per-rank load over the run: {_loads(rep.load_per_rank.tolist())}")
    if rep.quotas_match is not None:
        us = rep.balanced_collective_us_per_layer
        echo(
            f"per-step quotas: picks per slot {'equal' if rep.quotas_match else 'DIFFER from'} the numpy "
            f"quotas of every step; counts all-gather {rep.balanced_collective_bytes_per_layer} bytes, "
            f"{sum(us) / max(len(us), 1):.0f} us per layer call (median, slowest rank)"
        )
    verdict = "PASS" if rep.tokens_match and rep.weights_match and rep.quotas_match is not False else "FAIL"
    echo(
        f"{verdict}: generated tokens {'equal' if rep.tokens_match else 'DIFFER from'} the single-process "
        f"model; slot weights {'match' if rep.weights_match else 'DO NOT match'} the final placement; "
        f"{rep.committed_moves} committed rebalance(s); {rep.tokens_per_second:.1f} tokens/s"
    )


def run(args: argparse.Namespace) -> int:
    from runtime_hooks.hf_serve import serve_hf

    mode = serve_pd.check_modes(args)
    if mode == "pd":
        return _run_pd(args)
    _defaults(args, mode)
    info, spec = _spec(args)
    if mode == "kill":
        return _run_kill(args, info, spec)
    if not args.json:
        echo(
            f"serve-demo: {info.model_class} on {args.ranks} gloo ranks, rebalance every "
            f"{args.rebalance_every} steps, {args.new_tokens} tokens x {args.prompts_per_rank} prompts per rank"
        )
    with elapsed_bar("serving", limit_s=args.timeout):
        rep = serve_hf(spec, timeout=args.timeout)
    if args.json:
        echo(json.dumps(rep.to_dict()))
    else:
        _print_report(rep)
    return 0 if rep.tokens_match and rep.weights_match and rep.quotas_match is not False else 1


def _run_pd(args: argparse.Namespace) -> int:
    """``--disaggregated``: the two pools in one launch; the report as text or JSON."""
    from moe_placement.cli.validate import check_numbers
    from runtime_hooks.ep_layer import runtime_dispatch
    from runtime_hooks.hf_validate import describe_model
    from runtime_hooks.pd.serve import serve_pd as serve_pools

    check_numbers(
        args, positive=("timeout",), at_least_one=("new_tokens", "prompt_len"), non_negative=("seed",)
    )
    runtime_dispatch(args.dispatch)
    info = describe_model(args.model)
    spec = serve_pd.pd_spec(args, info, MAX_SERVE_TOKENS)
    if not args.json:
        P, D = spec.ranks
        echo(
            f"serve-demo --disaggregated: {info.model_class}, {P} prefill + {D} decode gloo ranks, {spec.requests} "
            f"requests x {spec.new_tokens} tokens, on hand-off failure: {spec.on_handoff_failure}"
        )
    with elapsed_bar("serving", limit_s=args.timeout):
        rep = serve_pools(spec, timeout=args.timeout)
    if args.json:
        echo(json.dumps(rep.to_dict()))
        return 0 if serve_pd.pd_ok(rep) else 1
    return 0 if serve_pd.print_pd(rep) else 1


def _run_kill(args: argparse.Namespace, info, live_spec) -> int:
    """``--kill-rank R --at-step S``: the co-located pool loses rank R at step S and serves on."""
    from runtime_hooks.pd.rank_loss import serve_rank_loss

    spec = serve_pd.kill_spec(args, live_spec)
    if not args.json:
        echo(
            f"serve-demo: {info.model_class} on {args.ranks} gloo ranks, rank {spec.kill_rank} killed at step "
            f"{spec.at_step}, on rank loss: {spec.on_rank_loss}"
        )
    with elapsed_bar("serving", limit_s=args.timeout):
        try:
            rep = serve_rank_loss(spec, timeout=args.timeout)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    if args.json:
        echo(json.dumps(rep.to_dict()))
        return 0 if serve_pd.kill_ok(rep) else 1
    return 0 if serve_pd.print_kill(rep) else 1


if __name__ == "__main__":  # pragma: no cover
    ap = argparse.ArgumentParser(prog="moe-placement")
    add_parser(ap.add_subparsers(dest="command", required=True))
    a = ap.parse_args()
    raise SystemExit(a.func(a))
