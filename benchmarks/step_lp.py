"""The per-step min-max split as a linear program solved by HiGHS: the reference the per-step solver
(``placement/step_balance.py``) and SGLang's LP dispatch (``sglang-lp``) are checked against.

One layer and step: counts ``c [E]`` over the replicas ``l2p [E, R]`` (ascending slots, -1 padded) of
``G`` GPUs with ``S`` slots each. Variables: the tokens ``x`` of every replica and the peak ``M``;
``min M`` subject to each expert's replicas summing to its count and every GPU's load being at most ``M``
(the LP SGLang's ``LPLBSolver`` builds per layer, without its feasibility slack).
"""

from __future__ import annotations

import numpy as np

__all__ = ["highs_step_peak"]


def highs_step_peak(
    counts: np.ndarray, l2p: np.ndarray, slots_per_gpu: int, num_gpus: int | None = None
) -> float:
    """The LP optimum ``M`` of one layer and step: ``counts [E]``, ``l2p [E, R]``; ``num_gpus``
    defaults to the GPUs the map reaches. Raises RuntimeError when HiGHS does not find the optimum."""
    import scipy.sparse as sp
    from scipy.optimize import linprog

    c = np.asarray(counts, dtype=np.float64)
    e_idx, r_idx = np.nonzero(l2p >= 0)  # one variable per replica
    gpu = l2p[e_idx, r_idx] // slots_per_gpu
    G = int(gpu.max()) + 1 if num_gpus is None else int(num_gpus)
    n = e_idx.size
    a_eq = sp.csr_matrix((np.ones(n), (e_idx, np.arange(n))), shape=(c.size, n + 1))  # replicas sum to c
    a_ub = sp.hstack([sp.csr_matrix((np.ones(n), (gpu, np.arange(n))), shape=(G, n)), -np.ones((G, 1))])
    cost = np.zeros(n + 1)
    cost[-1] = 1.0  # min M
    res = linprog(cost, A_ub=a_ub, b_ub=np.zeros(G), A_eq=a_eq, b_eq=c, method="highs")
    if res.status != 0:
        raise RuntimeError(f"HiGHS ended with status {res.status}: {res.message}")
    return float(res.fun)
