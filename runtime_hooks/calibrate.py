"""The measurements of ``moe-placement calibrate`` on real ``torch.distributed`` ranks (gloo on CPU, NCCL
on GPUs), through :func:`runtime_hooks.launcher.launch` or in this process under torchrun.

One worker (:func:`calibrate_worker`) runs every stage on every rank, in order, and reports a line per
stage to the launching process (:func:`runtime_hooks.launcher.report`):

1. ``hosts``: each rank's host name (whether the "inter" pairs really cross machines);
2. ``a2a decode`` / ``a2a prefill``: ``all_to_all_single`` at every point of the plan
   (:func:`placement.cost.calibration.a2a_points`: the model's message sizes, intra and inter pairs,
   uniform and skewed receivers); each sample is ``inner`` back-to-back calls after a barrier, the
   slowest rank's time per call;
3. ``allreduce``: a small all-reduce (the per-step dispatch's expert counts) inside a node and across
   the ranks;
4. ``gemm`` and ``launch``: rank 0's grouped expert GEMM at decode and prefill shapes, and a small
   kernel's launch cost inside a CUDA graph (:mod:`runtime_hooks.calibrate_kernels`; on the CPU when
   there is no GPU, and the launch cost then skipped with its reason);
5. ``deep_ep``: DeepEP's low-latency and normal kernels over the same sweep
   (:mod:`runtime_hooks.calibrate_deepep`; skipped with a reason without NCCL, CUDA or ``deep_ep``).

Rank 0 returns every stage's raw timings; the fits and the preset are
:mod:`placement.cost.calibration`'s (numpy). Shapes: n points, R repeats, G ranks.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from placement.cost.calibration import A2APoint
from runtime_hooks.launcher import device_for, launch, report, reporting_to

__all__ = [
    "CalibrationTask",
    "TORCHRUN_VARS",
    "calibrate_worker",
    "run_calibration",
    "run_under_torchrun",
    "torchrun_env",
]

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class CalibrationTask:
    """What every rank measures (pickled to each worker).

    Attributes:
        points: the all-to-alls, :class:`placement.cost.calibration.A2APoint`.
        repeats: samples per point; warmup: untimed calls before them; inner: back-to-back calls per
            sample by phase.
        gpus_per_node: ranks per node (intra / inter pairs, the all-reduce groups).
        count_bytes: bytes of the small all-reduce (the model's expert counts, int32).
        gemm: ``{"hidden", "inter", "experts", "tokens": {phase: (...)}, "cpu_tokens": {...}, "dtype"}`` or
            None (not timed); ``cpu_tokens``: the counts timed when rank 0 has no GPU.
        deep_ep: ``{"hidden", "top_k", "num_experts", "fp8", "tokens": {phase: (...)}, "skews", "seed"}``
            or None (not tried).
    """

    points: tuple[A2APoint, ...]
    repeats: int
    inner: dict[str, int]
    gpus_per_node: int
    count_bytes: int
    warmup: int = 1
    gemm: dict | None = None
    deep_ep: dict | None = None
    stages: tuple[str, ...] = field(default=("hosts", "a2a", "allreduce", "gemm", "launch", "deep_ep"))


def _timed(call: Callable[[], None], inner: int, device) -> float:
    """Seconds per call of ``inner`` back-to-back calls after a barrier (device work included)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(inner):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / inner


def _slowest(samples: np.ndarray, device) -> np.ndarray:
    """Every rank's samples -> the slowest rank's, elementwise (one all-reduce MAX)."""
    import torch
    import torch.distributed as dist

    t = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float64)).to(device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().numpy()


def _a2a_phase(rank: int, task: CalibrationTask, phase: str, device) -> np.ndarray:
    """Seconds ``[n_phase, R]`` of the plan's points of ``phase``; buffers allocated once at the largest."""
    import torch
    import torch.distributed as dist

    points = [p for p in task.points if p.phase == phase]
    if not points:
        return np.zeros((0, task.repeats))
    send_max = max(int(p.splits[rank].sum()) for p in points)
    recv_max = max(int(p.splits[:, rank].sum()) for p in points)
    sbuf = torch.full((send_max,), rank % 251, dtype=torch.uint8, device=device)
    rbuf = torch.empty(recv_max, dtype=torch.uint8, device=device)
    out = np.zeros((len(points), task.repeats))
    for i, p in enumerate(points):
        send_split = [int(x) for x in p.splits[rank]]
        recv_split = [int(x) for x in p.splits[:, rank]]
        s, r = sbuf[: sum(send_split)], rbuf[: sum(recv_split)]

        def call(s=s, r=r, ss=send_split, rs=recv_split):
            dist.all_to_all_single(r, s, rs, ss)

        for _ in range(task.warmup):
            call()
        for j in range(task.repeats):
            out[i, j] = _timed(call, task.inner[phase], device)
    return _slowest(out, device)


def _allreduce(rank: int, world: int, task: CalibrationTask, device) -> dict:
    """Seconds per small all-reduce, ``[R]`` each: ``intra`` (inside each node; when a node holds two
    ranks or more) and ``inter`` (across every rank; when there are two nodes or more)."""
    import torch
    import torch.distributed as dist

    m = task.gpus_per_node
    nodes = [dist.new_group(list(range(k, k + m))) for k in range(0, world, m)]  # every rank makes each group
    counts = torch.ones(max(1, task.count_bytes // 4), dtype=torch.int32, device=device)
    out = {}
    for link, group, ok in (("intra", nodes[rank // m], m > 1), ("inter", None, world > m)):
        if not ok:
            continue

        def call(g=group):
            dist.all_reduce(counts, group=g)

        for _ in range(task.warmup):
            call()
        samples = np.array([_timed(call, 5, device) for _ in range(task.repeats)])
        out[link] = _slowest(samples, device).tolist()
    for g in nodes:
        dist.destroy_process_group(g)
    return out


def _device_stages(rank: int, task: CalibrationTask, backend: str) -> dict:
    """Rank 0's GEMM and CUDA-graph launch cost (the device of this rank: its GPU when CUDA is here,
    whatever the backend, else the CPU); other ranks wait at the barrier."""
    import torch
    import torch.distributed as dist

    from runtime_hooks.calibrate_kernels import GemmShape, cuda_graph_launch, gemm_dtype, time_grouped_gemm

    out: dict = {}
    if rank == 0:
        dev = device_for("nccl", rank) if torch.cuda.is_available() else torch.device("cpu")
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        out["device"] = {"type": dev.type, "name": name}
        if "gemm" in task.stages and task.gemm is not None:
            report("gemm: grouped expert GEMM at decode and prefill shapes")
            g = task.gemm
            dtype, wb = gemm_dtype(dev, g.get("dtype", "auto"))
            shape = GemmShape(g["hidden"], g["inter"], g["experts"])
            out["gemm"] = {
                "dtype": dtype,
                "weight_bytes": wb,
                "hidden": shape.hidden,
                "inter": shape.inter,
                "experts": shape.experts,
                "phases": {},
            }
            for phase, tokens in g["tokens" if dev.type == "cuda" else "cpu_tokens"].items():
                out["gemm"]["phases"][phase] = time_grouped_gemm(shape, tokens, dev, dtype, task.repeats)
        if "launch" in task.stages:
            out["launch"] = cuda_graph_launch(dev)
            why = out["launch"].get("skipped")
            report(
                "launch: a small kernel's launch cost inside a CUDA graph"
                + (f": skipped ({why})" if why else "")
            )
    dist.barrier()
    return out


def _hosts(world: int) -> list[str]:
    import torch.distributed as dist

    names: list = [None] * world
    dist.all_gather_object(names, socket.gethostname())
    return [str(n) for n in names]


def calibrate_worker(rank: int, world: int, task: CalibrationTask, backend: str) -> dict | None:
    """Every stage on this rank (a module-level function, for :func:`runtime_hooks.launcher.launch`).

    Returns rank 0's ``{"hosts", "a2a": {phase: seconds [n, R]}, "allreduce", "device", "gemm",
    "launch", "deep_ep", "versions", "seconds"}``; None on the other ranks.
    """
    from runtime_hooks.calibrate_deepep import deepep_stage, skip_reason
    from runtime_hooks.calibrate_kernels import versions

    t0 = time.perf_counter()
    device = device_for(backend, rank)
    out: dict = {"hosts": _hosts(world), "a2a": {}}
    if "a2a" in task.stages:
        for phase in ("decode", "prefill"):
            n = sum(p.phase == phase for p in task.points)
            if rank == 0 and n:
                report(f"a2a {phase}: {n} all-to-alls x {task.repeats} repeats over {backend}")
            out["a2a"][phase] = _a2a_phase(rank, task, phase, device)
    if "allreduce" in task.stages:
        if rank == 0:
            report(f"allreduce: {task.count_bytes} B of expert counts")
        out["allreduce"] = _allreduce(rank, world, task, device)
    out.update(_device_stages(rank, task, backend))
    if "deep_ep" in task.stages:
        why = skip_reason(backend, task.deep_ep)
        if rank == 0:
            report("deep_ep: low-latency and normal kernels" + (f": skipped ({why})" if why else ""))
        out["deep_ep"] = deepep_stage(rank, world, task.deep_ep, backend, task.gpus_per_node, task.repeats)
    if rank != 0:
        return None
    out["versions"] = versions(backend)
    out["seconds"] = time.perf_counter() - t0
    return out


def run_calibration(
    task: CalibrationTask,
    ranks: int,
    backend: str,
    timeout: float,
    on_progress: Callable[[str], None] | None = None,
) -> dict:
    """Spawn ``ranks`` processes with the project's launcher and return rank 0's results (a rank's error
    or a timeout raises :class:`runtime_hooks.launcher.WorkerError` / ``WorkerTimeout``; Ctrl-C or
    SIGTERM in this process stops every rank)."""

    def relay(rank: int, text: str) -> None:
        if on_progress is not None:
            on_progress(text)

    results = launch(
        calibrate_worker, ranks, args=(task, backend), backend=backend, timeout=timeout, on_report=relay
    )
    return results[0]


def torchrun_env() -> dict[str, int] | None:
    """``{"rank", "world_size", "local_rank", "local_world_size"}`` when torchrun started this process
    (its ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set), else None."""
    if not all(v in os.environ for v in TORCHRUN_VARS):
        return None
    try:
        env = {k.lower(): int(os.environ[k]) for k in TORCHRUN_VARS}
        env["local_world_size"] = int(os.environ.get("LOCAL_WORLD_SIZE", env["world_size"]))
    except ValueError:
        raise ValueError(
            f"torchrun variables {', '.join(f'{k}={os.environ[k]!r}' for k in TORCHRUN_VARS)} are not integers"
        ) from None
    return env


def run_under_torchrun(
    task: CalibrationTask, backend: str, timeout: float, on_progress: Callable[[str], None] | None = None
) -> dict | None:
    """This process is one rank of a torchrun job: join its process group (``env://``), run every stage,
    leave. Rank 0 gets the results (and the progress lines); the others None."""
    import datetime

    import torch
    import torch.distributed as dist

    env = torchrun_env()
    if env is None:
        raise ValueError("not started by torchrun: RANK, WORLD_SIZE and LOCAL_RANK are not all set")
    if backend == "nccl":
        torch.cuda.set_device(env["local_rank"] % max(1, torch.cuda.device_count()))
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout))
    try:
        with reporting_to(on_progress if env["rank"] == 0 else None):
            return calibrate_worker(env["rank"], env["world_size"], task, backend)
    finally:
        dist.destroy_process_group()
