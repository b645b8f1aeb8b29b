"""The self-contained HTML report of an :class:`~solver.advise.core.Advice`: inline CSS, three plots as
inline SVG (matplotlib, fixed hash salt and no date: the same advice gives the same bytes)."""

from __future__ import annotations

import html
import io
from typing import Any

__all__ = ["PLOT_COUNT", "render_html"]

PLOT_COUNT = 3
_CSS = (
    "body{font-family:sans-serif;margin:24px;max-width:1150px;color:#222}"
    "table{border-collapse:collapse;font-size:12px;margin:8px 0}"
    "td,th{border:1px solid #bbb;padding:3px 6px;text-align:right}th{background:#eee}"
    "tr.chosen td{background:#e6f4e6;font-weight:bold}"
    "figure{margin:12px 0}figcaption{font-size:12px;color:#444}"
    ".rec{background:#f3f7ff;border-left:4px solid #369;padding:8px 12px}"
    "code{background:#f4f4f4;padding:1px 3px}"
)
_COLS = (
    ("option", "option"),
    ("dispatch", "dispatch"),
    ("redundant_per_gpu", "r/GPU"),
    ("window_par", "window PAR"),
    ("step_par_decode", "step PAR decode"),
    ("step_par_prefill", "step PAR prefill"),
    ("decode_moe_ms", "decode MoE ms"),
    ("prefill_moe_ms", "prefill MoE ms"),
    ("redundant_gb_per_gpu", "replica GB/GPU"),
    ("kv_tokens_lost_per_gpu", "KV tokens lost/GPU"),
)


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg") :]


def _balance_plot(plt, d: dict) -> str:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    series: dict[tuple[str, str], list[tuple[int, float, float]]] = {}
    for r in d["rows"]:
        series.setdefault((r["option"], r["dispatch"]), []).append(
            (r["redundant_per_gpu"], r["step_par_decode"], r["window_par"])
        )
    base = [r for r in d["rows"] if r["redundant_per_gpu"] == 0 and r["option"] != "no EPLB"]
    for (kind, disp), pts in series.items():  # the r=0 row (one replica: any dispatch) starts every line
        if base and not any(p[0] == 0 for p in pts):
            pts.append((0, base[0]["step_par_decode"], base[0]["window_par"]))
        pts.sort()
        x = [p[0] for p in pts]
        line = ax.plot(x, [p[1] for p in pts], marker="o", label=f"{kind} / {disp} (step)")[0]
        ax.plot(x, [p[2] for p in pts], ls="--", color=line.get_color(), alpha=0.6)
    ax.set_xlabel("redundant slots per GPU")
    ax.set_ylabel("held-out PAR (solid: per step, dashed: window)")
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    out = _svg(fig)
    plt.close(fig)
    return out


def _step_plot(plt, d: dict) -> str:
    c = d["step_curve"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for s in c["series"]:
        line = ax.loglog(c["batch_per_rank"], s["step_ms"], marker=".", label=s["key"])[0]
        ax.axvline(s["crossover_batch"], color=line.get_color(), ls=":", lw=1)
    ax.set_xlabel("tokens per rank per step (dotted: memory-bound | compute-bound crossover)")
    ax.set_ylabel("modelled MoE step time, ms")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    out = _svg(fig)
    plt.close(fig)
    return out


def _front_plot(plt, d: dict) -> str:
    pts = d["migration_front"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    x = [p["move"]["arrived_experts"] for p in pts]
    y = [p["held_out_par"] for p in pts]
    ax.plot(x, y, marker="o")
    for p, xi, yi in zip(pts, x, y):
        label = "no budget" if p["max_moves"] is None else f"max_moves={p['max_moves']}"
        ax.annotate(label, (xi, yi), fontsize=7, textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("arrived experts (trace layers)")
    ax.set_ylabel(f"held-out window PAR ({d['drift']['dispatch']})")
    ax.grid(alpha=0.3)
    out = _svg(fig)
    plt.close(fig)
    return out


def _table(d: dict) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h in _COLS)
    body = []
    for r in d["rows"]:
        cls = ' class="chosen"' if r["key"] == d["chosen"] else ""
        cells = "".join(f"<td>{html.escape(_fmt(r[k]))}</td>" for k, _ in _COLS)
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3f}"
    return str(v)


def _migration_table(d: dict) -> str:
    be = d["break_even"]
    rows = [
        ("drift (mean stale / fresh PAR, window i -> i+1)", f"{d['drift']['ratio']:.4f}"),
        ("rebalance move, modelled", f"{be['move_s'] * 1e3:.2f} ms"),
        ("decode MoE step saved by a rebalance", f"{be['saving'] * 100:.3f}%"),
        ("break-even interval", "never" if be["interval_s"] is None else f"{be['interval_s']:.3f} s"),
        ("one trace window of decode", f"{be['window_s']:.3f} s"),
    ]
    return (
        "<table>"
        + "".join(f"<tr><th>{html.escape(a)}</th><td>{html.escape(b)}</td></tr>" for a, b in rows)
        + "</table>"
    )


def render_html(advice) -> str:
    """The report as one HTML string (``advice``: an :class:`Advice` or its ``to_dict()``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = advice if isinstance(advice, dict) else advice.to_dict()
    c = d["context"]
    with matplotlib.rc_context({"svg.hashsalt": "moe-placement-advise", "svg.fonttype": "path"}):
        plots = [
            (
                "Balance vs redundant slots per GPU, per option and dispatch model (held-out half)",
                _balance_plot(plt, d),
            ),
            (f"Decode MoE step time vs batch, {c['model']} on {c['hardware']}", _step_plot(plt, d)),
            ("Migration front: experts moved vs held-out PAR, per max_moves budget", _front_plot(plt, d)),
        ]
    figs = "".join(f"<figure>{svg}<figcaption>{html.escape(cap)}</figcaption></figure>" for cap, svg in plots)
    assumptions = "".join(f"<li>{html.escape(a)}</li>" for a in d["assumptions"])
    t = c["trace"]
    title = f"moe-placement advise: {c['engine']}, {c['model']}, {c['nodes']} x {c['gpus_per_node']} {c['hardware']}"
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p>Trace {html.escape(str(t['name']))}: {t['tokens']:,} tokens, {t['experts']} experts, top-{t['top_k']}, "
        f"{t['layers']} layers; fit on {t['fit_tokens']:,}, scored on {t['held_out_tokens']:,} held-out tokens.</p>"
        f'<h2>Recommendation</h2><p class="rec">{html.escape(d["recommendation"])}</p>'
        f"<h2>Options</h2>{_table(d)}<h2>Migration</h2>{_migration_table(d)}<h2>Plots</h2>{figs}"
        f"<h2>Model and assumptions</h2><ul>{assumptions}</ul></body></html>\n"
    )
