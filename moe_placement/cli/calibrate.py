"""``moe-placement calibrate``: measure this machine's all-to-all, grouped GEMM and launch cost at a
model's real message sizes and write a hardware preset that ``--hardware PRESET.json`` reads.

Check every input -> plan the sweep (:mod:`placement.cost.calibration`) -> run it on real ranks
(:mod:`runtime_hooks.calibrate`: the project's launcher, or this process under torchrun) -> fit and build
the preset (:mod:`placement.cost.calibration_preset`) -> write it atomically -> print the summary.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from moe_placement.base.limits import MAX_RANKS
from moe_placement.cli.common import CliError, bounded_int, check_writes, echo, format_table, seconds, warn

__all__ = ["add_parser", "run"]

# The largest all-to-all buffer one rank allocates (send and receive each): points above it are left
# out with a note. Gloo ranks share the host's memory; a GPU has room.
MAX_RANK_BYTES = {"gloo": 64 * 1024**2, "nccl": 2 * 1024**3}
DEFAULT_GLOO_RANKS = 4


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from placement.cost.hardware import DEFAULT_HARDWARE, HARDWARE_NAMES

    p = subparsers.add_parser(
        "calibrate",
        help="measure the all-to-all, expert GEMM and launch cost here; write a hardware preset",
        description="Time all-to-alls at the model's decode and prefill message sizes (uniform and skewed "
        "receivers, intra- and inter-node pairs), DeepEP's kernels when deep_ep is importable, the grouped "
        "expert GEMM and a CUDA graph's launch cost; fit latency and bytes/s per link and write a preset "
        "for --hardware. Runs its own ranks, or joins a torchrun job (RANK/WORLD_SIZE/LOCAL_RANK set).",
    )
    p.add_argument("--model", required=True, help="built-in name, a model JSON, or a HF config.json / folder")
    p.add_argument(
        "--ranks",
        type=bounded_int(2, MAX_RANKS, "MAX_RANKS"),
        default=None,
        help=f"ranks to run (default: the visible GPUs with nccl, {DEFAULT_GLOO_RANKS} with gloo; under "
        "torchrun its WORLD_SIZE)",
    )
    p.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default=None,
        help="nccl (one GPU per rank) or gloo (CPU ranks: tests and trying it); default nccl when CUDA is here",
    )
    p.add_argument(
        "--gpus-per-node",
        type=bounded_int(1, MAX_RANKS, "MAX_RANKS"),
        default=None,
        help="ranks per node, grouping the ranks into nodes for the intra and inter pairs (default: all "
        "ranks in one node; under torchrun LOCAL_WORLD_SIZE); must divide --ranks",
    )
    p.add_argument(
        "--quick", action="store_true", help="fewer sizes, skews and repeats (a few seconds of timing)"
    )
    p.add_argument("--output", required=True, help="the preset JSON to write (atomically)")
    p.add_argument(
        "--base",
        choices=HARDWARE_NAMES,
        default=None,
        help=f"the GPU preset the measured figures override (default: the CUDA device's name, else {DEFAULT_HARDWARE})",
    )
    p.add_argument("--timeout", type=seconds, default=1800.0, help="seconds for the whole run (default 1800)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def _backend(args, env) -> tuple[str, int, int]:
    """``(backend, ranks, gpus per node)`` checked (CliError: one line)."""
    import torch

    cuda = torch.cuda.is_available()
    backend = args.backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise CliError(
            "--backend nccl needs CUDA GPUs and none is visible here; use --backend gloo (CPU ranks)"
        )
    if env is not None:
        if args.ranks is not None and args.ranks != env["world_size"]:
            raise CliError(
                f"--ranks {args.ranks} but torchrun started WORLD_SIZE={env['world_size']}: drop --ranks"
            )
        ranks = env["world_size"]
    else:
        ranks = args.ranks or (torch.cuda.device_count() if backend == "nccl" else DEFAULT_GLOO_RANKS)
        if backend == "nccl" and ranks > torch.cuda.device_count():
            raise CliError(
                f"--ranks {ranks} over NCCL needs one GPU per rank, {torch.cuda.device_count()} visible "
                "(NCCL refuses two ranks on one GPU); use fewer ranks, torchrun across machines, or --backend gloo"
            )
    if ranks < 2:
        raise CliError(f"calibrate needs 2 ranks or more to exchange anything, got {ranks}")
    gpn = args.gpus_per_node or (env["local_world_size"] if env is not None else ranks)
    if gpn > ranks or ranks % gpn:
        raise CliError(f"--gpus-per-node {gpn} must divide --ranks {ranks} (nodes hold equal ranks)")
    return backend, ranks, gpn


def _inputs(args) -> list[str]:
    """The files a model argument may be: the file itself and a HF folder's config.json."""
    return [args.model, str(Path(args.model) / "config.json")]


