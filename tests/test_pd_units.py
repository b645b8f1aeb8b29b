"""The pieces of disaggregated serving and rank-loss failover that run in one process: the failover map,
per-request KV caches under continuous batching, the request manager over a real TCPStore, and the
serve-demo flags refused before any rank starts."""

from __future__ import annotations

import dataclasses
import datetime

import numpy as np
import pytest
from tiny_models import tiny_mixtral

from placement.model import Placement
from runtime_hooks.pd.failover_map import failover_map

E = 8


# ---------------------------------------------------------------------------------------------------
# The failover map
# ---------------------------------------------------------------------------------------------------
def _four_ranks() -> Placement:
    """Rank g holds experts 2g, 2g+1 and a replica of 2g+2: ``[2, 12]``."""
    row = [e for g in range(4) for e in (2 * g, 2 * g + 1, (2 * g + 2) % E)]
    return Placement.from_map(np.array([row, row]), E, ep_size=4, num_nodes=2)


def test_failover_map_reloads_only_experts_without_a_surviving_copy():
    old = _four_ranks()
    new, reloads = failover_map(old, [1])
    S = 3
    assert new.topology.ep_size == 3 and new.topology.slots_per_gpu == S
    before = old.physical_to_logical_map.reshape(2, 4, S)[:, [0, 2, 3]]  # [L, 3, S] the survivors' slots
    after = new.physical_to_logical_map.reshape(2, 3, S)
    changed = np.argwhere(before != after)
    # rank 1 held 2, 3 and a replica of 4: expert 3 had its only copy there (2 is on rank 0, 4 on rank 2)
    assert reloads == 2 and len(changed) == 2
    assert all(int(after[l, g, s]) == 3 for l, g, s in changed)
    for l, g, s in changed:
        overwritten = int(before[l, g, s])
        assert (before[l] == overwritten).sum() >= 2  # a surplus replica, never a last copy
    assert all(set(new.physical_to_logical_map[l]) == set(range(E)) for l in range(2))
    assert new.provenance["solver"] == "failover" and new.provenance["lost_gpus"] == [1]
    assert new.topology.num_nodes == 1  # 1 GPU left on node 0, 2 on node 1: no longer even


def test_failover_map_overwrites_a_surplus_replica_on_a_lightly_loaded_survivor():
    """Rank 3 lost with expert 7's only copy (2 and 3 keep a copy elsewhere). Under the runtime's load
    (experts 0 and 1 hot, on rank 0 twice), expert 7 lands over a replica of an expert that keeps
    another copy, on a survivor other than the hottest; too few surviving slots are refused."""
    m = np.array([[0, 1, 2, 3, 4, 0, 5, 6, 1, 7, 2, 3]])
    load = np.array([[5.0, 5.0, 1, 1, 1, 1, 1, 1]])
    new, reloads = failover_map(Placement.from_map(m, E, ep_size=4), [3], load)
    after, before = new.physical_to_logical_map[0], m[0, :9]
    changed = np.nonzero(after != before)[0]
    assert reloads == 1 and len(changed) == 1 and after[changed[0]] == 7
    assert (before == before[changed[0]]).sum() >= 2  # a surplus replica, never a last copy
    assert set(after.tolist()) == set(range(E))
    thin = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0]])  # rank 2 lost: 6 slots left for 8 experts
    with pytest.raises(ValueError, match="fewer than the 8 experts"):
        failover_map(Placement.from_map(thin, E, ep_size=3), [2])


def test_failover_map_refuses_bad_ranks():
    for lost in ([], [4], [-1], [0, 1, 2, 3]):
        with pytest.raises(ValueError, match="lost ranks|no rank"):
            failover_map(_four_ranks(), lost)


# ---------------------------------------------------------------------------------------------------
# Per-request caches
# ---------------------------------------------------------------------------------------------------
def _mixtral(layers: int = 3):
    pytest.importorskip("transformers")
    return tiny_mixtral(layers, E)


