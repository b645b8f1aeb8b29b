"""Dispatch models: the engines' own answers (golden fixtures) and the rules' consequences."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from placement.dispatch import (
    DISPATCH,
    DispatchModel,
    check_dispatch,
    dispatch_names,
    get_dispatch,
    nearest_replica,
    rank_choices,
    register,
    sglang_static_tables,
    vllm_hash_replica,
)
from placement.metrics import batch_positions, route_tokens, routed_gpu_tokens, trace_gpu_load
from placement.model import Placement
from placement.topology import Topology
from profiling.synthetic import synthetic_trace

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "engine_dispatch.json").read_text())


def _case_placement(case: dict) -> Placement:
    p2l = np.array(case["physical_to_logical_map"])
    topo = Topology(ep_size=case["ep_size"], num_physical_experts=p2l.shape[1], num_nodes=case["num_nodes"])
    ids = tuple(case["layer_ids"])
    return Placement(p2l, case["num_logical_experts"], topo, ids, allow_colocated_replicas=case["colocated"])


def test_fixtures_name_the_engine_versions():
    assert FIXTURES["engines"] == {"sglang": "0.5.23", "vllm": "0.33.0"}
    cases = FIXTURES["cases"]
    assert any(c["colocated"] for c in cases) and any(c["num_nodes"] == 3 for c in cases)
    # dense layers before and between MoE layers: SGLang's map holds them as trivial rows that draw too
    assert any(c["layer_ids"][0] > 0 for c in cases)


@pytest.mark.parametrize("index", range(len(FIXTURES["cases"])))
def test_sglang_static_tables_equal_sglangs_own(index):
    case = FIXTURES["cases"][index]
    ours = sglang_static_tables(_case_placement(case))
    assert np.array_equal(ours, np.array(case["sglang_static_tables"]))


@pytest.mark.parametrize("index", range(len(FIXTURES["cases"])))
def test_vllm_hash_slots_equal_vllms_kernel(index):
    case = FIXTURES["cases"][index]
    pl = _case_placement(case)
    ids = np.array(case["topk_ids"])
    src = np.array(case["source_ranks"])
    rows = batch_positions(src, case["batch_tokens"])
    ours = route_tokens(pl, ids, src, "vllm-hash", batch_index=rows)
    assert np.array_equal(ours, np.array(case["vllm_hash_slots"]))


def _two_node_placement() -> Placement:
    # 4 GPUs on 2 nodes, 3 slots each; expert 0 has replicas on GPU 0 and GPU 1 (both node 0) and GPU 2.
    p2l = np.array([[0, 1, 2, 0, 3, 4, 0, 5, 6, 7, 1, 2]])
    return Placement(p2l, 8, Topology(ep_size=4, num_physical_experts=12, num_nodes=2))


def test_sglang_static_second_replica_on_a_node_gets_nothing_from_that_node():
    pl = _two_node_placement()
    table = sglang_static_tables(pl)[:, 0, 0]  # expert 0, per rank
    assert table[0] == 0 and table[1] == 3  # own-GPU replicas
    assert table[2] == 6  # rank 2 holds one itself
    assert table[3] == 6  # node 1's only replica, which narrows the list
    # expert 1 (GPU 0 and GPU 3, one per node): each node's ranks use their node's replica
    assert list(sglang_static_tables(pl)[:, 0, 1]) == [1, 1, 10, 10]


def test_sglang_fair_choice_is_drawn_per_rank_so_ranks_need_not_split_evenly():
    # one node, 8 GPUs, every expert twice: ranks without a replica get a "fair" pick, but each rank
    # draws in its own process (its own generator state), so across ranks the split can be uneven.
    G, E = 8, 8
    pl = Placement(
        (np.arange(G * 2) % E)[None, :], E, Topology(ep_size=G, num_physical_experts=G * 2, num_nodes=1)
    )
    near = nearest_replica(pl, 0)
    table = sglang_static_tables(pl)[:, 0, :]
    spread = []
    for e in range(E):
        left = near[:, e] < 0
        replicas = pl.logical_to_physical_map[0, e][pl.logical_to_physical_map[0, e] >= 0]
        assert set(table[left, e]) <= set(replicas.tolist())
        assert np.all(table[~left, e] == near[~left, e])
        counts = np.array([(table[left, e] == r).sum() for r in replicas])
        spread.append(counts.max() - counts.min())
    assert max(spread) >= 2


def test_colocated_duplicate_only_the_first_is_chosen_by_its_gpu():
    # GPU 0 holds expert 0 twice: its own tokens use the first copy only, while other ranks may still
    # be sent to the second (the SGLang hazard: that copy may not even be loaded)
    p2l = np.array([[0, 0, 1, 2, 3, 1]])
    topo = Topology(ep_size=3, num_physical_experts=6, num_nodes=1)
    pl = Placement(p2l, 4, topo, allow_colocated_replicas=True)
    table = sglang_static_tables(pl)[:, 0, 0]
    assert table[0] == 0
    assert set(table[1:].tolist()) <= {0, 1}


@pytest.mark.parametrize("dispatch", ["sglang-static", "vllm-hash"])
def test_deterministic_models_expected_load_equals_routed_tokens(dispatch):
    trace = synthetic_trace(
        num_tokens=3000, num_layers=2, num_logical_experts=16, top_k=2, num_prompts=40, seed=3
    )
    p2l = np.array([np.r_[np.arange(16), np.arange(8)], np.r_[np.arange(16), np.arange(8, 16)]])
    pl = Placement(p2l, 16, Topology(ep_size=8, num_physical_experts=24, num_nodes=2))
    src = np.arange(trace.num_tokens) % 8
    rows = batch_positions(src, 64)
    slots = route_tokens(pl, trace.topk_ids, src, dispatch, batch_index=rows)
    assert np.array_equal(
        routed_gpu_tokens(pl, slots), trace_gpu_load(pl, trace, dispatch, src, step_tokens=64)
    )


def test_sglang_dynamic_expectation_matches_sampled_draws():
    trace = synthetic_trace(
        num_tokens=4000, num_layers=1, num_logical_experts=8, top_k=2, num_prompts=20, seed=1
    )
    pl = Placement(
        np.array([[0, 1, 2, 0, 3, 4, 0, 5, 6, 7, 1, 2]]),
        8,
        Topology(ep_size=4, num_physical_experts=12, num_nodes=2),
    )
    src = np.arange(trace.num_tokens) % 4
    expected = trace_gpu_load(pl, trace, "sglang-dynamic", src)
    sampled = np.mean(
        [
            routed_gpu_tokens(pl, route_tokens(pl, trace.topk_ids, src, "sglang-dynamic", seed=s))
            for s in range(20)
        ],
        axis=0,
    )
    assert np.allclose(sampled, expected, rtol=0.03)
    assert not np.allclose(expected, trace_gpu_load(pl, trace, "even", src))


def test_rank_choices_rows_sum_to_one_for_every_model():
    pl = _two_node_placement()
    for name in DISPATCH:
        slots, weights = rank_choices(pl, 0, name)
        assert np.allclose(weights.sum(axis=2), 1.0), name
        assert np.all(slots[weights > 0] >= 0)


def test_vllm_hash_known_values():
    # 3 * 2654435769 mod 2**32 = 3668340011; mod 3 = 2, mod 2 = 1
    assert vllm_hash_replica(np.array([3, 3, 0]), np.array([3, 2, 5])).tolist() == [2, 1, 0]


def test_unknown_dispatch_names_the_models():
    with pytest.raises(ValueError, match="sglang-static"):
        check_dispatch("sglang")


# ---------------------------------------------------------------------------------------------
# The registry's attributes agree with what each model does
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(DISPATCH))
def test_model_attributes_are_consistent(name):
    model = DISPATCH[name]
    assert model.name == name == str(model) and get_dispatch(name) is model and get_dispatch(model) is model
    assert model.route is not None or model.fractional  # no token route: the shares are exact
    assert model.fractional or model.route is not None  # routed token by token: it has a route
    # our runtime executes the shares' rotation, or a per-step split whose token route is the contract
    assert not model.runtime or model.route is None or model.needs_step_counts
    assert not model.table or model.needs_source_ranks  # a table is per source rank
    assert not model.needs_step_counts or model.step_load is not None
    assert bool(model.engine) == bool(model.version)  # an engine's model names its version
    assert name in dispatch_names(**{"runtime": model.runtime, "fractional": model.fractional})
    # what callers ask it agrees with what it needs
    assert not model.counts_only or not (
        model.needs_source_ranks or model.needs_batch_rows or model.needs_step_counts
    )
    assert not model.local_first or model.needs_source_ranks  # the tiers are the source's GPU and node
    assert not model.locality_fit or model.counts_only or model.local_first
    assert model.runtime == bool(model.runtime_route) and model.table == bool(model.table_fit)


@pytest.mark.parametrize("name", list(DISPATCH))
def test_what_a_model_says_is_what_it_does(name):
    """``counts_only``: the shares are 1/c from every rank; ``local_first``: the own GPU's replica takes
    all of a rank's tokens for an expert it holds, and a replica on the node takes them over remote ones."""
    model = DISPATCH[name]
    pl = _two_node_placement()
    slots, weights = rank_choices(pl, 0, name)  # [G, E, R]
    even_slots, even_weights = rank_choices(pl, 0, "even")
    if model.counts_only:
        assert np.array_equal(slots, even_slots) and np.allclose(weights, even_weights)
    t = pl.topology
    gpu = np.where(slots >= 0, slots // t.slots_per_gpu, -1)
    ranks = np.arange(t.ep_size)[:, None, None]
    own = (gpu == ranks) & (slots >= 0)  # [G, E, R]
    on_node = (gpu // t.gpus_per_node == ranks // t.gpus_per_node) & (slots >= 0)
    owned = own.any(axis=2)  # [G, E]
    near = on_node.any(axis=2) & ~owned
    local_like = np.allclose((weights * own).sum(axis=2)[owned], 1.0) and np.allclose(
        (weights * on_node).sum(axis=2)[near], 1.0
    )
    assert owned.any() and near.any()  # the placement has both tiers to check
    if model.local_first:
        assert local_like
    if model.counts_only:
        assert not local_like  # the even split sends tokens off a GPU that holds the expert


def test_a_model_that_leaves_a_question_unsaid_is_refused():
    before = dict(DISPATCH)
    said = {
        "counts_only": False,
        "local_first": False,
        "locality_fit": False,
        "table_fit": "",
        "runtime_route": "",
    }
    for left_out in said:
        model = DispatchModel(
            "half-said",
            "a test model",
            DISPATCH["even"].choices,
            **{k: v for k, v in said.items() if k != left_out},
        )
        with pytest.raises(ValueError, match=rf"'half-said' does not say {left_out}: give {left_out}="):
            register(model)
    contradictions = [  # (one answer over a complete set, what the refusal says)
        ({"runtime_route": "gpu"}, "runtime_route must be one of"),
        ({"local_first": True}, "set needs_source_ranks"),
        ({"runtime_route": "step"}, "set needs_step_counts"),
        ({"table_fit": "yes"}, "table_fit must be one of"),
    ]
    for answer, refusal in contradictions:
        with pytest.raises(ValueError, match=refusal):
            register(DispatchModel("odd", "a test model", DISPATCH["even"].choices, **{**said, **answer}))
    assert DISPATCH == before


def test_every_model_the_runtime_claims_has_a_route_builder():
    """Asserted complete: each ``runtime_route`` of a runtime model names something the runtime builds."""
    import importlib

    pytest.importorskip("torch")
    from runtime_hooks.ep_layer import RUNTIME_ROUTES, runtime_dispatch

    claimed = dispatch_names(runtime=True)
    assert claimed and {DISPATCH[n].runtime_route for n in claimed} <= set(RUNTIME_ROUTES)
    for where in RUNTIME_ROUTES.values():
        module, attr = where.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), attr))
    for name in claimed:
        assert runtime_dispatch(name).name == name


