"""The ``moe-placement`` command line (also ``python -m placement``).

The one module that imports every package; nothing imports it. Bad input ends with one line on
stderr and exit code 2; ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from cli.common import CliError, echo, elapsed_bar, progress, warn

# Subcommands owned by their own modules: each exposes add_parser(subparsers) and run(args).
_EXTENSIONS = ("cli.profile", "cli.validate", "cli.layout")
# Placement file formats (placement.formats.FORMATS holds the same names; not imported to keep startup light).
FORMAT_NAMES = ("native", "sglang", "trtllm", "vllm-ascend", "vllm")


# ---------------------------------------------------------------------------------------------
# shared argument handling
# ---------------------------------------------------------------------------------------------
def _read_trace(path: str, domains=None):
    from profiling.readers import read_trace

    p = Path(path)
    if not p.exists():
        raise CliError(f"trace {p} does not exist")
    return read_trace(p, domains=domains)


def _read_load(path: str) -> np.ndarray:
    p = Path(path)
    if not p.is_file():
        raise CliError(f"load file {p} does not exist")
    try:
        arr = np.load(p, allow_pickle=False)
    except Exception as exc:  # numpy raises several types for corrupt files
        raise CliError(f"{p}: not a readable .npy array ({type(exc).__name__}: {exc})") from None
    if hasattr(arr, "files"):  # an .npz: take 'counts' or the only array
        keys = list(arr.files)
        key = "counts" if "counts" in keys else (keys[0] if len(keys) == 1 else None)
        if key is None:
            raise CliError(
                f"{p}: .npz with several arrays {keys}; expected a 'counts' array [layers, experts]"
            )
        arr = arr[key]
    arr = np.asarray(arr)
    if arr.ndim == 3:
        arr = arr.sum(axis=0)
    if arr.ndim != 2 or arr.dtype.kind not in "iuf":
        raise CliError(f"{p}: load must be a numeric [layers, experts] array, got {arr.dtype} {arr.shape}")
    if not np.all(np.isfinite(arr)) or (arr.size and arr.min() < 0):
        raise CliError(f"{p}: load must be finite and >= 0")
    return arr.astype(np.float64)


def _read_placement(path: str, **kw):
    from placement.formats import read_placement

    p = Path(path)
    if not p.exists():
        raise CliError(f"placement file {p} does not exist")
    return read_placement(p, **kw)


def _check_output(path: str | None) -> Path | None:
    if path is None:
        return None
    p = Path(path)
    if p.exists() and p.is_dir():
        raise CliError(f"output {p} is a folder; give a file path")
    if not p.parent.exists():
        raise CliError(f"output folder {p.parent} does not exist; create it first")
    return p


def _fmt(x: float, nd: int = 3) -> str:
    return f"{x:.{nd}f}"


def _table(rows: list[dict], cols: list[tuple[str, str, int]]) -> str:
    """Render rows as a fixed-width table; cols are (key, header, decimals or -1 for text)."""
    cells = []
    for r in rows:
        line = []
        for key, _, nd in cols:
            v = r.get(key, "")
            if isinstance(v, float) and nd >= 0:
                line.append(f"{v:.{nd}f}")
            else:
                line.append(str(v))
        cells.append(line)
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, (_, h, _) in enumerate(cols)
    ]
    out = ["  ".join(h.rjust(w) for (_, h, _), w in zip(cols, widths))]
    out += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------
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


_STREAM_ABOVE_BYTES = 4 * 1024**3


def cmd_inspect(args) -> int:
    from profiling.skew import skew_table
    from profiling.trace import RoutingTrace

    streamed = _streamed_counts(args) if not args.plot else None
    if streamed is not None:
        counts, ids = streamed
        trace = RoutingTrace(
            num_logical_experts=counts.shape[1],
            window_counts=counts[None],
            layer_ids=ids,
            name=Path(args.trace).stem + " (streamed counts)",
        )
    else:
        trace = _read_trace(args.trace, domains=args.domains)
    rows = skew_table(trace)
    summary = trace.summary()
    ratios = np.array([r["max_over_mean"] for r in rows])
    summary.update(
        {
            "max_over_mean_median": float(np.median(ratios)),
            "max_over_mean_min": float(ratios.min()),
            "max_over_mean_max": float(ratios.max()),
        }
    )
    plots = []
    if args.plot:
        out = Path(args.plot)
        out.mkdir(parents=True, exist_ok=True)
        try:
            from profiling.plots import inspect_plots
        except ImportError as exc:
            raise CliError(f"--plot needs the viz extra (matplotlib): {exc}") from None
        plots = [str(p) for p in inspect_plots(trace, out)]
    if args.json:
        echo(json.dumps({"summary": summary, "layers": rows, "plots": plots}, indent=1))
        return 0
    kind = "synthetic " if summary["synthetic"] else ""
    shape = (
        f"{summary['tokens']} tokens, top-{summary['top_k']}"
        if trace.has_tokens
        else f"{summary['windows']} count windows"
    )
    echo(
        f"{kind}trace {trace.name}: {shape}, {summary['layers']} layers, {summary['num_logical_experts']} experts"
    )
    echo(
        _table(
            rows,
            [
                ("layer_id", "layer", -1),
                ("max_over_mean", "max/mean", 3),
                ("gini", "gini", 3),
                ("entropy", "entropy", 3),
                ("idle_experts", "idle", -1),
                ("top1_share", "top1", 3),
                ("hottest_expert", "hottest", -1),
            ],
        )
    )
    echo(
        f"max/mean expert load: median {summary['max_over_mean_median']:.2f} "
        f"(range {summary['max_over_mean_min']:.2f}-{summary['max_over_mean_max']:.2f})"
    )
    for p in plots:
        echo(f"wrote {p}")
    return 0


# ---------------------------------------------------------------------------------------------
# solve
# ---------------------------------------------------------------------------------------------
def _solver_options(args) -> dict:
    opts: dict = {}
    if args.solver in ("cpsat", "milp"):
        if args.objective != "tokens":
            opts["objective"] = args.objective
        if args.robust:
            opts["robust"] = args.robust
            opts["num_windows"] = args.num_windows
        if args.weighted:
            opts["weighted"] = True
        if args.node_constraint:
            opts["node_constraint"] = True
        if args.workers:
            opts["workers"] = args.workers
    if args.solver == "locality":
        opts["balance_slack"] = args.balance_slack
        if args.hidden_size:
            opts["hidden_size"] = args.hidden_size
        for flag, key in (
            ("everywhere", "num_everywhere"),
            ("gpu_slack", "gpu_slack"),
            ("source_model", "source_model"),
            ("work_limit", "work_limit"),
            ("share_margin", "share_margin"),
            ("drift_z", "drift_z"),
            ("share_overload", "share_overload"),
        ):
            if getattr(args, flag) is not None:
                opts[key] = getattr(args, flag)
    if args.previous:
        if args.max_moves is not None:
            opts["max_moves"] = args.max_moves
        if args.move_cost is not None:
            opts["move_cost"] = args.move_cost
    return opts


def cmd_solve(args) -> int:
    from placement.metrics import balance_stats, evaluate, expected_gpu_load, moved_slots
    from placement.model import Placement
    from placement.topology import Topology
    from solver.api import solve

    out = _check_output(args.output)
    if (args.trace is None) == (args.load is None):
        raise CliError("give exactly one of --trace T or --load L.npy")
    trace = held = None
    if args.trace:
        trace = _read_trace(args.trace)
        fit = trace
        if args.fit_fraction < 1.0:
            fit, held = trace.split(args.fit_fraction)
        load = fit.counts().astype(np.float64)
        layer_ids = trace.layer_ids
    else:
        load = _read_load(args.load)
        fit = None
        layer_ids = tuple(range(load.shape[0]))
    L, E = load.shape
    if args.num_redundant < 0:
        raise CliError(f"--num-redundant must be >= 0, got {args.num_redundant}")
    topo = Topology.from_redundant(E, args.num_redundant, args.ep_size, args.num_nodes)
    if args.num_groups is not None and (args.num_groups < 1 or E % args.num_groups):
        raise CliError(f"--num-groups {args.num_groups} must divide the {E} experts")
    previous = None
    name = args.solver
    if args.previous:
        previous = _read_placement(args.previous, ep_size=args.ep_size, num_nodes=args.num_nodes)
        if previous.physical_to_logical_map.shape != (L, topo.num_physical_experts):
            raise CliError(
                f"--previous has shape {previous.physical_to_logical_map.shape} but the problem is "
                f"{L} layers x {topo.num_physical_experts} slots"
            )
        if args.max_moves is None and args.move_cost is None:
            raise CliError("--previous needs --max-moves M or --move-cost C")
        name = "migration"
    elif args.max_moves is not None or args.move_cost is not None:
        raise CliError("--max-moves/--move-cost need --previous OLD (the current placement)")

    t0 = time.perf_counter()
    greedy, greedy_report = solve(
        "greedy", topology=topo, load=load, num_groups=args.num_groups, layer_ids=layer_ids
    )
    options = _solver_options(args)
    if name == "greedy":
        placement, report = greedy, greedy_report
    else:
        with elapsed_bar(f"{name}", args.time_limit):
            placement, report = solve(
                name,
                topology=topo,
                load=load,
                trace=fit,
                num_groups=args.num_groups,
                layer_ids=layer_ids,
                previous=previous,
                time_limit=args.time_limit,
                seed=args.seed,
                options=options,
            )
        # never worse than greedy on the fitted objective (even split); fall back with a warning
        if name in ("cpsat", "milp"):
            peak_new = expected_gpu_load(placement, load).max(axis=1).sum()
            peak_greedy = expected_gpu_load(greedy, load).max(axis=1).sum()
            if peak_new > peak_greedy * (1 + 1e-9):
                warn(
                    f"{name} found nothing better than greedy within {args.time_limit}s; writing the greedy placement"
                )
                placement = greedy.with_provenance(fallback_from=name)
    wall = time.perf_counter() - t0

    trivial = None
    try:
        trivial = Placement.trivial(L, E, topo, layer_ids)
    except ValueError:
        pass
    rows = []
    # locality trades balance for fewer remote nodes: show both, scored with the policy asked for
    comm_view = name == "locality" and held is not None and held.has_tokens
    candidates = {"trivial": trivial, "greedy": greedy, name: placement}
    for label, pl in candidates.items():
        if pl is None:
            continue
        row = {"placement": label, "fit_par": balance_stats(expected_gpu_load(pl, load))["par"]}
        if held is not None:
            ev = evaluate(pl, held, args.policy).to_dict()
            row["heldout_par"] = ev["par"]
            if comm_view and "remote_nodes_per_token" in ev:
                row["heldout_remote_nodes"] = ev["remote_nodes_per_token"]
        rows.append(row)
    payload = {
        "solver": name,
        "topology": topo.to_dict(),
        "num_logical_experts": E,
        "layers": L,
        "balance": rows,
        "report": report.to_dict(),
        "wall_time_s": wall,
    }
    if previous is not None:
        payload["moved_slots"] = moved_slots(previous, placement)
    written = []
    if out is not None:
        from placement.formats import write_placement

        written = [str(p) for p in write_placement(placement, out, args.format)]
        if args.weighted and name in ("cpsat", "milp"):
            try:
                from solver.exact import replica_weights, write_replica_weights

                wpath = out.with_name(out.name + ".weights.json")
                write_replica_weights(wpath, replica_weights(placement, load), placement)
                written.append(str(wpath))
            except ImportError:
                warn("weighted dispatch export is not available in this build")
    if args.report:
        from profiling.fileio import atomic_write_json

        atomic_write_json(args.report, payload)
        written.append(args.report)
    payload["written"] = written
    if args.json:
        echo(json.dumps(payload, indent=1, default=str))
        return 0
    echo(
        f"{name}: {L} layers x {E} experts -> {topo.num_physical_experts} slots on {topo.ep_size} GPUs "
        f"({topo.num_nodes} node(s), {topo.slots_per_gpu} slots per GPU), {wall:.2f}s"
    )
    general = [n for n in report.notes if not n.startswith("layer ")]
    per_layer = [n for n in report.notes if n.startswith("layer ")]
    for n in general + per_layer[:3]:
        echo(f"note: {n}")
    if len(per_layer) > 3:
        echo(f"note: ... {len(per_layer) - 3} more per-layer notes (see --json or --report)")
    echo("balance (peak-to-average GPU load, mean over layers; 1.0 is perfect):")
    cols = [("placement", "placement", -1), ("fit_par", "fitted PAR", 4)]
    if held is not None:
        cols.append(("heldout_par", f"held-out PAR ({args.policy})", 4))
    if comm_view:
        cols.append(("heldout_remote_nodes", "held-out remote nodes/token", 4))
    echo(_table(rows, cols))
    if name == "locality" and held is None:
        echo(
            "tip: --fit-fraction 0.5 --policy local scores held-out PAR and remote nodes per token side by side"
        )
    if name not in ("greedy", "locality"):
        lrows = []
        for g, lr in zip(greedy_report.layers, report.layers):
            lrows.append(
                {
                    "layer": lr.layer_id,
                    "greedy": g.objective,
                    "solver": lr.objective,
                    "bound": lr.bound,
                    "gap": lr.gap,
                    "status": lr.status,
                    **({"moved": lr.extra.get("moved_slots")} if previous is not None else {}),
                }
            )
        echo(f"per layer (peak GPU load in tokens; status of {name}):")
        lcols = [
            ("layer", "layer", -1),
            ("greedy", "greedy", 1),
            ("solver", name, 1),
            ("bound", "bound", 1),
            ("gap", "gap", 4),
            ("status", "status", -1),
        ]
        if previous is not None:
            lcols.append(("moved", "moved", -1))
        echo(_table(lrows, lcols))
        echo(
            f"overall: status {report.status}, objective {report.objective:.1f} vs greedy {greedy_report.objective:.1f} "
            f"({report.objective / max(greedy_report.objective, 1e-12):.4f}x), bound {report.bound:.1f}, gap {report.gap:.4f}"
        )
    if previous is not None:
        echo(f"moved slots: {payload['moved_slots']} of {placement.physical_to_logical_map.size}")
    for p in written:
        echo(f"wrote {p}")
    return 0


# ---------------------------------------------------------------------------------------------
# evaluate
# ---------------------------------------------------------------------------------------------
def cmd_evaluate(args) -> int:
    from placement.metrics import evaluate

    placement = _read_placement(args.placement)
    trace = _read_trace(args.trace)
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
    echo(f"{placement!r} on {trace!r}, policy {args.policy}")
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
    return 0


# ---------------------------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------------------------
def cmd_convert(args) -> int:
    out = _check_output(args.output)
    assert out is not None  # -o is required
    if args.format == "trace":
        from profiling.readers import write_trace

        trace = _read_trace(args.input)
        write_trace(trace, out)
        echo(f"wrote {out} ({trace!r})")
        return 0
    from placement.formats import write_placement

    kw = {
        k: v
        for k, v in (
            ("ep_size", args.ep_size),
            ("num_nodes", args.num_nodes),
            ("num_logical_experts", args.num_logical_experts),
        )
        if v is not None
    }
    if args.from_format:
        kw["format"] = args.from_format
    placement = _read_placement(args.input, **kw)
    written = write_placement(placement, out, args.format, num_hidden_layers=args.num_hidden_layers)
    for p in written:
        echo(f"wrote {p}")
    return 0


# ---------------------------------------------------------------------------------------------
# demo: the whole pipeline on the built-in synthetic workload
# ---------------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    from placement.formats import write_placement
    from placement.metrics import evaluate
    from placement.model import Placement
    from placement.topology import Topology
    from profiling.readers import write_trace
    from profiling.synthetic import synthetic_trace
    from solver.api import solve

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    echo("== 1. workload: built-in SYNTHETIC trace (seeded; skewed experts, co-activated clusters, drift)")
    trace = synthetic_trace(
        num_tokens=args.tokens,
        num_layers=args.layers,
        num_logical_experts=64,
        top_k=6,
        num_prompts=max(2, args.tokens // 100),
        seed=args.seed,
    )
    tpath = out / "trace.npz"
    write_trace(trace, tpath)
    echo(f"wrote {tpath}")
    echo("\n== 2. moe-placement inspect")
    cmd_inspect(argparse.Namespace(trace=str(tpath), json=False, plot=None, domains=None, chunk_tokens=None))
    fit, held = trace.split(0.5)
    topo = Topology.from_redundant(64, 16, args.ep_size, args.num_nodes)
    echo(
        f"\n== 3. moe-placement solve (fit on the first half of prompts; {topo.ep_size} GPUs, {topo.num_nodes} nodes, "
        f"{topo.num_physical_experts - 64} redundant slots)"
    )
    results = {}
    results["trivial"] = Placement.trivial(trace.num_layers, 64, topo, trace.layer_ids)
    results["greedy"], _ = solve("greedy", topology=topo, trace=fit)
    solvers = ["cpsat", "locality"] if not args.quick else []
    for name in progress(solvers, desc="solving"):
        try:
            results[name], rep = solve(
                name, topology=topo, trace=fit, time_limit=args.time_limit, seed=args.seed
            )
            if name == "cpsat":
                echo(
                    f"{name}: status {rep.status}, peak load summed over layers {rep.objective:.0f} "
                    f"(greedy {sum(lr.baseline_objective or 0 for lr in rep.layers):.0f}), "
                    f"proven bound {rep.bound:.0f}, gap {rep.gap:.4f}"
                )
            else:
                echo(f"{name}: status {rep.status}, {rep.wall_time_s:.1f}s")
        except ImportError as exc:
            warn(f"solver {name} unavailable: {exc}")
    echo("\n== 4. moe-placement evaluate (held-out second half, policy local, 16 tokens per rank per step)")
    rows = []
    for name, pl in results.items():
        d = evaluate(pl, held, "local", step_tokens=16).to_dict()
        rows.append(
            {
                "placement": name,
                "par": d["par"],
                "step_par": d["step_par"],
                "remote_nodes": d["remote_nodes_per_token"],
                "remote_gpus": d["remote_gpus_per_token"],
            }
        )
    g = next(r for r in rows if r["placement"] == "greedy")
    for r in rows:
        r["par_vs_greedy"] = r["par"] / g["par"]
        r["nodes_vs_greedy"] = r["remote_nodes"] / g["remote_nodes"]
    echo(
        _table(
            rows,
            [
                ("placement", "placement", -1),
                ("par", "held-out PAR", 4),
                ("par_vs_greedy", "/greedy", 3),
                ("step_par", "step PAR", 4),
                ("remote_nodes", "remote nodes/token", 3),
                ("nodes_vs_greedy", "/greedy", 3),
                ("remote_gpus", "remote GPUs/token", 3),
            ],
        )
    )
    best = "locality" if "locality" in results else ("cpsat" if "cpsat" in results else "greedy")
    echo(f"\n== 5. write engine files for the {best} placement")
    for fmt, name in (
        ("native", "placement.json"),
        ("sglang", "sglang_init_expert_location.json"),
        ("trtllm", "moe_load_balancer.yaml"),
        ("vllm-ascend", "vllm_ascend_expert_map.json"),
    ):
        for p in write_placement(results[best], out / name, fmt):
            echo(f"wrote {p}")
    if args.skip_validate:
        return 0
    echo("\n== 6. moe-placement validate (real torch.distributed gloo ranks replay the held-out routing)")
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("cli.validate") is None:
        warn("torch runtime not installed: skipping validate (pip install torch==2.13.0)")
        return 0
    mod = importlib.import_module("cli.validate")
    parser = build_parser()
    vargs = parser.parse_args(
        [
            "validate",
            str(out / "placement.json"),
            "--trace",
            str(tpath),
            "--ranks",
            str(topo.ep_size),
            "--policy",
            "local",
            "--layers",
            "0",
            "--offset",
            str(fit.num_tokens),
        ]
    )
    return int(mod.run(vargs))


# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="moe-placement",
        description="Place the experts of a mixture-of-experts model on GPUs: inspect routing, solve, evaluate, "
        "export engine files, validate on real ranks.",
    )
    ap.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", help="per-layer skew of a trace")
    p.add_argument("trace", help="trace file (.npz, SGLang .pt dump, TensorRT-LLM folder)")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--plot", metavar="DIR", help="write plots (load heatmap, Lorenz curves, drift, co-activation)"
    )
    p.add_argument("--domains", nargs="+", help="per-domain files: domains to keep")
    p.add_argument(
        "--chunk-tokens",
        type=int,
        help="read a per-token .npz in chunks of this many tokens (bounded memory; automatic above 4 GB)",
    )
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("solve", help="compute a placement")
    p.add_argument("--trace", help="routing trace to fit on")
    p.add_argument("--load", help=".npy load matrix [layers, experts] (instead of --trace)")
    p.add_argument("--ep-size", type=int, required=True, help="EP ranks (GPUs)")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--num-redundant", type=int, default=0, help="redundant slots per layer")
    p.add_argument(
        "--num-groups", type=int, help="expert groups (hierarchical greedy when they divide over nodes)"
    )
    p.add_argument("--solver", choices=("greedy", "cpsat", "milp", "locality"), default="greedy")
    p.add_argument("--time-limit", type=float, default=10.0, help="seconds for the whole solve (all layers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, help="solver worker threads")
    p.add_argument("--objective", choices=("tokens", "decode"), default="tokens")
    p.add_argument("--robust", help="robust fit over windows: 'max' or a quantile like q90")
    p.add_argument("--num-windows", type=int, default=4)
    p.add_argument(
        "--weighted", action="store_true", help="also choose per-replica token shares (weighted dispatch)"
    )
    p.add_argument(
        "--node-constraint", action="store_true", help="keep expert groups on nodes inside the exact model"
    )
    p.add_argument(
        "--balance-slack", type=float, default=0.02, help="locality: allowed node-load excess over the mean"
    )
    p.add_argument(
        "--everywhere",
        type=int,
        metavar="H",
        help="locality: the H hottest experts get a replica on every node (default: chosen from the slots)",
    )
    p.add_argument(
        "--gpu-slack",
        type=float,
        metavar="X",
        help="locality: GPU peaks at most (1 + X) x greedy's on the fit trace (default 0.05)",
    )
    p.add_argument(
        "--source-model",
        choices=("auto", "trace", "uniform"),
        help="locality: attention-DP sources to fit with (auto: deal tokens round-robin when the trace "
        "has no source ranks and its prompts were dealt)",
    )
    p.add_argument(
        "--work-limit",
        type=int,
        metavar="STEPS",
        help="locality: bound the search by counted steps instead of --time-limit, so the same seed "
        "gives the same placement on any machine (a step is about 1-10 ms)",
    )
    p.add_argument(
        "--share-margin",
        type=float,
        metavar="X",
        help="locality, 2 slots per GPU: pair everywhere replicas as if (1 + X) x their fitted load "
        "(default: the busiest node's token share in the fit trace over the mean, minus 1)",
    )
    p.add_argument(
        "--drift-z",
        type=float,
        metavar="Z",
        help="locality, 2 slots per GPU: pair single-node experts as if their fitted load plus Z x their "
        "expected drift to unseen traffic (bootstrap over the fit prompts; default 1, 0: off)",
    )
    p.add_argument(
        "--share-overload",
        type=float,
        metavar="X",
        help="locality: the default --everywhere keeps (the busiest node's token share over the mean, "
        "minus 1) x (the everywhere experts' load share) at most X (default 0.08)",
    )
    p.add_argument("--hidden-size", type=int, help="model hidden size for bytes per token")
    p.add_argument("--previous", help="current placement: re-place with few moves")
    p.add_argument("--max-moves", type=int, help="with --previous: at most this many moved slots")
    p.add_argument(
        "--move-cost", type=float, help="with --previous: cost of one moved slot in tokens of peak load"
    )
    p.add_argument(
        "--fit-fraction",
        type=float,
        default=1.0,
        help="fit on this leading fraction of the trace's windows and score the rest (held-out)",
    )
    p.add_argument(
        "--policy", choices=("even", "local"), default="even", help="replica selection for held-out scoring"
    )
    p.add_argument("-o", "--output", help="placement file to write")
    p.add_argument("--format", choices=FORMAT_NAMES, default="native")
    p.add_argument("--report", help="write the solve report JSON here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("evaluate", help="score a placement on a trace")
    p.add_argument("placement")
    p.add_argument("trace")
    p.add_argument("--policy", choices=("even", "local"), default="even")
    p.add_argument("--step-tokens", type=int, help="tokens per rank per step for step_par")
    p.add_argument("--hidden-size", type=int, help="model hidden size for bytes_per_token")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser(
        "convert", help="convert placements between engine formats (or a trace to the native format)"
    )
    p.add_argument("input")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--format", choices=FORMAT_NAMES + ("trace",), required=True)
    p.add_argument("--from-format", choices=FORMAT_NAMES)
    p.add_argument("--ep-size", type=int)
    p.add_argument("--num-nodes", type=int)
    p.add_argument("--num-logical-experts", type=int)
    p.add_argument("--num-hidden-layers", type=int, help="SGLang: rows in the map (all hidden layers)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("demo", help="the whole pipeline on the built-in synthetic workload")
    p.add_argument("--out", default="demo-out")
    p.add_argument("--tokens", type=int, default=20000)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=8.0)
    p.add_argument("--ep-size", type=int, default=8, help="GPUs (also the gloo ranks of the validate step)")
    p.add_argument("--num-nodes", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="greedy only")
    p.add_argument("--skip-validate", action="store_true")
    p.set_defaults(func=cmd_demo)

    for modname in _EXTENSIONS:
        if importlib.util.find_spec(modname) is None:
            continue
        importlib.import_module(modname).add_parser(sub)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("moe-placement: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:  # CliError, InputFileError and bad-input ValueErrors
        if debug:
            raise
        msg = " ".join(str(exc).split()) or type(exc).__name__
        print(f"moe-placement: error: {msg}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug: say so in one line, show the traceback with --debug
        if debug:
            raise
        print(
            f"moe-placement: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