def test_continuous_batching_equals_each_request_alone():
    """Prompts of different lengths prefilled in one padded batch, decoded with requests joining two steps
    later: every request's tokens equal its greedy decode alone; the caches are freed to 0 bytes."""
    from runtime_hooks.hf_validate import load_model
    from runtime_hooks.pd import kv

    model = load_model(_mixtral(), 3, "float32")
    prompts = kv.make_prompts(3, [5, 9, 6, 7], 64)
    ref = kv.reference_tokens(model, prompts, 7)
    layers = []
    caches, first = kv.prefill(model, prompts[:2], on_layer=lambda l, k, v: layers.append((l, k.shape[2])))
    assert layers == [(0, 9), (1, 9), (2, 9)]  # each layer, as soon as it cached the padded batch
    reqs = [{"kv": c, "out": [t]} for c, t in zip(caches, first)]

    def step():
        run = [r for r in reqs if len(r["out"]) < 7]
        for r, t in zip(run, kv.decode_step(model, [r["kv"] for r in run], [r["out"][-1] for r in run])):
            r["out"].append(t)

    step(), step()
    later, first = kv.prefill(model, prompts[2:])
    reqs += [{"kv": c, "out": [t]} for c, t in zip(later, first)]
    while any(len(r["out"]) < 7 for r in reqs):
        step()
    assert [r["out"] for r in reqs] == ref
    assert reqs[0]["kv"].length == 5 + 6 and kv.kv_layout(model, reqs[0]["kv"]).bytes_per_token_layer() == 128
    assert kv.live_kv_bytes() == sum(r["kv"].nbytes for r in reqs) > 0
    for r in reqs:
        r["kv"].free()
    assert kv.live_kv_bytes() == 0


def test_formula_is_the_cost_models():
    """The runtime compares its bytes with ModelSpec.kv_bytes_per_token_layer of the same HF config at the
    runtime's dtype: 2 (keys, values) x 2 KV heads x 8 dims x 4 B in fp32."""
    from placement.cost.modelspec import model_from_hf_config
    from runtime_hooks.pd.report import kv_formula

    cfg = _mixtral()
    spec = model_from_hf_config(cfg.to_dict())
    assert (
        kv_formula(cfg, "float32") == dataclasses.replace(spec, kv_cache_bytes=4.0).kv_bytes_per_token_layer
    )
    assert kv_formula(cfg, "float32") == 2 * 2 * 8 * 4 and kv_formula(cfg, "bfloat16") == 2 * 2 * 8 * 2


# ---------------------------------------------------------------------------------------------------
# The request manager (a real TCPStore)
# ---------------------------------------------------------------------------------------------------
@pytest.fixture()
def store():
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False
    )


def _verdict(store, hid: str, state: str, reason: str = "") -> None:
    from runtime_hooks.pd.handoff import decide

    decide(store, hid, {"state": state, "by": "decode", "reason": reason, "t": 0.0})


def _done(store, hid: str) -> None:
    import json

    store.set(f"pd/r/{hid}/done", json.dumps({"hid": hid, "tokens": [7, 7], "t_commit": 0.0, "t_done": 0.0}))


@pytest.mark.parametrize("rule", ["fail", "retry"])
def test_manager_fails_or_retries_from_the_prompt(store, rule):
    from runtime_hooks.pd.manager import Manager

    retry = rule == "retry"
    m = Manager(store, 3, prefill=[0, 1], decode=[2, 3], on_failure=rule, max_attempts=3)
    plan, stop = m.plan()
    assert plan == [(0, 0, 2), (1, 0, 3)] and not stop
    assert m.plan()[0] == [None, None]  # one hand-off per decode rank at a time: both still receiving
    _verdict(store, "0.0", "aborted", "checksum mismatch on layer 1")
    _verdict(store, "1.0", "committed")
    plan, _ = m.plan()
    # the queue in order: request 2 to the least-loaded decode rank (3 decodes request 1), then the
    # retry of request 0, a new attempt from its prompt, to the one decode rank not receiving
    assert plan == [(2, 0, 2), (0, 1, 3) if retry else None]
    assert m.reqs[0].attempts[0]["reason"] == "checksum mismatch on layer 1"
    assert m.reqs[0].status == ("handoff" if retry else "failed")
    _verdict(store, "2.0", "committed")
    if retry:
        _verdict(store, "0.1", "aborted", "no verdict from decode rank 3 by the deadline")
    store.set("pd/decode/lost", "[3]")  # decode rank 3 lost, request 1 decoding on it
    plan, _ = m.plan()
    assert "decode rank 3 was lost" in m.reqs[1].reason
    assert m.reqs[1].status == ("queued" if retry else "failed")
    assert plan == [(0, 2, 2) if retry else None, None]  # only rank 2 is left, and it receives one
    if retry:
        _verdict(store, "0.2", "committed")
        _done(store, "0.2")
        assert m.plan()[0] == [(1, 1, 2), None]
        _verdict(store, "1.1", "committed")
        _done(store, "1.1")
    _done(store, "2.0")
    plan, stop = m.plan()
    assert stop and store.check(["pd/stop"]) and plan == [None, None]
    want = ["completed"] * 3 if retry else ["failed", "failed", "completed"]
    assert [r.status for r in m.reqs] == want
    assert [len(r.attempts) for r in m.reqs] == ([3, 2, 1] if retry else [1, 1, 1])
    # the output kept is the finishing attempt's, delivered whole (it outlives the decode rank)
    assert [r.output and r.output["hid"] for r in m.reqs] == (
        ["0.2", "1.1", "2.0"] if retry else [None, None, "2.0"]
    )


