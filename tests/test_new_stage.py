"""`make new-stage NAME=...` gives a stage that builds and passes its tests, and an op that the
hostile-input matrix, the fuzzer, the concurrency test and the benchmark cover with no edit
outside its two folders; in a copy of the repository under build/working-copies/ (built and
tested there, emptied by the next run)."""

import json
import subprocess
import sys

import pytest

from workbook import testing
from workbook.build import stages


# Of the other stages it reads what describes them (stage.toml, setup.py: the new stage's number,
# the README's table, the names taken); the tools it runs (-k, --op) select the new op alone. Its
# verdict is on the template, so a change to another stage's kernel leaves it standing: that
# stage's own tests judge the change (workbook.testing.pytest_results).
@pytest.mark.template
@pytest.mark.reads("stages/*/stage.toml", "stages/*/setup.py", "stages/*/README.md", "README.md")
def test_new_stage_builds_and_passes_its_tests(tmp_path):
    copy, env = testing.working_copy_in_build("new-stage")
    env["PYTHON"] = sys.executable
    number = max(s.number for s in stages.all_stages()) + 1

    def run(*args, timeout=1200):
        proc = subprocess.run(list(args), cwd=copy, env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0, f"$ {' '.join(args)}\n{proc.stdout[-4000:]}{proc.stderr}"
        return proc.stdout

    made = run("make", "-s", "new-stage", "NAME=scale_add")
    folder = copy / "stages" / f"{number:02d}_scale_add"
    assert f"stage {number} ({folder.name}) is ready" in made
    for part in ("stage.toml", "setup.py", "README.md", "test_scale_add.py", "csrc/scale_add.cpp",
                 "csrc/cpu/scale_add_cpu.cpp", "csrc/cuda/scale_add_cuda.cu",
                 "scale_add/__init__.py"):
        assert (folder / part).is_file(), f"new-stage wrote no {part}"
    op_folder = copy / "common" / "workbook" / "ops" / "scale_add"
    for part in ("__init__.py", "reference.py", "matrix.py", "fuzz.py", "bench.py"):
        assert (op_folder / part).is_file(), f"new-stage wrote no ops/scale_add/{part}"

    run(sys.executable, "-m", "workbook.build", str(number))
    tested = run(sys.executable, "-m", "workbook.testing.suite", str(number))
    assert f"ok   stage {number} ({folder.name})" in tested

    # The reliability net and the benchmark cover the new op with no edit outside its two
    # folders: each finds the op and the stage that implements it on disk.
    key = f"scale_add@{number}"
    matrix = run(sys.executable, "-m", "workbook.net.matrix", key)
    assert f"[matrix] {key}:" in matrix and "[matrix] all passed" in matrix, matrix[-2000:]
    fuzzed = run(sys.executable, "-m", "pytest", "-q", "tests/test_fuzz.py", "-k",
                 f"scale_add_at_stage_{number:02d}")
    assert "1 passed" in fuzzed, fuzzed[-2000:]
    threads = run(sys.executable, "-m", "pytest", "-q", "tests/test_concurrency.py", "-k",
                  "scale_add")
    assert "2 passed" in threads, threads[-2000:]
    out = tmp_path / "bench"
    run(sys.executable, "bench/run.py", "--op", "scale_add", "--smoke", "--device", "cpu",
        "--out", str(out))
    report = json.loads(next((out / "scale_add").glob("*.json")).read_text())
    assert any(row["impl"] == f"stage{number:02d}" for row in report["results"]), report["skipped"]
    # The README's stage table gained the row, and the notebook stub runs.
    run(sys.executable, "-m", "pytest", "-q", "tests/test_stages.py::"
        "test_readme_stage_table_matches_the_stage_folders")
    run(sys.executable, "scripts/run_notebooks.py", f"{number:02d}_scale_add")
    # A second stage of the same name is refused, saying why.
    again = subprocess.run(["make", "-s", "new-stage", "NAME=scale_add"], cwd=copy, env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "exists already" in again.stderr
