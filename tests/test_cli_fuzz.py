"""Issue 25: bad input to any sub-command ends in one stderr line and exit code 2 (Ctrl-C: 130), in
seconds, and no file on disk changes.

Every case of :data:`CASES` runs ``moe_placement.cli.main.main`` in-process on small synthetic files in a fresh
folder; the folder's names and checksums before and after the run must be equal (an output that names
an input, a report into a missing folder, a refused flag: nothing is written, nothing is replaced).
Only the Ctrl-C test starts a subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from moe_placement.cli.main import main
from placement.formats import write_placement
from placement.model import Placement
from placement.topology import Topology
from profiling.readers import write_trace
from profiling.synthetic import synthetic_trace
from profiling.trace import RoutingTrace
from solver.api import solve

ROOT = Path(__file__).resolve().parents[1]
E, L, G = 8, 2, 4  # experts, layers, GPUs of the synthetic files


class Hung(BaseException):
    """Raised by the watchdog: a case blocked (a FIFO read) instead of refusing at once."""


@pytest.fixture()
def watchdog():
    """Interrupt the main thread (even inside a blocking ``open``) after 30 s."""

    def fire(signum, frame):
        raise Hung("the command blocked for 30 s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _write_inputs(d: Path) -> None:
    """The files the cases name: a trace and its placement, loads, empty data, FIFOs, links, corrupt files."""
    trace = synthetic_trace(num_tokens=400, num_layers=L, num_logical_experts=E, top_k=2, num_prompts=8)
    write_trace(trace, d / "t.npz")
    empty = np.zeros((0, L, 2), dtype=np.int64)  # [T=0, L, k]
    write_trace(RoutingTrace(E, topk_ids=empty, layer_ids=trace.layer_ids), d / "empty.npz")
    unrouted = np.full((50, L, 2), -1, dtype=np.int64)  # [T, L, k]: every pick empty
    write_trace(RoutingTrace(E, topk_ids=unrouted, layer_ids=trace.layer_ids), d / "neg.npz")
    half = trace.topk_ids.copy()
    half[200:] = -1  # the second half routes nothing: a held-out part with zero load
    write_trace(RoutingTrace(E, topk_ids=half, layer_ids=trace.layer_ids), d / "half.npz")
    zeros = np.zeros((2, L, E), dtype=np.int64)  # [W, L, E]
    write_trace(RoutingTrace(E, window_counts=zeros, layer_ids=trace.layer_ids), d / "zeroc.npz")
    placement, _ = solve("greedy", topology=Topology.from_redundant(E, 0, G), trace=trace)
    write_placement(placement, d / "p.json")
    write_placement(placement, d / "p.yaml", "trtllm")  # with its sidecar p.yaml.meta.json
    np.save(d / "load.npy", np.ones((L, E)))
    np.save(d / "zero.npy", np.zeros((L, E)))
    np.save(d / "nolayers.npy", np.zeros((0, E)))
    np.save(d / "nan.npy", np.full((L, E), np.nan))
    np.save(d / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (d / "deep.json").write_text("[" * 200000 + "]" * 200000)
    (d / "deep.yaml").write_text("[" * 50000 + "]" * 50000)
    (d / "text.txt").write_text("some text to profile")
    ids = trace.topk_ids
    np.savez(d / "c.npz", counts=np.ones((L, E)))  # counts only, no tokens
    co = Placement(
        np.array([[0, 0, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]] * L), E, Topology(G, 12, 1), (0, 1), {}, True
    )
    write_placement(co, d / "co.json")  # an engine map with co-located replicas, 12 slots
    np.savez(d / "seq0d.npz", topk_ids=ids, seq_offsets=np.array(2**62))  # a scalar, not boundaries
    np.savez(d / "segnan.npz", topk_ids=ids, segment=np.array([np.nan]), counts_real=np.ones((L, E)))
    np.savez(d / "counts0d.npz", topk_ids=ids, counts=np.array("abc"))
    long = "9" * 5000  # over Python's int-digits limit: refused naming the file, not Python's limit
    (d / "long.json").write_text('{"physical_to_logical_map": [[0, 1, 2, ' + long + "]]}")
    (d / "long.yaml").write_text(f"num_slots: {long}\ninitial_global_assignments:\n  0: [0, 1]\n")
    (d / "placement.json").write_text(
        json.dumps({"model_type": "mixtral"})
    )  # a model file named like an output
    (d / "lorenz.png").write_bytes((d / "t.npz").read_bytes())  # a trace named like a plot
    (d / "out").mkdir()
    for name in ("fifo.npz", "fifo.npy", "fifo.json", "fifo.txt"):
        os.mkfifo(d / name)
    os.symlink(d / "t.npz", d / "link.json")  # an output path that resolves to the trace
    os.link(d / "p.json", d / "hard.json")  # a second name of the placement
    os.symlink("/proc", d / "proc")  # a folder no file can be created in (root too), found before the run
    dup = ids.astype(np.int64)
    dup[7, 1] = [3, 3]  # token 7 names expert 3 twice in layer 1
    np.savez(d / "dup.npz", topk_ids=dup)
    np.savez(d / "rawneg.npz", topk_ids=np.full((50, L, 2), -1))  # nothing routed, no expert count


def _snapshot(d: Path) -> dict[str, str]:
    """Every entry under ``d``: its kind, and a checksum for regular files."""
    out = {}
    for p in sorted(d.rglob("*")):
        rel = str(p.relative_to(d))
        if p.is_symlink():
            out[rel] = "link -> " + os.readlink(p)
        elif p.is_fifo():
            out[rel] = "fifo"
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


SOLVE = ["solve", "--trace", "{d}/t.npz", "--ep-size", "4"]
LOAD = ["solve", "--load", "{d}/load.npy", "--ep-size", "4"]
EVAL = ["evaluate", "{d}/p.json", "{d}/t.npz"]
CONVERT = ["convert", "{d}/p.json", "-o", "{d}/out/c.json", "--format", "sglang"]
LAYOUT = ["layout", "--model", "deepseek-v3", "--nodes", "1"]
VALIDATE = ["validate", "{d}/p.json"]
SERVE = ["serve-demo", "--model", "{d}/placement.json"]
PROFILE = ["profile", "--model", "{d}/placement.json", "--text", "{d}/text.txt", "-o", "{d}/out/t.npz"]

# (argv, a fragment of the one stderr line)
CASES = [
    # -- outputs that would destroy an input, or each other, or land in a missing folder
    (["solve", "--trace", "{d}/t.npz", "--ep-size", "4", "-o", "{d}/t.npz"], "is the input"),
    ([*SOLVE, "-o", "{d}/link.json"], "is the input"),
    ([*SOLVE, "-o", "{d}/out/q.json", "--report", "{d}/out/q.json"], "are the same file"),
    ([*SOLVE, "-o", "{d}/q.json", "--report", "{d}/nodir/r.json"], "does not exist"),
    ([*SOLVE, "-o", "{d}/nodir/q.json", "--report", "{d}/r.json"], "does not exist"),
    ([*SOLVE, "--previous", "{d}/p.json", "--max-moves", "1", "--report", "{d}/p.json"], "is the input"),
    ([*SOLVE, "--previous", "{d}/p.json", "--max-moves", "1", "-o", "{d}/hard.json"], "is the input"),
    ([*SOLVE, "--previous", "{d}/p.yaml", "--max-moves", "1", "-o", "{d}/p.yaml.meta.json"], "is the input"),
    ([*SOLVE, "--format", "sglang", "-o", "{d}/q.json", "--report", "{d}/q.json.meta.json"], "same file"),
    ([*SOLVE, "--weighted", "-o", "{d}/q.json", "--report", "{d}/q.json.weights.json"], "same file"),
    ([*SOLVE, "-o", "{d}/out"], "is a folder"),
    ([*LOAD, "-o", "{d}/load.npy"], "is the input"),
    (["convert", "{d}/p.json", "-o", "{d}/p.json", "--format", "native"], "is the input"),
    (["convert", "{d}/p.json", "-o", "{d}/hard.json", "--format", "native"], "is the input"),
    (["convert", "{d}/p.yaml", "-o", "{d}/p.yaml.meta.json", "--format", "native"], "is the input"),
    (["convert", "{d}/t.npz", "-o", "{d}/t.npz", "--format", "trace"], "is the input"),
    (["convert", "{d}/p.json", "-o", "{d}/nodir/c.yaml", "--format", "trtllm"], "does not exist"),
    (["inspect", "{d}/lorenz.png", "--plot", "{d}"], "is the input"),
    (["inspect", "{d}/t.npz", "--plot", "{d}/t.npz"], "is not a folder"),
    (["demo", "--out", "{d}/t.npz"], "is not a folder"),
    (["demo", "--out", "{d}/new", "--ep-size", "7"], "do not divide over ep_size=7"),
    ([*LAYOUT, "--output", "{d}/t.npz"], "is not a folder"),
    (["layout", "--model", "{d}/placement.json", "--nodes", "1", "--output", "{d}"], "is the input"),
    (
        ["profile", "--model", "{d}/placement.json", "--text", "{d}/text.txt", "-o", "{d}/text.txt"],
        "is the input",
    ),
    (
        ["profile", "--model", "{d}/placement.json", "--text", "{d}/text.txt", "-o", "{d}/placement.json"],
        "input",
    ),
    (["profile", "--model", "{d}/placement.json", "--text", "{d}/t.txt", "-o", "{d}/nodir/t.npz"], "t.txt"),
    # -- numeric flags: one line naming the flag, the value and the accepted range
    ([*SOLVE, "--fit-fraction", "1.5"], "--fit-fraction: 1.5 is not in the accepted range: (0, 1]"),
    ([*SOLVE, "--fit-fraction", "nan"], "--fit-fraction: nan is not in the accepted range: (0, 1]"),
    ([*SOLVE, "--fit-fraction", "0"], "--fit-fraction: 0 is not in"),
    ([*SOLVE, "--fit-fraction", "half"], "--fit-fraction: 'half' is not a number"),
    ([*SOLVE, "--hidden-size", "-7"], "--hidden-size: -7 is not in the accepted range: 1.."),
    ([*SOLVE, "--time-limit", "nan"], "--time-limit: nan is not in the accepted range: (0, "),
    ([*SOLVE, "--time-limit", "nan", "--wall-clock", "--solver", "locality"], "--time-limit: nan"),
    ([*SOLVE, "--time-limit", "inf"], "--time-limit: inf"),
    ([*SOLVE, "--time-limit", "0"], "--time-limit: 0 is not in"),
    ([*SOLVE, "--time-limit", "-1"], "--time-limit: -1 is not in"),
    ([*SOLVE, "--workers", "-3"], "--workers: -3 is not in the accepted range: 1..1024"),
    ([*SOLVE, "--workers", "0"], "--workers: 0"),
    ([*SOLVE, "--seed", "-1"], "--seed: -1 is not in the accepted range: 0..2147483647"),
    ([*SOLVE, "--seed", str(2**40)], f"--seed: {2**40} is not in"),
    (
        ["solve", "--trace", "{d}/t.npz", "--ep-size", "0"],
        "--ep-size: 0 is not in the accepted range: 1..65536",
    ),
    (["solve", "--trace", "{d}/t.npz", "--ep-size", "3000000000"], "--ep-size: 3000000000"),
    (["solve", "--trace", "{d}/t.npz", "--ep-size", "four"], "--ep-size: 'four' is not an integer"),
    ([*SOLVE, "--num-nodes", "0"], "--num-nodes: 0 is not in"),
    (
        [*SOLVE, "--num-nodes", "100000"],
        "--num-nodes: 100000 is not in the accepted range: 1..65536 (MAX_RANKS)",
    ),
    ([*SOLVE, "--num-redundant", "-1"], "--num-redundant: -1 is not in the accepted range: 0..65536"),
    ([*SOLVE, "--num-redundant", "1000000"], "(MAX_EXPERTS)"),
    ([*SOLVE, "--num-redundant", "65532"], "over the accepted 65536 (MAX_EXPERTS)"),
    ([*SOLVE, "--num-groups", "0"], "--num-groups: 0"),
    ([*SOLVE, "--num-windows", "0"], "--num-windows: 0"),
    ([*SOLVE, "--work-limit", "0"], "--work-limit: 0"),
    ([*SOLVE, "--everywhere", "-1"], "--everywhere: -1"),
    ([*SOLVE, "--balance-slack", "nan"], "--balance-slack: nan"),
    ([*SOLVE, "--gpu-slack", "-0.5"], "--gpu-slack: -0.5"),
    ([*SOLVE, "--share-margin", "inf"], "--share-margin: inf"),
    ([*SOLVE, "--drift-z", "-1"], "--drift-z: -1"),
    ([*SOLVE, "--share-overload", "nan"], "--share-overload: nan"),
    ([*SOLVE, "--max-moves", "-1"], "--max-moves: -1"),
    ([*SOLVE, "--move-cost", "inf"], "--move-cost: inf"),
    ([*SOLVE, "--solver", "nope"], "--solver: invalid choice"),
    ([*EVAL, "--step-tokens", "0"], "--step-tokens: 0 is not in the accepted range: integers >= 1"),
    ([*SOLVE, "--dispatch", "balanced", "--step-tokens", "0"], "--step-tokens: 0 is not in the accepted"),
    ([*EVAL, "--phase", "train"], "--phase: invalid choice"),
    (
        [*EVAL, "--step-tokens", "1000"],
        "tokens per rank on 4 ranks takes 4000 tokens but the trace has only 400",
    ),
    ([*SOLVE, "--phase", "warmup"], "--phase: invalid choice"),
    (
        [*SOLVE, "--dispatch", "balanced", "--phase", "prefill", "--step-tokens", "1000"],
        "one prefill step of 1000 tokens per rank on 4 ranks takes 4000 tokens but the trace has only 400",
    ),
    ([*SOLVE, "--dispatch", "balanced", "--model", "nope"], "unknown model 'nope'"),
    ([*EVAL, "--hidden-size", "0"], "--hidden-size: 0"),
    ([*EVAL, "--ep-size", "-2"], "--ep-size: -2"),
    (["inspect", "{d}/t.npz", "--chunk-tokens", "0"], "--chunk-tokens: 0"),
    (
        [*CONVERT, "--num-hidden-layers", "3000000000"],
        "--num-hidden-layers: 3000000000 is not in the accepted",
    ),
    ([*CONVERT, "--num-hidden-layers", "0"], "--num-hidden-layers: 0"),
    ([*CONVERT, "--num-logical-experts", "0"], "--num-logical-experts: 0"),
    ([*CONVERT, "--ep-size", "70000"], "--ep-size: 70000"),
    ([*LAYOUT, "--nodes", "0"], "--nodes: 0"),
    ([*LAYOUT, "--gpus-per-node", "0"], "--gpus-per-node: 0"),
    ([*LAYOUT, "--batch-per-rank", "0"], "--step-tokens/--batch-per-rank: 0"),
    ([*LAYOUT, "--step-tokens", "0"], "--step-tokens/--batch-per-rank: 0"),
    ([*LAYOUT, "--context-len", "-5"], "--context-len: -5"),
    ([*LAYOUT, "--top", "-1"], "--top: -1"),
    ([*LAYOUT, "--max-redundant", "-1"], "--max-redundant: -1"),
    ([*LAYOUT, "--time-limit", "nan"], "--time-limit: nan"),
    ([*LAYOUT, "--gpus-per-node", "1000", "--nodes", "1000"], "over the accepted 65536 (MAX_RANKS)"),
    ([*PROFILE, "--seq-len", "0"], "--seq-len: 0"),
    ([*PROFILE, "--max-tokens", "0"], "--max-tokens: 0"),
    ([*PROFILE, "--seed", "-1"], "--seed: -1"),
    (["demo", "--out", "{d}/new", "--tokens", "0"], "--tokens: 0"),
    (["demo", "--out", "{d}/new", "--layers", "100000"], "--layers: 100000"),
    (["demo", "--out", "{d}/new", "--time-limit", "nan"], "--time-limit: nan"),
    (["demo", "--out", "{d}/new", "--ep-size", "0"], "--ep-size: 0"),
    ([*VALIDATE, "--offset", "-1"], "--offset: -1"),
    ([*VALIDATE, "--hidden", "0"], "--hidden: 0"),
    ([*VALIDATE, "--layers", "-1"], "--layers: -1"),
    ([*VALIDATE, "--ep-size", "0"], "--ep-size: 0"),
    ([*VALIDATE, "--seed", str(2**40)], f"--seed {2**40} is outside the accepted range 0..2147483647"),
    ([*VALIDATE, "--timeout", "1e300"], "--timeout 1e+300 is outside the accepted range 0..10000000"),
    ([*SERVE, "--prompt-len", "0"], "--prompt-len: 0"),
    ([*SERVE, "--rebalance-every", "-1"], "--rebalance-every: -1"),
    ([*SERVE, "--layers", "-1"], "--layers: -1"),
    ([*SOLVE, "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["no-such-command"], "invalid choice"),
    # -- empty data: no placement from, and no score on, zero tokens
    (["solve", "--trace", "{d}/empty.npz", "--ep-size", "4"], "the trace has 0 tokens"),
    (["solve", "--trace", "{d}/zeroc.npz", "--ep-size", "4"], "every expert load is 0"),
    (["solve", "--load", "{d}/zero.npy", "--ep-size", "4"], "every expert load is 0"),
    (["solve", "--load", "{d}/nan.npy", "--ep-size", "4"], "NaN, inf or negative"),
    (["solve", "--load", "{d}/objects.npy", "--ep-size", "4"], "pickle"),
    (["evaluate", "{d}/p.json", "{d}/empty.npz"], "the trace has 0 tokens"),
    (["evaluate", "{d}/p.json", "{d}/zeroc.npz"], "every expert load is 0"),
    ([*VALIDATE, "--trace", "{d}/empty.npz"], "the trace has 0 tokens"),
    # -- nothing routed (issue 36): PAR of zero load is undefined, never a perfect 1.0
    (["inspect", "{d}/empty.npz"], "the trace has 0 tokens"),
    (["inspect", "{d}/neg.npz"], "every expert load is 0"),
    (["inspect", "{d}/neg.npz", "--json"], "balance (peak / mean of zero load) is undefined"),
    (["inspect", "{d}/neg.npz", "--plot", "{d}/out"], "every expert load is 0"),
    (["inspect", "{d}/neg.npz", "--chunk-tokens", "7"], "every expert load is 0"),
    (["inspect", "{d}/zeroc.npz"], "every expert load is 0"),
    (["solve", "--trace", "{d}/neg.npz", "--ep-size", "4", "-o", "{d}/out/q.json"], "every expert load is 0"),
    (["solve", "--trace", "{d}/half.npz", "--ep-size", "4", "--fit-fraction", "0.5"], "the held-out part"),
    (["evaluate", "{d}/p.json", "{d}/neg.npz"], "every expert load is 0"),
    (["advise", "--trace", "{d}/neg.npz", "--nodes", "1", "--engine", "vllm"], "every expert load is 0"),
    ([*VALIDATE, "--trace", "{d}/neg.npz"], "every expert load is 0"),
    # -- flags that cannot take effect on this run (issue 36): refused, never silently ignored
    ([*SOLVE, "--robust", "max"], "--robust applies to the cpsat and milp solvers, not greedy"),
    ([*SOLVE, "--weighted", "-o", "{d}/out/q.json"], "--weighted applies to the cpsat and milp solvers"),
    ([*SOLVE, "--num-windows", "3"], "--num-windows applies"),
    ([*SOLVE, "--solver", "locality", "--objective", "decode"], "--objective applies to the cpsat and milp"),
    (
        [*SOLVE, "--solver", "cpsat", "--balance-slack", "0.1"],
        "--balance-slack applies to the locality solver",
    ),
    ([*SOLVE, "--previous", "{d}/p.json", "--max-moves", "1", "--robust", "max"], "not migration"),
    ([*SOLVE, "--max-moves", "1"], "need --previous"),
    ([*SOLVE, "--source-ranks", "nosuch"], "'nosuch' is not a rule or a rank file"),
    ([*EVAL, "--source-ranks", "nosuch"], "'nosuch' is not a rule or a rank file"),
    ([*SOLVE, "--source-ranks", "round-robin"], "nothing in this run uses source ranks"),
    ([*SOLVE, "--step-tokens", "8"], "--step-tokens applies to a per-step dispatch model"),
    ([*SOLVE, "--wall-clock"], "--wall-clock applies to a solver bounded by --work-limit"),
    ([*SOLVE, "--format", "sglang"], "no -o FILE is written"),
    ([*LOAD, "--fit-fraction", "0.5"], "a --load matrix has none"),
    # -- leaked internals (issue 36)
    (["evaluate", "{d}/long.json", "{d}/t.npz", "--ep-size", "4"], "long.json: a number in it has over"),
    (
        ["convert", "{d}/long.yaml", "-o", "{d}/out/c.json", "--format", "native", "--ep-size", "2"],
        "long.yaml",
    ),
    (["inspect", "{d}/seq0d.npz"], "field 'seq_offsets' must be a 1-D integer array, got int64 of shape ()"),
    (["solve", "--trace", "{d}/segnan.npz", "--ep-size", "4"], "field 'segment' must be a 1-D integer array"),
    (["evaluate", "{d}/p.json", "{d}/counts0d.npz"], "field 'counts' must be counts [..., experts]"),
    ([*VALIDATE, "--timeout", "0.001"], "--timeout 0.001 s is too short for the ranks to start and meet"),
    ([*SERVE, "--timeout", "0.01"], "--timeout 0.01 s is too short"),
    (["inspect", "{d}/t.npz", "--domains", "arxiv"], "this trace has no per-domain counts"),
    (["inspect", "{d}/c.npz", "--domains", "arxiv"], "drop --domains"),
    (
        ["evaluate", "{d}/p.json", "{d}/c.npz", "--hidden-size", "64"],
        "--hidden-size applies to per-token metrics",
    ),
    (
        ["evaluate", "{d}/p.json", "{d}/c.npz", "--step-tokens", "8"],
        "--step-tokens applies to per-token metrics",
    ),
    ([*SOLVE, "-o", "{d}/out/x.pt"], "a .pt file is read back as SGLang's torch.save map; name it .json"),
    (["convert", "{d}/p.json", "-o", "{d}/out/c.json", "--format", "trtllm"], "TensorRT-LLM's file is YAML"),
    (["convert", "{d}/p.json", "-o", "{d}/out/c.pth", "--format", "vllm"], "name it .json"),
    ([*SOLVE, "--previous", "{d}/co.json", "--max-moves", "1"], "--previous has shape (2, 12)"),
    ([*VALIDATE, "--dtype", "bfloat16"], "--dtype applies to --model only"),
    (
        [*VALIDATE, "--model", "{d}/placement.json", "--hidden", "64"],
        "--hidden applies to the replayed trace",
    ),
    ([*VALIDATE, "--model", "{d}/placement.json", "--offset", "3"], "--offset applies to the replayed trace"),
    ([*SERVE, "--rebalance-every", "0", "--max-moves", "2"], "--max-moves applies to re-solves"),
    ([*SERVE, "--rebalance-every", "0", "--no-wait"], "--rebalance-every 0 runs none"),
    ([*SERVE, "--placement", "{d}/p.json", "--redundant", "2"], "--placement FILE brings its own"),
    (["solve", "--load", "{d}/nolayers.npy", "--ep-size", "4"], "needs at least one layer and one expert"),
    # -- FIFOs are refused at once, never read
    (["solve", "--trace", "{d}/fifo.npz", "--ep-size", "4"], "FIFO"),
    (["solve", "--load", "{d}/fifo.npy", "--ep-size", "4"], "FIFO"),
    ([*SOLVE, "--source-ranks", "{d}/fifo.npy", "--dispatch", "sglang-static"], "FIFO"),
    ([*EVAL, "--source-ranks", "{d}/fifo.npy"], "FIFO"),
    (["evaluate", "{d}/fifo.json", "{d}/t.npz"], "FIFO"),
    (["inspect", "{d}/fifo.npz"], "FIFO"),
    (["convert", "{d}/fifo.json", "-o", "{d}/out/c.json", "--format", "native"], "FIFO"),
    (["profile", "--model", "{d}/placement.json", "--text", "{d}/fifo.txt", "-o", "{d}/out/t.npz"], "FIFO"),
    # -- nesting deeper than the parsers' stacks
    (["evaluate", "{d}/deep.json", "{d}/t.npz"], "deep.json"),
    (["evaluate", "{d}/deep.yaml", "{d}/t.npz", "--ep-size", "4"], "deep.yaml"),
    # -- issue 46, round 4: each was accepted (or failed only after the whole run) before
    ([*SOLVE, "--dispatch", "balanced", "--hardware", ""], "--hardware '' is empty: give a value"),
    ([*LAYOUT, "--output", ""], "--output '' is empty"),
    (["layout", "--model", "deepseek-v3", "--nodes", "1", "--trace", ""], "--trace '' is empty"),
    (["evaluate", "", "{d}/t.npz"], "the placement argument is empty"),
    ([*EVAL, "--model", "deepseek-v3", "--hidden-size", "64"], "--hidden-size 64 contradicts --model"),
    (
        [*SOLVE, "--solver", "locality", "--dispatch", "balanced", "--model", "deepseek-v2-lite"]
        + ["--hidden-size", "64"],
        "whose hidden size is 2048",
    ),
    ([*EVAL, "--policy", "even", "--dispatch", "local"], "--policy and --dispatch are two spellings of one"),
    ([*LAYOUT, "--step-tokens", "8", "--batch-per-rank", "16"], "--step-tokens and --batch-per-rank"),
    ([*SOLVE, "-o", "{d}/out/a.json", "--output", "{d}/out/b.json"], "-o and --output are two spellings"),
    ([*LAYOUT, "--gpus-per-node", "1"], "no layout fits in memory on 1 GPUs (weights do not fit"),
    ([*LAYOUT, "--gpus-per-node", "1", "--output", "{d}/out/plan"], "shorter context (nothing written)"),
    ([*SOLVE, "-o", "{d}/proc/q.json"], "cannot write {d}/proc/q.json: no file can be created in folder"),
    ([*LAYOUT, "--output", "{d}/proc/plan"], "no file can be created in folder {d}/proc"),
    (["inspect", "{d}/t.npz", "--plot", "{d}/proc/plots"], "no file can be created in folder"),
    (["inspect", "{d}/dup.npz"], "token 7 names expert 3 twice in layer 1 (row 1; its top-2 is [3, 3])"),
    (["inspect", "{d}/rawneg.npz"], "nothing was routed: every topk_ids entry is -1 (no expert) in all 50"),
    (["evaluate", "{d}/p.json", "{d}/dup.npz"], "names expert 3 twice"),
    (["evaluate", "{d}/p.json", "{d}/c.npz", "--phase", "prefill"], "--phase applies to per-token metrics"),
    ([*LOAD, "--dispatch", "balanced", "--phase", "prefill"], "--phase shapes the per-step fit, which steps"),
    (
        ["solve", "--trace", "{d}/c.npz", "--ep-size", "4", "--dispatch", "balanced", "--step-tokens", "8"],
        "c.npz has counts only, so no step is placed for",
    ),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fuzz")
    _write_inputs(d)
    return d


@pytest.mark.parametrize("argv, fragment", CASES, ids=[" ".join(a)[:70] for a, _ in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_changes(argv, fragment, inputs, watchdog, capsys):
    before = _snapshot(inputs)
    start = time.perf_counter()
    rc = main([a.format(d=inputs) for a in argv])
    wall = time.perf_counter() - start
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert rc == 2, (argv, captured.err)
    assert len(lines) == 1 and captured.err.count("\n") == 1, (argv, captured.err)
    assert lines[0].startswith("moe-placement: error:"), lines
    assert fragment.replace("{d}", str(inputs)) in lines[0], (fragment, lines[0])
    assert "Traceback" not in captured.err
    assert wall < 20, f"{argv} took {wall:.1f}s"
    assert _snapshot(inputs) == before, f"{argv} changed files"


def test_help_exits_0_with_usage(capsys):
    assert main(["solve", "--help"]) == 0
    assert "--fit-fraction" in capsys.readouterr().out


@pytest.mark.parametrize(
    "error, fragment",
    [
        (RecursionError("maximum recursion depth exceeded"), "nested too deeply"),
        (MemoryError(), "does not fit in memory"),
        (OverflowError("int too large to convert to C long"), "out of range"),
    ],
)
def test_resource_errors_are_bad_input_naming_the_file(error, fragment, inputs, monkeypatch, capsys):
    """Raised while a file is read: exit 2 and the file's name; raised elsewhere: exit 2 as well;
    ``--debug`` shows the traceback (the exception propagates)."""
    import profiling.readers

    def boom(*args, **kwargs):
        raise error

    monkeypatch.setattr(profiling.readers, "read_trace", boom)
    argv = ["solve", "--trace", str(inputs / "t.npz"), "--ep-size", "4"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and "t.npz" in err and type(error).__name__ in err

    import moe_placement.cli.solve

    monkeypatch.setattr(moe_placement.cli.solve, "cmd_solve", boom)  # outside any reader
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moe-placement: error:") and type(error).__name__ in err
    with pytest.raises(type(error)):
        main(["--debug", *argv])


def test_a_bug_is_exit_1_in_one_line(inputs, monkeypatch, capsys):
    import moe_placement.cli.solve

    def bug(args):
        raise KeyError("oops")

    monkeypatch.setattr(moe_placement.cli.solve, "cmd_solve", bug)
    assert main(["solve", "--trace", str(inputs / "t.npz"), "--ep-size", "4"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error: KeyError" in err and "--debug" in err


def test_ctrl_c_in_process_is_exit_130(inputs, monkeypatch, capsys):
    import moe_placement.cli.solve

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(moe_placement.cli.solve, "cmd_solve", interrupted)
    assert main(["solve", "--trace", str(inputs / "t.npz"), "--ep-size", "4"]) == 130
    assert capsys.readouterr().err == "moe-placement: interrupted\n"


def test_ctrl_c_during_a_long_cpsat_solve_is_exit_130_and_writes_nothing(tmp_path):
    """A cpsat solve with a 60 s budget, SIGINT once the solve runs: exit 130 within seconds, one
    'interrupted' line after the progress bar, no output file and no temporary file left."""
    trace = synthetic_trace(
        num_tokens=4000, num_layers=4, num_logical_experts=64, top_k=6, num_prompts=40, seed=1
    )
    write_trace(trace, tmp_path / "t.npz")
    out = tmp_path / "p.json"
    argv = ["solve", "--trace", str(tmp_path / "t.npz"), "--ep-size", "8", "--num-redundant", "16"]
    argv += ["--solver", "cpsat", "--time-limit", "60", "-o", str(out), "--report", str(tmp_path / "r.json")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_placement", *argv],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=dict(os.environ, MOE_PLACEMENT_PROGRESS="1"),  # the time bar says when the solve runs
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # even under a shell's `&`
    )
    err = bytearray()

    def read_stderr() -> None:
        for chunk in iter(lambda: proc.stderr.read1(256), b""):
            err.extend(chunk)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while b"cpsat" not in err and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, f"the solve ended before the interrupt: {bytes(err)!r}"
        time.sleep(1.0)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
        stopped = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=5)
    text = bytes(err).decode()
    assert rc == 130, text
    assert stopped < 10, f"stopped {stopped:.1f}s after SIGINT"
    assert text.rstrip("\n").splitlines()[-1] == "moe-placement: interrupted", text
    assert "Traceback" not in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]  # no output, no .tmp file
