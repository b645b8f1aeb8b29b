"""Placements and figures of a small, fast run of the CLI, to diff a refactor against (about a minute).

Usage (from the repository root, with the package on ``PYTHONPATH``)::

    python tools/snapshot_quick.py OUT_DIR
    diff -r before/ after/        # must print nothing: same placement files, same figures

Two inputs: a synthetic trace (``synthetic_trace`` with a fixed seed) and the first tokens and layers
of the shared DeepSeek-V2-Lite trace (skipped with a note when ``MOE_TRACES_DIR`` lacks it). On each,
every solver the CLI offers is run on a step budget (so two runs of one tree write the same bytes), a
migration from greedy's placement, an SGLang export, and ``evaluate --json`` under every dispatch
model. Only placement files and the evaluation figures are kept; wall times and paths are dropped.
``files.sha256`` lists one hash per file. ``tools/snapshot.sh`` is the full (slow) version.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from profiling.readers import read_trace, write_trace
from profiling.synthetic import synthetic_trace

DEEPSEEK = "deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz"
# (name, topology flags) per input; the solves below run on each
TOPOLOGIES = {
    "synthetic": ["--ep-size", "8", "--num-nodes", "2", "--num-redundant", "8"],
    "deepseek": ["--ep-size", "16", "--num-nodes", "2", "--num-redundant", "16"],
}
SOLVES = {
    "greedy": ["--solver", "greedy", "--dispatch", "local"],
    "greedy-even": ["--solver", "greedy", "--dispatch", "even"],
    "cpsat-weighted": ["--solver", "cpsat", "--weighted", "--time-limit", "30", "--workers", "1"],
    "cpsat": ["--solver", "cpsat", "--time-limit", "30", "--workers", "1"],
    "locality": ["--solver", "locality", "--work-limit", "60", "--balance-slack", "0.02"],
}
VOLATILE = ("wall", "time", "seconds", "elapsed", "path", "output", "written", "date")


def _inputs(out: Path) -> dict[str, Path]:
    """Write the traces the snapshot solves on; ``{name: path}``."""
    paths = {}
    syn = synthetic_trace(
        num_tokens=3000, num_layers=3, num_logical_experts=32, top_k=4, num_prompts=40, seed=7
    )
    paths["synthetic"] = out / "synthetic.npz"
    write_trace(syn, paths["synthetic"])
    real = Path(os.environ.get("MOE_TRACES_DIR", "../shared/traces")) / DEEPSEEK
    if real.exists():
        sliced = read_trace(real).slice_tokens(0, 4000).select_layers([0, 1, 2])
        paths["deepseek"] = out / "deepseek.npz"
        write_trace(sliced, paths["deepseek"])
    else:
        print(f"note: {real} not found; the DeepSeek slice is skipped", file=sys.stderr)
    return paths


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe_placement", *args], capture_output=True, text=True, check=False
    )


def _stable(obj):
    """``obj`` without the keys that change from run to run (times, paths)."""
    if isinstance(obj, dict):
        return {k: _stable(v) for k, v in obj.items() if not any(w in k.lower() for w in VOLATILE)}
    if isinstance(obj, list):
        return [_stable(v) for v in obj]
    return obj


def _solve_all(out: Path, name: str, trace: Path) -> None:
    """Every solve of ``SOLVES`` plus a migration and an SGLang export, each placement in ``out``."""
    topo = TOPOLOGIES[name]
    for solve, flags in SOLVES.items():
        dest = out / f"{name}-{solve}.json"
        done = _cli("solve", "--trace", str(trace), *topo, *flags, "--fit-fraction", "0.5", "-o", str(dest))
        (out / f"{name}-{solve}.rc").write_text(
            f"{done.returncode}\n{done.stderr if done.returncode else ''}"
        )
    greedy = out / f"{name}-greedy.json"
    moved = _cli(
        "solve",
        "--trace",
        str(trace),
        *topo,
        "--previous",
        str(greedy),
        "--max-moves",
        "6",
        "--fit-fraction",
        "0.5",
        "-o",
        str(out / f"{name}-migration.json"),
    )
    (out / f"{name}-migration.rc").write_text(f"{moved.returncode}\n")
    sg = _cli(
        "solve",
        "--trace",
        str(trace),
        *topo,
        "--dispatch",
        "sglang-static",
        "--fit-fraction",
        "0.5",
        "-o",
        str(out / f"{name}-sglang.pt"),
        "--format",
        "sglang",
    )
    (out / f"{name}-sglang.rc").write_text(f"{sg.returncode}\n")
    ev = _cli("evaluate", str(greedy), str(trace), "--dispatch", "all", "--step-tokens", "32", "--json")
    figures = (
        _stable(json.loads(ev.stdout)) if ev.returncode == 0 else {"rc": ev.returncode, "err": ev.stderr}
    )
    (out / f"{name}-evaluate.json").write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python tools/snapshot_quick.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    traces = _inputs(out)
    for name, path in traces.items():
        _solve_all(out, name, path)
    rows = [
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}"
        for p in sorted(out.iterdir())
        if p.is_file() and p.name != "files.sha256"
    ]
    (out / "files.sha256").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
