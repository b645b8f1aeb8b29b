"""Shared fixtures. Real traces come from MOE_TRACES_DIR (default ../shared/traces); tests that need
them skip with the reason when the folder is absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from profiling.readers import default_traces_dir, read_trace  # noqa: E402

try:  # derandomised, bounded hypothesis profile for CI
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "ci",
        derandomize=True,
        max_examples=60,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.register_profile(
        "dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover
    pass

DEEPSEEK = "deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz"
QWEN = "qwen15-moe-gsm8k-decode/qwen15_gsm8k_layers_0_8_12_18_23.npz"
MIXTRAL = "mixtral-8x7b-mmlu/mixtral_mmlu_counts.npz"
OLMOE = "olmoe-domains/olmoe_counts.npz"


def shared_trace_path(rel: str) -> Path:
    """Path of a shared trace, or skip the test saying why."""
    d = default_traces_dir()
    p = d / rel
    if not p.is_file():
        pytest.skip(f"real trace {rel} not found (set MOE_TRACES_DIR to the shared traces folder)")
    return p


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    d = default_traces_dir()
    if not d.is_dir():
        pytest.skip("shared traces folder is absent (set MOE_TRACES_DIR; default ../shared/traces)")
    return d


@pytest.fixture(scope="session")
def deepseek_trace():
    return read_trace(shared_trace_path(DEEPSEEK))


@pytest.fixture(scope="session")
def qwen_trace():
    return read_trace(shared_trace_path(QWEN))


@pytest.fixture(scope="session")
def mixtral_trace():
    return read_trace(shared_trace_path(MIXTRAL))


@pytest.fixture(scope="session")
def olmoe_trace():
    return read_trace(shared_trace_path(OLMOE))
