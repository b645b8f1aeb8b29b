"""Time a grouped expert GEMM on this GPU against tokens per expert and fit the cost model's compute
constants (``P*eta_c``, ``BW*eta_m``, ``t0``); write a GPU preset JSON with provenance.

Run (only where CUDA exists):
    PYTHONPATH=. python benchmarks/gpu_gemm_fit.py --base h200 --out gpu_preset_h200.json

The expert is a GLU MLP (gate+up ``[2f, d]``, down ``[d, f]``) of ``--experts`` experts, each given
``n`` tokens; one "grouped GEMM" is the loop of per-expert matmuls in one CUDA graph-free stream
(torch has no portable grouped FP8 GEMM, so this is an upper bound on DeepGEMM's time). FP8 is used
with ``torch._scaled_mm`` where the GPU and torch support it, else BF16.

Fit: ``t(n) = max(F(n) / C, M(n) / B) + t0`` by least squares on log-time over a grid of
``(C, B)`` starts (scipy.optimize.least_squares), where ``F = 6 d f n E`` and
``M = E (3 d f b_w) + activations``. The preset stores ``eta_compute = C / peak``,
``eta_memory = B / HBM`` and ``gemm_overhead = t0`` for ``placement.cost.hardware.load_gpu_preset``,
whose measured times (``provenance.times_s``) make it calibrated: a ``StepTime`` priced with the preset says
``calibrated: true`` (``evaluate --model M --hardware FILE``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="h200", help="preset whose peaks are used (h100, h800, h200, b200)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8, help="experts per grouped GEMM")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,192,256,384,512,1024,2048")
    ap.add_argument("--dtype", choices=("auto", "fp8", "bf16"), default="auto")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="gpu_preset.json")
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        print("gpu_gemm_fit: torch is not installed; this script needs torch with CUDA", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "gpu_gemm_fit: no CUDA device here; run this on a GPU machine (nothing was measured)",
            file=sys.stderr,
        )
        return 2
    import numpy as np
    from scipy.optimize import least_squares

    from moe_placement.base.fileio import atomic_write_json
    from placement.cost.hardware import GPUS

    base = GPUS[args.base]
    dev = torch.device("cuda")
    d, f, E = args.hidden, args.inter, args.experts
    use_fp8 = args.dtype == "fp8" or (
        args.dtype == "auto"
        and hasattr(torch, "float8_e4m3fn")
        and torch.cuda.get_device_capability() >= (8, 9)
        and hasattr(torch, "_scaled_mm")
    )
    wb = 1.0 if use_fp8 else 2.0
    w_up = [torch.randn(2 * f, d, device=dev, dtype=torch.bfloat16) / d**0.5 for _ in range(E)]
    w_dn = [torch.randn(d, f, device=dev, dtype=torch.bfloat16) / f**0.5 for _ in range(E)]
    one = torch.ones((), device=dev, dtype=torch.float32)
    if use_fp8:
        w_up = [w.to(torch.float8_e4m3fn) for w in w_up]
        w_dn = [w.to(torch.float8_e4m3fn) for w in w_dn]

    def mm(x, w):
        if use_fp8:
            n = x.shape[0]
            pad = (-n) % 16  # _scaled_mm wants multiples of 16
            xx = torch.nn.functional.pad(x, (0, 0, 0, pad)).to(torch.float8_e4m3fn)
            return torch._scaled_mm(xx, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)[:n]
        return x @ w.t()

    def expert_pass(xs):
        for x, wu, wd in zip(xs, w_up, w_dn):
            h = mm(x, wu)
            g, u = h.chunk(2, dim=-1)
            mm((torch.nn.functional.silu(g) * u).contiguous(), wd)

    ns = [int(t) for t in args.tokens.split(",")]
    times = []
    for n in ns:
        xs = [torch.randn(n, d, device=dev, dtype=torch.bfloat16) for _ in range(E)]
        for _ in range(3):
            expert_pass(xs)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.repeats):
            expert_pass(xs)
        end.record()
        torch.cuda.synchronize()
        t = start.elapsed_time(end) / 1e3 / args.repeats
        times.append(t)
        print(
            f"tokens/expert {n:>5}: {t * 1e6:9.1f} us  ({6 * d * f * n * E / t / 1e12:7.1f} TFLOP/s, "
            f"{E * 3 * d * f * wb / t / 1e9:7.0f} GB/s weights)"
        )
    n = np.array(ns, float)
    t = np.array(times)
    F = 6.0 * d * f * n * E
    M = E * 3.0 * d * f * wb + n * E * (d * wb + 2 * d + 4 * f)
    peak = base.peak_flops(wb)

    def resid(p):
        C, B, t0 = np.exp(p)
        return np.log(np.maximum(F / C, M / B) + t0) - np.log(t)

    best = None
    for c0 in (0.3, 0.5, 0.7):
        for b0 in (0.6, 0.8, 0.9):
            r = least_squares(resid, np.log([c0 * peak, b0 * base.hbm_bandwidth, 3e-6]))
            if best is None or r.cost < best.cost:
                best = r
    C, B, t0 = np.exp(best.x)
    preset = {
        "base": args.base,
        "name": f"{args.base}-fitted",
        "eta_compute": float(min(C / peak, 1.0)),
        "eta_memory": float(min(B / base.hbm_bandwidth, 1.0)),
        "gemm_overhead": float(t0),
        "source": "benchmarks/gpu_gemm_fit.py",
        "provenance": {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "dtype": "fp8" if use_fp8 else "bf16",
            "hidden": d,
            "inter": f,
            "experts": E,
            "tokens": ns,
            "times_s": times,
            "fit_rms_log_error": float(np.sqrt(np.mean(best.fun**2))),
            "host": platform.node(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "note": "per-expert torch matmuls, not DeepGEMM: eta_c is a lower bound for a fused grouped kernel",
        },
    }
    atomic_write_json(args.out, preset)
    print(json.dumps({k: preset[k] for k in ("eta_compute", "eta_memory", "gemm_overhead")}, indent=1))
    print(
        f"wrote {args.out} (calibrated: measured times in provenance); use it with: moe-placement layout --hardware {args.out} ... "
        f"or evaluate --hardware {args.out}, whose step_time then says calibrated: true"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
