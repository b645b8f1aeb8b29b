"""DeepEP's kernels in ``moe-placement calibrate``: the low-latency (decode) and normal (prefill)
dispatch and combine over the same sweep as the plain all-to-all, when ``deep_ep`` is importable and the
ranks run NCCL on GPUs.

Each rank draws its tokens' experts for every point (:func:`placement.cost.calibration.skewed_topk`:
the point's link, one receiver ``skew`` times the mean); the ranks' pick counts are gathered so rank 0
can price the bytes with the cost model (:func:`placement.cost.calibration.routed_traffic`). Dispatch
and combine are timed separately (device synchronised around each), the slowest rank's time kept.

Not run in this repository's tests (no GPU, no ``deep_ep``): :func:`skip_reason` is, and the device
script ``benchmarks/gpu_calibrate_check.py`` runs the rest where a GPU is lent.
"""

from __future__ import annotations

import importlib.util
import time

import numpy as np

__all__ = ["deepep_stage", "skip_reason"]


def skip_reason(backend: str, spec: dict | None) -> str | None:
    """Why DeepEP's kernels cannot be timed here (None: they can)."""
    if spec is None:
        return "not requested"
    if backend != "nccl":
        return f"DeepEP runs on NVIDIA GPUs over NVLink/RDMA; this run uses {backend}"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    if importlib.util.find_spec("deep_ep") is None:
        return "deep_ep is not importable (pip install deep_ep from github.com/deepseek-ai/DeepEP)"
    return None


def _synced(fn) -> float:
    """Seconds of ``fn()`` with the device synchronised before and after."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _tokens(rank: int, world: int, point: dict, spec: dict, index: int, gpus_per_node: int):
    """This rank's ``(x [T, d] bf16, topk_idx [T, k] int64, weights [T, k] f32)`` on the GPU, and its
    pick count per serving rank, int64 ``[G]``."""
    import torch

    from placement.cost.calibration import skewed_topk

    rng = np.random.default_rng([spec["seed"], index, rank])
    ids = skewed_topk(rng, rank, world, gpus_per_node, point, spec["top_k"], spec["num_experts"])
    per = spec["num_experts"] // world
    row = np.bincount(ids[ids >= 0] // per, minlength=world)
    x = torch.randn(ids.shape[0], spec["hidden"], dtype=torch.bfloat16, device="cuda")
    idx = torch.from_numpy(ids).cuda()
    return x, idx, torch.ones(idx.shape, dtype=torch.float32, device="cuda"), row


def _low_latency(buffer, x, idx, w, spec: dict, max_tokens: int) -> tuple[float, float]:
    """One timed low-latency dispatch and combine: seconds of each."""
    got = {}

    def dispatch():
        got["out"] = buffer.low_latency_dispatch(
            x,
            idx,
            max_tokens,
            spec["num_experts"],
            use_fp8=spec["fp8"],
            async_finish=False,
            return_recv_hook=False,
        )

    d = _synced(dispatch)
    recv, _count, handle, _event, _hook = got["out"]
    y = recv[0].float().to(x.dtype) if isinstance(recv, tuple) else recv  # [local experts, slots, d] bf16
    c = _synced(lambda: buffer.low_latency_combine(y, idx, w, handle))
    return d, c


def _normal(buffer, x, idx, w, spec: dict) -> tuple[float, float]:
    """One timed normal (node-deduplicated) dispatch and combine: seconds of each."""
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, spec["num_experts"])
    got = {}

    def dispatch():
        got["out"] = buffer.dispatch(
            x,
            topk_idx=idx,
            topk_weights=w,
            num_step_tokens=per_rank,
            num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )

    d = _synced(dispatch)
    recv_x, _ri, _rw, _counts, handle, _event = got["out"]
    c = _synced(lambda: buffer.combine(recv_x, handle))
    return d, c


def _buffers(world: int, spec: dict, max_ll_tokens: int):
    """``(low-latency buffer, normal buffer)`` over the default process group."""
    import deep_ep
    import torch.distributed as dist

    group = dist.group.WORLD
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        max_ll_tokens, spec["hidden"], world, spec["num_experts"]
    )
    ll = deep_ep.Buffer(
        group,
        num_rdma_bytes=rdma,
        low_latency_mode=True,
        num_qps_per_rank=max(1, spec["num_experts"] // world),
    )
    normal = deep_ep.Buffer(group, int(1e9), int(1e9) if world > 8 else 0)
    return ll, normal


def _sweep(rank: int, world: int, spec: dict, gpus_per_node: int, repeats: int) -> dict:
    """Every routed point: ``{"points": [{..., "pair_picks", "dispatch_s", "combine_s"}], ...}`` on rank 0."""
    import torch
    import torch.distributed as dist

    points = spec["points"]
    max_ll = max([p["step_tokens"] for p in points if p["phase"] == "decode"] or [1])
    ll, normal = _buffers(world, spec, max_ll)
    out = []
    for i, p in enumerate(points):
        x, idx, w, row = _tokens(rank, world, p, spec, i, gpus_per_node)
        decode = p["phase"] == "decode"

        def one(x=x, idx=idx, w=w, decode=decode) -> tuple[float, float]:
            return _low_latency(ll, x, idx, w, spec, max_ll) if decode else _normal(normal, x, idx, w, spec)

        one()  # warm-up
        times = np.array([one() for _ in range(repeats)])  # [R, 2]
        t = torch.from_numpy(times).cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        picks = torch.from_numpy(row).cuda()
        rows = [torch.empty_like(picks) for _ in range(world)]
        dist.all_gather(rows, picks)
        times = t.cpu().numpy()
        out.append(
            {
                **p,
                "pair_picks": torch.stack(rows).cpu().numpy().tolist(),
                "dispatch_s": times[:, 0].tolist(),
                "combine_s": times[:, 1].tolist(),
            }
        )
    return {"points": out, "num_experts": spec["num_experts"], "fp8": spec["fp8"]}


def deepep_stage(
    rank: int, world: int, spec: dict | None, backend: str, gpus_per_node: int, repeats: int
) -> dict:
    """DeepEP's sweep on every rank, or ``{"skipped": reason}`` (decided alike on every rank: the same
    software on each). An error inside DeepEP is reported as skipped with its message."""
    reason = skip_reason(backend, spec)
    if reason is not None:
        return {"skipped": reason}
    assert spec is not None
    try:
        return _sweep(rank, world, spec, gpus_per_node, repeats)
    except Exception as exc:  # noqa: BLE001 - DeepEP refuses shapes it was not built for: say so, keep the rest
        return {"skipped": f"deep_ep raised {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
