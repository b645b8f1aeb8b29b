"""Communication-aware placement: keep co-activated experts on one node, cut cross-node dispatch.

Shapes: L layers, E logical experts, P physical slots, G GPUs (EP ranks), N nodes, m = G / N GPUs per
node, S = P / G slots per GPU, T tokens, k top-k.

Per layer, three steps:

1. Replicate: how many replicas each expert gets and on how many nodes. The default method
   (``replicated``) puts the ``h`` experts that save the most remote nodes on every node and every
   other expert on one node; ``grouped`` spreads greedy's replica counts over ``min(c_e, N)`` nodes.
2. Group experts onto nodes: maximise co-activation inside nodes (fewer remote nodes per token) with
   exactly ``P / N`` slots per node and every node's load (``local`` dispatch, tokens' real source ranks)
   at most ``(1 + balance_slack)`` times the mean node load.
3. Pack each node's replicas onto its ``m`` GPUs (LPT, pairs or CP-SAT), at most one replica of an
   expert per GPU, exactly ``S`` slots per GPU; ``replicated`` then repairs GPU peaks against greedy's.

The placement is meant to be served and scored with the ``local`` dispatch model (own GPU,
else own node, else spread over all replicas), see :mod:`placement.metrics`.

The steps, one module each (import the public names from this package):

- :mod:`solver.locality.options`: :class:`LocalityOptions`, every option documented.
- :mod:`solver.locality.solve`: :func:`solve_locality` / :func:`run_locality`: check the input, pick the method.
- :mod:`solver.locality.sources`: what the fit trace says about unseen traffic: source ranks, windows,
  load drift, the default number of everywhere experts.
- ``method="replicated"``: :mod:`solver.locality.fit` over all layers; one layer in
  :mod:`solver.locality.replicated` (everywhere set, then the node partition :mod:`solver.locality.nodes`,
  node packing, GPU repair :mod:`solver.locality.repair`; remote-node accounting :mod:`solver.locality.reach`).
- ``method="grouped"``: :mod:`solver.locality.grouped`; its node stages in :mod:`solver.locality.partition`.
- :mod:`solver.locality.pack`: packing one node's replicas onto its GPUs (both methods).
- :mod:`solver.locality.pareto`: the held-out trade-off table against greedy and trivial.
"""

from solver.locality.grouped import locality_replica_counts
from solver.locality.options import LocalityOptions
from solver.locality.pack import pack_node_gpus
from solver.locality.pareto import DEFAULT_SLACKS, pareto
from solver.locality.solve import run_locality, solve_locality
from solver.locality.sources import default_everywhere

__all__ = [
    "DEFAULT_SLACKS",
    "LocalityOptions",
    "default_everywhere",
    "locality_replica_counts",
    "pack_node_gpus",
    "pareto",
    "run_locality",
    "solve_locality",
]
