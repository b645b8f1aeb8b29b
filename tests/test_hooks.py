"""Routing capture hooks on real HF transformers MoE classes (tiny random configs)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from profiling.hooks import RecordOptions, RoutingRecorder, attach, find_moe_layers, read_stream  # noqa: E402
from profiling.readers import read_trace  # noqa: E402

VOCAB = 96
E, K = 8, 2


def _configs():
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return {
        "mixtral": lambda: transformers.MixtralConfig(**common, num_local_experts=E, num_experts_per_tok=K),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **common,
            num_experts=E,
            num_experts_per_tok=K,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=24,
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=24
        ),
        "olmoe": lambda: transformers.OlmoeConfig(**common, num_experts=E, num_experts_per_tok=K),
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **{**common, "num_hidden_layers": 3, "num_key_value_heads": 4},
            moe_intermediate_size=24,
            n_routed_experts=E,
            num_experts_per_tok=K,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_shared_experts=1,
        ),
    }


MODELS = list(_configs())


@pytest.fixture(scope="module", params=MODELS)
def tiny_model(request):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_configs()[request.param]()).eval()
    if request.param == "deepseek_v3":
        g = torch.Generator().manual_seed(1)
        for spec in find_moe_layers(model):  # bias correction must matter for the test to mean anything
            spec.block.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.5)
    return request.param, model


def _ground_truth(model, run):
    """Ids each MoE block handed to its experts, and the ids its own router returns when re-run on the
    block's captured input. Both come from hooks independent of the recorder."""
    specs = find_moe_layers(model)
    dispatched = {i: [] for i in range(len(specs))}
    block_inputs = {i: [] for i in range(len(specs))}
    handles = []
    for i, s in enumerate(specs):

        def pre_exp(_m, args, kwargs, i=i):
            ids = [
                a
                for a in list(args) + list(kwargs.values())
                if isinstance(a, torch.Tensor) and not a.is_floating_point()
            ]
            dispatched[i].append(ids[0].detach().clone())

        def pre_block(_m, args, i=i):
            block_inputs[i].append(args[0].detach().clone())

        handles.append(s.block.experts.register_forward_pre_hook(pre_exp, with_kwargs=True))
        handles.append(s.block.register_forward_pre_hook(pre_block))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    disp = {i: torch.cat(v).reshape(-1, K).numpy() for i, v in dispatched.items()}
    return specs, disp, block_inputs


def _forwards(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (2, 12), generator=g))
        model(input_ids=torch.randint(0, VOCAB, (1, 9), generator=g))


@pytest.mark.parametrize("mode", ["counts", "tokens"])
def test_recorded_ids_equal_model_routing(tiny_model, mode):
    name, model = tiny_model
    rec = attach(model, RecordOptions(mode=mode, capacity_tokens=1000))
    specs, disp, block_inputs = _ground_truth(model, lambda: _forwards(model))
    rec.detach()
    assert rec.layer_ids == tuple(s.layer_id for s in specs)
    if name == "deepseek_v3":
        assert rec.layer_ids == (1, 2)  # layer 0 is dense (first_k_dense_replace=1)
    # the router re-run on the block's own input returns the same selection (the recorder is detached)
    with torch.no_grad():
        for i, s in enumerate(specs):
            again = torch.cat([s.block.gate(h)[2].reshape(-1, K) for h in block_inputs[i]]).numpy()
            np.testing.assert_array_equal(np.sort(again, axis=1), np.sort(disp[i], axis=1))
    truth = np.stack([disp[i] for i in range(len(specs))], axis=1)  # [T, L, k]
    T = 2 * 12 + 9
    assert truth.shape == (T, len(specs), K)
    counts = rec.counts()
    expect = np.stack([np.bincount(truth[:, l].ravel(), minlength=E) for l in range(len(specs))])
    np.testing.assert_array_equal(counts, expect)
    tr = rec.to_trace(name=name)
    assert tr.layer_ids == rec.layer_ids and tr.num_logical_experts == E
    if mode == "tokens":
        np.testing.assert_array_equal(tr.topk_ids, truth)
        np.testing.assert_array_equal(tr.seq_offsets, [0, 12, 24, 33])
        np.testing.assert_array_equal(tr.step_offsets, [0, 24, 33])
    else:
        assert not tr.has_tokens
        np.testing.assert_array_equal(tr.counts(), expect)


