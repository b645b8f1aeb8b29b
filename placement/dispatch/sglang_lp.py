"""``sglang-lp``: SGLang 0.5.23's ``--ep-dispatch-algorithm lp`` (LPLB), as its source builds it.

What SGLang does (``srt/eplb/lplb_solver.py``, ``srt/eplb/expert_location_dispatch.py``): per MoE layer
and forward pass, every rank counts its tokens per logical expert, the counts are all-reduced, and
every rank solves the same LP: minimize the largest GPU load ``M`` over the copy loads of the
replicated experts (an expert with one replica puts all its tokens on it; each replicated expert's
copies sum to its count; each GPU's load is at most ``M``), by an interior-point method on CUDA. The
copy loads over the expert's count are ``log2phy_prob``; each token then picks a replica of each of
its experts at random with those probabilities. It is CUDA only in SGLang, so its solver cannot run
here; this module models it:

- shares: an exact optimum of the same LP. Its value ``M* = lp_peak`` (Dinkelbach over max flows,
  :func:`placement.step_balance.lp_peak`) has a denominator ``d <= G``; the integer split of the counts
  scaled by ``d`` (:func:`placement.step_balance.balanced_quotas`) then reaches ``d * M*`` and, divided
  by ``d``, is an optimal LP point (where the integer search stops short of ``d * M*``, the point is
  within its rounding of the optimum; tests/test_step_dispatch.py checks it against HiGHS).
  SGLang's interior point can be another point of the same optimal face: the same peak in
  expectation, other loads on the GPUs below the peak.
- tokens: one seeded multinomial draw per (step, expert) over its replicas with those shares
  (:func:`lp_step_load`), or one draw per token (:func:`route_lp`): the scored loads are the draws'.

Shapes: E logical experts, R most replicas, P slots, G ranks, S steps, T tokens, k top-k.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from placement.dispatch.balanced import step_map, step_picks
from placement.dispatch.ideal import even_choices
from placement.dispatch.registry import DispatchModel, register
from placement.model import Placement
from placement.step_balance import balanced_quotas, lp_peak

__all__ = ["SGLANG_LP", "SGLANG_LP_SEED", "lp_shares", "lp_step_load", "route_lp"]

SGLANG_LP_SEED = 0  # seeds the modelled draws (SGLang draws from the device's generator)


def lp_shares(placement: Placement, layer: int, counts: np.ndarray) -> np.ndarray:
    """Share of each expert's tokens per replica at an optimal LP point: float64 ``[S, E, R]``.

    ``counts``: ``[S, E]`` each step's all-reduced tokens per expert. Rows sum to 1 (an expert with no
    tokens: even over its replicas); 0 on padding.
    """
    l2p = step_map(placement, layer)  # [E, R]
    S_gpu, G = placement.topology.slots_per_gpu, placement.topology.ep_size
    c = np.rint(np.asarray(counts, dtype=np.float64)).astype(np.int64).reshape(-1, l2p.shape[0])  # [S, E]
    peak = np.atleast_1d(lp_peak(c, l2p, S_gpu))  # [S]
    d = np.array([Fraction(float(x)).limit_denominator(G).denominator for x in peak], dtype=np.int64)
    q = balanced_quotas(c * d[:, None], l2p, S_gpu).astype(np.float64)  # [S, E, R]: d x an LP point
    total = q.sum(axis=2, keepdims=True)  # [S, E, 1]
    valid = (l2p >= 0)[None]
    even = np.where(valid, 1.0 / valid.sum(axis=2, keepdims=True), 0.0)
    return np.where(total > 0, q / np.where(total > 0, total, 1.0), even)


def lp_step_load(placement: Placement, layer: int, counts: np.ndarray) -> np.ndarray:
    """Tokens per slot ``[S, P]`` (float64): each step's count of every expert drawn over its replicas
    with the LP shares (seeded by :data:`SGLANG_LP_SEED` and the layer)."""
    l2p = step_map(placement, layer)  # [E, R]
    c = np.rint(np.asarray(counts, dtype=np.float64)).astype(np.int64)  # [S, E]
    shares = lp_shares(placement, layer, c)  # [S, E, R]
    rng = np.random.default_rng([SGLANG_LP_SEED, layer])
    drawn = rng.multinomial(c, shares)  # [S, E, R]
    out = np.zeros((c.shape[0], placement.num_physical_experts))
    e_idx, r_idx = np.nonzero(l2p >= 0)
    out[:, l2p[e_idx, r_idx]] = drawn[:, e_idx, r_idx]
    return out


def route_lp(placement: Placement, layer: int, ids, src, batch_index=None, rng=None) -> np.ndarray:
    """Slots ``[T, k]``: per step (as :func:`placement.dispatch.balanced.step_of_token` defines it),
    the LP shares from the step's counts, then one draw per pick from ``rng``."""
    if rng is None:
        raise ValueError("sglang-lp routing draws at random: pass rng")
    E = placement.num_logical_experts
    l2p = step_map(placement, layer)  # [E, R]
    ok, _, e, st, _, counts = step_picks(ids, src, batch_index, E)  # counts [steps, E]
    cum = np.cumsum(lp_shares(placement, layer, counts), axis=2)  # [steps, E, R]
    u = rng.random(ok.size)[ok]  # one draw per pick position, used by the real picks
    r = (cum[st, e] <= u[:, None]).sum(axis=1)
    r = np.minimum(r, (l2p >= 0).sum(axis=1)[e] - 1)  # rounding at the top end
    out = np.full(ok.size, -1, dtype=np.int64)
    out[ok] = l2p[e, r]
    return out.reshape(ids.shape)


SGLANG_LP = register(
    DispatchModel(
        "sglang-lp",
        "SGLang --ep-dispatch-algorithm lp (LPLB): per-step LP shares, a random replica per token",
        even_choices,
        engine="SGLang",
        version="0.5.23",
        engine_flag=("--ep-dispatch-algorithm", "lp"),
        needs_step_counts=True,
        fractional=False,
        route=route_lp,
        step_load=lp_step_load,
        counts_only=False,
        local_first=False,
        locality_fit=False,
        table_fit="",
        runtime_route="",
    )
)
