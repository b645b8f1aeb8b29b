"""Deployment planning: which deployment (co-located, prefill/decode split, replicas) serves a workload
best under latency targets, judged by goodput per GPU in a request-level simulator on the one cost model.

- :mod:`moe_placement.apps.deploy.workloads`: request mixes (built-in, JSON, a trace's prompts).
- :mod:`moe_placement.apps.deploy.tables`: step-time tables of a pool from the layout planner's cost model.
- :mod:`moe_placement.apps.deploy.simulator`: the discrete-event simulator (and its route hook).
- :mod:`moe_placement.apps.deploy.goodput`: the goodput search over rates.
- :mod:`moe_placement.apps.deploy.candidates`: deployments and each pool's layout (the one planner).
- :mod:`moe_placement.apps.deploy.plan`: :func:`plan`, the search and the decision.
- :mod:`moe_placement.apps.deploy.decision`, :mod:`moe_placement.apps.deploy.launch`,
  :mod:`moe_placement.apps.deploy.report`: the reason, the launch commands and files, the HTML report.
"""

from moe_placement.apps.deploy.options import DeployOptions
from moe_placement.apps.deploy.plan import DeploymentPlan, plan

__all__ = ["DeployOptions", "DeploymentPlan", "plan"]
