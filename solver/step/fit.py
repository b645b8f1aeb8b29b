"""Placing replicas for a dispatch model that splits every step's counts (``balanced``, ``sglang-lp``).

Under a per-step split a replicated expert is an edge along which load flows between GPUs: what sets
step time is how flat the best split of each step is, not the window average. The fit here keeps the
number of slots and chooses which experts hold the redundant slots and where:

    sample steps of the phase from the fit part -> per layer: guard -> start -> local search, scored by
    the mean over the sampled steps of the modelled MoE layer time (or, without a cost model, the
    per-step peak) -> keep a layer only if it is better under the dispatch model on the search steps
    and on a validation part -> report

- steps (``phase``): ``decode`` steps of :func:`placement.steps.make_steps` (steady-state continuous
  batching, ``step_tokens`` sequences per rank; more seeded starts when the part holds too few), or
  ``prefill`` steps of ``step_tokens * G`` consecutive tokens starting at random multiples of
  ``step_tokens``; a trace with recorded engine batches is stepped by them. Drawn from the first
  ``1 - validation`` of the fit tokens (search) and from the rest (validation).
- objective (``cost``, :mod:`solver.step.cost`): per step, the slowest GPU's grouped GEMM from its
  tokens and its active experts (a replica that gets a few tokens still reads a whole expert's
  weights, which dominates in decode) plus dispatch and combine, from the one cost model
  (:mod:`placement.cost.step_time`); a layer is kept only where both its time and its step peak do
  not rise. Without a cost model: the step peak alone.
- guard (:class:`_Guard`): on the whole fit load and on each of ``window_parts`` consecutive parts of
  the fit tokens, the even-split window loads of every state keep the mean of the ``top_share`` most
  loaded GPUs within ``top_slack`` of the given placement's, and the peak within ``window_slack``
  (``fit_window_slack`` on the whole load) of the given placement's or the start's, whichever is
  higher. The mean of the top GPUs is the robust part: rearranging replicas under a peak limit alone
  lifts more GPUs up to the peak, and on held-out traffic the peak then rises (the window balance
  under ``even`` would be given away beyond the load it was fitted on).
- start (:mod:`solver.step.start`): the given placement, or replica counts that also weigh each
  expert's high per-step load (spiking experts get replicas) packed so that the replicas link the GPUs
  into one graph; the candidate the guard accepts with the best score.
- search: moves that re-point a slot holding a second (or later) replica to another expert, or swap
  two slots between GPUs; targeted moves replicate an expert of a GPU that carries the step peaks
  onto a cold GPU (a new edge from hot to cold) or swap a hot GPU's slot with a cold GPU's. A move
  is a scored proposal: illegal or guard-breaking draws are redrawn (up to ``draws``); it is kept
  only when it lowers the score. The split during the search is :func:`relaxed_split`, a fast
  feasible fractional split (within about 0.2% of the LP optimum on the shared traces); the final
  checks use the model's own ``step_load``.
- deterministic for a seed and a move budget (``moves`` per layer).

Shapes: L layers, E logical experts, P slots, G GPUs, S slots per GPU, N steps.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass

import numpy as np

from moe_placement.base.limits import MAX_FIT_STEPS, MAX_SEARCH_SAMPLES, MAX_STEP_TOKENS, MAX_TIME_LIMIT_S
from moe_placement.base.options import refuse_unknown_keywords
from placement.cost.fields import Range, check_fields
from placement.dispatch import DispatchModel, get_dispatch
from placement.model import Placement, compute_logical_maps
from placement.steps import make_steps, step_counts
from profiling.trace import RoutingTrace
from solver.step.cost import StepCost, layer_seconds, slot_loads
from solver.step.start import start_rows

__all__ = [
    "StepFit",
    "StepFitOptions",
    "fit_for_steps",
    "relaxed_peak",
    "relaxed_split",
    "sample_step_counts",
    "step_lower_bound_par",
    "step_scores",
    "step_seconds",
]

log = logging.getLogger(__name__)


@refuse_unknown_keywords
@dataclass(frozen=True)
class StepFitOptions:
    """How :func:`fit_for_steps` samples, starts and searches.

    Attributes:
        step_tokens: tokens per rank per step (``--step-tokens``).
        num_steps: steps sampled for the search (and at most as many for validation).
        moves: move attempts per layer. seed: seeds the sampling and the moves.
        validation: the trailing share of the fit tokens kept for validation.
        window_slack: how far a layer's even-split window peak may rise over the start's (or the
            given placement's, whichever is higher), on the load of each of ``window_parts``
            consecutive parts of the fit tokens.
        fit_window_slack: the same on the whole fit load.
        top_share, top_slack: the robust window guard: on the same loads, the mean load of the
            ``top_share`` most loaded GPUs may rise at most ``top_slack`` over the given placement's.
        count_blends: the starts' replica counts weigh experts by ``(1 - b)`` x mean load + ``b`` x
            their ``count_quantile`` per-step load, for each ``b`` here (:mod:`solver.step.start`).
        pack_slack: the starts' packing may put a replica up to this share of the mean GPU load above
            the lightest GPU to link two islands of the replica graph.
        draws: proposals drawn per move until one is legal and within the window guard.
        iters: rounds of :func:`relaxed_peak` per score.
        phase: the steps placed for (:func:`placement.steps.make_steps`: ``decode``, ``prefill``).
        cost: price each step with this model and hardware (:mod:`solver.step.cost`): the search
            minimizes modelled MoE layer time and a layer is kept only where both its time and its
            step peak do not rise; None: the step peak alone.
        time_limit: seconds the fit may take (the solve's ``time_limit``); the search stops there,
            keeping what it found, and :attr:`StepFit.stopped_at_limit` says so. None: only the move
            budget bounds it (deterministic for a seed).
    """

    step_tokens: int = 64
    num_steps: int = 96
    moves: int = 300
    seed: int = 0
    validation: float = 0.25
    window_slack: float = 0.005
    fit_window_slack: float = 0.005
    window_parts: int = 4
    top_share: float = 0.125
    top_slack: float = 0.01
    count_blends: tuple[float, ...] = (0.0, 0.5, 1.0)
    count_quantile: float = 0.9
    pack_slack: float = 0.03
    draws: int = 8
    iters: int = 30
    phase: str = "decode"
    cost: StepCost | None = None
    time_limit: float | None = None

    def __post_init__(self) -> None:
        check_fields(self, _STEP_FIT_RANGES, "", prefix="StepFitOptions.")


# accepted ranges of StepFitOptions' fields: shares in [0, 1], counts bounded so that no call asks for
# endless work or more sampled steps than memory holds (each sampled step is an [L, E] count array)
_SHARE = Range(0.0, 1.0)
_STEP_FIT_RANGES = {
    "step_tokens": Range(1, MAX_STEP_TOKENS),
    "num_steps": Range(1, MAX_SEARCH_SAMPLES),
    "moves": Range(0, MAX_FIT_STEPS),
    "seed": Range(0, 2**32 - 1),
    "validation": Range(0.0, 0.9),
    "window_slack": _SHARE,
    "fit_window_slack": _SHARE,
    "window_parts": Range(1, 1000),
    "top_share": Range(0.0, 1.0, lo_open=True),
    "top_slack": _SHARE,
    "count_blends": _SHARE,
    "count_quantile": _SHARE,
    "pack_slack": _SHARE,
    "draws": Range(1, 10_000),
    "iters": Range(1, 10_000),
    "time_limit": Range(0.0, MAX_TIME_LIMIT_S, lo_open=True),
}


@dataclass(frozen=True, eq=False)
class StepFit:
    """What the step did: the layers changed, mean per-step peaks (tokens, summed over layers) before
    and after on the search and validation steps (summed over the changed layers), the validation
    steps' counts ``[N, L, E]`` and the start each changed layer's search began from;
    ``stopped_at_limit``: the time limit ended the search with ``layers_searched`` layers searched to
    the end of their move budget and ``layers_started`` begun."""

    dispatch: str
    changed_layers: tuple[int, ...]
    fit_peak_before: float
    fit_peak_after: float
    validation_peak_before: float
    validation_peak_after: float
    step_tokens: int
    validation_counts: np.ndarray
    starts: tuple[str, ...] = ()
    phase: str = "decode"
    cost: StepCost | None = None
    validation_rank_counts: np.ndarray | None = None
    time_before_us: float = 0.0
    time_after_us: float = 0.0
    stopped_at_limit: bool = False
    layers_searched: int = 0
    layers_started: int = 0
    time_limit: float | None = None

    def note(self) -> str:
        objective = self.cost.describe() if self.cost is not None else "the step peak (no cost model)"
        out = (
            f"{self.dispatch}: replicas placed for per-step balance in {len(self.changed_layers)} layer(s) "
            f"on {self.phase} steps of {self.step_tokens} tokens per rank, objective {objective} (mean "
            f"step peak, summed over those layers: search {self.fit_peak_before:.0f} -> "
            f"{self.fit_peak_after:.0f}, validation {self.validation_peak_before:.0f} -> "
            f"{self.validation_peak_after:.0f} tokens"
        )
        if self.cost is not None:
            out += f"; validation MoE time {self.time_before_us:.1f} -> {self.time_after_us:.1f} us"
        if self.stopped_at_limit:
            out += f"; stopped at the time limit of {self.time_limit:g} s: {self.searched_text()}"
        return out + ")"

    def searched_text(self) -> str:
        """How far the search got: ``"2 of 5 layers searched to the end of their moves, 1 in part, 2 not
        at all"`` (what a stop at the time limit left)."""
        L = self.validation_counts.shape[1]
        part = self.layers_started - self.layers_searched
        return (
            f"{self.layers_searched} of {L} layers searched to the end of their moves, {part} in part, "
            f"{L - self.layers_started} not at all (raise the time limit to search them all)"
        )

    def score(self, placement: Placement, layers=None) -> float:
        """What the pipeline's gate compares on the validation steps, summed over ``layers`` (None:
        all): the modelled MoE time (seconds) when there is a cost model, else the mean step peak."""
        layers = range(placement.num_layers) if layers is None else list(layers)
        model = get_dispatch(self.dispatch)
        if self.cost is not None and self.validation_rank_counts is not None:
            return float(_figures(placement, self.validation_rank_counts, model, self.cost, layers)[1].sum())
        return float(_figures(placement, self.validation_counts, model, None, layers)[0].sum())


# ---------------------------------------------------------------------------------------------
# steps and scores
# ---------------------------------------------------------------------------------------------
def sample_step_counts(
    trace: RoutingTrace,
    ep_size: int,
    step_tokens: int,
    num_steps: int | None,
    seed: int = 0,
    phase: str = "decode",
    per_rank: bool = False,
) -> np.ndarray:
    """Tokens per expert of sampled steps of ``phase``: int64 ``[N, L, E]`` (``per_rank``: ``[N, L, G, E]``).

    ``num_steps`` steps drawn without replacement (None: the steps of one
    :func:`placement.steps.make_steps`). ``decode`` and engine batches: steps of
    :func:`placement.steps.make_steps`, more steady-state starts (seeds) when one gives fewer than
    ``num_steps``. ``prefill``: ``step_tokens * ep_size`` consecutive tokens starting at any multiple
    of ``step_tokens`` (chunk ``i`` of the step on rank ``i``).
    """
    if not trace.has_tokens:
        raise ValueError("per-step placement needs a per-token trace (topk_ids), not counts only")
    if phase == "prefill" and trace.step_offsets is None:
        per = _prefill_windows(trace, ep_size, int(step_tokens), num_steps, seed)  # [N, G, L, E]
    else:
        per = _made_steps(trace, ep_size, phase, step_tokens, num_steps, seed)
    return per.transpose(0, 2, 1, 3) if per_rank else per.sum(axis=1)


def _made_steps(trace, G: int, phase: str, b: int, num_steps: int | None, seed: int) -> np.ndarray:
    """Counts ``[N, G, L, E]`` of steps of :func:`placement.steps.make_steps`, sampled (module doc)."""
    parts, have = [], 0
    for rep in range(8):  # decode: more steady-state starts until there are enough steps
        st = make_steps(trace, G, phase, b, seed=seed + 7919 * rep)
        parts.append(step_counts(trace, st).transpose(0, 2, 1, 3))  # [S, G, L, E]
        have += st.num_steps
        if num_steps is None or have >= num_steps or st.phase != "decode":
            break
    per = np.concatenate(parts)
    if num_steps is None or per.shape[0] <= num_steps:
        return per
    pick = np.sort(np.random.default_rng(seed).choice(per.shape[0], size=int(num_steps), replace=False))
    return per[pick]


def _prefill_windows(trace: RoutingTrace, G: int, b: int, num_steps: int | None, seed: int) -> np.ndarray:
    """Counts ``[N, G, L, E]`` of prefill steps: ``G`` consecutive chunks of ``b`` tokens from sampled
    chunk starts (None: the disjoint steps from token 0)."""
    ids = trace.topk_ids
    assert ids is not None
    T, L, _ = ids.shape
    E = trace.num_logical_experts
    C = T // b  # whole chunks of b tokens
    if C < G:
        raise ValueError(
            f"one prefill step of {b} tokens per rank on {G} ranks takes {b * G} tokens but the trace has "
            f"only {T}; lower --step-tokens to at most {max(T // G, 1)} or give a longer trace"
        )
    chunk = np.repeat(np.arange(C), b)  # [C*b] chunk of each token
    flat = ids[: C * b].astype(np.int64)  # [C*b, L, k]
    valid = flat >= 0
    key = (chunk[:, None, None] * L + np.arange(L)[None, :, None]) * E + np.maximum(flat, 0)
    per_chunk = np.bincount(key[valid], minlength=C * L * E).reshape(C, L, E)
    if num_steps is None:
        starts = np.arange(0, C - G + 1, G)
    else:
        n_start = C - G + 1
        rng = np.random.default_rng(seed)
        starts = np.sort(rng.choice(n_start, size=min(int(num_steps), n_start), replace=False))
    return per_chunk[starts[:, None] + np.arange(G)[None, :]]  # [N, G, L, E]


def step_scores(placement: Placement, counts: np.ndarray, dispatch: str | DispatchModel) -> np.ndarray:
    """Mean over steps of the peak GPU load per layer under ``dispatch``'s ``step_load``: ``[L]``.

    ``counts``: ``[N, L, E]`` each step's all-reduced tokens per expert.
    """
    model = get_dispatch(dispatch)
    if model.step_load is None:
        raise ValueError(f"dispatch model {model.name!r} is not scored per step")
    t = placement.topology
    out = np.zeros(placement.num_layers)
    for l in range(placement.num_layers):
        slot = model.step_load(placement, l, counts[:, l, :])  # [N, P]
        out[l] = slot.reshape(counts.shape[0], t.ep_size, -1).sum(axis=2).max(axis=1).mean()
    return out


def step_lower_bound_par(counts: np.ndarray, ep_size: int, num_physical_experts: int) -> float:
    """A lower bound on ``step_par`` for any placement with these slots, under any split.

    Per step and layer ``max(mean, largest count / most replicas it can have)`` over the mean (the most
    replicas: ``min(G, 1 + P - E)``), averaged like ``step_par``. ``counts``: ``[N, L, E]``.
    """
    c = np.asarray(counts, dtype=np.float64)
    E = c.shape[-1]
    mean = c.sum(axis=-1) / ep_size  # [N, L]
    most = max(1, min(ep_size, 1 + num_physical_experts - E))
    lb = np.maximum(mean, c.max(axis=-1) / most)
    return float(np.where(mean > 0, lb / np.where(mean > 0, mean, 1.0), 1.0).mean(axis=0).mean())


def relaxed_peak(counts: np.ndarray, l2p: np.ndarray, slots_per_gpu: int, num_gpus: int, iters: int = 30):
    """Best peak seen of a feasible fractional split, per step: float64 ``[N]`` (an upper bound on the
    LP optimum, converging to it), and the last split's GPU loads ``[N, G]``
    (:func:`relaxed_split` without the split itself)."""
    best, last, _ = relaxed_split(counts, l2p, slots_per_gpu, num_gpus, iters)
    return best, last


def relaxed_split(counts: np.ndarray, l2p: np.ndarray, slots_per_gpu: int, num_gpus: int, iters: int = 30):
    """:func:`relaxed_peak`'s best peaks ``[N]`` and last GPU loads ``[N, G]``, and the last split:
    tokens per replica ``[N, E, R]``.

    Starts even; each round, every expert with several replicas moves a quarter of the load gap from
    its most to its least loaded replica's GPU (all experts at once: damped to avoid overshoot).
    ``counts``: float ``[N, E]``; ``l2p``: int ``[E, R]``, -1 padded.
    """
    N, E = counts.shape
    R = l2p.shape[1]
    valid = l2p >= 0  # [E, R]
    gpu = np.where(valid, l2p // slots_per_gpu, 0)  # [E, R]
    onehot = np.zeros((E * R, num_gpus))
    onehot[np.arange(E * R), gpu.ravel()] = valid.ravel()  # replica -> its GPU
    n = valid.sum(axis=1)
    x = np.where(valid[None], (counts / n)[:, :, None], 0.0)  # [N, E, R] tokens per replica
    multi = np.flatnonzero(n > 1)
    vm, gm = valid[multi][None], gpu[multi]  # [1, M, R], [M, R]
    best = np.full(N, np.inf)
    for _ in range(iters):
        ld = x.reshape(N, -1) @ onehot  # [N, G]
        best = np.minimum(best, ld.max(axis=1))
        if multi.size == 0:
            break
        gl = ld[:, gm]  # [N, M, R] load of each replica's GPU
        xm = x[:, multi]  # [N, M, R]
        h = np.where(vm & (xm > 0), gl, -np.inf).argmax(axis=2)[..., None]  # [N, M, 1]
        c = np.where(vm, gl, np.inf).argmin(axis=2)[..., None]
        xh = np.take_along_axis(xm, h, 2)
        amt = np.clip((np.take_along_axis(gl, h, 2) - np.take_along_axis(gl, c, 2)) * 0.25, 0, xh)
        np.put_along_axis(xm, h, xh - amt, 2)
        np.put_along_axis(xm, c, np.take_along_axis(xm, c, 2) + amt, 2)
        x[:, multi] = xm
    last = x.reshape(N, -1) @ onehot  # [N, G]
    return np.minimum(best, last.max(axis=1)), last, x


# ---------------------------------------------------------------------------------------------
# the search, one layer
# ---------------------------------------------------------------------------------------------
class _Guard:
    """The window guard of one layer, on the guarded loads ``[K, E]`` (the whole fit load, then its
    parts): the even-split GPU loads of a row may not raise the mean of the ``top_share`` most loaded
    GPUs more than ``top_slack`` over the reference row's (the given placement's), nor the peak more
    than ``slack [K]`` over the higher of the reference's and the start's (:meth:`around`)."""

    def __init__(self, ref_row, loads, slack, E: int, S: int, G: int, o: StepFitOptions):
        self.loads, self.slack, self.E, self.S, self.G = loads, np.asarray(slack), E, S, G
        self.top = max(1, int(round(o.top_share * G)))
        gpu = self.gpu_loads(ref_row)  # [K, G]
        self.ref_peak = gpu.max(axis=1)  # [K]
        self.top_limit = self.top_mean(gpu) * (1 + o.top_slack)  # [K]
        self.peak_limit = self.ref_peak * (1 + self.slack)  # [K]

    def gpu_loads(self, row) -> np.ndarray:
        """Even-split window GPU loads of ``row`` on each guarded load: ``[K, G]``."""
        n = np.bincount(row, minlength=self.E)
        return (self.loads[:, row] / n[row]).reshape(-1, self.G, self.S).sum(axis=2)

    def top_mean(self, gpu: np.ndarray) -> np.ndarray:
        return np.sort(gpu, axis=1)[:, -self.top :].mean(axis=1)  # [K]

    def robust_ok(self, row) -> bool:
        """The top GPUs' mean load within ``top_slack`` of the reference's on every guarded load."""
        return self._top_ok(self.gpu_loads(row))

    def ok(self, row) -> bool:
        """:meth:`robust_ok` and the peak within its limit on every guarded load."""
        gpu = self.gpu_loads(row)
        return bool(np.all(gpu.max(axis=1) <= self.peak_limit + 1e-9)) and self._top_ok(gpu)

    def _top_ok(self, gpu: np.ndarray) -> bool:
        return bool(np.all(self.top_mean(gpu) <= self.top_limit + 1e-9))

    def around(self, start_row) -> _Guard:
        """This guard with the peak limit raised to the start's peak (plus slack) where that is higher."""
        out = copy.copy(self)
        start_peak = self.gpu_loads(start_row).max(axis=1)
        out.peak_limit = np.maximum(self.ref_peak, start_peak) * (1 + self.slack)
        return out


def _shares(v: np.ndarray) -> np.ndarray:
    """``v / v.sum()``, or even shares when ``v`` sums to 0 (no spread, or a layer that routes nothing)."""
    total = float(v.sum())
    return v / total if total > 0 else np.full(v.size, 1.0 / v.size)


def _row_score(row, counts, rank_counts, E: int, S: int, G: int, o: StepFitOptions):
    """Search score of one layer's ``row [P]``: the mean relaxed step peak on ``counts [N, E]``, or
    with ``o.cost`` the mean modelled layer seconds of the relaxed split (``rank_counts [N, G, E]``);
    and the relaxed split's GPU loads ``[N, G]``."""
    l2p = compute_logical_maps(row[None], E)[0][0]  # [E, R]
    peak, ld, x = relaxed_split(counts, l2p, S, G, o.iters)
    if o.cost is None or rank_counts is None:
        return float(peak.mean()), ld
    slot = slot_loads(x, l2p, row.size)  # [N, P]
    return float(layer_seconds(o.cost, slot, rank_counts, row, S).mean()), ld


class _Layer:
    """One layer's search state: ``row`` int64 ``[P]`` (slot -> expert), scored on ``counts [N, E]``
    (and ``rank_counts [N, G, E]`` under a cost model), every state kept within ``guard``."""

    def __init__(self, row, counts, guard: _Guard, o: StepFitOptions, rank_counts=None):
        self.row, self.counts, self.guard, self.o = row.copy(), counts, guard, o
        self.rank_counts = rank_counts
        self.E, self.S, self.G = guard.E, guard.S, guard.G
        self.score = self.score_of(self.row)
        self.hot = self.last_hot  # [G] the current row's share of the peaks' excess per GPU
        sd, mean = counts.std(axis=0), counts.mean(axis=0)  # [E] per-step spread and mean
        self.want = (_shares(sd) + _shares(mean)) / 2  # [E] sums to 1 even with no spread

    def score_of(self, row) -> float:
        score, ld = _row_score(row, self.counts, self.rank_counts, self.E, self.S, self.G, self.o)
        excess = np.maximum(ld - ld.mean(axis=1, keepdims=True), 0).mean(axis=0) + 1e-9  # [G]
        self.last_hot = excess / excess.sum()  # where the peaks are: targeted moves start there
        return score

    def propose(self, rng: np.random.Generator) -> np.ndarray | None:
        """A re-pointed redundant slot or a swap of two slots between GPUs; None if the draw is illegal."""
        row, S = self.row, self.S
        new = row.copy()
        n = np.bincount(row, minlength=self.E)
        targeted = rng.random() < 0.5  # start from the GPUs that carry the peaks
        if rng.random() < 0.5:
            spare = np.flatnonzero(n[row] > 1)  # slots whose expert has another replica
            if spare.size == 0:
                return None
            p = int(rng.choice(spare))
            if targeted:  # a new edge from a hot GPU to a cold one: replicate a hot GPU's expert there
                cold = self.hot.max() - self.hot[spare // S] + 1e-9
                p = int(rng.choice(spare, p=cold / cold.sum()))
                g = int(rng.choice(self.G, p=self.hot))
                w = self.want[row[g * S : (g + 1) * S]] + 1e-12  # the most varying or loaded first
                b = int(row[g * S + rng.choice(S, p=w / w.sum())])
            else:
                b = int(rng.choice(self.E, p=self.want))
            if b in row[(p // S) * S : (p // S + 1) * S]:
                return None
            new[p] = b
        else:
            p, q = (int(v) for v in rng.choice(row.size, 2, replace=False))
            if targeted:  # swap a slot of a hot GPU with one of a cold GPU
                p = int(rng.choice(self.G, p=self.hot)) * S + int(rng.integers(S))
                cold = self.hot.max() - self.hot + 1e-9
                q = int(rng.choice(self.G, p=cold / cold.sum())) * S + int(rng.integers(S))
            gp, gq = p // S, q // S
            if gp == gq or row[p] == row[q]:
                return None
            if row[q] in row[gp * S : (gp + 1) * S] or row[p] in row[gq * S : (gq + 1) * S]:
                return None
            new[p], new[q] = row[q], row[p]
        return new

    def search(self, rng: np.random.Generator, deadline: float) -> bool:
        """Up to ``o.moves`` scored moves; False when ``deadline`` (``time.perf_counter``) cut it short."""
        for _ in range(self.o.moves):
            if time.perf_counter() > deadline:
                return False
            for _ in range(self.o.draws):  # a move is a scored proposal: redraw illegal ones
                new = self.propose(rng)
                if new is not None and self.guard.ok(new):
                    break
            else:
                continue
            score = self.score_of(new)
            if score < self.score * (1 - 1e-9):
                self.row, self.score, self.hot = new, score, self.last_hot
        return True


# ---------------------------------------------------------------------------------------------
# the step
# ---------------------------------------------------------------------------------------------
def _search_and_validation(trace: RoutingTrace, G: int, o: StepFitOptions) -> tuple[np.ndarray, np.ndarray]:
    """Sampled step counts of ``o.phase`` of the search part and of the validation part (the search
    part's own when the trailing part is shorter than a step): ``[N, L, G, E]`` per rank under a cost
    model (its traffic needs them), else ``[N, L, E]``."""
    T = trace.num_tokens
    cut = int(round(T * (1.0 - o.validation)))
    per_step = o.step_tokens * G
    ranks = o.cost is not None

    def sample(tr: RoutingTrace, seed: int) -> np.ndarray:
        return sample_step_counts(tr, G, o.step_tokens, o.num_steps, seed, o.phase, per_rank=ranks)

    if cut < per_step or T - cut < per_step:
        whole = sample(trace, o.seed)
        return whole, whole
    return sample(trace.slice_tokens(0, cut), o.seed), sample(trace.slice_tokens(cut, T), o.seed + 1)


def _window_loads(trace: RoutingTrace, G: int, o: StepFitOptions) -> tuple[np.ndarray, np.ndarray]:
    """The window loads the search guards, float64 ``[K, L, E]`` (the whole fit load, then those of
    ``window_parts`` consecutive parts of the fit tokens, as many as hold a step each), and the slack
    of each ``[K]``."""
    loads, slack = [trace.counts().astype(np.float64)], [o.fit_window_slack]
    T = trace.num_tokens
    parts = max(1, min(int(o.window_parts), T // (o.step_tokens * G)))
    if parts > 1:
        cuts = np.linspace(0, T, parts + 1).round().astype(int)
        for a, b in zip(cuts[:-1], cuts[1:]):
            loads.append(trace.slice_tokens(a, b).counts().astype(np.float64))
            slack.append(o.window_slack)
    return np.stack(loads), np.array(slack)


def _pick_start(
    row: np.ndarray, counts: np.ndarray, load: np.ndarray, guard: _Guard, o: StepFitOptions, rank_counts=None
) -> tuple[str, np.ndarray]:
    """The start of one layer's search: the given ``row [P]`` or a :func:`solver.step.start.start_rows`
    candidate, whichever the robust guard accepts with the lowest search score (:func:`_row_score`)."""
    cands = [("given", row)] + start_rows(
        load, counts, guard.G, guard.S, o.count_blends, o.count_quantile, o.pack_slack
    )
    ok = cands[:1] + [c for c in cands[1:] if guard.robust_ok(c[1])]  # the given row is the reference
    return min(ok, key=lambda c: _row_score(c[1], counts, rank_counts, guard.E, guard.S, guard.G, o)[0])


def _search_layers(
    placement: Placement, search: np.ndarray, trace: RoutingTrace, o: StepFitOptions, deadline: float
):
    """Per layer: guard, start, search, until ``deadline`` (``time.perf_counter``; the layers not
    reached keep their rows). Returns the rows ``[L, P]``, each layer's start name, the layers searched
    to the end of their move budget and the layers begun (fewer than ``L`` when the deadline cut in)."""
    t = placement.topology
    G, S, E = t.ep_size, t.slots_per_gpu, placement.num_logical_experts
    loads, slack = _window_loads(trace, G, o)  # [K, L, E], [K]
    rng = np.random.default_rng(o.seed)
    p2l = placement.physical_to_logical_map
    rows, starts, done, begun = p2l.copy(), [], 0, 0
    for l in range(placement.num_layers):
        if time.perf_counter() > deadline:
            starts += ["given"] * (placement.num_layers - l)
            break
        begun += 1
        ranks = search[:, l].astype(np.float64) if search.ndim == 4 else None  # [N, G, E] or None
        counts = ranks.sum(axis=1) if ranks is not None else search[:, l].astype(np.float64)  # [N, E]
        guard = _Guard(p2l[l], loads[:, l], slack, E, S, G, o)
        name, start = _pick_start(p2l[l], counts, loads[0, l], guard, o, ranks)
        layer = _Layer(start, counts, guard.around(start), o, ranks)
        done += layer.search(rng, deadline)
        rows[l] = layer.row
        starts.append(name)
    return rows, starts, done, begun


def step_seconds(
    placement: Placement, rank_counts: np.ndarray, dispatch: str | DispatchModel, cost: StepCost, layers
) -> np.ndarray:
    """Mean modelled seconds per step of each of ``layers`` (0 elsewhere) under ``dispatch``'s own
    split: ``[L]``. ``rank_counts``: ``[N, L, G, E]`` picks per rank and expert of each step."""
    model = get_dispatch(dispatch)
    if model.step_load is None:
        raise ValueError(f"dispatch model {model.name!r} is not scored per step")
    S = placement.topology.slots_per_gpu
    out = np.zeros(placement.num_layers)
    for l in layers:
        c = np.asarray(rank_counts[:, l], dtype=np.float64)  # [N, G, E]
        slot = model.step_load(placement, l, c.sum(axis=1))  # [N, P]
        out[l] = layer_seconds(cost, slot, c, placement.physical_to_logical_map[l], S).mean()
    return out


def _figures(placement: Placement, counts: np.ndarray, model: DispatchModel, cost, layers) -> np.ndarray:
    """Mean step peak and (under ``cost``, with ``counts [N, L, G, E]``) mean modelled seconds of each
    of ``layers`` under the model's own split, one split per layer: ``[2, L]`` (0 elsewhere)."""
    out = np.zeros((2, placement.num_layers))
    t = placement.topology
    for l in layers:
        c = np.asarray(counts[:, l], dtype=np.float64)  # [N, (G,) E]
        tot = c.sum(axis=1) if c.ndim == 3 else c  # [N, E]
        slot = model.step_load(placement, l, tot)  # [N, P]
        out[0, l] = slot.reshape(tot.shape[0], t.ep_size, -1).sum(axis=2).max(axis=1).mean()
        if cost is not None and c.ndim == 3:
            out[1, l] = layer_seconds(
                cost, slot, c, placement.physical_to_logical_map[l], t.slots_per_gpu
            ).mean()
    return out


def _kept_layers(placement: Placement, cand: Placement, search, held, model, o: StepFitOptions, moved):
    """The moved layers the search improved on the search and the validation steps under the model's
    own split: lower step peak, or under a cost model lower time with no higher step peak. Returns the
    layers, the peaks ``[4, L]`` (search before/after, validation before/after) and the validation
    seconds ``[2, L]`` (before/after; None without a cost model)."""
    priced = o.cost is not None and search.ndim == 4
    f0, f1 = (_figures(p, search, model, o.cost, moved) for p in (placement, cand))
    v0, v1 = (_figures(p, held, model, o.cost, moved) for p in (placement, cand))
    peaks = np.stack([f0[0], f1[0], v0[0], v1[0]])
    if not priced:
        return [l for l in moved if f1[0, l] < f0[0, l] and v1[0, l] < v0[0, l]], peaks, None
    keep = [
        l
        for l in moved
        if f1[1, l] < f0[1, l] and v1[1, l] < v0[1, l] and f1[0, l] <= f0[0, l] and v1[0, l] <= v0[0, l]
    ]
    return keep, peaks, np.stack([v0[1], v1[1]])


def fit_for_steps(
    placement: Placement,
    trace: RoutingTrace,
    dispatch: str | DispatchModel,
    options: StepFitOptions | None = None,
) -> tuple[Placement, StepFit]:
    """``placement`` with its slots re-chosen for per-step balance under ``dispatch`` (a model with
    ``step_load``) on steps of ``options.phase``, never worse than ``placement`` on the search or
    validation steps of ``trace`` (under ``options.cost``: in modelled time and in step peak).

    Returns the placement (``placement`` itself when no layer changed) and the :class:`StepFit`.
    """
    o = options or StepFitOptions()
    deadline = time.perf_counter() + (o.time_limit if o.time_limit is not None else np.inf)
    model = get_dispatch(dispatch)
    t = placement.topology
    E = placement.num_logical_experts
    search, held = _search_and_validation(trace, t.ep_size, o)  # [N, L, (G,) E] each
    rows, starts, done, begun = _search_layers(placement, search, trace, o, deadline)
    p2l = placement.physical_to_logical_map
    moved = [l for l in range(placement.num_layers) if not np.array_equal(rows[l], p2l[l])]
    cand = Placement(rows, E, t, placement.layer_ids, placement.provenance)
    keep, peaks, secs = _kept_layers(placement, cand, search, held, model, o, moved)
    log.debug("step fit: %d layers moved in the search, %d kept; starts %s", len(moved), len(keep), starts)
    out = placement
    if keep:
        final = p2l.copy()
        final[keep] = rows[keep]
        out = Placement(final, E, t, placement.layer_ids, placement.provenance).with_provenance(
            dispatch=model.name,
            step_fit={"step_tokens": o.step_tokens, "moves": o.moves, "seed": o.seed, "phase": o.phase},
        )
    fit = StepFit(
        model.name,
        tuple(keep),
        *(float(p[keep].sum()) for p in peaks),
        o.step_tokens,
        held.sum(axis=2) if held.ndim == 4 else held,
        tuple(starts[l] for l in keep),
        phase=o.phase,
        cost=o.cost,
        validation_rank_counts=held if held.ndim == 4 else None,
        time_before_us=float(secs[0][keep].sum() * 1e6) if secs is not None else 0.0,
        time_after_us=float(secs[1][keep].sum() * 1e6) if secs is not None else 0.0,
        stopped_at_limit=done < placement.num_layers,
        layers_searched=done,
        layers_started=begun,
        time_limit=o.time_limit,
    )
    return out, fit
