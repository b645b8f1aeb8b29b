"""Disaggregated serving and a lost rank on real gloo ranks, with a tiny random Mixtral (4 layers, 8
experts, top-2; the runtime tests' model with more layers).

- one launch of 2 prefill + 2 decode ranks, each pool on its own placement, serving 7 requests with one
  hand-off fault on each of requests 1-4 (metadata mismatch, corrupted chunk, a transfer slower than the
  timeout, a decode rank that dies mid-transfer) under ``retry``; the same through the CLI's ``--json``
  under ``fail``;
- SIGTERM and Ctrl-C sent to the CLI mid-run: exit codes 143 and 130, no rank left behind;
- ``--kill-rank``: a co-located pool of 4 loses rank 1 at step 3, its requests restarted (library) or
  failed (CLI).

Every request's tokens are compared with the single-process model's (the request decoded alone).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from tiny_models import tiny_mixtral  # noqa: E402

from placement.formats import write_placement  # noqa: E402
from placement.model import Placement  # noqa: E402
from runtime_hooks.hf_serve import contiguous_placement  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
E, LAYERS = 8, 4
FAULTS = ("metadata-mismatch", "corrupt-chunk", "slow-transfer", "decode-dies")  # on requests 1..4
WHY = {
    "metadata-mismatch": "metadata mismatch: planned for decode placement stale-",
    "corrupt-chunk": f"checksum mismatch on layer {LAYERS // 2}",
    "slow-transfer": f"layer {LAYERS // 2} not received: Timed out",
    "decode-dies": "no verdict from decode rank",
}


def pools() -> tuple[Placement, Placement]:
    """Prefill: contiguous blocks + 1 replica per rank (5 slots); decode: every expert on each rank in
    another order (8 slots), so it serves on after losing a rank."""
    decode = np.tile(np.array([0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7, 0, 1, 2, 3]), (LAYERS, 1))
    return contiguous_placement(LAYERS, E, 2, 2), Placement.from_map(decode, E, ep_size=2)


def fp32_spec():
    """The model as the cost model sees it, with the runtime's fp32 KV cache."""
    from placement.cost.modelspec import model_from_hf_config

    return dataclasses.replace(model_from_hf_config(tiny_mixtral(LAYERS).to_dict()), kv_cache_bytes=4.0)


def formula_bytes_per_token_layer() -> float:
    return fp32_spec().kv_bytes_per_token_layer


@pytest.fixture(scope="module")
def retry_run():
    from runtime_hooks.pd.handoff import HandoffFault
    from runtime_hooks.pd.serve import PDSpec, serve_pd

    prefill, decode = pools()
    spec = PDSpec(
        tiny_mixtral(LAYERS),
        prefill,
        decode,
        requests=7,
        new_tokens=5,
        on_handoff_failure="retry",
        handoff_timeout=2.0,
        liveness_timeout=2.0,
        faults=tuple(HandoffFault(kind, i + 1) for i, kind in enumerate(FAULTS)),
        seed=1,
    )
    return serve_pd(spec, timeout=240).to_dict()


def _lost(rep: dict) -> int:
    lost = rep["pools"]["decode"]["lost_ranks"]
    assert len(lost) == 1, lost
    return lost[0]


def _check_common(rep: dict) -> None:
    """What every run must show: no KV left anywhere, the formula's bytes, overlap, a lost decode rank
    whose survivor served on with the right weights, nothing spliced."""
    from placement.cost.handoff import kv_handoff_bytes

    kv = formula_bytes_per_token_layer()
    assert kv == 2 * 2 * 8 * 4 == rep["kv_bytes_per_token_layer"] == rep["measured_kv_bytes_per_token_layer"]
    assert rep["leaked_kv_bytes"] == {"prefill": 0, "decode": 0}
    lost = _lost(rep)
    dec, pre = rep["pools"]["decode"], rep["pools"]["prefill"]
    assert (
        dec["survivors"] == [r for r in (2, 3) if r != lost] and dec["reloads"] == 0
    )  # every expert on both
    assert (
        (pre["slots_per_gpu"], dec["slots_per_gpu"]) == (5, 8)
        and pre["weights_match"]
        and dec["weights_match"]
    )
    assert all(x > 0 for x in pre["load_per_rank"]) and dec["load_per_rank"][lost - 2] is None
    for r in rep["requests"]:
        h = r["handoff"]
        assert r["completions"] == (0 if r["status"] == "failed" else 1)  # one attempt's output, whole
        if h["state"] == "committed":
            assert h["bytes"] == h["expected_bytes"] == kv * LAYERS * r["prompt_tokens"]
            assert h["bytes"] == kv_handoff_bytes(fp32_spec(), r["prompt_tokens"])  # what plan prices
            assert h["bytes_per_layer"] == [kv * r["prompt_tokens"]] * LAYERS
            assert 0 <= h["exposed_ms"] < h["ms"], h  # layer-wise streaming: most of it under compute