@pytest.mark.parametrize("name", list(DISPATCH))
def test_choices_pick_replicas_of_the_expert(name):
    pl = _two_node_placement()
    slots, weights = rank_choices(pl, 0, name)  # [G, E, R]
    p2l = pl.physical_to_logical_map[0]
    experts = np.broadcast_to(np.arange(8)[None, :, None], slots.shape)
    chosen = weights > 0
    assert np.array_equal(p2l[slots[chosen]], experts[chosen])
    if not DISPATCH[name].needs_source_ranks:  # the same choice from every rank
        assert np.array_equal(weights, np.broadcast_to(weights[:1], weights.shape))


def test_runtime_models_are_the_ones_the_runtime_executes():
    torch = pytest.importorskip("torch")
    from runtime_hooks.ep_layer import build_routing_tables, route_slots

    pl = _two_node_placement()
    rng = np.random.default_rng(0)
    ids = rng.integers(-1, 8, (50, 1, 2))
    src = rng.integers(0, 4, 50)
    tables = build_routing_tables(pl, 0)
    tok = torch.arange(50)
    for name, model in DISPATCH.items():
        if model.needs_step_counts:
            continue  # split per step from all-reduced counts: runtime_hooks.step_balance, not route_slots
        if model.runtime:
            got = route_slots(tables, torch.as_tensor(ids[:, 0]), tok, torch.as_tensor(src), name)
            assert np.array_equal(got.numpy(), route_tokens(pl, ids, src, name)[:, 0]), name
        else:
            with pytest.raises(ValueError):
                route_slots(tables, torch.as_tensor(ids[:, 0]), tok, torch.as_tensor(src), name)


