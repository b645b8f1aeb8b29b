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

All output goes through :mod:`profiling.fileio` (temporary file + rename): a failed write leaves any
existing file untouched. All input is loaded safely (``json``, ``yaml.safe_load``,
``torch.load(weights_only=True)``) and any malformed file raises
:class:`~profiling.fileio.InputFileError` naming the file, the field and the expected form.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from placement.model import Placement, validate_map
from placement.topology import Topology
from profiling.fileio import InputFileError, atomic_write_bytes, safe_torch_load

__all__ = [
    "FORMATS",
    "PLACEMENT_SCHEMA",
    "PLACEMENT_SCHEMA_VERSION",
    "SIDECAR_SCHEMA",
    "detect_format",
    "read_placement",
    "sidecar_path",
    "write_placement",
]

logger = logging.getLogger(__name__)

FORMATS = ("native", "sglang", "trtllm", "vllm-ascend", "vllm")
PLACEMENT_SCHEMA = "moe-placement/placement"
PLACEMENT_SCHEMA_VERSION = 1
SIDECAR_SCHEMA = "moe-placement/placement-sidecar"
SIDECAR_SUFFIX = ".meta.json"
VLLM_RECORD_TYPE = "eplb_initial_mapping"
VLLM_RECORD_VERSION = 1

# Refuse input files above these sizes before parsing them.
MAX_TEXT_BYTES = 512 * 1024**2
MAX_PT_BYTES = 2 * 1024**3

_PT_SUFFIXES = (".pt", ".pth")
_YAML_SUFFIXES = (".yaml", ".yml")


def sidecar_path(path: str | os.PathLike) -> Path:
    """The metadata file written next to an engine file: ``<path>.meta.json``."""
    return Path(str(path) + SIDECAR_SUFFIX)


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


