"""Live online rebalancing on a real 4-rank gloo world.

Two MoE layers (8 experts, 4 redundant slots, 4 ranks) serve replayed routing: 30 steps drawn from one
expert popularity (domain A, the placement was fitted on it), then 40 steps from the reversed popularity
(domain B: the hot experts become cold). Every step each rank counts its own picks, the counts are
all-reduced (what the counting hook plus an all-reduce give a server), and rank 0 feeds them to the
:class:`Rebalancer` (gain trigger, cost model with a modelled 44 MB expert over NVLink). The re-solve
runs on the rebalancer's worker thread; rank 0 waits for it at the step it was submitted (so the test
is deterministic), broadcasts the decision, and every rank applies it through the runtime's atomic
``migrate_to`` between the same two steps. Checked: no migration during domain A (noise only), a
committed migration after the switch, and every step's outputs equal the single-process reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from placement.model import Placement
from placement.topology import Topology
from solver.greedy import greedy_placement

E, L, G, RED, K, T_RANK = 8, 2, 4, 4, 2, 32
STEPS_A, STEPS_B = 30, 40


def _ids_stream(pop_a, pop_b, seed=0):
    """int64 ``[steps, G*T_RANK, L, K]``: top-K distinct experts per token (Gumbel top-k) per layer."""
    rng = np.random.default_rng(seed)
    out = []
    for pop, n in ((pop_a, STEPS_A), (pop_b, STEPS_B)):
        for _ in range(n):
            g = rng.gumbel(size=(G * T_RANK, L, E)) + np.log(pop)[None]  # [T, L, E]
            out.append(np.argsort(-g, axis=2)[:, :, :K])
    return np.stack(out).astype(np.int64)


def _serve(rank, world_size, p2l, ids_steps):
    import torch.distributed as dist

    from runtime_hooks.ep_layer import EPMoELayer, ExpertWeights, reference_moe, replay_weights

    topo = Topology.from_redundant(E, RED, G)
    placement = Placement(np.asarray(p2l), E, topo)
    weights = [ExpertWeights.random(E, 16, 8, seed=11 + l) for l in range(L)]
    layers = [EPMoELayer(placement, l, weights[l], dispatch="even", name=f"live{l}") for l in range(L)]
    reb = None
    if rank == 0:
        from runtime_hooks.rebalancer import Rebalancer, RebalancerConfig

        cfg = RebalancerConfig(
            window_size=16,
            step_interval=10**6,
            trigger="gain",
            check_interval=4,
            horizon_steps=3000,
            link="nvlink",
            num_redundant_experts=RED,
        )
        reb = Rebalancer(placement, cfg, expert_bytes=44e6)
    errs, migrations, solve_threads = [], [], []
    lo, hi = rank * T_RANK, (rank + 1) * T_RANK
    tok = torch.arange(lo, hi)
    for step, ids_all in enumerate(ids_steps):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(G * T_RANK, 16, generator=g)[lo:hi]  # [T_RANK, d]
        counts = torch.zeros(L, E, dtype=torch.int64)
        for l in range(L):
            ids = torch.as_tensor(ids_all[lo:hi, l, :])  # [T_RANK, K]
            wts = replay_weights(ids, 7 + step, token_index=tok, num_experts=E)
            y = layers[l](x, ids, wts, tok)
            errs.append(float((y - reference_moe(x, ids, wts, weights[l])).abs().max()))
            counts[l] = torch.bincount(ids.reshape(-1), minlength=E)  # this rank's picks
        dist.all_reduce(counts)  # [L, E] global counts of the step
        decision = [None]
        if reb is not None:
            reb.observe(counts.numpy())
            if reb.pending:
                new = reb.wait(timeout=60)  # the solve ran on the rebalancer's worker thread
                solve_threads.append(reb.history[-1].solve_thread)
                decision = [None if new is None else new.physical_to_logical_map.copy()]
        dist.broadcast_object_list(decision, src=0)
        if decision[0] is not None:
            new_pl = Placement(decision[0], E, topo)
            results = [layers[l].migrate_to(new_pl, layer=l, timeout=20.0) for l in range(L)]
            ok = all(r.committed for r in results)
            migrations.append((step, ok, sum(r.moved_slots for r in results)))
            if reb is not None and not ok:  # keep the rebalancer in sync with what the runtime serves
                reb.set_placement(
                    Placement(np.stack([ly.placement.physical_to_logical_map[0] for ly in layers]), E, topo)
                )
    final = np.stack([ly.placement.physical_to_logical_map[0] for ly in layers])
    if reb is not None:
        reb.close()
    return {"max_err": max(errs), "migrations": migrations, "final": final, "threads": solve_threads}


@pytest.mark.slow
def test_rebalancer_live_domain_switch():
    from runtime_hooks.launcher import launch

    rng = np.random.default_rng(3)
    pop_a = np.sort(rng.pareto(1.0, size=(L, E)) + 0.1, axis=1)[:, ::-1]  # expert 0 hottest
    pop_a = pop_a / pop_a.sum(axis=1, keepdims=True)
    pop_b = pop_a[:, ::-1].copy()  # domain switch: the cold experts become hot
    topo = Topology.from_redundant(E, RED, G)
    start, _ = greedy_placement(pop_a * 1e6, topo)
    ids_steps = _ids_stream(pop_a, pop_b)
    res = launch(_serve, G, args=(start.physical_to_logical_map, ids_steps), backend="gloo", timeout=240.0)
    for r in res:
        assert r["max_err"] < 1e-4  # outputs equal the single-process reference on every step
        assert r["migrations"] == res[0]["migrations"]  # every rank applied the same moves at the same step
        assert np.array_equal(r["final"], res[0]["final"])
    migs = res[0]["migrations"]
    assert migs, "the domain switch was not detected"
    assert all(step >= STEPS_A for step, _, _ in migs)  # nothing moved on domain-A noise
    assert all(ok for _, ok, _ in migs) and sum(n for _, _, n in migs) > 0
    assert not np.array_equal(res[0]["final"], start.physical_to_logical_map)
    assert all(t.startswith("moe-rebalancer") for t in res[0]["threads"])