def test_a_model_needing_step_counts_must_give_step_load():
    before = dict(DISPATCH)
    model = DispatchModel(
        "no-step-load", "missing its hook", DISPATCH["even"].choices, needs_step_counts=True
    )
    with pytest.raises(ValueError, match="give it a step_load"):
        register(model)
    assert DISPATCH == before


def test_engine_models_name_the_engine_setting_that_selects_them():
    """The flag values agree with the engines' capability table (read from their code, checked in
    tests/test_advise_engines.py): SGLang's ``--ep-dispatch-algorithm`` values, vLLM's ``--enable-eplb``."""
    from moe_placement.apps.advise.engines import ENGINES

    for model in DISPATCH.values():
        assert bool(model.engine) == bool(model.engine_flag), model.name
        if model.engine == "SGLang":
            flag, value = model.engine_flag
            assert flag == "--ep-dispatch-algorithm" and value in ENGINES["sglang"].dispatch_platforms
        elif model.engine == "vLLM":
            assert model.engine_flag == ("--enable-eplb",)
    values = [m.engine_flag[1] for m in DISPATCH.values() if m.engine == "SGLang"]
    assert len(set(values)) == len(values)  # one model per setting
    with pytest.raises(ValueError, match="give engine_flag"):
        said = {
            "counts_only": False,
            "local_first": False,
            "locality_fit": False,
            "table_fit": "",
            "runtime_route": "",
        }
        register(
            DispatchModel(
                "flagless", "an engine rule", DISPATCH["even"].choices, engine="X", version="1", **said
            )
        )