def test_deepseek_grouped_bias_routing_is_not_plain_topk():
    """Guards the DeepSeek case against a trivial pass: the recorded ids must differ from a top-k of the
    raw gate scores somewhere, so the test above really checks grouped routing + bias correction."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_configs()["deepseek_v3"]()).eval()
    g = torch.Generator().manual_seed(1)
    for spec in find_moe_layers(model):
        spec.block.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.5)
    rec = attach(model, RecordOptions(mode="tokens"))
    specs, disp, block_inputs = _ground_truth(model, lambda: _forwards(model))
    rec.detach()
    tr = rec.to_trace()
    differ = 0
    with torch.no_grad():
        for i, s in enumerate(specs):
            logits = torch.cat([s.block.gate(h)[0] for h in block_inputs[i]])
            naive = torch.topk(logits, K, dim=-1).indices.numpy()
            differ += int((np.sort(naive, 1) != np.sort(tr.topk_ids[:, i].astype(np.int64), 1)).any(1).sum())
    assert differ > 0


def test_detach_removes_every_hook(tiny_model):
    _, model = tiny_model
    before = {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()}
    with attach(model, RecordOptions(mode="tokens")) as rec:
        assert rec.attached
        _forwards(model)
    after = {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()}
    assert after == before and not rec.attached
    c = rec.counts()
    _forwards(model, seed=3)
    np.testing.assert_array_equal(rec.counts(), c)
    assert c.sum() > 0


def test_two_recorders_and_streaming_chunks_match(tiny_model, tmp_path):
    _, model = tiny_model
    plain = attach(model, RecordOptions(mode="tokens", capacity_tokens=4096))
    streamed = attach(
        model, RecordOptions(mode="tokens", capacity_tokens=40, chunk_tokens=16, stream_dir=tmp_path)
    )
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _ in range(6):
            model(torch.randint(0, VOCAB, (1, 11), generator=g))
    plain.detach()
    streamed.detach()
    assert len(list(tmp_path.glob("chunk_*.npz"))) >= 2  # flushed during the run, memory stayed bounded
    a, b = plain.to_trace(), streamed.to_trace()
    np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
    np.testing.assert_array_equal(a.seq_offsets, b.seq_offsets)
    np.testing.assert_array_equal(read_stream(tmp_path).topk_ids, a.topk_ids)
    assert read_trace(tmp_path / "chunk_000000.npz").layer_ids == a.layer_ids
    np.testing.assert_array_equal(plain.counts(), a.counts())


def test_streaming_overflow_is_reported(tmp_path):
    rec = RoutingRecorder(
        [0], 4, 2, RecordOptions(mode="tokens", capacity_tokens=8, chunk_tokens=8, stream_dir=tmp_path)
    )
    rec.record(0, torch.zeros(6, 2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="capacity_tokens"):
        rec.record(0, torch.zeros(6, 2, dtype=torch.long))


def test_padding_ids_are_masked():
    rec = RoutingRecorder([3, 7], 4, 2, RecordOptions(mode="tokens", capacity_tokens=16))
    ids = torch.tensor([[0, 1], [-1, -1], [2, -1], [1, 3]])  # a router's picks are distinct; -1 may repeat
    rec.record(0, ids)
    rec.record(1, ids.flip(0))
    np.testing.assert_array_equal(rec.counts(), [[1, 2, 1, 1], [1, 2, 1, 1]])
    tr = rec.to_trace()
    assert tr.layer_ids == (3, 7)
    np.testing.assert_array_equal(tr.topk_ids[:, 0], ids.numpy())
    np.testing.assert_array_equal(tr.counts(), rec.counts())


def test_out_of_range_ids_raise_on_read():
    rec = RoutingRecorder([0], 4, 2)
    rec.record(0, torch.tensor([[0, 5]]))
    with pytest.raises(ValueError, match="num_logical_experts=4"):
        rec.counts()


def test_ring_buffer_wraps_and_keeps_newest_tokens():
    rec = RoutingRecorder([0, 1], 16, 2, RecordOptions(mode="tokens", capacity_tokens=10))
    all_ids = torch.arange(26).reshape(13, 2) % 16  # 13 tokens
    for a, b in [(0, 4), (4, 8), (8, 13)]:
        rec.record(0, all_ids[a:b])
        rec.record(1, (all_ids[a:b] + 1) % 16)
    tr = rec.to_trace()
    assert tr.num_tokens == 10 and tr.metadata["dropped_tokens"] == 3
    np.testing.assert_array_equal(tr.topk_ids[:, 0], all_ids[3:].numpy())
    np.testing.assert_array_equal(tr.topk_ids[:, 1], ((all_ids[3:] + 1) % 16).numpy())
    np.testing.assert_array_equal(rec.counts()[0], np.bincount(all_ids.numpy().ravel(), minlength=16))
    big = RoutingRecorder([0], 16, 2, RecordOptions(mode="tokens", capacity_tokens=4))
    big.record(0, all_ids)  # one batch larger than the ring
    np.testing.assert_array_equal(big.to_trace().topk_ids[:, 0], all_ids[-4:].numpy())


def test_sampling_keeps_every_sth_token_across_calls():
    rec = RoutingRecorder([0], 32, 1, RecordOptions(mode="tokens", capacity_tokens=100, sample_every=3))
    ids = torch.arange(20).reshape(20, 1)
    for a, b in [(0, 7), (7, 8), (8, 20)]:
        rec.record(0, ids[a:b])
    np.testing.assert_array_equal(rec.to_trace().topk_ids[:, 0, 0], np.arange(0, 20, 3))
    assert rec.counts().sum() == 20  # counts see every token


def test_record_path_never_syncs_with_host(monkeypatch):
    """The hot path must not read device values: patch the host-sync entry points to raise."""
    rec = RoutingRecorder([0, 1], 8, 2, RecordOptions(mode="tokens", capacity_tokens=7, sample_every=2))
    ids = torch.tensor([[0, 1], [2, -1], [7, 3], [4, 4], [5, 6]])

    def boom(*a, **k):
        raise AssertionError("host sync inside record()")

    orig_getitem = torch.Tensor.__getitem__

    def getitem(self, key):
        keys = key if isinstance(key, tuple) else (key,)
        if any(isinstance(x, torch.Tensor) and x.dtype == torch.bool for x in keys):
            raise AssertionError("boolean indexing inside record()")
        return orig_getitem(self, key)

    for attr in ("item", "cpu", "tolist", "numpy", "__bool__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, attr, boom)
    monkeypatch.setattr(torch.Tensor, "__getitem__", getitem)
    for _ in range(3):
        rec.record(0, ids)
        rec.record(1, ids)
    monkeypatch.undo()
    assert rec.counts().sum() == 2 * 3 * 9


def test_mark_window_splits_counts():
    rec = RoutingRecorder([0], 4, 1)
    rec.record(0, torch.tensor([[0], [0], [1]]))
    w0 = rec.mark_window("a")
    rec.record(0, torch.tensor([[3]]))
    tr = rec.to_trace()
    np.testing.assert_array_equal(w0, [[2, 1, 0, 0]])
    assert tr.window_labels == ("a", "window1")
    np.testing.assert_array_equal(tr.window_counts[:, 0], [[2, 1, 0, 0], [0, 0, 0, 1]])


class _TinyExperts(torch.nn.Module):
    def __init__(self, n, d):
        super().__init__()
        self.num_experts = n
        self.w = torch.nn.Parameter(torch.randn(n, d, d) * 0.1)

    def forward(self, h, top_k_index, top_k_weights):
        out = torch.zeros_like(h)
        for j in range(top_k_index.shape[1]):
            out = out + top_k_weights[:, j : j + 1] * torch.einsum("td,tde->te", h, self.w[top_k_index[:, j]])
        return out


class _LinearGateBlock(torch.nn.Module):
    """A block whose gate is a plain Linear: ids are only visible as the experts' input."""

    def __init__(self, n=6, d=16, k=2):
        super().__init__()
        self.gate = torch.nn.Linear(d, n, bias=False)
        self.experts = _TinyExperts(n, d)
        self.top_k = k
        self.last_ids = []

    def forward(self, h):
        w, ids = torch.topk(self.gate(h).softmax(-1), self.top_k, dim=-1)
        self.last_ids.append(ids)
        return self.experts(h, ids, w)


