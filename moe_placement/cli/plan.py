"""``moe-placement plan``: plan the deployment, not one step: co-located, prefill/decode split or
replicas, ranked by simulated goodput per GPU under latency targets (docs/plan.md).

Parse -> :func:`moe_placement.apps.deploy.plan` -> print the ranked table, the reason and the launch
commands (or ``--json``) -> write ``--output`` as one unit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

from moe_placement.cli.common import (
    CliError,
    bounded_float,
    bounded_int,
    check_folder_outputs,
    echo,
    ep_size_int,
    hardware_help,
    link_names,
    model_help,
    non_negative_int,
    open_trace,
    positive_int,
    seed_int,
    warn,
)

__all__ = ["add_parser", "run"]

_RATE = bounded_float(0.0, 1e9, lo_open=True)
_MS = bounded_float(0.0, 1e9, lo_open=True)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from moe_placement.apps.deploy.options import DEPLOYMENT_KINDS
    from moe_placement.apps.deploy.workloads import BUILTIN_WORKLOADS, MAX_LENGTH
    from placement.cost.handoff import STREAMING
    from placement.routing.rules import ROUND_ROBIN, rule_names

    p = subparsers.add_parser(
        "plan",
        help="plan a deployment (co-located, prefill/decode split, replicas) by simulated goodput per GPU",
        description="Search deployments of the model on the cluster (each pool's layout from the layout "
        "planner), simulate requests of the workload on each (continuous batching, chunked prefill, KV "
        "hand-off), find the goodput per GPU under the TTFT/TPOT targets, rank, explain, and write the "
        "winner's placement files and launch commands.",
    )
    _add_cluster_flags(p)
    p.add_argument(
        "--trace", default=None, help="routing trace: expert skew, prompt lengths, per-phase placements"
    )
    p.add_argument(
        "--workload",
        default=None,
        help=f"{', '.join(BUILTIN_WORKLOADS)}, or a workload .json (default: the trace's prompts, else chat)",
    )
    lengths = bounded_int(1, MAX_LENGTH, "MAX_STEP_TOKENS")
    p.add_argument("--prompt-len", type=lengths, default=None, help="fix every prompt's length (tokens)")
    p.add_argument("--output-len", type=lengths, default=None, help="fix every output's length (tokens)")
    p.add_argument(
        "--rate", type=_RATE, default=None, help="simulate this rate (requests/s) instead of searching"
    )
    p.add_argument(
        "--ttft-ms", type=_MS, default=2000.0, help="time-to-first-token target, ms (default 2000)"
    )
    p.add_argument(
        "--tpot-ms", type=_MS, default=100.0, help="time-per-output-token target, ms (default 100)"
    )
    p.add_argument(
        "--slo-attainment",
        type=bounded_float(0.0, 1.0, lo_open=True),
        default=0.9,
        help="share of requests that must meet both targets (default 0.9)",
    )
    p.add_argument(
        "--deployments",
        default=",".join(DEPLOYMENT_KINDS),
        help=f"comma-separated kinds to search (default {','.join(DEPLOYMENT_KINDS)})",
    )
    p.add_argument(
        "--requests", type=positive_int, default=None, help="fewest requests simulated per rate (1000)"
    )
    p.add_argument(
        "--max-requests", type=positive_int, default=None, help="most requests simulated per rate (40000)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small search: one chunk size (2048/rank), 64 sequences per rank, 2 splits, 2 bisection steps",
    )
    p.add_argument("--kv-streaming", choices=STREAMING, default="layer", help="how the KV hand-off is sent")
    p.add_argument(
        "--layout-steps",
        type=non_negative_int,
        default=None,
        help="with a --trace of the model's experts: its steps priced per layout (default 16; 0: every step)",
    )
    p.add_argument(
        "--route",
        choices=rule_names(),
        default=ROUND_ROBIN.name,
        help="routing rule of requests to ranks (placement.routing; default round-robin)",
    )
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--output", default=None, help="folder for plan.json, plan.html, launch.sh and placements")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (docs/cli.md)")
    p.set_defaults(func=run)


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    """The model and the cluster: ``--model``, ``--nodes``, ``--gpus-per-node``, ``--hardware`` and the
    links (a preset name, or a rate with its unit: the hand-off is priced from it)."""
    from placement.cost.hardware import DEFAULT_HARDWARE

    p.add_argument("--model", required=True, help=model_help())
    p.add_argument("--nodes", type=ep_size_int, required=True, help="nodes in the cluster")
    p.add_argument("--gpus-per-node", type=ep_size_int, default=8)
    p.add_argument("--hardware", default=DEFAULT_HARDWARE, help=f"GPU preset: {hardware_help()}")
    p.add_argument(
        "--intra-link",
        default=None,
        help=f"intra-node link: a preset (default: the GPU's NVLink; one of {link_names()}) or a rate with "
        "its unit (e.g. 400Gbit/s or 50GB/s)",
    )
    p.add_argument(
        "--inter-link",
        default=None,
        help=f"inter-node link: a preset (default rdma; one of {link_names()}) or a rate with its unit "
        "(e.g. 200Gbit/s = 25GB/s)",
    )


def _link(name: str | None, like):
    """A link preset's name (left to cluster_preset), or a rate with its unit as a link."""
    from placement.cost.handoff import link_with_rate, parse_rate
    from placement.cost.hardware import LINKS

    if name is None or name.lower() in LINKS:
        return name, None
    if not any(ch.isdigit() for ch in name):
        raise CliError(f"unknown link {name!r}; use one of {', '.join(LINKS)} or a rate such as 200Gbit/s")
    try:
        return None, link_with_rate(like, parse_rate(name), name)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _cluster(args):
    from dataclasses import replace

    from placement.cost.hardware import LINKS, cluster_preset

    intra, intra_rate = _link(args.intra_link, LINKS["nvlink4"])
    inter, inter_rate = _link(args.inter_link, LINKS["rdma"])
    cl = cluster_preset(args.hardware, intra, inter, args.gpus_per_node)
    if intra_rate is not None:
        nvl = cl.gpu.nvlink  # a rate-given intra-node link keeps the GPU's NVLink latencies
        cl = replace(cl, intra=replace(intra_rate, latency=nvl.latency, normal_latency=nvl.normal_latency))
    if inter_rate is not None:
        cl = replace(cl, inter=inter_rate)
    return cl


