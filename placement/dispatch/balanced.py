"""``balanced``: the per-step split our runtime executes (ours, deterministic, integer).

Each step, every EP rank all-reduces its MoE layer's token counts per logical expert and computes the
same integer quotas per replica, :func:`placement.step_balance.balanced_quotas`: the split of every
expert's tokens over its replicas that minimizes the peak GPU load (integer arithmetic only, ties by
index, so every rank and device gets the same bits).

Token-level route (the contract :func:`route` implements and the runtime implements in torch):

1. A step is every rank's ``s``-th forward batch; a token's row in its rank's batch is its
   ``batch_index`` (rank ``g``'s step ``s`` starts where its ``batch_index`` returns to 0).
2. Per step, the ranks' counts are all-gathered (``[G, E]``) and summed to ``c [E]``; the quotas
   ``q [E, R]`` come from ``c`` (replicas in ascending slot order, the order of
   ``logical_to_physical_map``). ``Q_e = [0, q_e0, q_e0 + q_e1, ...]`` are their prefix sums.
3. Expert ``e``'s tokens of the step are ordered by source rank, then by row within the rank's batch
   (a token picks an expert at most once). The token at position ``i`` of that order goes to replica
   ``r`` with ``Q_e[r] <= i < Q_e[r + 1]``.

Rank ``g`` can find its tokens' positions without seeing the other ranks' tokens: its first token for
``e`` sits at the all-gathered ``sum_{h < g} counts[h, e]``. So every replica receives exactly its
quota, and :func:`step_load` (the quotas scattered to slots) is the routed load, token for token.

``choices`` (expected shares) is the even split; it is used only where a caller has no step counts.
Shapes: E logical experts, R most replicas, P slots, G ranks, S steps, T tokens, k top-k.
"""

from __future__ import annotations

import numpy as np

from placement.dispatch.ideal import even_choices
from placement.dispatch.registry import DispatchModel, register
from placement.model import Placement
from placement.step_balance import balanced_quotas

__all__ = ["BALANCED", "balanced_step_load", "route_balanced", "step_map", "step_of_token", "step_picks"]


