"""Figures that need a placement's metrics (viz extra: matplotlib, imported only when drawing).

The trace-only figures are in :mod:`profiling.plots`; this module adds the per-GPU load of a
placement next to the trivial one. Shapes: L layers, E logical experts, G GPUs.
"""

from __future__ import annotations

import logging
from pathlib import Path

from placement.metrics import expected_gpu_load
from placement.model import Placement
from profiling.plots import gpu_load_bars, save_figure, trace_plots
from profiling.trace import RoutingTrace

__all__ = ["inspect_plots", "placement_gpu_load_plot"]

log = logging.getLogger(__name__)


def placement_gpu_load_plot(placement: Placement, trace: RoutingTrace, *, title: str | None = None):
    """Per-GPU load ``[L, G]`` of the trivial placement vs ``placement`` under the even policy.

    Args:
        placement: a placement for the trace's ``L`` layers.
        trace: its load ``[L, E]`` (``trace.counts()``) is spread over the GPUs; the trivial placement
            gets the trace's ``E`` and layer ids.

    Returns:
        a ``matplotlib.figure.Figure`` from :func:`profiling.plots.gpu_load_bars`.
    """
    load = trace.counts()  # [L, E]
    ids = trace.layer_ids
    base = Placement.trivial(load.shape[0], trace.num_logical_experts, placement.topology, layer_ids=ids)
    return gpu_load_bars(
        expected_gpu_load(base, load),  # [L, G]
        expected_gpu_load(placement, load),  # [L, G]
        labels=("trivial", "placement"),
        layer_ids=ids,
        title=title,
    )


def inspect_plots(trace: RoutingTrace, out_dir: str | Path, placement: Placement | None = None) -> list[Path]:
    """Write the standard figure set of a trace to ``out_dir`` (created if missing); returns the paths.

    The figures of :func:`profiling.plots.trace_plots` (``load_heatmap.png``, ``lorenz.png``, and as
    the trace allows ``drift.png``, ``domain_distance.png``, ``coactivation.png``). With ``placement``
    (a :class:`~placement.model.Placement` matching the trace): ``gpu_load.png``, per-GPU load of the
    trivial placement vs ``placement`` under the even policy.
    """
    out = Path(out_dir)
    written = trace_plots(trace, out)
    if placement is not None:
        fig = placement_gpu_load_plot(placement, trace, title=f"{trace.name or 'trace'}: per-GPU load")
        written.append(save_figure(fig, out / "gpu_load.png"))
    log.info("wrote %d plots to %s", len(written), out)
    return written
