"""From the raw timings of ``moe-placement calibrate`` to its summary and its hardware preset (numpy only).

:func:`calibration_report` fits every link and phase (:func:`placement.cost.calibration.fit_link`), the
GEMM (:func:`placement.cost.calibration.fit_gemm`), summarises the launch cost and the spread of the
repeats, decides what the preset may apply, and returns ``(preset, summary)``: the preset is the JSON
:func:`placement.cost.hardware.load_hardware_preset` reads (format in docs/formats.md), the summary
what ``calibrate --json`` prints.

What is applied (priced by ``--hardware PRESET.json``) and what is only recorded:

- a link's figures are applied when it was measured: ``intra`` whenever a node held two ranks or more;
  ``inter`` only when the ranks of different nodes ran on different hosts. On one host the "inter"
  pairs are ranks of different groups on the same machine (loopback TCP under gloo, NVLink or PCIe
  under NCCL), not a network between nodes: their fit is in the summary and the provenance with
  ``applied: false`` and the reason, and inter-node traffic keeps the base preset's ``rdma`` figures;
- DeepEP's fits replace the plain all-to-all's for a link and phase when DeepEP was measured there (the
  kernels the engines run); otherwise ``all_to_all_single`` stands in, and the preset says which;
- GEMM constants are applied only when the GEMM ran on a GPU: a CPU's figures would price a GPU with
  a CPU's speed. A CPU fit is recorded under ``provenance.gemm`` with ``applied: false``.
"""

from __future__ import annotations

import datetime
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from placement.cost.calibration import (
    A2APoint,
    LinkFit,
    fit_gemm,
    fit_link,
    gemm_work,
    routed_traffic,
    spread,
)
from placement.cost.hardware import GPUS, parse_hardware_preset
from placement.cost.modelspec import ModelSpec
from placement.steps import PHASES

__all__ = ["CalibrationSetup", "calibration_report", "guess_base"]


def guess_base(device_name: str) -> str | None:
    """The built-in GPU preset whose name a CUDA device's name holds (``NVIDIA H200`` -> ``h200``), else None."""
    low = device_name.lower()
    return next((name for name in GPUS if name in low), None)


def _point_rows(points: Sequence[A2APoint], seconds: Mapping[str, np.ndarray]) -> list[dict]:
    """One row per timed all-to-all: its sizes, its repeats and their spread."""
    rows, cursor = [], {ph: 0 for ph in PHASES}
    for p in points:
        t = np.asarray(seconds[p.phase])[cursor[p.phase]]
        cursor[p.phase] += 1
        rows.append(
            {
                "kernel": "all_to_all_single",
                "link": p.link,
                "phase": p.phase,
                "op": p.op,
                "step_tokens": p.step_tokens,
                "skew": p.skew,
                "busiest_bytes": p.busiest,
                "mean_recv_bytes": p.mean_recv,
                "seconds": [float(x) for x in t],
                **spread(t),
            }
        )
    return rows


def _deepep_rows(raw: Mapping, model: ModelSpec, gpus_per_node: int) -> list[dict]:
    """One row per DeepEP dispatch and combine timed, bytes priced by the cost model from the picks."""
    rows = []
    for p in raw.get("points", []):
        picks = np.asarray(p["pair_picks"], dtype=np.float64)
        for op, payload in (
            ("dispatch", model.dispatch_bytes_per_token),
            ("combine", model.combine_bytes_per_token),
        ):
            busiest, mean = routed_traffic(
                picks, p["step_tokens"], gpus_per_node, model.top_k, p["phase"], payload, p["link"]
            )
            t = np.asarray(p[f"{op}_s"], dtype=np.float64)
            rows.append(
                {
                    "kernel": "deep_ep",
                    "link": p["link"],
                    "phase": p["phase"],
                    "op": op,
                    "step_tokens": p["step_tokens"],
                    "skew": p["skew"],
                    "busiest_bytes": busiest,
                    "mean_recv_bytes": mean,
                    "seconds": t.tolist(),
                    **spread(t),
                }
            )
    return rows


def _fit_rows(rows: list[dict]) -> LinkFit | None:
    """The link fit of rows of one kernel, link and phase (None under two points)."""
    if len(rows) < 2:
        return None
    groups = {(r["op"], r["step_tokens"]) for r in rows}
    gid = {g: i for i, g in enumerate(sorted(groups))}
    return fit_link(
        np.array([r["busiest_bytes"] for r in rows]),
        np.array([r["mean_recv_bytes"] for r in rows]),
        np.array([r["seconds"] for r in rows]),
        np.array([gid[(r["op"], r["step_tokens"])] for r in rows]),
    )


def _link_fits(rows: list[dict]) -> dict[str, dict[str, dict[str, LinkFit]]]:
    """``{kernel: {link: {phase: LinkFit}}}`` for every kernel, link and phase with two points or more."""
    out: dict = {}
    for kernel, link, phase in sorted({(r["kernel"], r["link"], r["phase"]) for r in rows}):
        fit = _fit_rows([r for r in rows if (r["kernel"], r["link"], r["phase"]) == (kernel, link, phase)])
        if fit is not None:
            out.setdefault(kernel, {}).setdefault(link, {})[phase] = fit
    return out


