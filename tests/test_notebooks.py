"""The notebooks: committed without outputs, and every one executes without a cell error.

The execution test runs scripts/run_notebooks.py, the same runner `make notebooks` uses, in a
subprocess with this interpreter and environment: each notebook in a fresh Jupyter kernel, the
executed copies in build/notebooks/. It builds what the notebooks need (reusing the builds of
the other tests), so it takes a few minutes on a small machine.
"""

import json
import os
import subprocess
import sys

import pytest

from workbook import stages
from workbook.notebook import pythonpath_with_common

REPO = stages.REPO
RUNNER = REPO / "scripts" / "run_notebooks.py"
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def runner_env():
    """This process's environment, with common/ on PYTHONPATH as the Makefile sets it."""
    return dict(os.environ, PYTHONPATH=pythonpath_with_common())


def test_every_notebook_belongs_to_a_stage():
    numbers = {f"{s.number:02d}" for s in stages.all_stages()}
    strays = [p.name for p in NOTEBOOKS if p.name[:2] not in numbers]
    assert not strays, f"notebooks without a stage of their number: {strays}"


def test_notebooks_are_committed_without_outputs():
    proc = subprocess.run([sys.executable, str(RUNNER), "--check-clean"], env=runner_env(),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_markdown_cells_are_markdown(path):
    # A markdown cell whose every line starts with "#" is Python-comment text pasted into
    # markdown: Jupyter would render each line as a heading.
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"]
    assert cells, f"{path.name} has no markdown cells: a notebook here is a narrative"
    first = "".join(cells[0]["source"])
    assert first.startswith("# Stage") and "you will learn" in first, first[:200]
    for k, cell in enumerate(cells):
        lines = "".join(cell["source"]).splitlines()
        assert not (len(lines) > 1 and all(ln.startswith("#") for ln in lines)), (
            f"{path.name}, markdown cell {k}: every line starts with '#'"
        )


def test_notebooks_execute():
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    proc = subprocess.run([sys.executable, str(RUNNER)], env=runner_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    print(proc.stdout)  # per-notebook progress and times, shown by pytest -rA or on failure
    assert proc.returncode == 0, proc.stdout[-6000:]
