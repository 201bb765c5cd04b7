"""The repair tools: scripts/fix_abi.sh on a stage built with the wrong C++11 ABI, and the doctor.

The round trip builds stage 1 twice (wrong ABI, then repaired), in its own build folder under
build/ (build/abi-lesson) so the regular build is left alone.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbook.build import builder, stages

# Of the stages, the round trip builds stage 1 and the doctor reads what describes every stage
# (their kept results, workbook.testing.pytest_results, stand while those are unchanged).
pytestmark = [pytest.mark.reaches(stages.get(1).folder), pytest.mark.reads("stages/*/stage.toml")]

REPO = Path(__file__).resolve().parents[1]
FIX_ABI = REPO / "scripts" / "fix_abi.sh"
DOCTOR = REPO / "scripts" / "doctor.py"
TORCH_ABI = int(torch._C._GLIBCXX_USE_CXX11_ABI)
OTHER_ABI = 1 - TORCH_ABI
BUILD_TIMEOUT = 900  # one build of stage 1 takes about a minute on two busy cores

needs_binutils = pytest.mark.skipif(
    shutil.which("nm") is None or shutil.which("c++filt") is None or shutil.which("bash") is None,
    reason="fix_abi.sh needs bash, nm and c++filt (binutils), and one of them is not installed",
)

# Imports stage 1 from the build folder first on PYTHONPATH (with_library), checks it against
# 2x + y, gradchecks it.
IMPORT_AND_GRADCHECK = """
import torch
import z2xy
x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
y = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
torch.testing.assert_close(z2xy.z2xy(x, y), 2 * x + y)
assert torch.autograd.gradcheck(z2xy.z2xy, (x, y))
print("gradcheck ok")
"""


def tool_env(**overrides) -> dict:
    """The environment the Makefile gives its tools, without any forced ABI."""
    env = {k: v for k, v in os.environ.items() if k != "WORKBOOK_CXX11_ABI"}
    env["PYTHON"] = sys.executable
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "common"), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(overrides)
    return env


def with_library(env: dict, lib_dir) -> dict:
    """`env` with a built package's folder first on PYTHONPATH, where a child imports it from."""
    return dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(lib_dir),
                                                              env.get("PYTHONPATH", "")])))


def run(cmd, env, timeout=120) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    print(f"$ {' '.join(map(str, cmd))}  (exit {proc.returncode})\n{proc.stdout}{proc.stderr}")
    return proc


