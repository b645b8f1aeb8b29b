"""Hardware presets for the cost model: GPUs, links, clusters.

Every constant is a public figure or a fit to one; the source and a sensitivity band sit next to it.
All values are overridable: build a :class:`GpuSpec` / :class:`LinkSpec` yourself, use
``dataclasses.replace(preset, field=value)``, or load a JSON preset written by ``moe-placement
calibrate`` (or ``benchmarks/gpu_gemm_fit.py``) with :func:`load_hardware_preset` / :func:`cluster_preset`.
A preset is *measured* only where it carries measured figures (``provenance.measured``; the preset
format is described in docs/formats.md); :func:`hardware_summary` says so in every JSON report.

Units: bytes, bytes/s, FLOP/s, seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from moe_placement.base.limits import MAX_RANKS
from moe_placement.base.options import refuse_unknown_keywords
from placement.cost.fields import Range, check_fields, show

__all__ = [
    "LinkSpec",
    "GpuSpec",
    "ClusterSpec",
    "GPUS",
    "LINKS",
    "HardwarePreset",
    "MEASURED_PARTS",
    "cluster_preset",
    "hardware_summary",
    "load_gpu_preset",
    "load_hardware_preset",
    "parse_hardware_preset",
    "HARDWARE_NAMES",
    "DEFAULT_HARDWARE",
    "REBALANCE_STALL_S",
    "hardware_summary",
    "KV_HANDOFF_FIXED_S",
]

GB = 1e9
TB = 1e12

# Accepted range of each numeric field of the specs below (a field not listed: its kind's default range,
# placement.cost.fields). Ranges are far wider than any real part but keep every time and size the
# cost model prints finite and of sane magnitude (a FLOP rate of 1e-300 would print a 300-digit time).
_BANDWIDTH = Range(1e6, 1e15)  # bytes/s: 1 MB/s .. 1 PB/s
_SECONDS = Range(0.0, 1.0)  # fixed costs per call
_EFFICIENCY = Range(0.01, 1.0)  # achieved share of a peak
_RANGES = {
    # LinkSpec
    "bandwidth": _BANDWIDTH,
    "latency": _SECONDS,
    "nominal_bandwidth": Range(0.0, 1e15),
    "band": Range(0.0, 1e15),
    # GpuSpec
    "flops_fp8": Range(1e9, 1e19),  # FLOP/s: 1 GFLOP/s .. 10 EFLOP/s
    "flops_bf16": Range(1e9, 1e19),
    "hbm_bandwidth": _BANDWIDTH,
    "hbm_bytes": Range(1e8, 1e14),  # 100 MB .. 100 TB
    "eta_compute": _EFFICIENCY,
    "eta_memory": _EFFICIENCY,
    "eta_attention": _EFFICIENCY,
    "gemm_overhead": _SECONDS,
    # fields the cost branch adds (unused until it is merged; any other new field: its kind's default)
    "normal_bandwidth": _BANDWIDTH,
    "normal_latency": _SECONDS,
    "allreduce_latency": _SECONDS,
    "split_overhead": _SECONDS,
    # ClusterSpec
    "gpus_per_node": Range(1, MAX_RANKS),
}


@refuse_unknown_keywords
@dataclass(frozen=True)
class LinkSpec:
    """One link type as the all-to-all kernels see it.

    Attributes:
        name: preset name.
        bandwidth: effective bytes/s per GPU per direction (what a dispatch or combine achieves).
        latency: fixed cost of one dispatch or one combine of the low-latency kernels (decode; kernel
            launch, signalling, barrier), seconds.
        nominal_bandwidth: the datasheet figure, for reference only.
        source: where the numbers come from; ``band``: plausible range of the effective bandwidth.
        normal_bandwidth / normal_latency: the same for the normal (throughput, prefill) kernels and
            for bulk copies such as a rebalance's weight moves; None: as the low-latency figures.
        allreduce_latency: one small all-reduce (a per-step dispatch's expert counts) over this link,
            seconds.
    """

    name: str
    bandwidth: float
    latency: float
    nominal_bandwidth: float
    source: str = ""
    band: tuple[float, float] = (0.0, 0.0)
    normal_bandwidth: float | None = None
    normal_latency: float | None = None
    allreduce_latency: float = 10e-6

    def kernel(self, kind: str) -> tuple[float, float]:
        """``(effective bytes/s, latency s)`` of the ``low_latency`` or ``normal`` kernels."""
        if kind == "low_latency":
            return self.bandwidth, self.latency
        if kind == "normal":
            bw = self.bandwidth if self.normal_bandwidth is None else self.normal_bandwidth
            return bw, self.latency if self.normal_latency is None else self.normal_latency
        raise ValueError(f"link kernel must be 'low_latency' or 'normal', got {kind!r}")

    def __post_init__(self) -> None:
        where = f"link {self.name!r}"
        check_fields(self, _RANGES, where)
        if self.band[0] > self.band[1]:
            raise ValueError(f"{where}: band {self.band} must be (low, high) with low <= high")


@refuse_unknown_keywords
@dataclass(frozen=True)
class GpuSpec:
    """One GPU type.

    Attributes:
        flops_fp8 / flops_bf16: dense peak FLOP/s.
        hbm_bandwidth: bytes/s; hbm_bytes: usable device memory, bytes.
        eta_compute: achieved fraction of peak FLOP/s in a large grouped GEMM (``eta_c``).
        eta_memory: achieved fraction of HBM bandwidth when a GEMM is weight-read bound (``eta_m``).
        gemm_overhead: ``t0``, fixed cost per grouped GEMM call, seconds.
        eta_attention: achieved fraction of BF16 peak in attention kernels (FlashMLA / FA3).
        nvlink: the intra-node link that comes with the GPU (overridable per cluster).
        split_overhead: seconds per MoE layer a per-step dispatch spends computing its split on the
            GPU (LP or water-fill over the all-reduced counts), besides the all-reduce itself.
    """

    name: str
    flops_fp8: float
    flops_bf16: float
    hbm_bandwidth: float
    hbm_bytes: float
    nvlink: LinkSpec
    eta_compute: float = 0.54
    eta_memory: float = 0.88
    gemm_overhead: float = 3e-6
    eta_attention: float = 0.6
    source: str = ""
    provenance: Mapping[str, Any] = field(default_factory=dict)
    split_overhead: float = 2e-6

    def __post_init__(self) -> None:
        check_fields(self, _RANGES, f"GPU {self.name!r}")

    @property
    def calibrated(self) -> bool:
        """True when the GEMM constants were refitted on a GPU: the preset names ``gemm`` in
        ``provenance["measured"]`` (``moe-placement calibrate`` on CUDA) or carries the fit's measured
        times (``provenance["times_s"]``, ``benchmarks/gpu_gemm_fit.py``); False for datasheet figures,
        published fits and a GEMM timed on a CPU (kept aside in ``provenance["gemm"]``, never applied)."""
        if not isinstance(self.provenance, Mapping):
            return False
        return "gemm" in _measured_list(self.provenance) or bool(self.provenance.get("times_s"))

    def peak_flops(self, weight_bytes: float) -> float:
        """Dense peak for weights of ``weight_bytes`` per element (1 = FP8, else BF16)."""
        return self.flops_fp8 if weight_bytes <= 1 else self.flops_bf16

    def knee_tokens_per_expert(self, weight_bytes: float = 1.0) -> float:
        """Tokens per expert where a GLU expert GEMM turns compute-bound: ``2 P eta_c b_w / (BW eta_m) * ...``.

        FLOPs ``6 d f n`` vs bytes ``3 d f b_w``: the knee is ``n = P eta_c b_w / (2 BW eta_m)``.
        """
        return (
            self.peak_flops(weight_bytes)
            * self.eta_compute
            * weight_bytes
            / (2 * self.hbm_bandwidth * self.eta_memory)
        )


@refuse_unknown_keywords
@dataclass(frozen=True)
class ClusterSpec:
    """GPUs of one type, ``gpus_per_node`` per node, an intra-node and an inter-node link."""

    gpu: GpuSpec
    intra: LinkSpec
    inter: LinkSpec
    gpus_per_node: int = 8
    measured_parts: tuple[str, ...] = ()
    preset: str = ""

    def __post_init__(self) -> None:
        check_fields(self, _RANGES, "cluster")
        unknown = sorted(set(self.measured_parts) - set(MEASURED_PARTS))
        if unknown:
            raise ValueError(f"cluster: measured_parts {unknown} unknown; accepted: {list(MEASURED_PARTS)}")

    @property
    def name(self) -> str:
        return f"{self.gpu.name}/{self.intra.name}/{self.inter.name}"

    @property
    def measured(self) -> bool:
        """True when some figure this cluster is priced with was measured (``measured_parts``: the
        preset's measured links that no ``--intra-link``/``--inter-link`` replaced, its GEMM fit, its
        launch cost) or its GPU's GEMM constants were refitted (:attr:`GpuSpec.calibrated`)."""
        return bool(self.measured_parts) or self.gpu.calibrated

    def to_dict(self) -> dict:
        return {
            "gpu": asdict(self.gpu),
            "intra": asdict(self.intra),
            "inter": asdict(self.inter),
            "gpus_per_node": self.gpus_per_node,
            **hardware_summary(self),
        }


# ---------------------------------------------------------------------------------------------
# Links. Effective bandwidths per GPU and direction.
# ---------------------------------------------------------------------------------------------
# Small all-reduce (a per-step dispatch's expert counts, a few KB) across the EP group: latency-bound.
# Inside an NVLink node a one-shot custom all-reduce (vLLM/SGLang custom_all_reduce) takes a few us
# (8 us assumed, band 4-15 us); across nodes NCCL's small-message all-reduce over IB takes tens of us
# (25 us assumed, band 15-60 us); costmodel.md: "a few us in a node, tens across nodes".
_NVL_ALLREDUCE = 3e-6
_RDMA_ALLREDUCE = 8e-6

# Low-latency kernels over NVLink: 33 us, the best fit to DeepEP's legacy EP8 row (one H800 node, 77 us
# dispatch / 114 us combine: 1.6% largest error at 155 GB/s); costmodel.md's 18-20 us floor is the
# best kernels' at small messages, inside the range placement/cost/ranges.py gives.
_NVL_LL_LATENCY = 33e-6
# Normal (throughput) kernels and bulk weight copies over NVLink: 40 us typical fixed cost
# (costmodel.md). RDMA: fitted, see "rdma" below.
LINKS: dict[str, LinkSpec] = {
    # H100/H200 NVLink 4: 450 GB/s per direction nominal; ~0.6 of it effective for all-to-all
    # (calculon's efficiency; costmodel.md). Low-latency kernels' latency _NVL_LL_LATENCY (below).
    "nvlink4": LinkSpec(
        "nvlink4",
        270 * GB,
        _NVL_LL_LATENCY,
        450 * GB,
        "NVIDIA H100 datasheet (900 GB/s bidirectional); efficiency 0.6 (calculon)",
        (200 * GB, 360 * GB),
        normal_latency=40e-6,
        allreduce_latency=_NVL_ALLREDUCE,
    ),
    # H800 NVLink (400 GB/s bidirectional): DeepEP README measures 153-158 GB/s intranode EP8.
    "nvlink-h800": LinkSpec(
        "nvlink-h800",
        155 * GB,
        _NVL_LL_LATENCY,
        200 * GB,
        "deepseek-ai/DeepEP README (legacy): intranode EP8 153/158 GB/s on H800",
        (140 * GB, 170 * GB),
        normal_latency=40e-6,
        allreduce_latency=_NVL_ALLREDUCE,
    ),
    # B200 NVLink 5: 900 GB/s per direction nominal. DeepEP V2 README: 643-740 GB/s logical on SM100 EP8.
    "nvlink5": LinkSpec(
        "nvlink5",
        600 * GB,
        _NVL_LL_LATENCY,
        900 * GB,
        "NVIDIA B200 datasheet; deepseek-ai/DeepEP README (V2) 643-740 GB/s logical EP8",
        (540 * GB, 740 * GB),
        normal_latency=40e-6,
        allreduce_latency=_NVL_ALLREDUCE,
    ),
    # PCIe Gen5 x16: 63 GB/s per direction nominal; peer-to-peer through a switch reaches ~0.6-0.7.
    "pcie5": LinkSpec(
        "pcie5",
        40 * GB,
        25e-6,
        63 * GB,
        "PCIe 5.0 x16 spec; efficiency 0.6-0.7 assumed",
        (30 * GB, 50 * GB),
        allreduce_latency=25e-6,
    ),
    "pcie4": LinkSpec(
        "pcie4",
        20 * GB,
        25e-6,
        31.5 * GB,
        "PCIe 4.0 x16 spec; efficiency 0.6-0.7 assumed",
        (15 * GB, 25 * GB),
        allreduce_latency=25e-6,
    ),
    # One 400 Gb/s CX7 NIC per GPU: 50 GB/s nominal. Low-latency kernels: 35.5 us + 46 GB/s, the best fit
    # to DeepEP's NVLink-era figures (H20, EP16-EP64, inter-node bytes: 2.0% largest error), within 9.3%
    # of the legacy table (H800, EP16-EP256). Normal kernels: the same latency, 44.75 GB/s, the best fit at
    # it to the normal-kernel table (EP32/EP64: 3.5%). The constant sets that fit as well, and the range
    # they give every modelled figure: placement/cost/ranges.py (benchmarks/step_model_check.py fits).
    "rdma": LinkSpec(
        "rdma",
        46 * GB,
        35.5e-6,
        50 * GB,
        "deepseek-ai/DeepEP low-latency tables (legacy H800 and NVLink-era H20) and normal-kernel table, CX7 400 Gb/s",
        (39 * GB, 50 * GB),
        normal_bandwidth=44.75 * GB,
        allreduce_latency=_RDMA_ALLREDUCE,
    ),
    # Plain Ethernet with TCP sockets (no RDMA): 100 GbE = 12.5 GB/s nominal; NCCL socket transport
    # reaches ~70%; latency 100 us (band 50-300 us).
    "ethernet": LinkSpec(
        "ethernet",
        9 * GB,
        100e-6,
        12.5 * GB,
        "100 GbE, TCP sockets; efficiency 0.7 assumed",
        (5 * GB, 11 * GB),
        allreduce_latency=100e-6,
    ),
    "ethernet-25g": LinkSpec(
        "ethernet-25g",
        2.2 * GB,
        150e-6,
        3.125 * GB,
        "25 GbE, TCP sockets; efficiency 0.7 assumed",
        (1.5 * GB, 2.8 * GB),
        allreduce_latency=150e-6,
    ),
}

# ---------------------------------------------------------------------------------------------
# GPUs. split_overhead 5 us per MoE layer (assumed for a fused split kernel; band 2-20 us): with the
# count all-reduce it puts a per-step dispatch at about 1-2% of a decode step, SGLang's reported 1.0-1.6%
# for its LP dispatch (checked by benchmarks/step_model_check.py).
# eta_c 0.54, eta_m 0.88, t0 3 us: fit to DeepGEMM's published H800 grouped-GEMM timings
# (costmodel.md); the same efficiencies are assumed for H200 and B200 until a GPU fit replaces them.
# ---------------------------------------------------------------------------------------------
_HOPPER = "NVIDIA H100/H200 datasheets (FP8 1979 TFLOP/s dense, BF16 989); eta fit to deepseek-ai/DeepGEMM README (H800)"
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("h100", 1979 * TB, 989 * TB, 3.35 * TB, 80 * GB, LINKS["nvlink4"], source=_HOPPER),
    "h800": GpuSpec("h800", 1979 * TB, 989 * TB, 3.35 * TB, 80 * GB, LINKS["nvlink-h800"], source=_HOPPER),
    "h200": GpuSpec("h200", 1979 * TB, 989 * TB, 4.8 * TB, 141 * GB, LINKS["nvlink4"], source=_HOPPER),
    # B200: FP8 4.5 PFLOP/s dense, BF16 2.25, HBM3e 8 TB/s, 180 GB usable (192 GB nominal).
    "b200": GpuSpec(
        "b200",
        4500 * TB,
        2250 * TB,
        8.0 * TB,
        180 * GB,
        LINKS["nvlink5"],
        source="NVIDIA B200 datasheet; Hopper efficiencies assumed (sensitivity: eta_c 0.4-0.7)",
    ),
}

