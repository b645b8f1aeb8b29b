"""Placement file formats: round trips, layer-axis conversions, sidecars, atomic writes, bad input."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import yaml

from moe_placement.base.fileio import InputFileError
from placement.formats import FORMATS, detect_format, read_placement, sidecar_path, write_placement
from placement.model import Placement
from placement.topology import Topology

# 4 experts, 8 slots on 4 GPUs (2 slots each) in 2 nodes; MoE layers 1 and 3 of a 5-layer model.
MAP = np.array(
    [
        [0, 1, 2, 3, 0, 1, 2, 3],
        [3, 0, 1, 2, 0, 3, 2, 1],
    ]
)
LAYER_IDS = (1, 3)

CASES = [
    ("native", "placement.json"),
    ("sglang", "init_expert_location.json"),
    ("sglang", "init_expert_location.pt"),
    ("trtllm", "moe_load_balancer.yaml"),
    ("vllm-ascend", "expert_map.json"),
    ("vllm", "eplb_initial_mapping.json"),
]


@pytest.fixture
def placement() -> Placement:
    topo = Topology(ep_size=4, num_physical_experts=8, num_nodes=2)
    return Placement(MAP, 4, topo, LAYER_IDS, {"solver": "hand", "seed": np.int64(3), "load": np.arange(3)})


@pytest.mark.parametrize("fmt,name", CASES)
def test_round_trip_every_format(tmp_path, placement, fmt, name):
    files = write_placement(placement, tmp_path / name, fmt)
    assert files[0] == tmp_path / name
    assert all(f.is_file() for f in files)
    assert detect_format(tmp_path / name) == fmt
    back = read_placement(tmp_path / name)
    assert back == placement
    assert back.layer_ids == LAYER_IDS
    assert back.topology.num_nodes == 2
    assert back.provenance["solver"] == "hand"
    # explicit format works too, and a wrong one is refused
    assert read_placement(tmp_path / name, fmt) == placement
    other = "native" if fmt != "native" else "sglang"
    with pytest.raises(InputFileError, match="content"):
        read_placement(tmp_path / name, other)


def test_formats_constant_lists_every_writer():
    assert FORMATS == ("native", "sglang", "trtllm", "vllm-ascend", "vllm")
    with pytest.raises(ValueError, match="unknown placement format"):
        read_placement("x.json", "deepspeed")


# ---- SGLang -------------------------------------------------------------------------------------


def test_sglang_file_has_exactly_one_key_and_dense_rows(tmp_path, placement):
    path = tmp_path / "loc.json"
    files = write_placement(placement, path, "sglang", num_hidden_layers=5)
    assert files == [path, sidecar_path(path)]
    doc = json.loads(path.read_text())
    assert list(doc) == ["physical_to_logical_map"]
    full = np.array(doc["physical_to_logical_map"])
    assert full.shape == (5, 8)  # every hidden layer is a row
    trivial = np.arange(8) % 4
    for row in (0, 2, 4):  # dense layers: trivial map
        assert full[row].tolist() == trivial.tolist()
    assert full[1].tolist() == MAP[0].tolist()
    assert full[3].tolist() == MAP[1].tolist()


def test_sglang_default_rows_is_max_layer_plus_one(tmp_path, placement):
    path = tmp_path / "loc.json"
    write_placement(placement, path, "sglang")
    assert np.array(json.loads(path.read_text())["physical_to_logical_map"]).shape == (4, 8)


def test_sglang_sidecar_contents(tmp_path, placement):
    path = tmp_path / "loc.json"
    write_placement(placement, path, "sglang", num_hidden_layers=5)
    meta = json.loads(sidecar_path(path).read_text())
    assert sidecar_path(path).name == "loc.json.meta.json"
    assert meta["schema"] == "moe-placement/placement-sidecar"
    assert meta["format"] == "sglang"
    assert meta["num_hidden_layers"] == 5
    assert meta["layer_ids"] == [1, 3]
    assert meta["num_logical_experts"] == 4
    assert meta["topology"] == {"ep_size": 4, "num_nodes": 2, "num_physical_experts": 8, "slots_per_gpu": 2}
    assert meta["provenance"] == {"solver": "hand", "seed": 3, "load": [0, 1, 2]}


def test_sglang_pt_holds_one_tensor(tmp_path, placement):
    torch = pytest.importorskip("torch")
    path = tmp_path / "loc.pt"
    write_placement(placement, path, "sglang", num_hidden_layers=5)
    data = torch.load(path, weights_only=True)
    assert list(data) == ["physical_to_logical_map"]
    assert tuple(data["physical_to_logical_map"].shape) == (5, 8)
    assert data["physical_to_logical_map"][3].tolist() == MAP[1].tolist()


def test_sglang_without_sidecar_needs_ep_size(tmp_path, placement):
    path = tmp_path / "loc.json"
    write_placement(placement, path, "sglang", num_hidden_layers=5)
    sidecar_path(path).unlink()
    with pytest.raises(InputFileError, match="no sidecar.*pass ep_size"):
        read_placement(path)
    # with the MoE layer ids the dense rows are skipped
    back = read_placement(path, ep_size=4, num_nodes=2, layer_ids=[1, 3])
    assert back == placement
    # without them every row is a layer (dense rows hold the trivial map)
    every = read_placement(path, ep_size=4)
    assert every.layer_ids == (0, 1, 2, 3, 4)
    assert np.array_equal(every.physical_to_logical_map[[1, 3]], MAP)
    with pytest.raises(InputFileError, match="outside"):
        read_placement(path, ep_size=4, layer_ids=[1, 7])


def test_sidecar_conflict_with_arguments_is_an_error(tmp_path, placement):
    path = tmp_path / "loc.json"
    write_placement(placement, path, "sglang")
    assert read_placement(path, ep_size=4) == placement  # agreeing is fine
    with pytest.raises(InputFileError, match="ep_size=2 was given but the sidecar"):
        read_placement(path, ep_size=2)


def test_sglang_num_hidden_layers_too_small(tmp_path, placement):
    with pytest.raises(ValueError, match="num_hidden_layers=3.*>= 4"):
        write_placement(placement, tmp_path / "loc.json", "sglang", num_hidden_layers=3)
    assert list(tmp_path.iterdir()) == []


def test_sglang_logical_count_file_is_explained(tmp_path):
    path = tmp_path / "counts.json"
    path.write_text(json.dumps({"logical_count": [[1, 2], [3, 4]]}))
    with pytest.raises(InputFileError, match="logical_count"):
        read_placement(path, ep_size=1)


# ---- TensorRT-LLM -------------------------------------------------------------------------------


def test_trtllm_yaml_uses_real_layer_ids(tmp_path, placement):
    path = tmp_path / "moe_load_balancer.yaml"
    write_placement(placement, path, "trtllm")
    doc = yaml.safe_load(path.read_text())
    assert set(doc) == {"num_slots", "layer_updates_per_iter", "initial_global_assignments"}
    assert doc["num_slots"] == 8
    assert doc["layer_updates_per_iter"] == 0
    assert list(doc["initial_global_assignments"]) == [1, 3]
    assert doc["initial_global_assignments"][3] == MAP[1].tolist()
    assert all(type(x) is int for row in doc["initial_global_assignments"].values() for x in row)


def test_trtllm_without_sidecar_needs_ep_size(tmp_path, placement):
    path = tmp_path / "moe_load_balancer.yaml"
    write_placement(placement, path, "trtllm")
    sidecar_path(path).unlink()
    with pytest.raises(InputFileError, match="ep_size"):
        read_placement(path)
    back = read_placement(path, ep_size=4, num_nodes=2)
    assert back == placement and back.layer_ids == (1, 3)
    only3 = read_placement(path, ep_size=4, layer_ids=[3])
    assert only3.layer_ids == (3,) and only3.physical_to_logical_map.tolist() == [MAP[1].tolist()]


# ---- vLLM-Ascend and vLLM -----------------------------------------------------------------------


def test_vllm_ascend_device_lists(tmp_path, placement):
    path = tmp_path / "expert_map.json"
    write_placement(placement, path, "vllm-ascend")
    doc = json.loads(path.read_text())
    assert doc["moe_layer_count"] == 2
    layer = doc["layer_list"][1]
    assert layer["layer_id"] == 1 and layer["device_count"] == 4
    assert [d["device_id"] for d in layer["device_list"]] == [0, 1, 2, 3]
    assert [d["device_expert"] for d in layer["device_list"]] == MAP[1].reshape(4, 2).tolist()
    sidecar_path(path).unlink()
    back = read_placement(path)  # ep_size comes from device_count
    assert back.topology.ep_size == 4
    assert back.layer_ids == (0, 1)
    assert np.array_equal(back.physical_to_logical_map, MAP)
    assert read_placement(path, num_nodes=2, layer_ids=[1, 3]) == placement


def test_vllm_ascend_device_order_follows_device_id(tmp_path):
    doc = {
        "moe_layer_count": 1,
        "layer_list": [
            {
                "layer_id": 0,
                "device_count": 2,
                "device_list": [
                    {"device_id": 1, "device_expert": [2, 3]},
                    {"device_id": 0, "device_expert": [0, 1]},
                ],
            }
        ],
    }
    path = tmp_path / "m.json"
    path.write_text(json.dumps(doc))
    assert read_placement(path).physical_to_logical_map.tolist() == [[0, 1, 2, 3]]


def test_vllm_ascend_unequal_devices_is_an_error(tmp_path):
    doc = {
        "moe_layer_count": 1,
        "layer_list": [
            {
                "layer_id": 0,
                "device_count": 2,
                "device_list": [
                    {"device_id": 0, "device_expert": [0, 1, 2]},
                    {"device_id": 1, "device_expert": [3]},
                ],
            }
        ],
    }
    path = tmp_path / "m.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InputFileError, match="different numbers of experts"):
        read_placement(path)


def test_vllm_record_fields(tmp_path, placement):
    path = tmp_path / "mapping.json"
    write_placement(placement, path, "vllm")
    doc = json.loads(path.read_text())
    assert doc["record_type"] == "eplb_initial_mapping" and doc["version"] == 1
    assert doc["num_slots"] == 8 and doc["num_redundant_experts"] == 4
    assert doc["initial_global_assignments"] == {"1": MAP[0].tolist(), "3": MAP[1].tolist()}
    sidecar_path(path).unlink()
    with pytest.raises(InputFileError, match="pass ep_size"):
        read_placement(path)
    assert read_placement(path, ep_size=4, num_nodes=2) == placement


# ---- atomic writes ------------------------------------------------------------------------------


def _corrupted(placement: Placement) -> Placement:
    """A placement object whose map was damaged after validation (expert 3 has no replica)."""
    bad = np.array(placement.physical_to_logical_map)
    bad[bad == 3] = 0
    obj = Placement(MAP, 4, placement.topology, LAYER_IDS)
    object.__setattr__(obj, "physical_to_logical_map", bad)
    return obj


@pytest.mark.parametrize("fmt,name", CASES)
def test_failed_write_leaves_existing_file_untouched(tmp_path, placement, fmt, name):
    path = tmp_path / name
    path.write_bytes(b"previous content")
    sidecar_path(path).write_bytes(b"previous sidecar")
    with pytest.raises(ValueError, match="no replica"):
        write_placement(_corrupted(placement), path, fmt)
    assert path.read_bytes() == b"previous content"
    assert sidecar_path(path).read_bytes() == b"previous sidecar"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [name, sidecar_path(path).name]
    )  # no temp files


def test_write_into_missing_folder_fails_cleanly(tmp_path, placement):
    with pytest.raises(InputFileError, match="does not exist"):
        write_placement(placement, tmp_path / "nope" / "p.json", "sglang")
    assert not (tmp_path / "nope").exists()


def test_write_rejects_non_placement_and_bad_options(tmp_path, placement):
    with pytest.raises(ValueError, match="needs a Placement"):
        write_placement(MAP, tmp_path / "p.json")
    with pytest.raises(ValueError, match="unknown placement format"):
        write_placement(placement, tmp_path / "p.json", "deepep")
    with pytest.raises(ValueError, match="sglang format only"):
        write_placement(placement, tmp_path / "p.json", "trtllm", num_hidden_layers=5)
    assert list(tmp_path.iterdir()) == []


def test_overwrite_replaces_file(tmp_path, placement):
    path = tmp_path / "p.json"
    path.write_text("old")
    write_placement(placement, path)
    assert read_placement(path) == placement


# ---- malformed input ----------------------------------------------------------------------------


def _write(path: pathlib.Path, obj) -> pathlib.Path:
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


@pytest.mark.parametrize(
    "doc,match",
    [
        ({"physical_to_logical_map": [[0, 1, 2, 3]], "ep_size": 2}, "exactly one key"),
        ({"physical_to_logical_map": [[0, 1, 2, 3], [0, 1]]}, "2-D array of integer"),
        ({"physical_to_logical_map": [0, 1, 2, 3]}, "2-D array of integer"),
        ({"physical_to_logical_map": [[0, 1.5, 2, 3]]}, "2-D array of integer"),
        ({"physical_to_logical_map": [[0, "1", 2, 3]]}, "2-D array of integer"),
        ({"physical_to_logical_map": [[0, 1, 2, -1]]}, "outside"),
        ({"physical_to_logical_map": [[0, 1, 1, 3]]}, "no replica"),
        ({"physical_to_logical_map": [[0, 1, 2]]}, "do not divide"),
        ({"hello": 1}, "not a placement file"),
        ([1, 2, 3], "not a placement file"),
    ],
)
def test_malformed_sglang_json(tmp_path, doc, match):
    path = _write(tmp_path / "x.json", doc)
    with pytest.raises(InputFileError, match=match) as info:
        read_placement(path, ep_size=2)
    assert str(path) in str(info.value)


def test_ids_out_of_range_named(tmp_path):
    path = _write(tmp_path / "x.json", {"physical_to_logical_map": [[0, 1, 2, 9]]})
    with pytest.raises(InputFileError, match=r"expert id 9, outside \[0, 4\)"):
        read_placement(path, ep_size=2, num_logical_experts=4)


@pytest.mark.parametrize(
    "doc,match",
    [
        ({"num_slots": 4, "initial_global_assignments": {1: [0, 1, 2]}}, "has 3 entries, expected 4"),
        ({"num_slots": 4, "initial_global_assignments": {"x": [0, 1, 2, 3]}}, "layer id"),
        ({"num_slots": 4, "initial_global_assignments": {1: [0, 1, True, 3]}}, "integer expert ids"),
        (
            {"num_slots": "4", "initial_global_assignments": {1: [0, 1, 2, 3]}},
            "'num_slots' must be an integer",
        ),
        ({"num_slots": 4, "initial_global_assignments": []}, "non-empty mapping"),
        ({"num_slots": 4, "initial_global_assignments": {1: [0, 1, 2, 3]}, "enable": 1}, "unknown field"),
        ({"num_slots": 4, "initial_global_assignments": {1: [0, 1, 2, 7]}}, "8 logical experts cannot fit"),
        ({"num_slots": 4, "initial_global_assignments": {1: [0, 1, 1, 3]}}, "no replica"),
    ],
)
def test_malformed_trtllm_yaml(tmp_path, doc, match):
    path = tmp_path / "lb.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(InputFileError, match=match):
        read_placement(path, ep_size=2)


def test_malformed_vllm_ascend(tmp_path):
    base = {
        "moe_layer_count": 1,
        "layer_list": [
            {
                "layer_id": 0,
                "device_count": 2,
                "device_list": [
                    {"device_id": 0, "device_expert": [0, 1]},
                    {"device_id": 1, "device_expert": [2, 3]},
                ],
            }
        ],
    }
    assert read_placement(_write(tmp_path / "ok.json", base)).num_layers == 1
    cases = [
        ({**base, "moe_layer_count": 2}, "moe_layer_count=2 but layer_list has 1"),
        ({**base, "layer_list": "x"}, "non-empty list"),
        ({**base, "layer_list": [{**base["layer_list"][0], "device_count": 3}]}, "device_count=3"),
        (
            {
                **base,
                "layer_list": [
                    {**base["layer_list"][0], "device_list": [{"device_id": 0}, {"device_id": 1}]}
                ],
            },
            "device_expert",
        ),
        (
            {
                **base,
                "layer_list": [
                    {
                        **base["layer_list"][0],
                        "device_list": [
                            {"device_id": 0, "device_expert": [0, 1]},
                            {"device_id": 0, "device_expert": [2, 3]},
                        ],
                    }
                ],
            },
            "repeated",
        ),
    ]
    for i, (doc, match) in enumerate(cases):
        with pytest.raises(InputFileError, match=match):
            read_placement(_write(tmp_path / f"bad{i}.json", doc))
    with pytest.raises(InputFileError, match="ep_size=4 was given but the file lists 2"):
        read_placement(tmp_path / "ok.json", ep_size=4)


def test_malformed_native(tmp_path, placement):
    path = tmp_path / "p.json"
    write_placement(placement, path)
    good = json.loads(path.read_text())
    cases = [
        ({**good, "schema_version": 7}, "newer than this reader"),
        ({k: v for k, v in good.items() if k != "num_logical_experts"}, "num_logical_experts"),
        ({**good, "topology": [4, 8]}, "'topology' must be an object"),
        ({**good, "topology": {"ep_size": 3, "num_nodes": 1}}, "do not divide|slots_per_gpu"),
        ({**good, "layer_ids": [1]}, "layer_ids"),
        ({**good, "provenance": 5}, "provenance"),
        ({**good, "allow_colocated_replicas": "yes"}, "true or false"),
    ]
    for i, (doc, match) in enumerate(cases):
        with pytest.raises(InputFileError, match=match):
            read_placement(_write(tmp_path / f"bad{i}.json", doc))
    with pytest.raises(InputFileError, match="ep_size=8 was given but the file says 4"):
        read_placement(path, ep_size=8)


@pytest.mark.parametrize("fmt,name", CASES)
def test_truncated_files_raise_input_file_error(tmp_path, placement, fmt, name):
    """Every prefix of a valid file is either rejected with InputFileError or (rarely) still valid."""
    src = tmp_path / "src" / name
    src.parent.mkdir()
    write_placement(placement, src, fmt)
    data = src.read_bytes()
    cut_dir = tmp_path / "cut"
    cut_dir.mkdir()
    cuts = sorted(set(np.linspace(0, len(data) - 1, 25).astype(int).tolist()))
    for n in cuts:
        path = cut_dir / name
        path.write_bytes(data[:n])
        try:
            got = read_placement(path, ep_size=4, num_nodes=2, layer_ids=[1, 3])
        except InputFileError as exc:
            assert str(path) in str(exc)
        else:  # a YAML prefix can still parse; then it must still be a valid placement
            assert isinstance(got, Placement)


def test_truncated_json_message_names_position(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"physical_to_logical_map": [[0, 1,')
    with pytest.raises(InputFileError, match="invalid JSON at line 1"):
        read_placement(path, ep_size=1)


def test_yaml_python_tags_are_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "lb.yaml"
    path.write_text(
        f"num_slots: !!python/object/apply:os.mkdir ['{marker}']\ninitial_global_assignments: {{}}\n"
    )
    with pytest.raises(InputFileError, match="unsafe YAML"):
        read_placement(path, ep_size=1)
    assert not marker.exists()


class _Exploit:
    """Pickling this records a call to ``Path.touch``: loading it unsafely would create the marker."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_pt_with_pickled_object_is_refused(tmp_path):
    torch = pytest.importorskip("torch")
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"physical_to_logical_map": _Exploit(marker)}, path)
    with pytest.raises(InputFileError, match="never pickled objects"):
        read_placement(path, ep_size=1)
    assert not marker.exists()


