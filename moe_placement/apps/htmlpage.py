"""What the self-contained HTML reports (``advise``, ``plan``) share: the base style, the page head, and
matplotlib figures as inline SVG whose bytes depend on the input only (a fixed hash salt per report, no
date, text drawn as paths), each in a ``<figure>`` with its caption. No network, no files.
"""

from __future__ import annotations

import html
import io
from collections.abc import Callable, Sequence

__all__ = ["BASE_CSS", "figures", "page_head", "svg"]

BASE_CSS = (
    "body{font-family:sans-serif;margin:24px;color:#222}"
    "table{border-collapse:collapse;font-size:12px;margin:8px 0}"
    "td,th{border:1px solid #bbb;padding:3px 6px;text-align:right}th{background:#eee}"
    "figure{margin:12px 0}figcaption{font-size:12px;color:#444}"
    ".rec{background:#f3f7ff;border-left:4px solid #369;padding:8px 12px}"
    "pre.cmd{background:#f4f4f4;padding:8px;white-space:pre-wrap;word-break:break-all}.warn{color:#a40}"
)


def svg(fig) -> str:
    """``fig`` as an inline ``<svg>`` element (no XML prolog, no date); the figure is closed."""
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def figures(salt: str, plots: Sequence[tuple[str, Callable]]) -> str:
    """``<figure>`` blocks of ``plots`` (``(caption, draw)``, ``draw(plt)`` returning :func:`svg`'s
    text), drawn with the Agg backend under the report's hash ``salt``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with matplotlib.rc_context({"svg.hashsalt": salt, "svg.fonttype": "path"}):
        drawn = [(caption, draw(plt)) for caption, draw in plots]
    return "".join(
        f"<figure>{text}<figcaption>{html.escape(caption)}</figcaption></figure>" for caption, text in drawn
    )


def page_head(title: str, css: str) -> str:
    """The document up to and including the ``<h1>`` of ``title``."""
    t = html.escape(title)
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{t}</title><style>{css}</style>'
        f"</head><body><h1>{t}</h1>"
    )
