"""The notebooks: committed without outputs, and every one executes without a cell error.

A notebook is a stage's (NN_name.ipynb, NN a stage number, first cell "# Stage NN: ... you will
learn", last cell the stage's exercises) or an appendix (AK_name.ipynb, first cell "# Appendix
AK: ... you will learn"), for a lesson that belongs to no stage.

The execution test runs scripts/run_notebooks.py, the same runner `make notebooks` uses, in a
subprocess with this interpreter and environment, once per notebook: each in a fresh Jupyter
kernel, the executed copy in build/notebooks/. It builds what the notebook needs (reusing the
builds of the other tests): minutes in all on a small machine. Then it reads the executed copy:
it must hold a picture (an image/png output), drawn when it ran. The notebooks that time code
(`timed-...`) run when no other test does in `make test`; the others (`untimed-...`) beside them.
Each notebook's test names the stages its cells import, so a kept result of it
(workbook.testing.pytest_results) stands while those stages are unchanged, and it keeps its
executed copy, which the book shows, with that result.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from workbook.build import stages
from workbook.teaching import exercises
from workbook.teaching.notebook import pythonpath_with_common
from workbook.testing import pytest_results

REPO = stages.REPO
RUNNER = REPO / "scripts" / "run_notebooks.py"
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
APPENDIX = re.compile(r"A\d+_")


def is_appendix(path):
    return APPENDIX.match(path.name) is not None


def stage_of(path):
    """The stage a stage notebook belongs to (its first two characters are the number)."""
    return stages.get(int(path.name[:2]))


def runner_env():
    """This process's environment, with common/ on PYTHONPATH as the Makefile sets it."""
    return dict(os.environ, PYTHONPATH=pythonpath_with_common())


def test_every_notebook_belongs_to_a_stage():
    numbers = {f"{s.number:02d}" for s in stages.all_stages()}
    strays = [p.name for p in NOTEBOOKS if p.name[:2] not in numbers and not is_appendix(p)]
    assert not strays, (f"notebooks neither of a stage (NN_name, NN a stage number) nor an "
                        f"appendix (AK_name): {strays}")


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
    title = f"# Appendix {path.name.split('_')[0]}:" if is_appendix(path) else "# Stage"
    assert first.startswith(title) and "you will learn" in first, first[:200]
    for k, cell in enumerate(cells):
        lines = "".join(cell["source"]).splitlines()
        assert not (len(lines) > 1 and all(ln.startswith("#") for ln in lines)), (
            f"{path.name}, markdown cell {k}: every line starts with '#'"
        )


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if not is_appendix(p)],
                         ids=[p.stem for p in NOTEBOOKS if not is_appendix(p)])
def test_stage_notebooks_end_with_their_exercises(path):
    # The last cell names every exercise marked in the stage's sources, and the commands.
    stage = stage_of(path)
    number, found = stage.number, exercises.find(stage)
    if not found:
        pytest.skip(f"{stage.label} marks no exercises in its sources")
    last = json.loads(path.read_text())["cells"][-1]
    text = "".join(last["source"])
    assert last["cell_type"] == "markdown" and text.startswith("## Exercises"), (
        f"{path.name}: the last cell is not the exercises: {text[:120]!r}")
    for command in (f"make exercise {number}", f"make verify {number}", "RESET=1", "diff -ru"):
        assert command in text, f"{path.name}: the exercises do not say `{command}`"
    missing = [e.name for e in found if f"`{e.name}`" not in text]
    assert not missing, f"{path.name}: the exercises cell leaves out {missing}"


def images_in(executed) -> int:
    """How many image/png outputs the cells of an executed notebook hold."""
    cells = json.loads(executed.read_text())["cells"]
    return sum("image/png" in output.get("data", {})
               for cell in cells if cell["cell_type"] == "code" for output in cell["outputs"])


def times_something(path) -> bool:
    """Whether a notebook times code (ops or builds): its figures then want a quiet machine, and
    `make test` runs it when no other test runs (workbook.testing.suite); the others run beside
    them."""
    cells = json.loads(path.read_text())["cells"]
    code = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return any(word in code for word in ("timing.", "perf_counter", "nb.sweep("))


GROUPS = {"timed": [p for p in NOTEBOOKS if times_something(p)],
          "untimed": [p for p in NOTEBOOKS if not times_something(p)]}


def test_the_notebooks_that_time_nothing_are_few():
    # The lessons are timed; an appendix of commands (the ABI trap) need not be. A stage
    # notebook counted here would run beside other tests and draw its timings from a busy machine.
    assert all(is_appendix(p) for p in GROUPS["untimed"]), GROUPS["untimed"]


def executed_copy(path):
    return stages.build_root() / "notebooks" / path.name


def stages_run_by(path) -> set[str]:
    """The stage folders a notebook names: by folder name, stages.get(N) or import_stage(N)."""
    return pytest_results.folders_named(path.read_text(), {s.folder for s in stages.all_stages()})


def execution(group, path):
    """The execution test's case for one notebook: the stages it runs, and the executed copy it
    leaves for the book."""
    return pytest.param(path, id=f"{group}-{path.stem}",
                        marks=[pytest.mark.reaches(*sorted(stages_run_by(path))),
                               pytest.mark.keeps(executed_copy(path))])


def test_every_notebook_names_the_stages_it_runs():
    # A stage notebook imports its own stage; an appendix names the stage it builds on.
    for path in NOTEBOOKS:
        folders = stages_run_by(path)
        assert folders, f"{path.name} names no stage: its kept result would stand for every file"
        if not is_appendix(path):
            assert stage_of(path).folder in folders, (path.name, folders)


@pytest.mark.parametrize("path", [execution(group, path) for group, chosen in GROUPS.items()
                                  for path in chosen])
def test_notebooks_execute(capsys, path):
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    lines = []
    with subprocess.Popen([sys.executable, str(RUNNER), path.name],
                          env=runner_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[notebooks] "):  # each notebook's start and time, as they come:
                with capsys.disabled():         # minutes in all
                    print(f"\n{line}", end="", flush=True)
    output = "".join(lines)
    assert proc.returncode == 0, output[-6000:]
    # Every notebook draws at least one picture when it runs (none is committed).
    assert images_in(executed_copy(path)) > 0, \
        f"{path.name} executed without a picture (an image/png output)"
