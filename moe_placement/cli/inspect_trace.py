"""``moe-placement inspect``: per-layer skew of a routing trace (table, JSON, optional plots).

(Named ``inspect_trace`` so that it never shadows the standard library's ``inspect``.)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
from pathlib import Path

import numpy as np

from moe_placement.cli.common import (
    CliError,
    check_folder_outputs,
    echo,
    format_table,
    open_trace,
    positive_int,
)

__all__ = ["add_parser", "cmd_inspect"]

_STREAM_ABOVE_BYTES = 4 * 1024**3
# The figures --plot may write (profiling.plots.trace_plots), checked against the trace before reading.
_PLOT_FILES = ("load_heatmap.png", "lorenz.png", "drift.png", "domain_distance.png", "coactivation.png")

_SKEW_COLUMNS = [
    ("layer_id", "layer", -1),
    ("max_over_mean", "max/mean", 3),
    ("gini", "gini", 3),
    ("entropy", "entropy", 3),
    ("idle_experts", "idle", -1),
    ("top1_share", "top1", 3),
    ("hottest_expert", "hottest", -1),
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``inspect`` sub-command's arguments."""
    p = sub.add_parser("inspect", help="per-layer skew of a trace")
    p.add_argument("trace", help="trace file (.npz, SGLang .pt dump, TensorRT-LLM folder)")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--plot", metavar="DIR", help="write plots (load heatmap, Lorenz curves, drift, co-activation)"
    )
    p.add_argument("--domains", nargs="+", help="per-domain files: domains to keep")
    p.add_argument(
        "--chunk-tokens",
        type=positive_int,
        help="read a per-token .npz in chunks of this many tokens (bounded memory; automatic above 4 GB)",
    )
    p.set_defaults(func=cmd_inspect)


def _streamed_counts(args):
    """Counts of a per-token npz read in chunks (``--chunk-tokens``, or automatically for huge files)."""
    from profiling.readers import stream_counts

    p = Path(args.trace)
    if p.suffix != ".npz" or not p.is_file():
        return None
    import zipfile

    try:
        with zipfile.ZipFile(p) as zf:
            names = zf.namelist()
            declared = sum(i.file_size for i in zf.infolist())
    except (zipfile.BadZipFile, OSError):
        return None  # read_trace gives the clear error
    if "topk_ids.npy" not in names or not (args.chunk_tokens or declared > _STREAM_ABOVE_BYTES):
        return None
    meta = {}
    with zipfile.ZipFile(p) as zf:  # the small arrays that say E and the layer ids
        for key in ("counts", "counts_real", "layer_ids", "num_logical_experts"):
            if key + ".npy" in names:
                with zf.open(key + ".npy") as fh:
                    meta[key] = np.lib.format.read_array(fh, allow_pickle=False)
    if "num_logical_experts" in meta:
        E = int(meta["num_logical_experts"])
    elif "counts" in meta or "counts_real" in meta:
        E = int(meta.get("counts", meta.get("counts_real")).shape[-1])
    else:
        raise CliError(
            f"{p}: streaming needs the expert count ('counts' or 'num_logical_experts' in the file)"
        )
    counts = stream_counts(p, E, chunk_tokens=args.chunk_tokens or 1 << 20)
    ids = tuple(int(x) for x in meta["layer_ids"]) if "layer_ids" in meta else tuple(range(counts.shape[0]))
    return counts, ids


def _load_inspected(args):
    """The trace to inspect: streamed counts (``counts [L, E]`` as one window) or the whole trace."""
    from profiling.trace import RoutingTrace

    streamed = _streamed_counts(args) if not args.plot else None
    if streamed is None:
        return open_trace(args.trace, domains=args.domains)
    counts, ids = streamed
    return RoutingTrace(
        num_logical_experts=counts.shape[1],
        window_counts=counts[None],
        layer_ids=ids,
        name=Path(args.trace).stem + " (streamed counts)",
    )


def _skew_summary(trace) -> tuple[list[dict], dict]:
    """Per-layer skew rows (one dict per layer) and the trace summary with the max/mean range added."""
    from profiling.skew import skew_table

    rows = skew_table(trace)
    summary = trace.summary()
    ratios = np.array([r["max_over_mean"] for r in rows])  # [L]
    summary.update(
        {
            "max_over_mean_median": float(np.median(ratios)),
            "max_over_mean_min": float(ratios.min()),
            "max_over_mean_max": float(ratios.max()),
        }
    )
    return rows, summary


def _write_plots(claim, trace) -> list[str]:
    """``--plot DIR``: publish the inspect plots in the claimed folder; their paths (empty without it)."""
    if claim is None:
        return []
    if importlib.util.find_spec("matplotlib") is None:
        raise CliError("--plot needs the viz extra: pip install matplotlib")
    from profiling.plots import to_png, trace_figures

    return [str(p) for p in claim.publish({n: to_png(f) for n, f in trace_figures(trace).items()})]


def _print_skew(trace, rows: list[dict], summary: dict, plots: list[str]) -> None:
    """The human-readable report: one header line, the per-layer table, the max/mean range, the plots."""
    kind = "synthetic " if summary["synthetic"] else ""
    shape = (
        f"{summary['tokens']} tokens, top-{summary['top_k']}"
        if trace.has_tokens
        else f"{summary['windows']} count windows"
    )
    echo(
        f"{kind}trace {trace.name}: {shape}, {summary['layers']} layers, {summary['num_logical_experts']} experts"
    )
    echo(format_table(rows, _SKEW_COLUMNS))
    echo(
        f"max/mean expert load: median {summary['max_over_mean_median']:.2f} "
        f"(range {summary['max_over_mean_min']:.2f}-{summary['max_over_mean_max']:.2f})"
    )
    for p in plots:
        echo(f"wrote {p}")


def cmd_inspect(args: argparse.Namespace) -> int:
    """Steps: check and claim the plot folder -> load (or stream) the trace -> per-layer skew -> plots ->
    print (table or JSON)."""
    from moe_placement.base.folders import claim_folder
    from profiling.readers import require_data

    claimed = None
    if args.plot:
        check_folder_outputs(args.plot, _PLOT_FILES, inputs=[args.trace])
        claimed = claim_folder(args.plot, "inspect", _PLOT_FILES)
    with claimed or contextlib.nullcontext() as claim:
        trace = _load_inspected(args)
        require_data(trace, args.trace)  # max/mean of zero load is 0 / 0: undefined, never a perfect 1.000
        rows, summary = _skew_summary(trace)
        plots = _write_plots(claim, trace)
    if args.json:
        echo(json.dumps({"summary": summary, "layers": rows, "plots": plots}, indent=1))
        return 0
    _print_skew(trace, rows, summary, plots)
    return 0
