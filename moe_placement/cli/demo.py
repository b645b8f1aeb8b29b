"""``moe-placement demo``: the whole pipeline on the built-in synthetic workload.

Steps: write a seeded synthetic trace -> inspect it -> solve (greedy, and cpsat + locality unless
``--quick``) on the first half of its prompts -> evaluate on the held-out second half -> write engine
files for the best placement -> validate it on real gloo ranks (unless ``--skip-validate``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from pathlib import Path

from moe_placement.cli.common import (
    bounded_int,
    check_folder_outputs,
    echo,
    ep_size_int,
    format_table,
    output_files,
    progress,
    root_parser,
    seconds,
    seed_int,
    warn,
)
from moe_placement.cli.inspect_trace import cmd_inspect

__all__ = ["add_parser", "cmd_demo"]

_EXPERTS = 64  # logical experts of the demo workload (16 redundant slots on top)

# Solvers the full demo runs after the baseline, in order; the last that ran writes the engine files.
_SOLVERS = ("cpsat", "locality")
# Work units per layer for solvers run on a work limit instead of a clock (reproducible across machines).
_WORK_PER_LAYER = {"locality": 100}

_ENGINE_FILES = (
    ("native", "placement.json"),
    ("sglang", "sglang_init_expert_location.json"),
    ("trtllm", "moe_load_balancer.yaml"),
    ("vllm-ascend", "vllm_ascend_expert_map.json"),
)

_EVAL_COLUMNS = [
    ("placement", "placement", -1),
    ("par", "held-out PAR", 4),
    ("par_vs_greedy", "/greedy", 3),
    ("step_par", "step PAR", 4),
    ("remote_nodes", "remote nodes/token", 3),
    ("nodes_vs_greedy", "/greedy", 3),
    ("remote_gpus", "remote GPUs/token", 3),
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``demo`` sub-command's arguments."""
    p = sub.add_parser("demo", help="the whole pipeline on the built-in synthetic workload")
    p.add_argument("--out", default="demo-out")
    p.add_argument("--tokens", type=bounded_int(100, 10**7, "the demo workload"), default=20000)
    p.add_argument("--layers", type=bounded_int(1, 128, "the demo workload"), default=4)
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--time-limit", type=seconds, default=8.0)
    p.add_argument(
        "--ep-size", type=ep_size_int, default=8, help="GPUs (also the gloo ranks of the validate step)"
    )
    p.add_argument("--num-nodes", type=ep_size_int, default=2)
    p.add_argument("--quick", action="store_true", help="greedy only")
    p.add_argument("--skip-validate", action="store_true")
    p.set_defaults(func=cmd_demo)