class _TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_LinearGateBlock(), _LinearGateBlock()])

    def forward(self, h):
        for blk in self.layers:
            h = h + blk(h)
        return h


def test_linear_gate_blocks_are_read_from_expert_inputs():
    torch.manual_seed(0)
    m = _TinyModel()
    specs = find_moe_layers(m)
    assert [s.where for s in specs] == ["inputs", "inputs"] and [s.layer_id for s in specs] == [0, 1]
    with attach(m, RecordOptions(mode="tokens"), num_logical_experts=6, top_k=2) as rec:
        m(torch.randn(10, 16))
    tr = rec.to_trace()
    for l, blk in enumerate(m.layers):
        np.testing.assert_array_equal(tr.topk_ids[:, l], blk.last_ids[-1].numpy())


def test_adapter_on_any_module():
    torch.manual_seed(0)
    m = _TinyModel()

    def gate_ids(_mod, _inputs, output):  # the adapter sees the gate's logits and selects like the block
        return torch.topk(output.softmax(-1), 2, dim=-1).indices

    rec = attach(
        m,
        RecordOptions(mode="tokens"),
        adapters={blk.gate: gate_ids for blk in m.layers},
        num_logical_experts=6,
        top_k=2,
    )
    m(torch.randn(7, 16))
    rec.detach()
    tr = rec.to_trace()
    assert tr.layer_ids == (0, 1)
    for l, blk in enumerate(m.layers):
        np.testing.assert_array_equal(tr.topk_ids[:, l], blk.last_ids[-1].numpy())


