"""``moe-placement advise``: which EPLB option to run on SGLang or vLLM, from the user's own routing.

Parse -> :func:`moe_placement.apps.advise.advise` -> print the table and the recommendation, write ``--output``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from moe_placement.base.limits import MAX_CONTEXT_LEN
from moe_placement.cli.common import (
    CliError,
    bounded_float,
    bounded_int,
    check_folder_outputs,
    echo,
    format_table,
    hardware_help,
    open_trace,
    progress,
)

__all__ = ["add_parser", "run"]

REPORT = "advise.html"
JSON = "advise.json"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from moe_placement.apps.advise import AUTO_MODEL, engine_names
    from placement.cost.hardware import DEFAULT_HARDWARE
    from placement.steps import PHASES as STEP_PHASES

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
    p.add_argument(
        "--hardware",
        default=DEFAULT_HARDWARE,
        help=f"GPU preset: {hardware_help()} (moe-placement calibrate; the advice says measured only when the "
        "preset carries measured figures)",
    )
    p.add_argument("--nodes", type=bounded_int(1, 4096), required=True)
    p.add_argument("--gpus-per-node", type=bounded_int(1, 64), default=8)
    p.add_argument("--engine", choices=engine_names(), required=True)
    _add_knobs(p)
    _add_choice(p)
    p.add_argument(
        "--output",
        default=None,
        help=f"folder for {REPORT} (self-contained), {JSON} and every file the launch command names",
    )
    p.add_argument(
        "--phase",
        choices=STEP_PHASES,
        default=None,
        help="price and recommend on this phase's steps only (default: decode and prefill)",
    )
    p.add_argument("--json", action="store_true", help="print the advice as JSON")
    p.add_argument("--quick", action="store_true", help="300 prompts, fewer options and budgets (fast)")
    p.add_argument(
        "--no-stability",
        action="store_true",
        help="skip the decision-stability checks (about halves the time; decision_stable is then false, "
        "'not checked')",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="refuse (exit 2) instead of warning when a phase has < 20 held-out steps",
    )
    p.set_defaults(func=run)


def _add_knobs(p: argparse.ArgumentParser) -> None:
    """The deployment's knobs: each one given is pinned (the stability sweep leaves it alone)."""
    from moe_placement.apps.advise.options import DEFAULT_CONTEXT_LEN, OVERLAP
    from placement.steps import DEFAULT_STEP_TOKENS

    p.add_argument(
        "--decode-batch",
        type=bounded_int(1, 1 << 20),
        default=None,
        help="decode step_tokens: sequences in flight per rank, one token each per step "
        f"(default {DEFAULT_STEP_TOKENS['decode']})",
    )
    p.add_argument(
        "--prefill-chunk",
        type=bounded_int(1, 1 << 24),
        default=None,
        help="prefill step_tokens: tokens per rank per prefill chunk; the command then sets it (default: the "
        "engine's own for the command printed, e.g. SGLang's --chunked-prefill-size / --attn-dp-size)",
    )
    p.add_argument(
        "--context-len",
        type=bounded_int(1, MAX_CONTEXT_LEN, "MAX_CONTEXT_LEN"),
        default=None,
        help=f"cached tokens per sequence (default {DEFAULT_CONTEXT_LEN})",
    )
    p.add_argument(
        "--overlap",
        choices=OVERLAP,
        default=None,
        help="two-batch overlap: on puts the engine's flag in the command and prices it (default off, "
        "the engines' default)",
    )


def _add_choice(p: argparse.ArgumentParser) -> None:
    """How the choice is made: the least gain worth a change, and which half placements are fitted on."""
    from moe_placement.apps.advise.options import DEFAULT_MIN_GAIN, FIT_HALVES

    p.add_argument(
        "--min-gain",
        type=bounded_float(0.0, 1.0, hi_open=True),
        default=DEFAULT_MIN_GAIN,
        help="least net whole-step gain worth a change, a fraction judged at the low end of its range less "
        f"its band (default {DEFAULT_MIN_GAIN:g}: 1%%); below it the advice is no balancing",
    )
    p.add_argument(
        "--fit-half",
        choices=FIT_HALVES,
        default=FIT_HALVES[0],
        help="the half of the trace placements are fitted on; the other is held out (default first)",
    )


def _bar(items, total, desc):
    """A progress bar on a terminal; elsewhere one line per stage on stderr."""
    if sys.stderr.isatty():
        return progress(items, total=total, desc=f"advise: {desc}", min_seconds=0.0)
    print(f"advise: {desc} ({total} step{'s' if total != 1 else ''})", file=sys.stderr, flush=True)
    return items