HARDWARE_NAMES = tuple(GPUS)
DEFAULT_HARDWARE = "h200"  # the one default GPU preset: every command and solver prices with it unless told

# Serving time lost to one online rearrangement of the experts (weights moved while serving waits),
# seconds, (low, high): vLLM's EPLB 0.65-1.7 s per rearrangement measured on large models; SGLang's
# EPLB about 1.8 s reported (costmodel.md, "What has been measured elsewhere").
REBALANCE_STALL_S: dict[str, tuple[float, float]] = {"vllm": (0.65, 1.7), "sglang": (1.8, 1.8)}

# Fixed cost of one request's KV-cache hand-off from a prefill to a decode instance, seconds, besides
# the bytes over the link: connection and bootstrap handshake, the block-table exchange and the
# completion notice, (low, central, high). ASSUMED, not measured: the engines publish no figure (the
# transfer engines set up one batch of per-layer block copies per request or chunk). Priced by
# placement.cost.handoff.
KV_HANDOFF_FIXED_S: tuple[float, float, float] = (0.2e-3, 1e-3, 5e-3)


# ---------------------------------------------------------------------------------------------
# Preset files (docs/formats.md, "Hardware presets"): a base GPU, overrides of its numbers, measured
# links, and a provenance that names what was measured.
# ---------------------------------------------------------------------------------------------
# What a preset may say it measured (``provenance.measured``): the all-to-all over each link, the
# grouped-GEMM constants on a GPU, a small kernel's launch cost inside a CUDA graph.
MEASURED_PARTS: tuple[str, ...] = ("a2a_intra", "a2a_inter", "gemm", "launch")
LINK_SECTIONS: tuple[str, ...] = ("intra", "inter")
# The keys a GPU preset file may override: every number of :class:`GpuSpec` (the link is per cluster,
# ``source`` and ``provenance`` are the file's own keys), and its ``name``.
GPU_PRESET_KEYS: tuple[str, ...] = tuple(f.name for f in fields(GpuSpec) if f.type in ("float", float)) + (
    "name",
)
# The keys of a link section (``intra``, ``inter``): LinkSpec's fields; bandwidth and latency required.
LINK_PRESET_KEYS: tuple[str, ...] = tuple(f.name for f in fields(LinkSpec))
_GEMM_KEYS = ("eta_compute", "eta_memory", "gemm_overhead")