def test_pt_truncated_and_wrong_content(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "loc.pt"
    torch.save({"physical_to_logical_map": torch.tensor([[0, 1, 2, 3]])}, path)
    assert read_placement(path, ep_size=2).num_logical_experts == 4
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputFileError, match="not a safe torch.save file"):
        read_placement(path, ep_size=2)
    torch.save(torch.tensor([[0, 1, 2, 3]]), path)
    with pytest.raises(InputFileError, match="not a placement file"):
        read_placement(path, ep_size=2)
    torch.save({"physical_to_logical_map": torch.tensor([[0.0, 1.0, 2.0, 3.0]])}, path)
    with pytest.raises(InputFileError, match="integer"):
        read_placement(path, ep_size=2)


def test_missing_file_and_bad_sidecar(tmp_path, placement):
    with pytest.raises(InputFileError, match="no such file"):
        read_placement(tmp_path / "absent.json")
    path = tmp_path / "loc.json"
    write_placement(placement, path, "sglang")
    sidecar_path(path).write_text('{"schema": "other"}')
    with pytest.raises(InputFileError, match="not a placement sidecar"):
        read_placement(path)
    sidecar_path(path).write_text("{broken")
    with pytest.raises(InputFileError, match="invalid JSON"):
        read_placement(path)


def test_colocated_parity_placement_round_trips(tmp_path):
    topo = Topology(ep_size=2, num_physical_experts=6, num_nodes=1)
    colocated = Placement(np.array([[0, 0, 1, 2, 3, 1]]), 4, topo, (0,), {}, allow_colocated_replicas=True)
    for fmt, name in [("native", "p.json"), ("sglang", "s.json"), ("trtllm", "t.yaml")]:
        write_placement(colocated, tmp_path / name, fmt)
        back = read_placement(tmp_path / name)
        assert back == colocated and back.allow_colocated_replicas


