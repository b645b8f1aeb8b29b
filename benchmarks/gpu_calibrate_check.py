"""The prepared device check of ``moe-placement calibrate`` (issue 42): what a lent GPU machine runs, in
well under 5 minutes, to test the paths a CPU cannot (NCCL, CUDA events and graphs, FP8 GEMM, DeepEP).

Usage (repository root, a machine with CUDA)::

    PYTHONPATH=. python benchmarks/gpu_calibrate_check.py [--model deepseek-v3] [--out DIR]

Checks, each printed PASS / FAIL / SKIP with its figures; exit code 0 when none failed:

1. ``nccl-calibrate``: with two GPUs or more, ``calibrate --backend nccl --ranks min(GPUs, 8) --quick``
   writes a preset that loads, measures ``a2a_intra``, ``gemm`` (on the GPU) and ``launch``, and reports
   DeepEP as measured or skipped with its reason. With one GPU: the same command is refused in one line
   with exit 2 (NCCL refuses two ranks on one GPU), and the NCCL code path of every stage runs on one
   rank through the library instead (an all-to-all to itself, the all-reduce, the FP8/BF16 grouped GEMM,
   the CUDA-graph launch cost).
2. ``gloo-calibrate-gpu``: ``calibrate --backend gloo --ranks 2 --quick`` on the GPU machine: the
   all-to-all over gloo (said so, with a warning), the GEMM and launch cost on the GPU and applied.
3. ``gpu-gemm-fit``: ``benchmarks/gpu_gemm_fit.py`` on the library's timing and fit writes a preset
   that ``--hardware`` reads as calibrated.

Files go to ``--out`` (default ``$OUT`` or ``./gpu_calibrate_out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS: list[tuple[str, str, str]] = []


def _record(name: str, status: str, detail: str) -> None:
    RESULTS.append((name, status, detail))
    print(f"{status:4} {name}: {detail}", flush=True)


def _cli(args: list[str], timeout: float = 240.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "moe_placement", "calibrate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def _figures(summary: dict) -> str:
    parts = []
    for phase, d in summary["a2a"].items():
        slope = "-" if d["skew_slope"] is None else f"{d['skew_slope']:.2f}"
        parts.append(
            f"{phase} {d['link']}: {d['latency_us']:.1f} us + B/{d['bytes_per_s'] / 1e9:.1f} GB/s, "
            f"slope {slope}, R^2 {d['skew_r2']:.3f}"
        )
    g = summary["gemm"].get("fit")
    if g:
        parts.append(
            f"gemm {summary['gemm'].get('dtype')}: {(g['flops_per_s'] or 0) / 1e12:.0f} TFLOP/s, "
            f"{(g['bytes_per_s'] or 0) / 1e9:.0f} GB/s, t0 {g['overhead_us']:.1f} us"
        )
    if "graph_kernel_us" in summary["launch"]:
        parts.append(f"graph launch {summary['launch']['graph_kernel_us']['median']:.2f} us/kernel")
    parts.append(f"deep_ep: {summary['deep_ep']}")
    return "; ".join(parts)


def _check_preset(path: Path, want: set[str]) -> str | None:
    from placement.cost.hardware import cluster_preset, hardware_summary

    hw = hardware_summary(cluster_preset(str(path)))
    missing = want - set(hw["measured_parts"])
    return (
        None
        if hw["measured"] and not missing
        else f"measured {hw['measured_parts']}, missing {sorted(missing)}"
    )


def nccl_calibrate(model: str, out: Path, gpus: int) -> None:
    if gpus >= 2:
        res = _cli(
            [
                "--model",
                model,
                "--backend",
                "nccl",
                "--ranks",
                str(min(gpus, 8)),
                "--quick",
                "--output",
                str(out / "nccl.json"),
                "--json",
            ]
        )
        if res.returncode != 0:
            _record("nccl-calibrate", "FAIL", res.stderr.strip()[-600:])
            return
        bad = _check_preset(out / "nccl.json", {"a2a_intra", "gemm", "launch"})
        _record("nccl-calibrate", "FAIL" if bad else "PASS", bad or _figures(json.loads(res.stdout)))
        return
    res = _cli(
        ["--model", model, "--backend", "nccl", "--ranks", "2", "--quick", "--output", str(out / "x.json")]
    )
    refused = (
        res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and not (out / "x.json").exists()
    )
    _record("nccl-refuses-two-ranks-on-one-gpu", "PASS" if refused else "FAIL", res.stderr.strip()[-300:])
    _nccl_one_rank(model)


def _nccl_one_rank(model_name: str) -> None:
    """Every stage's NCCL/CUDA code on one rank: an all-to-all to itself, the device stages."""
    import numpy as np

    from placement.cost.calibration import A2APoint, gemm_shapes, self_send_bytes, sweep
    from placement.cost.modelspec import load_model
    from runtime_hooks.calibrate import CalibrationTask, run_calibration

    model = load_model(model_name)
    points = tuple(
        A2APoint(
            "intra",
            ph,
            "dispatch",
            b,
            1.0,
            np.array([[self_send_bytes(model, b)]]),
        )
        for ph, b in (("decode", 128), ("prefill", 4096))
    )
    gemm = {
        "hidden": model.hidden_size,
        "inter": model.moe_intermediate_size,
        "experts": 8,
        "tokens": gemm_shapes(True),
        "cpu_tokens": gemm_shapes(True, cpu=True),
    }
    task = CalibrationTask(points, 3, sweep(True)["inner"], 1, 4 * model.num_logical_experts, gemm=gemm)
    t0 = time.perf_counter()
    raw = run_calibration(task, 1, "nccl", 240.0, lambda s: print(f"  {s}", flush=True))
    a2a = {ph: np.median(v) * 1e6 for ph, v in raw["a2a"].items() if len(v)}
    launch = raw.get("launch", {})
    ok = (
        raw["device"]["type"] == "cuda"
        and "graph_kernel_s" in launch
        and raw["gemm"]["phases"]["prefill"]["seconds"]
    )
    _record(
        "nccl-one-rank-stages",
        "PASS" if ok else "FAIL",
        f"{raw['device']['name']}, nccl {raw['versions']['nccl']}, self all-to-all us {a2a}, gemm {raw['gemm']['dtype']} "
        f"{raw['gemm']['phases']}, launch {launch}, {time.perf_counter() - t0:.0f} s",
    )


