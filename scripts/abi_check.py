"""make abi-check: stage 10's wheel built once, then its tests under two torch versions, with no
rebuild between them: the proof that the stable ABI makes one binary.

    make abi-check                 the pinned torch (this environment's) and torch 2.13.0
    make abi-check TORCH=2.x.y     another second version, where pip can get one

1. `pip wheel` builds stages/10_stable_abi once, with this environment's torch, into dist/: an
   abi3 wheel (checked by its name), CPU-only (WORKBOOK_NO_CUDA=1: the second torch is a CPU
   build; its CUDA tests skip in both runs, WORKBOOK_CUDA=off, saying why).
2. A venv gets the second torch (pip takes 2.13.0 from this machine's disk, a CPU-only build)
   and the tests' own requirements (pytest, numpy, ONNX), while the wheel builds. It holds
   nothing of the repository, so it is made once per machine and kept in the user's cache
   (~/.cache/workbook/abi-check/, named by a hash of the interpreter and the versions it holds):
   every clone reuses it while it imports them.
3. The one wheel is installed, unchanged, beside each torch (pip install --target), and stage 10's
   tests run on that installed package (WORKBOOK_INSTALLED: workbook.build.loader imports it
   instead of building the stage), once per torch, the two runs side by side.
4. Both summaries are printed. The check fails if either run fails, or if their passed counts
   differ by more than the tests that compare with torchvision (which is not installed beside
   the second torch: PyPI's torchvision does not import beside a CPU build of 2.13.0).

The symbol test (stage 10's test_stable_abi.py) runs in both: the library imports no C++ symbol
of libtorch or c10, only their C shims.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import venv
from pathlib import Path

from workbook.build import compiler, stages
from workbook.build.loader import INSTALLED

REPO = stages.REPO
SECOND_TORCH = "2.13.0"
# The tests' own requirements, pinned as requirements.txt pins them: pytest (with pytest-timeout,
# for pyproject.toml's time limit) and numpy, the ONNX packages the deployment tests export
# to and run in (stage 06's test_deploy.py), and HF transformers with its `kernels`, whose models
# stage 10's test_integrations.py runs on extops.
TEST_REQUIREMENTS = ("pytest", "pytest-timeout", "numpy", "onnx", "onnxscript", "onnxruntime",
                     "transformers", "kernels")


_printing = threading.Lock()  # the two torch runs print from threads of their own


def say(text: str) -> None:
    with _printing:
        print(f"[abi-check] {text}", flush=True)


def run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    say("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def pins(names) -> list[str]:
    """requirements.txt's pins of `names`, e.g. ["pytest==9.2.0", "numpy==2.4.6"]."""
    found = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line.strip())
        if match and match.group(1).lower() in names:
            found[match.group(1).lower()] = line.strip()
    return [found.get(name, name) for name in names]


def build_wheel(stage: stages.Stage) -> Path:
    """The stage's wheel, built by pip (which runs setup.py with this process's environment: the
    compiler cache's settings for this clone, set by main, so that a wheel built in another clone
    of the same sources compiles nothing again)."""
    dist = REPO / "dist"
    dist.mkdir(exist_ok=True)
    for old in dist.glob(f"{stage.package}-*.whl"):
        old.unlink()
    run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--quiet",
         "-w", dist, stage.source_dir])
    wheels = sorted(dist.glob(f"{stage.package}-*.whl"))
    if len(wheels) != 1 or "-abi3-" not in wheels[0].name:
        raise SystemExit(f"[abi-check] expected one abi3 wheel in {dist}, found "
                         f"{[w.name for w in wheels]}")
    return wheels[0]


