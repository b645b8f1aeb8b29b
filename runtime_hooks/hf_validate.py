"""Validate a placement on a real Hugging Face MoE model over ``G`` launched ranks.

Every rank loads the same model (a checkpoint folder, or a config with seeded random weights), computes
the single-process logits of the whole batch, applies the placement with
:func:`runtime_hooks.hf.apply_placement_to_model`, runs its own ``B`` prompts (attention data-parallel:
rank ``r`` owns prompts ``[r*B, (r+1)*B)``) and compares. The parent then replays the top-k ids the ranks saw
through :func:`placement.metrics.route_tokens` and compares the picks per slot with those computed;
under ``balanced`` (one experts call of a layer is one step) the prediction is the model's numpy
``step_load`` (:func:`placement.step_balance.balanced_quotas`) of each call's counts over all ranks, and
the report gives the median time and the bytes of the counts all-gather per layer call.

Public API::

    report = validate_hf(HFCase(source, placement, seed=0))   # -> HFValidationReport (even dispatch)
    report.max_abs_diff, report.tokens_match, report.expert_bytes_per_rank, report.to_dict()
    describe_model(source) -> ModelInfo   # class, MoE layer ids, experts (meta device, no weights)
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from placement.dispatch import EVEN, get_dispatch
from placement.metrics import route_tokens
from placement.model import Placement

__all__ = [
    "HFValidationReport",
    "ModelInfo",
    "HFCase",
    "describe_model",
    "load_model",
    "predicted_slot_tokens",
    "validate_hf",
    "validate_many",
]

_WEIGHT_FILES = ("*.safetensors", "*.bin")
_MAX_CONFIG_BYTES = 64 * 1024**2  # a config.json is kilobytes; refuse anything near this before parsing


# ---------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------
def _config(source):
    """A transformers config from a config object, a ``config.json`` file or a folder holding one.

    Files are decoded by transformers itself (``AutoConfig.from_pretrained``), as for a folder: the
    ``{"__float__": "Infinity"}`` tags it writes for infinities and NaNs come back as floats.
    """
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from moe_placement.base.fileio import load_json
    from placement.cost.modelspec import check_hf_config_fits

    if isinstance(source, PretrainedConfig):
        return source
    path = Path(source)
    if not path.exists():
        raise ValueError(f"--model {path}: no such checkpoint folder or config.json")
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"--model {path}: the folder holds no config.json; pass a checkpoint folder")
    doc = load_json(file, max_bytes=_MAX_CONFIG_BYTES)
    if not isinstance(doc, dict) or "model_type" not in doc:
        raise ValueError(f"--model {file}: a transformers config.json needs a 'model_type' field")
    model_type = doc["model_type"]
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"--model {file}: model_type {model_type!r} is unknown to transformers "
            f"{_transformers_version()}; upgrade transformers or fix the config"
        )
    # sizes, and weights (2 bytes each at least) against the memory available, before anything is built
    check_hf_config_fits(doc, f"--model {file}", bytes_per_weight=2.0)
    try:
        return AutoConfig.from_pretrained(str(path))
    except _config_errors() as exc:
        why = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ValueError(f"--model {file}: transformers refuses this {model_type} config ({why})") from None


def _config_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises for a config it refuses (its strict dataclass checks are no ValueError)."""
    from huggingface_hub.errors import StrictDataclassError

    return (ValueError, TypeError, KeyError, OSError, StrictDataclassError)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _lm_route(cfg):
    """``(auto class, config, part)``: how to build the model that maps ``input_ids`` to logits.

    Decoder LMs build with ``AutoModelForCausalLM``; vision-language MoE models (Qwen3-VL-MoE,
    GLM-4.1V-MoE, ...) with ``AutoModelForImageTextToText`` and are run on text prompts only (their text
    decoders use the experts interface); an omni model (Qwen3-Omni-MoE) through the sub-model that
    generates text (``part``: its config attribute, e.g. ``thinker_config``; ``""`` for the whole model).

    Raises:
        ValueError: none of these fits (one line naming the class and what is supported).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )

    routes = (
        (AutoModelForCausalLM, MODEL_FOR_CAUSAL_LM_MAPPING),
        (AutoModelForImageTextToText, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING),
    )
    for part, sub in (
        ("", cfg),
        *((k, getattr(cfg, k, None)) for k in getattr(cfg, "sub_configs", {}) or {}),
    ):
        for auto, mapping in routes:
            if sub is not None and type(sub) in mapping:
                return auto, sub, part
    raise ValueError(
        f"{type(cfg).__name__} (model_type {cfg.model_type!r}) has no causal-LM or image-text-to-text "
        f"class in transformers; moe-placement serves decoder MoE LMs and the text decoder of "
        f"vision-language / omni MoE models"
    )


def _has_weights(source) -> bool:
    path = Path(source) if isinstance(source, (str, Path)) else None
    return path is not None and path.is_dir() and any(any(path.glob(p)) for p in _WEIGHT_FILES)


def load_model(source, seed: int = 0, dtype: str = "float32"):
    """The text-generating model in eval mode (see :func:`_lm_route`): checkpoint weights when
    ``source`` is a folder holding them, otherwise random weights from the config drawn after
    ``torch.manual_seed(seed)`` (identical in every process)."""
    import torch

    torch_dtype = getattr(torch, dtype)
    auto, cfg, part = _lm_route(_config(source))
    if _has_weights(source):
        if part:
            raise ValueError(
                f"--model {source}: serving the {part.removesuffix('_config')} of a checkpoint is not "
                f"supported; pass its config.json (random weights) instead"
            )
        model = auto.from_pretrained(str(source), dtype=torch_dtype)
    else:
        torch.manual_seed(int(seed))
        cfg = copy.deepcopy(cfg)  # the model switches its config's experts implementation
        model = auto.from_config(cfg).to(torch_dtype)
    return model.eval()


@dataclass(frozen=True)
class ModelInfo:
    """What a placement must fit: ``model_class``, MoE ``layer_ids``, ``num_experts``, ``top_k``, ``vocab_size``."""

    model_class: str
    layer_ids: tuple[int, ...]
    num_experts: int
    vocab_size: int


def describe_model(source) -> ModelInfo:
    """Build the model on the meta device (no memory, no weights read) and list its MoE layers.

    Raises:
        ValueError: unreadable source, or a class whose experts do not use the experts interface.
    """
    import torch

    from runtime_hooks.hf import moe_experts

    auto, cfg, _ = _lm_route(_config(source))
    with torch.device("meta"):
        model = auto.from_config(cfg)
    experts = moe_experts(model)
    num_experts = max(int(getattr(m, "num_experts", 0)) for m in experts.values())
    vocab = int(getattr(cfg.get_text_config(), "vocab_size", 0) or 0)
    return ModelInfo(type(model).__name__, tuple(experts), num_experts, vocab)


# ---------------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HFValidationReport:
    """Result of :func:`validate_hf`.

    ``predicted`` / ``measured``: int64 ``[L, P]`` picks per physical slot (MoE layers in model order);
    ``max_abs_diff_per_rank``: ``[G]`` max |logits - single-process logits|.
    """

    model_class: str
    ranks: int
    dispatch: str
    dtype: str
    layer_ids: tuple[int, ...]
    rows: tuple[int, ...]
    max_abs_diff: float
    max_abs_diff_per_rank: tuple[float, ...]
    predicted: np.ndarray
    measured: np.ndarray
    expert_bytes_per_rank: tuple[dict, ...]
    atol: float
    wall_seconds: float
    balanced_collective_us_per_layer: tuple[float, ...] | None = None
    balanced_collective_bytes_per_layer: int | None = None

    @property
    def tokens_match(self) -> bool:
        return bool(np.array_equal(self.predicted, self.measured))

    @property
    def ok(self) -> bool:
        within = self.max_abs_diff <= self.atol or self.dtype != "float32"
        return self.tokens_match and within

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["predicted"] = self.predicted.tolist()
        d["measured"] = self.measured.tolist()
        d["tokens_match"] = self.tokens_match
        d["ok"] = self.ok
        return d


@dataclass(frozen=True)
class _Job:
    """What every rank needs (pickled to each)."""

    source: Any
    placement: Placement
    dispatch: str
    seed: int
    prompts_per_rank: int
    seq_len: int
    vocab_size: int
    dtype: str
    rows: tuple[int, ...]


def _inputs(job: _Job, ranks: int):
    """int64 ``[G*B, seq_len]`` seeded prompts, the same in every process."""
    import torch

    g = torch.Generator().manual_seed(int(job.seed) + 17)
    return torch.randint(0, job.vocab_size, (ranks * job.prompts_per_rank, job.seq_len), generator=g)


def _validate_worker(rank: int, ranks: int, jobs: list[_Job]) -> list[dict]:
    """Per-rank body, for each job: reference logits, apply, own prompts through the sharded model."""
    return [_validate_job(rank, ranks, job) for job in jobs]


def _validate_job(rank: int, ranks: int, job: _Job) -> dict:
    """One model: single-process logits of the whole batch, then this rank's prompts sharded; compare."""
    import torch

    from runtime_hooks.hf import (
        apply_placement_to_model,
        balanced_collective,
        recorded_ids,
        slot_token_counts,
    )
    from runtime_hooks.validate import TIMING_REPEATS

    model = load_model(job.source, job.seed, job.dtype)
    ids = _inputs(job, ranks)  # [G*B, seq]
    B = job.prompts_per_rank
    with torch.no_grad():
        ref = model(ids).logits[rank * B : (rank + 1) * B].float()  # [B, seq, V] single process
        applied = apply_placement_to_model(
            model, job.placement, dispatch=job.dispatch, record=True, rows=list(job.rows)
        )
        out = model(ids[rank * B : (rank + 1) * B]).logits.float()  # [B, seq, V] sharded
    diff = float((out - ref).abs().max()) if out.numel() else 0.0
    return {
        "collective": balanced_collective(model, repeats=TIMING_REPEATS),
        "diff": diff,
        "counts": slot_token_counts(model),
        "ids": recorded_ids(model),
        "applied": asdict(applied),
    }