def _options(args):
    from moe_placement.apps.advise import AdviseOptions

    if args.prefill_chunk is not None and args.phase == "decode":  # decode-batch also sizes the KV memory
        raise CliError(
            f"--prefill-chunk {args.prefill_chunk} sizes prefill steps, but --phase decode prices no prefill step; "
            "drop it"
        )
    kw = dict(
        gpus_per_node=args.gpus_per_node,
        decode_step_tokens=args.decode_batch,
        prefill_step_tokens=args.prefill_chunk,
        context_len=args.context_len,
        overlap=args.overlap,
        min_gain=args.min_gain,
        fit_half=args.fit_half,
        stability=not args.no_stability,
        strict=args.strict,
        phase=args.phase,
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
    ("decode", "decode gain", -1),
    ("prefill", "prefill gain", -1),
    ("memory_gb", "rep GB", 2),
    ("runs", "runs", -1),
]


def _gain(ph: dict | None) -> str:
    if ph is None:
        return "not priced"
    band = "n/a" if ph["band"] is None else f"{ph['band'] * 100:.2f}"
    return f"{ph['whole_step_gain'] * 100:+.2f}% +-{band}"


def _print(d: dict) -> None:
    c, rec = d["context"], d["recommendation"]
    echo(
        f"{c['engine']} {c['engine_version']}: {c['model']} on {c['nodes']} x {c['gpus_per_node']} {c['hardware']} "
        f"(modelled); trace {c['trace']['name']}, held-out steps "
        + ", ".join(f"{ph} {n}" for ph, n in d["held_out_steps"].items())
    )
    chosen = rec["option"]
    rows = []
    for o in d["options"]:
        mark = "* " if o["key"] == chosen else "  "
        rows.append(
            {
                "key": mark + o["key"],
                "window_par": o["window_par"],
                "decode": _gain(o["phases"].get("decode")),
                "prefill": _gain(o["phases"].get("prefill")),
                "memory_gb": next(iter(o["phases"].values()))["memory_gb"],
                "runs": "yes" if o["available"] else f"no: {o['unavailable_reason']}",
            }
        )
    echo(format_table(rows, _COLS))
    echo(f"recommendation: {d['summary']}")
    if len(rec["launch_commands"]) > 1:
        for node in rec["launch_commands"]:
            echo(f"node {node['node_rank']}: {node['command']}")
    for w in d["warnings"]:
        echo(f"warning: {w}")
    for a in d["assumptions"]:
        echo(f"* {a}")


def _files(out: Path, advice, d: dict) -> dict[str, bytes]:
    """Every file of ``--output`` as ``{name: bytes}``: the report, the JSON and the launch command's files."""
    from moe_placement.apps.advise import render_html
    from moe_placement.base.fileio import json_bytes
    from placement.formats import placement_files

    files = {REPORT: render_html(advice).encode(), JSON: json_bytes(out / JSON, d)}
    for name, (placement, hidden) in advice.files.items():
        fmt = "sglang" if advice.context["engine"] == "sglang" else "native"
        extra = {"num_hidden_layers": hidden} if fmt == "sglang" else {}
        files.update((Path(f).name, data) for f, data in placement_files(placement, name, fmt, **extra))
    return files


def run(args: argparse.Namespace) -> int:
    """Steps: check outputs -> claim ``--output`` -> read the trace -> advise -> publish -> print."""
    from moe_placement.apps.advise import advise
    from moe_placement.apps.advise.recommend import SGLANG_FILE, VLLM_FILE
    from moe_placement.base.folders import claim_folder
    from profiling.readers import require_data

    names = [REPORT, JSON, *(f + x for f in (SGLANG_FILE, VLLM_FILE) for x in ("", ".meta.json"))]
    inputs = [args.trace, args.model, args.hardware]  # a model or GPU preset JSON is an input too
    if args.model:
        inputs.append(str(Path(args.model) / "config.json"))  # a HF folder's config
    out = check_folder_outputs(args.output, names, inputs) if args.output is not None else None
    options = _options(args)
    with claim_folder(out, "advise", names) if out is not None else contextlib.nullcontext() as claim:
        trace = open_trace(args.trace)
        require_data(
            trace, args.trace
        )  # nothing routed: no balance to advise on (PAR of zero load is undefined)
        try:
            advice = advise(
                trace,
                args.model,
                args.hardware,
                options,
                progress=_bar,
                **({"output": str(out)} if out else {}),
            )
        except ValueError as exc:
            raise CliError(str(exc)) from None
        d = advice.to_dict()
        files = claim.publish(_files(out, advice, d)) if claim is not None else []
    if args.json:
        echo(json.dumps({**d, "files": [str(f) for f in files]}, indent=1))
        return 0
    _print(d)
    if files:
        echo(f"wrote {', '.join(str(f) for f in files)}")
    return 0
