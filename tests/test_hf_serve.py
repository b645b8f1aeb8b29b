"""Live serving with online rebalancing of a real transformers MoE model over 4 real gloo ranks.

One launch serves four runs of a tiny random Mixtral (hidden 32, 2 layers, 8 experts, 12 slots):
a clean live rebalance, a rank that raises mid-migration, tensors that arrive corrupted, and a
three-row placement mapped to the two MoE layers by ``rows``. Each is compared with greedy decoding of
the single-process model. A second launch runs the CLI; its bad-input checks launch nothing.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

from tiny_models import tiny_mixtral  # noqa: E402

from placement.dispatch import BALANCED  # noqa: E402
from placement.model import Placement  # noqa: E402
from runtime_hooks.hf_serve import ServeSpec, contiguous_placement, serve_many  # noqa: E402
from runtime_hooks.migration_core import FaultSpec  # noqa: E402

pytestmark = pytest.mark.slow

E, G = 8, 4


def start_placement(num_rows: int = 2) -> Placement:
    """Rank g holds experts 2g, 2g+1 and one replica (different per row): ``[num_rows, 12]``."""
    shift = (2, 5, 3)  # replica of row l on rank g: expert 2g + shift[l], never one the rank holds
    rows = [
        [e for g in range(G) for e in (2 * g, 2 * g + 1, (2 * g + shift[l]) % E)] for l in range(num_rows)
    ]
    return Placement.from_map(np.array(rows), E, ep_size=G)


@pytest.fixture(scope="module")
def reports():
    """clean / raise / corrupt -> ServeReport, all from one 4-rank launch."""
    base = dict(rebalance_every=3, new_tokens=8, seed=1)
    specs = {
        "clean": ServeSpec(tiny_mixtral(2, E), start_placement(), **base),
        "raise": ServeSpec(
            tiny_mixtral(2, E),
            start_placement(),
            faults=(FaultSpec(1, "raise"),),
            migration_timeout=3.0,
            **base,
        ),
        "corrupt": ServeSpec(
            tiny_mixtral(2, E),
            start_placement(),
            faults=tuple(FaultSpec(r, "corrupt") for r in range(G)),
            **base,
        ),
        "rows": ServeSpec(tiny_mixtral(2, E), start_placement(3), rows=(2, 0), **base),
        "balanced": ServeSpec(tiny_mixtral(2, E), start_placement(), dispatch=BALANCED.name, **base),
    }
    return dict(zip(specs, serve_many(list(specs.values()), timeout=240)))


def test_live_rebalance_keeps_tokens(reports):
    rep = reports["clean"]
    assert rep.ranks == G and rep.tokens.shape == (G, 2, 8)
    assert rep.tokens_match, (rep.tokens, rep.reference)
    assert rep.weights_match
    assert [e.step for e in rep.events] == [3, 6]
    assert rep.committed_moves >= 1
    assert all(e.committed for e in rep.events)
    assert (rep.final_map != rep.initial_map).any()
    moved = sum(e.moved_slots for e in rep.events)
    assert moved >= int((rep.final_map != rep.initial_map).sum()) > 0
    # picks per rank are accounted in full: windows add up to the run's total
    ev = rep.events
    assert np.array_equal(
        np.add(np.add(ev[0].load_before, ev[0].load_after), ev[1].load_after), rep.load_per_rank
    )
    assert len(ev[0].predicted_after) == G and rep.tokens_per_second > 0
    json.dumps(rep.to_dict())


@pytest.mark.parametrize(
    "name,needle", [("raise", "injected fault on rank 1"), ("corrupt", "checksum mismatch")]
)
def test_fault_mid_migration_keeps_old_placement(reports, name, needle):
    rep = reports[name]
    first = rep.events[0]
    assert not first.committed and first.moved_slots > 0
    assert needle in first.reason
    assert rep.tokens_match, (rep.tokens, rep.reference)  # the old placement kept serving
    assert rep.weights_match
    # the next attempt (no fault) commits
    assert rep.events[1].committed and rep.committed_moves >= 1


def test_rows_map_a_longer_placement_onto_the_moe_layers(reports):
    rep = reports["rows"]
    three = start_placement(3).physical_to_logical_map
    np.testing.assert_array_equal(rep.initial_map, three[[2, 0]])  # row 2 serves layer 0, row 0 layer 1
    assert rep.layer_ids == (0, 1)
    assert rep.tokens_match and rep.weights_match and rep.committed_moves >= 1


def test_balanced_dispatch_serves_the_quotas_across_migrations(reports):
    """Per-step quotas while the placement changes: the tokens stay the model's, every slot computed
    exactly the numpy quotas of every step (on the row it served then), the gather's cost is reported."""
    rep, even = reports["balanced"], reports["clean"]
    assert rep.tokens_match and rep.weights_match, (rep.tokens, rep.reference)
    assert rep.committed_moves >= 1 and (rep.final_map != rep.initial_map).any()
    assert rep.quotas_match is True and even.quotas_match is None
    assert rep.balanced_collective_bytes_per_layer == 4 * G * E
    assert len(rep.balanced_collective_us_per_layer) == 2
    assert all(u > 0 for u in rep.balanced_collective_us_per_layer)
    assert rep.load_per_rank.sum() == even.load_per_rank.sum()  # same routing, another split
    json.dumps(rep.to_dict())


