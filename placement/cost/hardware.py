"""Hardware presets for the cost model: GPUs, links, clusters.

Every constant is a public figure or a fit to one; the source and a sensitivity band sit next to it.
All values are overridable: build a :class:`GpuSpec` / :class:`LinkSpec` yourself, use
``dataclasses.replace(preset, field=value)``, or load a JSON preset written by
``benchmarks/gpu_gemm_fit.py`` with :func:`load_gpu_preset`.

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
    "cluster_preset",
    "load_gpu_preset",
    "HARDWARE_NAMES",
    "REBALANCE_STALL_S",
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
        """True when the GEMM constants were refitted on this GPU: the preset carries the fit's measured
        times (``provenance["times_s"]``, written by ``benchmarks/gpu_gemm_fit.py``); False for
        datasheet figures and published fits."""
        return bool(self.provenance.get("times_s")) if isinstance(self.provenance, Mapping) else False

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

    def __post_init__(self) -> None:
        check_fields(self, _RANGES, "cluster")

    @property
    def name(self) -> str:
        return f"{self.gpu.name}/{self.intra.name}/{self.inter.name}"

    def to_dict(self) -> dict:
        return {
            "gpu": asdict(self.gpu),
            "intra": asdict(self.intra),
            "inter": asdict(self.inter),
            "gpus_per_node": self.gpus_per_node,
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

# Normal (throughput) kernels and bulk weight copies over NVLink: 40 us typical fixed cost
# (costmodel.md; the low-latency kernels' floor is 18-20 us). RDMA: the 30 us floor for both.
LINKS: dict[str, LinkSpec] = {
    # H100/H200 NVLink 4: 450 GB/s per direction nominal; ~0.6 of it effective for all-to-all
    # (calculon's efficiency; costmodel.md). Latency floor 18-20 us dispatch, 30 us combine, 40 us typical.
    "nvlink4": LinkSpec(
        "nvlink4",
        270 * GB,
        20e-6,
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
        20e-6,
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
        20e-6,
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
    # One 400 Gb/s CX7 NIC per GPU: 50 GB/s nominal. 45 GB/s and 30 us fit DeepEP's low-latency table
    # (EP16..EP256, H800 + CX7) within 10%; costmodel.md: 40-45 GB/s at EP >= 64, latency 30 us (up to 120 us).
    "rdma": LinkSpec(
        "rdma",
        45 * GB,
        30e-6,
        50 * GB,
        "deepseek-ai/DeepEP README low-latency table (H800, CX7 400 Gb/s); costmodel.md",
        (39 * GB, 50 * GB),
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


# The keys a GPU preset file may override: every number of :class:`GpuSpec` (the link is per cluster,
# ``source`` and ``provenance`` are the file's own keys), and its ``name``.
GPU_PRESET_KEYS: tuple[str, ...] = tuple(f.name for f in fields(GpuSpec) if f.type in ("float", float)) + (
    "name",
)


def load_gpu_preset(path: str | Path) -> GpuSpec:
    """Read a GPU preset JSON (as written by ``benchmarks/gpu_gemm_fit.py``).

    Keys: ``base`` (a preset name to start from) and any :class:`GpuSpec` field to override
    (``eta_compute``, ``eta_memory``, ``gemm_overhead``, ...), plus ``provenance`` (the fit's measured
    ``times_s`` there make the preset :attr:`GpuSpec.calibrated`).
    """
    from moe_placement.base.fileio import load_json

    d = load_json(path)
    if not isinstance(d, dict) or "base" not in d:
        raise ValueError(
            f"{path}: a GPU preset must be a JSON object with a 'base' GPU name (one of {HARDWARE_NAMES})"
        )
    base = d["base"].lower() if isinstance(d["base"], str) else d["base"]
    if not isinstance(base, str) or base not in GPUS:
        raise ValueError(f"{path}: unknown base GPU {show(base)}; use one of {HARDWARE_NAMES}")
    allowed = set(GPU_PRESET_KEYS)
    over = {k: d[k] for k in allowed if k in d}
    extra = set(d) - allowed - {"base", "provenance", "source"}
    if extra:
        raise ValueError(f"{path}: unknown GPU preset keys {sorted(extra)}; allowed: {sorted(allowed)}")
    try:
        return replace(
            GPUS[base],
            **over,
            source=d.get("source", f"fitted preset {path}"),
            provenance=d.get("provenance", {}),
        )
    except ValueError as exc:  # the field checks of GpuSpec, named with the file
        raise ValueError(f"{path}: {exc}") from None


def cluster_preset(
    hardware: str = "h200", intra: str | None = None, inter: str | None = None, gpus_per_node: int = 8
) -> ClusterSpec:
    """A cluster from preset names: ``hardware`` a GPU name or a preset JSON path; ``intra`` a link
    name (default: the GPU's NVLink), ``inter`` a link name (default ``rdma``)."""
    hw = str(hardware)
    if hw.lower() in GPUS:
        gpu = GPUS[hw.lower()]
    elif hw.endswith(".json") or Path(hw).is_file():
        gpu = load_gpu_preset(hw)
    else:
        raise ValueError(f"unknown hardware {hardware!r}; use one of {HARDWARE_NAMES} or a preset .json file")

    def link(name: str | None, default: LinkSpec) -> LinkSpec:
        if name is None:
            return default
        if not isinstance(name, str) or name.lower() not in LINKS:
            raise ValueError(f"unknown link {name!r}; use one of {tuple(LINKS)}")
        return LINKS[name.lower()]

    return ClusterSpec(gpu, link(intra, gpu.nvlink), link(inter, LINKS["rdma"]), gpus_per_node)
