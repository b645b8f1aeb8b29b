"""``moe-placement route``: route held-out requests with each routing rule and print the table
(:func:`moe_placement.apps.routing.evaluate_routing`), or ``--serve``: run the router process in front
of an engine (:mod:`runtime_hooks.dp_router`)."""

from __future__ import annotations

import argparse
import json
import sys

from moe_placement.cli.common import (
    CliError,
    bounded_float,
    bounded_int,
    check_output,
    check_writes,
    echo,
    ep_size_int,
    expert_count_int,
    format_table,
    hardware_help,
    hidden_size_int,
    model_help,
    non_negative_int,
    open_placement,
    open_trace,
    positive_int,
    seed_int,
    warn,
)

__all__ = ["add_parser", "cmd_route"]

RULES_FLAG = "--policies"  # the public name for the routing rules to compare


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``route`` sub-command's arguments."""
    from placement.dispatch import DISPATCH, LOCAL
    from placement.routing import rule_names
    from placement.routing.router import DEFAULT_CACHE_TOKENS

    names = ",".join(rule_names())
    p = sub.add_parser(
        "route", help="route requests to attention-DP ranks by load, prefix and expert affinity"
    )
    p.add_argument("--trace", help="per-token trace with request boundaries (offline mode)")
    p.add_argument("--ep-size", type=ep_size_int, help="GPUs = attention-DP ranks = EP ranks")
    p.add_argument("--num-nodes", type=ep_size_int, help="nodes")
    p.add_argument("--num-redundant", type=expert_count_int, help="redundant expert slots per layer")
    p.add_argument("--placement", help="route on this placement file instead of solving one on the fit part")
    p.add_argument(RULES_FLAG, dest="rules", default=names, help=f"comma-separated rules (default {names})")
    p.add_argument("--co-optimize", action="store_true", help="place with the affinity solver (co-optimized)")
    p.add_argument("--fit-fraction", type=bounded_float(0.0, 1.0, lo_open=True, hi_open=True), default=0.5)
    p.add_argument("--step-tokens", type=positive_int, help="requests in flight per rank (default 64)")
    p.add_argument(
        "--hidden-size", type=hidden_size_int, help="for bytes (default: the matching built-in model)"
    )
    p.add_argument("--workload", help="sessions workload FILE.json, or PROFILE:CONVERSATIONS to generate one")
    p.add_argument("--save-workload", help="write the generated workload here (JSON)")
    p.add_argument(
        "--signature-tokens", type=positive_int, default=32, help="prompt tokens a signature is made of"
    )
    p.add_argument("--max-imbalance", type=bounded_float(0.0, 100.0), default=0.05, help="drift cap (0.05)")
    p.add_argument(
        "--cache-tokens",
        type=non_negative_int,
        default=DEFAULT_CACHE_TOKENS,
        help=f"prefix cache per rank, tokens (default {DEFAULT_CACHE_TOKENS})",
    )
    p.add_argument("--kv-capacity", type=positive_int, help="KV tokens per rank (free-KV terms)")
    choices = tuple(n for n, m in DISPATCH.items() if m.route is not None or m.runtime)
    p.add_argument(
        "--dispatch", default=LOCAL.name, choices=choices, help=f"dispatch model (default {LOCAL.name})"
    )
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--output", help="write the placement routed on (native format)")
    p.add_argument("--json", action="store_true")
    _add_sim_args(p)
    _add_serve_args(p)
    p.set_defaults(func=cmd_route)