def _jsonable(obj: Any) -> Any:
    """Provenance values as plain JSON types (numpy scalars/arrays to Python, the rest to str)."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def _rows_json(key: str, rows: np.ndarray) -> str:
    """``{"key": [[...], ...]}`` with one row per line (readable diffs, ints only)."""
    body = ",\n".join(json.dumps([int(x) for x in row]) for row in rows)
    return "{" + json.dumps(key) + ": [\n" + body + "\n]}\n"


def _checked(placement: Placement) -> np.ndarray:
    """Re-validate before writing: a file is only ever written for a valid placement."""
    if not isinstance(placement, Placement):
        raise TypeError(f"write_placement needs a Placement, got {type(placement).__name__}")
    return validate_map(
        placement.physical_to_logical_map,
        placement.num_logical_experts,
        placement.topology,
        allow_colocated_replicas=placement.allow_colocated_replicas,
    )


def _metadata(placement: Placement, fmt: str, path: Path, **extra) -> dict:
    meta = {
        "schema": SIDECAR_SCHEMA,
        "schema_version": PLACEMENT_SCHEMA_VERSION,
        "format": fmt,
        "file": path.name,
        "num_logical_experts": placement.num_logical_experts,
        "layer_ids": list(placement.layer_ids),
        "topology": placement.topology.to_dict(),
        "allow_colocated_replicas": bool(placement.allow_colocated_replicas),
        "provenance": _jsonable(placement.provenance),
    }
    meta.update(extra)
    return meta


def write_placement(
    placement: Placement,
    path: str | os.PathLike,
    format: str = "native",
    *,
    num_hidden_layers: int | None = None,
) -> list[Path]:
    """Write ``placement`` in an engine's format (atomically) and return every file written.

    Args:
        placement: the placement (re-validated before anything is written).
        path: the main output file. Engine formats also get the sidecar ``<path>.meta.json``.
        format: one of :data:`FORMATS`. ``sglang`` writes ``torch.save`` output when ``path``
            ends in ``.pt``/``.pth`` and JSON otherwise.
        num_hidden_layers: ``sglang`` only: the model's ``config.num_hidden_layers`` ``H`` (the
            file has ``H`` rows; rows of dense layers hold the trivial map ``p % E``). Default
            ``max(layer_ids) + 1``.

    Returns:
        ``[main file]`` or ``[main file, sidecar]``.

    Raises:
        ValueError: unknown format, invalid placement, ``num_hidden_layers`` too small, or the
            output folder missing (:class:`~profiling.fileio.InputFileError`). Nothing is written
            then, and existing files keep their content.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown placement format {format!r}; choose one of {', '.join(FORMATS)}")
    p2l = _checked(placement)  # [L, P]
    out = Path(path)
    L, P = p2l.shape
    E = placement.num_logical_experts
    ids = list(placement.layer_ids)
    if num_hidden_layers is not None and format != "sglang":
        raise ValueError(f"num_hidden_layers applies to the sglang format only, not {format!r}")

    # Build every file's bytes first, so a failure leaves the disk untouched.
    files: list[tuple[Path, bytes]] = []
    meta: dict | None = None
    if format == "native":
        doc = {
            "schema": PLACEMENT_SCHEMA,
            "schema_version": PLACEMENT_SCHEMA_VERSION,
            "num_logical_experts": E,
            "layer_ids": ids,
            "topology": placement.topology.to_dict(),
            "allow_colocated_replicas": bool(placement.allow_colocated_replicas),
            "provenance": _jsonable(placement.provenance),
        }
        head = json.dumps(doc, indent=1)[:-2]  # drop the closing "\n}"
        rows = _rows_json("physical_to_logical_map", p2l)[1:]  # '"physical_to_logical_map": [...]}\n'
        files.append((out, (head + ",\n" + rows).encode("utf-8")))
    elif format == "sglang":
        H = max(ids) + 1 if num_hidden_layers is None else int(num_hidden_layers)
        if H <= max(ids):
            raise ValueError(
                f"num_hidden_layers={H} but the placement has layer id {max(ids)}; SGLang's map has one "
                f"row per hidden layer, so pass num_hidden_layers >= {max(ids) + 1} (config.num_hidden_layers)"
            )
        full = np.tile(np.arange(P, dtype=np.int64) % E, (H, 1))  # [H, P] dense rows: trivial map
        full[ids] = p2l  # MoE rows at their real layer index
        if out.suffix in _PT_SUFFIXES:
            try:
                import torch
            except ImportError:  # pragma: no cover - torch is an optional extra
                raise ValueError(
                    "writing an SGLang .pt file needs torch (pip install 'moe-placement[torch]'); "
                    "or write .json, which SGLang reads as well"
                ) from None
            buf = io.BytesIO()
            torch.save({"physical_to_logical_map": torch.from_numpy(full)}, buf)
            files.append((out, buf.getvalue()))
        else:
            files.append((out, _rows_json("physical_to_logical_map", full).encode("utf-8")))
        meta = _metadata(placement, format, out, num_hidden_layers=H)
    elif format == "trtllm":
        import yaml

        doc = {
            "num_slots": P,
            "layer_updates_per_iter": 0,
            "initial_global_assignments": {int(lid): [int(x) for x in row] for lid, row in zip(ids, p2l)},
        }
        text = yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=2**31 - 1)
        files.append((out, text.encode("utf-8")))
        meta = _metadata(placement, format, out)
    elif format == "vllm-ascend":
        G, S = placement.topology.ep_size, placement.topology.slots_per_gpu
        per_gpu = p2l.reshape(L, G, S)  # [L, G, S]: rank g owns slots [g*S, (g+1)*S)
        doc = {
            "moe_layer_count": L,
            "layer_list": [
                {
                    "layer_id": i,
                    "device_count": G,
                    "device_list": [
                        {"device_id": g, "device_expert": [int(x) for x in per_gpu[i, g]]} for g in range(G)
                    ],
                }
                for i in range(L)
            ],
        }
        files.append((out, (json.dumps(doc, indent=1) + "\n").encode("utf-8")))
        meta = _metadata(placement, format, out)
    else:  # vllm (provisional)
        doc = {
            "record_type": VLLM_RECORD_TYPE,
            "version": VLLM_RECORD_VERSION,
            "num_redundant_experts": P - E,
            "num_slots": P,
            "initial_global_assignments": {str(lid): [int(x) for x in row] for lid, row in zip(ids, p2l)},
        }
        files.append((out, (json.dumps(doc) + "\n").encode("utf-8")))
        meta = _metadata(placement, format, out)
    if meta is not None:
        files.append((sidecar_path(out), (json.dumps(meta, indent=1) + "\n").encode("utf-8")))

    for target, data in files:
        atomic_write_bytes(target, data)
    logger.info(
        "wrote %s placement (%d layers x %d slots) to %s", format, L, P, ", ".join(str(f) for f, _ in files)
    )
    return [f for f, _ in files]


# ---------------------------------------------------------------------------------------------
# reading: safe loading and field checks
# ---------------------------------------------------------------------------------------------


