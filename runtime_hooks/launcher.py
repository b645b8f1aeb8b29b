"""Launch ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes with a real process group.

Public API::

    results = launch(fn, world_size, args=(...), backend="gloo", timeout=60.0)

- ``fn`` must be importable by name (a module-level function; closures and lambdas do not pickle).
  Processes start with ``forkserver`` (torch preloaded once in the server, so a launch after the first
  costs well under a second instead of one torch import per rank) or ``spawn``; never plain ``fork``
  (unsafe after CUDA or thread-pool initialisation in the parent).
- Each worker joins a ``torch.distributed`` default process group (gloo on CPU, NCCL on GPU: the device
  of rank ``r`` is ``cuda:r % device_count``, see :func:`device_for`) and gets ``torch.set_num_threads(1)``
  on gloo so many ranks share few cores.
- Rendezvous uses a ``TCPStore`` hosted by the launching process on a free port chosen by the OS
  (port 0, no race). The same store is a side channel for workers (:func:`current_store`): the
  migration protocol in :mod:`runtime_hooks.migration_core` decides commit/abort through it, because a
  collective cannot decide anything once a rank is stuck.
- A worker may send one-line progress reports to the launching process with :func:`report` (the
  launcher hands each to ``launch(..., on_report=)`` as ``(rank, text)``, from the parent's main
  thread, while it waits); outside a launch, :func:`reporting_to` sets where reports go.
- Results come back per rank (``results[r]`` is rank r's return value; it must pickle). When a rank
  raises, :class:`WorkerError` carries its rank and formatted traceback; when ranks do not finish within
  ``timeout`` seconds, :class:`WorkerTimeout` names them. Either way every child is terminated and
  joined before the exception propagates: no orphan processes. ``destroy_process_group`` runs in each
  worker on the way out.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue as _queue
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from moe_placement.base.errors import (  # re-exported: the family lives in moe_placement.base.errors
    WorkerError,
    WorkerTimeout,
)

__all__ = [
    "LOST_RANK_EXIT_CODE",
    "WorkerError",
    "WorkerTimeout",
    "current_store",
    "device_for",
    "launch",
    "report",
    "reporting_to",
]

_CURRENT_STORE = None  # set inside workers
_REPORT: Callable[[str], None] | None = None  # set inside workers (or by reporting_to)
_PROGRESS = "progress"  # the queue tag of a report (results are tagged True / False)

LOST_RANK_EXIT_CODE = 86
"""Exit code of a rank killed on purpose (fault injection: ``os._exit(LOST_RANK_EXIT_CODE)``). With
``launch(..., lost_ok=True)`` such a rank is lost, not failed: its result is None and the others go on."""


def current_store():
    """The launcher's TCPStore inside a worker (None outside :func:`launch`)."""
    return _CURRENT_STORE


def report(text: str) -> None:
    """Send one progress line to whoever launched this worker (nothing when no one listens)."""
    if _REPORT is not None:
        _REPORT(str(text))


@contextlib.contextmanager
def reporting_to(handler: Callable[[str], None] | None) -> Iterator[None]:
    """Within the block, :func:`report` calls ``handler`` (a run in this process, e.g. under torchrun)."""
    global _REPORT
    before, _REPORT = _REPORT, handler
    try:
        yield
    finally:
        _REPORT = before


def device_for(backend: str, rank: int):
    """The torch device a rank computes on: ``cpu`` for gloo, ``cuda:rank % n`` for nccl."""
    import torch

    if backend == "nccl":
        return torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def _context(start_method: str | None):
    import multiprocessing

    import torch.multiprocessing as mp

    if start_method is None:
        start_method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # Preload torch in the server so each rank forks with it already imported (no CUDA init here).
        ctx.set_forkserver_preload(["torch", "torch.distributed", "numpy", "placement.metrics"])
    return ctx


@dataclass(frozen=True)
class _Rendezvous:
    """Where and how the ranks meet: the parent's TCP store and the process-group settings."""

    world_size: int
    backend: str
    host: str
    port: int
    pg_timeout: float


def _worker(rank: int, rdv: _Rendezvous, fn, args, results):
    global _CURRENT_STORE, _REPORT
    _REPORT = lambda text: results.put((rank, _PROGRESS, text))  # noqa: E731
    world_size, backend = rdv.world_size, rdv.backend
    import torch
    import torch.distributed as dist

    try:
        if backend == "gloo":
            torch.set_num_threads(1)
        else:
            torch.cuda.set_device(device_for(backend, rank))
        td = datetime.timedelta(seconds=rdv.pg_timeout)
        store = dist.TCPStore(rdv.host, rdv.port, world_size + 1, False, timeout=td)
        _CURRENT_STORE = store
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=td)
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - report anything to the parent, including KeyboardInterrupt
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001, S110 - best effort while shutting down after a failure
            pass
        _CURRENT_STORE = None
        _REPORT = None


