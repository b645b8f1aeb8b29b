"""What ``advise`` is asked: the frozen :class:`AdviseOptions`, the engines it knows (read from the
dispatch registry), and which model the cost side uses for a trace.

Shapes: L MoE layers, E logical experts, G EP ranks (GPUs), r redundant slots per GPU.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace

from moe_placement.apps.advise.engines import default_prefill_chunk
from moe_placement.base.limits import MAX_FIT_STEPS, check_whole
from moe_placement.base.options import refuse_unknown_keywords
from placement.cost.modelspec import BUILTIN_MODELS, ModelSpec, load_model
from placement.dispatch import DISPATCH, DispatchModel
from placement.steps import DEFAULT_STEP_TOKENS
from placement.steps import PHASES as STEP_PHASES
from profiling.trace import RoutingTrace

__all__ = [
    "AUTO_MODEL",
    "DEFAULT_MIN_GAIN",
    "FIT_HALVES",
    "KNOBS",
    "KNOB_FLAGS",
    "OVERLAP",
    "AdviseOptions",
    "engine_dispatches",
    "engine_flag_value",
    "engine_names",
    "knob_value",
    "resolve_model",
    "runtime_step_dispatches",
    "with_knob",
]

AUTO_MODEL = "auto"
FIT_HALVES = ("first", "second")  # the half of the trace placements are fitted on; the other is held out
OVERLAP = ("off", "on")  # two-batch overlap; off is the engines' default
DEFAULT_CONTEXT_LEN = 4096  # cached tokens per decode sequence when the user gives none
DEFAULT_MIN_GAIN = 0.01  # 1% of the whole step, at the low end of the gain's range less its band
# The knobs of the deployment a sweep varies unless the user pinned them (AdviseOptions fields), with
# the CLI flag that sets each.
KNOB_FLAGS = {
    "decode_step_tokens": "--decode-batch",
    "context_len": "--context-len",
    "prefill_step_tokens": "--prefill-chunk",
    "overlap": "--overlap",
}
KNOBS = tuple(KNOB_FLAGS)
_FLAG_RE = re.compile(r"--ep-dispatch-algorithm (\w+)")


def engine_names() -> tuple[str, ...]:
    """Engines with a registered dispatch model, lower case (``sglang``, ``vllm``), registry order."""
    out: list[str] = []
    for m in DISPATCH.values():
        if m.engine and m.engine.lower() not in out:
            out.append(m.engine.lower())
    return tuple(out)


def engine_dispatches(engine: str) -> tuple[DispatchModel, ...]:
    """The dispatch models of ``engine`` (its EPLB options), in registry order."""
    return tuple(m for m in DISPATCH.values() if m.engine.lower() == engine.lower())


def runtime_step_dispatches() -> tuple[DispatchModel, ...]:
    """Per-step models our own runtime executes (``balanced`` when registered): no engine runs them."""
    return tuple(m for m in DISPATCH.values() if not m.engine and m.runtime and m.needs_step_counts)


def engine_flag_value(model: DispatchModel) -> str | None:
    """The value of SGLang's ``--ep-dispatch-algorithm`` a model stands for (read from its ``models``)."""
    hit = _FLAG_RE.search(model.models)
    return hit.group(1) if hit else None