def predicted_slot_tokens(
    rows: Placement, per_rank_ids: list[list[list[np.ndarray]]], dispatch: str
) -> np.ndarray:
    """int64 ``[L, P]`` picks per slot that :func:`placement.metrics.route_tokens` predicts.

    Args:
        rows: the placement rows serving the model's MoE layers, in model order (``L`` rows).
        per_rank_ids: ``[rank][layer][call]`` int ``[T, K]`` top-k ids each rank saw in each call; the
            global token order is call by call, rank by rank (as :mod:`runtime_hooks.hf` numbers them).
    """
    L, P = rows.num_layers, rows.num_physical_experts
    if get_dispatch(dispatch).needs_step_counts:
        return _predicted_step_tokens(rows, per_rank_ids, dispatch)
    pred = np.zeros((L, P), dtype=np.int64)
    for l in range(L):
        calls = len(per_rank_ids[0][l])
        parts = [(r, per_rank_ids[r][l][c]) for c in range(calls) for r in range(len(per_rank_ids))]
        if not parts:
            continue
        ids = np.concatenate([a for _, a in parts])[:, None, :]  # [T, 1, K]
        src = np.concatenate([np.full(len(a), r, dtype=np.int64) for r, a in parts])  # [T]
        slots = route_tokens(rows.select_layers([l]), ids, src, dispatch)  # [T, 1, K]
        flat = slots.reshape(-1)
        pred[l] = np.bincount(flat[flat >= 0], minlength=P)
    return pred


