"""Installing our policy through each engine's own plugin loader, for the scripts the engine tests run
in the engines' Python (``MOE_ENGINES_PYTHON``; no pytest there). Each loader returns
``load_with(spec)``: set ``MOE_PLACEMENT_EPLB`` to ``spec`` (None: unset), put the engine's default
back, run the engine's loader, and return what the engine will call; and the engine's default itself.
"""

from __future__ import annotations

import os


def _set_spec(spec: str | None) -> None:
    os.environ.pop("MOE_PLACEMENT_EPLB", None)
    if spec:
        os.environ["MOE_PLACEMENT_EPLB"] = spec


def vllm_loader():
    """``(load_with, eplb)``: ``load_with(spec)`` returns the class vLLM uses as its ``default`` policy."""
    os.environ["VLLM_PLUGINS"] = "moe_placement"
    import vllm.plugins
    from vllm.distributed.eplb import policy as eplb

    def load_with(spec):
        _set_spec(spec)
        eplb.EPLB_POLICIES["default"] = eplb.DefaultEplbPolicy
        vllm.plugins.plugins_loaded = False
        vllm.plugins.load_general_plugins()
        return eplb.EPLB_POLICIES["default"]

    return load_with, eplb


def sglang_loader():
    """``(load_with, algos, keep)``: ``load_with(spec)`` returns SGLang's ``rebalance_experts`` after its
    plugins load; ``keep["original"]`` is SGLang's own function (in a dict: applying a hook rebinds every
    module-level name that holds the original, a caller's included)."""
    os.environ["SGLANG_PLUGINS"] = "moe_placement"
    import sglang.srt.plugins as plugins
    from sglang.srt.eplb import eplb_algorithms as algos
    from sglang.srt.plugins.hook_registry import HookRegistry

    original = algos.rebalance_experts  # a closure's name: no hook rebinds it

    def load_with(spec):
        _set_spec(spec)
        HookRegistry.reset()
        algos.rebalance_experts = original
        plugins._plugins_loaded = False
        plugins.load_plugins()
        return algos.rebalance_experts

    return load_with, algos, {"original": original}
