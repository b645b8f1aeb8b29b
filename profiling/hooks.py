"""Record the experts a model really selects, from inside its forward pass (torch).

The recorder captures the SELECTED expert ids of every MoE layer: the ids the block hands to its
experts, after top-k, grouped routing and score-bias correction. It never recomputes an argmax of the
gate logits. This module hooks a model; the pieces live beside it:

- :mod:`profiling.moe_layers`: which modules of a model are MoE blocks and where their ids appear;
- :mod:`profiling.recorder`: :class:`RoutingRecorder` (device buffers, no host syncs in a hook) and
  :class:`RecordOptions`; :func:`read_stream` for streamed chunks.

Example::

    with attach(model, RecordOptions(mode="tokens", capacity_tokens=65536)) as rec:
        model(input_ids)
    trace = rec.to_trace(name="my-run")
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from profiling.hook_checks import check_module
from profiling.moe_layers import (
    MoeLayerSpec,
    cfg_get,
    find_moe_layers,
    ids_from_inputs,
    ids_from_output,
    layer_id_of,
)
from profiling.recorder import RecordOptions, RoutingRecorder, read_stream

__all__ = ["RecordOptions", "RoutingRecorder", "MoeLayerSpec", "attach", "find_moe_layers", "read_stream"]

log = logging.getLogger(__name__)


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def attach(
    model: nn.Module,
    options: RecordOptions | None = None,
    *,
    adapters: Mapping[nn.Module, Callable[[nn.Module, Any, Any], torch.Tensor]] | None = None,
    layer_ids: Sequence[int] | None = None,
    num_logical_experts: int | None = None,
    top_k: int | None = None,
) -> RoutingRecorder:
    """Hook every MoE block of ``model`` and return the recorder (also a context manager).

    Args:
        model: a torch module; HF transformers MoE models are walked automatically.
        options: what to record (:class:`RecordOptions`; default counts only).
        adapters: ``{module: fn(module, inputs, output) -> topk_ids [N, k]}`` for code paths the walker
            does not know; a forward hook on each module calls ``fn``. Layer ids come from the module
            path (``layers.<i>``) unless ``layer_ids`` is given; ``num_logical_experts`` and ``top_k``
            are then required unless the model's config says them.
    """
    check_module(model)
    device = _model_device(model)
    config = getattr(model, "config", None)
    text_cfg = getattr(config, "text_config", None) or config
    if adapters:
        hooks, ids_, E, k = _adapter_hooks(model, adapters, text_cfg, num_logical_experts, top_k)
    else:
        hooks, ids_, E, k = _walked_hooks(model, num_logical_experts, top_k)
    ids_ = _final_layer_ids(ids_, layer_ids)
    rec = RoutingRecorder(ids_, E, k, options, device=device)
    _register_hooks(model, rec, hooks)
    log.info("recording %d MoE layers %s (E=%d, top_k=%d, mode=%s)", len(ids_), ids_, E, k, rec.mode)
    return rec


_Hook = tuple[nn.Module, str, Callable | None]  # (module, "output" | "inputs" | "adapter", adapter fn)


def _adapter_hooks(model: nn.Module, adapters, text_cfg, num_logical_experts, top_k):
    """Hooks for user adapters: ``(hooks, layer ids, E, k)``; E and k from the arguments or the config."""
    names = {m: n for n, m in model.named_modules()}
    hooks: list[_Hook] = []
    ids_: list[int] = []
    for i, (mod, fn) in enumerate(adapters.items()):
        if not callable(fn):
            raise ValueError(f"adapter for {type(mod).__name__} is not callable")
        ids_.append(layer_id_of(names.get(mod, ""), i))
        hooks.append((mod, "adapter", fn))
    E = (
        num_logical_experts
        if num_logical_experts is not None
        else cfg_get(text_cfg, "num_local_experts", "num_experts", "n_routed_experts")
    )
    k = top_k if top_k is not None else cfg_get(text_cfg, "num_experts_per_tok", "top_k")
    if E is None or k is None:
        raise ValueError("adapters need num_logical_experts= and top_k= (the model config does not say them)")
    return hooks, ids_, E, k


def _walked_hooks(model: nn.Module, num_logical_experts, top_k):
    """Hooks for the MoE blocks :func:`find_moe_layers` finds: ``(hooks, layer ids, E, k)``."""
    specs = find_moe_layers(model)
    if not specs:
        raise ValueError(
            f"found no MoE block in {type(model).__name__} (a module with 'experts' and a 'gate'/'router'); "
            "pass adapters={module: fn(module, inputs, output) -> topk_ids}"
        )
    Es = {s.num_experts for s in specs}
    if len(Es) > 1:
        raise ValueError(
            f"MoE blocks disagree on the expert count {sorted(Es)}; record them with separate adapters"
        )
    found_E, found_k = Es.pop(), max(s.top_k for s in specs)
    for name, given, found in (
        ("num_logical_experts", num_logical_experts, found_E),
        ("top_k", top_k, found_k),
    ):
        if given is not None and given != found:
            raise ValueError(
                f"{name}={given!r} but the model's MoE blocks have {found}; leave {name} out (it is read from the "
                f"blocks) or record with adapters="
            )
    E, k = found_E, found_k
    hooks: list[_Hook] = [(s.hook_module, s.where, None) for s in specs]
    return hooks, [s.layer_id for s in specs], E, k


def _final_layer_ids(ids_: list[int], layer_ids: Sequence[int] | None) -> list[int]:
    """The given ``layer_ids`` (one per hooked module), else the ids found, numbered in order if they repeat."""
    if layer_ids is not None:
        if len(layer_ids) != len(ids_):
            raise ValueError(f"layer_ids has {len(layer_ids)} entries for {len(ids_)} hooked modules")
        ids_ = [int(x) for x in layer_ids]
    if len(set(ids_)) != len(ids_):
        ids_ = list(range(len(ids_)))  # module paths without distinct layer numbers: number in order
    return ids_


def _register_hooks(model: nn.Module, rec: RoutingRecorder, hooks: list[_Hook]) -> None:
    """One forward (pre-)hook per MoE module recording its row, plus the model-level step hooks."""
    for row, (mod, where, fn) in enumerate(hooks):
        if where == "output":

            def hook(_m, _inp, out, row=row):
                rec.record(row, ids_from_output(out))

            rec._handles.append(mod.register_forward_hook(hook))
        elif where == "inputs":

            def pre(_m, args, kwargs, row=row):
                rec.record(row, ids_from_inputs(args, kwargs))

            rec._handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        else:

            def ahook(m, inp, out, row=row, fn=fn):
                rec.record(row, fn(m, inp, out))

            rec._handles.append(mod.register_forward_hook(ahook))
    rec._handles.append(
        model.register_forward_pre_hook(lambda _m, a, kw: rec._note_forward(a, kw), with_kwargs=True)
    )
    rec._handles.append(model.register_forward_hook(lambda *_: rec._after_forward()))
