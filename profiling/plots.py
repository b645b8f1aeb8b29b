"""Figures of expert skew, drift, co-activation and GPU balance (viz extra: matplotlib).

Figures drawn from arrays and traces only; the figures that need a placement's metrics live in
:mod:`placement.plots` (profiling imports nothing from placement).

matplotlib is imported inside the functions, and only its object-oriented API is used (``Figure``
objects rendered by the Agg canvas, no pyplot state), so this module imports without matplotlib and
works in scripts, servers and notebooks alike. Every function returns a ``matplotlib.figure.Figure``;
:func:`save_figure` writes it atomically and :func:`to_png` gives the PNG bytes (for
``IPython.display.Image``).

Shapes: L layers, E logical experts, G GPUs, W windows.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moe_placement.base.fileio import atomic_write_bytes
from profiling import stats
from profiling.trace import RoutingTrace

__all__ = [
    "load_heatmap",
    "lorenz_plot",
    "drift_plot",
    "coactivation_heatmap",
    "gpu_load_bars",
    "domain_distance_plot",
    "save_figure",
    "to_png",
    "inspect_plots",
    "trace_figures",
    "trace_plots",
]

log = logging.getLogger(__name__)


def _figure(width: float, height: float):
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("plots need matplotlib (the viz extra): pip install matplotlib") from exc
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _ids(layer_ids, n) -> list[int]:
    ids = list(layer_ids) if layer_ids is not None else list(range(n))
    if len(ids) != n:
        raise ValueError(f"layer_ids has {len(ids)} entries for {n} layers")
    return ids


def to_png(fig) -> bytes:
    """Render ``fig`` to PNG bytes (Agg canvas)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def save_figure(fig, path: str | Path) -> Path:
    """Write ``fig`` as PNG to ``path`` atomically (BytesIO, then temp file + rename)."""
    p = Path(path)
    atomic_write_bytes(p, to_png(fig))
    return p


