"""Reliability timings (issue 36): how fast a signal stops a CP-SAT solve, and how well the time limits
of migration and locality hold, each next to the greedy baseline measured in the same run.

    PYTHONPATH=. python benchmarks/reliability_timings.py [--json out.json]          # under a minute
    PYTHONPATH=. python benchmarks/reliability_timings.py --migration-layers 10000 --migration-limit 5

Rows (each: ``measured_s``, ``limit_s``, ``ratio`` = measured / limit, ``greedy_s`` and
``measured_over_greedy``):

- ``sigterm``: ``python -m moe_placement solve --load L.npy --ep-size 32 --num-redundant 32 --solver cpsat
  --time-limit 60 -o out.json`` on a heavy-tailed ``[8, 64]`` load (CP-SAT cannot prove it within
  seconds). Once greedy's baseline and start are logged (``--debug``), the script waits
  ``--signal-after`` seconds and sends SIGTERM. ``measured_s``: seconds from the signal to the exit;
  ``limit_s``: the solve's time limit, which the CLI would have waited out before the fix (48.7 s);
  ``exit_code`` (the CLI documents 143); ``left_files``: whatever is in the output folder besides the
  load (a temporary or half-written file; expected none). ``greedy_s``: the same command with
  ``--solver greedy``, from start to exit (Python start and imports included).
- ``sigint``: the same with SIGINT (Ctrl-C); the CLI documents exit code 130.
- ``migration-wall``: :func:`solver.migration.solve_migration` re-placing ``--migration-layers``
  random layers (8 experts, 12 slots on 4 GPUs) from a greedy map in service, with
  ``MigrationOptions(time_limit=--migration-limit)``. ``measured_s``: the call's wall seconds;
  ``greedy_s``: :func:`solver.greedy.greedy_placement` on the same new load; ``cut``: whether the
  report says the time limit cut the search (it should at these sizes, or the row proves nothing).
- ``locality-budget``: :func:`solver.locality.solve_locality` (``replicated``, ``local`` dispatch) on a
  synthetic per-token trace of ``--locality-layers`` layers (16 experts, top-2, 400 tokens; 24 slots on
  8 GPUs / 2 nodes) with ``LocalityOptions(time_limit=--locality-limit)``, a caller's budget for the
  whole call. ``greedy_s``: greedy on the trace's ``[L, E]`` counts.

The closing note's figures (one-off runs before this script): SIGTERM 0.6 s (48.7 s before the fix),
migration 10,000 layers at 5 s: 5.4 s (27.7 s before), locality 64 layers at 1 s: 1.45 s (10.7 s).
Times on a shared machine are noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from moe_placement.base.fileio import atomic_write_text  # noqa: E402
from placement.topology import Topology  # noqa: E402
from profiling.synthetic import synthetic_trace  # noqa: E402
from solver.greedy import greedy_placement  # noqa: E402
from solver.locality import LocalityOptions, solve_locality  # noqa: E402
from solver.migration import MigrationOptions, solve_migration  # noqa: E402

EXPECTED_EXIT = {"sigterm": 143, "sigint": 130}  # docs/cli.md's exit codes
SIGNALS = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT}
STARTED = "greedy: mode="  # the debug line greedy logs; the second one (the start) precedes CP-SAT


def solve_command(folder: Path, solver: str, time_limit: float) -> list[str]:
    """``moe-placement --debug solve`` on ``folder/load.npy`` writing ``folder/out.json``."""
    return [
        sys.executable,
        "-m",
        "moe_placement",
        "--debug",
        "solve",
        "--load",
        str(folder / "load.npy"),
        "--ep-size",
        "32",
        "--num-redundant",
        "32",
        "--solver",
        solver,
        "--time-limit",
        f"{time_limit:g}",
        "-o",
        str(folder / "out.json"),
    ]


def write_load(folder: Path) -> None:
    """A heavy-tailed ``[8, 64]`` load: CP-SAT spends its whole limit on each layer's proof."""
    rng = np.random.default_rng(0)
    np.save(folder / "load.npy", np.round(rng.pareto(1.5, (8, 64)) * 1000 + 10))


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _default_sigint() -> None:
    """In the child: SIGINT back to the default, so Python turns it into KeyboardInterrupt even when
    this script was started in the background (where the shell ignores SIGINT for it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _watch(proc: subprocess.Popen, lines: list[str], started: threading.Event) -> None:
    for line in proc.stderr:
        lines.append(line.rstrip())
        if sum(STARTED in x for x in lines) >= 2:
            started.set()


def signal_row(name: str, signal_after: float, time_limit: float, greedy_s: float) -> dict:
    """Start the CP-SAT solve, signal it ``signal_after`` s after its searches begin, time the exit."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_load(folder)
        proc = subprocess.Popen(
            solve_command(folder, "cpsat", time_limit),
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            cwd=folder,
            env=_child_env(),
            preexec_fn=_default_sigint,
        )
        lines: list[str] = []
        started = threading.Event()
        reader = threading.Thread(target=_watch, args=(proc, lines, started), daemon=True)
        reader.start()
        try:
            if not started.wait(120):
                raise RuntimeError(f"the CP-SAT solve did not start within 120 s: {lines[-3:]}")
            time.sleep(signal_after)
            running = proc.poll() is None
            t0 = time.perf_counter()
            proc.send_signal(SIGNALS[name])
            rc = proc.wait(timeout=time_limit + 60)
            measured = time.perf_counter() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        reader.join(5)
        left = sorted(p.name for p in folder.iterdir() if p.name != "load.npy")
    row = _row(name, measured, time_limit, greedy_s)
    row.update(
        exit_code=rc,
        expected_exit_code=EXPECTED_EXIT[name],
        left_files=left,
        running_at_signal=running,
        signal_after_s=signal_after,
        last_line=lines[-1] if lines else "",
    )
    return row


