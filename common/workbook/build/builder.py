"""Building one stage with its setup.py, under build/, and knowing when it must be built again.

* ahead-of-time builds land in ``build/stages/<stage>`` (a CUDA stage built CPU-only in
  ``build/stages-cpu/<stage>``), with the compiler's output in its build.log;
* a built library records what it was built with (torch, flags, GPU architectures, CPU
  instruction set): a change of any of them rebuilds it, as a change of a source does;
* where no CUDA toolkit is found a CUDA stage is skipped with the reason (StageSkipped), or built
  CPU-only where its stage.toml says ``cpu_fallback = true``.

``python -m workbook.build N`` builds stage N by hand (workbook.build.side_by_side: several at
once); `workbook.build.loader` builds a stage when a test imports it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from workbook.build import compiler, stages, toolkit
from workbook.build.compiler import (
    COMMON_INCLUDE,
    cpu_simd_flags,
    cuda_arch_list,
    cuda_toolkit,
    cxx_flags,
    max_jobs,
    nvcc_flags,
    tools_on_path,
)
from workbook.build.stages import REPO, Stage
from workbook.measure import runlog


class StageSkipped(RuntimeError):
    """A stage this machine cannot build (a CUDA stage without a CUDA toolkit); says why."""


class BuildFailed(RuntimeError):
    """The compiler refused a build; the message gives its first errors. Nothing an earlier
    build left is loaded in its place."""


# The builds that failed in this process: build folder -> (its sources' modification times, the
# message). Each test imports its stage, so a stage whose build fails would be compiled again,
# and fail again, once per test; until a source changes, a later build fails at once alike.
_failed: dict[str, tuple[tuple, str]] = {}


def _sources_state(s: Stage) -> tuple:
    return tuple(sorted((str(p), p.stat().st_mtime_ns) for p in _sources(s)))


def _sources(s: Stage) -> list[Path]:
    """Every file whose change must trigger a rebuild of stage s (its tests are not among them)."""
    patterns = ("*.cpp", "*.cu", "*.h", "*.cuh", "*.py")
    files = [p for folder in s.source_dirs for pat in patterns for p in folder.rglob(pat)
             if not p.name.startswith("test_")]
    files += [p for p in COMMON_INCLUDE.rglob("*") if p.is_file()]
    files.append(Path(compiler.__file__))  # the flags every build is compiled with
    return files


def _built_libraries(s: Stage) -> list[Path]:
    return list((s.lib_dir / s.package).glob("*.so")) if s.lib_dir.is_dir() else []


def toolkit_for(s: Stage):
    """The CUDA toolkit stage s builds with: None for a stage without CUDA sources, for a
    CPU-only build (Stage.cpu_only_build()), and where none is found."""
    return cuda_toolkit() if s.cuda and not s.cpu_only else None


def _toolkit_used(s: Stage) -> str:
    """The CUDA toolkit a CUDA stage builds with now ("none": CPU-only), to rebuild on a change."""
    found = toolkit_for(s)
    return str(found.home) if found else "none"


def _toolkit_stamp(s: Stage) -> Path:
    return s.build_dir / "cuda_toolkit.txt"


def build_record(s: Stage | None = None) -> str:
    """What stage s's library is built with; a stage whose record differs from this is out of
    date.

    Mtimes alone miss a change of flags: a library built with WORKBOOK_CXX11_ABI=0 would still
    look up to date once the switch is unset, and so would one built against another torch, for
    another GPU (TORCH_CUDA_ARCH_LIST: a library for sm_90 has no kernel an sm_80 GPU can run) or
    for another CPU (cpu_simd_flags(): an AVX-512 build dies with "illegal instruction" on an
    AVX2 machine). The architectures are recorded for a CUDA stage only, as its build uses them
    ("none" when it builds CPU-only, without a toolkit); the SIMD flags for every stage, which
    costs a stage that does not use them a rebuild on another CPU, and nothing else.
    """
    record = (f"torch {compiler.torch_facts()['version']}\ncxx_flags {' '.join(cxx_flags())}\n"
              f"cpu_simd_flags {' '.join(cpu_simd_flags()) or 'none'}\n")
    if s is not None and s.cuda:
        found = toolkit_for(s)  # sets TORCH_CUDA_ARCH_LIST, as the build does
        record += (f"cuda_arch_list {cuda_arch_list()}\nnvcc_flags {' '.join(nvcc_flags())}\n"
                   if found else "cuda_arch_list none (CPU-only build)\n")
    return record


def _record_file(s: Stage) -> Path:
    """build/stages/<stage>/build-flags.txt: the build_record() of the library in lib/."""
    return s.build_dir / "build-flags.txt"


def is_up_to_date(s: Stage) -> bool:
    libs = _built_libraries(s)
    if not libs:
        return False
    # The sources first: an edited file says no without the record, which loads torch.
    built = min(p.stat().st_mtime for p in libs)
    if any(p.stat().st_mtime > built for p in _sources(s)):
        return False
    record = _record_file(s)
    if not record.is_file() or record.read_text() != build_record(s):
        return False
    if s.cuda:
        stamp = _toolkit_stamp(s)
        if not stamp.is_file() or stamp.read_text() != _toolkit_used(s):
            return False
    return True


def first_errors(text: str, limit: int = 12, where: Path | None = None) -> str:
    """The first compiler errors of a build's output: what a reader needs, not the Python
    traceback or the command lines (ninja's `[1/2] c++ ...`, whose flags may say -Werror).
    `where`: the folder the compiler ran in; the paths it gave relative to it are shown from the
    repository (the compiler cache hands the compiler relative paths: ../../../../stages/...)."""
    lines = text.splitlines()
    errors = [ln for ln in lines if "error" in ln.lower() and not ln.lstrip().startswith("File ")
              and not re.search(r"\[\d+/\d+\] ", ln)]
    # Each error once: a template's body fails alike in every instantiation (one per dtype).
    shown = list(dict.fromkeys(errors))[:limit] or lines[-limit:]
    if where is not None:
        shown = [_RELATIVE.sub(lambda m: _from_repo(where, m.group(0)), ln) for ln in shown]
    return "--- first errors ---\n" + "\n".join(shown)


# A path that climbs out of the folder it is relative to: ../../x/y.cpp
_RELATIVE = re.compile(r"(?<![\w./-])(?:\.\./)+[\w.+-][\w./+-]*")


def _from_repo(where: Path, relative: str) -> str:
    """The path of file `relative` (to `where`) from the repository, absolute outside it; as
    written when there is no such file."""
    path = (where / relative).resolve()
    if not path.is_file():
        return relative
    return str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


def _first_errors(log: Path, limit: int = 12) -> str:
    """The first errors of a stage's build.log; its compiler ran in the build's temp folder."""
    temps = sorted(log.parent.glob("temp.*"))
    return first_errors(log.read_text(errors="replace"), limit, temps[0] if temps else None)


def why_cpu_only(s: Stage) -> str:
    """Why CUDA stage s is built here without its CUDA kernels (toolkit_for(s) is None)."""
    if s.cpu_only and not stages.cuda_disabled():
        if s.cpu_fallback and not stages.nvcc_wanted():
            return "WORKBOOK_NVCC=0: no GPU visible, its CUDA kernels run on the emulated device"
        return "asked for"
    return toolkit.reason()


def build_stage(number_or_folder: int | str | Stage, *, quiet: bool = False,
                force: bool = False) -> Path:
    """Build a setup.py stage under build/ and return the folder to put on sys.path.

    A no-op when the built library is newer than every source. The compiler's output goes to
    build/stages/<stage>/build.log; on failure its tail is raised with the error.
    """
    s = stages.get(number_or_folder)
    if s.kind != "setup":
        raise ValueError(f"stage {s.number} ({s.folder}) is built when imported, not with setup.py")
    if s.cuda and toolkit_for(s) is None:
        why = why_cpu_only(s)
        if not s.cpu_fallback:
            from workbook.build import emulate

            if s.cpu_only and emulate.active():  # make verify without a GPU, say
                raise StageSkipped(f"stage {s.number} ({s.folder}): no nvcc build ({why}); its "
                                   f"CUDA kernels are emulated on the CPU, built apart "
                                   f"(python -m workbook.build.emulate build {s.number}), or when "
                                   f"its tests import them")
            raise StageSkipped(f"stage {s.number} ({s.folder}) skipped: CUDA only, and no CUDA "
                               f"build here ({why})")
        cpu_only = f" CPU-only, without its CUDA kernels ({why}),"
    else:
        cpu_only = ""
    if not force and is_up_to_date(s):
        if not quiet:
            print(f"[build] stage {s.number} ({s.folder}) is up to date in {s.lib_dir}")
        return s.lib_dir
    state = _sources_state(s)
    earlier = _failed.get(str(s.build_dir))
    if earlier is not None and earlier[0] == state and not force:
        raise BuildFailed(earlier[1])
    s.build_dir.mkdir(parents=True, exist_ok=True)
    if force:  # every object too, not only the library
        for temp in s.build_dir.glob("temp.*"):
            shutil.rmtree(temp)
    tools_on_path()
    log = s.build_dir / "build.log"
    _record_file(s).unlink(missing_ok=True)
    # No sanitizer runtime under the compiler: a racecheck or sanitize process that builds a
    # stage on import (stage 04's tests build stage 02) has one preloaded, and g++ under
    # ThreadSanitizer's dies (exit 139). setup.py loads nothing instrumented.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["MAX_JOBS"] = max_jobs()
    if s.cpu_only:
        env["WORKBOOK_NO_CUDA"] = "1"  # setup.py then builds it CPU-only, into s.build_dir
    if not quiet:
        print(
            f"[build] stage {s.number} ({s.folder}): compiling{cpu_only} with MAX_JOBS="
            f"{env['MAX_JOBS']}, "
            f"log in {log.relative_to(REPO) if log.is_relative_to(REPO) else log} ...",
            flush=True,
        )
    start = time.perf_counter()
    # --force: setuptools would skip a library newer than its sources even when it was built
    # with other flags (the record says so, setuptools does not look); ninja still recompiles
    # only the objects whose source or command line changed.
    cmd = [sys.executable, "setup.py", "build", "--force"]
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=s.source_dir, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        errors = _first_errors(log)
        first = next((ln.strip() for ln in errors.splitlines() if ": error: " in ln), None)
        message = (f"building stage {s.number} ({s.folder}) failed{': ' + first if first else ''}"
                   f" (exit {proc.returncode}); full log: {log}\n{errors}")
        _failed[str(s.build_dir)] = (state, message)
        raise BuildFailed(message)
    if s.cuda:
        _toolkit_stamp(s).write_text(_toolkit_used(s))
    _record_file(s).write_text(build_record(s))
    took = time.perf_counter() - start
    runlog.record("build", s.label, took, stage=f"{s.number:02d}", flavour=_flavour(s))
    if not quiet:
        print(f"[build] stage {s.number} ({s.folder}) built in {took:.1f} s")
    return s.lib_dir


def _flavour(s: Stage) -> str:
    """What this build of s is, in the run log's words (workbook.measure.runlog)."""
    if not s.source_dir.resolve().is_relative_to(stages.STAGES_DIR.resolve()):
        return "exercise"  # a carved copy, built by make verify
    return runlog.checks_flavour() or ("host" if not s.cuda
                                       else "nvcc" if toolkit_for(s) else "cpu-only")


