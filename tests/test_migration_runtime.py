"""Runtime migration on a real 4-rank gloo world: planned slots only, atomic commit, safe abort.

One launched world runs the whole story (launching costs more than the checks):
serve -> migrate (commit) -> injected raise mid-move (abort) -> stalled rank (abort on timeout)
-> a slot staged corrupted (abort on its checksum)
-> retry (commit), checking outputs, weights, token counts and staging buffers after every step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from placement.metrics import moved_slots, route_tokens, routed_gpu_tokens
from placement.topology import Topology
from runtime_hooks.ep_layer import EPMoELayer, ExpertWeights, reference_moe, replay_weights, tensor_checksum
from runtime_hooks.launcher import launch
from runtime_hooks.migration_core import (
    FaultSpec,
    checksum,
    live_staging_buffers,
    pack_slot,
    plan_migration,
    slot_bytes,
    unpack_slot,
)
from solver.greedy import greedy_placement

T_RANK = 16


def _step(layer, ids_all, weights, rank, seed):
    """One step on this rank's tokens; returns (max |y - ref|, picks computed, checksums ok)."""
    lo, hi = rank * T_RANK, (rank + 1) * T_RANK
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ids_all.shape[0], weights.hidden, generator=g)[lo:hi]
    ids = torch.as_tensor(ids_all[lo:hi])
    tok = torch.arange(lo, hi)
    wts = replay_weights(ids, seed, token_index=tok, num_experts=weights.num_experts)
    y = layer(x, ids, wts, tok)
    err = float((y - reference_moe(x, ids, wts, weights)).abs().max())
    sums_ok = all(
        c == tensor_checksum(weights.w1[e]) + tensor_checksum(weights.w2[e])
        for c, e in zip(layer.slot_checksums(), layer.local_experts.tolist())
    )
    return err, layer.last_tokens_processed, sums_ok


def _story(rank, world_size, a, b, ids_all):
    weights = ExpertWeights.random(a.num_logical_experts, 16, 8, seed=5)
    layer = EPMoELayer(a, 0, weights, dispatch="local")
    log = {"start": _step(layer, ids_all, weights, rank, 1)}
    res = layer.migrate_to(b, timeout=10.0)
    log["commit"] = (
        res,
        layer.placement == b,
        _step(layer, ids_all, weights, rank, 2),
        live_staging_buffers(),
    )
    res = layer.migrate_to(a, timeout=3.0, fault=FaultSpec(rank=1, mode="raise"))
    log["raise"] = (
        res,
        layer.placement == b,
        _step(layer, ids_all, weights, rank, 3),
        live_staging_buffers(),
    )
    res = layer.migrate_to(a, timeout=2.0, fault=FaultSpec(rank=3, mode="stall", stall_s=3.0))
    log["stall"] = (
        res,
        layer.placement == b,
        _step(layer, ids_all, weights, rank, 4),
        live_staging_buffers(),
    )
    res = layer.migrate_to(a, timeout=10.0, fault=FaultSpec(rank=2, mode="corrupt"))
    log["corrupt"] = (
        res,
        layer.placement == b,
        _step(layer, ids_all, weights, rank, 6),
        live_staging_buffers(),
    )
    res = layer.migrate_to(a, timeout=10.0)
    log["retry"] = (
        res,
        layer.placement == a,
        _step(layer, ids_all, weights, rank, 5),
        live_staging_buffers(),
    )
    return log


def _predicted(pl, ids_all):
    src = np.arange(ids_all.shape[0]) // T_RANK
    return routed_gpu_tokens(pl, route_tokens(pl, ids_all[:, None, :], src, "local"))[0]  # [G]


def test_plan_moves_only_changed_slots_from_old_holders(deepseek_trace):
    tr = deepseek_trace.select_layers([3, 20])
    topo = Topology.from_redundant(64, 16, 8, 2)
    a = greedy_placement(tr.slice_tokens(0, 40000).counts(), topo, layer_ids=tr.layer_ids)[0]
    b = greedy_placement(tr.slice_tokens(100000, 140000).counts(), topo, layer_ids=tr.layer_ids)[0]
    moves = plan_migration(a, b)
    assert len(moves) == moved_slots(a, b) > 0
    for m in moves:
        assert (
            a.physical_to_logical_map[m.layer, m.src_slot]
            == m.expert
            == b.physical_to_logical_map[m.layer, m.slot]
        )
        assert a.physical_to_logical_map[m.layer, m.slot] != m.expert
        old_gpus = topo.gpu_of_slot[a.physical_to_logical_map[m.layer] == m.expert]
        if m.dst_rank in old_gpus:  # a copy on the same rank is always preferred
            assert m.src_rank == m.dst_rank
        elif np.any(topo.node_of_gpu[old_gpus] == topo.node_of_gpu[m.dst_rank]):  # then the same node
            assert topo.node_of_gpu[m.src_rank] == topo.node_of_gpu[m.dst_rank]
    assert plan_migration(a, a) == []
    with pytest.raises(ValueError, match="rows"):
        plan_migration(a, b.select_layers([0]))


