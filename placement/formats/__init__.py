"""Placement files the serving engines read, and the project's own JSON.

Every engine numbers layers its own way; a :class:`~placement.model.Placement` always carries the
model's real ``layer_ids`` (MoE layers only) and the conversion happens here, at the edge:

==============  =====================================  ===========================================
format          file                                   layer axis in the file
==============  =====================================  ===========================================
``native``      JSON, ``schema: moe-placement/...``    real layer ids (``layer_ids`` field)
``sglang``      ``--init-expert-location`` JSON/.pt    every hidden layer; dense rows hold ``p % E``
``trtllm``      ``moe_load_balancer.yaml``             real layer id as the mapping key
``vllm-ascend`` ``expert_map_path`` JSON               MoE layers in order (``layer_id`` = index)
``vllm``        provisional ``eplb_initial_mapping``   real layer id as the mapping key
==============  =====================================  ===========================================

Engine files hold only what the engine accepts (SGLang splats the dict into a constructor and
TensorRT-LLM's config model forbids unknown keys), so what they cannot hold (topology, logical
expert count, real layer ids, provenance) goes to a sidecar ``<path>.meta.json`` written next to
them. :func:`read_placement` uses the sidecar when it is there and otherwise asks for the missing
numbers (``ep_size``, ...) by name.

All output goes through :mod:`moe_placement.base.fileio` (temporary file + rename): a failed write leaves any
existing file untouched. All input is loaded safely, from regular files only: JSON and YAML through
:mod:`moe_placement.base.textparse` (duplicate keys refused, YAML alias expansion bounded, no ``!!python``
tags), ``.pt`` with ``torch.load(weights_only=True)``; layer ids are bounded by
:data:`moe_placement.base.limits.MAX_LAYER_ID`. Any malformed file raises
:class:`~moe_placement.base.fileio.InputFileError` naming the file, the field and the expected form.

Modules: :mod:`placement.formats.spec` (format names, schemas, sidecar path),
:mod:`placement.formats.writers` (:func:`write_placement`), :mod:`placement.formats.load` (safe
loading, field checks, :func:`detect_format`) and :mod:`placement.formats.readers`
(:func:`read_placement`). This module is the public import path for all of them.
"""

from __future__ import annotations

from placement.formats.load import MAX_PT_BYTES as MAX_PT_BYTES  # re-exported
from placement.formats.load import MAX_TEXT_BYTES as MAX_TEXT_BYTES  # re-exported
from placement.formats.load import detect_format
from placement.formats.readers import read_placement
from placement.formats.spec import (
    FORMATS,
    PLACEMENT_SCHEMA,
    PLACEMENT_SCHEMA_VERSION,
    SIDECAR_SCHEMA,
    check_output_name,
    sidecar_path,
)
from placement.formats.spec import SIDECAR_SUFFIX as SIDECAR_SUFFIX  # re-exported
from placement.formats.spec import VLLM_RECORD_TYPE as VLLM_RECORD_TYPE  # re-exported
from placement.formats.spec import VLLM_RECORD_VERSION as VLLM_RECORD_VERSION  # re-exported
from placement.formats.writers import placement_files, write_placement

__all__ = [
    "FORMATS",
    "PLACEMENT_SCHEMA",
    "PLACEMENT_SCHEMA_VERSION",
    "SIDECAR_SCHEMA",
    "check_output_name",
    "detect_format",
    "placement_files",
    "read_placement",
    "sidecar_path",
    "write_placement",
]
