"""Time a grouped expert GEMM on this GPU against tokens per expert and fit the cost model's compute
constants (``P*eta_c``, ``BW*eta_m``, ``t0``); write a GPU preset JSON with provenance.

Run (only where CUDA exists):
    PYTHONPATH=. python benchmarks/gpu_gemm_fit.py --base h200 --out gpu_preset_h200.json

The timing and the fit are the library's, the same ``moe-placement calibrate`` uses:
:func:`runtime_hooks.calibrate_kernels.time_grouped_gemm` (the expert is a GLU MLP, gate+up ``[2f, d]``
and down ``[d, f]``, of ``--experts`` experts each given ``n`` tokens; one "grouped GEMM" is the loop of
per-expert matmuls, FP8 through ``torch._scaled_mm`` where the GPU and torch support it, else BF16:
an upper bound on DeepGEMM's time) and :func:`placement.cost.calibration.fit_gemm` (``t(n) = max(F(n) / C,
M(n) / B) + t0``, numpy: every split of the points into a memory-bound head and a compute-bound tail,
least squares on relative error, the best log-time fit kept; ``F = 6 d f n E``,
``M = E (3 d f b_w) + activations``). The preset stores ``eta_compute = C / peak``, ``eta_memory = B /
HBM`` and ``gemm_overhead = t0``; its ``provenance.measured`` names ``gemm`` (and keeps the measured
``times_s``), so ``--hardware FILE`` reports it measured and ``step_time`` says ``calibrated: true``.
``moe-placement calibrate`` writes the same figures together with the measured links.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="h200", help="preset whose peaks are used (h100, h800, h200, b200)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8, help="experts per grouped GEMM")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,192,256,384,512,1024,2048")
    ap.add_argument("--dtype", choices=("auto", "fp8", "bf16"), default="auto")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="gpu_preset.json")
    return ap.parse_args(argv)


def _preset(args, fit, dtype: str, wb: float, ns: list[int], times: list[float], device: str) -> dict:
    import numpy as np
    import torch

    from placement.cost.hardware import GPUS

    base = GPUS[args.base]
    eta_c = fit.flops_per_s / base.peak_flops(wb) if fit.flops_per_s else base.eta_compute
    eta_m = fit.bytes_per_s / base.hbm_bandwidth if fit.bytes_per_s else base.eta_memory
    return {
        "base": args.base,
        "name": f"{args.base}-fitted",
        "eta_compute": float(np.clip(eta_c, 0.01, 1.0)),
        "eta_memory": float(np.clip(eta_m, 0.01, 1.0)),
        "gemm_overhead": float(fit.overhead_s),
        "source": "benchmarks/gpu_gemm_fit.py",
        "provenance": {
            "measured": ["gemm"],
            "device": device,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "dtype": dtype,
            "hidden": args.hidden,
            "inter": args.inter,
            "experts": args.experts,
            "tokens": ns,
            "times_s": times,
            "fit_rms_log_error": fit.rms_log_error,
            "compute_identified": fit.flops_per_s is not None,
            "memory_identified": fit.bytes_per_s is not None,
            "host": platform.node(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "note": "per-expert torch matmuls, not DeepGEMM: eta_c is a lower bound for a fused grouped kernel",
        },
    }


def main(argv=None) -> int:
    args = _args(argv)
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

    from moe_placement.base.fileio import atomic_write_json
    from placement.cost.calibration import fit_gemm, gemm_work
    from runtime_hooks.calibrate_kernels import GemmShape, gemm_dtype, time_grouped_gemm

    dev = torch.device("cuda")
    dtype, wb = gemm_dtype(dev, args.dtype)
    shape = GemmShape(args.hidden, args.inter, args.experts)
    ns = [int(t) for t in args.tokens.split(",")]
    got = time_grouped_gemm(shape, ns, dev, dtype, args.repeats)
    d, f, E = args.hidden, args.inter, args.experts
    for n, t in zip(got["tokens"], got["seconds"]):
        print(
            f"tokens/expert {n:>5}: {t * 1e6:9.1f} us  ({6 * d * f * n * E / t / 1e12:7.1f} TFLOP/s, "
            f"{E * 3 * d * f * wb / t / 1e9:7.0f} GB/s weights)"
        )
    F, M = gemm_work(d, f, E, np.array(got["tokens"]), wb)
    fit = fit_gemm(F, M, np.array(got["seconds"]))
    preset = _preset(args, fit, dtype, wb, got["tokens"], got["seconds"], torch.cuda.get_device_name())
    atomic_write_json(args.out, preset)
    print(json.dumps({k: preset[k] for k in ("eta_compute", "eta_memory", "gemm_overhead")}, indent=1))
    print(
        f"wrote {args.out} (measured: gemm); use it with: moe-placement layout --hardware {args.out} ... "
        f"or evaluate --hardware {args.out}, whose step_time then says calibrated: true"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