def _add_sim_args(p: argparse.ArgumentParser) -> None:
    from moe_placement.apps.deploy.workloads import MAX_REQUESTS
    from moe_placement.apps.routing import RouteOptions
    from placement.cost.hardware import DEFAULT_HARDWARE

    g = p.add_argument_group("time: the one cost model and the request simulator")
    g.add_argument("--model", help=f"model priced (default: the built-in matching the trace): {model_help()}")
    g.add_argument("--hardware", default=DEFAULT_HARDWARE, help=f"GPU preset: {hardware_help()}")
    ms = bounded_float(0.0, 1e9, lo_open=True)
    g.add_argument("--ttft-ms", type=ms, default=RouteOptions.ttft_ms, help="TTFT target of goodput (ms)")
    g.add_argument("--tpot-ms", type=ms, default=RouteOptions.tpot_ms, help="TPOT target of goodput (ms)")
    g.add_argument(
        "--slo-attainment",
        type=bounded_float(0.0, 1.0, lo_open=True),
        default=RouteOptions.slo_attainment,
        help="share of requests meeting both targets (goodput)",
    )
    g.add_argument(
        "--sim-requests",
        type=bounded_int(0, MAX_REQUESTS),
        default=RouteOptions.sim_requests,
        help="most requests of one request simulation per rule (0: no request simulation)",
    )


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from runtime_hooks.dp_router import ENGINE_PINS

    g = p.add_argument_group("router process (--serve)")
    g.add_argument("--serve", action="store_true", help="run the router process in front of an engine")
    g.add_argument("--engine", choices=tuple(ENGINE_PINS), help="the engine behind the router")
    g.add_argument("--upstream", action="append", help="engine URL (once), or one per rank (repeat)")
    g.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    g.add_argument("--port", type=bounded_int(0, 65535), default=30010, help="listen port (default 30010)")
    g.add_argument("--max-requests", type=positive_int, help="stop after this many requests")


def _rules(args) -> tuple[str, ...]:
    from placement.routing import ROUTING_RULES

    names = tuple(n.strip() for n in str(args.rules).split(",") if n.strip())
    bad = [n for n in names if n not in ROUTING_RULES]
    if bad or not names:
        raise CliError(
            f"{RULES_FLAG}: unknown rule {bad[0] if bad else '(none)'!r}; choose from {', '.join(ROUTING_RULES)}"
        )
    return names


def _workload(args):
    """The sessions document: a file, or ``PROFILE:N`` generated (and saved with --save-workload)."""
    from placement.routing.sessions import PROFILES, SessionSpec, generate_sessions, read_sessions

    spec = args.workload
    if spec is None:
        if args.save_workload:
            raise CliError(
                "--save-workload writes a generated workload: give --workload PROFILE:CONVERSATIONS"
            )
        return None
    profile, sep, n = spec.partition(":")
    if sep and profile in PROFILES:
        if not (n.isascii() and n.isdigit()) or not 1 <= int(n) <= 1 << 22:
            raise CliError(f"--workload {spec!r}: the conversation count after ':' must be 1..{1 << 22}")
        b = args.step_tokens or 64
        doc = generate_sessions(SessionSpec(profile, int(n), concurrency=args.ep_size * b, seed=args.seed))
        if args.save_workload:
            from moe_placement.base.fileio import atomic_write_json

            out = check_output(args.save_workload)
            check_writes([args.trace, args.placement], [out])
            atomic_write_json(out, doc)
        return doc
    if args.save_workload:
        raise CliError("--save-workload writes a generated workload; --workload names a file here")
    return read_sessions(spec)


def _check_offline(args) -> None:
    given = {"--trace": args.trace, "--ep-size": args.ep_size, "--num-nodes": args.num_nodes}
    given["--num-redundant"] = args.num_redundant
    missing = [flag for flag, v in given.items() if v is None]
    if missing:
        raise CliError(f"route needs {', '.join(missing)} (or --serve to run the router process)")
    if args.placement and args.co_optimize:
        raise CliError("--co-optimize places anew; --placement routes on a given placement: use one")
    if args.output:
        check_writes([args.trace, args.placement], [check_output(args.output)])


def cmd_route(args: argparse.Namespace) -> int:
    """Offline: read -> evaluate every rule -> table or JSON. ``--serve``: run the router process."""
    if args.serve:
        return _serve(args)
    _check_offline(args)
    from moe_placement.apps.routing import RouteOptions, evaluate_routing

    rules = _rules(args)
    trace = open_trace(args.trace)
    placement = open_placement(args.placement) if args.placement else None
    options = RouteOptions(
        ep_size=args.ep_size,
        num_nodes=args.num_nodes,
        num_redundant=args.num_redundant,
        rules=rules,
        co_optimize=args.co_optimize,
        fit_fraction=args.fit_fraction,
        step_tokens=args.step_tokens,
        hidden_size=args.hidden_size,
        signature_tokens=args.signature_tokens,
        max_imbalance=args.max_imbalance,
        cache_tokens=args.cache_tokens,
        kv_capacity=args.kv_capacity,
        dispatch=args.dispatch,
        seed=args.seed,
        model=args.model,
        hardware=args.hardware,
        ttft_ms=args.ttft_ms,
        tpot_ms=args.tpot_ms,
        slo_attainment=args.slo_attainment,
        sim_requests=args.sim_requests,
    )
    report = evaluate_routing(trace, options, placement=placement, workload=_workload(args))
    if args.output:
        from placement.formats import write_placement

        write_placement(report.solved, args.output)
    if args.json:
        echo(json.dumps(report.to_dict(), indent=1))
        return 0
    _print(report, args)
    return 0


