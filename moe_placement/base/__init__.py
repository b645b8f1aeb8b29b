"""The bottom floor: what every package shares and nothing here is about MoE.

- :mod:`moe_placement.base.errors`: the one exception family (``MoePlacementError`` and its subclasses).
- :mod:`moe_placement.base.options`: options given whole or as keywords, and the one unknown-keyword check.
- :mod:`moe_placement.base.fileio`: atomic output files and folders, safe bounded input loading.
- :mod:`moe_placement.base.limits`: size and value checks made before allocating.
- :mod:`moe_placement.base.textparse`: bounded JSON and text parsing with one-line errors.

It imports numpy and the standard library only.
"""