def test_migration_commit_abort_and_retry_on_four_ranks(deepseek_trace):
    tr = deepseek_trace.select_layers([7])
    topo = Topology.from_redundant(64, 16, 4, 2)
    a = greedy_placement(tr.slice_tokens(0, 30000).counts(), topo, layer_ids=tr.layer_ids)[0]
    b = greedy_placement(tr.slice_tokens(120000, 150000).counts(), topo, layer_ids=tr.layer_ids)[0]
    planned = moved_slots(a, b)
    assert planned > 8
    moves = plan_migration(a, b)
    assert any(m.src_rank == 1 and m.dst_rank != 1 for m in moves)  # the faulty rank really sends
    assert any(m.dst_rank == 2 for m in plan_migration(b, a))  # the corrupting rank really stages
    ids_all = np.asarray(tr.topk_ids[50000 : 50000 + 4 * T_RANK, 0, :], dtype=np.int64)  # [64, 6]
    logs = launch(_story, 4, args=(a, b, ids_all), timeout=120)
    pa, pb = _predicted(a, ids_all), _predicted(b, ids_all)
    assert not np.array_equal(pa, pb)
    for rank, log in enumerate(logs):
        err, picks, ok = log["start"]
        assert err < 1e-4 and ok and picks == pa[rank]
        res, on_b, (err, picks, ok), live = log["commit"]
        assert res.committed and on_b and res.moved_slots == planned
        assert res.moved_bytes == planned * (2 * 8 * 16 + 16 * 8) * 4
        assert 0 < res.network_bytes <= res.moved_bytes
        assert err < 1e-4 and ok and picks == pb[rank] and live == 0
        for stage in ("raise", "stall"):  # aborted everywhere; the old (= b) placement still serves
            res, on_b, (err, picks, ok), live = log[stage]
            assert not res.committed and res.reason.startswith("abort"), (stage, res)
            assert on_b and err < 1e-4 and ok and picks == pb[rank], stage
            assert live == 0, f"{stage}: {live} staging tensors leaked on rank {rank}"
        assert "injected fault on rank 1" in log["raise"][0].reason
        res, on_b, (err, picks, ok), live = log["corrupt"]  # a slot staged corrupted: abort everywhere
        assert not res.committed and "checksum mismatch" in res.reason and "rank 2" in res.reason
        assert on_b and err < 1e-4 and ok and picks == pb[rank] and live == 0
        res, on_a, (err, picks, ok), live = log["retry"]
        assert res.committed and on_a and res.moved_slots == planned
        assert err < 1e-4 and ok and picks == pa[rank] and live == 0
    # every rank reached the same decision each time
    for stage in ("commit", "raise", "stall", "corrupt", "retry"):
        assert len({log[stage][0].reason for log in logs}) == 1


def test_packed_slot_round_trip_and_checksum():
    tensors = (torch.randn(3, 4, 5), torch.randn(3, 5))  # [S, 4, 5] and [S, 5]: one slot = 25 values
    buf = pack_slot(tensors, 1)  # [25]
    assert buf.shape == (25,) and slot_bytes(tensors) == 25 * 4
    target = tuple(torch.zeros_like(t) for t in tensors)
    unpack_slot(target, 2, buf)
    assert torch.equal(target[0][2], tensors[0][1]) and torch.equal(target[1][2], tensors[1][1])
    assert not target[0][:2].any() and not target[1][:2].any()  # other slots untouched
    changed, swapped = buf.clone(), buf.clone()
    changed[7] += 1
    swapped[[3, 4]] = buf[[4, 3]]
    assert torch.equal(checksum(buf), checksum(pack_slot(target, 2)))
    assert not torch.equal(checksum(changed), checksum(buf))
    assert not torch.equal(checksum(swapped), checksum(buf))
