"""Step-time tables: the one cost model's step time of a pool, tabulated over per-rank sizes.

The simulator asks for thousands of step times per run, each for the step's real token count; the cost
model (the layout planner's :func:`moe_placement.apps.planner.layout.evaluate_candidate`, on
:mod:`placement.cost`) is evaluated once per grid point of a table and the simulator interpolates
(bilinearly, clamped at the edges):

- decode: ``[B, K]`` seconds of a step with ``b`` sequences per attention-DP rank holding ``k`` cached
  tokens in all (``b`` in powers of 2 up to the decode cap, ``k`` in 9 even steps up to the rank's KV
  capacity; the cost model's context is ``k / b``);
- prefill: ``[C, X]`` seconds of a step of ``c`` prompt tokens per rank whose attention spans ``x``
  (``c`` in powers of 2 up to the chunk; ``x`` in 9 even steps up to twice the longest prompt: the cost
  model attends half its context on average, so a chunk at offset ``o`` of ``c`` tokens is ``x = 2 o + c``).

A step that mixes prefill and decode (chunked prefill beside running sequences) costs the prefill step
of all its tokens plus what the decode sequences' cached tokens add to attention:
``prefill(c + b, x) + decode(b, k) - decode(b, 0)``.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, replace

import numpy as np

from moe_placement.apps.planner.costmodel import CostOptions
from moe_placement.apps.planner.layout import LayoutResult, evaluate_candidate
from placement.cost.hardware import ClusterSpec
from placement.cost.modelspec import ModelSpec

__all__ = ["GRID_POINTS", "StepTable", "build_table", "kv_tokens_per_rank", "powers_of_two"]

GRID_POINTS = 9  # even steps of the cached-token and context axes
# (grid field, table field, the table's axis along that grid) of a StepTable
_AXES = (
    ("decode_seqs", "decode_s", 0),
    ("decode_kv", "decode_s", 1),
    ("prefill_tokens", "prefill_s", 0),
    ("prefill_ctx", "prefill_s", 1),
)


def powers_of_two(top: int) -> list[int]:
    """``1, 2, 4, ...`` below ``top``, then ``top``."""
    out, x = [], 1
    while x < top:
        out.append(x)
        x *= 2
    return [*out, int(top)]


def _bracket(grid: list[float], x: float) -> tuple[int, float]:
    """``(i, w)``: ``x`` lies between ``grid[i]`` and ``grid[i + 1]`` at weight ``w`` (clamped)."""
    if x <= grid[0]:
        return 0, 0.0
    if x >= grid[-1]:
        return len(grid) - 2, 1.0
    i = bisect_right(grid, x) - 1
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


def _bilinear(t: np.ndarray, rows: list[float], x: float, cols: list[float], y: float) -> float:
    """``t [R, C]`` interpolated at row coordinate ``x`` on ``rows`` and column ``y`` on ``cols``."""
    i, w = _bracket(rows, x)
    j, v = _bracket(cols, y)
    return float(
        (t[i, j] * (1 - v) + t[i, j + 1] * v) * (1 - w) + (t[i + 1, j] * (1 - v) + t[i + 1, j + 1] * v) * w
    )


@dataclass(frozen=True, eq=False)
class StepTable:
    """Seconds of one step of a pool (module docstring). Grids are float lists, tables ``[B, K]`` and
    ``[C, X]`` float64 arrays."""

    decode_seqs: list[float]
    decode_kv: list[float]
    decode_s: np.ndarray
    prefill_tokens: list[float]
    prefill_ctx: list[float]
    prefill_s: np.ndarray

    def __post_init__(self) -> None:
        # an axis of one point (a cap of 1 sequence, a chunk of 1 token) is repeated, the table flat
        # along it: every lookup then has the two neighbours it interpolates between
        for grid, table, axis in _AXES:
            if len(getattr(self, grid)) == 1:
                object.__setattr__(self, grid, list(getattr(self, grid)) * 2)
                object.__setattr__(self, table, np.repeat(getattr(self, table), 2, axis=axis))

    def _row(self, seqs: float) -> np.ndarray:
        """``[K]`` decode seconds at ``seqs`` sequences (interpolated between rows)."""
        i, w = _bracket(self.decode_seqs, seqs)
        return self.decode_s[i] * (1.0 - w) + self.decode_s[i + 1] * w

    def decode(self, seqs: float, kv: float) -> float:
        """One decode step of ``seqs`` sequences holding ``kv`` cached tokens; 0 without sequences."""
        if seqs <= 0:
            return 0.0
        return _bilinear(self.decode_s, self.decode_seqs, seqs, self.decode_kv, kv)

    def decode_run(self, seqs: float, kv: float, steps: int) -> np.ndarray:
        """``[steps]`` seconds of consecutive decode steps of ``seqs`` sequences, the cached tokens
        growing by ``seqs`` a step from ``kv``."""
        kvs = kv + seqs * np.arange(steps, dtype=np.float64)
        return np.interp(kvs, self.decode_kv, self._row(seqs))

    def prefill(self, tokens: float, ctx: float) -> float:
        """One prefill step of ``tokens`` per rank attending spans of ``ctx`` (module docstring)."""
        if tokens <= 0:
            return 0.0
        return _bilinear(self.prefill_s, self.prefill_tokens, tokens, self.prefill_ctx, ctx)

    def scaled(self, decode: float, prefill: float = 1.0) -> StepTable:
        """This table with every decode step ``decode`` times as long and every prefill step ``prefill``
        times (a mixed step follows both)."""
        for name, v in (("decode", decode), ("prefill", prefill)):
            if not (np.isfinite(v) and v > 0):
                raise ValueError(f"a {name} scale must be a finite number > 0, got {v!r}")
        return replace(
            self, decode_s=self.decode_s * float(decode), prefill_s=self.prefill_s * float(prefill)
        )

    def mixed(self, tokens: float, ctx: float, seqs: float, kv: float) -> float:
        """A step of ``tokens`` prompt tokens beside ``seqs`` decode sequences holding ``kv`` tokens."""
        if tokens <= 0:
            return self.decode(seqs, kv)
        if seqs <= 0:
            return self.prefill(tokens, ctx)
        return self.prefill(tokens + seqs, ctx) + self.decode(seqs, kv) - self.decode(seqs, 0.0)


def kv_tokens_per_rank(model: ModelSpec, result: LayoutResult) -> int:
    """KV-cache tokens one attention-DP rank of ``result``'s layout holds: the layout's free KV bytes per
    GPU over one token's bytes per GPU (MLA's latent replicated over attention TP, GQA's heads split)."""
    t = result.candidate.attn_tp
    per_token = model.kv_bytes_per_token * (
        t if model.attention == "mla" else 1.0 / min(t, model.num_kv_heads)
    )
    return int(max(result.memory.kv_free, 0.0) // per_token)


def _seconds(model, cluster, result, options: CostOptions, load) -> float:
    """The cost model's step time of ``result``'s layout and placement under ``options``."""
    r = evaluate_candidate(model, cluster, result.candidate, options, load, None, None, result.placement)
    if r.cost is None:
        raise ValueError(f"{result.candidate.label(model.num_logical_experts)}: {r.reason}")
    return float(r.cost.step_time)


def build_table(
    model: ModelSpec,
    cluster: ClusterSpec,
    result: LayoutResult,
    load: np.ndarray,
    shape: tuple[int, int, int],
    base: CostOptions,
) -> StepTable:
    """The step-time table of one pool's layout (``result``, with its placement) on its cluster.

    Args:
        load: ``[L_moe, E]`` per-expert load the cost model prices the placement on.
        shape: ``(decode cap: sequences per rank, prefill chunk: tokens per rank, longest prompt)``.
        base: cost options the grid points vary (``overlap``, ``reserve_fraction``).
    """
    seqs_cap, chunk, longest = shape
    kv_cap = max(kv_tokens_per_rank(model, result) * 0.995, 1.0)
    seqs = powers_of_two(max(1, seqs_cap))
    kvs = list(np.linspace(0.0, kv_cap, GRID_POINTS))
    dec = np.empty((len(seqs), len(kvs)))
    for i, b in enumerate(seqs):
        for j, k in enumerate(kvs):
            ctx = max(1, int(k // b))
            opts = replace(base, phase="decode", step_tokens=int(b), context_len=ctx)
            dec[i, j] = _seconds(model, cluster, result, opts, load)
    toks = powers_of_two(max(1, chunk))
    ctxs = list(np.linspace(1.0, max(2.0, 2.0 * longest), GRID_POINTS))
    pre = np.empty((len(toks), len(ctxs)))
    for i, c in enumerate(toks):
        for j, x in enumerate(ctxs):
            opts = replace(base, phase="prefill", step_tokens=int(c), context_len=max(1, int(round(x))))
            pre[i, j] = _seconds(model, cluster, result, opts, load)
    return StepTable(
        [float(s) for s in seqs], [float(k) for k in kvs], dec, [float(c) for c in toks], ctxs, pre
    )