def greedy_cli_seconds(time_limit: float) -> float:
    """The same ``solve`` command with ``--solver greedy``, start to exit."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_load(folder)
        t0 = time.perf_counter()
        subprocess.run(
            solve_command(folder, "greedy", time_limit),
            check=True,
            cwd=folder,
            env=_child_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return time.perf_counter() - t0


def migration_row(num_layers: int, limit: float, seed: int = 2) -> dict:
    """``solve_migration`` on ``num_layers`` random layers under a ``limit`` s wall, and greedy."""
    rng = np.random.default_rng(seed)
    topo = Topology(4, 12, 1)
    warm = greedy_placement(rng.integers(1, 100, (2, 8)).astype(float), topo)[0]
    solve_migration(rng.integers(1, 100, (2, 8)).astype(float), warm)  # imports outside the timing
    prev = greedy_placement(rng.integers(1, 100, (num_layers, 8)).astype(float), topo)[0]
    w = rng.integers(1, 100, (num_layers, 8)).astype(float)  # [L, E] the new window's load
    t0 = time.perf_counter()
    pl, rep = solve_migration(w, prev, MigrationOptions(time_limit=limit))
    measured = time.perf_counter() - t0
    t0 = time.perf_counter()
    greedy_placement(w, topo)
    row = _row("migration-wall", measured, limit, time.perf_counter() - t0)
    cut = any(note.startswith("time limit") for note in rep.notes)
    row.update(layers=num_layers, placed_layers=pl.num_layers, cut=cut)
    return row


def locality_row(num_layers: int, limit: float, method: str = "replicated") -> dict:
    """``solve_locality`` on ``num_layers`` synthetic layers with a ``limit`` s call budget, and greedy."""
    trace = synthetic_trace(num_tokens=400, num_layers=num_layers, num_logical_experts=16, top_k=2)
    topo = Topology.from_redundant(16, 8, 8, 2)
    opts = LocalityOptions(
        time_limit=limit, method=method, dispatch="local" if method == "replicated" else "even"
    )
    solve_locality(trace.select_layers([0]), topo, opts)  # imports and CP-SAT's start outside the timing
    t0 = time.perf_counter()
    pl, _ = solve_locality(trace, topo, opts)
    measured = time.perf_counter() - t0
    counts = trace.counts()  # [L, E]
    t0 = time.perf_counter()
    greedy_placement(counts, topo)
    row = _row("locality-budget", measured, limit, time.perf_counter() - t0)
    row.update(layers=num_layers, placed_layers=pl.num_layers, method=method)
    return row


def _row(name: str, measured: float, limit: float, greedy_s: float) -> dict:
    return {
        "row": name,
        "measured_s": round(measured, 3),
        "limit_s": limit,
        "ratio": round(measured / limit, 4),
        "greedy_s": round(greedy_s, 4),
        "measured_over_greedy": round(measured / greedy_s, 3),
    }


def _detail(r: dict) -> str:
    if r["row"] in EXPECTED_EXIT:
        left = ", ".join(r["left_files"]) or "none"
        return (
            f"exit {r['exit_code']} (expected {r['expected_exit_code']}), files left: {left}, "
            f"signal {r['signal_after_s']:g} s into the search"
            + ("" if r["running_at_signal"] else " (had already ended!)")
        )
    cut = "" if r["row"] != "migration-wall" else (", cut by the limit" if r["cut"] else ", not cut")
    return f"{r['placed_layers']}/{r['layers']} layers placed{cut}"


def print_table(rows: list[dict]) -> None:
    print("| row | measured s | limit s | measured / limit | greedy s | measured / greedy | detail |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['row']} | {r['measured_s']:.3f} | {r['limit_s']:g} | {r['ratio']:.3f} | "
            f"{r['greedy_s']:.4f} | {r['measured_over_greedy']:.3g} | {_detail(r)} |"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rows",
        nargs="*",
        default=["sigterm", "sigint", "migration-wall", "locality-budget"],
        choices=["sigterm", "sigint", "migration-wall", "locality-budget"],
    )
    ap.add_argument("--signal-after", type=float, default=2.0, help="seconds into the search (default 2)")
    ap.add_argument("--solve-limit", type=float, default=60.0, help="the CP-SAT solve's --time-limit (60)")
    ap.add_argument("--migration-layers", type=int, default=2000, help="layers re-placed (2000)")
    ap.add_argument("--migration-limit", type=float, default=2.0, help="migration time limit, s (2)")
    ap.add_argument("--locality-layers", type=int, default=64, help="locality layers (64)")
    ap.add_argument("--locality-limit", type=float, default=1.0, help="locality time limit, s (1)")
    ap.add_argument("--locality-method", default="replicated", choices=["replicated", "grouped"])
    ap.add_argument("--json", default=None, metavar="OUT", help="write the rows to OUT (JSON)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    if {"sigterm", "sigint"} & set(args.rows):
        greedy_s = greedy_cli_seconds(args.solve_limit)
        for name in ("sigterm", "sigint"):
            if name in args.rows:
                rows.append(signal_row(name, args.signal_after, args.solve_limit, greedy_s))
    if "migration-wall" in args.rows:
        rows.append(migration_row(args.migration_layers, args.migration_limit))
    if "locality-budget" in args.rows:
        rows.append(locality_row(args.locality_layers, args.locality_limit, args.locality_method))
    print_table(rows)
    if args.json:
        atomic_write_text(args.json, json.dumps({"rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