@dataclass(frozen=True)
class HardwarePreset:
    """One preset file, read and checked.

    Attributes:
        path: the file.
        gpu: the base GPU with the file's overrides (its ``nvlink`` is the measured intra link when the
            file has one).
        intra / inter: the file's link sections as :class:`LinkSpec` (None: not in the file).
        measured: what the file measured, a subset of :data:`MEASURED_PARTS` in that order (a
            ``benchmarks/gpu_gemm_fit.py`` file, whose provenance has ``times_s``: ``("gemm",)``).
    """

    path: str
    gpu: GpuSpec
    intra: LinkSpec | None
    inter: LinkSpec | None
    measured: tuple[str, ...]


def _measured_list(provenance: Mapping) -> tuple[str, ...]:
    """``provenance["measured"]`` as a tuple of names (anything else: empty)."""
    m = provenance.get("measured", ())
    return tuple(x for x in m if isinstance(x, str)) if isinstance(m, (list, tuple)) else ()


def _check_measured(path, d: dict) -> tuple[str, ...]:
    """The file's ``provenance.measured`` checked: known names, each backed by the figures it names."""
    prov = d.get("provenance", {})
    if not isinstance(prov, dict):
        raise ValueError(f"{path}: provenance must be a JSON object, got {show(prov)}")
    m = prov.get("measured", [])
    if not isinstance(m, list) or not all(isinstance(x, str) for x in m):
        raise ValueError(f"{path}: provenance.measured must be a list of names from {list(MEASURED_PARTS)}")
    unknown = sorted(set(m) - set(MEASURED_PARTS))
    if unknown:
        raise ValueError(f"{path}: provenance.measured names {unknown}; accepted: {list(MEASURED_PARTS)}")
    for link in LINK_SECTIONS:
        if f"a2a_{link}" in m and link not in d:
            raise ValueError(
                f"{path}: provenance.measured names a2a_{link} but the file has no {link!r} section"
            )
    if "gemm" in m and not all(k in d for k in _GEMM_KEYS):
        raise ValueError(
            f"{path}: provenance.measured names gemm but the file lacks one of {list(_GEMM_KEYS)}"
        )
    if not m and prov.get("times_s"):  # benchmarks/gpu_gemm_fit.py: the GEMM fit's measured times
        return ("gemm",)
    return tuple(p for p in MEASURED_PARTS if p in m)


