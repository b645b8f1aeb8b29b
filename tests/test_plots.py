"""Figures: every plot renders to a real PNG; inspect_plots writes the expected set atomically."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from placement import plots as placement_plots  # noqa: E402
from placement.model import Placement  # noqa: E402
from placement.topology import Topology  # noqa: E402
from profiling import plots, stats  # noqa: E402
from profiling.synthetic import synthetic_trace  # noqa: E402
from profiling.trace import RoutingTrace  # noqa: E402
from solver.greedy import greedy_placement  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small_trace():
    return synthetic_trace(
        num_tokens=3000, num_layers=4, num_logical_experts=16, top_k=2, num_prompts=30, seed=1
    )


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_module_imports_without_matplotlib_loaded():
    code = "import sys, profiling.plots, placement.plots; print('matplotlib' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )
    assert out.stdout.strip() == "False"


def test_each_figure_renders(small_trace, tmp_path):
    load = small_trace.counts()
    wl = stats.window_loads(small_trace, 5)
    co = stats.coactivation(small_trace, layers=[0])[0]
    figs = {
        "heat": plots.load_heatmap(load, small_trace.layer_ids),
        "heat_ids": plots.load_heatmap(load, sort=False),
        "lorenz": plots.lorenz_plot(load, small_trace.layer_ids),
        "drift": plots.drift_plot(stats.window_drift(wl), small_trace.layer_ids),
        "co": plots.coactivation_heatmap(
            stats.coactivation_lift(co, small_trace.num_tokens), order=np.argsort(-load[0])
        ),
        "co_counts": plots.coactivation_heatmap(co, log_scale=False, label="pairs"),
        "bars": plots.gpu_load_bars(np.array([[3.0, 1.0], [2.0, 2.0]]), np.array([[2.0, 2.0], [2.0, 2.0]])),
        "bars1": plots.gpu_load_bars([5.0, 1.0, 3.0], [3.0, 3.0, 3.0]),
        "domains": plots.domain_distance_plot(stats.domain_distance(wl[:3]), ["a", "b", "c"]),
    }
    for name, fig in figs.items():
        p = plots.save_figure(fig, tmp_path / f"{name}.png")
        w, h = _png_size(p)
        assert w > 200 and h > 200
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporaries
    assert plots.to_png(figs["heat"])[:8] == PNG


def test_gpu_bars_default_to_the_worst_layer():
    fig = plots.gpu_load_bars(np.array([[1.0, 1.0], [4.0, 0.0]]), np.ones((2, 2)), layer_ids=[5, 9])
    assert "layer 9" in fig.axes[0].get_title()


def test_bad_inputs_raise_value_errors():
    with pytest.raises(ValueError, match="before"):
        plots.gpu_load_bars(np.ones((2, 3)), np.ones((2, 4)))
    with pytest.raises(ValueError, match=r"\[E, E\]"):
        plots.coactivation_heatmap(np.ones((2, 3)))
    with pytest.raises(ValueError, match="layer_ids"):
        plots.load_heatmap(np.ones((2, 3)), layer_ids=[1])
    with pytest.raises(ValueError, match="drift"):
        plots.drift_plot({"x": np.ones((2, 2))})


def test_inspect_plots_token_trace_with_placement(small_trace, tmp_path):
    topo = Topology.from_redundant(16, 4, 4, 2)
    pl, _ = greedy_placement(small_trace.counts(), topo, layer_ids=small_trace.layer_ids)
    out = tmp_path / "plots"
    paths = placement_plots.inspect_plots(small_trace, out, placement=pl)
    assert [p.name for p in paths] == [
        "load_heatmap.png",
        "lorenz.png",
        "drift.png",
        "coactivation.png",
        "gpu_load.png",
    ]
    for p in paths:
        assert p.parent == out and _png_size(p)[0] > 200


def test_inspect_plots_counts_trace_with_domains(tmp_path):
    rng = np.random.default_rng(0)
    wc = rng.integers(0, 100, (3, 2, 8))
    tr = RoutingTrace(
        num_logical_experts=8, window_counts=wc, window_labels=("arxiv", "github", "c4"), layer_ids=(0, 7)
    )
    names = [p.name for p in plots.inspect_plots(tr, tmp_path)]
    assert names == ["load_heatmap.png", "lorenz.png", "drift.png", "domain_distance.png"]
    one = RoutingTrace(num_logical_experts=8, window_counts=wc[:1])
    assert [p.name for p in plots.inspect_plots(one, tmp_path / "one")] == ["load_heatmap.png", "lorenz.png"]


def test_inspect_plots_real_olmoe(olmoe_trace, tmp_path):
    topo = Topology.from_redundant(olmoe_trace.num_logical_experts, 0, 8)
    pl = Placement.trivial(
        olmoe_trace.num_layers, olmoe_trace.num_logical_experts, topo, layer_ids=olmoe_trace.layer_ids
    )
    paths = placement_plots.inspect_plots(olmoe_trace, tmp_path, placement=pl)
    assert {"domain_distance.png", "gpu_load.png"} <= {p.name for p in paths}