def step_map(placement: Placement, layer: int) -> np.ndarray:
    """The replicas the split uses: int64 ``[E, R]``, ascending, -1 padded.

    ``logical_to_physical_map`` of the layer, except that an engine map holding two replicas of an
    expert on one GPU (accepted with a warning) keeps only the first of them: a GPU's load does not
    depend on how its own copies share the tokens, so the second one receives none.
    """
    l2p = placement.logical_to_physical_map[layer]  # [E, R]
    if not placement.allow_colocated_replicas:
        return l2p
    gpu = np.where(l2p >= 0, l2p // placement.topology.slots_per_gpu, -1)  # [E, R]
    r = np.arange(l2p.shape[1])
    dup = ((gpu[:, :, None] == gpu[:, None, :]) & (r[None, None, :] < r[None, :, None])).any(axis=2)
    kept = np.where(dup | (l2p < 0), np.iinfo(np.int64).max, l2p)
    kept = np.sort(kept, axis=1)  # survivors first, ascending
    return np.where(kept == np.iinfo(np.int64).max, -1, kept).astype(np.int64)


def balanced_step_load(placement: Placement, layer: int, counts: np.ndarray) -> np.ndarray:
    """Tokens per slot ``[S, P]`` (float64) from each step's all-reduced counts ``[S, E]``."""
    l2p = step_map(placement, layer)  # [E, R] ascending, -1 padded
    c = np.rint(np.asarray(counts, dtype=np.float64)).astype(np.int64)  # [S, E]
    q = balanced_quotas(c, l2p, placement.topology.slots_per_gpu)  # [S, E, R]
    out = np.zeros((c.shape[0], placement.num_physical_experts))
    e_idx, r_idx = np.nonzero(l2p >= 0)  # one entry per replica
    out[:, l2p[e_idx, r_idx]] = q[:, e_idx, r_idx]
    return out


def step_of_token(src: np.ndarray, batch_index: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Each token's step and row ``(int64 [T], int64 [T])``: step ``s`` is its rank's ``s``-th batch.

    Without ``batch_index`` every token is in step 0, its row its position among its rank's tokens.
    """
    order = np.argsort(src, kind="stable")  # tokens grouped by rank, trace order inside
    ss = src[order]
    pos = np.empty_like(order)
    pos[order] = np.arange(order.size) - np.searchsorted(ss, ss, side="left")
    if batch_index is None:
        return np.zeros(src.size, dtype=np.int64), pos.astype(np.int64)
    rows = np.asarray(batch_index, dtype=np.int64)
    starts = (rows[order] == 0).astype(np.int64)  # a new batch of the rank begins
    run = np.cumsum(starts)
    first_run = run[np.searchsorted(ss, ss, side="left")] - starts[np.searchsorted(ss, ss, side="left")]
    step = np.empty_like(order)
    step[order] = run - first_run - 1
    return np.maximum(step, 0).astype(np.int64), rows


def step_picks(ids: np.ndarray, src: np.ndarray, batch_index, num_experts: int):
    """The real picks of a layer grouped by step (what a per-step model counts; -1 ids count nowhere).

    Args:
        ids: int64 ``[T, k]`` logical ids (-1: no pick); src: int64 ``[T]``; batch_index: int64 ``[T]``
            or None (:func:`step_of_token`).

    Returns:
        ``(ok bool [T*k], tok int64 [n], e int64 [n], step int64 [n], rows int64 [T], counts [S, E])``:
        which of the token-major picks are real, each real pick's token, expert and step, each token's
        row in its rank's batch, and the picks per (step, expert).
    """
    T, k = ids.shape
    step, rows = step_of_token(src, batch_index)  # [T], [T]
    n_steps = int(step.max()) + 1 if T else 1
    flat = ids.ravel()  # [T*k] picks, token-major
    ok = flat >= 0
    tok = np.repeat(np.arange(T), k)[ok]  # token of each real pick
    e = flat[ok]
    st = step[tok]
    counts = np.bincount(st * num_experts + e, minlength=n_steps * num_experts)
    return ok, tok, e, st, rows, counts.reshape(n_steps, num_experts)


def route_balanced(placement: Placement, layer: int, ids, src, batch_index=None, rng=None) -> np.ndarray:
    """Slots ``[T, k]`` by the contract above: ``ids`` int64 ``[T, k]`` (-1: no pick, counted nowhere),
    ``src`` int64 ``[T]``, ``batch_index`` int64 ``[T]`` (row in the rank's batch; None: one step)."""
    E = placement.num_logical_experts
    l2p = step_map(placement, layer)  # [E, R]
    ok, tok, e, st, rows, counts = step_picks(ids, src, batch_index, E)  # counts [steps, E]
    group = st * E + e  # (step, expert) of each pick
    q = balanced_quotas(counts, l2p, placement.topology.slots_per_gpu)  # [steps, E, R]
    cum = np.cumsum(q, axis=2)  # [steps, E, R]: Q_{r+1}
    order = np.lexsort((rows[tok], src[tok], group))  # by (step, e), rank, row
    gs = group[order]
    pos = np.empty_like(order)
    pos[order] = np.arange(order.size) - np.searchsorted(gs, gs, side="left")  # position i in the order
    r = (cum.reshape(counts.size, -1)[group] <= pos[:, None]).sum(axis=1)  # Q_{r} <= i < Q_{r+1}
    out = np.full(ok.size, -1, dtype=np.int64)
    out[ok] = l2p[e, r]
    return out.reshape(ids.shape)


BALANCED = register(
    DispatchModel(
        "balanced",
        "ours: per step, integer quotas per replica from the all-reduced counts minimizing the peak GPU",
        even_choices,
        needs_step_counts=True,
        fractional=False,
        route=route_balanced,
        step_load=balanced_step_load,
        counts_only=False,
        local_first=False,
        locality_fit=False,
        table_fit="",
        runtime_route="step",
    )
)