def _options(args):
    from moe_placement.apps.deploy import DeployOptions

    kinds = tuple(k.strip() for k in args.deployments.split(",") if k.strip())
    make = DeployOptions.quick if args.quick else DeployOptions
    extra = {}
    if args.requests is not None:
        extra["requests"] = args.requests
    if args.max_requests is not None:
        extra["max_requests"] = args.max_requests
    elif args.requests is not None:  # the most simulated per rate is at least the fewest asked
        extra["max_requests"] = max(args.requests, make().max_requests)
    if args.layout_steps is not None:
        extra["layout_steps"] = args.layout_steps or None
    return make(
        ttft_ms=args.ttft_ms,
        tpot_ms=args.tpot_ms,
        slo_attainment=args.slo_attainment,
        deployments=kinds,
        rate=args.rate,
        seed=args.seed,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        kv_streaming=args.kv_streaming,
        route=args.route,
        **extra,
    )


def _table(d: dict) -> list[str]:
    head = (
        f"{'#':>2} {'deployment':<62} {'GPUs':<14} {'goodput/GPU':>11} {'p99 TTFT':>9} {'p99 TPOT':>9} "
        f"{'weights GB':>10} {'KV GB/GPU':>10}"
    )
    lines = [head, "-" * len(head)]
    for i, r in enumerate(d["deployments"]):
        gpus = "+".join(f"{p['phase'][0].upper()}{p['gpus']}" for p in r["pools"])
        kv = "/".join(f"{p['memory_gb']['kv_free']:.0f}" for p in r["pools"])
        wts = "/".join(f"{p['memory_gb']['weights']:.0f}" for p in r["pools"])
        t, q = r["ttft_ms"]["p99"], r["tpot_ms"]["p99"]
        lines.append(
            f"{i + 1:>2} {r['label'][:62]:<62} {gpus:<14} {r['goodput_rps_per_gpu']:>11.4g} "
            f"{'n/a' if t is None else f'{t:.0f}':>9} {'n/a' if q is None else f'{q:.1f}':>9} {wts:>10} {kv:>10}"
            + ("" if r["met_targets"] else "  (targets missed)")
        )
    return lines


def _print(d: dict, files: list) -> None:
    c, t, w = d["cluster"], d["targets"], d["workload"]
    echo(
        f"{d['model']} on {c['nodes']} x {c['gpus_per_node']} {c['gpu']} ({c['intra_link']}/{c['inter_link']}); "
        f"workload {w['name']} (median prompt {w['median_prompt']}, output {w['median_output']}); targets TTFT <= "
        f"{t['ttft_ms']:g} ms, TPOT <= {t['tpot_ms']:g} ms for {t['slo_attainment']:.0%}"
    )
    echo(
        "goodput in requests/s per GPU, latencies in ms at that rate, memory per GPU of each pool "
        "(modelled, not measured); layouts in the deployment's label"
    )
    for line in _table(d):
        echo(line)
    echo(f"* {d['reason']}")
    if d["launch"]:
        echo("launch (SGLang):")
        for cmd in d["launch"]["sglang"] + ([d["launch"]["router"]] if d["launch"]["router"] else []):
            echo(f"  {cmd}")
    for w_ in d["warnings"]:
        warn(w_)
    if files:
        echo(f"wrote {', '.join(str(f) for f in files)}")


def run(args: argparse.Namespace) -> int:
    """Steps: check outputs -> inputs -> plan -> write -> print. Exit 0 also when nothing meets the
    targets (the plan says so and names the closest; a warning on stderr)."""
    from moe_placement.apps.deploy import plan
    from moe_placement.apps.deploy.launch import output_names, plan_files
    from moe_placement.base.folders import claim_folder

    inputs = [args.model, str(Path(args.model) / "config.json"), args.trace, args.hardware, args.workload]
    out = check_folder_outputs(args.output, output_names(), inputs) if args.output else None
    trace = open_trace(args.trace) if args.trace else None
    claimed = claim_folder(out, "plan", output_names()) if out is not None else None
    with claimed or contextlib.nullcontext() as claim:
        try:
            options, cluster = _options(args), _cluster(args)
            where = str(out) if out else None
            result = plan(
                args.model, cluster, args.nodes, args.workload, trace=trace, options=options, output=where
            )
        except ValueError as exc:
            raise CliError(str(exc)) from None
        files = claim.publish(plan_files(result, out)) if claim is not None else []
    d = result.to_dict()
    if args.json:
        echo(json.dumps(d, indent=1))
        for w in d["warnings"]:
            warn(w)
        return 0
    _print(d, files)
    return 0
