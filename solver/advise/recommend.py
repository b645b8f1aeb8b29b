"""The recommendation: which option to run, the engine's launch flags for it, and the figures behind it.

Flag names as the engines spell them (SGLang 0.5.23 ``arg_groups/fields/exec_.py``, vLLM 0.33
``config/parallel.py`` and ``engine/arg_utils.py``); our plugin spec as ``docs/serving.md`` gives it.
"""

from __future__ import annotations

import json
import math

from placement.dispatch import get_dispatch
from solver.advise.balance import ENGINE, NO_EPLB, OURS, RUNTIME
from solver.advise.options import engine_flag_value

__all__ = ["choose_row", "launch_flags", "recommendation_text"]

_KIND_ORDER = {NO_EPLB: 0, ENGINE: 1, OURS: 2}
TIE = 0.01  # rows within 1% of the fastest decode step count as tied: the cheaper one is chosen


def choose_row(rows):
    """The row to recommend: fastest modelled decode MoE step among engine-runnable rows that fit in
    memory; within 1% of it, the fewest redundant slots, then the engine's own option."""
    ok = [r for r in rows if r.kind in _KIND_ORDER and r.memory.fits] or [
        r for r in rows if r.kind in _KIND_ORDER
    ]
    best = min(r.decode.step_s for r in ok)
    tied = [r for r in ok if r.decode.step_s <= best * (1 + TIE)]
    return min(tied, key=lambda r: (r.redundant_per_gpu, _KIND_ORDER[r.kind], r.decode.step_s))


def launch_flags(engine: str, row, ep_size: int, interval_steps: int | None) -> list[str]:
    """The engine's command-line pieces (environment first) for ``row``; ``interval_steps``: rebalance
    every that many steps (None: the trace shows no gain from rebalancing)."""
    n = row.redundant_per_gpu * ep_size
    if row.kind == NO_EPLB:
        return ["(no EPLB flags: leave --enable-eplb off)"]
    env = []
    if row.kind == OURS:
        env = [f"{engine.upper()}_PLUGINS=moe_placement", "MOE_PLACEMENT_EPLB=greedy"]
    every = interval_steps if interval_steps is not None else 100000
    if engine == "sglang":
        algo = engine_flag_value(get_dispatch(row.dispatch)) or "static"
        return env + [
            "--moe-a2a-backend deepep",
            "--enable-eplb",
            f"--ep-num-redundant-experts {n}",
            f"--ep-dispatch-algorithm {algo}",
            f"--eplb-rebalance-num-iterations {every}",
        ]
    cfg = json.dumps({"num_redundant_experts": n, "step_interval": every})
    return env + ["--enable-expert-parallel", "--enable-eplb", f"--eplb-config '{cfg}'"]


def _pct(a: float, b: float) -> str:
    return f"{(1 - a / b) * 100:+.1f}%" if b > 0 else "n/a"


def recommendation_text(engine: str, row, baseline, rows, be, flags: list[str], model_name: str) -> str:
    """One paragraph: what to run, the flags, and the figures it rests on."""
    d = get_dispatch(row.dispatch)
    what = {
        NO_EPLB: "no EPLB (trivial placement)",
        ENGINE: f"the engine's EPLB with {row.redundant_per_gpu} redundant slot(s) per GPU",
        OURS: f"our placement (fitted for {d.name}) with {row.redundant_per_gpu} redundant slot(s) per GPU",
    }[row.kind]
    text = (
        f"Run {engine} with {what}, dispatch {d.name}: {' '.join(flags)}. "
        f"On the held-out half it gives window PAR {row.scores.window_par:.3f} and per-step PAR "
        f"{row.scores.step_par_decode:.3f} (no EPLB: {baseline.scores.window_par:.3f} / "
        f"{baseline.scores.step_par_decode:.3f}); modelled decode MoE step {row.decode.step_s * 1e3:.2f} ms vs "
        f"{baseline.decode.step_s * 1e3:.2f} ms ({_pct(row.decode.step_s, baseline.decode.step_s)} faster), "
        f"prefill {row.prefill.step_s * 1e3:.1f} ms vs {baseline.prefill.step_s * 1e3:.1f} ms, for "
        f"{row.memory.redundant_bytes / 1e9:.2f} GB per GPU of replicas ({row.memory.kv_tokens_lost:,.0f} "
        f"KV-cache tokens of {model_name})."
    )
    if be.interval_s is None:
        text += (
            f" Rebalancing does not pay on this trace (a re-placement one window later saves "
            f"{be.saving * 100:.2f}% of the decode MoE step; a move takes {be.move_s * 1e3:.1f} ms): "
            f"rebalance rarely."
        )
    else:
        text += (
            f" A rebalance moves experts for {be.move_s * 1e3:.1f} ms and saves {be.saving * 100:.2f}% of the "
            f"decode MoE step: it pays every {be.interval_s:.2f} s ({math.ceil(be.interval_steps):,} decode "
            f"steps) or less often; the trace's windows last {be.window_s:.2f} s of decode."
        )
    runtime = [r for r in rows if r.kind == RUNTIME and r.redundant_per_gpu == row.redundant_per_gpu]
    for r in runtime:
        text += (
            f" Our own runtime (runtime_hooks EP layer, not the engine) with {r.dispatch} would reach per-step "
            f"PAR {r.scores.step_par_decode:.3f}, decode {r.decode.step_s * 1e3:.2f} ms."
        )
    return text