def _predicted_step_tokens(rows: Placement, per_rank_ids, dispatch: str) -> np.ndarray:
    """int64 ``[L, P]``: a step-counts model's numpy ``step_load`` of each call's counts (all ranks)."""
    from runtime_hooks.step_dispatch import quota_slot_tokens

    E = rows.num_logical_experts
    out = []
    for l in range(rows.num_layers):
        calls = len(per_rank_ids[0][l])
        counts = np.zeros((calls, E), dtype=np.int64)  # [calls, E] valid picks of every rank per call
        for ids in per_rank_ids:
            for c in range(calls):
                a = ids[l][c]
                counts[c] += np.bincount(a[a >= 0], minlength=E)
        out.append(quota_slot_tokens(rows.select_layers([l]), counts, dispatch).sum(axis=0))
    return np.stack(out)


@dataclass(frozen=True)
class HFCase:
    """One model to validate: ``source`` (checkpoint folder, ``config.json`` path or config object),
    ``placement`` (rows for its MoE layers), ``dispatch`` (a runtime model), ``seed``, prompts, dtype
    and ``rows``: explicit placement row per MoE layer (``--layers``; None: see
    :func:`runtime_hooks.hf.match_layers`)."""

    source: Any
    placement: Placement
    dispatch: str = EVEN.name
    seed: int = 0
    prompts_per_rank: int = 2
    seq_len: int = 8
    dtype: str = "float32"
    rows: tuple[int, ...] | None = None