def _check_launch(world_size: int, backend: str) -> None:
    """Bad ``world_size`` or ``backend`` (or nccl without GPUs) -> ValueError naming the value."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA GPUs, none is visible; use --backend gloo")


def _start_workers(ctx, rdv: _Rendezvous, fn, args, results):
    """Start one daemon process per rank (``OMP_NUM_THREADS=1`` in their environment on gloo)."""
    world_size, backend = rdv.world_size, rdv.backend
    procs = []
    env_before = os.environ.get("OMP_NUM_THREADS")
    if backend == "gloo":
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children at spawn
    try:
        for r in range(world_size):
            p = ctx.Process(
                target=_worker,
                args=(r, rdv, fn, tuple(args), results),
                daemon=True,
            )
            p.start()
            procs.append(p)
    finally:
        if backend == "gloo":
            if env_before is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_before
    return procs


def _collect(
    procs, results, out: dict[int, Any], timeout: float, grace: float, on_report=None, lost_ok: bool = False
) -> tuple[int, str] | None:
    """Fill ``out`` (rank -> result; None for a failed or lost rank) from the queue until every rank
    reported, ``timeout`` passed, or ``grace`` seconds after the first failure (progress reports go to
    ``on_report(rank, text)`` meanwhile). Returns that failure (rank, text). With ``lost_ok`` a rank that
    exited with :data:`LOST_RANK_EXIT_CODE` is lost: None."""
    world_size = len(procs)
    failure: tuple[int, str] | None = None
    deadline = time.monotonic() + timeout
    fail_deadline = float("inf")
    dead_since: dict[int, float] = {}
    while len(out) < world_size:
        now = time.monotonic()
        if now > deadline or now > fail_deadline:
            break
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except _queue.Empty:
            # A child that died without reporting (killed, segfault) is a failure too; its report
            # may still be in the pipe, so give it a second before declaring it.
            for r, p in enumerate(procs):
                if r in out or p.exitcode is None:
                    continue
                first = dead_since.setdefault(r, now)
                if lost_ok and p.exitcode == LOST_RANK_EXIT_CODE and now - first > 1.0:
                    out[r] = None  # killed on purpose: the survivors carry on without it
                elif failure is None and now - first > 1.0:
                    failure = (r, f"process exited with code {p.exitcode} without reporting a result")
                    fail_deadline = now + grace
            continue
        if ok == _PROGRESS:
            if on_report is not None:
                on_report(rank, payload)
            continue
        out[rank] = payload if ok else None
        if not ok and failure is None:
            failure = (rank, payload)
            fail_deadline = time.monotonic() + grace
    return failure


def _reap(procs, results, wait: bool) -> None:
    """Join every child (up to 5 s each when ``wait``), terminate then kill the rest; close the queue."""
    for p in procs:
        p.join(timeout=5.0 if wait else 0.0)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
    results.close()
    results.join_thread()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    backend: str = "gloo",
    timeout: float = 60.0,
    pg_timeout: float | None = None,
    grace: float = 3.0,
    start_method: str | None = None,
    on_report: Callable[[int, str], None] | None = None,
    lost_ok: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return ``[result of rank r]``.

    Args:
        fn: module-level function (picklable by name).
        world_size: number of ranks (>= 1).
        args: extra positional arguments, pickled to every rank.
        backend: ``gloo`` (CPU) or ``nccl`` (one GPU per rank, shared round-robin if fewer).
        timeout: wall-clock seconds for the whole run (start-up included) before all ranks are killed.
        pg_timeout: process-group / store timeout inside workers (default ``timeout``).
        grace: seconds the other ranks get to report after one rank failed, before being terminated.
        start_method: ``forkserver`` (default where available: one server process imports torch once,
            later launches fork from it in well under a second) or ``spawn``.
        on_report: called as ``on_report(rank, text)`` for each :func:`report` of a worker, in this
            process's main thread while it waits (None: reports are dropped).
        lost_ok: a rank that exits with :data:`LOST_RANK_EXIT_CODE` (killed on purpose by a fault
            injection) is lost, not failed: its result is None and the run goes on.

    Raises:
        ValueError: bad world_size, backend or timeouts (each must be > 0 seconds).
        WorkerError: a rank raised (its traceback is in the message).
        WorkerTimeout: ranks did not finish in time.
    """
    import torch.distributed as dist

    _check_launch(world_size, backend)
    pg_timeout = float(timeout if pg_timeout is None else pg_timeout)
    for name, value in (("timeout", timeout), ("pg_timeout", pg_timeout), ("grace", grace)):
        if not float(value) > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {value}; pass a positive number of seconds")
    host = "127.0.0.1"
    store = dist.TCPStore(
        host, 0, world_size + 1, True, timeout=datetime.timedelta(seconds=pg_timeout), wait_for_workers=False
    )
    ctx = _context(start_method)
    results = ctx.Queue()
    rdv = _Rendezvous(world_size, backend, host, store.port, pg_timeout)
    procs = _start_workers(ctx, rdv, fn, args, results)
    out: dict[int, Any] = {}
    failure: tuple[int, str] | None = None
    try:
        failure = _collect(procs, results, out, timeout, grace, on_report=on_report, lost_ok=lost_ok)
    finally:
        # a failure (or an interrupted wait) leaves ranks unfinished: do not wait for them
        _reap(procs, results, wait=not (failure or len(out) < world_size))
        del store
    if failure is not None:
        raise WorkerError(*failure)
    missing = [r for r in range(world_size) if r not in out]
    if missing:
        raise WorkerTimeout(missing, timeout)
    return [out[r] for r in range(world_size)]
