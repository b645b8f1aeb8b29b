import numpy as np
import pytest

from placement import Placement, Topology, compute_logical_maps


def test_topology_derived_maps():
    t = Topology(ep_size=4, num_physical_experts=12, num_nodes=2)
    assert t.slots_per_gpu == 3 and t.gpus_per_node == 2
    assert t.gpu_of_slot.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert t.node_of_slot.tolist() == [0] * 6 + [1] * 6
    assert t.node_of_gpu.tolist() == [0, 0, 1, 1]
    assert Topology.from_dict(t.to_dict()) == t


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(ep_size=7, num_physical_experts=288), "288 physical experts do not divide over ep_size=7"),
        (dict(ep_size=8, num_physical_experts=16, num_nodes=3), "ep_size=8 does not divide over num_nodes=3"),
        (dict(ep_size=0, num_physical_experts=16), "ep_size must be >= 1"),
    ],
)
def test_topology_errors_name_the_numbers(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        Topology(**kwargs)


def test_from_redundant_suggests_divisible_counts():
    with pytest.raises(ValueError) as exc:
        Topology.from_redundant(256, 30, 32)
    assert "use 0 or 32 redundant experts" in str(exc.value)
    assert Topology.from_redundant(256, 32, 32).num_physical_experts == 288


def test_derived_maps_match_definition():
    p2l = np.array([[0, 1, 2, 0, 3, 1], [3, 2, 1, 0, 2, 2]])
    l2p, cnt = compute_logical_maps(p2l, 4)
    assert cnt.tolist() == [[2, 2, 1, 1], [1, 1, 3, 1]]
    assert l2p.shape == (2, 4, 3)
    assert l2p[0, 0].tolist() == [0, 3, -1]
    assert l2p[1, 2].tolist() == [1, 4, 5]
    # every slot listed exactly once and maps back to its expert
    for l in range(2):
        slots = l2p[l][l2p[l] >= 0]
        assert sorted(slots.tolist()) == list(range(6))
        for e in range(4):
            for s in l2p[l, e][l2p[l, e] >= 0]:
                assert p2l[l, s] == e


def _topo():
    return Topology(ep_size=3, num_physical_experts=6, num_nodes=1)


@pytest.mark.parametrize(
    "p2l, E, fragment",
    [
        ([[0, 1, 2, 3, 0, 5]], 5, "layer 0 slot 5 holds expert id 5, outside \\[0, 5\\)"),
        ([[0, 1, 2, 3, 0, 1]], 5, "logical expert 4 has no replica"),
        ([[0, 0, 1, 2, 3, 4]], 5, "GPU 0 holds two replicas of expert 0"),
        ([[0, 1, 2, 3, 4]], 5, "has 5 slots per layer but the topology has 6"),
        ([0, 1, 2, 3, 4, 0], 5, "must be 2-D"),
        ([[0, 1, 2, 3, 4, 0.5]], 5, "integer expert ids"),
        ([[0, 1, 2, 3, 4, 0]], 7, "7 logical experts cannot fit in 6 physical slots"),
    ],
)
def test_validation_errors(p2l, E, fragment):
    with pytest.raises(ValueError, match=fragment):
        Placement(np.array(p2l), E, _topo())


def test_placement_is_read_only_and_layer_ids_checked():
    p = Placement(np.array([[0, 1, 2, 3, 4, 0]]), 5, _topo(), layer_ids=(3,))
    with pytest.raises(ValueError):
        p.physical_to_logical_map[0, 0] = 1
    with pytest.raises(ValueError, match="layer_ids has 2 entries but the map has 1 layers"):
        Placement(np.array([[0, 1, 2, 3, 4, 0]]), 5, _topo(), layer_ids=(1, 2))


def test_trivial_and_from_map():
    t = Topology(ep_size=4, num_physical_experts=12, num_nodes=2)
    p = Placement.trivial(2, 10, t, layer_ids=(1, 2))
    assert p.physical_to_logical_map[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    assert p.logical_replica_count[0].tolist() == [2, 2] + [1] * 8
    q = Placement.from_map(p.physical_to_logical_map, ep_size=4, num_nodes=2, layer_ids=(1, 2))
    assert q == p and q.num_logical_experts == 10
    mask = p.replica_gpu_mask
    assert mask.shape == (2, 10, 4) and mask.sum() == 24
    assert mask[0, 0].tolist() == [1, 0, 0, 1]


@pytest.mark.parametrize(
    "args", [("64", 32, 32), (64, 32.0, 32), (64, 32, True), (64, 32, 32, None), (64, [32], 32)]
)
def test_from_redundant_refuses_non_integers_naming_the_field(args):
    with pytest.raises(ValueError, match="must be an integer"):
        Topology.from_redundant(*args)