def validate_hf(
    case: HFCase, backend: str = "gloo", timeout: float = 300.0, atol: float = 1e-5
) -> HFValidationReport:
    """Launch ``placement.topology.ep_size`` ranks, run the model sharded, compare with one process."""
    return validate_many([case], backend=backend, timeout=timeout, atol=atol)[0]


def validate_many(
    cases: list[HFCase], backend: str = "gloo", timeout: float = 300.0, atol: float = 1e-5
) -> list[HFValidationReport]:
    """Validate several models in one launch (all placements must have the same ``ep_size``).

    Every placement is checked against its model before launching: ValueError naming the numbers.
    """
    from runtime_hooks.ep_layer import runtime_dispatch
    from runtime_hooks.hf import match_layers
    from runtime_hooks.launcher import launch

    if not cases:
        return []
    sizes = {c.placement.topology.ep_size for c in cases}
    if len(sizes) != 1:
        raise ValueError(f"one launch needs one ep_size, the placements have {sorted(sizes)}")
    for c in cases:
        runtime_dispatch(c.dispatch)
    infos = [describe_model(c.source) for c in cases]
    rows = [match_layers(c.placement, list(i.layer_ids), i.num_experts, c.rows) for c, i in zip(cases, infos)]
    jobs = [
        _Job(
            c.source,
            c.placement,
            c.dispatch,
            int(c.seed),
            int(c.prompts_per_rank),
            int(c.seq_len),
            i.vocab_size,
            c.dtype,
            tuple(r),
        )
        for c, i, r in zip(cases, infos, rows)
    ]
    t0 = time.perf_counter()
    results = launch(_validate_worker, sizes.pop(), args=(jobs,), backend=backend, timeout=timeout)
    wall = (time.perf_counter() - t0) / len(cases)
    return [
        _report(c, i, r, [res[j] for res in results], atol, wall)
        for j, (c, i, r) in enumerate(zip(cases, infos, rows))
    ]


def _report(case: HFCase, info: ModelInfo, rows: list[int], results: list[dict], atol: float, wall: float):
    """Assemble the per-rank results of one case into an :class:`HFValidationReport`."""
    from runtime_hooks.hf import served_placement

    served = served_placement(case.placement, rows, list(info.layer_ids))  # [L, P]
    measured = np.concatenate([r["counts"] for r in results], axis=1)  # [L, G*S] = [L, P]
    diffs = tuple(float(r["diff"]) for r in results)
    bytes_per_rank = tuple(
        {"before": r["applied"]["expert_bytes_before"], "after": r["applied"]["expert_bytes_after"]}
        for r in results
    )
    return HFValidationReport(
        model_class=info.model_class,
        ranks=len(results),
        dispatch=case.dispatch,
        dtype=case.dtype,
        layer_ids=info.layer_ids,
        rows=tuple(rows),
        max_abs_diff=max(diffs),
        max_abs_diff_per_rank=diffs,
        predicted=predicted_slot_tokens(served, [r["ids"] for r in results], case.dispatch),
        measured=measured,
        expert_bytes_per_rank=bytes_per_rank,
        atol=float(atol),
        wall_seconds=wall,
        **_collective_fields(results),
    )


def _collective_fields(results: list[dict]) -> dict:
    """The report's ``balanced_collective_*`` fields from the ranks' readings (slowest rank per layer)."""
    if results[0]["collective"] is None:
        return {}
    us = np.array([r["collective"][0] for r in results], dtype=np.float64).max(axis=0)  # [L]
    return {
        "balanced_collective_us_per_layer": tuple(float(u) for u in us),
        "balanced_collective_bytes_per_layer": int(results[0]["collective"][1]),
    }
