"""advise's decode whole-step gain on real held-back traffic against an independent calculation from the
same trace and the same cost constants (hardware preset fields, model sizes), written here without the
cost model's code: per step and layer, each GPU's picks and distinct active experts, its grouped GEMM
as max(FLOPs / effective peak, bytes / effective HBM) + launch floor, and the low-latency dispatch and
combine as latency + the busiest GPU's NVLink or RDMA bytes over that link's bandwidth.

The steps are the shared definition (``placement.steps.make_steps``, itself checked against an
independent loop in tests/test_steps.py); the part of the step that does not depend on the placement
(attention, dense and shared parts, LM head) is taken from advise's own figures."""

from __future__ import annotations

import numpy as np
import pytest

from apps.advise import AdviseOptions, advise
from placement.cost.hardware import cluster_preset
from placement.cost.modelspec import load_model
from placement.steps import make_steps
from profiling.readers import read_trace

TRACE = "deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz"
PUBLISHED_DECODE = (0.0, 0.08)  # load-aware decode gains published: a few % (issue 33: +2.6..7%)


def _moe_ms(placement, held, steps, model, cluster) -> float:
    """Mean modelled MoE milliseconds per decode step, one replica per expert (no choice of replica)."""
    G, m = placement.topology.ep_size, cluster.gpus_per_node
    gpu_of = np.asarray(placement.physical_to_logical_map)  # [L, P]
    S_per_gpu = gpu_of.shape[1] // G
    gpu = cluster.gpu
    d, f = model.hidden_size, model.moe_intermediate_size
    peak = (gpu.flops_fp8 if model.weight_bytes <= 1 else gpu.flops_bf16) * gpu.eta_compute
    hbm = gpu.hbm_bandwidth * gpu.eta_memory
    act = model.dispatch_bytes_per_token + 2 * d + 4 * f
    nvl_bw, nvl_lat = cluster.intra.bandwidth, cluster.intra.latency
    rdma_bw, rdma_lat = cluster.inter.bandwidth, cluster.inter.latency
    alpha = rdma_lat if G > m else nvl_lat
    ids = np.asarray(held.topk_ids)[steps.token]  # [N, L, k]
    total = 0.0
    for layer in range(ids.shape[1]):
        home = np.empty(model.num_logical_experts, dtype=np.int64)
        for slot, e in enumerate(gpu_of[layer]):
            home[e] = slot // S_per_gpu  # the one GPU holding expert e
        for s in range(steps.num_steps):
            rows = steps.step == s
            picks = ids[rows, layer, :]  # [n, k]
            src = np.repeat(steps.rank[rows], picks.shape[1])
            dst = home[picks.ravel()]
            n = np.bincount(dst, minlength=G).astype(float)
            active = np.array([len(set(picks.ravel()[dst == g].tolist())) for g in range(G)], dtype=float)
            gemm = (
                np.maximum(6.0 * d * f * n / peak, (active * model.expert_bytes + n * act) / hbm)
                + gpu.gemm_overhead
            )
            same = (src // m) == (dst // m)
            nvl = same & (src != dst)
            busiest = []
            for payload in (model.dispatch_bytes_per_token, model.combine_bytes_per_token):
                link = np.zeros((G, 2))
                for sel, col in ((nvl, 0), (~same, 1)):
                    link[:, col] = (
                        np.maximum(np.bincount(src[sel], minlength=G), np.bincount(dst[sel], minlength=G))
                        * payload
                    )
                busiest.append(alpha + np.maximum(link[:, 0] / nvl_bw, link[:, 1] / rdma_bw).max())
            total += gemm.max() + sum(busiest)
    per_layer_step = total / (ids.shape[1] * steps.num_steps)
    return per_layer_step * model.num_moe_layers * 1e3


def test_decode_whole_step_gain_matches_an_independent_calculation(traces_dir):
    path = traces_dir / TRACE
    if not path.is_file():
        pytest.skip(f"shared trace {TRACE} not found (set MOE_TRACES_DIR to the shared traces folder)")
    trace = read_trace(path)
    opts = AdviseOptions.quick_form("vllm", 1, gpus_per_node=8, decode_batch=16, prefill_chunk=256)
    adv = advise(trace, "auto", "h200", opts)
    model, cluster = load_model("deepseek-v2-lite"), cluster_preset("h200", gpus_per_node=8)
    base = adv.row(adv.baseline)
    row = next(r for r in adv.rows if r.kind == "engine EPLB" and r.redundant_per_gpu == 0)
    steps = make_steps(adv.held_out, 8, "decode", 16)
    assert row.decode.num_steps == steps.num_steps >= 20
    rest = base.decode.whole_ms - base.decode.moe_ms - base.decode.dispatch_overhead_ms
    mine = {r.key: _moe_ms(adv.placement_of(r), adv.held_out, steps, model, cluster) for r in (base, row)}
    assert mine[base.key] == pytest.approx(base.decode.moe_ms, rel=0.05)
    independent = (mine[base.key] + rest) / (mine[row.key] + rest) - 1
    got = adv.to_dict()["options"][adv.rows.index(row)]["phases"]["decode"]["whole_step_gain"]
    assert abs(got - independent) < 0.02, (got, independent)
    assert PUBLISHED_DECODE[0] < got < PUBLISHED_DECODE[1], got
