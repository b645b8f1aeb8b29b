"""Exact joint replication and placement per layer (OR-Tools CP-SAT, scipy MILP / HiGHS), with bounds.

Problem (one layer; E logical experts, G GPUs with S slots each, P = G*S, N nodes):

- replica counts ``n_e >= 1`` (integers, ``sum_e n_e = P``) and ``x[e, g] in {0, 1}`` (at most one
  replica of an expert per GPU), ``sum_e x[e, g] = S``, ``sum_g x[e, g] = n_e``;
- tokens of an expert split evenly over its replicas (the servers' static dispatch), so GPU ``g`` carries
  ``sum_e x[e, g] * c[e, n_e]`` with ``c[e, r] = w_e / r`` (the ``tokens`` objective) or the decode
  cost of one replica (``decode``, below); minimise the peak over GPUs (or over windows, ``robust``).
- optional node constraint (``node_constraint=True``, as the hierarchical policy): expert groups go
  to nodes (``groups / N`` groups per node) and every replica of a group's experts stays in its node;
  enforced inside the model (group-to-node variables), not by packing groups first.

The nonlinear ``w_e / n_e`` is linearised exactly: each expert's cost table ``c[e, r]`` over its
allowed counts ``r in [lo_e, hi_e]`` is an element constraint on ``n_e`` (CP-SAT) or a one-hot
``y[e, r]`` with products ``s[e, g] >= c[e, r] * (x[e, g] + y[e, r] - 1)`` (MILP; exact because the
objective only pushes ``s`` down). ``lo_e = max(1, ceil(w_e / UB))`` with UB the incumbent's peak
(every better solution needs it) and ``hi_e <= min(G, 1 + P - E)``; on large instances the count
range of cold experts is narrowed around the incumbent (``extra["restricted"]``), and then the
model's own bound is not used as a global bound.

Integer scaling (CP-SAT works on integers): with integer loads and ``lcm(1..R_max) * max(w)`` below
2**40 every share is scaled by ``K = lcm(1..R_max)`` and is exact. Otherwise ``K`` is a fixed-point
scale (total load about 1e7 units) and every share is rounded *up* (``ceil(w_e K / r)``): a model
solution's true peak is at most its model peak / K, and the model bound ``B`` certifies a true bound
``(B - S + 1) / K`` (each GPU adds at most ``S`` roundings of < 1 unit). The MILP works in floats.

Bounds reported per layer: the best of the closed-form ``peak_lower_bound`` (mean, hottest expert),
the count bound (the least ``T`` with ``sum_e max(1, ceil(w_e / T)) <= P`` and ``ceil(w_e / T) <= G``;
it dominates the closed form and the LP relaxation of the joint model, which is the mean) and the
complete model's proven bound.

Search: every layer starts from the greedy placement (global policy, or hierarchical with node
constraints), improved by a deterministic local search (swaps between the hottest GPU and the others,
and moving a slot from one expert to another), then CP-SAT hinted with it. The returned layer is the
best of greedy and the solvers' results, so it is never worse than greedy.

Determinism: with ``deterministic=True`` (default) every CP-SAT solve uses one worker, the given seed
and a *deterministic-time* limit (CP-SAT's work units; half a unit per second of the layer's wall
share, since units run about 2x slower than seconds on a loaded core) computed from ``time_limit``
only; the local search and the neighbourhood search are bounded by iterations and rounds, not time.
Two runs then return the same map, whatever the machine load, unless the wall-clock safety cap (4x
the per-layer share) cuts a solve short, which ``notes`` then reports. The per-layer share, the
validation guard's and the noise gate's budgets, and so the provenance, never depend on how long the
setup took. With ``deterministic=False`` solves use the wall clock. Ctrl-C during a CP-SAT solve
stops it and raises ``KeyboardInterrupt`` (OR-Tools' own SIGINT handler is not installed).

Decode objective (``objective="decode"``): in memory-bound decode a GPU's time per step is about
``a * tokens + t_read * (experts with at least one token)``. For a step of ``batch`` tokens per GPU
and top-k ``k``, expert ``e`` gets ``lam_e = f_e * k * batch * G`` selections (``f_e`` its load
share); one of its ``r`` replicas is active with probability ``1 - exp(-lam_e / r)`` (Poisson), so
``c[e, r] = a * lam_e / r + t_read * (1 - exp(-lam_e / r))`` microseconds. Replicating a cold expert
adds a weight read for few tokens, so the decode optimum replicates less than the token optimum.
Defaults (see :class:`DecodeCost`) are DeepSeek-V3 on H100; the hardware figures come from the one
cost model, :mod:`placement.cost.hardware`.

Robust (``robust="max"`` or ``"qNN"``): per window ``w`` the load is normalised to mean 1 per GPU and
the objective is the max over windows of the window's peak (PAR), or for ``qNN`` the CVaR at NN%: the
mean of the worst ``m = max(1, ceil((1 - NN/100) W))`` windows' peaks (exactly
``min_tau m*tau + sum_w max(0, peak_w - tau)``; an upper bound of the NN-th percentile).

Noise gate (default when the input has windows): the exact optimum of the fitted load beats greedy
by less than the sampling noise on the real traces, and then loses as often as it wins on held-out
traffic. So the default keeps greedy's placement and changes it only where the gain is significant:
per layer ``sigma`` = bootstrap standard deviation of greedy's peak (windows, or label groups, resampled
and rescaled to the fit total), then :func:`solver.migration.solve_migration` from greedy with
``move_cost = noise_k * sigma`` per moved slot, or the exact layer when it scores better on that same
penalised objective. The layer's proven bound is still the exact solve's, so its gap is reported.

Weighted dispatch: ``weighted="shares"`` keeps the even-split optimum and adds per-replica shares
``q[p] >= 0`` (summing to 1 per expert) from an LP that minimises the peak on that placement
(``extra["replica_shares"]``, ``extra["weighted_objective"]``). ``weighted=True`` chooses the placement
*for* weighted dispatch (:mod:`solver.weighted`: bin packing with item splitting, then the same LP):
the report is then the weighted solve's (``objective`` = weighted peak, ``bound`` = ``max(mean,
max_e w_e / rmax)``) with the even-split peak of the same placement beside it in
``extra["even_objective"]``; such a placement is meant only for engines that dispatch by weight.

Modules: :mod:`~solver.exact.solve` (entry points, pipeline), :mod:`~solver.exact.per_layer` (one
layer's solve), :mod:`~solver.exact.cpsat` / :mod:`~solver.exact.milp` (the joint model),
:mod:`~solver.exact.lns` and :mod:`~solver.exact.local_search` (large layers, improvement),
:mod:`~solver.exact.layer_problem` (one layer's problem, scaling), :mod:`~solver.exact.costs` (cost tables,
bounds), :mod:`~solver.exact.guard` (validation guard), :mod:`~solver.exact.gate` (noise gate). The
per-replica LP (``weighted_shares``, ``replica_weights``, ``write_replica_weights``) lives in
:mod:`solver.weighted` and is re-exported here.
"""

from solver.exact.costs import DecodeCost, count_lower_bound, layer_cost_table
from solver.exact.gate import peak_noise
from solver.exact.options import ExactOptions
from solver.exact.solve import run_exact, solve_exact
from solver.weighted import replica_weights, weighted_shares, write_replica_weights

__all__ = [
    "DecodeCost",
    "ExactOptions",
    "solve_exact",
    "run_exact",
    "count_lower_bound",
    "replica_weights",
    "weighted_shares",
    "write_replica_weights",
    "layer_cost_table",
    "peak_noise",
]
