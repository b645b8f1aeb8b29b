"""vLLM general plugin ``moe_placement``: our policy as vLLM's EPLB ``default`` policy.

vLLM (0.33) runs every ``vllm.general_plugins`` entry point (filtered by ``VLLM_PLUGINS``) in every
process before the model is built. ``EplbState`` then looks its policy up by name in
``vllm.distributed.eplb.policy.EPLB_POLICIES`` (the config accepts only ``default``, and async EPLB,
on by default, requires it), so :func:`register` replaces the ``default`` entry with a subclass of
vLLM's ``DefaultEplbPolicy`` whose ``rebalance_experts`` runs our policy.

The call: ``rebalance_experts(weight int32 [L, E] CPU, num_replicas P, num_groups, num_nodes,
num_ranks G, old_global_expert_indices int64 [L, P] CPU or None)`` returns ``phy2log`` int64
``[L, P]`` on CPU. Every rank calls it on the all-reduced load and nothing broadcasts the result.

With ``MOE_PLACEMENT_EPLB`` unset nothing is touched. A bad spec raises :class:`SpecError` (vLLM lets
a plugin's exception stop the start). Every call is validated first
(:func:`runtime_hooks.engine_plugins.policy.validate_call`: slots that do not divide over the ranks, a
load that is not ``[L, E]`` finite counts); any failure inside a rebalance is logged with a non-empty
reason and answered by vLLM's own default policy. The map in service (``old_global_expert_indices``)
is the migration's start whatever it holds (vLLM's own map may hold two replicas of one expert on one
GPU); a new map that does not pay for its migration is dropped and the map in service returned
(:mod:`runtime_hooks.rebalance_rule`). Nothing here installs a signal handler.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from runtime_hooks.engine_plugins.spec import PolicySpec, failure_reason, spec_from_env

__all__ = ["register"]

log = logging.getLogger(__name__)

POLICY_NAME = "default"


def register() -> None:
    """Entry point (``vllm.general_plugins``): install our policy when ``MOE_PLACEMENT_EPLB`` is set."""
    spec = spec_from_env()
    if spec is None:
        log.debug("moe_placement: MOE_PLACEMENT_EPLB unset; vLLM's EPLB policy untouched")
        return
    from vllm.distributed.eplb import policy as eplb_policy

    current = eplb_policy.EPLB_POLICIES[POLICY_NAME]
    engine_default = getattr(current, "_moe_placement_default", current)
    eplb_policy.EPLB_POLICIES[POLICY_NAME] = policy_class(spec, engine_default)
    log.info("moe_placement: vLLM EPLB policy %r is now %s", POLICY_NAME, spec.text)


def policy_class(spec: PolicySpec, engine_default: type) -> type:
    """A subclass of ``engine_default`` whose ``rebalance_experts`` runs ``spec``, falling back to
    ``engine_default.rebalance_experts`` on any failure."""

    def rebalance_experts(
        cls: type,
        weight: Any,
        num_replicas: int,
        num_groups: int,
        num_nodes: int,
        num_ranks: int,
        old_global_expert_indices: Any = None,
    ) -> Any:
        args = (weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices)
        try:
            return _ours(spec, *args, engine=lambda: engine_default.rebalance_experts(*args).numpy())
        except Exception as exc:  # every failure, named, answered by vLLM's own policy
            why = failure_reason(exc)
            log.warning("moe_placement %s failed (%s); vLLM's default EPLB policy used", spec.text, why)
            return engine_default.rebalance_experts(*args)

    attrs = {
        "rebalance_experts": classmethod(rebalance_experts),
        "_moe_placement_default": engine_default,
        "_moe_placement_spec": spec,
        "__doc__": f"moe-placement EPLB policy ({spec.text}); falls back to {engine_default.__name__}.",
    }
    return type("MoePlacementEplbPolicy", (engine_default,), attrs)


def _ours(spec: PolicySpec, weight, num_replicas, num_groups, num_nodes, num_ranks, old, engine=None) -> Any:
    """Our map as vLLM wants it: int64 ``[L, P]`` CPU tensor (``engine``: vLLM's default policy on
    the call, ``() -> [L, P]``, which a fresh call's map is compared with)."""
    import torch

    from placement.dispatch import VLLM_HASH
    from runtime_hooks.engine_plugins.policy import EngineCall, place

    t0 = time.perf_counter()
    call = EngineCall(
        engine="vllm",
        load=weight.detach().cpu().double().numpy(),  # [L, E]
        num_physical=int(num_replicas),
        num_ranks=int(num_ranks),
        num_nodes=int(num_nodes),
        num_groups=int(num_groups) if num_groups else None,
        previous=None if old is None else old.detach().cpu().numpy(),  # [L, P]
        dispatch=VLLM_HASH.name,  # vLLM's EPLB hash: even in expectation, no table to fit
        engine_default=engine,
    )
    phy2log = torch.from_numpy(place(spec, call))
    log.debug("moe_placement %s: %s map in %.3fs", spec.text, tuple(phy2log.shape), time.perf_counter() - t0)
    return phy2log
