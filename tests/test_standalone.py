"""Every target stands alone: `make racecheck` and `make sanitize` pass from a clean clone, run
first, with nothing built before them, and no compiler ever runs with a sanitizer runtime
preloaded (g++ under ThreadSanitizer's dies with exit 139, which the checks' processes have:
stage 04's tests build stage 02 when they import it).

The first tests (`make test`) check the rule where it is kept, in seconds: the ahead-of-time
builder and the emulated device's builder hand their compilers an environment without
LD_PRELOAD. The last two, marked `standalone` (`make test-standalone`, CI's first step), run each
pass on one stage into an empty build folder, as a clean clone would: racecheck on stage 04 (its
CUDA tests import stage 02, which is then built under the checker's process) and sanitize on
stage 01. The empty folder is build-standalone/, beside build/: the compiler cache takes paths
relative to the clone, so what these builds compile is what `make test`, `make racecheck` and
`make sanitize` compile later into build/, found in the cache there. The builds in the race
checker's own process compile whatever the cache holds (CCACHE_RECACHE: the compiler itself must
run there, where it once crashed), and store what they compile: the emulated device and stage
04's kernels under ThreadSanitizer, and stage 02. Stage 04's own build, which the pass starts
from its driver, without the runtime, is built first into the same empty folder, from the cache
(its nvcc compile is the slowest of the four); the sanitizer pass's builds may be hits.
"""

import os
import shutil
import subprocess
import sys

import pytest

from workbook.build import builder, emulate, stages, toolkit

RUNTIME = "/nonexistent/libtsan.so"


def test_the_ahead_of_time_builder_runs_setup_py_without_a_preloaded_runtime(
        monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBOOK_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("LD_PRELOAD", RUNTIME)
    seen = {}

    def run(cmd, **kwargs):
        seen.update(kwargs["env"])
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(builder.subprocess, "run", run)
    with pytest.raises(RuntimeError, match="failed"):
        builder.build_stage(stages.get(1), quiet=True, force=True)
    assert seen, "setup.py was not run"
    assert "LD_PRELOAD" not in seen
    assert os.environ["LD_PRELOAD"] == RUNTIME  # the process keeps its own


def test_the_emulated_device_compiles_without_a_preloaded_runtime(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.setenv("LD_PRELOAD", RUNTIME)
    seen = []
    monkeypatch.setattr(cpp_extension, "load",
                        lambda **kwargs: seen.append(os.environ.get("LD_PRELOAD")))
    emulate._load("standalone_probe", [tmp_path / "probe.cpp"], tmp_path, python_module=False)
    assert seen == [None]
    assert os.environ["LD_PRELOAD"] == RUNTIME


# At the depth of build/, so that every compile's paths, relative to the clone, are the same.
EMPTY = stages.REPO / "build-standalone"


def _empty() -> None:
    shutil.rmtree(EMPTY, ignore_errors=True)
    EMPTY.mkdir()


def _run(module: str, args: list[str], **env: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, WORKBOOK_BUILD_DIR=str(EMPTY), TORCH_EXTENSIONS_DIR=f"{EMPTY}/jit",
               WORKBOOK_EMULATE_QUIET="1", **env)
    return subprocess.run([sys.executable, "-m", module, *args],
                          env=env, capture_output=True, text=True, cwd=stages.REPO)


@pytest.mark.standalone
@pytest.mark.reaches("04_cuda_raw")  # and what it names (02): workbook.testing.pytest_results
@pytest.mark.skipif(toolkit.find() is None, reason="stage 04 is CUDA-only: no CUDA toolkit here")
@pytest.mark.skipif(not emulate.active(), reason="the race check runs on the emulated device")
def test_racecheck_runs_first_and_alone():
    _empty()
    built = _run("workbook.build", ["4"])
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-2000:]
    assert not (EMPTY / "stages" / stages.get(2).folder).exists()
    # The one test of stage 04 that imports stage 02: built now, under the checker's process.
    run = _run("workbook.net.racecheck",
               ["4", "--", "-k", "test_matches_the_cpu_extension_of_stage_02"], CCACHE_RECACHE="1")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout
    assert (EMPTY / "stages" / stages.get(2).folder / "lib").is_dir()


@pytest.mark.standalone
@pytest.mark.reaches("01_z2xy")
def test_sanitize_runs_first_and_alone():
    _empty()
    run = _run("workbook.net.sanitize", ["1", "--", "-x"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "clean under ASan+UBSan" in run.stdout
    assert (EMPTY / "sanitize" / "stages" / stages.get(1).folder).is_dir()