# ---- the real DeepSeek-V2-Lite trace ------------------------------------------------------------


def test_deepseek_greedy_placement_in_every_format(tmp_path, deepseek_trace):
    from solver.greedy import greedy_placement

    topo = Topology.from_redundant(64, 16, ep_size=8, num_nodes=2)
    placement, _ = greedy_placement(deepseek_trace.counts(), topo, layer_ids=deepseek_trace.layer_ids)
    assert placement.layer_ids == tuple(range(1, 27))
    for fmt, name in CASES:
        write_placement(placement, tmp_path / name, fmt)
        assert read_placement(tmp_path / name) == placement, fmt
    full = np.array(
        json.loads((tmp_path / "init_expert_location.json").read_text())["physical_to_logical_map"]
    )
    assert full.shape == (27, 80)
    assert full[0].tolist() == (np.arange(80) % 64).tolist()  # layer 0 of DeepSeek-V2-Lite is dense
    assert np.array_equal(full[1:], placement.physical_to_logical_map)
    gia = yaml.safe_load((tmp_path / "moe_load_balancer.yaml").read_text())["initial_global_assignments"]
    assert sorted(gia) == list(range(1, 27))


@pytest.mark.parametrize(
    "fmt, name, fragment",
    [
        ("native", "p.pt", "read back as SGLang's torch.save map; name it .json"),
        ("vllm", "p.pth", "name it .json"),
        ("trtllm", "p.pt", "name it .yaml"),
        ("trtllm", "p.json", "TensorRT-LLM's file is YAML"),
    ],
)
def test_a_name_that_would_not_read_back_is_refused_before_writing(tmp_path, placement, fmt, name, fragment):
    with pytest.raises(ValueError, match=fragment):
        write_placement(placement, tmp_path / name, fmt)
    assert list(tmp_path.iterdir()) == []
    for ok in ("p.json", "p.yaml", "p.txt") if fmt != "trtllm" else ("p.yaml", "p.yml"):
        write_placement(placement, tmp_path / ok, fmt)
        assert read_placement(tmp_path / ok) == placement  # every accepted name reads back
