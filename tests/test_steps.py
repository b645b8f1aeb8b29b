"""Step shapes (``placement/steps.py``) against a small loop written independently here.

The synthetic trace has what makes step shape matter: every sequence opens with the same template
tokens (a cold start would put them all in one step) and keeps one topic for its whole length
(consecutive tokens alike, so prefill chunks are lumpier than decode steps).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from benchmarks.step_lp import highs_step_peak
from placement.model import Placement
from placement.steps import DEFAULT_STEP_TOKENS, PHASES, make_steps, step_counts
from placement.topology import Topology
from profiling.trace import RoutingTrace

E, K, G, S_GPU = 16, 2, 4, 6  # experts, top-k, GPUs, slots per GPU
TEMPLATE = 4  # template tokens at the start of every sequence


def topic_trace(seed: int = 0, num_seqs: int = 300, source_rank: bool = False) -> RoutingTrace:
    """One layer; sequence ``i`` of length 10..400 routes its first ``TEMPLATE`` tokens to experts
    (0, 1) and the rest to two experts of its topic (topics of 4 experts, one of them favoured)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(10, 400, num_seqs)
    rows = []
    for n in lengths:
        topic = int(rng.integers(0, E // 4)) * 4
        hot = topic + int(rng.integers(0, 4))
        body = np.stack([np.full(n, hot), topic + rng.integers(0, 4, n)], axis=1)
        body[:, 1] = np.where(body[:, 1] == hot, (hot + 1 - topic) % 4 + topic, body[:, 1])
        body[:TEMPLATE] = (0, 1)
        rows.append(body)
    ids = np.concatenate(rows)[:, None, :]  # [T, 1, k]
    off = np.concatenate([[0], np.cumsum(lengths)])
    src = np.repeat(rng.integers(0, G, num_seqs), lengths) if source_rank else None
    return RoutingTrace(E, topk_ids=ids, seq_offsets=off, source_rank=src, name="topic")


def placement_for(trace: RoutingTrace) -> Placement:
    """Replicas for the 8 hottest experts, spread so no GPU holds an expert twice."""
    load = trace.counts()[0]
    extra = np.argsort(-load, kind="stable")[: G * S_GPU - E]
    row = np.concatenate([np.arange(E), extra])
    gpu_rows = [[] for _ in range(G)]
    for e in sorted(row, key=lambda e: -load[e]):
        g = next(g for g in sorted(range(G), key=lambda g: len(gpu_rows[g])) if e not in gpu_rows[g])
        gpu_rows[g].append(int(e))
    return Placement(np.array([sum(gpu_rows, [])]), E, Topology(ep_size=G, num_physical_experts=G * S_GPU))


# ---------------------------------------------------------------------------------------------
# the independent calculation: plain loops
# ---------------------------------------------------------------------------------------------
def loop_decode(trace: RoutingTrace, b: int, num_steps: int, seed: int) -> list[list[int]]:
    """Continuous batching by hand: per rank (sequences round robin) ``b`` slots, each started at a
    token drawn uniformly from the rank's tokens (steady state); each step a slot emits its token and
    moves on; a finished slot takes the rank's next sequence in order. Returns the tokens of each step."""
    rnd = random.Random(seed)
    off = [int(x) for x in trace.seq_offsets]
    seqs = [(off[i], off[i + 1]) for i in range(len(off) - 1)]
    queues = [[s for i, s in enumerate(seqs) if i % G == g] for g in range(G)]
    slots, nxt = [], [0] * G
    for g in range(G):
        tokens = [(q, t) for q, (a, z) in enumerate(queues[g]) for t in range(a, z)]
        for _ in range(b):
            q, t = rnd.choice(tokens)
            slots.append([g, q, t])
    steps = []
    for _ in range(num_steps):
        steps.append([t for _, _, t in slots])
        for slot in slots:
            g, q, t = slot
            if t + 1 < queues[g][q][1]:
                slot[2] = t + 1
            else:
                q = nxt[g] % len(queues[g])
                nxt[g] += 1
                slot[1], slot[2] = q, queues[g][q][0]
    return steps


def loop_prefill(trace: RoutingTrace, b: int) -> list[list[int]]:
    """Chunk ``c`` of ``b`` consecutive tokens to step ``c // G`` (rank ``c % G``); whole steps only."""
    n = trace.num_tokens // (b * G)
    return [list(range(s * b * G, (s + 1) * b * G)) for s in range(n)]


def loop_par(trace: RoutingTrace, pl: Placement, steps: list[list[int]]) -> tuple[float, float]:
    """Mean step PAR under the even split and under the best split (HiGHS), by loops."""
    ids = trace.topk_ids[:, 0, :]
    row = pl.physical_to_logical_map[0]
    reps = {e: int((row == e).sum()) for e in range(E)}
    l2p = pl.logical_to_physical_map[0]
    even, best = [], []
    for toks in steps:
        c = np.zeros(E)
        for t in toks:
            for e in ids[t]:
                c[e] += 1
        gpu = [sum(c[row[p]] / reps[row[p]] for p in range(g * S_GPU, (g + 1) * S_GPU)) for g in range(G)]
        mean = c.sum() / G
        even.append(max(gpu) / mean)
        best.append(highs_step_peak(c, l2p, S_GPU, G) / mean)
    return float(np.mean(even)), float(np.mean(best))


def _par(pl: Placement, counts: np.ndarray) -> tuple[float, float]:
    from placement.metrics import expected_gpu_load
    from placement.step_balance import lp_peak

    gpu = expected_gpu_load(pl, counts[:, None, :])[:, 0]  # [S, G]
    mean = counts.sum(axis=1) / G
    lp = lp_peak(counts, pl.logical_to_physical_map[0], S_GPU)
    return float((gpu.max(axis=1) / mean).mean()), float((lp / mean).mean())


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("b", [12, 24])
def test_decode_matches_the_independent_loop_within_3_percent(b):
    tr = topic_trace()
    pl = placement_for(tr)
    st = make_steps(tr, G, "decode", b)
    ref_even, ref_best = loop_par(tr, pl, loop_decode(tr, b, st.num_steps, seed=7))
    even, best = _par(pl, step_counts(tr, st).sum(axis=2)[:, 0])
    assert even == pytest.approx(ref_even, rel=0.03)
    assert best == pytest.approx(ref_best, rel=0.03)
    # steady state from the first step: template tokens no likelier than in the trace (a cold start,
    # every slot at position 0, would make step 0 all template)
    seq = np.searchsorted(tr.seq_offsets, st.token, side="right") - 1
    template = (st.token - tr.seq_offsets[seq]) < TEMPLATE
    share = TEMPLATE * (tr.seq_offsets.size - 1) / tr.num_tokens
    assert template[st.step == 0].mean() < 4 * share


def test_prefill_matches_consecutive_chunks_within_1_percent():
    tr = topic_trace()
    pl = placement_for(tr)
    b = 32
    ref = loop_par(tr, pl, loop_prefill(tr, b))
    got = _par(pl, step_counts(tr, make_steps(tr, G, "prefill", b)).sum(axis=2)[:, 0])
    assert got == pytest.approx(ref, rel=0.01)
    dec = _par(pl, step_counts(tr, make_steps(tr, G, "decode", b)).sum(axis=2)[:, 0])
    assert got[0] > dec[0]  # consecutive tokens of one topic are lumpier than a decode step


def test_decode_steps_hold_one_token_per_slot():
    tr = topic_trace()
    st = make_steps(tr, G, "decode", 8, seed=3)
    assert st.phase == "decode" and st.num_steps == tr.num_tokens // (G * 8)
    key = (st.step * G + st.rank) * 8 + st.row
    assert np.unique(key).size == key.size == st.num_steps * G * 8
    seq = np.searchsorted(tr.seq_offsets, st.token, side="right") - 1
    assert np.all(seq % G == st.rank)  # round robin by sequence
    again = make_steps(tr, G, "decode", 8, seed=3)
    assert np.array_equal(again.token, st.token)
    assert not np.array_equal(make_steps(tr, G, "decode", 8, seed=4).token, st.token)
    assert "decode" in st.describe() and "8 tokens per rank" in st.describe()


def test_decode_uses_recorded_source_ranks():
    tr = topic_trace(source_rank=True)
    st = make_steps(tr, G, "decode", 8)
    assert np.array_equal(tr.source_rank[st.token], st.rank)
    assert any("recorded ranks" in n for n in st.notes)


def test_decode_without_boundaries_says_what_it_assumed():
    tr = topic_trace()
    flat = RoutingTrace(E, topk_ids=tr.topk_ids)
    st = make_steps(flat, G, "decode", 8)
    assert any("no sequence boundaries" in n for n in st.notes)
    assert np.unique(st.token).size == st.token.size  # each slot walks its own piece once
    slot = st.rank * 8 + st.row
    for j in (0, 9, 31):
        walk = st.token[slot == j]  # in step order
        assert np.array_equal(np.diff(walk), np.ones(walk.size - 1))


def test_few_sequences_are_cycled_and_noted():
    tr = topic_trace(num_seqs=20)
    st = make_steps(tr, G, "decode", 16)
    assert any("cycled" in n for n in st.notes)
    assert st.token.size == st.num_steps * G * 16


def test_engine_batches_step_the_trace():
    tr = topic_trace(num_seqs=40)
    T = tr.num_tokens
    bounds = np.array([0, 500, 510, 520, 530, 540, 560, T])
    eng = RoutingTrace(E, topk_ids=tr.topk_ids, step_offsets=bounds)
    st = make_steps(eng, 2, "decode")
    assert st.phase == "engine" and any("asked: decode" in n for n in st.notes)
    assert st.num_steps == 4  # 7 batches dealt 2 per step
    first = st.token[(st.step == 0) & (st.rank == 1)]
    assert np.array_equal(first, np.arange(500, 510))
    capped = make_steps(eng, 2, "prefill", 100)
    assert capped.step_tokens == 100 and any("chunks of 100" in n for n in capped.notes)
    assert np.bincount(capped.step * 2 + capped.rank).max() <= 100
    with pytest.raises(ValueError, match="records the engine"):
        make_steps(tr, G, "engine")


def test_engine_batches_with_ranks():
    tr = topic_trace(num_seqs=40, source_rank=True)
    bounds = np.linspace(0, tr.num_tokens, 6).astype(int)
    eng = RoutingTrace(E, topk_ids=tr.topk_ids, step_offsets=bounds, source_rank=tr.source_rank)
    st = make_steps(eng, G, "decode")
    assert st.num_steps == 5 and np.array_equal(st.rank, tr.source_rank[st.token])


def test_step_counts_sum_the_stepped_picks():
    tr = topic_trace()
    for phase in PHASES:
        st = make_steps(tr, G, phase, 16)
        c = step_counts(tr, st)
        assert c.shape == (st.num_steps, 1, G, E)
        assert c.sum() == (tr.topk_ids[st.token] >= 0).sum()
        s, g = int(st.step[5]), int(st.rank[5])
        mine = st.token[(st.step == s) & (st.rank == g)]
        assert np.array_equal(c[s, 0, g], np.bincount(tr.topk_ids[mine, 0].ravel(), minlength=E))


def test_max_steps_and_size_check(monkeypatch):
    tr = topic_trace()
    st = make_steps(tr, G, "prefill", 8, max_steps=3)
    assert st.num_steps == 3 and st.step.max() == 2 and any("max_steps" in n for n in st.notes)
    import placement.steps as steps_mod

    monkeypatch.setattr(steps_mod, "MAX_STEP_CELLS", 100)
    with pytest.raises(ValueError, match="max_steps="):
        step_counts(tr, st)


def test_refusals_name_the_numbers():
    tr = topic_trace(num_seqs=20)
    with pytest.raises(ValueError, match="unknown phase 'train'"):
        make_steps(tr, G, "train")
    T = tr.num_tokens
    with pytest.raises(ValueError, match=rf"takes {4 * T} tokens but the trace has only {T}"):
        make_steps(tr, G, "decode", T)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            make_steps(tr, G, "prefill", bad)
    assert make_steps(tr, G, "prefill").step_tokens == DEFAULT_STEP_TOKENS["prefill"]


def test_step_par_by_phase_matches_the_independent_loops():
    from placement.metrics import evaluate, step_par

    tr = topic_trace()
    pl = placement_for(tr)
    b = 24
    st = make_steps(tr, G, "decode", b)
    ref_even, ref_best = loop_par(tr, pl, loop_decode(tr, b, st.num_steps, seed=11))
    assert step_par(pl, tr, b, "even", "decode")["step_par"] == pytest.approx(ref_even, rel=0.03)
    assert step_par(pl, tr, b, "balanced", "decode")["step_par"] == pytest.approx(ref_best, rel=0.03)
    pre_even, pre_best = loop_par(tr, pl, loop_prefill(tr, b))
    assert step_par(pl, tr, b, "even", "prefill")["step_par"] == pytest.approx(pre_even, rel=0.01)
    assert step_par(pl, tr, b, "balanced", "prefill")["step_par"] == pytest.approx(pre_best, rel=0.01)
    d = evaluate(pl, tr, "even", phase="decode").to_dict()
    assert d["phase"] == "decode" and d["step_tokens"] == DEFAULT_STEP_TOKENS["decode"] and d["notes"]
    assert "step_par" not in evaluate(pl, tr, "even").to_dict()  # no phase, no step tokens: no steps
    with pytest.raises(ValueError, match="unknown phase 'warmup'"):
        evaluate(pl, tr, "even", phase="warmup")


def test_prefill_with_recorded_ranks_chunks_each_ranks_tokens():
    tr = topic_trace(source_rank=True)
    st = make_steps(tr, G, "prefill", 16)
    assert np.array_equal(tr.source_rank[st.token], st.rank)
    for g in range(G):
        mine = st.token[(st.rank == g) & (st.step == 1)]
        assert np.array_equal(mine, np.flatnonzero(tr.source_rank == g)[16:32])


def test_decode_stops_at_max_steps_with_the_same_first_steps():
    tr = topic_trace()
    whole = make_steps(tr, G, "decode", 8, seed=2)
    first = make_steps(tr, G, "decode", 8, seed=2, max_steps=5)
    assert first.num_steps == 5 and any("first 5 of" in n for n in first.notes)
    assert np.array_equal(first.token, whole.token[whole.step < 5])
    assert not any("not stepped" in n for n in first.notes)
