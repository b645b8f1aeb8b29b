"""The self-contained HTML report of an :class:`~moe_placement.apps.advise.core.Advice`: inline CSS, plots as inline
SVG (matplotlib, fixed hash salt and no date: the same advice gives the same bytes).

Layout: the launch command and flags first (copyable), then the recommendation, the options (greyed
where the engine cannot run them, with the reason), the plots (linear axes, legends outside the plots)
and the assumptions. Every header says "modelled": the figures come from a cost model, not a run.
"""

from __future__ import annotations

import html
from typing import Any

from moe_placement.apps.htmlpage import BASE_CSS, figures, page_head, svg
from placement.steps import PHASES

__all__ = ["PLOT_COUNT", "render_html"]

PLOT_COUNT = 2
_CSS = BASE_CSS + (
    "body{max-width:1150px}tr.chosen td{background:#e6f4e6;font-weight:bold}tr.grey td{color:#999}"
    "pre.cmd{user-select:all}"
)


def _series(d: dict) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for o in d["options"]:
        out.setdefault((o["option"], o["dispatch"]), []).append(o)
    return out


def _gain_plot(plt, d: dict) -> str:
    """Whole-step gain vs replica GB per GPU, one panel per phase, error bars = the band; the GB the
    user's batch x context leaves for replicas marked; unrunnable options hollow; series at the same GB
    nudged apart by a hair so their bars do not hide each other."""
    priced = [ph for ph in PHASES if ph in d["held_out_steps"]]
    fig, axes = plt.subplots(1, len(priced), figsize=(5 * len(priced), 3.6), sharex=True, squeeze=False)
    axes = axes[0]
    limit = d["context"]["replica_gb_limit"]
    marks = []
    for ax, ph in zip(axes, priced):
        series = _series(d)
        span = max([o["phases"][ph]["memory_gb"] for o in d["options"]] + [0.1])
        for i, ((kind, disp), opts) in enumerate(series.items()):
            nudge = (i - (len(series) - 1) / 2) * 0.012 * span  # options at the same GB side by side
            x = [o["phases"][ph]["memory_gb"] + nudge for o in opts]
            y = [o["phases"][ph]["whole_step_gain"] * 100 for o in opts]
            e = [(o["phases"][ph]["band"] or 0.0) * 100 for o in opts]  # none from one held-out step
            ok = all(o["available"] for o in opts)
            label = f"{kind} / {disp}" + ("" if ok else " (not runnable)")
            style = {"color": f"C{i}", "mfc": f"C{i}" if ok else "white", "ls": "-" if ok else ":"}
            ax.errorbar(x, y, yerr=e, marker="o", capsize=3, label=label, **style)
        ax.axhline(0, color="#888", lw=0.8)
        if limit is not None and limit > 0:
            if limit <= 3 * span:  # drawn only where it does not squash the options onto the y axis
                marks.append(ax.axvline(limit, color="#a40", ls="--", lw=1))
        ax.set_title(f"{ph} (modelled)", fontsize=10)
        ax.set_xlabel("replica GB per GPU")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("whole-step gain over no EPLB, %")
    b, c = d["context"]["decode_step_tokens"], d["context"]["context_len"]
    handles, labels = axes[0].get_legend_handles_labels()
    if marks:
        labels = [*labels, f"GB left for replicas at batch {b} x context {c}"]
        handles = [*handles, marks[0]]
    elif limit is not None:
        labels = [*labels, f"batch {b} x context {c} leaves {limit:,.0f} GB for replicas (off the axis)"]
        handles = [*handles, plt.Line2D([], [], color="#a40", ls="--", lw=1)]
    fig.legend(
        handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=2, fontsize=8, frameon=False
    )
    return svg(fig)


