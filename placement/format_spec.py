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
