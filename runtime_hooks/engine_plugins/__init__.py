"""Our placement policies inside vLLM and SGLang, through the engines' own plugin systems.

Two entry points, both named ``moe_placement`` (``pyproject.toml``):

- ``vllm.general_plugins``: :func:`runtime_hooks.engine_plugins.vllm_plugin.register`;
- ``sglang.srt.plugins``: :func:`runtime_hooks.engine_plugins.sglang_plugin.register`.

Both do nothing unless ``MOE_PLACEMENT_EPLB=<spec>`` is set (:mod:`.spec`); the engine-neutral
policy is :mod:`.policy`. Launch lines and specs: ``docs/serving.md``. Importing this package, or
loading either entry point, imports neither the engines' heavy modules nor the solver stack.
"""