def _link_section(path, key: str, section: Any, default: LinkSpec, preset_name: str) -> LinkSpec:
    """A link section -> LinkSpec: ``bandwidth`` and ``latency`` required; ``normal_*`` absent: as the
    low-latency figures; ``nominal_bandwidth`` and ``allreduce_latency`` absent: the default link's."""
    if not isinstance(section, dict):
        raise ValueError(f"{path}: {key!r} must be a JSON object of LinkSpec fields, got {show(section)}")
    extra = sorted(set(section) - set(LINK_PRESET_KEYS))
    if extra:
        raise ValueError(f"{path}: unknown {key!r} keys {extra}; allowed: {list(LINK_PRESET_KEYS)}")
    missing = [k for k in ("bandwidth", "latency") if k not in section]
    if missing:
        raise ValueError(f"{path}: the {key!r} section needs {missing} (bytes/s and seconds)")
    kw = {
        "name": f"{preset_name}-{key}",
        "nominal_bandwidth": default.nominal_bandwidth,
        "source": f"measured, preset {path}",
        "allreduce_latency": default.allreduce_latency,
        **section,
    }
    if isinstance(kw.get("band"), list):
        kw["band"] = tuple(kw["band"])
    try:
        return LinkSpec(**kw)
    except (ValueError, TypeError) as exc:  # the field checks of LinkSpec, named with the file
        raise ValueError(f"{path}: {key}: {exc}") from None