def test_each_fault_is_retried_from_the_prompt(retry_run):
    rep = retry_run
    _check_common(rep)
    assert rep["tokens_match"] is True
    lost = _lost(rep)
    for r in rep["requests"]:
        assert r["status"] in ("completed", "retried") and r["tokens_match"] is True, r
        assert r["tokens"] == r["reference"] and r["ttft_ms"] > 0 and r["tpot_ms"] > 0
        first = r["attempts"][0]
        if 1 <= r["id"] <= len(FAULTS):
            kind = FAULTS[r["id"] - 1]
            assert first["fault"] == kind and first["state"] == "aborted" and WHY[kind] in first["reason"], r
            assert first["prefill_freed_bytes"] > 0  # the sender held the KV it sent, and freed it
        if r["status"] == "retried":  # each earlier attempt aborted, or was lost with the decode rank
            assert r["attempts"][-1]["state"] == "committed" and r["attempts"][-1]["decode_rank"] != lost
            assert all(a["state"] == "aborted" or a["decode_rank"] == lost for a in r["attempts"][:-1])
        else:  # a request no fault touched went through once
            assert not 1 <= r["id"] <= len(FAULTS) and len(r["attempts"]) == 1
    survivor_aborts = rep["pools"]["decode"]["aborted_handoffs"]  # the lost rank's own list died with it
    assert survivor_aborts
    for a in survivor_aborts:  # only faulted first attempts abort; what was received is freed at once
        kind = FAULTS[int(a["hid"].split(".")[0]) - 1]
        assert a["hid"].endswith(".0") and WHY[kind] in a["reason"], a
        assert (a["freed_bytes"] == 0) == (kind == "metadata-mismatch")  # refused before allocating


def test_each_fault_fails_its_request_under_fail_via_the_cli(tmp_path, capsys):
    from moe_placement.cli.main import main

    cfg = tmp_path / "config.json"
    cfg.write_text(tiny_mixtral(LAYERS).to_json_string())
    prefill, decode = pools()
    write_placement(prefill, tmp_path / "prefill.json", "native")
    write_placement(decode, tmp_path / "decode.json", "native")
    flags = (
        "serve-demo --disaggregated --prefill-ranks 2 --decode-ranks 2 --requests 7 --new-tokens 5 "
        "--on-handoff-failure fail --handoff-timeout 2 --liveness-timeout 2 --seed 1 --json"
    )
    argv = [*flags.split(), "--model", str(cfg)]
    argv += [
        "--prefill-placement",
        str(tmp_path / "prefill.json"),
        "--decode-placement",
        str(tmp_path / "decode.json"),
    ]
    for kind in FAULTS:
        argv += ["--inject-fault", kind]
    assert main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    assert {"tokens_match", "requests", "pools", "leaked_kv_bytes", "kv_bytes_per_token_layer"} <= set(rep)
    assert {"prefill", "decode"} == set(rep["pools"])
    _check_common(rep)
    assert rep["tokens_match"] is True
    lost = _lost(rep)
    for r in rep["requests"]:
        assert {"id", "status", "tokens_match", "handoff"} <= set(r)
        assert {"bytes", "ms", "exposed_ms", "state"} <= set(r["handoff"])
        assert len(r["attempts"]) == 1  # fail: never a second attempt
        if 1 <= r["id"] <= len(FAULTS):
            assert r["status"] == "failed" and r["tokens_match"] is None and r["tokens"] is None, r
            assert r["handoff"]["state"] == "aborted" and WHY[FAULTS[r["id"] - 1]] in r["reason"]
        elif r["status"] == "failed":  # decoding on the rank that died: lost with it
            assert r["attempts"][0]["decode_rank"] == lost and f"decode rank {lost} was lost" in r["reason"]
        else:
            assert r["status"] == "completed" and r["tokens_match"] is True and r["tokens"] == r["reference"]
    assert any(r["status"] == "completed" for r in rep["requests"])