_COLUMNS = [
    ("name", "rule", -1),
    ("remote_bytes_per_step", "remote MB/step", -1),
    ("remote_bytes_per_step_ratio", "vs rr greedy", 3),
    ("remote_fraction", "remote share", 3),
    ("step_par", "step_par", 3),
    ("busiest_rank_load", "busiest rank", 3),
    ("hit_rate", "hit rate", 3),
    ("ttft_saved_ms", "TTFT saved ms", 3),
    ("decode_step_ms", "step ms", 4),
    ("tpot_p50", "TPOT p50 ms", 3),
    ("tpot_p99", "TPOT p99 ms", 3),
    ("goodput_rps_per_gpu", "goodput/GPU", 1),
]


def _print(report, args) -> None:
    from moe_placement.apps.routing import rules_table

    rows = rules_table(report)
    for r in rows:
        b = r.get("remote_bytes_per_step")
        r["remote_bytes_per_step"] = "n/a" if b is None else f"{b / 1e6:.3f}"
        if r.get("remote_bytes_per_step_ratio") is None and r.get("remote_copies_per_step_ratio") is not None:
            r["remote_bytes_per_step_ratio"] = r["remote_copies_per_step_ratio"]
        for key in ("ttft_saved_ms", "decode_step_ms", "goodput_rps_per_gpu"):
            if r.get(key) is None:
                r[key] = "n/a"
        tpot = r.get("tpot_ms") or {}
        for q in ("p50", "p99"):
            r[f"tpot_{q}"] = "n/a" if tpot.get(q) is None else tpot[q]
    src = report.placement.get("source", "")
    co = report.placement["co_optimized"]
    echo(
        f"{report.held_out_requests} held-out requests on the placement from {src} (co-optimized: {co}); dispatch {args.dispatch}"
    )
    echo(format_table(rows, _COLUMNS))
    sim = report.simulation
    if sim.get("simulated"):
        echo(
            f"TPOT at {sim['rate_rps']:.4g} requests/s for every rule (round-robin's goodput); goodput: "
            f"{sim['targets']['slo_attainment']:.0%} within TTFT {sim['targets']['ttft_ms']:g} ms, TPOT "
            f"{sim['targets']['tpot_ms']:g} ms (modelled)"
        )
    for a in report.assumptions:
        echo(f"note: {a}")
    for w in report.warnings:
        warn(w)


def _serve(args) -> int:
    """The router process until Ctrl-C, SIGTERM or ``--max-requests``."""
    from placement.routing import RouterOptions
    from runtime_hooks.dp_router import serve

    if not args.engine or not args.upstream or args.ep_size is None:
        raise CliError(
            "--serve needs --engine, --upstream URL (once, or once per rank) and --ep-size (DP ranks)"
        )
    rules = _rules(args)
    if len(rules) != 1:
        raise CliError(f"--serve routes with one rule: give {RULES_FLAG} NAME (got {', '.join(rules)})")
    options = RouterOptions(
        max_imbalance=args.max_imbalance,
        kv_capacity=args.kv_capacity,
        cache_tokens=args.cache_tokens,
        seed=args.seed,
    )
    server = serve(
        args.engine,
        args.upstream,
        args.ep_size,
        rules[0],
        options,
        host=args.host,
        port=args.port,
        max_requests=args.max_requests,
    )
    host, port = server.server_address[:2]
    ups = ", ".join(args.upstream)
    echo(
        f"routing with {rules[0]} over {args.ep_size} ranks of {args.engine} at {ups}; listening on http://{host}:{port}"
    )
    sys.stdout.flush()
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0
