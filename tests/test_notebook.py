"""notebooks/colab_tpu_quickstart.ipynb runs top to bottom in small mode (nbclient, a kernel on
this interpreter); without small mode and without a TPU it says it falls back to the embedded pair."""

from __future__ import annotations

import json
import os
import sys
import time

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "colab_tpu_quickstart.ipynb")
KERNEL = "ssd-jax-notebook-test"


def _read() -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOK, as_version=4)


def _tagged(nb, tag: str):
    cells = [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"expected one cell tagged {tag!r}, found {len(cells)}"
    return cells[0]


def _text(cell) -> str:
    """Everything a code cell printed or returned as text."""
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            parts.append(output.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def _kernel_env(small: bool, host_devices: int | None) -> dict:
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)  # let ipykernel pick its inline backend, which emits image/png
    env.pop("SSD_JAX_NOTEBOOK_SMALL", None)
    if small:
        env["SSD_JAX_NOTEBOOK_SMALL"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    if host_devices:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={host_devices}".strip()
    return env


def _execute(nb, tmp_path, env: dict) -> nbformat.NotebookNode:
    """Runs every cell of nb in a fresh kernel on sys.executable (cwd: the repository root);
    raises nbclient's CellExecutionError on the first cell that fails."""
    kernels = tmp_path / "kernels"
    (kernels / KERNEL).mkdir(parents=True)
    spec = dict(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                display_name="ssd_jax test kernel", language="python")
    (kernels / KERNEL / "kernel.json").write_text(json.dumps(spec))
    km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))
    client = NotebookClient(nb, km=km, timeout=600, startup_timeout=120,
                            resources={"metadata": {"path": REPO}})
    client.execute(env=env)
    return nb


def test_notebook_is_committed_without_outputs():
    for cell in _read().cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def test_notebook_runs_in_small_mode(tmp_path):
    start = time.perf_counter()
    # Two host devices, so the SSD cell takes its disjoint device groups branch on this CPU.
    nb = _execute(_read(), tmp_path, _kernel_env(small=True, host_devices=2))
    elapsed = time.perf_counter() - start
    print(f"notebook ran in small mode in {elapsed:.0f} s")

    printed = "".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "Small mode (SSD_JAX_NOTEBOOK_SMALL=1)" in printed
    assert "Policy(platform='cpu'" in printed
    assert "SSD ran on disjoint device groups" in printed and "cache hit rate" in printed
    for name in ("AR", "SD", "GBV", "LogitSpec", "SSD"):
        assert f"\n{name} " in printed, name
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, "no cell produced an image/png output (the speedup plot)"

    jit_cell = _text(_tagged(nb, "decode-in-jit"))
    assert "decode inside jit: tokens (2, 16)" in jit_cell, jit_cell
    assert "same tokens as ssd_jax.generate: True" in jit_cell, jit_cell
    assert "log-likelihood of each continuation under the target: [" in jit_cell, jit_cell
    assert elapsed < 600, f"small mode took {elapsed:.0f} s; it must stay well under 10 minutes"


def test_without_small_mode_and_tpu_the_notebook_says_it_falls_back(tmp_path):
    import jax

    if jax.default_backend() == "tpu":
        pytest.skip("on a TPU the notebook loads the Hugging Face pair instead")
    nb = _read()
    mode_cell = _tagged(nb, "mode-helper")
    # The install cell, the helper and the cell that picks the mode: cheap, no decoding.
    upto = nb.cells.index(mode_cell) + 2
    nb.cells = nb.cells[:upto]
    _execute(nb, tmp_path, _kernel_env(small=False, host_devices=None))
    printed = "".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "Not on Colab" in printed
    assert f"No TPU found (JAX's default backend is '{jax.default_backend()}')" in printed, printed
    assert "Falling back to the embedded pair." in printed, printed


def _mode_helper():
    namespace: dict = {}
    exec(compile(_tagged(_read(), "mode-helper").source, NOTEBOOK, "exec"), namespace)
    return namespace["notebook_mode"]


@pytest.mark.parametrize("small, platform, mode", [
    ("1", "cpu", "small"), ("1", "tpu", "small"), (None, "tpu", "tpu"), ("0", "tpu", "tpu"), ("", "tpu", "tpu"),
    (None, "cpu", "fallback"), (None, "gpu", "fallback"), ("0", "cpu", "fallback"),
])
def test_mode_helper(small, platform, mode):
    got, message = _mode_helper()(small, platform)
    assert got == mode
    if mode == "fallback":
        assert f"default backend is {platform!r}" in message and "needs a Colab TPU runtime" in message
        assert message.endswith("Falling back to the embedded pair.")


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_mode_helper_rejects_unknown_values(value):
    with pytest.raises(ValueError, match="SSD_JAX_NOTEBOOK_SMALL must be 1"):
        _mode_helper()(value, "cpu")