def load_heatmap(
    load, layer_ids: Sequence[int] | None = None, *, sort: bool = True, title: str | None = None
):
    """Layers x experts heatmap of load shares, log colour scale.

    Args:
        load: ``[L, E]`` selections per expert.
        sort: sort each layer's experts hottest first (x axis = rank), so skew reads as a gradient;
            ``False`` keeps expert ids on the x axis.
    """
    from matplotlib.colors import LogNorm

    s = stats.hotness(load)[0] if sort else stats.load_shares(load)
    L, E = s.shape
    ids = _ids(layer_ids, L)
    pos = s[s > 0]
    vmin = float(pos.min()) if pos.size else 1e-6
    vmax = float(pos.max()) if pos.size else 1.0
    masked = np.ma.masked_less_equal(s, 0)
    fig = _figure(min(12, 3 + 0.12 * E), min(10, 1.5 + 0.25 * L))
    ax = fig.add_subplot()
    im = ax.imshow(
        masked,
        aspect="auto",
        interpolation="nearest",
        cmap="magma",
        norm=LogNorm(vmin=vmin, vmax=max(vmax, vmin * 1.0001)),
    )
    ax.set_xlabel("expert rank in layer (hottest first)" if sort else "expert id")
    ax.set_ylabel("layer")
    step = max(1, L // 16)
    ax.set_yticks(range(0, L, step), [str(ids[i]) for i in range(0, L, step)])
    fig.colorbar(im, ax=ax, label="share of the layer's selections (log)")
    ax.set_title(title or f"expert load share, uniform = {1 / E:.3g}")
    return fig


def lorenz_plot(
    load,
    layer_ids: Sequence[int] | None = None,
    *,
    layers: Sequence[int] | None = None,
    title: str | None = None,
):
    """Lorenz curve per layer (share of selections carried by the coldest fraction of experts).

    Args:
        load: ``[L, E]``.
        layers: rows to draw (default up to 8 spread over the layers).
    """
    from profiling.skew import gini

    c = np.asarray(load, dtype=np.float64)
    L, E = c.shape
    ids = _ids(layer_ids, L)
    rows = (
        list(layers)
        if layers is not None
        else sorted(set(np.linspace(0, L - 1, min(L, 8)).round().astype(int)))
    )
    curves = stats.lorenz_curve(c)
    g = gini(c)
    x = np.linspace(0, 1, E + 1)
    fig = _figure(5.5, 5)
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--", label="uniform")
    for r in rows:
        ax.plot(x, curves[r], lw=1.4, label=f"layer {ids[r]} (gini {g[r]:.2f})")
    ax.set_xlabel("fraction of experts (coldest first)")
    ax.set_ylabel("fraction of selections")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title(title or "Lorenz curves of expert load")
    return fig


def drift_plot(drift: dict, layer_ids: Sequence[int] | None = None, *, title: str | None = None):
    """Drift between consecutive windows, from :func:`profiling.stats.window_drift`.

    One panel per metric (``tv``, ``spearman``, ``topn_overlap``), each ``[W - 1, L]``: the median over
    layers as a line and the min-max range over layers as a band.
    """
    keys = [k for k in ("tv", "spearman", "topn_overlap") if k in drift]
    if not keys:
        raise ValueError(f"drift must hold 'tv', 'spearman' or 'topn_overlap' arrays, got {sorted(drift)}")
    labels = {
        "tv": "total variation (0 = same)",
        "spearman": "Spearman rank corr. (1 = same)",
        "topn_overlap": "hot-set overlap (1 = same)",
    }
    fig = _figure(4 * len(keys), 3.4)
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    for ax, k in zip(axes, keys):
        v = np.asarray(drift[k], dtype=np.float64)  # [W-1, L]
        if v.ndim == 1:
            v = v[:, None]
        x = np.arange(1, v.shape[0] + 1)
        with np.errstate(all="ignore"):
            med, lo, hi = np.nanmedian(v, axis=1), np.nanmin(v, axis=1), np.nanmax(v, axis=1)
        ax.fill_between(x, lo, hi, alpha=0.25, label="range over layers")
        ax.plot(x, med, marker="o", ms=3, label="median over layers")
        ax.set_xlabel("window boundary (w-1 -> w)")
        ax.set_title(labels[k], fontsize=9)
        ax.set_ylim(-1.05 if k == "spearman" else 0, 1.05)
    axes[0].legend(fontsize=7)
    fig.suptitle(title or "drift of expert load between consecutive windows", fontsize=10)
    return fig


def coactivation_heatmap(
    matrix,
    *,
    order: Sequence[int] | None = None,
    log_scale: bool = True,
    title: str | None = None,
    label: str = "co-activation lift",
):
    """Heatmap of one layer's expert-pair matrix ``[E, E]`` (counts, lift or PMI).

    Args:
        order: expert ids in display order (e.g. hottest first, or grouped by cluster).
        log_scale: log colour scale (values <= 0 and NaN are left blank).
    """
    from matplotlib.colors import LogNorm

    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"matrix must be [E, E], got shape {m.shape}")
    if order is not None:
        o = np.asarray(order, dtype=np.int64)
        m = m[np.ix_(o, o)]
    E = m.shape[0]
    fig = _figure(6.2, 5.4)
    ax = fig.add_subplot()
    masked = np.ma.masked_invalid(np.where(m > 0, m, np.nan) if log_scale else m)
    norm = None
    if log_scale and masked.count():
        lo, hi = float(masked.min()), float(masked.max())
        norm = LogNorm(vmin=lo, vmax=max(hi, lo * 1.0001))
    im = ax.imshow(masked, interpolation="nearest", cmap="viridis", norm=norm)
    ax.set_xlabel("expert" + (" (display order)" if order is not None else " id"))
    ax.set_ylabel("expert" + (" (display order)" if order is not None else " id"))
    if order is not None and E <= 32:
        ax.set_xticks(range(E), [str(i) for i in order], fontsize=6)
        ax.set_yticks(range(E), [str(i) for i in order], fontsize=6)
    fig.colorbar(im, ax=ax, label=label + (" (log)" if log_scale else ""))
    ax.set_title(title or label)
    return fig