# ---------------------------------------------------------------------------------------------------
# Interrupted: SIGTERM and Ctrl-C
# ---------------------------------------------------------------------------------------------------
def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to list the ranks")
def test_sigterm_and_ctrl_c_leave_no_rank_behind(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(tiny_mixtral(2).to_json_string())
    flags = "serve-demo --disaggregated --prefill-ranks 1 --decode-ranks 1 --requests 400 --new-tokens 64"
    cmd = [sys.executable, "-m", "moe_placement", *flags.split(), "--model", str(cfg)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = {
        sig: subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        ranks = {sig: set() for sig in procs}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(len(r) < 3 for r in ranks.values()):  # 2 ranks + forkserver
            for sig, p in procs.items():
                ranks[sig] |= _descendants(p.pid)
            time.sleep(0.2)
        time.sleep(2.0)  # the ranks meet and serve
        for sig, p in procs.items():
            ranks[sig] |= _descendants(p.pid)
            assert p.poll() is None, p.stderr.read()  # still serving when the signal comes
            p.send_signal(sig)
        codes = {sig: p.wait(timeout=60) for sig, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    assert codes == {signal.SIGTERM: 143, signal.SIGINT: 130}
    assert (
        procs[signal.SIGTERM]
        .stderr.read()
        .strip()
        .endswith("terminated (SIGTERM); nothing half-written is left")
    )
    assert procs[signal.SIGINT].stderr.read().strip().endswith("moe-placement: interrupted")
    end = time.monotonic() + 15
    left = set().union(*ranks.values())
    while left and time.monotonic() < end:
        left = {pid for pid in left if _running(pid)}
        time.sleep(0.2)
    assert all(len(r) >= 3 for r in ranks.values()), ranks
    assert not left, left


# ---------------------------------------------------------------------------------------------------
# A rank lost mid-serving (co-located)
# ---------------------------------------------------------------------------------------------------
def _only_copies(placement: Placement, rank: int) -> int:
    """(layer, expert) pairs whose every copy is on ``rank``: the experts a loss of it must reload."""
    S = placement.topology.slots_per_gpu
    m = placement.physical_to_logical_map.reshape(placement.num_layers, -1, S)
    return sum(len(set(m[l, rank]) - set(np.delete(m[l], rank, axis=0).ravel())) for l in range(len(m)))


def _check_kill(rep: dict, placement: Placement) -> None:
    assert rep["killed_rank"] == 1 and rep["at_step"] == 3
    assert rep["reloads"] == _only_copies(placement, 1) == 2  # expert 3 in each layer
    f = rep["failover"]
    assert f["lost"] == [1] and f["survivors"] == [0, 2, 3]
    assert sum(f["loaded_slots_per_rank"].values()) == rep["reloads"]  # nothing but the reloads moved
    after = np.array(f["map_after"])
    assert after.shape == (2, 9) and all(sorted(set(row)) == list(range(E)) for row in after.tolist())
    before = np.array(f["map_before"]).reshape(2, 4, 3)[:, [0, 2, 3]].reshape(2, 9)
    assert int((before != after).sum()) == rep["reloads"]  # the survivors kept their slots
    assert rep["weights_match"] and rep["leaked_kv_bytes"] == 0 and rep["tokens_match"] is True


def test_kill_rank_restarts_its_requests_on_the_survivors():
    from runtime_hooks.pd.rank_loss import RankLossSpec, serve_rank_loss

    placement = contiguous_placement(2, E, 4, 4)
    spec = RankLossSpec(
        tiny_mixtral(2),
        placement,
        kill_rank=1,
        at_step=3,
        on_rank_loss="restart",
        new_tokens=6,
        liveness_timeout=2.0,
        seed=1,
    )
    rep = serve_rank_loss(spec, timeout=240).to_dict()
    _check_kill(rep, placement)
    for r in rep["requests"]:
        assert r["tokens"] == r["reference"] and r["tokens_match"] is True
        assert r["status"] == ("restarted" if r["rank"] == 1 else "completed")
        assert r["served_by"] == r["rank"] if r["rank"] != 1 else r["served_by"] in (0, 2, 3)


def test_kill_rank_fails_its_requests_via_the_cli(tmp_path, capsys):
    from moe_placement.cli.main import main

    cfg = tmp_path / "config.json"
    cfg.write_text(tiny_mixtral(2).to_json_string())
    flags = "serve-demo --ranks 4 --kill-rank 1 --at-step 3 --on-rank-loss fail --new-tokens 6 --liveness-timeout 2"
    argv = [*flags.split(), "--seed", "1", "--json", "--model", str(cfg)]
    assert main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    _check_kill(rep, contiguous_placement(2, E, 4, 4))
    for r in rep["requests"]:
        if r["rank"] == 1:
            assert r["status"] == "failed" and r["tokens"] is None and r["tokens_match"] is None
        else:
            assert r["status"] == "completed" and r["tokens_match"] is True and r["tokens"] == r["reference"]
