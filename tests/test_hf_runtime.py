"""Real transformers MoE models on a placement, over 4 real gloo ranks (runtime_hooks.hf).

One launch runs every architecture (each rank imports transformers once): tiny random configs with a
fixed seed, hidden 32, 8 experts, 12 slots (3 per rank, uneven replica counts).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

import transformers as tf  # noqa: E402

from placement.model import Placement  # noqa: E402
from runtime_hooks.hf import match_layers, moe_experts  # noqa: E402
from runtime_hooks.hf_validate import HFCase, describe_model, validate_many  # noqa: E402

pytestmark = pytest.mark.slow

E, G = 8, 4
COMMON = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, initializer_range=0.2)


def placement_for(num_layers: int, layer_ids=None) -> Placement:
    """Rank g holds experts 2g, 2g+1 and one replica (different per layer): ``[L, 12]``."""
    rows = []
    for l in range(num_layers):
        rows.append([e for g in range(G) for e in (2 * g, 2 * g + 1, (2 * g + 2 + (3 * l) % 6) % E)])
    return Placement.from_map(np.array(rows), E, ep_size=G, layer_ids=layer_ids)


def configs() -> dict:
    moe = dict(num_hidden_layers=2, num_key_value_heads=2, num_experts_per_tok=2, **COMMON)
    return {
        "mixtral": tf.MixtralConfig(intermediate_size=48, num_local_experts=E, **moe),
        "qwen2_moe": tf.Qwen2MoeConfig(
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=E,
            **moe,
        ),
        "qwen3_moe": tf.Qwen3MoeConfig(
            intermediate_size=48, moe_intermediate_size=16, num_experts=E, head_dim=8, **moe
        ),
        "gpt_oss": tf.GptOssConfig(
            intermediate_size=16,
            num_local_experts=E,
            head_dim=8,
            layer_types=["sliding_attention", "full_attention"],
            **moe,
        ),
        # two more classes through the same generic path, with no code of their own
        "olmoe": tf.OlmoeConfig(intermediate_size=16, num_experts=E, **moe),
        "glm4_moe": tf.Glm4MoeConfig(
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=E,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            head_dim=8,
            **moe,
        ),
        # grouped router, a shared expert and a dense first layer: MoE layers 1 and 2
        "deepseek_v3": tf.DeepseekV3Config(
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_key_value_heads=4,
            num_experts_per_tok=2,
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=E,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            **COMMON,
        ),
    }


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """name -> HFValidationReport, all from one 4-rank launch."""
    import torch

    cfgs = configs()
    ckpt = tmp_path_factory.mktemp("qwen3_ckpt")
    torch.manual_seed(3)
    tf.AutoModelForCausalLM.from_config(cfgs["qwen3_moe"]).save_pretrained(ckpt)
    cases = {name: HFCase(cfg, placement_for(2), seed=1) for name, cfg in cfgs.items()}
    cases["mixtral_local"] = HFCase(cfgs["mixtral"], placement_for(2), dispatch="local", seed=2)
    cases["deepseek_v3_by_id"] = HFCase(cfgs["deepseek_v3"], placement_for(2, layer_ids=(1, 2)), seed=4)
    cases["checkpoint"] = HFCase(str(ckpt), placement_for(2), seed=5)
    return dict(zip(cases, validate_many(list(cases.values()), timeout=240)))


NAMES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
    "deepseek_v3",
    "olmoe",
    "glm4_moe",
    "mixtral_local",
    "deepseek_v3_by_id",
    "checkpoint",
)


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_tokens_match(reports, name):
    rep = reports[name]
    assert rep.ranks == G
    assert rep.max_abs_diff <= 1e-5, rep.max_abs_diff_per_rank
    assert rep.tokens_match, (rep.predicted, rep.measured)
    assert rep.measured.sum() == rep.predicted.sum() > 0
    # every rank keeps 3 of the 8 experts of each layer
    for b in rep.expert_bytes_per_rank:
        assert b["after"] * E == b["before"] * 3


def test_layers_and_checkpoint(reports):
    assert reports["deepseek_v3"].layer_ids == (1, 2)
    assert reports["deepseek_v3"].rows == (0, 1)  # default ids matched in order
    assert reports["checkpoint"].model_class == "Qwen3MoeForCausalLM"
    assert reports["mixtral_local"].dispatch == "local"
    json.dumps(reports["mixtral"].to_dict())  # the CLI's --json payload serialises


def test_unsupported_class_is_named():
    dbrx = tf.DbrxConfig(
        d_model=32,
        n_heads=4,
        n_layers=1,
        vocab_size=64,
        max_seq_len=64,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0},
        ffn_config={"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 16},
    )
    with pytest.raises(ValueError, match="DbrxForCausalLM"):
        describe_model(dbrx)
    dense = tf.LlamaForCausalLM(
        tf.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    )
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        moe_experts(dense)


def test_placement_that_does_not_fit_names_the_numbers():
    info = describe_model(configs()["deepseek_v3"])
    assert info.layer_ids == (1, 2) and info.num_experts == E
    with pytest.raises(ValueError, match="3 rows"):
        match_layers(placement_for(3, layer_ids=(4, 5, 6)), list(info.layer_ids), E)
    twelve = Placement.from_map(np.tile(np.arange(12), (2, 1)), 12, ep_size=G)
    with pytest.raises(ValueError, match="12 logical experts .* has 8"):
        match_layers(twelve, list(info.layer_ids), E)


def test_cli_validate_model_json(tmp_path, capsys):
    from cli.main import main
    from placement.formats import write_placement

    cfg = tmp_path / "config.json"
    cfg.write_text(configs()["qwen2_moe"].to_json_string())
    plan = tmp_path / "p.json"
    write_placement(placement_for(2), plan, "native")
    code = main(["validate", str(plan), "--model", str(cfg), "--ranks", "4", "--seed", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    assert out["model_class"] == "Qwen2MoeForCausalLM" and out["ranks"] == G
    assert out["tokens_match"] is True and out["max_abs_diff"] <= 1e-5
    assert len(out["expert_bytes_per_rank"]) == G

    bad = tmp_path / "bad.json"
    write_placement(placement_for(1), bad, "native")
    assert main(["validate", str(bad), "--model", str(cfg), "--json"]) == 2
    err = capsys.readouterr().err
    assert "2 MoE layers" in err and "1 rows" in err
