"""Ranges until calibrated: every modelled time and gain on each constant set the published tables allow.

The all-to-all constants (latency and bandwidth per link and kernel) are fitted to published DeepEP
figures, measured on other clusters at other message sizes. Several constant sets reproduce those
figures about equally well and disagree elsewhere (at small messages a higher latency with a higher
bandwidth fits as well as a lower latency with a lower one), so until the user's cluster is measured
a modelled figure is the range of what those sets give.

The fit (``benchmarks/step_model_check.py``, :func:`derive_sets` there; ``tests/test_ranges.py``
re-derives the sets below from the published tables and asserts they are these):

- data: DeepEP's low-latency table (H800 + CX7, EP8-EP256, "legacy"), the NVLink-era low-latency
  figures (H20, EP16-EP64) and the normal-kernel table (EP32/EP64), all uniform routing, priced with
  the model's own accounting (:func:`placement.cost.traffic.traffic_bytes`: intra-node bytes over
  NVLink, inter-node bytes over RDMA, the busiest GPU's; :func:`placement.cost.primitives.a2a_time`);
- grid (:data:`GRID_STEPS`): latency :data:`LATENCY_PRIOR` (18 us, the best NVLink kernels' floor,
  to 120 us, the sensitivity ceiling of costmodel.md) by 0.5 us; bandwidth
  :data:`BANDWIDTH_FLOOR` (20 GB/s) to the link's nominal figure by 0.25 GB/s (no kernel beats the wire);
- kept: the points that reproduce every figure of every table within :data:`FIT_TOLERANCE` (10%);
- sets: the two ends of the kept region along the latency-bandwidth trade-off the tables leave open,
  ``low`` = the least kept latency with the least bandwidth kept there, ``high`` = the largest kept
  latency with the largest bandwidth kept there; ``central`` = the preset's own figures in
  :mod:`placement.cost.hardware` (RDMA low-latency: the best fit to the NVLink-era table, whose
  accounting, intra-node over NVLink, is the model's; normal kernels: its latency, best bandwidth;
  NVLink low-latency latency: the best fit to the legacy EP8 row at the link's bandwidth).

Fitted links: the ``rdma`` preset (low-latency and normal kernels) and the low-latency latency of
every GPU's NVLink preset. Any other link (PCIe, Ethernet, a custom one) spans its documented
effective-bandwidth ``band`` at its own latency. GPU constants (GEMM efficiencies) are the same in
every set. A measured cluster (:func:`placement.cost.hardware.hardware_summary`) has one set, its
own.

API (every caller that reports a modelled figure uses these; gains are never combined from
constants, they are evaluated on each set, since a gain is not monotone in them):

- :func:`cluster_sets`: ``{"low", "central", "high"}`` -> :class:`ClusterSpec` (measured: central only);
- :func:`set_values`: ``fn(cluster_set)`` on every set;
- :func:`value_range`: :class:`Range3` ``(low, central, high)`` of ``fn`` over the sets, with
  ``low <= central <= high`` by construction;
- :func:`gain_range`: the range of ``baseline / option - 1`` taken set by set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import NamedTuple

from placement.cost.hardware import GPUS, LINKS, ClusterSpec, LinkSpec, hardware_summary

__all__ = [
    "BANDWIDTH_FLOOR",
    "FIT_TOLERANCE",
    "GRID_STEPS",
    "LATENCY_PRIOR",
    "NVLINK_LOW_LATENCY_LATENCY",
    "RDMA_LOW_LATENCY",
    "RDMA_NORMAL",
    "SET_NAMES",
    "Range3",
    "cluster_sets",
    "gain_range",
    "is_measured",
    "set_values",
    "value_range",
]

GB = 1e9
FIT_TOLERANCE = 0.10  # largest relative error a kept constant set makes on any published figure
LATENCY_PRIOR = (18e-6, 120e-6)  # seconds: the fit's latency grid (costmodel.md's floor and ceiling)
BANDWIDTH_FLOOR = 20e9  # bytes/s: the fit's least bandwidth (up to each link's nominal figure)
GRID_STEPS = (0.5e-6, 0.25e9)  # the fit grid's latency (s) and bandwidth (bytes/s) steps
SET_NAMES = ("low", "central", "high")

# (latency s, bandwidth bytes/s) of the ends of the kept sets (the central set is the preset itself).
# RDMA low-latency kernels: legacy table EP16-EP256 and NVLink-era EP16-EP64 (16 figures).
RDMA_LOW_LATENCY: dict[str, tuple[float, float]] = {
    "low": (18.0e-6, 39.25 * GB),
    "high": (52.5e-6, 49.0 * GB),
}
# RDMA normal kernels: the normal-kernel table (6 figures, messages of 80-320 MB: the latency is free).
RDMA_NORMAL: dict[str, tuple[float, float]] = {"low": (18.0e-6, 42.0 * GB), "high": (120.0e-6, 49.25 * GB)}
# NVLink low-latency kernels' latency, seconds, at each link's own bandwidth: legacy EP8 (2 figures).
NVLINK_LOW_LATENCY_LATENCY: dict[str, float] = {"low": 27.0e-6, "high": 41.5e-6}


class Range3(NamedTuple):
    """A modelled figure's ``low`` and ``high`` over the constant sets and its ``central`` value."""

    low: float
    central: float
    high: float

    def span(self) -> list[float]:
        """``[low, high]``, as JSON reports carry it (``X_range``)."""
        return [float(self.low), float(self.high)]

    @classmethod
    def of(cls, values: Mapping[str, float]) -> Range3:
        """From one value per set (``central`` required): min, central, max."""
        if "central" not in values:
            raise ValueError(f"a range needs the central set's value, got sets {sorted(values)}")
        v = [float(x) for x in values.values()]
        return cls(min(v), float(values["central"]), max(v))


