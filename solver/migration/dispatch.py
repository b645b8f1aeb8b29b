"""Migration under the engine's dispatch model: score candidate layers as the engine will serve them.

Shapes: L layers, E logical experts, P physical slots, G GPUs, C candidates per layer.

The migration's local search balances the even split (a replica's share is ``1 / replicas``). An engine
whose dispatch has fixed per-rank shares (SGLang's static table, the locality-first ideal: a rank uses
its own GPU's replica, else its node's) serves a map differently: a move that helps the even split
may not help there. So, per layer, the candidates (stay put, the searched layer, the full re-solve)
are scored under the problem's model from tokens per (source rank, expert), and each layer takes the
best on ``peak + move_cost x moved`` within the move budget (:func:`choose_layers`).

Each candidate is scored with every layer taken from it. SGLang's static table is drawn layer after
layer from one generator per rank, so a layer's remote-replica draws also depend on the layers before
it: the chosen mix can differ from the candidates' scores on some layers (a few per cent of a layer's
peak on DeepSeek-V2-Lite); the report's ``dispatch_peak`` is the mix scored again.

Models without fixed shares per rank (vLLM's hash over batch rows is even in expectation) and ``even``
itself keep the even score; :func:`dispatch_scorer` then returns None and the migration is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from placement.dispatch import get_dispatch
from placement.metrics import rank_expert_counts, rank_gpu_load
from placement.model import Placement
from solver.dispatch_fit import even_rank_counts

if TYPE_CHECKING:
    from solver.problem import Problem

__all__ = ["choose_layers", "dispatch_scorer"]

Scorer = Callable[[np.ndarray], np.ndarray]  # map int64 [L, P] -> peak GPU load float64 [L]


def dispatch_scorer(
    problem: Problem | None, num_experts: int, layer_ids: tuple[int, ...]
) -> tuple[Scorer | None, str]:
    """``(scorer or None, note)``: per-layer peak under ``problem.dispatch`` for maps ``[L, P]``.

    None (with a note unless the model is the even split) when the model has no fixed per-rank
    shares. Tokens per (source rank, expert) come from the problem's trace (its per-token or
    per-window routing, ``problem.source_ranks``); without them every expert's count is split evenly
    over the ranks, which the note says.
    """
    if problem is None:
        return None, ""
    model = get_dispatch(problem.dispatch)
    if not (model.fractional and model.needs_source_ranks):
        if model.counts_only:
            return None, ""
        return None, f"{model.name} has no fixed per-rank shares: candidate layers scored with the even split"
    topo = problem.topology
    L, G = problem.load.shape[0], topo.ep_size
    trace = problem.trace
    routed = trace is not None and (trace.has_tokens or trace.window_counts is not None)
    if routed and (trace.num_layers, trace.num_logical_experts) == (L, num_experts):
        counts = rank_expert_counts(trace, G, problem.source_ranks).astype(np.float64)  # [L, G, E]
        how = "the trace's tokens per source rank"
    else:
        counts = even_rank_counts(problem.load, G)  # [L, G, E]
        how = "each expert's count split evenly over the ranks (no per-token or per-window routing)"

    def score(p2l: np.ndarray) -> np.ndarray:
        pl = Placement(p2l, num_experts, topo, layer_ids)
        return rank_gpu_load(pl, counts, model).max(axis=1)  # [L]

    return score, f"candidate layers scored under {model.name} from {how}"


def choose_layers(peaks: np.ndarray, moved: np.ndarray, budget: float, move_cost: float) -> np.ndarray:
    """Per layer, which candidate to take: int64 ``[L]`` indices into the ``C`` candidates.

    Args:
        peaks: float64 ``[C, L]`` each candidate's peak under the dispatch model; candidate 0 is staying
            put (``moved[0] == 0``), candidate 1 the searched layer, the others alternatives.
        moved: int64 ``[C, L]`` moved slots of each candidate.
        budget: moved slots allowed in total (``inf``: none).
        move_cost: objective cost of one moved slot (load units).

    Steps: take the searched layer unless it is worse than staying put; then, best gain per extra
    moved slot first, switch a layer to a better alternative while the budget allows. The total of
    the chosen candidates' moves never exceeds ``max(budget, total of the searched layers' moves)``.
    """
    obj = peaks + move_cost * moved  # [C, L]
    tol = 1e-9 * (np.abs(obj).max() + 1.0)
    L = peaks.shape[1]
    choice = np.where(obj[1] > obj[0] + tol, 0, 1)  # [L]
    spent = float(moved[choice, np.arange(L)].sum())
    while True:
        cur = obj[choice, np.arange(L)]  # [L]
        extra = moved - moved[choice, np.arange(L)][None, :]  # [C, L]
        gain = cur[None, :] - obj  # [C, L]
        ok = (gain > tol) & (spent + extra <= budget)
        if not ok.any():
            return choice
        eff = np.where(ok, gain / np.maximum(extra, 1), -np.inf)
        c, l = np.unravel_index(int(np.argmax(eff)), eff.shape)
        spent += float(extra[c, l])
        choice[l] = c