def test_bad_arguments_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        RoutingRecorder([0], 4, 2, RecordOptions(mode="ids"))
    with pytest.raises(ValueError, match="mode='tokens'"):
        RoutingRecorder([0], 4, 2, RecordOptions(stream_dir=tmp_path))
    with pytest.raises(ValueError, match="no MoE block"):
        attach(torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="nothing recorded"):
        RoutingRecorder([0], 4, 2, RecordOptions(mode="tokens")).to_trace()


# ---- moe-placement profile ---------------------------------------------------------------------
def _cli(argv):
    from moe_placement.cli.main import main

    return main(argv)


def test_profile_cli_records_the_models_own_routing(tmp_path, capsys):
    """A tiny Qwen3-MoE folder with saved weights and no tokenizer: the CLI loads the weights, uses the
    byte fallback, and the trace equals the ids the same model dispatches on the same tokens."""
    torch.manual_seed(0)
    cfg = _configs()["qwen3_moe"]()
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    folder = tmp_path / "tiny-qwen3"
    model.save_pretrained(folder)
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
    texts = [tmp_path / "a.txt", tmp_path / "b.txt"]
    texts[0].write_text("Mixture of experts routes tokens. " * 2)  # 68 bytes
    texts[1].write_text("def f(x):\n    return x * 2\n" * 2)
    out = tmp_path / "trace.npz"
    rc = _cli(
        [
            "profile",
            "--model",
            str(folder),
            "--text",
            str(texts[0]),
            "--text",
            str(texts[1]),
            "-o",
            str(out),
            "--seq-len",
            "40",
            "--max-tokens",
            "100",
        ]
    )
    assert rc == 0
    err = capsys.readouterr().err
    assert "byte-level fallback" in err and "random weights" not in err
    tr = read_trace(out)
    assert tr.metadata["weights"] == "pretrained" and tr.metadata["tokenizer"] == "byte-fallback"
    a, b = (np.frombuffer(t.read_bytes(), np.uint8).astype(np.int64) % VOCAB for t in texts)
    b = b[: 100 - a.size]  # --max-tokens cuts the second file
    assert tr.num_tokens == a.size + b.size == 100
    # ground truth: the same weights, the same sequences (each file cut every 40 tokens), ids at the experts' input
    seqs = [a[:40], a[40:], b]

    def run():
        with torch.no_grad():
            for s in seqs:
                model(torch.as_tensor(s)[None])

    _, disp, _ = _ground_truth(model, run)
    truth = np.stack([disp[i] for i in sorted(disp)], axis=1)
    np.testing.assert_array_equal(tr.topk_ids, truth)
    np.testing.assert_array_equal(tr.seq_offsets, np.cumsum([0] + [len(s) for s in seqs]))


