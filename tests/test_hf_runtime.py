"""Real transformers MoE models on a placement, over 4 real gloo ranks (runtime_hooks.hf).

One launch runs every architecture (each rank imports transformers once): tiny random configs with a
fixed seed, hidden 32, 8 experts, 12 slots (3 per rank, uneven replica counts), including a
vision-language model served on text prompts and a placement mapped to the layers by ``rows``. The
other tests check the model, config and layer edges without launching.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

import transformers as tf  # noqa: E402

from placement.dispatch import BALANCED  # noqa: E402
from placement.model import Placement  # noqa: E402
from runtime_hooks.hf import match_layers, moe_experts, served_placement  # noqa: E402
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


def vision_language() -> tf.Qwen3VLMoeConfig:
    """A tiny Qwen3-VL-MoE: the text decoder uses the experts interface; the vision tower is unused."""
    text = dict(
        num_hidden_layers=2,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=E,
        head_dim=8,
        **COMMON,
    )
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)
    return tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision)


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
    cases["qwen3_vl_moe"] = HFCase(vision_language(), placement_for(2), seed=6)
    # four rows for two MoE layers: row 3 serves layer 0, row 1 serves layer 1
    cases["mixtral_rows"] = HFCase(cfgs["mixtral"], placement_for(4), rows=(3, 1), seed=7)
    # per-step quotas: same prompts and routing as "mixtral" (seed 1); a grouped router with a dense layer
    cases["mixtral_balanced"] = HFCase(cfgs["mixtral"], placement_for(2), dispatch=BALANCED.name, seed=1)
    cases["deepseek_v3_balanced"] = HFCase(
        cfgs["deepseek_v3"], placement_for(2), dispatch=BALANCED.name, seed=8
    )
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
    "qwen3_vl_moe",
    "mixtral_rows",
    "mixtral_balanced",
    "deepseek_v3_balanced",
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
    assert reports["qwen3_vl_moe"].model_class == "Qwen3VLMoeForConditionalGeneration"
    assert reports["mixtral_rows"].rows == (3, 1) and reports["mixtral_rows"].layer_ids == (0, 1)
    json.dumps(reports["mixtral"].to_dict())  # the CLI's --json payload serialises


def test_balanced_slots_take_the_numpy_quotas(reports):
    """Same prompts and routing as ``mixtral`` (even): only the split over the replicas differs.

    Measured picks per slot equal the numpy ``balanced_quotas`` of each call's all-rank counts
    (``tokens_match`` in the test above); here the split lowers the peak and the cost is reported.
    """
    even, bal = reports["mixtral"], reports["mixtral_balanced"]
    assert bal.measured.sum() == even.measured.sum()
    peak = lambda r: r.measured.reshape(r.measured.shape[0], G, -1).sum(-1).max(-1)  # noqa: E731  [L]
    assert (peak(bal) <= peak(even)).all() and (bal.measured != even.measured).any()
    for rep in (bal, reports["deepseek_v3_balanced"]):
        assert rep.dispatch == BALANCED.name and rep.balanced_collective_bytes_per_layer == 4 * G * E
        assert len(rep.balanced_collective_us_per_layer) == 2
        assert all(u > 0 for u in rep.balanced_collective_us_per_layer)
    assert even.balanced_collective_us_per_layer is None


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
    from moe_placement.cli.main import main
    from placement.formats import write_placement

    cfg = tmp_path / "config.json"
    cfg.write_text(configs()["qwen2_moe"].to_json_string())
    plan = tmp_path / "p.json"
    write_placement(placement_for(2), plan, "native")
    argv = ["validate", str(plan), "--model", str(cfg), "--ranks", "4", "--seed", "3", "--json"]
    code = main([*argv, "--dispatch", BALANCED.name])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    assert out["model_class"] == "Qwen2MoeForCausalLM" and out["ranks"] == G
    assert out["tokens_match"] is True and out["max_abs_diff"] <= 1e-5
    assert out["dispatch"] == BALANCED.name and out["balanced_collective_bytes_per_layer"] == 4 * G * E
    assert len(out["balanced_collective_us_per_layer"]) == 2
    assert len(out["expert_bytes_per_rank"]) == G

    bad = tmp_path / "bad.json"
    write_placement(placement_for(1), bad, "native")
    assert main(["validate", str(bad), "--model", str(cfg), "--json"]) == 2
    err = capsys.readouterr().err
    assert "2 MoE layers" in err and "1 rows" in err


# ---- edges that need no launch ---------------------------------------------------------------------
def test_more_rows_than_moe_layers_is_an_error_unless_mapped():
    info = describe_model(configs()["mixtral"])
    assert info.layer_ids == (0, 1)
    four = placement_for(4)  # ids 0..3: layers 0 and 1 are among them, but two rows would be dropped
    with pytest.raises(ValueError, match=r"2 MoE layers .* 4 rows .*--layers"):
        match_layers(four, list(info.layer_ids), E)
    assert match_layers(four, list(info.layer_ids), E, rows=[3, 1]) == [3, 1]
    assert match_layers(four, list(info.layer_ids), E, rows=[2, 2]) == [2, 2]  # one row, two layers
    with pytest.raises(ValueError, match="names 3 placement rows but the model has 2 MoE layers"):
        match_layers(four, list(info.layer_ids), E, rows=[0, 1, 2])
    with pytest.raises(ValueError, match=r"--layers \[4\] outside the placement's rows 0..3"):
        match_layers(four, list(info.layer_ids), E, rows=[0, 4])
    served = served_placement(four, [2, 2], list(info.layer_ids))
    assert served.layer_ids == (0, 1)
    np.testing.assert_array_equal(served.physical_to_logical_map, four.physical_to_logical_map[[2, 2]])


def _granite_hybrid() -> tf.GraniteMoeHybridConfig:
    """A hybrid Mamba/MoE config: its ``time_step_limit`` holds an infinity."""
    return tf.GraniteMoeHybridConfig(
        num_hidden_layers=2,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        intermediate_size=16,
        num_local_experts=E,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=8,
        **COMMON,
    )


def test_config_file_with_infinity_reads_like_its_folder(tmp_path):
    from runtime_hooks.hf_validate import _config

    cfg = _granite_hybrid()
    assert cfg.time_step_limit[1] == float("inf")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    cfg.save_pretrained(folder)  # writes the infinity as transformers' {"__float__": "Infinity"} tag
    assert "Infinity" in (folder / "config.json").read_text()
    named = tmp_path / "granite.json"  # any file name, not only config.json
    named.write_text((folder / "config.json").read_text())
    assert tuple(_config(named).time_step_limit) == (0.0, float("inf"))
    assert describe_model(named) == describe_model(folder)
    assert describe_model(named).model_class == "GraniteMoeHybridForCausalLM"
    # a bare JSON Infinity (Python's json writes it) reads too
    doc = json.loads(named.read_text())
    doc["time_step_limit"] = [0.0, float("inf")]
    named.write_text(json.dumps(doc))
    assert tuple(_config(named).time_step_limit) == (0.0, float("inf"))


def test_bad_config_files_are_one_line(tmp_path):
    bad = tmp_path / "config.json"
    for text, needle in (
        ("{not json", "invalid JSON"),
        ('{"hidden_size": 8}', "'model_type' field"),
        ('{"model_type": "no-such-model"}', "unknown to transformers"),
        (
            '{"model_type": "granitemoehybrid", "mamba_n_heads": 7}',
            "refuses this granitemoehybrid .*must divide",
        ),
    ):
        bad.write_text(text)
        with pytest.raises(ValueError, match=needle) as err:
            describe_model(bad)
        assert "\n" not in str(err.value).strip() and len(str(err.value)) < 500
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no config.json"):
        describe_model(empty)


def test_vision_language_and_omni_models_serve_their_text_decoder():
    vl = describe_model(vision_language())
    assert vl.model_class == "Qwen3VLMoeForConditionalGeneration" and vl.layer_ids == (0, 1)
    assert vl.num_experts == E and vl.vocab_size == 64
    text = vision_language().text_config.to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)
    audio = dict(encoder_layers=1, d_model=16, encoder_attention_heads=2, encoder_ffn_dim=16, output_dim=32)
    omni = tf.Qwen3OmniMoeConfig(
        thinker_config=dict(text_config=text, vision_config=vision, audio_config=audio)
    )
    info = describe_model(omni)  # the thinker generates the text; the talker is not served
    assert info.model_class == "Qwen3OmniMoeThinkerForConditionalGeneration" and info.layer_ids == (0, 1)
    with pytest.raises(ValueError, match="NllbMoeConfig .* no causal-LM or image-text-to-text") as err:
        describe_model(tf.NllbMoeConfig())
    assert len(str(err.value)) < 300


def test_cli_validate_refuses_bad_numbers_and_layers_in_one_line(tmp_path, capsys):
    from moe_placement.cli.main import main
    from placement.dispatch import dispatch_names
    from placement.formats import write_placement

    cfg = tmp_path / "config.json"
    cfg.write_text(configs()["mixtral"].to_json_string())
    plan = tmp_path / "p.json"
    write_placement(placement_for(2), plan, "native")
    four = tmp_path / "four.json"
    write_placement(placement_for(4), four, "native")
    offline = dispatch_names(runtime=False)[0]
    cases = (
        (["--timeout", "0"], "--timeout must be a finite number > 0, got 0.0"),
        (["--timeout", "nan"], "--timeout must be a finite number > 0"),
        (["--ranks", "0"], "--ranks must be >= 1, got 0"),
        (["--ranks", "100000"], "above the limit of"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--tokens-per-rank", "0"], "--tokens-per-rank must be >= 1"),
        (["--dispatch", offline], f"{offline!r} is scored offline only"),
        (["--layers", "0"], "--layers names 1 placement rows but the model has 2 MoE layers"),
    )
    for extra, needle in cases:
        for model in ([], ["--model", str(cfg)]):
            if extra[0] == "--layers" and not model:
                continue  # without --model, --layers selects rows to replay
            assert main(["validate", str(plan), *model, *extra]) == 2, extra
            err = capsys.readouterr().err
            assert needle in err and err.count("\n") == 1, (extra, err)
    assert main(["validate", str(four), "--model", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "the model has 2 MoE layers" in err and "4 rows" in err and "--layers" in err
