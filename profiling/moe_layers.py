"""Find the MoE blocks of a torch model and where each hands its selected expert ids (torch).

HF transformers blocks are found by walking the model: a module with an ``experts`` child and a
``gate`` or ``router`` child that returns ``(logits, weights, ids)`` (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, DeepSeek-V3 and most other MoE classes of transformers 5.x). When the router returns no integer
ids, the ids are read from the arguments of the ``experts`` module instead. :mod:`profiling.hooks`
hooks what is found here.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

from profiling.hook_checks import check_module

__all__ = ["MoeLayerSpec", "find_moe_layers", "ids_from_inputs", "ids_from_output", "cfg_get", "layer_id_of"]

log = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


@dataclass(frozen=True)
class MoeLayerSpec:
    """One MoE block found in a model.

    ``hook_module`` is the module whose output (``where="output"``) or inputs (``where="inputs"``)
    carry the selected ids.
    """

    layer_id: int
    name: str
    block: nn.Module
    hook_module: nn.Module
    where: str  # "output" (router returns ids) or "inputs" (experts receive ids)
    num_experts: int
    top_k: int


def cfg_get(config, *names):
    for n in names:
        v = getattr(config, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def layer_id_of(name: str, fallback: int) -> int:
    matches = list(_LAYER_RE.finditer(name))
    return int(matches[-1].group(1)) if matches else fallback


def find_moe_layers(model: nn.Module) -> list[MoeLayerSpec]:
    """Walk ``model`` and return its MoE blocks in execution (module) order.

    A block is a module with an ``experts`` child and a ``gate`` or ``router`` child module. The layer id
    is the decoder-layer index in the module path (``model.layers.7.mlp`` -> 7).
    """
    check_module(model)
    config = getattr(model, "config", None)
    text_cfg = getattr(config, "text_config", None) or config
    specs: list[MoeLayerSpec] = []
    for name, mod in model.named_modules():
        experts = getattr(mod, "experts", None)
        if not isinstance(experts, nn.Module):
            continue
        router = None
        for attr in ("gate", "router"):
            r = getattr(mod, attr, None)
            if isinstance(r, nn.Module):
                router = r
                break
        if router is None:
            continue
        E = getattr(router, "num_experts", None) or getattr(experts, "num_experts", None)
        if not isinstance(E, int):
            E = cfg_get(text_cfg, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
        if not isinstance(E, int) and isinstance(router, nn.Linear):
            E = router.out_features
        k = getattr(router, "top_k", None)
        if not isinstance(k, int):
            k = getattr(mod, "top_k", None)
        if not isinstance(k, int):
            k = cfg_get(text_cfg, "num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token")
        if not isinstance(E, int) or not isinstance(k, int):
            log.debug("skipping %s: cannot tell its expert count / top-k", name)
            continue
        plain = isinstance(router, nn.Linear)
        specs.append(
            MoeLayerSpec(
                layer_id=layer_id_of(name, len(specs)),
                name=name,
                block=mod,
                hook_module=experts if plain else router,
                where="inputs" if plain else "output",
                num_experts=int(E),
                top_k=int(k),
            )
        )
    return specs


def ids_from_output(output) -> torch.Tensor:
    """The last integer tensor of a router's output tuple (``(logits, weights, ids)``)."""
    items = output if isinstance(output, (tuple, list)) else (output,)
    for t in reversed(items):
        if isinstance(t, torch.Tensor) and t.dtype in _INT_DTYPES:
            return t
    raise TypeError(
        "the router output holds no integer expert-id tensor "
        f"(got {[type(t).__name__ if not isinstance(t, torch.Tensor) else str(t.dtype) for t in items]}); "
        "pass adapters={module: fn} that returns the selected ids"
    )


def ids_from_inputs(args, kwargs) -> torch.Tensor:
    for t in list(args) + list(kwargs.values()):
        if isinstance(t, torch.Tensor) and t.dtype in _INT_DTYPES:
            return t
    raise TypeError("the experts module received no integer expert-id tensor; pass adapters={module: fn}")