def test_profile_cli_counts_mode_from_config_only(tmp_path, capsys):
    cfg = _configs()["mixtral"]()
    cfg.save_pretrained(tmp_path / "m")
    text_a, text_b = tmp_path / "arxiv.txt", tmp_path / "code.txt"
    text_a.write_text("the quick brown fox " * 10)
    text_b.write_text("for i in range(10): print(i)\n" * 5)
    outs = []
    for n in range(2):
        out = tmp_path / f"c{n}.npz"
        rc = _cli(
            [
                "profile",
                "--model",
                str(tmp_path / "m" / "config.json"),
                "--text",
                str(text_a),
                "--text",
                str(text_b),
                "-o",
                str(out),
                "--mode",
                "counts",
                "--seq-len",
                "64",
                "--seed",
                "3",
            ]
        )
        assert rc == 0
        outs.append(read_trace(out))
    assert "random weights" in capsys.readouterr().err
    tr = outs[0]
    assert not tr.has_tokens and tr.window_labels == ("arxiv", "code") and tr.metadata["weights"] == "random"
    n_a, n_b = len(text_a.read_bytes()), len(text_b.read_bytes())
    np.testing.assert_array_equal(tr.window_counts.sum(axis=2), [[2 * n_a] * 2, [2 * n_b] * 2])
    np.testing.assert_array_equal(tr.window_counts, outs[1].window_counts)  # seeded: reproducible


def test_profile_cli_bad_input_is_one_line(tmp_path, capsys):
    rc = _cli(
        [
            "profile",
            "--model",
            str(tmp_path / "nope"),
            "--text",
            str(tmp_path / "x.txt"),
            "-o",
            str(tmp_path / "t.npz"),
        ]
    )
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err


def test_profile_cli_uses_the_folders_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path / "tok-model"
    _configs()["olmoe"]().save_pretrained(folder)
    words = ["[UNK]", "experts", "route", "tokens", "to", "gpus"]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)
    text = tmp_path / "t.txt"
    text.write_text("experts route tokens to gpus " * 7)
    out = tmp_path / "t.npz"
    assert (
        _cli(["profile", "--model", str(folder), "--text", str(text), "-o", str(out), "--seq-len", "16"]) == 0
    )
    tr = read_trace(out)
    assert tr.metadata["tokenizer"] != "byte-fallback"
    assert tr.num_tokens == 35  # one token per word, not per byte
    np.testing.assert_array_equal(tr.seq_offsets, [0, 16, 32, 35])
