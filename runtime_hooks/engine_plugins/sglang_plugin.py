"""SGLang general plugin ``moe_placement``: our policy behind ``eplb_algorithms.rebalance_experts``.

SGLang (0.5.x) runs every ``sglang.srt.plugins`` entry point (filtered by ``SGLANG_PLUGINS``) from
``sglang.srt.plugins.load_plugins()`` in every process, then applies the hooks they registered.
:func:`register` puts an AROUND hook on ``sglang.srt.eplb.eplb_algorithms.rebalance_experts``, the
one function behind both ``--init-expert-location`` with a ``logical_count`` file and online
``--enable-eplb`` (``ExpertLocationMetadata.init_by_eplb``).

The call: ``rebalance_experts(tokens_per_expert [W, L, E] (any device), num_physical_experts P,
num_local_physical_experts S, num_groups (or None), num_nodes, algorithm: EplbAlgorithm)`` returns
``(phy2log int64 [L, P], log2phy int64 [L, E, R] padded with -1, logcnt int64 [L, E])``; the engine
moves them to its device and pads ``log2phy`` to ``P`` itself. ``L`` is every hidden layer.

Our maps are placed for SGLang's static dispatch table (``sglang-static``), every expert's load taken
as split evenly over the ranks (SGLang passes all-reduced counts, no source ranks; docs/serving.md).
Differences from vLLM: SGLang passes no map in service, so ``migration`` reads the one in the
global ``ExpertLocationMetadata`` (none at start-up: greedy then); the ``elasticity_aware``
algorithms (which depend on the live ranks) are left to SGLang. SGLang logs and swallows a plugin's
exception, so a bad spec stops the process with ``SystemExit`` and a one-line message instead.

Every call is validated first (:func:`_declined`, then
:func:`runtime_hooks.engine_plugins.policy.validate_call`): ``algorithm=None`` or an algorithm we do
not know, slots that do not divide into the slots per GPU, a load that is not counts; each is answered
by SGLang's own algorithm with a logged, non-empty reason. Nothing here installs a signal handler.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from runtime_hooks.engine_plugins.spec import PolicySpec, SpecError, failure_reason, spec_from_env

__all__ = ["TARGET", "make_hook", "register"]

log = logging.getLogger(__name__)

TARGET = "sglang.srt.eplb.eplb_algorithms.rebalance_experts"


def register() -> None:
    """Entry point (``sglang.srt.plugins``): hook our policy in when ``MOE_PLACEMENT_EPLB`` is set."""
    try:
        spec = spec_from_env()
    except SpecError as exc:
        raise SystemExit(f"moe_placement: {exc}") from None
    if spec is None:
        log.debug("moe_placement: MOE_PLACEMENT_EPLB unset; SGLang's EPLB algorithm untouched")
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, make_hook(spec), HookType.AROUND)
    log.info("moe_placement: SGLang EPLB rebalance_experts is now %s", spec.text)


# SGLang's EplbAlgorithm members our policy answers; elasticity-aware ones stay SGLang's (live ranks)
OURS = ("deepseek", "deepseek_hierarchical", "deepseek_vec", "deepseek_vec_hierarchical")
ENGINE_ONLY = ("elasticity_aware", "elasticity_aware_hierarchical")


def make_hook(spec: PolicySpec):
    """The AROUND hook ``hook(original, **engine_arguments)``: ours, or SGLang's own algorithm (with
    a logged, non-empty reason) on any call we do not answer or any failure."""

    def moe_placement_rebalance(original, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = _bind(*args, **kwargs)
        except TypeError as exc:
            why = failure_reason(exc)
            log.warning("moe_placement: unexpected SGLang call (%s); SGLang's algorithm used", why)
            return original(*args, **kwargs)
        why = _declined(bound)
        if why:
            log.info("moe_placement %s: %s; SGLang's EPLB algorithm used", spec.text, why)
            return _engine(original, bound)
        try:
            return _ours(spec, lambda: original(**bound)[0].cpu().numpy(), **bound)
        except Exception as exc:  # every failure, named, answered by SGLang's own algorithm
            why = failure_reason(exc)
            log.warning("moe_placement %s failed (%s); SGLang's EPLB algorithm used", spec.text, why)
            return _engine(original, bound)

    return moe_placement_rebalance


def _declined(bound: dict[str, Any]) -> str:
    """Why our policy does not answer this call (empty: it does). Checked before anything runs."""
    name = getattr(bound["algorithm"], "name", None)
    if not isinstance(name, str):
        return f"algorithm={bound['algorithm']!r} is not an EplbAlgorithm"
    if name in ENGINE_ONLY:
        return f"{name} is left to SGLang (it depends on the live ranks)"
    if name not in OURS:
        return f"unknown EPLB algorithm {name!r} (ours answers {', '.join(OURS)})"
    P, S = bound["num_physical_experts"], bound["num_local_physical_experts"]
    for label, v in (("num_physical_experts", P), ("num_local_physical_experts", S)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"{label}={v!r} is not a positive integer"
    if P % S:
        return f"{P} physical slots do not divide into {S} slots per GPU"
    return ""


def _engine(original, bound: dict[str, Any]) -> Any:
    """SGLang's own algorithm on the call; without a valid algorithm, the one SGLang picks itself
    (``compute_algorithm("auto", ...)``), so the engine never gets our error."""
    if not isinstance(getattr(bound["algorithm"], "name", None), str):
        try:
            from sglang.srt.eplb.eplb_algorithms import compute_algorithm

            bound = {**bound, "algorithm": compute_algorithm("auto", bound["num_groups"], bound["num_nodes"])}
        except Exception as exc:  # no SGLang (offline use): pass the call through unchanged
            log.debug("moe_placement: SGLang's auto algorithm unavailable (%s)", failure_reason(exc))
    return original(**bound)


def _bind(
    tokens_per_expert: Any,
    num_physical_experts: int,
    num_local_physical_experts: int,
    num_groups: int | None,
    num_nodes: int,
    algorithm: Any,
) -> dict[str, Any]:
    """SGLang's arguments by name (it calls with keywords; positions work too)."""
    return {
        "tokens_per_expert": tokens_per_expert,
        "num_physical_experts": num_physical_experts,
        "num_local_physical_experts": num_local_physical_experts,
        "num_groups": num_groups,
        "num_nodes": num_nodes,
        "algorithm": algorithm,
    }