def venvs() -> Path:
    """Where the second torch's venvs are kept: the user's cache, shared by every clone."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "workbook" / \
        "abi-check"


def python_with_torch(version: str) -> Path:
    """A venv with torch `version` and the tests' pinned requirements, kept under venvs() by a
    hash of this interpreter's version and those pins; made once (one process at a time: a lock
    file beside it), reused while it imports them."""
    wanted = [f"torch=={version}", *pins(TEST_REQUIREMENTS)]
    digest = hashlib.sha256("\n".join([sys.version, *wanted]).encode()).hexdigest()[:12]
    folder = venvs() / f"torch-{version}-{digest}"
    python = folder / "bin" / "python"
    probe = [python, "-c", "import torch, pytest, onnxscript, onnxruntime, transformers"]
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:  # closed: unlocked
        fcntl.flock(lock, fcntl.LOCK_EX)
        if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
            say(f"torch {version}'s venv, kept: {folder}")
            return python
        say(f"creating {folder} with {' '.join(wanted)} (a minute or two; kept for next time)")
        shutil.rmtree(folder, ignore_errors=True)
        venv.create(folder, with_pip=True)
        run([python, "-m", "pip", "install", "--quiet", *wanted])
    return python


def run_tests(python: Path, wheel: Path, stage: stages.Stage) -> dict:
    """Install `wheel` beside `python`'s torch and run the stage's tests on it."""
    version = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    site = stages.build_root() / "abi-check" / f"site-{version}"
    shutil.rmtree(site, ignore_errors=True)
    run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--target", site, wheel])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO / "common")]))
    env[INSTALLED] = stage.folder
    say(f"stage {stage.number}'s tests on the wheel beside torch {version}")
    start = time.perf_counter()
    proc = subprocess.run([python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           stage.source_dir], cwd=REPO, env=env, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    with _printing:
        print(output[-4000:], flush=True)
    last = [ln for ln in output.splitlines()
            if re.search(r"\d+ (passed|failed|error|reused)", ln)]
    summary = last[-1].strip("= ") if last else f"no summary (exit {proc.returncode})"
    # A test whose result was kept (workbook.testing.pytest_results) passed on these inputs.
    passed = sum(int(n) for n in re.findall(r"(\d+) (?:passed|reused)", summary))
    torchvision_skips = sum(int(n) for n in re.findall(r"SKIPPED \[(\d+)\].*torchvision", output))
    return {"torch": version, "rc": proc.returncode, "summary": summary,
            "passed": passed, "torchvision": torchvision_skips,
            "seconds": time.perf_counter() - start, "site": site}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", default=os.environ.get("TORCH") or SECOND_TORCH,
                        help=f"the second torch version (default {SECOND_TORCH})")
    args = parser.parse_args(argv)
    # The wheel checked across versions is the CPU build of the same sources: the second torch is
    # a CPU build, beside which a library linked to libtorch_cuda's shims and the CUDA runtime
    # cannot load. So no CUDA kernels in it, and none tested (the emulated device would test a
    # build of its own, not this wheel): the CUDA tests say so as they skip, in both runs alike.
    os.environ["WORKBOOK_NO_CUDA"] = "1"
    os.environ["WORKBOOK_CUDA"] = "off"
    # Every change to the environment is made here, before the threads below start: a thread's
    # subprocess hands the child the C library's environment, which a write from another thread
    # can move under it (then the child's execve fails: "Bad address").
    compiler.compiler_cache()
    stage = next(s for s in stages.all_stages() if s.folder.endswith("_stable_abi"))
    import torch

    # Side by side, as each is mostly one process on one core: the second torch's venv is made
    # while the wheel builds, and each torch's run starts as soon as it has the wheel and its venv.
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        second_python = pool.submit(python_with_torch, args.torch)
        say(f"building {stage.label}'s wheel once, with torch {torch.__version__}")
        wheel = build_wheel(stage)
        say(f"the one wheel: {wheel.relative_to(REPO)}")
        runs = [pool.submit(run_tests, Path(sys.executable), wheel, stage),
                pool.submit(lambda: run_tests(second_python.result(), wheel, stage))]
        results = [r.result() for r in runs]
    say(f"one wheel, {wheel.name}, no rebuild between the runs:")
    for r in results:
        say(f"  torch {r['torch']:<14} {r['summary']}  ({r['seconds']:.0f} s)")
    first, second = results
    allowed = abs(first["torchvision"] - second["torchvision"])
    failed = [r for r in results if r["rc"] != 0]
    if failed:
        say(f"FAILED: the tests failed under torch {', '.join(r['torch'] for r in failed)}")
        return 1
    if abs(first["passed"] - second["passed"]) > allowed:
        say(f"FAILED: {first['passed']} passed under torch {first['torch']}, {second['passed']} "
            f"under {second['torch']}: more than the {allowed} torchvision comparisons apart")
        return 1
    say("ok: the same binary passes the same tests under both")
    return 0


if __name__ == "__main__":
    sys.exit(main())
