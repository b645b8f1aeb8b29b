"""The options of the locality solver (:mod:`solver.locality`), one frozen dataclass.

:func:`solver.locality.solve_locality` and :func:`solver.locality.run_locality` (the registry's entry,
:mod:`solver.api`) take the object. Import it
from :mod:`solver.locality`; it lives here so the method modules below that one can read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_placement.base.options import refuse_unknown_keywords
from placement.dispatch import LOCAL

__all__ = ["LocalityOptions"]


@refuse_unknown_keywords
@dataclass(frozen=True)
class LocalityOptions:
    """How the locality solver searches (the ``options`` of :func:`solver.locality.solve_locality`).

    Attributes:
        balance_slack: node loads (expected tokens under ``dispatch``) at most ``(1 + slack) x`` the mean;
            the trade-off knob (larger: more locality, less balance).
        dispatch: the dispatch model the placement will be served with, how tokens choose among
            replicas (``local`` or ``even``).
        time_limit: seconds for the whole solve (split evenly over layers: CP-SAT and swap search).
        seed: seeds Louvain, CP-SAT and the swap search.
        num_redundant: optional check against the topology's ``P - E``.
        refine: run CP-SAT and the token-level swap search after the heuristic.
        hidden_size: model hidden size; adds fitted ``bytes_per_token`` to the notes.
        comm_weight: None (default) minimises remote nodes under the hard balance cap; a number ``w > 0``
            also rewards node balance in the swap search: objective ``remote_nodes + (max/mean - 1) / w``
            (``method="grouped"`` only).
        method: ``"replicated"`` (default, ``local`` dispatch only; :mod:`solver.locality.replicated`): the
            ``num_everywhere`` experts get a replica on every node (the hottest, then traded for "hub"
            experts where that cuts remote nodes), the rest one node each, nodes packed exactly, then
            GPU peaks repaired against greedy's on every fit window.
            ``"grouped"``: the earlier scheme (greedy replica counts spread over nodes, co-activation
            grouping); also used for ``dispatch="even"``.
        num_everywhere: experts replicated on every node (each costs ``N - 1`` slots). Default: per layer,
            :func:`solver.locality.sources.default_everywhere` (as many as the slots allow after splitting
            heavy experts and a packing margin, and no more than ``share_overload`` allows; the counts
            it picks on the benchmark traces are in ``docs/results.md``).
        share_overload: caps the default ``num_everywhere``: an everywhere replica serves its own node's
            tokens, so the busiest node's share of the tokens (``1 + d`` times the mean) puts ``d x`` the
            everywhere experts' share of the layer's load on that node on top of its fair share. Unseen
            traffic deals the shares anew, so ``d`` is what a random dealing of the fit trace's prompts gives
            on average (:func:`solver.locality.sources.expected_share_excess`; the trace's own ranks when
            it has them; 0 for tokens dealt round-robin, where the cap never binds).
            The default keeps ``d x`` that share at most ``share_overload`` (0.08), calibrated with
            ``benchmarks/locality.py --ep 64 --redundant 128`` (``--everywhere`` and ``--share-overload``
            sweep it; ``docs/results.md``). With unequal shares, 0 gives no everywhere experts unless
            ``num_everywhere`` asks for them; 10 turns the cap off.
        num_windows: consecutive prompt groups of the fit trace used as extra balance views (node caps,
            GPU packing and repair). Default 1 (the fit total only): more windows let the packing fit the
            windows' noise (``docs/results.md``).
        window_slack: node-load cap on each window, ``(1 + window_slack) x`` that window's mean.
        gpu_slack: GPU peak cap on the fit total and every window: ``(1 + gpu_slack) x`` greedy's peak
            on the same view (0: no heavier than greedy where the search can reach it), both under the
            sources the solver fits with (``source_model``). Default 0.05: with the fit sources dealt evenly
            a tighter cap mostly forces cross-node swaps that cost remote nodes without lowering held-out
            PAR; ``benchmarks/locality.py --gpu-slack X`` shows the trade-off.
        source_model: attention-DP sources the solver fits with (scoring always uses the trace's or the
            dealt ones, see :func:`placement.metrics.source_ranks`). ``"auto"`` (default): the trace's own
            ranks when it has them; when prompts were dealt round-robin (no ranks in the trace), tokens
            dealt round-robin instead, so every rank has its expected, equal share. Prompt lengths vary so
            much that dealt prompts leave nodes with very different token shares (the report's first note
            prints the range), unseen traffic deals
            them differently, and everywhere-replicated experts follow those shares; the imbalance also
            inflates greedy's fitted peak, which loosens the GPU caps. ``"trace"``: the scoring sources;
            ``"uniform"``: always deal tokens.
        work_limit: ``method="replicated"`` only: bound the searches by counted steps (about
            ``work_limit / L`` per layer: partition scans, kicks, repair steps; CP-SAT by its deterministic
            time) instead of ``time_limit``, so one seed gives one placement on any machine at any load.
            ``time_limit`` is then ignored (what a step costs: ``docs/results.md``).
        share_margin: with two slots per GPU, everywhere replicas are paired as if
            ``(1 + share_margin) x`` their fitted load (their load follows their node's token share).
            None (default): the busiest node's token share over the mean, minus 1, under the scoring
            sources on the fit trace (0 when tokens are dealt, since shares are then equal).
        drift_z: with two slots per GPU, every single-node expert is paired as if its fitted load plus
            ``drift_z`` times its expected drift to unseen traffic (a bootstrap over the fit trace's
            prompts, :func:`solver.locality.sources.load_drift`), so experts whose load is uncertain get
            split or lighter partners. Default 1.0; 0 turns it off.
        single_margin: single-node experts per node at most ``ceil(n_single / N) + single_margin``
            (None: only the slot limit); 0 keeps spare slots on every node for splitting its heavy experts.

    """

    balance_slack: float = 0.02
    dispatch: str = LOCAL.name
    time_limit: float = 10.0
    seed: int = 0
    num_redundant: int | None = None
    refine: bool = True
    hidden_size: int | None = None
    comm_weight: float | None = None
    replication: str = "locality"
    replica_headroom: float = 0.2
    method: str = "replicated"
    num_everywhere: int | None = None
    num_windows: int = 1
    window_slack: float = 0.5
    gpu_slack: float = 0.05
    single_margin: int | None = 0
    source_model: str = "auto"
    work_limit: int | None = None
    share_margin: float | None = None
    drift_z: float = 1.0
    share_overload: float = 0.08
