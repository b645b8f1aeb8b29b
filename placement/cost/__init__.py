"""The one cost model: hardware presets, model shapes and the modelled time of a step.

- :mod:`placement.cost.hardware`: GPU, link and cluster presets; every hardware figure lives here once.
- :mod:`placement.cost.modelspec`: :class:`~placement.cost.modelspec.ModelSpec`, a model's shapes
  (built-ins in ``models/*.json``, a model JSON, or a Hugging Face ``config.json``).

Import each name from its module, e.g. ``from placement.cost.hardware import cluster_preset``.
"""
