"""Build helpers shared by every stage's setup.py, the JIT stage, the tests and the Makefile.

One place decides where builds go, which headers and flags every extension gets, and how a stage
is built and imported:

* everything built lands under ``build/`` at the repository root (``WORKBOOK_BUILD_DIR``
  overrides it): ahead-of-time builds in ``build/stages/<stage>``, JIT builds in ``build/jit``;
* every extension sees ``common/include`` (``#include "workbook/checks.h"``) and is compiled with
  torch's C++11 ABI setting, spelled out so it can be read (and, for the ABI lesson, flipped with
  ``WORKBOOK_CXX11_ABI=0|1``);
* ``MAX_JOBS`` is honoured; when unset, it defaults to the number of cores.

Run ``python -m workbook.build 1`` (with ``common/`` on ``sys.path``) to build stage 1 by hand.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMON_INCLUDE = REPO / "common" / "include"
STAGES_DIR = REPO / "stages"


def build_root() -> Path:
    """The one folder every build output and JIT cache lives under (git-ignored)."""
    return Path(os.environ.get("WORKBOOK_BUILD_DIR", REPO / "build")).resolve()


@dataclasses.dataclass(frozen=True)
class Stage:
    number: int
    folder: str  # folder name under stages/
    package: str  # importable Python package the stage provides
    kind: str  # "setup" (built ahead of time with setup.py), "jit" (built when imported)
    cuda: bool = False  # needs a CUDA toolkit to build

    @property
    def source_dir(self) -> Path:
        return STAGES_DIR / self.folder

    @property
    def build_dir(self) -> Path:
        return build_root() / "stages" / self.folder

    @property
    def lib_dir(self) -> Path:
        """Where `setup.py build` puts the importable package (Python files and the .so)."""
        return self.build_dir / "lib"


STAGES = {
    1: Stage(1, "01_z2xy", "z2xy", "setup"),
    2: Stage(2, "02_lltm_cpp", "lltm_cpp", "setup"),
    3: Stage(3, "03_jit", "lltm_jit", "jit"),
}


def stage(number_or_folder: int | str) -> Stage:
    for s in STAGES.values():
        if number_or_folder in (s.number, s.folder, str(s.number)):
            return s
    known = ", ".join(f"{s.number} ({s.folder})" for s in STAGES.values())
    raise ValueError(f"unknown stage {number_or_folder!r}; known stages: {known}")


# ----------------------------------------------------------------------------------------------
# Flags


def include_dirs() -> list[str]:
    return [str(COMMON_INCLUDE)]


def torch_cxx11_abi() -> int:
    """The C++11 ABI setting torch was built with (1 on every recent Linux wheel)."""
    import torch

    return int(torch._C._GLIBCXX_USE_CXX11_ABI)


def cxx11_abi() -> int:
    """The ABI setting extensions are built with: torch's, unless WORKBOOK_CXX11_ABI forces one.

    Forcing the other value reproduces the classic `undefined symbol` import failure on purpose;
    scripts/fix_abi.sh repairs it.
    """
    forced = os.environ.get("WORKBOOK_CXX11_ABI", "").strip()
    if forced in ("0", "1"):
        return int(forced)
    if forced:
        raise ValueError(f"WORKBOOK_CXX11_ABI must be 0 or 1, got {forced!r}")
    return torch_cxx11_abi()


def abi_flag() -> str:
    return f"-D_GLIBCXX_USE_CXX11_ABI={cxx11_abi()}"


def cxx_flags() -> list[str]:
    """Host compiler flags for every extension. The C++ standard is left to torch, which asks for
    the one its headers need (C++17 up to torch 2.9, C++20 since)."""
    return ["-O3", abi_flag()]


def max_jobs() -> str:
    """Parallel compile jobs: MAX_JOBS when set, else the number of cores."""
    value = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
    os.environ["MAX_JOBS"] = value  # torch's ninja build reads it from the environment
    return value


def setup_options(folder: str) -> dict:
    """setuptools options that keep build/ and *.egg-info out of the source tree."""
    base = build_root() / "stages" / folder
    base.mkdir(parents=True, exist_ok=True)
    return {
        "build": {"build_base": str(base), "build_lib": str(base / "lib")},
        "egg_info": {"egg_base": str(base)},
    }


def jit_dir(name: str) -> Path:
    """Build folder of one JIT-compiled extension; also points TORCH_EXTENSIONS_DIR at build/jit."""
    root = build_root() / "jit"
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root))
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    return path


# ----------------------------------------------------------------------------------------------
# Building and importing a stage


def _sources(s: Stage) -> list[Path]:
    """Every file whose change must trigger a rebuild of stage s."""
    patterns = ("*.cpp", "*.cu", "*.h", "*.cuh", "*.py")
    files = [p for pat in patterns for p in s.source_dir.rglob(pat)]
    files += [p for p in COMMON_INCLUDE.rglob("*") if p.is_file()]
    files.append(Path(__file__))
    return files


def _built_libraries(s: Stage) -> list[Path]:
    return list((s.lib_dir / s.package).glob("*.so")) if s.lib_dir.is_dir() else []


def build_record() -> str:
    """What a library is built with; a stage whose record differs from this is out of date.

    Mtimes alone miss a change of flags: a library built with WORKBOOK_CXX11_ABI=0 would still
    look up to date once the switch is unset, and so would one built against another torch.
    """
    import torch

    return f"torch {torch.__version__}\ncxx_flags {' '.join(cxx_flags())}\n"


def _record_file(s: Stage) -> Path:
    """build/stages/<stage>/build-flags.txt: the build_record() of the library in lib/."""
    return s.build_dir / "build-flags.txt"


def is_up_to_date(s: Stage) -> bool:
    libs = _built_libraries(s)
    if not libs:
        return False
    record = _record_file(s)
    if not record.is_file() or record.read_text() != build_record():
        return False
    built = min(p.stat().st_mtime for p in libs)
    return all(p.stat().st_mtime <= built for p in _sources(s))


def _first_errors(log: Path, limit: int = 12) -> str:
    """The first compiler errors of a build log: what a reader needs, not the Python traceback."""
    lines = log.read_text(errors="replace").splitlines()
    errors = [ln for ln in lines if "error" in ln.lower() and not ln.lstrip().startswith("File ")]
    shown = errors[:limit] or lines[-limit:]
    return "--- first errors ---\n" + "\n".join(shown)


def build_stage(number_or_folder: int | str, *, quiet: bool = False, force: bool = False) -> Path:
    """Build a setup.py stage under build/ and return the folder to put on sys.path.

    A no-op when the built library is newer than every source. The compiler's output goes to
    build/stages/<stage>/build.log; on failure its tail is raised with the error.
    """
    s = stage(number_or_folder)
    if s.kind != "setup":
        raise ValueError(f"stage {s.number} ({s.folder}) is built when imported, not with setup.py")
    if not force and is_up_to_date(s):
        if not quiet:
            print(f"[build] stage {s.number} ({s.folder}) is up to date in {s.lib_dir}")
        return s.lib_dir
    s.build_dir.mkdir(parents=True, exist_ok=True)
    tools_on_path()
    log = s.build_dir / "build.log"
    _record_file(s).unlink(missing_ok=True)
    env = dict(os.environ, MAX_JOBS=max_jobs())
    if not quiet:
        print(
            f"[build] stage {s.number} ({s.folder}): compiling with MAX_JOBS={env['MAX_JOBS']}, "
            f"log in {log.relative_to(REPO) if log.is_relative_to(REPO) else log} ...",
            flush=True,
        )
    start = time.perf_counter()
    cmd = [sys.executable, "setup.py", "build"] + (["--force"] if force else [])
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=s.source_dir, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(
            f"building stage {s.number} ({s.folder}) failed (exit {proc.returncode}); "
            f"full log: {log}\n{_first_errors(log)}"
        )
    _record_file(s).write_text(build_record())
    if not quiet:
        print(f"[build] stage {s.number} ({s.folder}) built in {time.perf_counter() - start:.1f} s")
    return s.lib_dir


def tools_on_path() -> None:
    """Put this interpreter's bin folder first on PATH: torch runs `ninja` by name, and a venv's
    ninja lives there even when the venv is not activated."""
    bin_dir = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def import_stage(number_or_folder: int | str, *, quiet: bool = True):
    """Build stage N if needed and import its package. JIT stages build themselves on import."""
    s = stage(number_or_folder)
    tools_on_path()
    path = build_stage(s.number, quiet=quiet) if s.kind == "setup" else s.source_dir
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    return importlib.import_module(s.package)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Build workbook stages under build/.")
    parser.add_argument("stage", help="stage number (1-5), folder name, or `all`")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    targets = list(STAGES.values()) if args.stage == "all" else [stage(args.stage)]
    for s in targets:
        if s.kind == "jit":
            print(f"[build] stage {s.number} ({s.folder}) compiles just in time when imported; "
                  f"importing it (cached under {build_root() / 'jit'}) ...", flush=True)
            start = time.perf_counter()
            import_stage(s.number)
            print(f"[build] stage {s.number} ({s.folder}) ready in "
                  f"{time.perf_counter() - start:.1f} s")
        else:
            build_stage(s.number, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