@refuse_unknown_keywords
@dataclass(frozen=True)
class AdviseOptions:
    """Every knob of one advice run.

    Attributes:
        engine: one of :func:`engine_names` (``sglang``, ``vllm``).
        nodes / gpus_per_node: the cluster; ``G = nodes x gpus_per_node`` EP ranks.
        decode_step_tokens: decode ``step_tokens``: sequences in flight per rank (also the memory check);
            None: :data:`placement.steps.DEFAULT_STEP_TOKENS` of decode, not pinned.
        prefill_step_tokens: prefill ``step_tokens``: tokens per rank per chunk (capped by the held-out
            tokens); None: the engine's own default for the printed command
            (:func:`moe_placement.apps.advise.engines.default_prefill_chunk`), not pinned.
        redundant_per_gpu: the redundant slots per GPU compared (``r``).
        context_len: cached tokens per decode sequence (attention and the memory check); None: 4096,
            not pinned.
        overlap: two-batch overlap ``"on"`` (the command turns it on, and it is priced) or ``"off"``;
            None: off (the engines' default), not pinned.
        min_gain: the least net whole-step gain (fraction) worth a change, judged at the low end of the
            gain's range less its band; below it the advice is no balancing (keep what you run).
        pinned: the knobs (:data:`KNOBS`) the user set, which the sensitivity sweep leaves alone; None:
            those given above (not None).
        stability: run the decision-stability checks (the swapped split, a bootstrap over blocks of
            held-out prompts, the sweep over the knobs not pinned).
        windows: windows the drift is measured over (window ``i`` fit, ``i + 1`` scored).
        solver: our solver (``greedy`` keeps the advice deterministic; the pipeline fits it for
            table dispatch models).
        fit_steps / fit_dealings: the pipeline's fit step budget (:class:`solver.api.FitOptions`).
        quick: fewer prompts (``quick_prompts``), fewer options and fit budget; for notebooks and tests.
        strict: refuse (ValueError) where the advice would only warn (too few held-out steps).
        min_held_out_steps: held-out steps per phase below which the figures are warned about.
        rebalance_margin: out-of-sample whole-step gain a periodic rebalance must clear (fraction).
        rebalance_min_steps: held-out window length (steps) below which no rebalance verdict is given.
        phase: ``"decode"`` or ``"prefill"`` to price and recommend on that phase only; None: both.
        fit_half: ``"first"`` (fit on the first half of the trace's prompts, price on the second) or
            ``"second"`` (the halves swapped).
    """

    engine: str
    nodes: int
    gpus_per_node: int = 8
    decode_step_tokens: int | None = None
    prefill_step_tokens: int | None = None
    redundant_per_gpu: tuple[int, ...] = (0, 1, 2, 4)
    context_len: int | None = None
    windows: int = 8
    solver: str = "greedy"
    fit_steps: int = 60
    fit_dealings: int = 16
    quick: bool = False
    quick_prompts: int = 300
    seed: int = 0
    strict: bool = False
    min_held_out_steps: int = 20
    rebalance_margin: float = 0.005
    rebalance_min_steps: int = 20
    phase: str | None = None
    fit_half: str = "first"
    overlap: str | None = None
    min_gain: float = DEFAULT_MIN_GAIN
    pinned: tuple[str, ...] | None = None
    stability: bool = True
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.engine, str) or self.engine.lower() not in engine_names():
            raise ValueError(f"engine must be one of {', '.join(engine_names())}, got {self.engine!r}")
        for name in ("nodes", "gpus_per_node", *KNOBS):
            v = getattr(self, name)
            if v is None and name in KNOBS:
                continue
            if name == "overlap":
                if v not in OVERLAP:
                    raise ValueError(f"overlap must be one of {', '.join(OVERLAP)} (or None: off), got {v!r}")
            elif not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.ep_size < 2:
            raise ValueError(
                f"EP needs more than one rank: --nodes {self.nodes} x --gpus-per-node {self.gpus_per_node} "
                f"= {self.ep_size} GPU; use at least 2 GPUs"
            )
        self._check_more()
        r = tuple(self.redundant_per_gpu)
        if not r or min(r) < 0 or len(set(r)) != len(r):
            raise ValueError(f"redundant_per_gpu must be distinct integers >= 0, got {list(r)}")
        if self.phase is not None and self.phase not in STEP_PHASES:
            raise ValueError(
                f"phase must be one of {', '.join(STEP_PHASES)} (or None: both), got {self.phase!r}"
            )
        if self.fit_half not in FIT_HALVES:
            raise ValueError(f"fit_half must be one of {', '.join(FIT_HALVES)}, got {self.fit_half!r}")
        object.__setattr__(self, "engine", self.engine.lower())
        object.__setattr__(self, "redundant_per_gpu", tuple(sorted(int(x) for x in r)))

    def _check_more(self) -> None:
        """The fields a call could set to anything before (a negative fit budget, an unknown solver)."""
        from solver.api import SOLVERS

        if self.solver not in SOLVERS:
            raise ValueError(f"unknown solver {self.solver!r}; use one of {', '.join(SOLVERS)}")
        rp = self.redundant_per_gpu
        if isinstance(rp, (str, bytes)) or not isinstance(rp, (tuple, list, range)):
            raise ValueError(f"redundant_per_gpu must be a tuple of whole numbers, got {rp!r}; e.g. (0, 2)")
        for x in rp:
            check_whole("redundant_per_gpu's entry", x, 0, fix="e.g. (0, 1, 2, 4)")
        for name, lo in (("fit_steps", 0), ("fit_dealings", 1), ("quick_prompts", 1)):
            check_whole(name, getattr(self, name), lo, MAX_FIT_STEPS)
        check_whole("seed", self.seed, 0)
        check_whole("min_held_out_steps", self.min_held_out_steps, 0)
        check_whole("windows", self.windows, 2, fix="drift compares window i with i + 1")
        check_whole("rebalance_min_steps", self.rebalance_min_steps, 1)
        for name, eg in (("rebalance_margin", "0.005"), ("min_gain", "0.01 (1% of the whole step)")):
            m = getattr(self, name)
            if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < 1:
                raise ValueError(f"{name} must be a fraction in [0, 1), got {m!r}; e.g. {eg}")
        if self.pinned is not None and (
            not isinstance(self.pinned, tuple) or not set(self.pinned) <= set(KNOBS)
        ):
            raise ValueError(f"pinned must be None or a tuple of {', '.join(KNOBS)}, got {self.pinned!r}")
        if not isinstance(self.stability, bool):
            raise ValueError(f"stability must be True or False, got {self.stability!r}")
        if not isinstance(self.notes, tuple) or not all(isinstance(n, str) for n in self.notes):
            raise ValueError(f"notes must be a tuple of strings, got {self.notes!r}")

    @property
    def ep_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def priced_phases(self) -> tuple[str, ...]:
        """The phases priced and recommended on: ``(phase,)``, or decode and prefill."""
        return STEP_PHASES if self.phase is None else (self.phase,)

    def resolved(self, hbm_bytes: float) -> AdviseOptions:
        """These options with every knob set: the ones left None take their defaults (the prefill chunk
        the engine's own for the printed command, on a GPU of ``hbm_bytes``), and ``pinned`` names the
        knobs that were given."""
        pinned = self.pinned
        if pinned is None:
            pinned = tuple(k for k in KNOBS if getattr(self, k) is not None)
        chunk = default_prefill_chunk(self.engine, hbm_bytes, self.ep_size)[0]
        return replace(
            self,
            decode_step_tokens=self.decode_step_tokens or DEFAULT_STEP_TOKENS["decode"],
            prefill_step_tokens=self.prefill_step_tokens or chunk,
            context_len=self.context_len or DEFAULT_CONTEXT_LEN,
            overlap=self.overlap or OVERLAP[0],
            pinned=pinned,
        )

    def step_tokens(self, phase: str) -> int:
        """Tokens per rank per step asked for ``phase`` (before prefill's cap to the held-out half)."""
        return self.decode_step_tokens if phase == "decode" else self.prefill_step_tokens

    @classmethod
    def from_fields(cls, fields: dict) -> AdviseOptions:
        """``AdviseOptions(**fields)``, with a missing field named in a ValueError (Python's own
        TypeError gives no fix); an unknown one is named by the class's own check
        (:func:`moe_placement.base.options.refuse_unknown_keywords`)."""
        missing = [n for n in ("engine", "nodes") if n not in fields]
        if missing:
            raise ValueError(f"AdviseOptions needs {' and '.join(missing)} (e.g. engine='vllm', nodes=1)")
        return cls(**fields)

    @classmethod
    def quick_form(cls, engine: str, nodes: int, **kw) -> AdviseOptions:
        """The ``--quick`` settings: 300 prompts, 0 and 2 redundant slots, 4 windows, a smaller fit budget."""
        base = dict(
            redundant_per_gpu=(0, 2),
            windows=4,
            fit_steps=15,
            fit_dealings=4,
            quick=True,
        )
        base.update(kw)
        return cls(engine=engine, nodes=nodes, **base)


