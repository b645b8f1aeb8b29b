"""Cost-model tests: hand-computed regimes, node-deduplicated bytes, overlap, memory, config.json
reading, and validation against published DeepEP / DeepGEMM figures (sources next to each figure)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from moe_placement.apps.planner.costmodel import CostOptions, memory_per_gpu, step_cost
from placement.cost.hardware import GPUS, LINKS, cluster_preset
from placement.cost.modelspec import load_model, model_from_hf_config
from placement.cost.primitives import a2a_time, gemm_time
from placement.cost.traffic import StepArrays, counted_loads, expected_loads, payload_bytes
from placement.model import Placement
from placement.topology import Topology


def _published_tables():
    """The published DeepEP / DeepGEMM figures, written once in benchmarks/step_model_check.py."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "step_model_check.py"
    spec = importlib.util.spec_from_file_location("step_model_check_tables", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_PUBLISHED = _published_tables()

DSV3 = load_model("deepseek-v3")


DISPATCH_BYTES, COMBINE_BYTES = payload_bytes(DSV3.hidden_size)


def _uniform_workload(ep, mode, tokens, E=256, k=8, m=8):
    nodes = max(ep // m, 1)
    pl = Placement.trivial(1, E, Topology(ep, E, nodes))
    return pl, expected_loads(pl, np.ones((1, E)), k, tokens, mode), nodes


def _a2a_us(cluster, loads, nodes, ep, payload):
    busiest = np.maximum(loads.send, loads.recv) * payload  # [S, L, G, 2]
    t = a2a_time(cluster, busiest[..., 0], busiest[..., 1], nodes, ep, loads.kernel)
    return float(t.max()) * 1e6


# ---------------------------------------------------------------------------------------------
# hand-computed cases
# ---------------------------------------------------------------------------------------------
def test_expert_bytes_and_slot_cost_match_costmodel_doc():
    assert DSV3.expert_bytes == 44_040_192  # 3 * 7168 * 2048 bytes in FP8
    assert DSV3.num_moe_layers == 58 and DSV3.moe_layer_ids[0] == 3
    assert DSV3.dispatch_bytes_per_token == DISPATCH_BYTES == 7168 + 7168 / 128 * 4 == 7392
    assert DSV3.combine_bytes_per_token == COMBINE_BYTES == 14336


def test_gemm_memory_bound_and_compute_bound_regimes():
    gpu = GPUS["h800"]
    d, f = 7168, 2048
    W = 3 * d * f  # one FP8 expert
    bw = 3.35e12 * 0.88
    peak = 1979e12 * 0.54
    # 16 tokens: weight read dominates
    t_small = float(gemm_time(gpu, 6 * d * f * 16, W, 1.0))
    assert t_small == pytest.approx(W / bw + 3e-6, rel=1e-9)
    assert 6 * d * f * 16 / peak < W / bw
    # 4096 tokens: FLOPs dominate
    t_big = float(gemm_time(gpu, 6 * d * f * 4096, W, 1.0))
    assert t_big == pytest.approx(6 * d * f * 4096 / peak + 3e-6, rel=1e-9)
    # knee ~180 tokens/expert on H100 and ~125 on H200 (costmodel.md)
    assert GPUS["h100"].knee_tokens_per_expert(1.0) == pytest.approx(180, rel=0.05)
    assert GPUS["h200"].knee_tokens_per_expert(1.0) == pytest.approx(125, rel=0.05)


def test_active_experts_follow_poisson_expectation_at_tiny_batch():
    """1 token per rank on 8 ranks, k=8, 256 experts: 0.25 expected tokens per expert."""
    _, wl0, _ = _uniform_workload(8, "low_latency", 1)
    a = wl0.active_experts().sum()
    assert a == pytest.approx(256 * (1 - np.exp(-0.25)), rel=1e-6)
    _, wl1, _ = _uniform_workload(32, "low_latency", 512)
    assert wl1.active_experts().sum() == pytest.approx(256, rel=1e-3)
    # a half batch (two-batch overlap) activates fewer experts per half, but more than half as many
    half = wl0.active_experts(0.5).sum()
    assert a / 2 < half < a


def test_node_dedup_counts_one_rdma_copy_per_remote_node():
    """2 nodes x 2 GPUs, one expert per GPU; every token picks experts 2 and 3 (both on node 1)."""
    topo = Topology(4, 4, 2)
    pl = Placement(np.array([[0, 1, 2, 3]]), 4, topo)
    b = 8
    ids = np.tile(np.array([[[2, 3]]], dtype=np.int16), (4 * b, 1, 1))  # [T, L=1, k=2]
    one_step = StepArrays(ids, np.zeros(4 * b, np.int64), np.arange(4 * b) // b, 1, b, "decode")
    normal = counted_loads(pl, one_step, "even", 2, "normal")
    ll = counted_loads(pl, one_step, "even", 2, "low_latency")
    # ranks 0 and 1 (node 0) send each token once over RDMA (dedup), low-latency sends two copies
    assert normal.send[0, 0, 0, 1] == b
    assert ll.send[0, 0, 0, 1] == 2 * b
    # analytic expectation: independent picks, P(node hit) = 1 - (1/2)^2 = 0.75 per node, sent once by
    # each rank of node 0 and landing on the same-index GPU of node 1
    wl = expected_loads(pl, np.ones((1, 4)), 2, b, "normal")
    assert wl.send[0, 0, 0, 1] == pytest.approx(b * 0.75)
    assert wl.recv[0, 0, 2, 1] == pytest.approx(b * 0.75)  # GPU 2 lands what GPU 0 sends


def test_expected_loads_are_the_counted_traffic_of_the_expected_picks():
    """One traffic model: the analytic loads are traffic_bytes of the expected picks (even split over
    replicas), so on uniform routing they equal the counts of a step whose every rank picks each
    expert equally often."""
    topo = Topology(8, 16, 2)
    pl = Placement.trivial(1, 16, topo)
    b, k = 16, 2
    ids = np.array(
        [[[(2 * t) % 16, (2 * t + 1) % 16]] for t in range(b)], dtype=np.int16
    )  # each expert twice
    arrays = StepArrays(
        np.tile(ids, (8, 1, 1)), np.zeros(8 * b, np.int64), np.arange(8 * b) // b, 1, b, "decode"
    )
    for kernel in ("low_latency", "normal"):
        counted = counted_loads(pl, arrays, "even", k, kernel)
        expected = expected_loads(pl, np.ones((1, 16)), k, b, kernel)
        general = expected_loads(pl, np.ones((1, 16)), k, b, kernel, "local")  # every pair counted
        np.testing.assert_allclose(expected.slot_tokens, counted.slot_tokens)
        np.testing.assert_allclose(general.send, expected.send)  # one replica each: local == even
        np.testing.assert_allclose(general.recv, expected.recv)
        if kernel == "low_latency":  # per pick: counts and expectation agree exactly
            np.testing.assert_allclose(expected.send, counted.send)
            np.testing.assert_allclose(expected.recv, counted.recv)
    assert expected.expected and not counted.expected


@pytest.mark.parametrize("G,m", [(16, 8), (32, 8), (8, 8), (6, 2)])
def test_uniform_source_traffic_is_traffic_bytes_in_closed_form(G, m):
    """The planner's closed form (every source sends each GPU the same picks) is the traffic model's
    accounting: equal to traffic_bytes on the broadcast pairs, both kernels."""
    from placement.cost.traffic import traffic_bytes, uniform_source_traffic

    rng = np.random.default_rng(G)
    q = rng.gamma(1.0, 3.0, size=(3, G))  # [S, G] picks one source sends each GPU
    b, k = float(q.sum(axis=1).max() / 4 + 1), 4
    pair = np.broadcast_to(q[:, None, :], (3, G, G)).copy()
    for kernel in ("low_latency", "normal"):
        want = traffic_bytes(pair, np.full((3, G), b), m, k, kernel, 1.0)
        got = uniform_source_traffic(q, b, m, k, kernel)
        for w, g in zip(want, got):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-9)


def test_overlap_never_slower_and_pays_when_comm_and_compute_balance():
    cl = cluster_preset("h200")
    for ep, b in ((32, 128), (16, 8), (8, 1), (32, 512)):
        nodes = ep // 8
        pl = Placement.trivial(DSV3.num_moe_layers, 256, Topology(ep, 256, nodes))
        wl = expected_loads(pl, np.ones((DSV3.num_moe_layers, 256)), 8, b, "low_latency")
        off = step_cost(DSV3, cl, pl, wl, CostOptions(step_tokens=b, overlap="off"))
        auto = step_cost(DSV3, cl, pl, wl, CostOptions(step_tokens=b, overlap="auto"))
        assert auto.step_time <= off.step_time + 1e-12
    # at 128 tokens/rank over 4 nodes the two halves hide each other's communication
    pl = Placement.trivial(DSV3.num_moe_layers, 256, Topology(32, 256, 4))
    wl = expected_loads(pl, np.ones((DSV3.num_moe_layers, 256)), 8, 128, "low_latency")
    on = step_cost(DSV3, cl, pl, wl, CostOptions(step_tokens=128, overlap="on"))
    off = step_cost(DSV3, cl, pl, wl, CostOptions(step_tokens=128, overlap="off"))
    assert on.step_time < off.step_time
    # one token per rank: each half re-reads every weight, so auto keeps TBO off
    wl1 = expected_loads(pl, np.ones((DSV3.num_moe_layers, 256)), 8, 1, "low_latency")
    assert not step_cost(DSV3, cl, pl, wl1, CostOptions(step_tokens=1, overlap="auto")).layer.overlap_used


def test_memory_each_redundant_slot_costs_one_expert_per_moe_layer():
    gpu = GPUS["h200"]
    opts = CostOptions(step_tokens=16)
    m0 = memory_per_gpu(DSV3, gpu, 8, 256, opts)
    m1 = memory_per_gpu(DSV3, gpu, 8, 264, opts)  # one extra slot per GPU
    assert m0.expert - m1.expert == pytest.approx(-44_040_192 * 58)
    assert m1.redundant == pytest.approx(2.554e9, rel=1e-3)
    assert m0.kv_free - m1.kv_free == pytest.approx(44_040_192 * 58)


def test_too_many_redundant_slots_rejected_with_numbers():
    from moe_placement.apps.planner.layout import LayoutCandidate, evaluate_candidate

    cl = cluster_preset("h200")
    load = np.ones((DSV3.num_moe_layers, 256))
    opts = CostOptions(step_tokens=16, context_len=2048)
    ok = evaluate_candidate(DSV3, cl, LayoutCandidate(8, 1, 1, 0, 1), opts, load)
    assert ok.feasible
    # 44 slots/GPU: 44 x 2.55 GB = 112 GB of experts + 19 GB other weights + 14 GB reserve > 141 GB
    bad = evaluate_candidate(DSV3, cl, LayoutCandidate(8, 1, 1, 96, 1), opts, load)
    assert not bad.feasible and bad.placement is None
    assert "weights do not fit" in bad.reason and "141.0 GB HBM" in bad.reason
    # 40 slots/GPU fit the weights, but not 64 sequences of 4096 cached tokens
    kv = evaluate_candidate(DSV3, cl, LayoutCandidate(8, 1, 1, 64, 1), CostOptions(step_tokens=64), load)
    assert not kv.feasible and "KV cache does not fit" in kv.reason
    assert kv.memory.max_step_tokens < 64
    assert f"at most {kv.memory.max_step_tokens} sequences" in kv.reason
    assert f"{bad.memory.redundant / 1e9:.1f} GB redundant" in bad.reason
    assert bad.memory.kv_free < bad.memory.kv_needed


# ---------------------------------------------------------------------------------------------
# validation against published figures (model within 25% of each)
# ---------------------------------------------------------------------------------------------
# deepseek-ai/DeepEP low-latency kernels (H800 + CX7 400 Gb/s, 128 tokens per batch, hidden 7168,
# top-8, FP8 dispatch, BF16 combine): (EP, dispatch us, combine us), from the benchmark's table
DEEPEP_LOW_LATENCY = _PUBLISHED.DEEPEP_LOW_LATENCY


@pytest.mark.parametrize("ep,dispatch_us,combine_us", DEEPEP_LOW_LATENCY)
def test_deepep_low_latency_within_25_percent(ep, dispatch_us, combine_us):
    cl = cluster_preset("h800")
    _, wl, nodes = _uniform_workload(ep, "low_latency", 128)
    d = _a2a_us(cl, wl, nodes, ep, DISPATCH_BYTES)
    c = _a2a_us(cl, wl, nodes, ep, COMBINE_BYTES)
    assert abs(d / dispatch_us - 1) <= 0.25, (ep, d, dispatch_us)
    assert abs(c / combine_us - 1) <= 0.25, (ep, c, combine_us)


def test_costmodel_doc_check_ep32():
    """costmodel.md: EP32, 128 decode tokens/GPU, DeepEP measured 155 us dispatch, 273 us combine."""
    cl = cluster_preset("h800")
    _, wl, nodes = _uniform_workload(32, "low_latency", 128)
    assert abs(_a2a_us(cl, wl, nodes, 32, DISPATCH_BYTES) / 155 - 1) <= 0.25
    assert abs(_a2a_us(cl, wl, nodes, 32, COMBINE_BYTES) / 273 - 1) <= 0.25


DEEPEP_NORMAL = _PUBLISHED.DEEPEP_NORMAL  # (EP, tokens, dispatch GB/s, combine GB/s)


@pytest.mark.parametrize("ep,tokens,disp_gbs,comb_gbs", DEEPEP_NORMAL)
def test_deepep_normal_bandwidth_within_25_percent(ep, tokens, disp_gbs, comb_gbs):
    cl = cluster_preset("h800")
    _, wl, nodes = _uniform_workload(ep, "normal", tokens)
    nodes_hit = nodes * (1 - (1 - 1 / nodes) ** 8)  # distinct nodes per token incl. its own
    for payload, gbs in ((DISPATCH_BYTES, disp_gbs), (COMBINE_BYTES, comb_gbs)):
        t = _a2a_us(cl, wl, nodes, ep, payload) * 1e-6
        logical = tokens * nodes_hit * payload / t / 1e9
        assert abs(logical / gbs - 1) <= 0.25, (ep, payload, logical, gbs)


DEEPGEMM_GROUPED = _PUBLISHED.DEEPGEMM_GROUPED  # (groups, M per group, N, K, TFLOPS)


@pytest.mark.parametrize("groups,m,n,k,tflops", DEEPGEMM_GROUPED)
def test_deepgemm_grouped_gemm_within_25_percent(groups, m, n, k, tflops):
    flops = 2.0 * groups * m * n * k
    measured = flops / (tflops * 1e12)
    moved = groups * (n * k + m * k + 2 * m * n)  # FP8 weights and inputs, BF16 output
    model = float(gemm_time(GPUS["h800"], flops, moved, 1.0))
    assert abs(model / measured - 1) <= 0.25, (groups, m, n, k, model, measured)


# ---------------------------------------------------------------------------------------------
# model descriptions and config.json
# ---------------------------------------------------------------------------------------------
HF_CONFIGS = {
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "moe_intermediate_size": 2048,
        "intermediate_size": 18432,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "n_group": 8,
        "topk_group": 4,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    },
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2",
        "hidden_size": 2048,
        "moe_intermediate_size": 1408,
        "intermediate_size": 10944,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "num_hidden_layers": 27,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "vocab_size": 102400,
        "torch_dtype": "bfloat16",
    },
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "torch_dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "moe_intermediate_size": 768,
        "intermediate_size": 6144,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
    },
    "qwen1.5-moe-a2.7b": {  # Qwen/Qwen1.5-MoE-A2.7B config.json (the shared Qwen1.5-MoE trace's model)
        "model_type": "qwen2_moe",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
    },
    "olmoe-1b-7b": {
        "model_type": "olmoe",
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 50304,
        "torch_dtype": "bfloat16",
    },
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_hf_config_matches_builtin_description(name, tmp_path):
    p = tmp_path / name / "config.json"
    p.parent.mkdir()
    p.write_text(json.dumps(HF_CONFIGS[name]))
    got = load_model(p.parent)
    ref = load_model(name)
    for f in (
        "hidden_size",
        "moe_intermediate_size",
        "num_logical_experts",
        "top_k",
        "num_layers",
        "moe_layer_ids",
        "shared_intermediate_size",
        "weight_bytes",
        "attention",
        "kv_lora_rank",
        "num_kv_heads",
        "head_dim",
    ):
        assert getattr(got, f) == getattr(ref, f), (name, f, getattr(got, f), getattr(ref, f))
    assert got.expert_bytes == ref.expert_bytes
    assert got.kv_bytes_per_token == ref.kv_bytes_per_token