def _task(model, backend: str, ranks: int, gpn: int, quick: bool):
    """The plan every rank runs, and the notes of points left out."""
    from placement.cost.calibration import a2a_points, gemm_shapes, routed_points, sweep
    from runtime_hooks.calibrate import CalibrationTask

    points, notes = a2a_points(model, ranks, gpn, quick, MAX_RANK_BYTES[backend])
    if not points:
        raise CliError(
            f"every all-to-all of {model.name} is over the {MAX_RANK_BYTES[backend] / 1e6:.0f} MB buffer limit"
        )
    s = sweep(quick)
    _check_gemm_size(model)
    gemm = {
        "hidden": model.hidden_size,
        "inter": model.moe_intermediate_size,
        "tokens": gemm_shapes(quick),
        "cpu_tokens": gemm_shapes(quick, cpu=True),
        "experts": min(8, model.num_logical_experts) if _gemm_on_gpu() else 1,
    }
    E = ranks * max(1, round(model.num_logical_experts / ranks))  # DeepEP: experts a multiple of ranks
    deep_ep = {
        "hidden": model.hidden_size,
        "top_k": model.top_k,
        "num_experts": E,
        "seed": 0,
        "fp8": model.weight_bytes <= 1,
        "points": routed_points(ranks, gpn, quick),
    }
    task = CalibrationTask(
        points=tuple(points),
        repeats=s["repeats"],
        inner=s["inner"],
        gpus_per_node=gpn,
        count_bytes=4 * model.num_logical_experts,
        gemm=gemm,
        deep_ep=deep_ep,
    )
    return task, notes


def _gemm_on_gpu() -> bool:
    """Rank 0 times the GEMM on its GPU whenever CUDA is here (whatever the backend), else on a CPU core."""
    import torch

    return torch.cuda.is_available()


def _check_gemm_size(model) -> None:
    """The grouped GEMM's weights (8 experts in BF16 on a GPU, one in FP32 on a CPU) fit the limit."""
    from runtime_hooks.calibrate_kernels import MAX_GEMM_WEIGHT_BYTES

    experts, wb = (min(8, model.num_logical_experts), 2) if _gemm_on_gpu() else (1, 4)
    need = 3.0 * model.hidden_size * model.moe_intermediate_size * experts * wb
    if need > MAX_GEMM_WEIGHT_BYTES:
        raise CliError(
            f"{model.name}: {experts} expert(s) of {model.hidden_size} x {model.moe_intermediate_size} are "
            f"{need / 1e9:.1f} GB, over the {MAX_GEMM_WEIGHT_BYTES / 1e9:.1f} GB a calibration GEMM may allocate"
        )


def _progress(text: str) -> None:
    print(f"calibrate: {text}", file=sys.stderr, flush=True)


def _measure(task, backend: str, ranks: int, env, timeout: float) -> dict | None:
    """Run the plan: this process as one torchrun rank, or the launcher's ranks. Rank 0's raw results."""
    from moe_placement.base.errors import WorkerError
    from runtime_hooks.calibrate import run_calibration, run_under_torchrun

    try:
        if env is not None:
            return run_under_torchrun(task, backend, timeout, _progress)
        return run_calibration(task, ranks, backend, timeout, _progress)
    except WorkerError as exc:
        last = [ln for ln in exc.remote_traceback.strip().splitlines() if ln.strip()][-1:]
        raise RuntimeError(
            f"rank {exc.rank} failed while measuring: {' '.join(last)} (--debug shows where)"
        ) from None


def _table(summary: dict) -> str:
    rows = []
    for phase, d in summary["a2a"].items():
        for link, f in d["links"].items():
            rows.append(
                {
                    "what": f"a2a {phase} {link}",
                    "lat": f["latency_us"],
                    "bw": f["bytes_per_s"] / 1e9,
                    "slope": "-" if f["skew_slope"] is None else f"{f['skew_slope']:.2f}",
                    "r2": f["skew_r2"],
                    "spread": "",
                    "applied": "yes" if summary["a2a_links"][link]["applied"] else "no",
                }
            )
    cols = [
        ("what", "measured", -1),
        ("lat", "latency us", 1),
        ("bw", "GB/s", 3),
        ("slope", "skew slope", -1),
        ("r2", "R^2", 3),
        ("applied", "in preset", -1),
    ]
    return format_table(rows, cols)


