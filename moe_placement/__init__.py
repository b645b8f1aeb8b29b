"""The moe-placement distribution's own package: the shared bottom floor (:mod:`moe_placement.base`),
the applications (:mod:`moe_placement.apps`) and the command line (:mod:`moe_placement.cli`).

The specified packages ``profiling``, ``placement``, ``solver`` and ``runtime_hooks`` sit beside it;
this file imports nothing, so ``moe_placement.base`` can be imported from the lowest floor.
"""