def test_hf_config_qwen2_moe_shared_expert_and_sparse_step():
    cfg = {
        "model_type": "qwen2_moe",
        "hidden_size": 2048,
        "moe_intermediate_size": 1408,
        "intermediate_size": 5632,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
        "shared_expert_intermediate_size": 5632,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 151936,
    }
    m = model_from_hf_config(cfg)
    assert m.moe_layer_ids == tuple(i for i in range(24) if (i + 1) % 2 == 0 and i != 3)
    assert m.shared_intermediate_size == 5632 and m.num_logical_experts == 60


def test_hf_config_not_moe_is_a_clear_error():
    with pytest.raises(ValueError, match="n_routed_experts"):
        model_from_hf_config({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32})


def test_hardware_presets_and_overrides():
    assert LINKS["nvlink4"].bandwidth > 5 * LINKS["pcie5"].bandwidth > LINKS["ethernet"].bandwidth
    cl = cluster_preset("h100", intra="pcie5", inter="ethernet")
    assert cl.intra.name == "pcie5" and cl.inter.name == "ethernet"
    slow = dataclasses.replace(cl.gpu, eta_memory=0.5)
    assert float(gemm_time(slow, 1.0, 1e9)) > float(gemm_time(cl.gpu, 1.0, 1e9))
    with pytest.raises(ValueError, match="unknown hardware"):
        cluster_preset("tpu-v9")
    with pytest.raises(ValueError, match="unknown link"):
        cluster_preset("h200", inter="carrier-pigeon")
