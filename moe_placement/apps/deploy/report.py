"""The self-contained HTML report of a :class:`~moe_placement.apps.deploy.plan.DeploymentPlan`: inline CSS,
plots as inline SVG (matplotlib; fixed hash salt, no date: the same plan gives the same bytes), no
network.

Layout: the decision and the winner's launch commands first, then the ranked table, the plots (share of
requests meeting the targets vs rate per GPU, the goodput search's points; TTFT and TPOT CDFs at each
deployment's reported rate; where a request's time goes) and the assumptions. Every header says
"modelled".
"""

from __future__ import annotations

import html

import numpy as np

from moe_placement.apps.htmlpage import BASE_CSS, figures, page_head, svg

__all__ = ["PLOT_COUNT", "SHOWN", "render_html"]

PLOT_COUNT = 3
SHOWN = 6  # deployments drawn in the plots (the best ones)
_CSS = BASE_CSS + "body{max-width:1200px}td.l{text-align:left}tr.best td{background:#e6f4e6;font-weight:bold}"


def _attainment_plot(plt, plan) -> str:
    """Share meeting both targets vs rate per GPU, one line per deployment; the required share dashed."""
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for i, r in enumerate(plan.results[:SHOWN]):
        pts = [(p.rate / r.gpus, p.attainment) for p in r.goodput.curve]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, color=f"C{i}", label=r.label)
        if r.goodput.met:
            ax.axvline(r.goodput_per_gpu, color=f"C{i}", ls=":", lw=0.8)
    ax.axhline(plan.options.slo_attainment, color="#a40", ls="--", lw=1, label="required share")
    ax.set_xscale("log")
    ax.set_xlabel("requests/s per GPU (log)")
    ax.set_ylabel("share meeting TTFT and TPOT")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7, frameon=False)
    return svg(fig)


def _cdf_plot(plt, plan) -> str:
    """TTFT and TPOT CDFs (ms, log) at each deployment's reported rate; the targets dashed."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    targets = (plan.options.ttft_ms, plan.options.tpot_ms)
    for i, r in enumerate(plan.results[:SHOWN]):
        at = r.goodput.at
        with np.errstate(invalid="ignore"):
            series = (at.ttft * 1e3, at.tpot[at.output > 1] * 1e3)
        for ax, x in zip(axes, series):
            x = np.sort(x[np.isfinite(x) & (x > 0)])
            if x.size:
                ax.plot(
                    x,
                    np.arange(1, x.size + 1) / x.size,
                    color=f"C{i}",
                    label=f"{r.label} @ {at.rate:.3g} req/s",
                )
    for ax, name, t in zip(axes, ("TTFT", "TPOT"), targets):
        ax.axvline(t, color="#a40", ls="--", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} ms (log)")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=2, fontsize=7, frameon=False
    )
    return svg(fig)


def _time_plot(plt, plan) -> str:
    """Mean ms per request by where it goes (queue, prefill, hand-off, decode), stacked."""
    shown = plan.results[:SHOWN]
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * max(len(shown), 1)))
    parts = ("queue", "prefill", "handoff", "decode")
    left = np.zeros(len(shown))
    for j, part in enumerate(parts):
        vals = np.array([r.time_split_ms()[part] or 0.0 for r in shown])
        ax.barh(range(len(shown)), vals, left=left, color=f"C{j}", label=part)
        left += vals
    ax.set_yticks(range(len(shown)), [r.label for r in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("mean ms per request at the reported rate")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    return svg(fig)


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.4g}"
    return str(v)


def _table(d: dict) -> str:
    heads = (
        "#",
        "deployment",
        "GPUs per pool",
        "layouts",
        "goodput/GPU req/s",
        "met",
        "p99 TTFT ms",
        "p99 TPOT ms",
        "weights GB/GPU",
        "KV free GB/GPU",
        "hand-off ms",
    )
    rows = []
    for i, r in enumerate(d["deployments"]):
        pools = r["pools"]
        cells = (
            i + 1,
            r["label"],
            " + ".join(f"{p['phase']} {p['gpus']}" for p in pools),
            " | ".join(p["layout"] for p in pools),
            r["goodput_rps_per_gpu"],
            "yes" if r["met_targets"] else "no",
            r["ttft_ms"]["p99"],
            r["tpot_ms"]["p99"],
            " | ".join(f"{p['memory_gb']['weights']:.1f}" for p in pools),
            " | ".join(f"{p['memory_gb']['kv_free']:.1f}" for p in pools),
            r["breakdown"]["handoff_ms"],
        )
        cls = "best" if r["label"] == d["best"] else ""
        tds = "".join(
            f"<td{' class=l' if j in (1, 2, 3) else ''}>{html.escape(_fmt(c))}</td>"
            for j, c in enumerate(cells)
        )
        rows.append(f'<tr class="{cls}">{tds}</tr>')
    head = "".join(f"<th>{html.escape(h)}</th>" for h in heads)
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def render_html(plan) -> str:
    """The report as one HTML string."""
    d = plan.to_dict()
    esc = html.escape
    plots = [
        (
            "Modelled: share of requests meeting both targets vs rate per GPU (dotted: goodput)",
            lambda plt: _attainment_plot(plt, plan),
        ),
        (
            "Modelled: TTFT and TPOT CDFs at each deployment's reported rate (dashed: targets)",
            lambda plt: _cdf_plot(plt, plan),
        ),
        ("Modelled: where a request's time goes", lambda plt: _time_plot(plt, plan)),
    ]
    figs = figures("moe-placement-plan", plots)
    c, t = d["cluster"], d["targets"]
    title = f"moe-placement plan (modelled): {d['model']} on {c['nodes']} x {c['gpus_per_node']} {c['gpu']}"
    launch = d["launch"]
    cmds = "(nothing met the targets: no launch command)"
    if launch:
        router = ["# router", launch["router"]] if launch["router"] else []
        cmds = "\n".join(["# SGLang", *launch["sglang"], *router, "# vLLM", *launch["vllm"]])
    warn = "".join(f'<li class="warn">{esc(w)}</li>' for w in d["warnings"])
    w = d["workload"]
    return (
        page_head(title, _CSS)
        + f"<p>Workload {esc(w['name'])}: median prompt {w['median_prompt']}, median output {w['median_output']} tokens, "
        f"up to {w['sampled_requests']} requests per rate. Targets: TTFT &le; {t['ttft_ms']:g} ms and TPOT &le; {t['tpot_ms']:g} ms "
        f"for {t['slo_attainment']:.0%} of requests. Hardware {esc(d['hardware']['preset'])}, "
        f"{'measured' if d['hardware']['measured'] else 'not measured'}.</p>"
        f'<h2>Decision (modelled)</h2><p class="rec">{esc(d["reason"])}</p><ul>{warn}</ul>'
        f'<h2>Launch commands (modelled choice)</h2><pre class="cmd">{esc(cmds)}</pre>'
        f"<h2>Deployments (modelled, ranked by goodput per GPU)</h2>{_table(d)}"
        f"<h2>Plots (modelled)</h2>{figs}"
        f"<h2>Assumptions (modelled figures)</h2><ul>"
        + "".join(f"<li>{esc(a)}</li>" for a in d["assumptions"])
        + "</ul></body></html>\n"
    )
