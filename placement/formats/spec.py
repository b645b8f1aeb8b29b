"""Names shared by the placement file writers and readers: formats, schemas, the sidecar path.

Re-exported by :mod:`placement.formats` (the public import path).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "FORMATS",
    "PLACEMENT_SCHEMA",
    "PLACEMENT_SCHEMA_VERSION",
    "SIDECAR_SCHEMA",
    "SIDECAR_SUFFIX",
    "VLLM_RECORD_TYPE",
    "VLLM_RECORD_VERSION",
    "sidecar_path",
]

FORMATS = ("native", "sglang", "trtllm", "vllm-ascend", "vllm")
PLACEMENT_SCHEMA = "moe-placement/placement"
PLACEMENT_SCHEMA_VERSION = 1
SIDECAR_SCHEMA = "moe-placement/placement-sidecar"
SIDECAR_SUFFIX = ".meta.json"
VLLM_RECORD_TYPE = "eplb_initial_mapping"
VLLM_RECORD_VERSION = 1

_PT_SUFFIXES = (".pt", ".pth")
_YAML_SUFFIXES = (".yaml", ".yml")


def sidecar_path(path: str | os.PathLike) -> Path:
    """The metadata file written next to an engine file: ``<path>.meta.json``."""
    return Path(str(path) + SIDECAR_SUFFIX)


def check_output_name(path: str | os.PathLike, fmt: str) -> None:
    """Refuse a file name the readers would not read back as ``fmt`` (ValueError naming both): a
    ``.pt``/``.pth`` name is loaded with ``torch.load`` (SGLang's map only), a ``.json`` name is parsed
    as JSON (TensorRT-LLM's file is YAML)."""
    suffix = Path(path).suffix
    if suffix in _PT_SUFFIXES and fmt != "sglang":
        raise ValueError(
            f"cannot write {fmt} to {path}: a {suffix} file is read back as SGLang's torch.save map; "
            f"name it {'.yaml' if fmt == 'trtllm' else '.json'}"
        )
    if suffix == ".json" and fmt == "trtllm":
        raise ValueError(f"cannot write trtllm to {path}: TensorRT-LLM's file is YAML; name it .yaml")
