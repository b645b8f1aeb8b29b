"""``moe-placement advise``: which EPLB option to run on SGLang or vLLM, from the user's own routing.

Parse -> :func:`solver.advise.advise` -> print the table and the recommendation, write ``--output``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cli.common import CliError, bounded_int, check_folder_outputs, echo, format_table, open_trace, progress

__all__ = ["add_parser", "run"]

REPORT = "advise.html"
JSON = "advise.json"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from solver.advise import AUTO_MODEL, engine_names

    p = subparsers.add_parser(
        "advise",
        help="recommend an engine's EPLB settings (redundant slots, dispatch, rebalancing) from a trace",
        description="Fit on the first half of the trace, score on the held-out second half: every EPLB option "
        "of the engine at several redundant slots per GPU, modelled step time and KV-cache cost, drift and "
        "rebalance break-even; prints a table and a recommendation with launch flags.",
    )
    p.add_argument("--trace", required=True, help="per-token routing trace (any format `inspect` reads)")
    p.add_argument(
        "--model",
        default=AUTO_MODEL,
        help=f"cost-side model: a built-in name, a model JSON, or {AUTO_MODEL} (the built-in with the trace's experts)",
    )
    p.add_argument("--hardware", default="h200", help="GPU preset (h100, h800, h200, b200) or a preset .json")
    p.add_argument("--nodes", type=bounded_int(1, 4096), required=True)
    p.add_argument("--gpus-per-node", type=bounded_int(1, 64), default=8)
    p.add_argument("--engine", choices=engine_names(), required=True)
    p.add_argument(
        "--decode-batch", type=bounded_int(1, 1 << 20), default=64, help="tokens per rank per decode step"
    )
    p.add_argument(
        "--prefill-chunk", type=bounded_int(1, 1 << 24), default=8192, help="tokens per rank per prefill step"
    )
    p.add_argument(
        "--context-len", type=bounded_int(1, 1 << 24), default=4096, help="cached tokens per sequence"
    )
    p.add_argument("--output", default=None, help=f"folder for {REPORT} (self-contained) and {JSON}")
    p.add_argument("--json", action="store_true", help="print the advice as JSON")
    p.add_argument("--quick", action="store_true", help="300 prompts, fewer options and budgets (fast)")
    p.set_defaults(func=run)


def _bar(items, total, desc):
    return progress(items, total=total, desc=f"advise: {desc}", min_seconds=0.0)


def _options(args):
    from solver.advise import AdviseOptions

    kw = dict(
        gpus_per_node=args.gpus_per_node,
        decode_batch=args.decode_batch,
        prefill_chunk=args.prefill_chunk,
        context_len=args.context_len,
        hardware_calibrated=str(args.hardware).endswith(".json"),
    )
    try:
        if args.quick:
            return AdviseOptions.quick_form(args.engine, args.nodes, **kw)
        return AdviseOptions(engine=args.engine, nodes=args.nodes, **kw)
    except ValueError as exc:
        raise CliError(str(exc)) from None


_COLS = [
    ("key", "option | dispatch | r/GPU", -1),
    ("window_par", "win PAR", 3),
    ("step_par_decode", "step PAR", 3),
    ("decode_moe_ms", "dec ms", 2),
    ("prefill_moe_ms", "pre ms", 1),
    ("redundant_gb_per_gpu", "rep GB", 2),
    ("kv_tokens_lost_per_gpu", "KV tok lost", 0),
]


def _print(d: dict) -> None:
    c = d["context"]
    echo(
        f"{c['engine']}: {c['model']} on {c['nodes']} x {c['gpus_per_node']} {c['hardware']}; trace "
        f"{c['trace']['name']} ({c['trace']['experts']} experts), held-out half scored"
    )
    rows = [{**r, "key": ("* " if r["key"] == d["chosen"] else "  ") + r["key"]} for r in d["rows"]]
    echo(format_table(rows, _COLS))
    be = d["break_even"]
    never = be["interval_s"] is None
    echo(
        f"drift: stale/fresh PAR {d['drift']['ratio']:.4f}; rebalance move {be['move_s'] * 1e3:.2f} ms; "
        f"break-even {'never' if never else format(be['interval_s'], '.3f') + ' s'}"
    )
    for p in d["migration_front"]:
        echo(
            f"  max_moves={p['max_moves']}: {p['move']['arrived_experts']} arrived experts, "
            f"{p['move']['seconds'] * 1e3:.2f} ms, held-out PAR {p['held_out_par']:.4f}"
        )
    echo(f"recommendation: {d['recommendation']}")
    for a in d["assumptions"]:
        echo(f"* {a}")


def _write(out: Path, advice, d: dict) -> list[Path]:
    from profiling.fileio import atomic_write_bytes, atomic_write_json
    from solver.advise import render_html

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / REPORT, render_html(advice).encode())
    atomic_write_json(out / JSON, d)
    return [out / REPORT, out / JSON]


def run(args: argparse.Namespace) -> int:
    """Steps: check outputs -> read the trace -> advise -> write -> print."""
    from profiling.readers import require_data
    from solver.advise import advise

    out = check_folder_outputs(args.output, [REPORT, JSON], [args.trace]) if args.output else None
    options = _options(args)
    trace = open_trace(args.trace)
    require_data(trace, args.trace)  # nothing routed: no balance to advise on (PAR of zero load is undefined)
    advice = advise(trace, args.model, args.hardware, options, progress=_bar)
    d = advice.to_dict()
    files = _write(out, advice, d) if out is not None else []
    if args.json:
        echo(json.dumps({**d, "files": [str(f) for f in files]}, indent=1))
        return 0
    _print(d)
    if files:
        echo(f"wrote {', '.join(str(f) for f in files)}")
    return 0
