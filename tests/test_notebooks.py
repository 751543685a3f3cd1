"""Every ``notebooks/*.ipynb`` runs top to bottom on the default backend, and is committed stripped.

Executed with nbclient on the ``python3`` kernel, in the notebooks folder
(where the notebooks look for their data), with the repository root on
``PYTHONPATH`` so that the kernel imports this checkout of cupykv.
"""
import os
from pathlib import Path

import ipykernel  # noqa: F401  (the python3 kernel; in the test extra)
import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300     # a guard against a hung kernel, not a performance target


def test_notebooks_exist():
    assert {"01_tour.ipynb", "02_graph_decode.ipynb", "03_benchmarks.ipynb", "04_real_model.ipynb"} <= {
        path.name for path in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_committed_stripped(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs: strip them before committing"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_runs_without_errors(path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.delenv("CUPYKV_BENCH_JSON", raising=False)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()   # raises CellExecutionError, with the traceback, on the first failing cell
    errors = [output for cell in nb.cells if cell.cell_type == "code" for output in cell.outputs
              if output.output_type == "error"]
    assert not errors, errors