def load_hardware_preset(path: str | Path) -> HardwarePreset:
    """Read a hardware preset JSON (``moe-placement calibrate``, ``benchmarks/gpu_gemm_fit.py``, or
    written by hand): ``base`` (a GPU name to start from), any :class:`GpuSpec` number to override,
    ``intra`` / ``inter`` link sections (:class:`LinkSpec` fields), ``source`` and ``provenance``
    (``measured``: what was measured; see docs/formats.md). Every value is checked; a bad one is a
    one-line ValueError naming the file and the key."""
    from moe_placement.base.fileio import load_json

    return parse_hardware_preset(load_json(path), path)


def parse_hardware_preset(d: Any, path: str | Path = "preset") -> HardwarePreset:
    """:func:`load_hardware_preset` on a preset already read (``path`` names it in messages)."""
    if not isinstance(d, dict) or "base" not in d:
        raise ValueError(
            f"{path}: a GPU preset must be a JSON object with a 'base' GPU name (one of {HARDWARE_NAMES})"
        )
    base = d["base"].lower() if isinstance(d["base"], str) else d["base"]
    if not isinstance(base, str) or base not in GPUS:
        raise ValueError(f"{path}: unknown base GPU {show(base)}; use one of {HARDWARE_NAMES}")
    allowed = set(GPU_PRESET_KEYS)
    extra = set(d) - allowed - {"base", "provenance", "source", *LINK_SECTIONS}
    if extra:
        raise ValueError(
            f"{path}: unknown GPU preset keys {sorted(extra)}; allowed: base, source, provenance, "
            f"{', '.join(LINK_SECTIONS)} and {sorted(allowed)}"
        )
    measured = _check_measured(path, d)
    name = d["name"] if isinstance(d.get("name"), str) else f"{base}-preset"
    intra = _link_section(path, "intra", d["intra"], GPUS[base].nvlink, name) if "intra" in d else None
    inter = _link_section(path, "inter", d["inter"], LINKS["rdma"], name) if "inter" in d else None
    over = {k: d[k] for k in allowed if k in d}
    try:
        gpu = replace(
            GPUS[base],
            **over,
            nvlink=intra or GPUS[base].nvlink,
            source=d.get("source", f"fitted preset {path}"),
            provenance=d.get("provenance", {}),
        )
    except ValueError as exc:  # the field checks of GpuSpec, named with the file
        raise ValueError(f"{path}: {exc}") from None
    return HardwarePreset(str(path), gpu, intra, inter, measured)