def _ours(spec: PolicySpec, engine=None, **bound: Any) -> tuple[Any, Any, Any]:
    """``(phy2log, log2phy, logcnt)`` CPU int64 tensors from our policy (``engine``: SGLang's own
    algorithm on the call, ``() -> [L, P]``, which a fresh call's map is compared with)."""
    import torch

    from placement.dispatch import SGLANG_STATIC
    from runtime_hooks.engine_plugins.policy import EngineCall, logical_maps, place

    t0 = time.perf_counter()
    tokens = bound["tokens_per_expert"].detach()
    if tokens.dim() == 3:
        tokens = tokens.sum(dim=0)  # [W, L, E] -> [L, E]
    P, S = int(bound["num_physical_experts"]), int(bound["num_local_physical_experts"])
    hierarchical = bound["algorithm"].name.endswith("hierarchical")
    call = EngineCall(
        engine="sglang",
        load=tokens.cpu().double().numpy(),  # [L, E]
        num_physical=P,
        num_ranks=P // S,
        num_nodes=int(bound["num_nodes"]),
        num_groups=bound["num_groups"] if hierarchical else None,
        previous=_map_in_service() if spec.kind != "file" else None,  # the rule compares with it
        dispatch=SGLANG_STATIC.name,  # maps are fitted for SGLang's static table
        engine_default=engine,
    )
    phy2log = place(spec, call)  # [L, P]
    log2phy, logcnt = logical_maps(phy2log, call.load.shape[1])  # [L, E, R], [L, E]
    log.debug("moe_placement %s: %s map in %.3fs", spec.text, phy2log.shape, time.perf_counter() - t0)
    return torch.from_numpy(phy2log), torch.from_numpy(log2phy), torch.from_numpy(logcnt)


def _map_in_service():
    """int64 ``[L, P]`` from SGLang's global expert location, or None (not set up yet)."""
    try:
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        metadata = get_global_expert_location_metadata()
    except Exception as exc:  # no server context (start-up, offline use)
        log.debug("moe_placement: no expert location in service (%s)", exc)
        return None
    return None if metadata is None else metadata.physical_to_logical_map_cpu.numpy()