def gloo_calibrate_gpu(model: str, out: Path) -> None:
    res = _cli(
        [
            "--model",
            model,
            "--backend",
            "gloo",
            "--ranks",
            "2",
            "--quick",
            "--output",
            str(out / "gloo.json"),
            "--json",
        ]
    )
    if res.returncode != 0:
        _record("gloo-calibrate-gpu", "FAIL", res.stderr.strip()[-600:])
        return
    bad = _check_preset(out / "gloo.json", {"a2a_intra", "gemm", "launch"})
    warned = "ran over gloo" in res.stderr
    _record(
        "gloo-calibrate-gpu",
        "FAIL" if bad or not warned else "PASS",
        (bad or "") + ("" if warned else " no gloo warning; ") + _figures(json.loads(res.stdout)),
    )


def gpu_gemm_fit(out: Path) -> None:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_gemm_fit.py"),
        "--tokens",
        "1,4,16,64,256,1024,2048",
        "--repeats",
        "5",
        "--out",
        str(out / "fit.json"),
    ]
    res = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=180
    )
    if res.returncode != 0:
        _record("gpu-gemm-fit", "FAIL", res.stderr.strip()[-600:])
        return
    from placement.cost.hardware import cluster_preset

    cl = cluster_preset(str(out / "fit.json"))
    ok = cl.gpu.calibrated and cl.measured
    _record("gpu-gemm-fit", "PASS" if ok else "FAIL", res.stdout.strip().replace("\n", " ")[-500:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_calibrate_out"))
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_calibrate_check: no CUDA device here; run it on a GPU machine (nothing was checked)",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    print(f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    for check in (
        lambda: nccl_calibrate(args.model, out, gpus),
        lambda: gloo_calibrate_gpu(args.model, out),
        lambda: gpu_gemm_fit(out),
    ):
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - one check's crash is its FAIL; the others still run
            _record("check", "FAIL", f"{type(exc).__name__}: {exc}")
    (out / "results.json").write_text(json.dumps(RESULTS, indent=1))
    return 1 if any(s == "FAIL" for _, s, _ in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