@needs_binutils
def test_wrong_abi_round_trip(monkeypatch, tmp_path):
    lesson = stages.build_root() / "abi-lesson"
    shutil.rmtree(lesson, ignore_errors=True)
    env = tool_env(WORKBOOK_BUILD_DIR=str(lesson))
    lib_dir = lesson / "stages" / "01_z2xy" / "lib"

    # 1. The documented switch builds stage 1 with the other ABI ...
    wrong = run([sys.executable, "-m", "workbook.build", "1"],
                dict(env, WORKBOOK_CXX11_ABI=str(OTHER_ABI)), timeout=BUILD_TIMEOUT)
    assert wrong.returncode == 0, wrong.stdout + wrong.stderr
    record = (lesson / "stages" / "01_z2xy" / "build-flags.txt").read_text()
    assert f"-D_GLIBCXX_USE_CXX11_ABI={OTHER_ABI}" in record

    # ... which counts as out of date once the switch is unset (mtimes alone would say otherwise).
    monkeypatch.setenv("WORKBOOK_BUILD_DIR", str(lesson))
    monkeypatch.setenv("WORKBOOK_CXX11_ABI", str(OTHER_ABI))
    assert builder.is_up_to_date(stages.get(1))
    monkeypatch.delenv("WORKBOOK_CXX11_ABI")
    assert not builder.is_up_to_date(stages.get(1))

    # 2. ... and importing it fails with the classic undefined symbol.
    failed = run([sys.executable, "-c", IMPORT_AND_GRADCHECK], with_library(env, lib_dir))
    assert failed.returncode != 0
    assert "undefined symbol" in failed.stderr

    # 3. --check finds the mismatch, says so, and changes nothing.
    so_files = sorted((lib_dir / "z2xy").glob("*.so"))
    before = so_files[0].stat().st_mtime_ns
    check = run(["bash", FIX_ABI, "--check", "1"], env)
    assert check.returncode == 1
    assert "MISMATCH" in check.stdout and "undefined symbol" in check.stdout
    assert f"_GLIBCXX_USE_CXX11_ABI={OTHER_ABI}), but torch uses" in check.stdout
    assert so_files[0].stat().st_mtime_ns == before

    # A copy outside the build folder belongs to no stage: diagnosed, but there is nothing to rerun.
    foreign = tmp_path / so_files[0].name
    shutil.copy(so_files[0], foreign)
    orphan = run(["bash", FIX_ABI, foreign], env)
    assert orphan.returncode == 1
    assert "not built by a workbook stage" in orphan.stdout and "CANNOT REPAIR" in orphan.stdout

    # 4. Without --check it rebuilds the stage with torch's ABI and verifies the import.
    fixed = run(["bash", FIX_ABI, "1"], env, timeout=BUILD_TIMEOUT)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "FIXED" in fixed.stdout
    good = run([sys.executable, "-c", IMPORT_AND_GRADCHECK], with_library(env, lib_dir))
    assert good.returncode == 0, good.stderr
    assert "gradcheck ok" in good.stdout

    # 5. --check on the good build: OK, exit 0, and the build is up to date without the switch.
    recheck = run(["bash", FIX_ABI, "--check", "1"], env)
    assert recheck.returncode == 0
    assert "OK: consistent with torch" in recheck.stdout
    assert builder.is_up_to_date(stages.get(1))


def doctor_lines(env) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    proc = run([sys.executable, DOCTOR], env, timeout=300)
    checks = {}
    for line in proc.stdout.splitlines():
        if line.startswith("doctor:"):
            continue
        status, what, rest = line.split(maxsplit=2)
        assert status in ("OK", "WARN", "FAIL"), line
        checks[what] = f"{status} {rest}"
    return proc, checks


def test_doctor_agrees_with_python():
    proc, checks = doctor_lines(tool_env())
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only"
    assert checks["torch"].startswith(f"OK {torch.__version__}, {cuda}, C++11 ABI {TORCH_ABI}")
    assert checks["abi"].startswith(f"OK builds use -D_GLIBCXX_USE_CXX11_ABI={TORCH_ABI}")
    for what in ("python", "compiler", "ninja", "nvcc", "CUDA_HOME", "gpus", "arch", "build",
                 "stages", "jit"):
        assert what in checks, f"doctor printed no {what} line"
    failed = [line for line in checks.values() if line.startswith("FAIL")]
    assert proc.returncode == (1 if failed else 0)


def test_doctor_fails_on_a_forced_abi():
    proc, checks = doctor_lines(tool_env(WORKBOOK_CXX11_ABI=str(OTHER_ABI)))
    assert checks["abi"].startswith("FAIL")
    assert "unset WORKBOOK_CXX11_ABI" in checks["abi"]
    assert proc.returncode == 1


def test_gpu_check_stops_with_one_line_where_no_gpu_is_visible(tmp_path):
    """scripts/device_check.sh cannot pass green without a GPU: it stops at its preflight,
    exit 1, saying why in its summary (CUDA_VISIBLE_DEVICES="" hides any GPU there is)."""
    env = tool_env(OUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    proc = run(["bash", REPO / "scripts" / "device_check.sh"], env, timeout=300)
    assert proc.returncode == 1
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "STOP at preflight: no GPU visible" in summary, summary
    assert (tmp_path / "out" / "logs.tgz").is_file()
