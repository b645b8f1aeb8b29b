"""Layout planner: which attention-DP x EP size x redundant-slot layout to serve a model with.

It sits beside the placement solvers, not among them: for each candidate layout it asks a solver
(greedy by default, through :mod:`solver.api`) for a placement, then prices the step with a cost model.
The steps, one module each:

- :mod:`placement.cost.modelspec`: :class:`ModelSpec`, the model's shapes (built-ins in ``models/*.json``,
  a model JSON, or a Hugging Face ``config.json``), :func:`load_model`.
- :mod:`placement.cost.hardware`: GPU, link and cluster presets (:func:`cluster_preset`).
- :mod:`placement.cost.traffic`: one step's per-GPU tokens and all-to-all bytes (the one traffic model),
  expected from per-expert loads or counted from a per-token trace's steps.
- :mod:`moe_placement.apps.planner.costmodel`: options (:class:`CostOptions`), memory per GPU and the step
  a layout gets (:class:`LayoutCost`, priced by :mod:`placement.cost.step_time`).
- :mod:`moe_placement.apps.planner.layout`: enumerate candidates, reject those that do not fit in memory, place,
  price and rank by throughput per GPU (:func:`plan_layout`, :func:`compare_phases`,
  :func:`launch_flags`).

Import each name from its module, e.g. ``from moe_placement.apps.planner.layout import plan_layout``.
"""