def _write_workload(args, claim):
    """Step 1: the seeded synthetic trace (``topk_ids [T, L, 6]`` over 64 experts), published in the
    claimed folder -> (trace, its path)."""
    from profiling.readers import trace_bytes
    from profiling.synthetic import synthetic_trace

    echo("== 1. workload: built-in SYNTHETIC trace (seeded; skewed experts, co-activated clusters, drift)")
    trace = synthetic_trace(
        num_tokens=args.tokens,
        num_layers=args.layers,
        num_logical_experts=_EXPERTS,
        top_k=6,
        num_prompts=max(2, args.tokens // 100),
        seed=args.seed,
    )
    (tpath,) = claim.publish({"trace.npz": trace_bytes(trace)})
    echo(f"wrote {tpath}")
    return trace, tpath


def _solve_all(args, trace, fit, topo) -> dict:
    """Step 3: trivial, the baseline, and (unless ``--quick``) :data:`_SOLVERS` fitted on ``fit``; by name."""
    from placement.model import Placement
    from solver.api import BASELINE, solve

    results = {}
    results["trivial"] = Placement.trivial(trace.num_layers, _EXPERTS, topo, trace.layer_ids)
    results[BASELINE], _ = solve(BASELINE, topology=topo, trace=fit)
    for name in progress(_SOLVERS if not args.quick else (), desc="solving"):
        work = _WORK_PER_LAYER.get(name)
        options = {"work_limit": work * fit.num_layers} if work else None
        try:
            results[name], rep = solve(
                name, topology=topo, trace=fit, time_limit=args.time_limit, seed=args.seed, options=options
            )
        except ImportError as exc:
            warn(f"solver {name} unavailable: {exc}")
            continue
        if rep.bound > 0:  # a proven bound: the exact model
            echo(
                f"{name}: status {rep.status}, peak load summed over layers {rep.objective:.0f} "
                f"({BASELINE} {sum(lr.baseline_objective or 0 for lr in rep.layers):.0f}), "
                f"proven bound {rep.bound:.0f}, gap {rep.gap:.4f}"
            )
        else:
            echo(f"{name}: status {rep.status}, {rep.wall_time_s:.1f}s")
    return results


def _evaluate_all(results: dict, held) -> list[dict]:
    """Step 4: held-out PAR, step PAR and remote traffic of each placement, also relative to greedy."""
    from placement.dispatch import LOCAL
    from placement.metrics import evaluate
    from solver.api import BASELINE

    rows = []
    for name, pl in results.items():
        d = evaluate(pl, held, LOCAL, step_tokens=16).to_dict()
        rows.append(
            {
                "placement": name,
                "par": d["par"],
                "step_par": d["step_par"],
                "remote_nodes": d["remote_nodes_per_token"],
                "remote_gpus": d["remote_gpus_per_token"],
            }
        )
    g = rows[list(results).index(BASELINE)]
    for r in rows:
        r["par_vs_greedy"] = r["par"] / g["par"]
        r["nodes_vs_greedy"] = r["remote_nodes"] / g["remote_nodes"]
    return rows


def _write_engine_files(results: dict, claim) -> None:
    """Step 5: the last placement solved (the last of :data:`_SOLVERS` that ran, else the baseline) in
    every engine format, published in the claimed folder as one."""
    from placement.formats import placement_files

    best = list(results)[-1]
    echo(f"\n== 5. write engine files for the {best} placement")
    files = {}
    for fmt, name in _ENGINE_FILES:
        files.update(
            (Path(f).name, data) for f, data in placement_files(results[best], claim.folder / name, fmt)
        )
    for p in claim.publish(files):
        echo(f"wrote {p}")


def _validate(out: Path, tpath: Path, ep_size: int, offset: int) -> int:
    """Step 6: ``moe-placement validate`` on the written placement, replaying held-out tokens of layer 0."""
    echo("\n== 6. moe-placement validate (real torch.distributed gloo ranks replay the held-out routing)")
    if (
        importlib.util.find_spec("torch") is None
        or importlib.util.find_spec("moe_placement.cli.validate") is None
    ):
        warn("torch runtime not installed: skipping validate (pip install torch==2.13.0)")
        return 0
    from placement.dispatch import LOCAL

    mod = importlib.import_module("moe_placement.cli.validate")
    parser, sub = root_parser()
    mod.add_parser(sub)
    vargs = parser.parse_args(
        [
            "validate",
            str(out / "placement.json"),
            "--trace",
            str(tpath),
            "--ranks",
            str(ep_size),
            "--dispatch",
            LOCAL.name,
            "--layers",
            "0",
            "--offset",
            str(offset),
        ]
    )
    return int(mod.run(vargs))


def cmd_demo(args: argparse.Namespace) -> int:
    """Steps: workload -> inspect -> solve -> evaluate held out -> engine files -> validate."""
    from moe_placement.base.folders import claim_folder
    from placement.dispatch import LOCAL
    from placement.topology import Topology

    topo = Topology.from_redundant(_EXPERTS, 16, args.ep_size, args.num_nodes)  # checked before writing
    names = ["trace.npz", *(f.name for fmt, n in _ENGINE_FILES for f in output_files(n, fmt))]
    out = check_folder_outputs(args.out, names)
    with claim_folder(out, "demo", names) as claim:  # one run's files; a concurrent demo is refused
        trace, tpath = _write_workload(args, claim)
        echo("\n== 2. moe-placement inspect")
        cmd_inspect(
            argparse.Namespace(trace=str(tpath), json=False, plot=None, domains=None, chunk_tokens=None)
        )
        fit, held = trace.split(0.5)
        echo(
            f"\n== 3. moe-placement solve (fit on the first half of prompts; {topo.ep_size} GPUs, {topo.num_nodes} "
            f"nodes, {topo.num_physical_experts - _EXPERTS} redundant slots)"
        )
        results = _solve_all(args, trace, fit, topo)
        echo(
            f"\n== 4. moe-placement evaluate (held-out second half, dispatch {LOCAL.name}, 16 tokens per rank per step)"
        )
        echo(format_table(_evaluate_all(results, held), _EVAL_COLUMNS))
        _write_engine_files(results, claim)
    if args.skip_validate:
        return 0
    return _validate(out, tpath, topo.ep_size, fit.num_tokens)