def gpu_load_bars(
    before,
    after,
    *,
    labels: tuple[str, str] = ("before", "after"),
    layer: int | None = None,
    layer_ids: Sequence[int] | None = None,
    title: str | None = None,
):
    """Per-GPU load of two placements, e.g. from :func:`placement.metrics.expected_gpu_load`.

    Args:
        before, after: ``[L, G]`` (or ``[G]`` for one layer) loads.
        layer: the row to draw as bars (default: the row where ``before`` has the worst peak-to-average);
            with ``[L, G]`` inputs a second panel shows the per-layer peak-to-average of both.
    """
    b = np.asarray(before, dtype=np.float64)
    a = np.asarray(after, dtype=np.float64)
    if b.ndim == 1:
        b, a = b[None], a[None]
    if b.shape != a.shape or b.ndim != 2:
        raise ValueError(f"before {b.shape} and after {a.shape} must both be [layers, gpus] (or [gpus])")
    L, G = b.shape
    ids = _ids(layer_ids, L)
    with np.errstate(invalid="ignore", divide="ignore"):
        par_b = np.where(b.mean(1) > 0, b.max(1) / b.mean(1), 1.0)
        par_a = np.where(a.mean(1) > 0, a.max(1) / a.mean(1), 1.0)
    r = int(np.argmax(par_b)) if layer is None else int(layer)
    if not 0 <= r < L:
        raise ValueError(f"layer row {r} out of range for {L} layers")
    fig = _figure(11 if L > 1 else 6, 3.8)
    axes = fig.subplots(1, 2 if L > 1 else 1, squeeze=False)[0]
    ax = axes[0]
    x = np.arange(G)
    w = 0.4
    ax.bar(x - w / 2, b[r], w, label=f"{labels[0]} (PAR {par_b[r]:.2f})")
    ax.bar(x + w / 2, a[r], w, label=f"{labels[1]} (PAR {par_a[r]:.2f})")
    ax.axhline(b[r].mean(), color="grey", ls="--", lw=1, label="mean")
    ax.set_xlabel("GPU (EP rank)")
    ax.set_ylabel("tokens routed")
    ax.set_title(f"layer {ids[r]}: per-GPU load", fontsize=9)
    ax.legend(fontsize=7)
    if L > 1:
        ax2 = axes[1]
        ax2.plot(ids, par_b, marker="o", ms=3, label=labels[0])
        ax2.plot(ids, par_a, marker="o", ms=3, label=labels[1])
        ax2.axhline(1.0, color="grey", ls="--", lw=1)
        ax2.set_xlabel("layer")
        ax2.set_ylabel("peak-to-average (par)")
        ax2.set_title("per-layer par (1.0 = perfect)", fontsize=9)
        ax2.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def domain_distance_plot(
    distance, labels: Sequence[str], *, layer_ids: Sequence[int] | None = None, title: str | None = None
):
    """Total-variation distance between domains ``[L, D, D]`` (from :func:`profiling.stats.domain_distance`),
    one small matrix per layer."""
    d = np.asarray(distance, dtype=np.float64)
    if d.ndim != 3 or d.shape[1] != d.shape[2] or d.shape[1] != len(labels):
        raise ValueError(f"distance must be [layers, {len(labels)}, {len(labels)}], got shape {d.shape}")
    L, D = d.shape[0], d.shape[1]
    ids = _ids(layer_ids, L)
    n = min(L, 4)
    rows = np.linspace(0, L - 1, n).round().astype(int)
    fig = _figure(3.2 * n + 1, 3.4)
    axes = fig.subplots(1, n, squeeze=False)[0]
    im = None
    for ax, r in zip(axes, rows):
        im = ax.imshow(d[r], vmin=0, vmax=max(1e-9, float(d.max())), cmap="cividis")
        ax.set_xticks(range(D), labels, rotation=60, fontsize=7)
        ax.set_yticks(range(D), labels, fontsize=7)
        ax.set_title(f"layer {ids[r]}", fontsize=9)
    fig.colorbar(im, ax=list(axes), label="TV distance of expert load")
    fig.suptitle(title or "how differently domains route", fontsize=10)
    return fig