def load_gpu_preset(path: str | Path) -> GpuSpec:
    """The GPU of a preset file (:func:`load_hardware_preset`; its ``nvlink`` is the file's measured
    intra link when it has one)."""
    return load_hardware_preset(path).gpu


def cluster_preset(
    hardware: str = DEFAULT_HARDWARE,
    intra: str | None = None,
    inter: str | None = None,
    gpus_per_node: int = 8,
) -> ClusterSpec:
    """A cluster from preset names: ``hardware`` a GPU name or a preset JSON path; ``intra`` a link
    name (default: the preset's measured intra link, else the GPU's NVLink), ``inter`` a link name
    (default: the preset's measured inter link, else ``rdma``). A link given by name replaces the
    preset's: the cluster's ``measured_parts`` then no longer name it."""
    hw = str(hardware)
    preset = None
    if hw.lower() in GPUS:
        gpu = GPUS[hw.lower()]
    elif hw.endswith(".json") or Path(hw).is_file():
        preset = load_hardware_preset(hw)
        gpu = preset.gpu
    else:
        raise ValueError(f"unknown hardware {hardware!r}; use one of {HARDWARE_NAMES} or a preset .json file")

    def link(name: str | None, default: LinkSpec) -> LinkSpec:
        if name is None:
            return default
        if not isinstance(name, str) or name.lower() not in LINKS:
            raise ValueError(f"unknown link {name!r}; use one of {tuple(LINKS)}")
        return LINKS[name.lower()]

    parts = preset.measured if preset is not None else ()
    replaced = {f"a2a_{k}" for k, v in (("intra", intra), ("inter", inter)) if v is not None}
    inter_default = preset.inter if preset is not None and preset.inter is not None else LINKS["rdma"]
    return ClusterSpec(
        gpu,
        link(intra, gpu.nvlink),
        link(inter, inter_default),
        gpus_per_node,
        tuple(p for p in parts if p not in replaced),
        preset=hw if preset is not None else hw.lower(),
    )


def hardware_summary(cluster: ClusterSpec) -> dict:
    """What every JSON report that carries a modelled time says of its hardware:
    ``{"preset": name or preset path, "measured": bool, "measured_parts": [...]}`` (``measured``:
    :attr:`ClusterSpec.measured`; ``measured_parts``: the measured figures priced, from
    :data:`MEASURED_PARTS`)."""
    parts = list(cluster.measured_parts)
    if cluster.gpu.calibrated and "gemm" not in parts:
        parts.append("gemm")
    return {
        "preset": cluster.preset or cluster.gpu.name,
        "measured": cluster.measured,
        "measured_parts": parts,
    }