def _read_text(p: Path) -> str:
    size = p.stat().st_size
    if size > MAX_TEXT_BYTES:
        raise InputFileError(
            f"{p}: {size} bytes is over the {MAX_TEXT_BYTES}-byte limit for a placement file"
        )
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputFileError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _parse_json(p: Path, text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputFileError(
            f"{p}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise InputFileError(f"{p}: JSON nested too deeply") from None


def _parse_yaml(p: Path, text: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InputFileError(f"{p}: invalid or unsafe YAML ({' '.join(str(exc).split())})") from None
    except RecursionError:
        raise InputFileError(f"{p}: YAML nested too deeply") from None


def _load_pt(p: Path):
    return safe_torch_load(p, MAX_PT_BYTES, "a .pt placement")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _int_field(p: Path, obj: Mapping, key: str, where: str = "") -> int:
    if key not in obj:
        raise InputFileError(f"{p}: {where}missing field {key!r}; expected an integer")
    v = obj[key]
    if not _is_int(v):
        raise InputFileError(f"{p}: {where}field {key!r} must be an integer, got {v!r:.60}")
    return int(v)


def _int_matrix(p: Path, obj, field: str) -> np.ndarray:
    """A nested list (or tensor) of integers as int64 ``[rows, cols]``."""
    if hasattr(obj, "numpy") and hasattr(obj, "dtype"):  # a torch tensor from a .pt file
        obj = obj.detach().cpu().numpy()
    try:
        arr = np.asarray(obj)
    except (ValueError, TypeError):
        arr = None
    if arr is None or arr.ndim != 2 or arr.dtype.kind not in "iu" or arr.shape[1] == 0:
        desc = "ragged or mixed rows" if arr is None or arr.dtype == object else f"{arr.dtype} {arr.shape}"
        raise InputFileError(
            f"{p}: field {field!r} must be a 2-D array of integer expert ids [layers, slots], got {desc}"
        )
    return arr.astype(np.int64)


def _int_list(p: Path, obj, field: str, length: int | None = None) -> np.ndarray:
    if not isinstance(obj, list) or not all(_is_int(x) for x in obj):
        raise InputFileError(
            f"{p}: field {field!r} must be a list of integer expert ids, got {str(obj)[:60]}"
        )
    if length is not None and len(obj) != length:
        raise InputFileError(f"{p}: field {field!r} has {len(obj)} entries, expected {length}")
    return np.asarray(obj, dtype=np.int64)


def _layer_key(p: Path, key, field: str) -> int:
    if _is_int(key) or isinstance(key, str) and key.strip().isdigit():
        k = int(key)
    else:
        raise InputFileError(
            f"{p}: field {field!r} has key {key!r}; expected a non-negative integer layer id"
        )
    if k < 0:
        raise InputFileError(f"{p}: field {field!r} has layer id {k}; expected >= 0")
    return k


def _opt_int_list(p: Path, obj: Mapping, key: str) -> list[int] | None:
    if key not in obj or obj[key] is None:
        return None
    v = obj[key]
    if not isinstance(v, list) or not all(_is_int(x) for x in v):
        raise InputFileError(f"{p}: field {key!r} must be a list of integers, got {str(v)[:60]}")
    return [int(x) for x in v]


# ---------------------------------------------------------------------------------------------
# format detection
# ---------------------------------------------------------------------------------------------


def _format_of(doc) -> str | None:
    if not isinstance(doc, dict):
        return None
    if doc.get("schema") == PLACEMENT_SCHEMA:
        return "native"
    if doc.get("record_type") == VLLM_RECORD_TYPE:
        return "vllm"
    if "layer_list" in doc or "moe_layer_count" in doc:
        return "vllm-ascend"
    if "physical_to_logical_map" in doc or "logical_count" in doc:
        return "sglang"
    if "initial_global_assignments" in doc or "num_slots" in doc:
        return "trtllm"
    return None


def _load_any(p: Path) -> tuple[Any, str]:
    """Load a placement file safely; return ``(content, kind)`` with kind ``json``/``yaml``/``pt``."""
    if not p.is_file():
        raise InputFileError(f"{p}: no such file")
    if p.suffix in _PT_SUFFIXES:
        return _load_pt(p), "pt"
    text = _read_text(p)
    if p.suffix in _YAML_SUFFIXES:
        return _parse_yaml(p, text), "yaml"
    if p.suffix == ".json" or text.lstrip()[:1] in ("{", "["):
        return _parse_json(p, text), "json"
    return _parse_yaml(p, text), "yaml"


def detect_format(path: str | os.PathLike) -> str:
    """The placement format of a file, from its content (and ``.pt`` suffix)."""
    p = Path(path)
    doc, _ = _load_any(p)
    fmt = _format_of(doc)
    if fmt is None:
        raise InputFileError(_unknown_msg(p, doc))
    return fmt


def _unknown_msg(p: Path, doc) -> str:
    keys = sorted(map(str, doc))[:8] if isinstance(doc, dict) else type(doc).__name__
    return (
        f"{p}: not a placement file in any known format (found {keys}); expected native "
        f"(schema {PLACEMENT_SCHEMA!r}), sglang (physical_to_logical_map), trtllm (num_slots, "
        f"initial_global_assignments), vllm-ascend (moe_layer_count, layer_list) or vllm "
        f"(record_type {VLLM_RECORD_TYPE!r})"
    )


# ---------------------------------------------------------------------------------------------
# reading: options from arguments and the sidecar
# ---------------------------------------------------------------------------------------------


class _Options:
    """Values the caller passed, merged with a sidecar; a conflict between the two is an error."""

    def __init__(self, p: Path, fmt: str, given: dict, use_sidecar: bool):
        self.p = p
        self.values = {k: v for k, v in given.items() if v is not None}
        self.sidecar: dict | None = None
        side = sidecar_path(p)
        if use_sidecar and side.is_file():
            self.sidecar = _read_sidecar(side, fmt)
            s = self.sidecar
            topo = s["topology"]
            from_side = {
                "ep_size": topo["ep_size"],
                "num_nodes": topo.get("num_nodes", 1),
                "num_logical_experts": s["num_logical_experts"],
                "layer_ids": s["layer_ids"],
            }
            for key, side_value in from_side.items():
                if side_value is None:
                    continue
                mine = self.values.get(key)
                if mine is not None and _norm(mine) != _norm(side_value):
                    raise InputFileError(
                        f"{p}: {key}={_norm(mine)} was given but the sidecar {side.name} says {_norm(side_value)}; "
                        f"drop the argument or fix the sidecar"
                    )
                self.values[key] = side_value

    def get(self, key: str, default=None):
        return self.values.get(key, default)

    @property
    def provenance(self) -> dict:
        if self.sidecar is not None:
            return dict(self.sidecar.get("provenance") or {})
        return {}

    @property
    def allow_colocated(self) -> bool:
        return self.sidecar.get("allow_colocated_replicas") is True if self.sidecar else False


def _norm(v):
    return [int(x) for x in v] if isinstance(v, (list, tuple, np.ndarray)) else v


def _read_sidecar(side: Path, fmt: str) -> dict:
    s = _parse_json(side, _read_text(side))
    if not isinstance(s, dict) or s.get("schema") != SIDECAR_SCHEMA:
        raise InputFileError(f"{side}: not a placement sidecar (expected field 'schema': {SIDECAR_SCHEMA!r})")
    version = _int_field(side, s, "schema_version")
    if version > PLACEMENT_SCHEMA_VERSION:
        raise InputFileError(
            f"{side}: sidecar schema version {version} is newer than this reader ({PLACEMENT_SCHEMA_VERSION}); upgrade moe-placement"
        )
    if s.get("format") not in (None, fmt):
        raise InputFileError(f"{side}: sidecar describes a {s.get('format')!r} file, but the file is {fmt!r}")
    topo = s.get("topology")
    if not isinstance(topo, dict):
        raise InputFileError(
            f"{side}: field 'topology' must be an object with ep_size, num_physical_experts, num_nodes"
        )
    for key in ("ep_size", "num_physical_experts"):
        _int_field(side, topo, key, "topology: ")
    if "num_nodes" in topo:
        _int_field(side, topo, "num_nodes", "topology: ")
    _int_field(side, s, "num_logical_experts")
    s["layer_ids"] = _opt_int_list(side, s, "layer_ids")
    if "num_hidden_layers" in s and s["num_hidden_layers"] is not None:
        _int_field(side, s, "num_hidden_layers")
    if not isinstance(s.get("provenance", {}), dict):
        raise InputFileError(f"{side}: field 'provenance' must be an object")
    return s


def _build(
    p: Path,
    p2l: np.ndarray,
    opts: _Options,
    layer_ids: Sequence[int] | None,
    provenance: Mapping[str, Any],
    field: str,
    num_logical_experts: int | None = None,
    allow_colocated: bool | None = None,
) -> Placement:
    """Assemble and validate; every validation error names the file and the field."""
    ep_size = opts.get("ep_size")
    if ep_size is None:
        raise InputFileError(
            f"{p}: the file does not say how many EP ranks it is for and has no sidecar: pass ep_size"
        )
    E = num_logical_experts if num_logical_experts is not None else opts.get("num_logical_experts")
    if E is None:
        E = int(p2l.max()) + 1 if p2l.size else 0
    try:
        topo = Topology(
            ep_size=int(ep_size),
            num_physical_experts=int(p2l.shape[1]),
            num_nodes=int(opts.get("num_nodes", 1)),
        )
        return Placement(
            p2l,
            int(E),
            topo,
            tuple(layer_ids or ()),
            dict(provenance),
            opts.allow_colocated if allow_colocated is None else allow_colocated,
        )
    except InputFileError:
        raise
    except ValueError as exc:
        raise InputFileError(f"{p}: field {field!r}: {exc}") from None


def _select_rows(p: Path, full: np.ndarray, layer_ids: Sequence[int], what: str) -> np.ndarray:
    H = full.shape[0]
    bad = [i for i in layer_ids if not 0 <= int(i) < H]
    if bad:
        raise InputFileError(f"{p}: layer id(s) {bad} are outside the file's {H} {what} rows (0..{H - 1})")
    return full[[int(i) for i in layer_ids]]


# ---------------------------------------------------------------------------------------------
# reading: one function per format
# ---------------------------------------------------------------------------------------------


def _read_native(p: Path, doc: dict, opts: _Options) -> Placement:
    version = _int_field(p, doc, "schema_version")
    if version > PLACEMENT_SCHEMA_VERSION:
        raise InputFileError(
            f"{p}: placement schema version {version} is newer than this reader ({PLACEMENT_SCHEMA_VERSION}); upgrade moe-placement"
        )
    if "physical_to_logical_map" not in doc:
        raise InputFileError(
            f"{p}: missing field 'physical_to_logical_map'; expected [layers, slots] integer ids"
        )
    p2l = _int_matrix(p, doc["physical_to_logical_map"], "physical_to_logical_map")
    E = _int_field(p, doc, "num_logical_experts")
    topo = doc.get("topology")
    if not isinstance(topo, dict):
        raise InputFileError(
            f"{p}: field 'topology' must be an object with ep_size, num_physical_experts, num_nodes"
        )
    ep = _int_field(p, topo, "ep_size", "topology: ")
    nodes = _int_field(p, topo, "num_nodes", "topology: ") if "num_nodes" in topo else 1
    ids = _opt_int_list(p, doc, "layer_ids")
    prov = doc.get("provenance", {})
    if not isinstance(prov, dict):
        raise InputFileError(f"{p}: field 'provenance' must be an object")
    for key, mine, theirs in (
        ("ep_size", opts.get("ep_size"), ep),
        ("num_nodes", opts.get("num_nodes"), nodes),
        ("num_logical_experts", opts.get("num_logical_experts"), E),
    ):
        if mine is not None and int(mine) != theirs:
            raise InputFileError(f"{p}: {key}={mine} was given but the file says {theirs}; drop the argument")
    requested = opts.get("layer_ids")
    if requested is not None:
        file_ids = ids if ids is not None else list(range(p2l.shape[0]))
        missing = [i for i in requested if i not in file_ids]
        if missing:
            raise InputFileError(f"{p}: layer id(s) {missing} are not in the file's layer_ids {file_ids}")
        rows = [file_ids.index(i) for i in requested]
        p2l, ids = p2l[rows], list(requested)
    if ids is not None and len(ids) != p2l.shape[0]:
        raise InputFileError(
            f"{p}: field 'layer_ids' has {len(ids)} entries but the map has {p2l.shape[0]} rows"
        )
    spg = topo.get("slots_per_gpu")
    if spg is not None and (not _is_int(spg) or spg * ep != p2l.shape[1]):
        raise InputFileError(
            f"{p}: topology says slots_per_gpu={spg!r} x ep_size={ep}, but the map has {p2l.shape[1]} slots per layer"
        )
    colocated = doc.get("allow_colocated_replicas", False)
    if not isinstance(colocated, bool):
        raise InputFileError(
            f"{p}: field 'allow_colocated_replicas' must be true or false, got {colocated!r:.40}"
        )
    local = _Options(p, "native", {"ep_size": ep, "num_nodes": nodes}, use_sidecar=False)
    return _build(p, p2l, local, ids, prov, "physical_to_logical_map", E, bool(colocated))


def _read_sglang(p: Path, doc, opts: _Options) -> Placement:
    if not isinstance(doc, dict):
        raise InputFileError(
            f"{p}: an SGLang placement must be a dict {{'physical_to_logical_map': ...}}, got {type(doc).__name__}"
        )
    if "physical_to_logical_map" not in doc:
        if "logical_count" in doc:
            raise InputFileError(
                f"{p}: this SGLang file holds 'logical_count' (expert loads for SGLang to balance itself), not a "
                f"placement; read it as a trace, or solve a placement from it"
            )
        raise InputFileError(f"{p}: missing field 'physical_to_logical_map'")
    extra = sorted(set(map(str, doc)) - {"physical_to_logical_map"})
    if extra:
        raise InputFileError(
            f"{p}: SGLang's --init-expert-location file must have exactly one key 'physical_to_logical_map'; "
            f"found extra {extra} (SGLang would fail on them; move metadata to {sidecar_path(p).name})"
        )
    full = _int_matrix(p, doc["physical_to_logical_map"], "physical_to_logical_map")  # [H, P]
    side = opts.sidecar
    if side is not None and side.get("num_hidden_layers") not in (None, full.shape[0]):
        raise InputFileError(
            f"{p}: the map has {full.shape[0]} rows but the sidecar says num_hidden_layers={side['num_hidden_layers']}"
        )
    ids = opts.get("layer_ids")
    if side is None and opts.get("ep_size") is None:
        raise InputFileError(
            f"{p}: sglang file has no sidecar ({sidecar_path(p).name}): pass ep_size (and num_nodes, and layer_ids "
            f"of the MoE layers to skip dense rows)"
        )
    if ids is not None:
        p2l = _select_rows(p, full, ids, "hidden-layer")
    else:
        p2l, ids = full, list(range(full.shape[0]))
    prov = opts.provenance if side is not None else {"source_format": "sglang", "source_file": p.name}
    return _build(p, p2l, opts, ids, prov, "physical_to_logical_map")


def _assignments(
    p: Path, doc: dict, P: int, field: str = "initial_global_assignments"
) -> tuple[list[int], np.ndarray]:
    ga = doc.get(field)
    if not isinstance(ga, dict) or not ga:
        raise InputFileError(
            f"{p}: field {field!r} must be a non-empty mapping {{layer id: [logical id per slot]}}"
        )
    rows = {}
    for key, value in ga.items():
        lid = _layer_key(p, key, field)
        if lid in rows:
            raise InputFileError(f"{p}: field {field!r} lists layer {lid} twice")
        rows[lid] = _int_list(p, value, f"{field}[{lid}]", P)
    ids = sorted(rows)
    return ids, np.stack([rows[i] for i in ids])  # [L, P]


def _pick_layers(p: Path, ids: list[int], p2l: np.ndarray, requested) -> tuple[list[int], np.ndarray]:
    if requested is None:
        return ids, p2l
    missing = [i for i in requested if i not in ids]
    if missing:
        raise InputFileError(f"{p}: layer id(s) {missing} are not in the file (it has {ids})")
    return list(requested), p2l[[ids.index(i) for i in requested]]


def _read_trtllm(p: Path, doc, opts: _Options) -> Placement:
    if not isinstance(doc, dict):
        raise InputFileError(
            f"{p}: a TensorRT-LLM load balancer config must be a mapping, got {type(doc).__name__}"
        )
    P = _int_field(p, doc, "num_slots")
    if P < 1:
        raise InputFileError(f"{p}: field 'num_slots' must be >= 1, got {P}")
    updates = doc.get("layer_updates_per_iter", 0)
    if not _is_int(updates):
        raise InputFileError(f"{p}: field 'layer_updates_per_iter' must be an integer, got {updates!r:.40}")
    if updates:
        logger.warning(
            "%s: layer_updates_per_iter=%d: TensorRT-LLM will rebalance online; reading the initial map",
            p,
            updates,
        )
    unknown = sorted(
        set(map(str, doc)) - {"num_slots", "layer_updates_per_iter", "initial_global_assignments", "ep_size"}
    )
    if unknown:
        raise InputFileError(
            f"{p}: unknown field(s) {unknown}; TensorRT-LLM's moe_load_balancer accepts num_slots, "
            f"layer_updates_per_iter and initial_global_assignments"
        )
    if "ep_size" in doc:  # some TensorRT-LLM tools put it here
        file_ep = _int_field(p, doc, "ep_size")
        if opts.get("ep_size") not in (None, file_ep):
            raise InputFileError(f"{p}: ep_size={opts.get('ep_size')} was given but the file says {file_ep}")
        opts.values["ep_size"] = file_ep
    ids, p2l = _assignments(p, doc, P)
    ids, p2l = _pick_layers(p, ids, p2l, opts.get("layer_ids"))
    if opts.get("ep_size") is None:
        raise InputFileError(
            f"{p}: a TensorRT-LLM moe_load_balancer.yaml does not record the EP size and there is no sidecar "
            f"({sidecar_path(p).name}): pass ep_size"
        )
    prov = opts.provenance if opts.sidecar is not None else {"source_format": "trtllm", "source_file": p.name}
    return _build(p, p2l, opts, ids, prov, "initial_global_assignments")


def _read_vllm_ascend(p: Path, doc, opts: _Options) -> Placement:
    if not isinstance(doc, dict):
        raise InputFileError(f"{p}: a vLLM-Ascend expert map must be a JSON object, got {type(doc).__name__}")
    L = _int_field(p, doc, "moe_layer_count")
    layers = doc.get("layer_list")
    if not isinstance(layers, list) or not layers:
        raise InputFileError(f"{p}: field 'layer_list' must be a non-empty list of layer objects")
    if len(layers) != L:
        raise InputFileError(f"{p}: moe_layer_count={L} but layer_list has {len(layers)} layers")
    G = None
    rows = []
    for i, layer in enumerate(layers):
        where = f"layer_list[{i}]: "
        if not isinstance(layer, dict):
            raise InputFileError(f"{p}: {where}must be an object with device_count and device_list")
        devices = layer.get("device_list")
        if not isinstance(devices, list) or not devices:
            raise InputFileError(f"{p}: {where}field 'device_list' must be a non-empty list")
        count = _int_field(p, layer, "device_count", where) if "device_count" in layer else len(devices)
        if count != len(devices):
            raise InputFileError(
                f"{p}: {where}device_count={count} but device_list has {len(devices)} devices"
            )
        if G is None:
            G = count
        elif count != G:
            raise InputFileError(
                f"{p}: {where}has {count} devices but layer_list[0] has {G}; every layer needs the same count"
            )
        per_dev = {}
        for j, dev in enumerate(devices):
            if not isinstance(dev, dict) or "device_expert" not in dev:
                raise InputFileError(f"{p}: {where}device_list[{j}] must be an object with 'device_expert'")
            d = _int_field(p, dev, "device_id", where + f"device_list[{j}]: ") if "device_id" in dev else j
            if not 0 <= d < count or d in per_dev:
                raise InputFileError(f"{p}: {where}device_id {d} is out of 0..{count - 1} or repeated")
            per_dev[d] = _int_list(p, dev["device_expert"], f"layer_list[{i}].device_list[{j}].device_expert")
        sizes = {len(v) for v in per_dev.values()}
        if len(sizes) != 1 or 0 in sizes:
            raise InputFileError(
                f"{p}: {where}devices list different numbers of experts {sorted(len(per_dev[d]) for d in per_dev)}; "
                f"each device must hold the same number of slots"
            )
        rows.append(np.concatenate([per_dev[d] for d in range(count)]))  # [P]: device g's slots in order
    widths = {r.size for r in rows}
    if len(widths) != 1:
        raise InputFileError(f"{p}: layers have different slot counts {sorted(widths)}")
    p2l = np.stack(rows)  # [L, P]
    if opts.get("ep_size") is not None and int(opts.get("ep_size")) != G:
        raise InputFileError(
            f"{p}: ep_size={opts.get('ep_size')} was given but the file lists {G} devices per layer"
        )
    opts.values["ep_size"] = G
    ids = opts.get("layer_ids")
    if ids is not None and len(ids) != L:
        raise InputFileError(
            f"{p}: {len(ids)} layer_ids given for {L} MoE layers in the file; give one per layer"
        )
    prov = (
        opts.provenance
        if opts.sidecar is not None
        else {"source_format": "vllm-ascend", "source_file": p.name}
    )
    return _build(p, p2l, opts, ids, prov, "layer_list")


def _read_vllm(p: Path, doc, opts: _Options) -> Placement:
    version = _int_field(p, doc, "version")
    if version > VLLM_RECORD_VERSION:
        raise InputFileError(
            f"{p}: {VLLM_RECORD_TYPE} version {version} is newer than this reader ({VLLM_RECORD_VERSION})"
        )
    P = _int_field(p, doc, "num_slots")
    R = _int_field(p, doc, "num_redundant_experts")
    if P < 1 or not 0 <= R < P:
        raise InputFileError(
            f"{p}: num_slots={P}, num_redundant_experts={R}: need num_slots >= 1 and 0 <= redundant < slots"
        )
    E = P - R
    if opts.get("num_logical_experts") not in (None, E):
        raise InputFileError(
            f"{p}: num_logical_experts={opts.get('num_logical_experts')} was given but the file implies {E} (= {P} - {R})"
        )
    ids, p2l = _assignments(p, doc, P)
    ids, p2l = _pick_layers(p, ids, p2l, opts.get("layer_ids"))
    if opts.get("ep_size") is None:
        raise InputFileError(
            f"{p}: the vllm mapping does not record the EP size and there is no sidecar: pass ep_size"
        )
    prov = opts.provenance if opts.sidecar is not None else {"source_format": "vllm", "source_file": p.name}
    return _build(p, p2l, opts, ids, prov, "initial_global_assignments", E)


_READERS = {
    "native": _read_native,
    "sglang": _read_sglang,
    "trtllm": _read_trtllm,
    "vllm-ascend": _read_vllm_ascend,
    "vllm": _read_vllm,
}


def read_placement(
    path: str | os.PathLike,
    format: str | None = None,
    *,
    ep_size: int | None = None,
    num_nodes: int | None = None,
    num_logical_experts: int | None = None,
    layer_ids: Sequence[int] | None = None,
) -> Placement:
    """Read a placement file of any supported format.

    Args:
        path: the file (engine files may have a ``<path>.meta.json`` sidecar, used when present).
        format: one of :data:`FORMATS`; default: detected from the content (``.pt`` is SGLang).
        ep_size: EP ranks ``G``, needed for ``sglang``/``trtllm``/``vllm`` files without a sidecar
            (the vLLM-Ascend file states it as ``device_count``; the native file has it).
        num_nodes: nodes ``N`` (default 1 when neither the file nor the sidecar says).
        num_logical_experts: ``E`` (default: the sidecar, the file, or the largest id + 1).
        layer_ids: the real MoE layer ids. For ``sglang`` (one row per hidden layer) they select the
            MoE rows; without them or a sidecar every row is read as a layer. For ``trtllm``,
            ``vllm`` and ``native`` they select layers by id; for ``vllm-ascend`` they name the rows.

    Raises:
        InputFileError (a ValueError) naming the file, the field and the expected form, or the
        missing argument (e.g. ``sglang file has no sidecar: pass ep_size``).
    """
    p = Path(path)
    if format is not None and format not in FORMATS:
        raise ValueError(f"unknown placement format {format!r}; choose one of {', '.join(FORMATS)}")
    doc, kind = _load_any(p)
    detected = "sglang" if kind == "pt" and isinstance(doc, dict) else _format_of(doc)
    if detected is None:
        raise InputFileError(_unknown_msg(p, doc))
    if format is not None and format != detected:
        raise InputFileError(
            f"{p}: asked to read it as {format!r} but its content is the {detected!r} format"
        )
    given = {
        "ep_size": ep_size,
        "num_nodes": num_nodes,
        "num_logical_experts": num_logical_experts,
        "layer_ids": None if layer_ids is None else [int(i) for i in layer_ids],
    }
    for key, v in (
        ("ep_size", ep_size),
        ("num_nodes", num_nodes),
        ("num_logical_experts", num_logical_experts),
    ):
        if v is not None and (not _is_int(v) or v < 1):
            raise ValueError(f"{key} must be a positive integer, got {v!r}")
    opts = _Options(p, detected, given, use_sidecar=detected != "native")
    try:
        return _READERS[detected](p, doc, opts)
    except InputFileError:
        raise
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as exc:  # last line of defence
        raise InputFileError(
            f"{p}: malformed {detected} placement file ({type(exc).__name__}: {exc})"
        ) from None