def test_manager_fails_everything_left_when_no_decode_rank_is_left(store):
    from runtime_hooks.pd.manager import Manager

    m = Manager(store, 2, prefill=[0], decode=[1], on_failure="retry", max_attempts=3)
    store.set("pd/decode/lost", "[1]")
    plan, stop = m.plan()
    assert plan == [None] and stop
    assert {r.reason for r in m.reqs} == {"no decode rank is left"}


# ---------------------------------------------------------------------------------------------------
# serve-demo flags refused before any rank starts
# ---------------------------------------------------------------------------------------------------
def test_serve_demo_modes_refuse_bad_flags_in_one_line(tmp_path, capsys):
    from moe_placement.cli.main import main
    from placement.formats import write_placement

    cfg = tmp_path / "config.json"
    cfg.write_text(_mixtral(2).to_json_string())
    thin = tmp_path / "thin.json"  # 2 decode ranks x 4 slots: losing one loses 4 experts
    write_placement(Placement.from_map(np.tile(np.arange(E), (2, 1)), E, ep_size=2), thin, "native")
    base = ["serve-demo", "--model", str(cfg)]
    pd = [*base, "--disaggregated"]
    cases = (
        (["--prefill-ranks", "2"], "--prefill-ranks belongs to disaggregated serving: add --disaggregated"),
        (["--disaggregated", "--ranks", "4"], "--ranks does not apply with --disaggregated"),
        (["--disaggregated", "--kill-rank", "1"], "--kill-rank does not apply with --disaggregated"),
        (["--kill-rank", "1"], "--kill-rank R and --at-step S go together"),
        (["--kill-rank", "1", "--at-step", "0"], "--at-step 0 is outside the run's steps 1..16"),
        (["--kill-rank", "7", "--at-step", "2"], "--kill-rank 7 is not one of the ranks 0..3"),
        (["--kill-rank", "-1", "--at-step", "2"], "--kill-rank must be >= 0"),
        (
            ["--kill-rank", "1", "--at-step", "2", "--rebalance-every", "2"],
            "--rebalance-every does not apply",
        ),
        (
            ["--kill-rank", "1", "--at-step", "2", "--redundant", "0"],
            "rank 1 cannot be lost on this placement",
        ),
        (["--liveness-timeout", "2"], "--liveness-timeout applies with --disaggregated or --kill-rank"),
    )
    for extra, needle in cases:
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, (extra, err)
    pd_cases = (
        (["--handoff-timeout", "0"], "--handoff-timeout must be a finite number > 0"),
        (
            ["--requests", "2", "--inject-fault", "corrupt-chunk", "--inject-fault", "slow-transfer"],
            "--requests 3",
        ),
        (["--decode-ranks", "3", "--decode-placement", str(thin)], "--decode-ranks 3 differs"),
        (["--decode-placement", str(thin), "--inject-fault", "decode-dies"], "cannot lose decode rank 0"),
        (["--decode-ranks", "1", "--inject-fault", "decode-dies"], "needs --decode-ranks 2 or more"),
        (["--inject-fault", "bit-flip"], "invalid choice: 'bit-flip'"),
    )
    for extra, needle in pd_cases:
        assert main([*pd, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert needle in err, (extra, err)


# ---------------------------------------------------------------------------------------------------
# The launcher: a rank killed on purpose is lost, not failed
# ---------------------------------------------------------------------------------------------------
def _exit_on_rank_one(rank, world_size):
    import os

    from runtime_hooks.launcher import LOST_RANK_EXIT_CODE

    if rank == 1:
        os._exit(LOST_RANK_EXIT_CODE)
    return rank


def test_launcher_takes_a_rank_killed_on_purpose_as_lost_only_when_told():
    import multiprocessing

    from moe_placement.base.errors import WorkerError
    from runtime_hooks.launcher import launch

    assert launch(_exit_on_rank_one, 2, timeout=60, lost_ok=True) == [0, None]
    with pytest.raises(WorkerError, match="exited with code 86 without reporting"):
        launch(_exit_on_rank_one, 2, timeout=60, grace=1.0)
    assert multiprocessing.active_children() == []
