"""Engine statistics dumps written with the engines' own savers, read back and checked by hand.

The worked example: a 3-layer model whose layer 0 is dense, MoE layers 1 and 2, 4 logical experts on
6 physical slots (2 GPUs x 3 slots). The SGLang map rows are

    layer 0 (dense, trivial): [0, 1, 2, 3, 0, 1]
    layer 1:                  [0, 1, 2, 3, 0, 1]
    layer 2:                  [3, 2, 1, 0, 3, 2]

Physical counts ``[5, 1, 2, 3, 4, 0]`` in layer 1 give logical ``[5+4, 1+0, 2, 3] = [9, 1, 2, 3]``;
``[2, 0, 7, 1, 0, 3]`` in layer 2 give logical ``[1, 7, 0+3, 2+0] = [1, 7, 3, 2]``.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from moe_placement.base.fileio import InputFileError
from profiling.engine_readers import physical_to_logical_counts, physical_to_logical_ids, read_engine_dump
from profiling.readers import read_trace

torch = pytest.importorskip("torch")

P2L = np.array([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 3, 2]])
PHYS_A = np.array([[0, 0, 0, 0, 0, 0], [5, 1, 2, 3, 4, 0], [2, 0, 7, 1, 0, 3]])
LOGICAL_A = np.array([[9, 1, 2, 3], [1, 7, 3, 2]])  # MoE layers 1 and 2
PHYS_B = np.array([[0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 6, 0]])
LOGICAL_B = np.array([[2, 2, 1, 1], [0, 0, 0, 6]])


def test_physical_to_logical_counts_by_hand():
    got = physical_to_logical_counts(PHYS_A, P2L, 4)
    assert got[1:].tolist() == LOGICAL_A.tolist()
    assert got[0].tolist() == [0, 0, 0, 0]
    batched = physical_to_logical_counts(np.stack([PHYS_A, PHYS_B]), P2L, 4)  # [2, H, E]
    assert batched[1, 1:].tolist() == LOGICAL_B.tolist()
    assert physical_to_logical_counts(PHYS_A * 0.5, P2L, 4)[1].tolist() == [4.5, 0.5, 1.0, 1.5]


def test_physical_to_logical_counts_preserves_totals():
    rng = np.random.default_rng(0)
    p2l = np.stack([rng.permutation(np.arange(12) % 8) for _ in range(5)])  # [5, 12]
    phys = rng.integers(0, 50, size=(7, 5, 12))
    out = physical_to_logical_counts(phys, p2l, 8)
    assert out.shape == (7, 5, 8)
    assert np.array_equal(out.sum(axis=2), phys.sum(axis=2))


def test_physical_to_logical_ids_keeps_padding():
    ids = np.array([[[0, -1]], [[4, 5]], [[1, -1]]])  # [H=3, T=1, k=2]
    assert physical_to_logical_ids(ids, P2L).tolist() == [[[0, -1]], [[0, 1]], [[2, -1]]]


# ---- SGLang stat ---------------------------------------------------------------------------------


def _stat_dump(path: pathlib.Path, logical_count) -> pathlib.Path:
    torch.save(
        {
            "rank": 0,
            "logical_count": torch.tensor(logical_count),
            "average_utilization_rate_over_window": 0.75,
        },
        path,
    )
    return path


def test_sglang_stat_drops_dense_rows_and_keeps_layer_ids(tmp_path):
    counts = np.zeros((3, 3, 4), dtype=np.int32)  # [steps, H, E]; layer 0 is dense
    counts[0, 1:] = LOGICAL_A
    counts[1, 1:] = LOGICAL_B
    counts[2, 2] = [0, 0, 5, 0]
    path = _stat_dump(tmp_path / "expert_distribution_recorder_1700000000.123.pt", counts)
    trace = read_engine_dump(path)
    assert trace.layer_ids == (1, 2)
    assert trace.num_logical_experts == 4
    assert trace.window_counts.shape == (3, 2, 4)
    assert trace.window_counts[0].tolist() == LOGICAL_A.tolist()
    assert trace.counts().tolist() == (LOGICAL_A + LOGICAL_B + [[0, 0, 0, 0], [0, 0, 5, 0]]).tolist()
    assert trace.metadata["average_utilization_rate_over_window"] == 0.75
    assert trace.metadata["recorder_mode"] == "stat"
    # explicit MoE rows keep a row even when it is empty
    kept = read_engine_dump(path, moe_layer_ids=[0, 2])
    assert kept.layer_ids == (0, 2) and kept.window_counts[:, 0].sum() == 0
    # read_trace dispatches .pt files here
    assert read_trace(path).counts().tolist() == trace.counts().tolist()


def test_sglang_stat_errors(tmp_path):
    empty = _stat_dump(tmp_path / "empty.pt", np.zeros((2, 3, 4), dtype=np.int32))
    with pytest.raises(InputFileError, match="no routed tokens.*moe_layer_ids"):
        read_engine_dump(empty)
    assert read_engine_dump(empty, moe_layer_ids=[1, 2]).counts().sum() == 0
    with pytest.raises(InputFileError, match="outside the dump's 3 layer rows"):
        read_engine_dump(empty, moe_layer_ids=[5])
    ok = _stat_dump(tmp_path / "ok.pt", np.ones((1, 3, 4), dtype=np.int32))
    with pytest.raises(InputFileError, match="num_logical_experts=8"):
        read_engine_dump(ok, num_logical_experts=8)
    bad = _stat_dump(tmp_path / "neg.pt", -np.ones((1, 3, 4), dtype=np.int32))
    with pytest.raises(InputFileError, match="negative"):
        read_engine_dump(bad)
    torch.save({"something": 1}, tmp_path / "other.pt")
    with pytest.raises(InputFileError, match="not an SGLang expert-distribution dump"):
        read_engine_dump(tmp_path / "other.pt")


# ---- SGLang per_pass / per_token ------------------------------------------------------------------


def _detail_dump(path, records, p2l=P2L):
    torch.save({"records": records, "last_physical_to_logical_map": torch.tensor(p2l)}, path)
    return path


def _rec(fp, rank, phys, topk=None, **extra):
    r = dict(
        forward_pass_id=fp,
        rank=rank,
        gatherer_key="primary",
        global_physical_count=torch.tensor(phys),
        **extra,
    )
    if topk is not None:
        r["topk_ids_of_layer"] = torch.tensor(topk, dtype=torch.int32)
    return r


def test_sglang_per_pass_converts_physical_counts_and_merges_ranks(tmp_path):
    folder = tmp_path / "dump"
    folder.mkdir()
    _detail_dump(
        folder / "expert_distribution_recorder_1700000000.5_0.pt", [_rec(0, 0, PHYS_A), _rec(1, 0, PHYS_B)]
    )
    _detail_dump(
        folder / "expert_distribution_recorder_1700000000.5_1.pt", [_rec(0, 1, PHYS_B), _rec(1, 1, PHYS_B)]
    )
    trace = read_engine_dump(folder)
    assert trace.layer_ids == (1, 2)
    assert trace.window_labels == ("pass0", "pass1")
    assert trace.window_counts[0].tolist() == (LOGICAL_A + LOGICAL_B).tolist()  # ranks 0 and 1, pass 0
    assert trace.window_counts[1].tolist() == (2 * LOGICAL_B).tolist()
    assert trace.metadata["ranks"] == [0, 1]
    assert trace.metadata["recorder_mode"] == "per_pass"
    # one rank file alone
    one = read_engine_dump(folder / "expert_distribution_recorder_1700000000.5_1.pt")
    assert one.counts().tolist() == (2 * LOGICAL_B).tolist()
    assert read_trace(folder).counts().tolist() == trace.counts().tolist()


def test_sglang_per_pass_map_mismatch_between_ranks(tmp_path):
    folder = tmp_path / "dump"
    folder.mkdir()
    _detail_dump(folder / "expert_distribution_recorder_1_0.pt", [_rec(0, 0, PHYS_A)])
    other = P2L.copy()
    other[1] = [1, 0, 2, 3, 0, 1]
    _detail_dump(folder / "expert_distribution_recorder_1_1.pt", [_rec(0, 1, PHYS_A)], other)
    with pytest.raises(InputFileError, match="differs from the one in"):
        read_engine_dump(folder)


def test_sglang_per_pass_malformed(tmp_path):
    bad_shape = _detail_dump(tmp_path / "a.pt", [_rec(0, 0, PHYS_A[:, :4])])
    with pytest.raises(InputFileError, match=r"global_physical_count has shape \(3, 4\), expected \(3, 6\)"):
        read_engine_dump(bad_shape)
    no_fp = tmp_path / "b.pt"
    torch.save(
        {
            "records": [{"rank": 0, "global_physical_count": torch.tensor(PHYS_A)}],
            "last_physical_to_logical_map": torch.tensor(P2L),
        },
        no_fp,
    )
    with pytest.raises(InputFileError, match="forward_pass_id"):
        read_engine_dump(no_fp)
    out_of_range = _detail_dump(tmp_path / "c.pt", [_rec(0, 0, PHYS_A)], np.where(P2L == 3, 9, P2L))
    with pytest.raises(InputFileError, match="num_logical_experts=4"):
        read_engine_dump(out_of_range, num_logical_experts=4)
    no_map = tmp_path / "d.pt"
    torch.save({"records": []}, no_map)
    with pytest.raises(InputFileError, match="last_physical_to_logical_map"):
        read_engine_dump(no_map)


def _topk(rows_per_layer, K=8):
    """[H, T, K] physical ids padded with -1 to K columns (SGLang's recorder width)."""
    H, T = len(rows_per_layer), len(rows_per_layer[0])
    out = np.full((H, T, K), -1, dtype=np.int32)
    for h, rows in enumerate(rows_per_layer):
        for t, ids in enumerate(rows):
            out[h, t, : len(ids)] = ids
    return out


def test_sglang_per_token_converts_ids(tmp_path):
    # rank 0, pass 0: two tokens; rank 1, pass 0: one token; rank 0, pass 1: one token.
    r0p0 = _topk([[[], []], [[0, 5], [4, 2]], [[1, 3], [0, 2]]])
    r1p0 = _topk([[[]], [[3, 1]], [[4, 5]]])
    r0p1 = _topk([[[]], [[2, 4]], [[5, 3]]])
    folder = tmp_path / "dump"
    folder.mkdir()
    _detail_dump(
        folder / "expert_distribution_recorder_5_0.pt",
        [
            _rec(
                0,
                0,
                PHYS_A,
                r0p0,
                input_ids=[11, 12],
                positions=[0, 1],
                extend_seq_lens=[2],
                forward_mode=1,
                misc_objects=[],
            ),
            _rec(1, 0, PHYS_A, r0p1, input_ids=[13]),
        ],
    )
    _detail_dump(folder / "expert_distribution_recorder_5_1.pt", [_rec(0, 1, PHYS_A, r1p0, input_ids=[21])])
    trace = read_engine_dump(folder)
    assert trace.layer_ids == (1, 2)
    assert trace.top_k == 2  # padding columns of the 8-wide recorder buffer are dropped
    # token order: pass 0 rank 0 (2 tokens), pass 0 rank 1, pass 1 rank 0
    # layer 1 map [0,1,2,3,0,1]; layer 2 map [3,2,1,0,3,2]
    assert trace.topk_ids[:, 0].tolist() == [[0, 1], [0, 2], [3, 1], [2, 0]]
    assert trace.topk_ids[:, 1].tolist() == [[2, 0], [3, 1], [3, 2], [2, 0]]
    assert trace.source_rank.tolist() == [0, 0, 1, 0]
    assert trace.step_offsets.tolist() == [0, 3, 4]
    assert trace.metadata["recorder_mode"] == "per_token"


def test_sglang_per_token_rejects_bad_slot_ids(tmp_path):
    bad = _topk([[[]], [[0, 6]], [[1, 2]]])  # slot 6 does not exist (P = 6)
    path = _detail_dump(tmp_path / "x.pt", [_rec(0, 0, PHYS_A, bad)])
    with pytest.raises(InputFileError, match=r"slot ids in \[-1, 6\], expected \[-1, 6\)"):
        read_engine_dump(path)


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_pickled_object_in_dump_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "expert_distribution_recorder_1.pt"
    torch.save({"rank": 0, "logical_count": _Exploit(marker)}, path)
    with pytest.raises(InputFileError, match="never pickled objects"):
        read_engine_dump(path)
    assert not marker.exists()
    good = _stat_dump(tmp_path / "good.pt", np.ones((2, 3, 4), dtype=np.int32))
    data = good.read_bytes()
    good.write_bytes(data[: len(data) // 3])
    with pytest.raises(InputFileError, match="not a safe torch.save file"):
        read_engine_dump(good)


# ---- TensorRT-LLM ----------------------------------------------------------------------------------


def _trt_folder(tmp_path, with_raw=False):
    from safetensors.torch import save_file

    folder = tmp_path / "stats"
    folder.mkdir()
    (folder / "meta_info.json").write_text(json.dumps({"num_experts": 4, "num_experts_per_token": 2}))
    # raw token_selected_experts per (iter, layer) and rank: [T, k] logical ids
    raw = {
        0: {"100_3": [[0, 1], [1, 2]], "100_5": [[3, 0], [2, 0]], "101_3": [[0, 3]], "101_5": [[1, 2]]},
        1: {"100_3": [[2, 3]], "100_5": [[0, 1]], "101_3": [[1, 0], [2, 1]], "101_5": [[3, 2], [3, 0]]},
    }
    for rank, tensors in raw.items():
        counts = {k: torch.bincount(torch.tensor(v).flatten(), minlength=4) for k, v in tensors.items()}
        save_file(counts, str(folder / f"rank{rank}.safetensors"))
        if with_raw:
            save_file(
                {k: torch.tensor(v, dtype=torch.int32) for k, v in tensors.items()},
                str(folder / f"rank{rank}_raw.safetensors"),
            )
    return folder


def test_trtllm_counts_sum_over_ranks(tmp_path):
    folder = _trt_folder(tmp_path)
    trace = read_engine_dump(folder)
    assert trace.layer_ids == (3, 5)  # real layer ids from the keys
    assert trace.window_labels == ("iter100", "iter101")
    # iter 100, layer 3: rank0 ids 0,1,1,2 + rank1 ids 2,3 -> [1, 2, 2, 1]
    assert trace.window_counts[0, 0].tolist() == [1, 2, 2, 1]
    # iter 101, layer 5: rank0 ids 1,2 + rank1 ids 3,2,3,0 -> [1, 1, 2, 2]
    assert trace.window_counts[1, 1].tolist() == [1, 1, 2, 2]
    assert trace.metadata["ranks"] == [0, 1]
    assert read_engine_dump(folder, moe_layer_ids=[5]).layer_ids == (5,)
    assert read_trace(folder).counts().tolist() == trace.counts().tolist()
    # one rank file alone
    one = read_engine_dump(folder / "rank1.safetensors")
    assert one.window_counts[0, 0].tolist() == [0, 0, 1, 1]


def test_trtllm_raw_gives_per_token_trace(tmp_path):
    folder = _trt_folder(tmp_path, with_raw=True)
    trace = read_engine_dump(folder)
    assert trace.has_tokens and trace.layer_ids == (3, 5)
    # order: iter 100 rank 0 (2 tokens), iter 100 rank 1 (1), iter 101 rank 0 (1), iter 101 rank 1 (2)
    assert trace.source_rank.tolist() == [0, 0, 1, 0, 1, 1]
    assert trace.step_offsets.tolist() == [0, 3, 6]
    assert trace.topk_ids[:, 0].tolist() == [[0, 1], [1, 2], [2, 3], [0, 3], [1, 0], [2, 1]]
    assert trace.topk_ids[:, 1].tolist() == [[3, 0], [2, 0], [0, 1], [1, 2], [3, 2], [3, 0]]
    assert trace.metadata["raw_matches_counts"] is True
    plain = tmp_path / "plain"
    plain.mkdir()
    assert trace.counts().tolist() == read_engine_dump(_trt_folder(plain)).counts().tolist()


def test_trtllm_malformed(tmp_path):
    from safetensors.torch import save_file

    folder = _trt_folder(tmp_path)
    save_file({"100_3": torch.zeros(4, dtype=torch.int64)}, str(folder / "rank2.safetensors"))
    save_file({"bad-key": torch.zeros(4, dtype=torch.int64)}, str(folder / "rank3.safetensors"))
    with pytest.raises(InputFileError, match="'bad-key' is not '<iter>_<layer>'"):
        read_engine_dump(folder)
    (folder / "rank3.safetensors").unlink()
    save_file({"102_3": torch.zeros(4, dtype=torch.int64)}, str(folder / "rank3.safetensors"))
    with pytest.raises(InputFileError, match="no statistics for key '102_5'"):
        read_engine_dump(folder)
    (folder / "rank3.safetensors").unlink()
    save_file({"100_3": torch.zeros(5, dtype=torch.int64)}, str(folder / "rank3.safetensors"))
    with pytest.raises(InputFileError, match="5 entries, expected num_experts=4"):
        read_engine_dump(folder)
    (folder / "rank3.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    with pytest.raises(InputFileError, match="not a readable safetensors file"):
        read_engine_dump(folder)
    (folder / "rank3.safetensors").unlink()
    (folder / "meta_info.json").write_text("[1, 2]")
    with pytest.raises(InputFileError, match="JSON object"):
        read_engine_dump(folder)
    (folder / "meta_info.json").write_text('{"num_experts": 4')
    with pytest.raises(InputFileError, match="invalid JSON"):
        read_engine_dump(folder)


# ---- vLLM (provisional JSONL) ------------------------------------------------------------------------


def _vllm_record(step, load, p2l, **extra):
    return json.dumps(
        {
            "record_type": "eplb_load_stats",
            "version": 1,
            "step": step,
            "num_ranks": 2,
            "expert_load": np.asarray(load).tolist(),
            "p2l_map": np.asarray(p2l).tolist(),
            **extra,
        }
    )


def test_vllm_jsonl_converts_with_each_records_map(tmp_path):
    moved = P2L[1:].copy()
    moved[0] = [1, 0, 2, 3, 0, 1]  # the map changed between the two records
    path = tmp_path / "eplb.jsonl"
    path.write_text(
        "\n".join(
            [
                _vllm_record(1000, PHYS_A[1:], P2L[1:]),
                json.dumps({"record_type": "something_else", "x": 1}),
                "",
                _vllm_record(2000, PHYS_A[1:], moved),
            ]
        )
        + "\n"
    )
    trace = read_engine_dump(path)
    assert trace.window_labels == ("step1000", "step2000")
    assert trace.window_counts[0].tolist() == LOGICAL_A.tolist()
    # moved row: slots [5,1,2,3,4,0] -> expert 1 gets 5, expert 0 gets 1+4, experts 2, 3 unchanged
    assert trace.window_counts[1, 0].tolist() == [5, 5, 2, 3]
    assert trace.layer_ids == (0, 1)
    assert trace.metadata["skipped_records"] == 1
    assert read_engine_dump(path, moe_layer_ids=[1, 2]).layer_ids == (1, 2)
    with pytest.raises(InputFileError, match="3 moe_layer_ids given for 2"):
        read_engine_dump(path, moe_layer_ids=[1, 2, 3])


def test_vllm_jsonl_layer_ids_in_record_and_errors(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(_vllm_record(1, PHYS_A[1:], P2L[1:], layer_ids=[1, 2]) + "\n")
    assert read_engine_dump(path).layer_ids == (1, 2)
    assert read_engine_dump(path, moe_layer_ids=[2]).window_counts[0].tolist() == [LOGICAL_A[1].tolist()]
    cases = [
        ("{not json", "line 1: not a JSON record"),
        (_vllm_record(1, PHYS_A[1:, :4], P2L[1:]), "differs from p2l_map shape"),
        (
            _vllm_record(1, PHYS_A[1:], P2L[1:]).replace('"num_ranks": 2', '"num_ranks": 4'),
            "does not divide 6",
        ),
        (_vllm_record(1, PHYS_A[1:], P2L[1:]).replace('"version": 1', '"version": 2'), "newer"),
        (json.dumps({"record_type": "other"}), "no 'eplb_load_stats' records"),
        (_vllm_record(1, -PHYS_A[1:], P2L[1:]), "negative"),
    ]
    for i, (text, match) in enumerate(cases):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_text(text + "\n")
        with pytest.raises(InputFileError, match=match):
            read_engine_dump(bad)


def test_unknown_inputs(tmp_path):
    with pytest.raises(InputFileError, match="no such file"):
        read_engine_dump(tmp_path / "absent.pt")
    with pytest.raises(InputFileError, match="folder holds no engine dump"):
        read_engine_dump(tmp_path)
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(InputFileError, match="unknown engine dump type"):
        read_engine_dump(tmp_path / "x.csv")


# ---- the real DeepSeek-V2-Lite trace written as SGLang dumps --------------------------------------


def test_deepseek_counts_as_sglang_stat_dump(tmp_path, deepseek_trace):
    windows = deepseek_trace.windows(4)
    counts = np.stack([w.counts() for w in windows])  # [4, 26, 64], layers 1..26
    full = np.zeros((4, 27, 64), dtype=np.int32)  # SGLang's axis: all 27 hidden layers, layer 0 dense
    full[:, 1:] = counts
    path = _stat_dump(tmp_path / "expert_distribution_recorder_1.pt", full)
    trace = read_engine_dump(path)
    assert trace.layer_ids == deepseek_trace.layer_ids == tuple(range(1, 27))
    assert np.array_equal(trace.window_counts, counts)


def test_deepseek_tokens_as_sglang_per_token_dump(tmp_path, deepseek_trace):
    from placement.topology import Topology
    from solver.greedy import greedy_placement

    part = deepseek_trace.slice_tokens(0, 600)
    placement, _ = greedy_placement(
        deepseek_trace.counts(), Topology.from_redundant(64, 16, 8, 2), layer_ids=deepseek_trace.layer_ids
    )
    ids = part.topk_ids.astype(np.int64)  # [T, 26, 6] logical
    first_slot = placement.logical_to_physical_map[..., 0]  # [26, 64] one replica per expert
    phys = np.take_along_axis(first_slot[None], ids.reshape(600, 26, 6) % 64, axis=2)  # [T, 26, 6]
    phys = np.where(ids >= 0, phys, -1)
    full_map = np.tile(np.arange(80) % 64, (27, 1))
    full_map[1:] = placement.physical_to_logical_map
    buf = np.full((27, 600, 8), -1, dtype=np.int32)  # [H, T, 8] as SGLang's recorder stores it
    buf[1:, :, :6] = phys.transpose(1, 0, 2)
    count = np.zeros((27, 80), dtype=np.int32)
    records = [_rec(0, 0, count, buf[:, :300]), _rec(1, 0, count, buf[:, 300:])]
    path = _detail_dump(tmp_path / "expert_distribution_recorder_1_0.pt", records, full_map)
    trace = read_engine_dump(path)
    assert trace.layer_ids == tuple(range(1, 27))
    assert np.array_equal(trace.topk_ids, part.topk_ids)
    assert trace.step_offsets.tolist() == [0, 300, 600]
