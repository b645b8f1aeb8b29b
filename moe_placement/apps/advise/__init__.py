"""Advice for serving an MoE model with expert parallelism, from the user's own routing trace.

``advise(trace, model, hardware, engine=..., nodes=...)`` -> :class:`Advice` (``to_dict()``: the CLI's
``--json``); :func:`render_html` writes the self-contained report. Modules: ``options`` (what is asked),
``balance`` (options, placements, held-out scores), ``cost`` (memory), ``phases`` (step time per phase), ``engines``
(what each engine runs), ``rebalance`` (judged out of sample), ``recommend`` (the choice and the command), ``report`` (HTML).
"""

from __future__ import annotations

from moe_placement.apps.advise.core import Advice, Row, advise
from moe_placement.apps.advise.options import AUTO_MODEL, AdviseOptions, engine_names
from moe_placement.apps.advise.report import render_html

__all__ = ["AUTO_MODEL", "Advice", "AdviseOptions", "Row", "advise", "engine_names", "render_html"]