def _inter_is_network(hosts: Sequence[str], gpus_per_node: int) -> bool:
    """True when every pair of ranks in different nodes ran on different hosts."""
    node = np.arange(len(hosts)) // gpus_per_node
    h = np.asarray(hosts)
    across = node[:, None] != node[None, :]
    return bool(np.all((h[:, None] != h[None, :])[across])) if across.any() else False


def _link_section(fits: Mapping[str, LinkFit], allreduce: Sequence[float] | None, kernel: str) -> dict:
    """A preset link section (LinkSpec fields) from a link's phase fits: decode -> the low-latency
    figures, prefill -> the normal ones (decode's when prefill was not measured, and back)."""
    dec, pre = fits.get("decode") or fits.get("prefill"), fits.get("prefill")
    sec = {"bandwidth": dec.bytes_per_s, "latency": dec.latency_s, "band": [dec.band[0], dec.band[1]]}
    if pre is not None:
        sec.update(normal_bandwidth=pre.bytes_per_s, normal_latency=pre.latency_s)
    if allreduce:
        sec["allreduce_latency"] = float(np.median(allreduce))
    sec["source"] = f"moe-placement calibrate: {kernel}, least squares of time vs the busiest GPU's bytes"
    return sec


def _links(fits: dict, raw: Mapping, measured_on: dict) -> tuple[dict, dict, list[str]]:
    """``(sections to apply, per-link summary, notes)``: DeepEP's fits where measured, else the plain
    all-to-all's; ``inter`` applied only across hosts."""
    sections, summary, notes = {}, {}, []
    for link in ("intra", "inter"):
        kernel = "deep_ep" if link in fits.get("deep_ep", {}) else "all_to_all_single"
        f = fits.get(kernel, {}).get(link)
        if not f:
            continue
        applied, why = True, ""
        if link == "inter" and not measured_on["inter_network"]:
            applied = False
            why = (
                f"one host: the inter pairs are ranks of different groups on {measured_on['hosts'][0]} "
                f"({measured_on['backend']}), not a network between nodes; inter-node traffic keeps the "
                "base preset's rdma figures"
            )
            notes.append(f"inter not applied: {why}")
        if applied:
            sections[link] = _link_section(f, (raw.get("allreduce") or {}).get(link), kernel)
        summary[link] = {
            "kernel": kernel,
            "applied": applied,
            "why": why,
            **{ph: fit.to_dict() for ph, fit in f.items()},
        }
    return sections, summary, notes


def _gemm(raw: Mapping, base: str) -> tuple[dict, dict]:
    """``(top-level GpuSpec overrides, provenance entry)`` of the GEMM: overrides only on a GPU."""
    g, dev = raw.get("gemm"), raw.get("device", {})
    if not g:
        return {}, {"skipped": "not timed"}
    tokens = [n for ph in g["phases"].values() for n in ph["tokens"]]
    times = [t for ph in g["phases"].values() for t in ph["seconds"]]
    entry = {"device": dev.get("name", "?"), "device_type": dev.get("type", "?"), **g}
    if len(times) < 3:
        return {}, {**entry, "applied": False, "why": "fewer than 3 shapes timed: no fit"}
    F, M = gemm_work(g["hidden"], g["inter"], g["experts"], np.array(tokens), g["weight_bytes"])
    fit = fit_gemm(F, M, np.array(times))
    entry["fit"] = {
        "flops_per_s": fit.flops_per_s,
        "bytes_per_s": fit.bytes_per_s,
        "overhead_us": fit.overhead_s * 1e6,
        "rms_log_error": fit.rms_log_error,
    }
    if dev.get("type") != "cuda":
        why = "timed on a CPU: these are not a GPU's figures; the preset keeps the base GPU's GEMM constants"
        return {}, {**entry, "applied": False, "why": why}
    gpu = GPUS[base]
    eta_c = fit.flops_per_s / gpu.peak_flops(g["weight_bytes"]) if fit.flops_per_s else gpu.eta_compute
    eta_m = fit.bytes_per_s / gpu.hbm_bandwidth if fit.bytes_per_s else gpu.eta_memory
    over = {
        "eta_compute": float(np.clip(eta_c, 0.01, 1.0)),
        "eta_memory": float(np.clip(eta_m, 0.01, 1.0)),
        "gemm_overhead": float(min(fit.overhead_s, 1.0)),
    }
    entry["applied"] = True
    return over, entry


def _launch(raw: Mapping) -> dict:
    got = raw.get("launch") or {"skipped": "not timed"}
    if "skipped" in got:
        return got
    return {
        "kernels": got["kernels"],
        "graph_kernel_us": {
            k: v * 1e6 for k, v in spread(got["graph_kernel_s"]).items() if k != "rel_spread"
        },
        "eager_kernel_us": {
            k: v * 1e6 for k, v in spread(got["eager_kernel_s"]).items() if k != "rel_spread"
        },
    }


