"""The device-side timings of ``moe-placement calibrate``: the grouped expert GEMM, a small kernel's launch
cost inside a CUDA graph, DeepEP's kernels, and the versions a run used (torch, lazily).

Each timing returns plain data (seconds, shapes, what was skipped and why); the fits are in
:mod:`placement.cost.calibration`. ``benchmarks/gpu_gemm_fit.py`` times its GEMM with
:func:`time_grouped_gemm` too.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CPU_GEMM_FLOPS",
    "MAX_GEMM_WEIGHT_BYTES",
    "GemmShape",
    "cuda_graph_launch",
    "gemm_dtype",
    "time_grouped_gemm",
    "versions",
]

# A GEMM timed on a CPU core is kept under this many FLOPs per call (one call of DeepSeek-V3's expert at
# 1024 tokens is 90 GFLOP: minutes on one core); larger shapes are left out, said in the result.
CPU_GEMM_FLOPS = 1e9
MAX_GEMM_WEIGHT_BYTES = 8 * 1024**3  # the experts' weights allocated for one grouped GEMM


@dataclass(frozen=True)
class GemmShape:
    """One grouped GLU expert GEMM: ``experts`` experts of ``hidden x inter`` (gate+up ``[2f, d]``,
    down ``[d, f]``), each given ``tokens`` tokens per call."""

    hidden: int
    inter: int
    experts: int


def gemm_dtype(device, want: str = "auto") -> tuple[str, float]:
    """``(dtype name, bytes per weight)``: FP8 through ``torch._scaled_mm`` where the GPU (compute
    capability 8.9+) and torch support it and ``want`` allows, BF16 on other GPUs, FP32 on a CPU."""
    import torch

    if device.type != "cuda":
        return "fp32", 4.0
    fp8_ok = (
        hasattr(torch, "float8_e4m3fn")
        and hasattr(torch, "_scaled_mm")
        and torch.cuda.get_device_capability(device) >= (8, 9)
    )
    if want == "fp8" or (want == "auto" and fp8_ok):
        return "fp8", 1.0
    return "bf16", 2.0


def _expert_pass(shape: GemmShape, device, dtype: str) -> Callable:
    """``run(xs)``: the per-expert GLU of ``shape`` over inputs ``xs`` (one ``[n, d]`` per expert)."""
    import torch

    d, f, E = shape.hidden, shape.inter, shape.experts
    act = torch.float32 if dtype == "fp32" else torch.bfloat16
    w_up = [torch.randn(2 * f, d, device=device, dtype=act) / d**0.5 for _ in range(E)]
    w_dn = [torch.randn(d, f, device=device, dtype=act) / f**0.5 for _ in range(E)]
    one = torch.ones((), device=device, dtype=torch.float32)
    if dtype == "fp8":
        w_up = [w.to(torch.float8_e4m3fn) for w in w_up]
        w_dn = [w.to(torch.float8_e4m3fn) for w in w_dn]

    def mm(x, w):
        if dtype != "fp8":
            return x @ w.t()
        n = x.shape[0]
        xx = torch.nn.functional.pad(x, (0, 0, 0, (-n) % 16)).to(torch.float8_e4m3fn)  # multiples of 16
        return torch._scaled_mm(xx, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)[:n]

    def run(xs):
        for x, wu, wd in zip(xs, w_up, w_dn):
            g, u = mm(x, wu).chunk(2, dim=-1)
            mm((torch.nn.functional.silu(g) * u).contiguous(), wd)

    return run


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_grouped_gemm(
    shape: GemmShape, tokens: Sequence[int], device, dtype: str, repeats: int, warmup: int = 2
) -> dict:
    """Seconds of one grouped GEMM per tokens-per-expert count, median of ``repeats`` timed calls.

    On a CPU, counts whose call would exceed :data:`CPU_GEMM_FLOPS` are left out (``left_out``). The
    weights are checked against :data:`MAX_GEMM_WEIGHT_BYTES` before they are allocated.

    Returns:
        ``{"tokens": [...], "seconds": [...], "samples": [[...] per count], "left_out": [...]}``.
    """
    import torch

    wb = {"fp8": 1, "bf16": 2, "fp32": 4}[dtype]
    weights = 3.0 * shape.hidden * shape.inter * shape.experts * max(wb, 2)
    if weights > MAX_GEMM_WEIGHT_BYTES:
        raise ValueError(
            f"grouped GEMM weights {weights / 1e9:.1f} GB over the {MAX_GEMM_WEIGHT_BYTES / 1e9:.1f} GB limit: "
            "fewer experts per call"
        )
    per_token = 6.0 * shape.hidden * shape.inter * shape.experts
    keep = [n for n in tokens if device.type == "cuda" or n * per_token <= CPU_GEMM_FLOPS]
    run = _expert_pass(shape, device, dtype)
    act = torch.float32 if dtype == "fp32" else torch.bfloat16
    out = {"tokens": keep, "seconds": [], "samples": [], "left_out": [n for n in tokens if n not in keep]}
    for n in keep:
        xs = [torch.randn(n, shape.hidden, device=device, dtype=act) for _ in range(shape.experts)]
        for _ in range(warmup):
            run(xs)
        samples = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            run(xs)
            _sync(device)
            samples.append(time.perf_counter() - t0)
        out["samples"].append(samples)
        out["seconds"].append(float(np.median(samples)))
    return out


def cuda_graph_launch(device, kernels: int = 200, repeats: int = 20) -> dict:
    """Launch cost of one small kernel (an in-place add on 256 floats): inside a captured CUDA graph
    (graph replay time / kernels) and eagerly (host time per launch, synchronised at the end).

    Returns ``{"graph_kernel_s": [...], "eager_kernel_s": [...], "kernels": kernels}`` (one entry per
    repeat), or ``{"skipped": reason}`` off CUDA.
    """
    import torch

    if device.type != "cuda":
        return {"skipped": "no CUDA device: a CUDA graph's launch cost is measured on a GPU only"}
    x = torch.zeros(256, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up on a side stream, as graph capture wants
        for _ in range(3):
            x.add_(1.0)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.add_(1.0)
    graph.replay()
    _sync(device)
    graph_s, eager_s = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        graph_s.append(start.elapsed_time(end) / 1e3 / kernels)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(kernels):
            x.add_(1.0)
        _sync(device)
        eager_s.append((time.perf_counter() - t0) / kernels)
    return {"graph_kernel_s": graph_s, "eager_kernel_s": eager_s, "kernels": kernels}


def _dist_version(name: str) -> str | None:
    """An installed distribution's version, without importing it (None: not installed)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(backend: str) -> dict:
    """The engine and library versions this run used: python, platform, numpy, torch, CUDA and NCCL
    (on CUDA), deep_ep, sglang, vllm (None when absent; read from the installed metadata, not imported)."""
    import torch

    out = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": None,
        "backend": backend,
    }
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        except (RuntimeError, AttributeError):  # torch built without NCCL
            out["nccl"] = None
    for name in ("deep_ep", "sglang", "vllm"):
        found = importlib.util.find_spec(name) is not None
        out[name] = (
            (_dist_version(name) or _dist_version(name.replace("_", "-")) or "unknown") if found else None
        )
    return out