def _balance_plot(plt, d: dict) -> str:
    """Held-out window PAR vs redundant slots per GPU (linear axes, legend outside)."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for i, ((kind, disp), opts) in enumerate(_series(d).items()):
        pts = sorted((o["redundant_per_gpu"], o["window_par"]) for o in opts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}", label=f"{kind} / {disp}")
    ax.set_xlabel("redundant slots per GPU")
    ax.set_ylabel("held-out window PAR")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    return svg(fig)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3f}"
    return "" if v is None else str(v)


def _pct(ph: dict | None) -> str:
    """``+4.75% ± 1.18 [+4.1, +5.2]``: the gain, its band (n/a from one held-out step) and its range."""
    if ph is None:
        return "not priced"
    band = "n/a" if ph["band"] is None else f"{ph['band'] * 100:.2f}"
    lo, hi = ph.get("whole_step_gain_range") or (ph["whole_step_gain"],) * 2
    return f"{ph['whole_step_gain'] * 100:+.2f}% ± {band} [{lo * 100:+.2f}, {hi * 100:+.2f}]"


def _decision_table(rec: dict) -> str:
    """The decision: the minimum gain, the net gain and its range, stability and what would flip it."""
    lo, hi = rec.get("net_gain_range", [0.0, 0.0])
    flips = (
        "; ".join(f"{f['what']} {f['value']}: {f['option']}" for f in rec.get("would_flip", []))
        or "nothing tried"
    )
    runner = rec.get("runner_up") or {}
    return _kv_table(
        [
            (
                "minimum gain worth a change",
                f"{rec.get('min_gain', 0.0) * 100:g}% of the whole step (low end less band)",
            ),
            (
                "net whole-step gain [range]",
                f"{rec.get('net_gain', 0.0) * 100:+.2f}% [{lo * 100:+.2f}, {hi * 100:+.2f}]",
            ),
            ("decision stable", "yes" if rec.get("decision_stable") else "no"),
            ("would flip it", flips),
            ("cannot be judged", "; ".join(rec.get("stability", {}).get("unknown", [])) or "none"),
            ("best option not picked", f"{runner.get('option', 'none')}: {runner.get('why_not', '')}"),
        ]
    )


_HEADS = (
    "option",
    "dispatch",
    "r/GPU",
    "runs on the engine",
    "window PAR",
    "decode gain",
    "prefill gain",
    "lp/dispatch overhead ms",
    "replica GB/GPU",
    "KV tokens lost/GPU",
    "fits",
)


def _table(d: dict) -> str:
    rows = []
    chosen = d["recommendation"]["option"]
    for o in d["options"]:
        dec, pre = o["phases"].get("decode"), o["phases"].get("prefill")
        one = dec or pre
        cells = (
            o["option"],
            o["dispatch"],
            o["redundant_per_gpu"],
            "yes" if o["available"] else f"no: {o['unavailable_reason']}",
            o["window_par"],
            _pct(dec),
            _pct(pre),
            one["dispatch_overhead_ms"],
            one["memory_gb"],
            one["kv_tokens_lost"],
            "yes" if o["fits"] else "no",
        )
        cls = "chosen" if o["key"] == chosen else ("grey" if not o["available"] else "")
        tds = "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in cells)
        rows.append(f'<tr class="{cls}">{tds}</tr>')
    head = "".join(f"<th>{html.escape(h)}</th>" for h in _HEADS)
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _kv_table(pairs: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(a)}</th><td>{html.escape(b)}</td></tr>" for a, b in pairs)
    return f"<table>{body}</table>"


def _rebalance_table(rb: dict) -> str:
    g = rb["out_of_sample_gain"]
    return _kv_table(
        [
            (
                "periodic rebalance",
                "none" if rb["interval_steps"] is None else f"every {rb['interval_steps']:,} steps",
            ),
            (
                "out-of-sample gain (next window)",
                "n/a" if g is None else f"{g * 100:+.2f}% ± {rb['band'] * 100:.2f}",
            ),
            ("judged", "yes" if rb.get("judged", True) else "no: not enough trace"),
            ("stall per rearrangement", f"{rb['stall_ms']:.0f} ms" + (" (async)" if rb["async"] else "")),
            ("why", rb["reason"]),
            ("stall source", rb["stall_source"]),
        ]
    )


def _commands(rec: dict) -> str:
    """The command of every node (copyable), or the one command on a single node."""
    nodes = rec.get("launch_commands") or [{"node_rank": 0, "command": rec["launch_command"]}]
    if len(nodes) == 1:
        return f'<pre class="cmd">{html.escape(nodes[0]["command"])}</pre>'
    return "".join(
        f'<p>node {n["node_rank"]} (HEAD_IP: node 0\'s address)</p><pre class="cmd">{html.escape(n["command"])}</pre>'
        for n in nodes
    )


def render_html(advice) -> str:
    """The report as one HTML string (``advice``: an :class:`Advice` or its ``to_dict()``)."""
    d = advice if isinstance(advice, dict) else advice.to_dict()
    c, rec = d["context"], d["recommendation"]
    plots = [
        (
            "Modelled whole-step gain vs replica GB per GPU, per phase (error bars: the band)",
            lambda plt: _gain_plot(plt, d),
        ),
        ("Modelled: held-out window PAR vs redundant slots per GPU", lambda plt: _balance_plot(plt, d)),
    ]
    figs = figures("moe-placement-advise", plots)
    esc = html.escape
    title = f"moe-placement advise (modelled): {c['engine']} {c['engine_version']}, {c['model']}, {c['nodes']} x {c['gpus_per_node']} {c['hardware']}"
    flags = " ".join(rec["flags"]) or "(no EPLB flags)"
    warn = "".join(f'<li class="warn">{esc(w)}</li>' for w in d["warnings"])
    t = c["trace"]
    return (
        page_head(title, _CSS) + f"<h2>Launch command (modelled choice)</h2>{_commands(rec)}"
        f"<p>EPLB flags: <code>{esc(flags)}</code>; files: {esc(', '.join(rec['files']) or 'none')}</p>"
        f'<h2>Recommendation (modelled)</h2><p class="rec">{esc(d["summary"])}</p>{_decision_table(rec)}<ul>{warn}</ul>'
        f"<p>Trace {esc(str(t['name']))}: {t['tokens']:,} tokens, {t['experts']} experts, top-{t['top_k']}, "
        f"{t['layers']} layers; held-out steps: "
        + ", ".join(f"{ph} {n}" for ph, n in d["held_out_steps"].items())
        + ".</p>"
        f"<h2>Options (modelled, held-out half)</h2>{_table(d)}"
        f"<h2>Rebalancing (modelled, out of sample)</h2>{_rebalance_table(rec['rebalance'])}"
        f"<h2>Plots (modelled)</h2>{figs}"
        f"<h2>Model and assumptions (modelled figures)</h2><ul>"
        + "".join(f"<li>{esc(a)}</li>" for a in d["assumptions"])
        + "</ul></body></html>\n"
    )
