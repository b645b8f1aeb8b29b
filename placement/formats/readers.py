"""Read placement files of every format into a :class:`~placement.model.Placement`.

One reader per format turns the file's layer axis into real layer ids; what an engine file cannot
hold comes from the sidecar ``<path>.meta.json`` or from the caller's arguments (a conflict between
the two is an error). The public entry point :func:`read_placement` is re-exported by
:mod:`placement.formats`. Shapes: L = MoE layers, H = hidden layers, P = physical slots, G = devices.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moe_placement.base.fileio import InputFileError, require_regular
from moe_placement.base.limits import MAX_LAYER_ID, check_layer_ids
from placement.formats.load import (
    _format_of,
    _int_field,
    _int_list,
    _int_matrix,
    _is_int,
    _layer_id_list,
    _layer_key,
    _parse_json,
    _read_text,
    _unknown_msg,
    load_with_digest,
)
from placement.formats.spec import (
    FORMATS,
    PLACEMENT_SCHEMA_VERSION,
    SIDECAR_SCHEMA,
    VLLM_RECORD_TYPE,
    VLLM_RECORD_VERSION,
    sidecar_path,
)
from placement.model import Placement
from placement.topology import Topology

__all__ = ["read_placement"]

# The public logger name of the formats (the CLI's log format shows it), kept from before the split.
logger = logging.getLogger("placement.formats")


# ---------------------------------------------------------------------------------------------
# reading: options from arguments and the sidecar
# ---------------------------------------------------------------------------------------------


class _Options:
    """Values the caller passed, merged with a sidecar; a conflict between the two is an error."""

    def __init__(self, p: Path, fmt: str, given: dict, use_sidecar: bool, digest: str | None = None):
        self.p = p
        self.values = {k: v for k, v in given.items() if v is not None}
        self.sidecar: dict | None = None
        side = sidecar_path(p)
        if use_sidecar and os.path.lexists(side):
            require_regular(side)  # a folder, FIFO or dangling link there is named, not taken for "none"
            self.sidecar = _read_sidecar(side, fmt)
            s = self.sidecar
            _check_digest(p, side, s, digest)
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
        if self.values.get("allow_colocated_replicas"):
            return True
        return self.sidecar.get("allow_colocated_replicas") is True if self.sidecar else False


def _norm(v):
    return [int(x) for x in v] if isinstance(v, (list, tuple, np.ndarray)) else v


def _check_digest(p: Path, side: Path, s: dict, digest: str | None) -> None:
    """A sidecar that records ``file_sha256`` describes only the map with those bytes (older sidecars
    record none and are taken as they are)."""
    want = s.get("file_sha256")
    if want is None or digest is None:
        return
    if not isinstance(want, str) or len(want) != 64:
        raise InputFileError(f"{side}: field 'file_sha256' must be 64 hex digits, got {want!r:.80}")
    if want.lower() != digest:
        raise InputFileError(
            f"{side} describes another version of {p.name} (its file_sha256 {want[:12]}... is not the file's "
            f"{digest[:12]}...): the pair comes from two different writes; write both again (solve or "
            f"convert -o {p.name}), or delete the sidecar and pass ep_size"
        )


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
    s["layer_ids"] = _layer_id_list(side, s, "layer_ids")
    if "num_hidden_layers" in s and s["num_hidden_layers"] is not None:
        H = _int_field(side, s, "num_hidden_layers")
        if not 1 <= H <= MAX_LAYER_ID + 1:
            raise InputFileError(
                f"{side}: field 'num_hidden_layers' is {H}, outside the accepted range 1..{MAX_LAYER_ID + 1} "
                f"(MAX_LAYER_ID + 1)"
            )
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
    ids = _layer_id_list(p, doc, "layer_ids")
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
        G, row = _ascend_layer_row(p, i, layer, G)
        rows.append(row)  # [P]: device g's slots in order
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


def _ascend_layer_row(p: Path, i: int, layer, G: int | None) -> tuple[int, np.ndarray]:
    """One ``layer_list[i]`` entry: its device count (must equal ``G`` once known) and its row
    int64 ``[P]``, the devices' ``device_expert`` lists concatenated in ``device_id`` order."""
    where = f"layer_list[{i}]: "
    if not isinstance(layer, dict):
        raise InputFileError(f"{p}: {where}must be an object with device_count and device_list")
    devices = layer.get("device_list")
    if not isinstance(devices, list) or not devices:
        raise InputFileError(f"{p}: {where}field 'device_list' must be a non-empty list")
    count = _int_field(p, layer, "device_count", where) if "device_count" in layer else len(devices)
    if count != len(devices):
        raise InputFileError(f"{p}: {where}device_count={count} but device_list has {len(devices)} devices")
    if G is not None and count != G:
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
    return count, np.concatenate([per_dev[d] for d in range(count)])  # [P]


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
    allow_colocated_replicas: bool = False,
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
        allow_colocated_replicas: accept two replicas of one expert on one GPU (the engines' own
            balancers write such maps; see :func:`placement.model.colocated_replicas`).

    Raises:
        InputFileError (a ValueError) naming the file, the field and the expected form, or the
        missing argument (e.g. ``sglang file has no sidecar: pass ep_size``).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise InputFileError(f"path must be a file name (str or os.PathLike), got {type(path).__name__}")
    p = Path(path)
    if format is not None and format not in FORMATS:
        raise ValueError(f"unknown placement format {format!r}; choose one of {', '.join(FORMATS)}")
    doc, kind, digest = load_with_digest(p)
    detected = "sglang" if kind == "pt" and isinstance(doc, dict) else _format_of(doc)
    if detected is None:
        raise InputFileError(_unknown_msg(p, doc))
    if format is not None and format != detected:
        raise InputFileError(
            f"{p}: asked to read it as {format!r} but its content is the {detected!r} format"
        )
    if layer_ids is not None:
        layer_ids = check_layer_ids(layer_ids, "layer_ids")
    given = {
        "ep_size": ep_size,
        "num_nodes": num_nodes,
        "num_logical_experts": num_logical_experts,
        "layer_ids": None if layer_ids is None else [int(i) for i in layer_ids],
        "allow_colocated_replicas": allow_colocated_replicas or None,
    }
    for key, v in (
        ("ep_size", ep_size),
        ("num_nodes", num_nodes),
        ("num_logical_experts", num_logical_experts),
    ):
        if v is not None and (not _is_int(v) or v < 1):
            raise ValueError(f"{key} must be a positive integer, got {v!r}")
    opts = _Options(p, detected, given, use_sidecar=detected != "native", digest=digest)
    try:
        return _READERS[detected](p, doc, opts)
    except InputFileError:
        raise
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as exc:  # last line of defence
        raise InputFileError(
            f"{p}: malformed {detected} placement file ({type(exc).__name__}: {exc})"
        ) from None
    except RecursionError:
        raise InputFileError(f"{p}: {detected} placement file nested too deeply to read") from None
