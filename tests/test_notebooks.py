"""The notebooks run top to bottom without an error cell, and are committed without outputs."""

import os
import pathlib

import pytest

from kvjax.testing.fast_compile import with_fast_xla_flags

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_three_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["01_silent_bugs.ipynb", "02_kernels.ipynb", "03_serving.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, f"{path.name}: cells {dirty} hold outputs; strip them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_without_error_and_draws_a_figure(path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    # The kernel (and the processes it starts) compile at kvjax.testing.fast_compile's settings,
    # about half the CPU time of each compile; the notebooks' own parity checks still run.
    flags = with_fast_xla_flags(os.environ.get("XLA_FLAGS"))
    # the kernel imports kvjax from this checkout whatever the environment's install state
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    client.execute(env={**os.environ, "XLA_FLAGS": flags, "PYTHONPATH": path})  # raises CellExecutionError on the first error cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.get("output_type") == "error"]
    assert not errors
    figures = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
               if o.get("output_type") == "display_data" and "image/png" in o.get("data", {})]
    assert figures, f"{path.name} drew no figure"
