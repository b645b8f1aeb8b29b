"""Read the routing statistics that serving engines dump, as :class:`~profiling.trace.RoutingTrace`.

Shapes: H = hidden layers (the engine's layer axis), L = MoE layers kept, E = logical experts,
P = physical slots, W = windows (steps / forward passes / iterations), T = tokens, k = top-k.

Supported dumps (see ``docs/formats.md``):

- SGLang expert-distribution recorder, ``stat`` mode: one ``torch.save`` file
  ``dict(rank, logical_count [W, H, E], average_utilization_rate_over_window)``, summed over ranks by
  SGLang -> counts-only trace, one window per buffered step.
- SGLang ``per_pass`` / ``per_token`` mode: one file per rank,
  ``dict(records=[dict(forward_pass_id, rank, gatherer_key, global_physical_count [H, P],
  topk_ids_of_layer [H, T, 8] (per_token only), ...)], last_physical_to_logical_map [H, P])``.
  Counts and ids are PHYSICAL slots: converted to logical experts with the map. Ranks are merged:
  one window (step) per ``forward_pass_id``; per-token traces carry ``source_rank``.
- TensorRT-LLM statistics folder: ``meta_info.json`` + ``rank{r}.safetensors`` with keys
  ``"{iter}_{layer}"`` -> bincount ``[num_experts]`` (logical), summed over ranks, one window per
  iteration. With ``rank{r}_raw.safetensors`` (same keys, each the raw ``token_selected_experts``
  ``[T_{iter,rank}, k]`` of that rank's tokens; assumed layout: for one iteration and rank every
  layer sees the same tokens in the same order) a per-token trace is built instead, tokens ordered by
  iteration then rank.
- vLLM (provisional proposal) JSONL: records ``{"record_type": "eplb_load_stats", "version": 1,
  "step", "num_ranks", "expert_load": [[...]] [L, P], "p2l_map": [[...]] [L, P]}`` (optional
  ``"layer_ids"``), one window per record; other record types are skipped.

Layer axes: SGLang rows are every hidden layer (dense layers are all-zero rows, dropped unless
``moe_layer_ids`` names the MoE rows); TensorRT-LLM keys are real layer ids; vLLM rows are MoE layers
(real ids from the record's ``layer_ids`` or ``moe_layer_ids``). Real layer ids are kept.

Everything is loaded safely (``torch.load(weights_only=True)``, safetensors, JSON); malformed input
raises :class:`~moe_placement.base.fileio.InputFileError` naming the file and the field.

Modules: :mod:`profiling.engine_sglang`, :mod:`profiling.engine_trtllm` and :mod:`profiling.engine_vllm`
read one engine each; :mod:`profiling.engine_common` holds the shared loading, checks and the
physical -> logical conversions re-exported here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from moe_placement.base.fileio import InputFileError, require_regular
from moe_placement.base.limits import MAX_EXPERTS
from profiling.engine_common import MAX_DUMP_BYTES as MAX_DUMP_BYTES  # re-exported
from profiling.engine_common import physical_to_logical_counts, physical_to_logical_ids
from profiling.engine_sglang import _read_sglang
from profiling.engine_trtllm import _read_trtllm
from profiling.engine_vllm import VLLM_LOAD_RECORD as VLLM_LOAD_RECORD  # re-exported
from profiling.engine_vllm import VLLM_LOAD_VERSION as VLLM_LOAD_VERSION  # re-exported
from profiling.engine_vllm import _read_vllm_jsonl
from profiling.trace import RoutingTrace

__all__ = ["physical_to_logical_counts", "physical_to_logical_ids", "read_engine_dump"]


def read_engine_dump(
    path: str | os.PathLike,
    *,
    num_logical_experts: int | None = None,
    moe_layer_ids: Sequence[int] | None = None,
) -> RoutingTrace:
    """Read an engine's routing statistics dump (file or folder) as a trace.

    Args:
        path: an SGLang ``expert_distribution_recorder_*.pt`` file or a folder of them; a
            TensorRT-LLM statistics folder (``meta_info.json`` + ``rank<r>.safetensors``) or one of its
            ``.safetensors`` files (that rank only); a vLLM ``.jsonl`` file or a folder of them.
        num_logical_experts: ``E`` when the dump does not say it (default: from the dump, or the
            largest id in the physical->logical map + 1); checked against the dump when it does.
        moe_layer_ids: SGLang: the hidden-layer rows that are MoE layers (default: rows with any
            load); TensorRT-LLM: the layer ids to keep; vLLM: the real ids of the rows.

    Returns:
        A :class:`RoutingTrace` (counts-only with one window per step/pass/iteration, or per-token
        with ``step_offsets`` and ``source_rank`` for SGLang ``per_token`` and TensorRT-LLM raw dumps).

    Raises:
        InputFileError (a ValueError) naming the file and field.
    """
    p = Path(path)
    E = None if num_logical_experts is None else int(num_logical_experts)
    if E is not None and not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"num_logical_experts must be in 1..{MAX_EXPERTS} (MAX_EXPERTS), got {E}")
    try:
        return _read_dump(p, E, moe_layer_ids)
    except InputFileError:
        raise
    except ValueError as exc:  # the trace's own checks (layer ids, sizes, totals): name the dump
        raise InputFileError(f"{p}: {exc}") from None


def _read_dump(p: Path, E: int | None, moe_layer_ids) -> RoutingTrace:
    """Dispatch on what ``p`` is: a TensorRT-LLM, SGLang or vLLM folder, or one dump file."""
    if p.is_dir():
        if (p / "meta_info.json").is_file():
            return _read_trtllm(p, None, E, moe_layer_ids)
        sg = sorted(p.glob("expert_distribution_recorder_*.pt"))
        if sg:
            return _read_sglang(sg, p.name, E, moe_layer_ids)
        jl = sorted(p.glob("*.jsonl"))
        if jl:
            return _read_vllm_jsonl(jl, p.name, E, moe_layer_ids)
        raise InputFileError(
            f"{p}: folder holds no engine dump: expected meta_info.json + rank<r>.safetensors (TensorRT-LLM), "
            f"expert_distribution_recorder_*.pt (SGLang) or *.jsonl (vLLM)"
        )
    if not p.exists():
        raise InputFileError(f"{p}: no such file or folder")
    require_regular(p)  # a FIFO or a device is refused before any reader opens it
    if p.suffix in (".pt", ".pth"):
        return _read_sglang([p], p.stem, E, moe_layer_ids)
    if p.suffix == ".safetensors":
        return _read_trtllm(p.parent, p, E, moe_layer_ids)
    if p.suffix == ".jsonl":
        return _read_vllm_jsonl([p], p.stem, E, moe_layer_ids)
    raise InputFileError(
        f"{p}: unknown engine dump type {p.suffix!r}; expected .pt, .safetensors, .jsonl or a folder"
    )