def _measured_on(raw: Mapping, model: ModelSpec, setup: CalibrationSetup) -> dict:
    hosts = list(raw.get("hosts", []))
    return {
        "backend": setup.backend,
        "a2a_device": "cuda" if setup.backend == "nccl" else "cpu",
        "ranks": setup.ranks,
        "gpus_per_node": setup.gpus_per_node,
        "nodes": setup.ranks // setup.gpus_per_node,
        "hosts": sorted(set(hosts)),
        "inter_network": _inter_is_network(hosts, setup.gpus_per_node) if hosts else False,
        "device": raw.get("device", {}).get("name", "?"),
        "model": model.name,
        "quick": setup.quick,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(),
    }


def _phase_summary(links: dict) -> dict:
    """``a2a: {decode: {...}, prefill: {...}}``: each phase's figures of the link that prices the
    deployment (inter when applied, else intra, else the unapplied inter), with every link beside."""
    out = {}
    for phase in PHASES:
        order = [k for k in ("inter", "intra") if links.get(k, {}).get("applied")] + [
            k for k in ("intra", "inter") if k in links and not links[k].get("applied")
        ]
        name = next((k for k in order if phase in links[k]), None)
        if name is None:
            continue
        pick = links[name][phase]
        out[phase] = {
            **{k: pick[k] for k in ("latency_us", "bytes_per_s", "skew_slope", "skew_r2", "mean_r2")},
            "link": name,
            "kernel": links[name]["kernel"],
            "applied": links[name]["applied"],
            "links": {k: v[phase] for k, v in links.items() if phase in v},
        }
    return out


@dataclass(frozen=True)
class CalibrationSetup:
    """How a calibration ran: ``ranks`` over ``backend`` in nodes of ``gpus_per_node``, ``quick`` sweep or
    not, the ``base`` GPU preset its figures override, the ``command`` (the preset's ``source``)."""

    ranks: int
    gpus_per_node: int
    backend: str
    quick: bool
    base: str
    command: str = ""


def calibration_report(
    raw: Mapping,
    points: Sequence[A2APoint],
    model: ModelSpec,
    setup: CalibrationSetup,
    notes: Sequence[str] = (),
) -> tuple[dict, dict]:
    """``(preset, summary)`` from rank 0's raw results (:func:`runtime_hooks.calibrate.calibrate_worker`).

    The preset is checked by :func:`placement.cost.hardware.parse_hardware_preset` before it is returned
    (a figure out of range is a ValueError here, never a file that does not load).
    """
    base, command, gpus_per_node = setup.base, setup.command, setup.gpus_per_node
    if base not in GPUS:
        raise ValueError(f"unknown base GPU {base!r}; use one of {tuple(GPUS)}")
    rows = _point_rows(points, raw["a2a"]) + _deepep_rows(raw.get("deep_ep") or {}, model, gpus_per_node)
    measured_on = _measured_on(raw, model, setup)
    sections, links, link_notes = _links(_link_fits(rows), raw, measured_on)
    gemm_over, gemm = _gemm(raw, base)
    launch = _launch(raw)
    measured = [f"a2a_{k}" for k in ("intra", "inter") if k in sections]
    measured += ["gemm"] * bool(gemm_over) + ["launch"] * ("skipped" not in launch)
    rel = {f"{r['kernel']}/{r['link']}/{r['phase']}": [] for r in rows}
    for r in rows:
        rel[f"{r['kernel']}/{r['link']}/{r['phase']}"].append(r["rel_spread"])
    spreads = {
        k: {"median_rel_spread": float(np.median(v)), "max_rel_spread": float(np.max(v))}
        for k, v in rel.items()
    }
    deep_ep = raw.get("deep_ep") or {"skipped": "not run"}
    provenance = {
        "measured": measured,
        "measured_on": measured_on,
        "versions": raw.get("versions", {}),
        "a2a": _phase_summary(links),
        "allreduce": _allreduce(raw),
        "gemm": gemm,
        "launch": launch,
        "deep_ep": {"skipped": deep_ep["skipped"]} if "skipped" in deep_ep else {"measured": True},
        "spread": spreads,
        "samples": rows,
        "notes": [*notes, *link_notes],
        "command": command,
    }
    name = f"{base}-calibrated"
    preset = {
        "base": base,
        "name": name,
        "source": command or "moe-placement calibrate",
        **gemm_over,
        **sections,
        "provenance": provenance,
    }
    parse_hardware_preset(preset, "the calibrated preset")
    keys = (
        "a2a",
        "gemm",
        "launch",
        "deep_ep",
        "allreduce",
        "measured",
        "measured_on",
        "versions",
        "spread",
        "notes",
    )
    summary = {k: provenance[k] for k in keys}
    summary["a2a_links"] = links
    summary["seconds"] = raw.get("seconds")
    return preset, summary


def _allreduce(raw: Mapping) -> dict:
    """The small all-reduce's spread (seconds) per link measured."""
    ar = raw.get("allreduce") or {}
    return {k: spread(ar[k]) for k in ("intra", "inter") if ar.get(k)}
