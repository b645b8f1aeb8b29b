import numpy as np
import pytest

from profiling.readers import read_trace, write_trace
from profiling.skew import gini, normalized_entropy, skew_table
from profiling.synthetic import synthetic_trace
from profiling.trace import RoutingTrace, token_counts


def _small():
    ids = np.array([[[0, 1]], [[1, 2]], [[2, -1]], [[0, 2]], [[3, 0]]])
    return RoutingTrace(
        num_logical_experts=4, topk_ids=ids, seq_offsets=np.array([0, 2, 3, 5]), layer_ids=(5,)
    )


def test_counts_mask_padding():
    tr = _small()
    assert tr.counts().tolist() == [[3, 2, 3, 1]]
    assert token_counts(np.array([[[-1, -1]]]), 3).tolist() == [[0, 0, 0]]


def test_split_at_prompt_boundary_and_windows():
    tr = _small()
    fit, held = tr.split(0.5)
    # 3 prompts -> 2 fitted (tokens 0..2), 1 held out (tokens 3..4)
    assert fit.num_tokens == 3 and held.num_tokens == 2
    assert fit.seq_offsets.tolist() == [0, 2, 3] and held.seq_offsets.tolist() == [0, 2]
    assert (fit.counts() + held.counts()).tolist() == tr.counts().tolist()
    wins = tr.windows(3)
    assert [w.num_tokens for w in wins] == [2, 1, 2]
    assert tr.window_load().shape == (3, 1, 4)
    with pytest.raises(ValueError, match="fraction must be in"):
        tr.split(1.0)


def test_counts_only_windows():
    wc = np.arange(24).reshape(3, 2, 4)
    tr = RoutingTrace(num_logical_experts=4, window_counts=wc, window_labels=("a", "b", "c"))
    fit, held = tr.split(0.34)
    assert fit.window_labels == ("a",) and held.window_labels == ("b", "c")
    assert tr.counts().tolist() == wc.sum(0).tolist()


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (
            dict(num_logical_experts=4, topk_ids=np.array([[[4]]])),
            r"ids in \[4, 4\] but must be in \[-1, 3\]",
        ),
        (dict(num_logical_experts=4, topk_ids=np.array([[[-2]]])), "must be in"),
        (
            dict(num_logical_experts=4, topk_ids=np.zeros((2, 1, 1), int), seq_offsets=np.array([0, 1])),
            "end at the token count 2",
        ),
        (dict(num_logical_experts=4, window_counts=np.ones((1, 2, 3))), r"must be \[windows, layers, 4\]"),
        (dict(num_logical_experts=4, window_counts=-np.ones((1, 1, 4))), ">= 0"),
        (dict(num_logical_experts=4), "needs topk_ids"),
        (dict(num_logical_experts=0, topk_ids=np.zeros((1, 1, 1), int)), "positive integer"),
    ],
)
def test_trace_validation(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        RoutingTrace(**kwargs)


def test_native_round_trip(tmp_path):
    tr = synthetic_trace(
        num_tokens=500, num_layers=3, num_logical_experts=16, top_k=2, num_prompts=10, seed=4
    )
    write_trace(tr, tmp_path / "t.npz")
    back = read_trace(tmp_path / "t.npz")
    np.testing.assert_array_equal(back.topk_ids, tr.topk_ids)
    np.testing.assert_array_equal(back.seq_offsets, tr.seq_offsets)
    assert back.layer_ids == tr.layer_ids and back.metadata["synthetic"] is True


def test_synthetic_is_seeded_and_skewed():
    a = synthetic_trace(num_tokens=3000, num_layers=2, seed=1)
    b = synthetic_trace(num_tokens=3000, num_layers=2, seed=1)
    c = synthetic_trace(num_tokens=3000, num_layers=2, seed=2)
    np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
    assert not np.array_equal(a.topk_ids, c.topk_ids)
    # top-k ids are distinct within a token
    s = np.sort(a.topk_ids, axis=2)
    assert (s[:, :, 1:] != s[:, :, :-1]).all()
    flat = synthetic_trace(num_tokens=3000, num_layers=1, skew=0.0, affinity=0.0, seed=1)
    assert skew_table(a)[0]["max_over_mean"] > skew_table(flat)[0]["max_over_mean"]


def test_skew_metrics_hand_cases():
    assert gini(np.array([1.0, 1.0, 1.0, 1.0])) == pytest.approx(0.0)
    assert gini(np.array([0.0, 0.0, 0.0, 4.0])) == pytest.approx(0.75)
    assert normalized_entropy(np.array([1.0, 1.0])) == pytest.approx(1.0)
    assert normalized_entropy(np.array([0.0, 3.0])) == pytest.approx(0.0)
    row = skew_table(np.array([[0.0, 2.0, 6.0, 0.0]]))[0]
    assert (
        row["max_over_mean"] == pytest.approx(3.0) and row["idle_experts"] == 2 and row["hottest_expert"] == 2
    )


def test_read_every_shared_trace(traces_dir):
    from profiling.readers import find_shared_traces

    paths = find_shared_traces()
    assert len(paths) >= 4
    for p in paths:
        tr = read_trace(p)
        assert tr.num_layers >= 1 and tr.counts().sum() > 0


def test_deepseek_layout(deepseek_trace):
    tr = deepseek_trace
    assert (tr.num_tokens, tr.num_layers, tr.top_k, tr.num_logical_experts) == (192023, 26, 6, 64)
    assert tr.layer_ids == tuple(range(1, 27))
    assert len(tr.natural_windows()) == 1999
    med = np.median([r["max_over_mean"] for r in skew_table(tr)])
    assert 1.6 < med < 2.0  # the README says median 1.78


def test_qwen_drops_startup_dummy_rows(qwen_trace):
    # segments 2 and 3 only: the real prefill and decode rows
    assert qwen_trace.num_tokens == 1406 + 2886
    assert qwen_trace.step_offsets is not None and len(qwen_trace.step_offsets) - 1 == 128


def test_olmoe_domains_and_mixtral_questions(olmoe_trace, mixtral_trace):
    assert set(olmoe_trace.window_labels) >= {"arxiv", "github", "c4"}
    assert olmoe_trace.layer_ids == (0, 7, 15)
    assert mixtral_trace.window_counts.shape == (14042, 32, 8)
    assert mixtral_trace.window_labels[0] == "abstract_algebra"