def knob_value(options: AdviseOptions, knob: str):
    """The value of one of :data:`KNOBS` in ``options``."""
    return getattr(options, knob)


def with_knob(options: AdviseOptions, knob: str, value) -> AdviseOptions:
    """``options`` with one of :data:`KNOBS` set to ``value``."""
    return replace(options, **{knob: value})


def _near_miss(builtins: dict[str, ModelSpec], E: int, k: int, L: int) -> str:
    """``" (qwen1.5-moe-a2.7b has them but 24 MoE layers: ...)"`` when a built-in model differs from the
    trace only in its MoE layer count (a trace that logged some layers), else ``""``."""
    for name, m in builtins.items():
        if m.num_logical_experts == E and k in (None, m.top_k) and m.num_moe_layers != L:
            return (
                f" ({name} has them but {m.num_moe_layers} MoE layers: record all {m.num_moe_layers}, "
                f"or describe the {L} logged ones in a model JSON)"
            )
    return ""


def resolve_model(spec: str, trace: RoutingTrace) -> ModelSpec:
    """The cost-side model for ``trace``: ValueError unless its experts, top-k and MoE layers match.

    ``auto`` picks the built-in model with the trace's expert count, top-k and layer count. A model of
    another shape is refused, naming both: its figures would price experts or layers the trace never saw.
    """
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec:
        raise ValueError(
            f"model must be {AUTO_MODEL!r}, a built-in model name ({', '.join(BUILTIN_MODELS)}) or a model JSON "
            f"path, got {spec!r}"
        )
    E, k, L = trace.num_logical_experts, trace.top_k, trace.num_layers
    top = f"top-{k}" if k is not None else "any top-k (counts only)"

    def same(m: ModelSpec) -> bool:  # a counts-only trace has no top-k: the model's is taken
        return (m.num_logical_experts, m.num_moe_layers) == (E, L) and k in (None, m.top_k)

    if spec.lower() == AUTO_MODEL:
        builtins = {name: load_model(name) for name in BUILTIN_MODELS}
        for m in builtins.values():
            if same(m):
                return m
        raise ValueError(
            f"--model auto: no built-in model has the trace's {E} experts, {top} and {L} MoE layers"
            f"{_near_miss(builtins, E, k, L)}; name one of {', '.join(BUILTIN_MODELS)} or a model JSON"
        )
    model = load_model(spec)
    if not same(model):
        raise ValueError(
            f"the trace has {E} experts, {top}, {L} MoE layers but {model.name} has "
            f"{model.num_logical_experts} experts, top-{model.top_k}, {model.num_moe_layers} MoE layers: "
            f"advise prices the model the trace was recorded from; use --model auto or a model JSON of the "
            f"trace's shape"
        )
    return model