def test_contiguous_placement_rejects_uneven_split():
    p = contiguous_placement(2, 8, 4, 4)
    assert p.physical_to_logical_map[0].tolist() == [0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 0]
    with pytest.raises(ValueError, match="8 experts and 3 redundant slots"):
        contiguous_placement(2, 8, 4, 3)


def test_cli_serve_demo(tmp_path, capsys):
    from moe_placement.cli.main import main

    cfg = tmp_path / "config.json"
    cfg.write_text(tiny_mixtral(2, E).to_json_string())
    argv = ["serve-demo", "--model", str(cfg), "--ranks", "4", "--rebalance-every", "3", "--new-tokens", "6"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "step 3: committed" in out and "per-rank load before" in out and "per-rank load after" in out
    assert "PASS: generated tokens equal" in out
    assert main(["serve-demo", "--model", str(cfg), "--ranks", "4", "--redundant", "3"]) == 2
    assert "3 redundant slots" in capsys.readouterr().err


def test_cli_serve_demo_refuses_bad_input_in_one_line(tmp_path, capsys):
    from moe_placement.cli.main import main
    from placement.dispatch import dispatch_names
    from placement.formats import write_placement

    cfg = tmp_path / "config.json"
    cfg.write_text(tiny_mixtral(2, E).to_json_string())
    three = tmp_path / "three.json"
    write_placement(start_placement(3), three, "native")
    offline = dispatch_names(runtime=False)[-1]
    base = ["serve-demo", "--model", str(cfg), "--ranks", "4"]
    cases = (
        (["--timeout", "0"], "--timeout must be a finite number > 0, got 0.0"),
        (["--timeout", "-5"], "--timeout must be a finite number > 0"),
        (["--ranks", "0"], "--ranks must be >= 1, got 0"),
        (["--ranks", "100000"], "above the limit of"),
        (["--new-tokens", "0"], "--new-tokens must be >= 1"),
        (["--seed", "-2"], "--seed must be >= 0, got -2"),
        (["--redundant", "-4"], "--redundant must be >= 0"),
        (["--max-moves", "-1"], "--max-moves must be >= 0"),
        (["--dispatch", offline], f"{offline!r} is scored offline only"),
        (["--layers", "0", "1"], "--layers maps the rows of --placement"),
        (["--placement", str(three)], "the model has 2 MoE layers"),
        (["--placement", str(three), "--layers", "0"], "--layers names 1 placement rows"),
        (["--placement", str(three), "--layers", "0", "3"], "--layers [3] outside the placement's rows 0..2"),
    )
    for extra, needle in cases:
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, (extra, err)
