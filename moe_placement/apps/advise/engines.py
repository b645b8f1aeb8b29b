"""What each serving engine can run, read from its own code and pinned per engine version: one table.

Read from the engines' source (``tests/test_advise_engines.py`` checks this table against it when the
engines' side environment is present):

- SGLang 0.5.23 balances (EPLB, ``--init-expert-location``) the architectures whose model class has
  ``get_model_config_for_expert_location`` (``sglang/srt/eplb/expert_location.py``
  ``ModelConfigForExpertLocation.from_model_config``; the classes in ``sglang/srt/models/*.py``,
  through inheritance). Its ``--ep-dispatch-algorithm`` is one of static, dynamic, fake, lp
  (``arg_groups/fields/exec_.py``); ``lp`` runs a CUDA kernel (``sglang.kernels.ops.lplb.cuda_solver``)
  and only for ``_LPLB_SUPPORTED_MODEL_ARCHS`` (``eplb/lplb_solver.py``); ``fake`` is a benchmarking
  dispatch (random experts), never advised. DeepEP (``--moe-a2a-backend deepep``) ``--deepep-mode auto``
  runs low_latency kernels for decode batches and normal kernels for prefill.
- vLLM 0.33.0 balances the architectures whose class implements ``MixtureOfExperts``
  (``model_executor/models/interfaces.py`` ``is_mixture_of_experts``; the registry's classes);
  ``--enable-eplb`` needs ``--enable-expert-parallel`` and TP x PCP x DP > 1 (``config/parallel.py``),
  on CUDA, ROCm or XPU; ``EPLBConfig.use_async`` (default True) moves weights without stopping the step.
- Both need ``(experts + redundant) % EP ranks == 0`` (SGLang ``expert_location._init_common``, vLLM's
  EPLB state): redundant slots can make an expert count that does not divide valid. vLLM without EPLB
  needs no redundant expert (``config/parallel.py`` refuses ``num_redundant_experts`` without
  ``--enable-eplb``; ``determine_expert_map`` deals ``E // G`` or one more expert to each rank).
- The all-to-all kernel per phase is the one the printed command selects: SGLang ``--moe-a2a-backend
  deepep --deepep-mode auto`` (low-latency kernels for decode, normal for prefill); vLLM
  ``--all2all-backend deepep_low_latency`` (the low-latency kernels for every batch, prefill too).
- Prefill chunk per rank when the user does not set one (:func:`default_prefill_chunk`): SGLang resolves
  ``--chunked-prefill-size`` by GPU memory (``arg_groups/memory_hook.py``: 2048 below 20 GiB, 4096 below
  60 GiB, 8192 below 160 GiB (H100, H200), else 16384), then divides it by ``attn_dp_size``
  (``arg_groups/parallel_hook.py``); vLLM with ``deepep_low_latency`` and DP > 1 defaults
  ``max_num_batched_tokens`` to ``SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS_FOR_BATCHED_DP`` = 256
  per engine core (``engine/arg_utils.py`` ``_set_default_max_num_seqs_and_batched_tokens_args``).
- Two-batch overlap is off unless the command sets it: SGLang ``--enable-two-batch-overlap``, vLLM
  ``--enable-dbo`` (both default False).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from placement.cost.primitives import kernel_of_phase
from placement.steps import PHASES

__all__ = [
    "ARCHITECTURES",
    "ENGINES",
    "EngineCaps",
    "architecture_of",
    "can_balance",
    "can_dispatch",
    "default_prefill_chunk",
    "min_redundant",
]

# Model name (a built-in preset, or a model JSON's "name") -> the Hugging Face architecture the engines
# key their support on.
ARCHITECTURES = MappingProxyType(
    {
        "deepseek-v3": "DeepseekV3ForCausalLM",
        "deepseek-r1": "DeepseekV3ForCausalLM",
        "deepseek-v2-lite": "DeepseekV2ForCausalLM",
        "mixtral-8x7b": "MixtralForCausalLM",
        "qwen3-30b-a3b": "Qwen3MoeForCausalLM",
        "olmoe-1b-7b": "OlmoeForCausalLM",
        "qwen1.5-moe-a2.7b": "Qwen2MoeForCausalLM",
    }
)

_SGLANG_EPLB = frozenset(
    """BailingMoEForCausalLM BailingMoeForCausalLM BailingMoeV2ForCausalLM BailingMoeV2_5ForCausalLM
    BailingMoeV3ForCausalLM BailingMoeV3VLForConditionalGeneration DeepseekV2ForCausalLM DeepseekV32ForCausalLM
    DeepseekV3ForCausalLM DeepseekV3ForCausalLMNextN DeepseekV4ForCausalLM DeepseekV4ForCausalLMNextN
    DotsVLMForCausalLM ExaoneMoEForCausalLM ExaoneMoEForCausalLMMTP ExaoneMoeForCausalLM Glm4MoeForCausalLM
    Glm4MoeForCausalLMNextN Glm4MoeLiteForCausalLM Glm4MoeLiteForCausalLMNextN Glm5NextForConditionalGeneration
    Glm5NextForConditionalGenerationNextN GlmMoeDsaForCausalLM GlmMoeDsaForCausalLMNextN GptOssForCausalLM
    InternS1ProForConditionalGeneration InternS2PreviewForConditionalGeneration K2HorizonForCausalLM
    KimiK25ForConditionalGeneration LLaDA2MoeModelLM LongcatFlashForCausalLM LongcatFlashForCausalLMNextN
    MellumForCausalLM MiMoV2FlashForCausalLM MiMoV2ForCausalLM MiMoV2MTP MindSporeForCausalLM
    MiniMaxM2ForCausalLM MiniMaxM3SparseForCausalLM MiniMaxM3SparseForConditionalGeneration
    MistralLarge3ForCausalLM MistralLarge3ForCausalLMEagle NemotronHForCausalLM NemotronHForCausalLMMTP
    NemotronHPuzzleForCausalLM NemotronH_Nano_Omni_Reasoning_V3 NemotronH_Nano_VL_V2
    NemotronH_Omni_Reasoning_V3 Qwen2MoeForCausalLM Qwen3MoeForCausalLM Qwen3MoeForCausalLMMTP
    Qwen3NextForCausalLM Qwen3NextForCausalLMMTP Qwen3VLMoeForConditionalGeneration Qwen3_5ForCausalLM
    Qwen3_5ForCausalLMMTP Qwen3_5MoeForCausalLM Qwen3_5MoeForConditionalGeneration Qwen4ExpForCausalLMMTP
    Qwen4ExpForConditionalGeneration SDARMoeForCausalLM SarvamMLAForCausalLM SarvamMoEForCausalLM
    Step3VLForConditionalGeneration Step3p5ForCausalLM Step3p5MTP Step3p7ForConditionalGeneration
    TransformersMoEEmbeddingModel TransformersMoEForCausalLM TransformersMoEForSequenceClassification
    TransformersMultiModalMoEEmbeddingModel TransformersMultiModalMoEForCausalLM
    TransformersMultiModalMoEForSequenceClassification XllmForCausalLM""".split()
)
_SGLANG_LP = frozenset(
    """DeepseekV2ForCausalLM DeepseekV3ForCausalLM DeepseekV32ForCausalLM MistralLarge3ForCausalLM
    MistralLarge3ForCausalLMEagle Glm4MoeLiteForCausalLM GlmMoeDsaForCausalLM""".split()
)
_VLLM_EPLB = frozenset(
    """AXK1ForCausalLM AfmoeForCausalLM AliceAIForCausalLM DeepSeekMTPModel DeepseekForCausalLM
    DeepseekV2ForCausalLM DeepseekV3BidirectionalModel DeepseekV3ForCausalLM Eagle3DeepseekV2ForCausalLM
    Eagle3DeepseekV3ForCausalLM EagleDeepSeekMTPModel Ernie4_5_MoeForCausalLM Gemma4ForCausalLM
    Glm4MoeForCausalLM Glm4MoeLiteForCausalLM Glm4MoeLiteMTPModel Glm4MoeMTPModel GlmMoeDsaForCausalLM
    InternS1ProForConditionalGeneration InternS2MobiusForConditionalGeneration InternS2MobiusMTP
    InternS2PreviewForConditionalGeneration K2HorizonForCausalLM Lfm2MoeForCausalLM Llama4ForCausalLM
    Llama4ForConditionalGeneration MiMoV2FlashForCausalLM MiMoV2ForCausalLM MistralLarge3ForCausalLM
    MixtralForCausalLM NemotronHForCausalLM NemotronHPuzzleForCausalLM PanguProMoEV2ForCausalLM
    PanguUltraMoEForCausalLM Param2MoEForCausalLM Qwen3MoeForCausalLM Qwen3NextForCausalLM Qwen3NextMTP
    Qwen3VLMoeForConditionalGeneration Qwen3_5MoeForCausalLM Qwen3_5MoeForConditionalGeneration Qwen3_5MoeMTP
    SarvamMLAForCausalLM Step3p5ForCausalLM""".split()
)


@dataclass(frozen=True)
class EngineCaps:
    """One engine version's EPLB capabilities (module docstring for where each is read).

    Attributes:
        dispatch_platforms: ``--ep-dispatch-algorithm`` value (or ``hash`` for vLLM) -> platforms it runs on.
        dispatch_architectures: a dispatch limited to some architectures -> those architectures.
        not_advised: dispatch -> why it is never advised (it runs, but is not a serving choice).
        deepep_modes: phase -> the DeepEP kernels the engine runs for it, as the printed command selects.
        a2a_kernels: phase -> the cost model's all-to-all kernel for those (``placement.cost.primitives``).
        async_rebalance: the engine can move weights while steps keep running.
        overlap_flag: the flag that turns two-batch overlap on (off by default).
        prefill_flag: the flag that sets the prefill chunk; ``prefill_flag_per_rank``: its value is per
            rank (vLLM, per engine core) rather than for all attention-DP ranks together (SGLang).
    """

    engine: str
    version: str
    eplb_architectures: frozenset[str]
    dispatch_platforms: MappingProxyType
    dispatch_architectures: MappingProxyType
    not_advised: MappingProxyType
    deepep_modes: MappingProxyType
    async_rebalance: bool
    a2a_kernels: MappingProxyType
    overlap_flag: str
    prefill_flag: str
    prefill_flag_per_rank: bool
    divisibility: str = "(experts + redundant) % EP ranks == 0"


ENGINES = MappingProxyType(
    {
        "sglang": EngineCaps(
            engine="sglang",
            version="0.5.23",
            eplb_architectures=_SGLANG_EPLB,
            dispatch_platforms=MappingProxyType(
                {
                    "static": ("cuda", "rocm", "npu"),
                    "dynamic": ("cuda", "rocm", "npu"),
                    "fake": ("cuda", "rocm", "npu"),
                    "lp": ("cuda",),
                }
            ),
            dispatch_architectures=MappingProxyType({"lp": _SGLANG_LP}),
            not_advised=MappingProxyType(
                {"fake": "fake dispatch routes to random experts (benchmarking only)"}
            ),
            deepep_modes=MappingProxyType({"decode": "low_latency", "prefill": "normal"}),
            async_rebalance=False,
            a2a_kernels=MappingProxyType({ph: kernel_of_phase(ph) for ph in PHASES}),  # --deepep-mode auto
            overlap_flag="--enable-two-batch-overlap",
            prefill_flag="--chunked-prefill-size",
            prefill_flag_per_rank=False,
        ),
        "vllm": EngineCaps(
            engine="vllm",
            version="0.33.0",
            eplb_architectures=_VLLM_EPLB,
            dispatch_platforms=MappingProxyType({"hash": ("cuda", "rocm", "xpu")}),
            dispatch_architectures=MappingProxyType({}),
            not_advised=MappingProxyType({}),
            deepep_modes=MappingProxyType({ph: "deepep_low_latency" for ph in PHASES}),
            async_rebalance=True,
            a2a_kernels=MappingProxyType({ph: kernel_of_phase("decode") for ph in PHASES}),
            overlap_flag="--enable-dbo",
            prefill_flag="--max-num-batched-tokens",
            prefill_flag_per_rank=True,
        ),
    }
)


def architecture_of(model_name: str) -> str | None:
    """The HF architecture of a built-in model preset (None for a model JSON we cannot name)."""
    return ARCHITECTURES.get(model_name.lower())


def can_balance(engine: str, architecture: str | None) -> tuple[bool, str]:
    """``(True, "")`` when ``engine`` runs EPLB for ``architecture``, else ``(False, reason)``."""
    caps = ENGINES[engine]
    if architecture is None:
        return (
            False,
            f"{engine} {caps.version}: the model's architecture is unknown, so EPLB support cannot be checked",
        )
    if architecture not in caps.eplb_architectures:
        return False, f"{engine} {caps.version} has no EPLB (expert location) support for {architecture}"
    return True, ""


def can_dispatch(
    engine: str, algorithm: str, architecture: str | None, platform: str = "cuda"
) -> tuple[bool, str]:
    """Whether ``engine`` runs dispatch ``algorithm`` for ``architecture`` on ``platform``, with the reason."""
    caps = ENGINES[engine]
    ok, why = can_balance(engine, architecture)
    if not ok:
        return ok, why
    if algorithm in caps.not_advised:
        return False, caps.not_advised[algorithm]
    platforms = caps.dispatch_platforms.get(algorithm, ())
    if platform not in platforms:
        return (
            False,
            f"{engine} {caps.version} dispatch {algorithm} runs on {', '.join(platforms) or 'nothing'}, not {platform}",
        )
    archs = caps.dispatch_architectures.get(algorithm)
    if archs is not None and architecture not in archs:
        return (
            False,
            f"{engine} {caps.version} dispatch {algorithm} supports {', '.join(sorted(archs))}, not {architecture}",
        )
    return True, ""


def min_redundant(num_experts: int, ep_size: int) -> int:
    """The fewest redundant slots (all GPUs together) that make ``(E + R) % G == 0``."""
    if ep_size < 2:
        raise ValueError(f"EP needs more than one rank, got {ep_size}: use --nodes x --gpus-per-node >= 2")
    return (-int(num_experts)) % int(ep_size)


_MIB = 1 << 20
# SGLang 0.5.23 arg_groups/memory_hook.py: --chunked-prefill-size by GPU memory (MiB upper bound, tokens)
_SGLANG_CHUNK_BY_MEMORY = ((20 * 1024, 2048), (35 * 1024, 4096), (60 * 1024, 4096), (160 * 1024, 8192))
_SGLANG_CHUNK_LARGEST = 16384  # B200, MI300
_VLLM_BATCHED_DP_TOKENS = 256  # vLLM 0.33 SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS_FOR_BATCHED_DP


def default_prefill_chunk(engine: str, hbm_bytes: float, ep_size: int) -> tuple[int, str]:
    """``(tokens per rank per prefill chunk, where the figure comes from)`` when the command sets none,
    as the engine resolves it for the command advise prints (module docstring)."""
    if engine == "vllm":
        return _VLLM_BATCHED_DP_TOKENS, (
            f"vLLM {ENGINES['vllm'].version}: max_num_batched_tokens defaults to {_VLLM_BATCHED_DP_TOKENS} per "
            "engine core under --all2all-backend deepep_low_latency with data parallelism"
        )
    mib = hbm_bytes / _MIB
    total = next((t for bound, t in _SGLANG_CHUNK_BY_MEMORY if mib < bound), _SGLANG_CHUNK_LARGEST)
    per_rank = max(1, total // int(ep_size))
    return per_rank, (
        f"SGLang {ENGINES['sglang'].version}: --chunked-prefill-size resolves to {total} for {mib / 1024:.0f} GiB "
        f"per GPU, divided by --attn-dp-size {ep_size}"
    )
