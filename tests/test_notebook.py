"""Execute notebooks/expert_skew.ipynb against the real DeepSeek-V2-Lite trace and check its figures."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "expert_skew.ipynb"
TRACE = "deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz"
KERNEL_HINT = ".venv/bin/python -m ipykernel install --sys-prefix"


def _require_extras():
    for mod in ("nbclient", "nbformat", "ipykernel", "matplotlib", "jupyter_client"):
        pytest.importorskip(mod, reason=f"the notebook test needs {mod} (notebook extras)")
    from jupyter_client.kernelspec import find_kernel_specs

    if "python3" not in find_kernel_specs():
        pytest.skip(f"no 'python3' Jupyter kernel spec; install one into the venv with: {KERNEL_HINT}")


def test_expert_skew_notebook_runs_and_draws(monkeypatch, traces_dir):
    _require_extras()
    trace = traces_dir / TRACE
    if not trace.is_file():
        pytest.skip(f"real trace {TRACE} not found in the shared traces folder (set MOE_TRACES_DIR)")
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("MOE_TRACES_DIR", str(trace.parents[1]))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(images) >= 5  # heatmap, Lorenz, drift, co-activation, GPU bars
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "held-out par: trivial" in text and "max/mean per layer" in text


PLAN_NOTEBOOK = NOTEBOOK.parent / "deployment_plan.ipynb"


def test_deployment_plan_notebook_sweeps_output_length_and_the_answer_flips():
    """notebooks/deployment_plan.ipynb: plan(...) over output lengths; short outputs keep co-located,
    long ones pick the split (no trace needed)."""
    _require_extras()
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(PLAN_NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(PLAN_NOTEBOOK.parent)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    lines = [ln for ln in text.splitlines() if ln.startswith("output")]
    assert "best co-located" in lines[0] and "best disaggregated" in lines[-1], lines
    assert "the answer flips between output lengths [(" in text