def is_measured(cluster: ClusterSpec) -> bool:
    """True when the cluster's figures were measured on it (then it is its own only set)."""
    return bool(hardware_summary(cluster)["measured"])


def _banded(link: LinkSpec, end: str) -> LinkSpec:
    """A link without a fit: the low or high end of its documented effective bandwidth, its latency
    unchanged (normal-kernel bandwidth scaled alike); itself when it documents no band."""
    lo, hi = link.band
    if not 0 < lo <= hi:
        return link
    bw = lo if end == "low" else hi
    normal = None if link.normal_bandwidth is None else link.normal_bandwidth * bw / link.bandwidth
    return replace(link, bandwidth=bw, normal_bandwidth=normal)


def _inter(link: LinkSpec, end: str) -> LinkSpec:
    if link != LINKS["rdma"]:
        return _banded(link, end)
    (lat, bw), (n_lat, n_bw) = RDMA_LOW_LATENCY[end], RDMA_NORMAL[end]
    return replace(link, latency=lat, bandwidth=bw, normal_latency=n_lat, normal_bandwidth=n_bw)


def _intra(link: LinkSpec, end: str) -> LinkSpec:
    if link not in {g.nvlink for g in GPUS.values()}:
        return _banded(link, end)
    return replace(link, latency=NVLINK_LOW_LATENCY_LATENCY[end])


def cluster_sets(cluster: ClusterSpec) -> dict[str, ClusterSpec]:
    """The constant sets a modelled figure is evaluated on: ``{"low", "central", "high"}`` for a cluster
    priced from published figures (module docstring; ``central`` is ``cluster`` itself), ``{"central":
    cluster}`` for a measured one."""
    if not isinstance(cluster, ClusterSpec):
        raise ValueError(
            f"cluster must be a ClusterSpec (placement.cost.hardware.cluster_preset), got {cluster!r}"
        )
    if is_measured(cluster):
        return {"central": cluster}
    out = {}
    for end in SET_NAMES:
        if end == "central":
            out[end] = cluster
        else:
            out[end] = replace(cluster, intra=_intra(cluster.intra, end), inter=_inter(cluster.inter, end))
    return out


def set_values(fn: Callable[[ClusterSpec], float], cluster: ClusterSpec) -> dict[str, float]:
    """``{set name: fn(cluster set)}`` over :func:`cluster_sets`."""
    return {name: float(fn(c)) for name, c in cluster_sets(cluster).items()}


def value_range(fn: Callable[[ClusterSpec], float], cluster: ClusterSpec) -> Range3:
    """:class:`Range3` of ``fn`` evaluated on every constant set of ``cluster`` (min, central, max)."""
    return Range3.of(set_values(fn, cluster))


def gain_range(baseline: Mapping[str, float], option: Mapping[str, float]) -> Range3:
    """The range of the gain ``baseline / option - 1`` (times, e.g. whole-step ms, per set) taken set by
    set: both mappings from :func:`set_values` on the same cluster."""
    if set(baseline) != set(option):
        raise ValueError(
            f"baseline and option were priced on different sets: {sorted(baseline)} vs {sorted(option)}"
        )
    return Range3.of({k: baseline[k] / option[k] - 1.0 if option[k] > 0 else 0.0 for k in baseline})