def _print(summary: dict, out: Path) -> None:
    mo = summary["measured_on"]
    echo(
        f"calibrated {mo['model']} on {mo['ranks']} ranks ({mo['backend']}, {mo['nodes']} node(s) of "
        f"{mo['gpus_per_node']}, host(s) {', '.join(mo['hosts'])}; device {mo['device']})"
    )
    echo(_table(summary))
    g = summary["gemm"]
    if "fit" in g:
        f = g["fit"]
        flops = "not identified" if f["flops_per_s"] is None else f"{f['flops_per_s'] / 1e12:.3f} TFLOP/s"
        mem = "not identified" if f["bytes_per_s"] is None else f"{f['bytes_per_s'] / 1e9:.1f} GB/s"
        echo(
            f"gemm ({g['device']}, {g['dtype']}): compute {flops}, memory {mem}, t0 {f['overhead_us']:.1f} us; "
            f"{'applied' if g.get('applied') else 'not applied: ' + g.get('why', '')}"
        )
    else:
        echo(f"gemm: {g.get('why') or g.get('skipped')}")
    for key in ("launch", "deep_ep"):
        v = summary[key]
        echo(f"{key}: {'skipped: ' + v['skipped'] if 'skipped' in v else json.dumps(v)}")
    for n in summary["notes"]:
        echo(f"note: {n}")
    echo(f"measured: {', '.join(summary['measured']) or 'nothing applied'}")
    echo(f"wrote {out}; use it with --hardware {out} (evaluate, layout, advise)")


def run(args: argparse.Namespace) -> int:
    """Steps: check inputs and output -> plan -> measure -> fit, build the preset -> write -> print."""
    from moe_placement.base.fileio import atomic_write_json
    from placement.cost.calibration_preset import CalibrationSetup, calibration_report, guess_base
    from placement.cost.hardware import DEFAULT_HARDWARE
    from placement.cost.modelspec import load_model
    from runtime_hooks.calibrate import torchrun_env

    try:
        env = torchrun_env()
        model = load_model(args.model)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    backend, ranks, gpn = _backend(args, env)
    out = Path(args.output)
    if out.suffix != ".json":
        raise CliError(f"--output {out}: a preset is a .json file (--hardware reads *.json as a preset)")
    lead = env is None or env["rank"] == 0
    if lead:
        check_writes(_inputs(args), [out])
    task, notes = _task(model, backend, ranks, gpn, args.quick)
    raw = _measure(task, backend, ranks, env, args.timeout)
    if not lead or raw is None:
        return 0
    base = args.base or guess_base(raw.get("device", {}).get("name", "")) or DEFAULT_HARDWARE
    if (
        args.base is None
        and raw.get("device", {}).get("type") == "cuda"
        and guess_base(raw["device"]["name"]) is None
    ):
        warn(
            f"{raw['device']['name']} is none of the built-in GPUs: starting from {DEFAULT_HARDWARE} (--base to choose)"
        )
    if backend == "gloo" and raw.get("device", {}).get("type") == "cuda":
        warn(
            "the all-to-all ran over gloo (CPU tensors, TCP) on a GPU machine: its figures are gloo's, not "
            "NVLink/RDMA; --backend nccl measures the GPUs' links"
        )
    command = shlex.join(
        [
            "moe-placement",
            "calibrate",
            "--model",
            args.model,
            "--ranks",
            str(ranks),
            "--backend",
            backend,
            "--gpus-per-node",
            str(gpn),
            *(["--quick"] if args.quick else []),
            "--output",
            str(out),
        ]
    )
    try:
        setup = CalibrationSetup(ranks, gpn, backend, args.quick, base, command)
        preset, summary = calibration_report(raw, task.points, model, setup, notes)
    except ValueError as exc:
        raise RuntimeError(f"the measurements do not make a valid preset: {exc}") from None
    atomic_write_json(out, preset)
    if args.json:
        echo(json.dumps({"output": str(out), "preset": preset["name"], **summary}, indent=1))
    else:
        _print(summary, out)
    return 0