def inspect_plots(trace: RoutingTrace, out_dir: str | Path) -> list[Path]:
    """Write the standard figure set of a trace to ``out_dir`` (created if missing); returns the paths.

    The figures of :func:`trace_plots`. The per-GPU load of a placement (``gpu_load.png``) needs
    placement metrics: :func:`placement.plots.inspect_plots` writes this set plus that figure.
    """
    written = trace_plots(trace, out_dir)
    log.info("wrote %d plots to %s", len(written), Path(out_dir))
    return written


def trace_plots(trace: RoutingTrace, out_dir: str | Path) -> list[Path]:
    """Write the trace's figures (:func:`trace_figures`) to ``out_dir`` (created if missing), without
    logging; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [save_figure(fig, out / name) for name, fig in trace_figures(trace).items()]


def trace_figures(trace: RoutingTrace) -> dict:
    """The trace's figures by file name, in order (nothing written).

    Always: ``load_heatmap.png``, ``lorenz.png``. With two or more windows (prompts, steps or count rows;
    per-token traces are cut into up to 8 groups): ``drift.png``; labelled count windows (domains,
    subjects; at most 12) also get ``domain_distance.png``. Per-token traces: ``coactivation.png``
    (lift, the most skewed layer, experts hottest first).
    """
    load = trace.counts()  # [L, E]
    ids = trace.layer_ids
    name = trace.name or "trace"
    figs = {
        "load_heatmap.png": load_heatmap(load, ids, title=f"{name}: expert load share (sorted, log)"),
        "lorenz.png": lorenz_plot(load, ids, title=f"{name}: Lorenz curves"),
    }
    wl = _drift_windows(trace)  # [W, L, E] or None
    if wl is not None and wl.shape[0] >= 2:
        title = f"{name}: drift over {wl.shape[0]} windows"
        figs["drift.png"] = drift_plot(stats.window_drift(wl), ids, title=title)
    if not trace.has_tokens and trace.window_labels and 2 <= len(trace.window_labels) <= 12:
        d = stats.domain_distance(trace.window_counts)
        figs["domain_distance.png"] = domain_distance_plot(d, trace.window_labels, layer_ids=ids)
    if trace.has_tokens:
        figs["coactivation.png"] = _coactivation_figure(trace, load, name)
    return figs


def _drift_windows(trace: RoutingTrace) -> np.ndarray | None:
    """Window loads ``[W, L, E]`` to draw drift over, or None with fewer than two windows.

    Per-token traces: up to 8 groups of the natural windows (8 token blocks when there is one
    window and at least 16 tokens). Counts: the count rows, in 8 consecutive groups when over 12.
    """
    wins = trace.natural_windows()
    if trace.has_tokens:
        n = min(8, len(wins)) if len(wins) >= 2 else (8 if trace.num_tokens >= 16 else 0)
        return stats.window_loads(trace, n) if n >= 2 else None
    wl = trace.window_load() if len(wins) >= 2 else None
    if wl is not None and wl.shape[0] > 12:  # many small windows (questions, steps): 8 consecutive groups
        wl = np.stack([g.sum(axis=0) for g in np.array_split(wl, 8)])
    return wl


def _coactivation_figure(trace: RoutingTrace, load: np.ndarray, name: str):
    """Co-activation lift ``[E, E]`` of the most skewed layer (by Gini of ``load`` ``[L, E]``) over the
    first 50,000 tokens, experts hottest first."""
    from profiling.skew import gini

    ids = trace.layer_ids
    row = int(np.argmax(gini(load)))
    sub = trace.slice_tokens(0, min(trace.num_tokens, 50_000))
    co = stats.coactivation(sub, layers=[row])
    lift = stats.coactivation_lift(co, sub.num_tokens)[0]
    order = stats.hotness(load[row])[1]
    return coactivation_heatmap(
        lift, order=order, title=f"{name}: co-activation lift, layer {ids[row]} (hottest first)"
    )
