"""Build helpers shared by every stage's setup.py, the JIT stage, the tests and the Makefile.

One place decides where builds go, which headers and flags every extension gets, and how a stage
is built and imported:

* everything built lands under ``build/`` at the repository root (``WORKBOOK_BUILD_DIR``
  overrides it): ahead-of-time builds in ``build/stages/<stage>``, JIT builds in ``build/jit``;
* every extension sees ``common/include`` (``#include "workbook/checks.h"``) and is compiled with
  torch's C++11 ABI setting, spelled out so it can be read (and, for the ABI lesson, flipped with
  ``WORKBOOK_CXX11_ABI=0|1``);
* ``MAX_JOBS`` is honoured; when unset, it defaults to the number of cores;
* CUDA stages build with the toolkit `workbook.toolkit` finds (``CUDA_HOME`` is set for torch),
  for the GPUs that are visible, or for sm_90 plus its PTX when none is
  (``TORCH_CUDA_ARCH_LIST``); where no toolkit is found they are skipped with the reason, or
  built CPU-only where their stage.toml says ``cpu_fallback = true``;
* a built library records what it was built with (torch, flags, GPU architectures, CPU
  instruction set): a change of any of them rebuilds it, as a change of a source does.

The stages themselves are found on disk by `workbook.stages`. ``python -m workbook.build 1``
builds stage 1 by hand; ``python -m workbook.build all`` builds every stage.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import stages
from .stages import REPO, Stage, build_root

COMMON_INCLUDE = REPO / "common" / "include"


class StageSkipped(RuntimeError):
    """A stage this machine cannot build (a CUDA stage without a CUDA toolkit); says why."""


class StageConflict(ImportError):
    """Two stages provide the same package, and one of them is already imported in this process.

    A package (and, for torch.library stages, its op namespace) can be loaded once per process:
    run the other stage's tests in a process of its own, as `make test` does.
    """


def stage(number_or_folder: int | str | Stage) -> Stage:
    """A stage by number, folder name or path (see workbook.stages.get)."""
    return stages.get(number_or_folder)


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
    the one its headers need (C++17 up to torch 2.9, C++20 since).

    -g0: setuptools compiles with Python's own CFLAGS, -g among them, and debug information for
    the thousands of torch declarations a file includes is a third of its compile time (stage
    01's bindings.cpp: 50 s with -g, 34 s without, on 2 cores here). ``WORKBOOK_DEBUG=1`` keeps
    it, for gdb; `make sanitize` asks for line tables (-g1) of its own.
    """
    debug = os.environ.get("WORKBOOK_DEBUG", "").strip() not in ("", "0")
    return ["-O3", abi_flag(), *([] if debug else ["-g0"])] + sanitizer_flags()


def sanitizer_flags() -> list[str]:
    """With ``WORKBOOK_SANITIZE=1`` (set by `make sanitize`, see workbook.sanitize): compile the
    host C++ with AddressSanitizer and UndefinedBehaviorSanitizer; otherwise nothing.

    -O1 (it comes after -O3, so it wins) and -g1 (line tables) keep the reports' stacks readable
    at no extra compile time over the ordinary build. Beyond -fsanitize=undefined:
    float-cast-overflow, which gcc leaves out of `undefined`, catches a float converted to an
    integer it does not fit (a sampling position turned into an index); -fno-wrapv undoes the
    -fwrapv that setuptools copies from Python's own CFLAGS, under which a signed overflow wraps
    silently and UBSan does not look for it (an index that wraps is a bug all the same, and the
    just-in-time and nvcc builds do not wrap). Undefined behaviour stops the process at its first
    report, as a memory error does. The library is not linked against the sanitizer runtimes:
    they are preloaded into Python (LD_PRELOAD), as they must be anyway for an uninstrumented
    interpreter, and resolve the instrumentation's calls when the library loads. nvcc's device
    code is never instrumented.
    """
    if os.environ.get("WORKBOOK_SANITIZE", "").strip() in ("", "0"):
        return []
    return ["-O1", "-g1", "-fsanitize=address,undefined,float-cast-overflow", "-fno-wrapv",
            "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined,float-cast-overflow"]


def openmp_flags() -> list[str]:
    """Compile and link flags for at::parallel_for in an extension's own code.

    torch's parallel_for is OpenMP inlined from its headers (when torch is built with OpenMP, as
    every Linux wheel is): the extension must be compiled with -fopenmp or the loop runs serially.
    Linking with -fopenmp adds libgomp.so.1, the same library torch already loaded.
    """
    import torch

    openmp = "OpenMP" in torch.__config__.parallel_info() and sys.platform.startswith("linux")
    return ["-fopenmp"] if openmp else []


def cpu_simd_flags() -> list[str]:
    """Flags that let an extension's own CPU loops use at::vec::Vectorized at full width.

    ATen compiles its kernels once per instruction set and picks one at run time; an extension
    compiled with plain flags gets Vectorized's portable fallback, a scalar loop. These select
    the Vectorized that ATen itself runs on this machine (torch.backends.cpu.get_cpu_capability():
    AVX512, 16 floats a vector, or AVX2, 8), whose exp and tanh come from the SLEEF library
    inside libtorch_cpu. The result then needs that instruction set to run, like a -march=native
    build: fine for an extension built where it runs, as these are. ``WORKBOOK_CPU_SIMD=0`` turns
    it off; ``WORKBOOK_CPU_SIMD=AVX2`` caps it at AVX2.
    """
    choice = os.environ.get("WORKBOOK_CPU_SIMD", "1").upper()
    if choice == "0":
        return []
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512" and choice != "AVX2":
        isa = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
    elif capability in ("AVX512", "AVX2"):
        capability, isa = "AVX2", ["-mavx2", "-mfma", "-mf16c"]
    else:
        return []
    # ATen's vec headers say `#pragma unroll` (meant for nvcc), which gcc warns about.
    return isa + [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}",
                  "-Wno-unknown-pragmas"]


def nvcc_flags() -> list[str]:
    """nvcc flags for every CUDA extension (torch adds -std and the -gencode flags).

    -O3 for the device code; -lineinfo maps SASS back to source lines in Nsight Compute at no
    run-time cost. No --use_fast_math: the LLTM kernels are memory-bound, so the faster but less
    accurate exp/tanh would buy no time, and the kernels would drift from the CPU path.
    """
    return ["-O3", "-lineinfo", abi_flag()]


def cuda_arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST: as set, else the visible GPUs' architectures, else "9.0+PTX".

    Without it, torch compiles for the visible GPUs or, with none visible, for every
    architecture it supports: slow, and pointless on a build machine with no GPU.

    With GPUs visible, the library holds machine code (SASS) for exactly their architectures.
    With none, it is built for Hopper (sm_90, the H100 and H200) plus the PTX of compute_90:
    SASS runs only on its own GPU generation (sm_90 code does not load on an sm_100 Blackwell or
    an sm_80 Ampere: "no kernel image is available"), while PTX is compiled by the driver, on
    first use, for any GPU of compute capability 9.0 or newer. A GPU older than 9.0 needs a
    build for it: set TORCH_CUDA_ARCH_LIST (say "8.0;8.6"), or build where it is visible.
    """
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    import torch

    if torch.cuda.is_available():
        archs = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return ";".join(f"{major}.{minor}" for major, minor in sorted(archs))
    return "9.0+PTX"


def cuda_toolkit():
    """Find the CUDA toolkit and set up the environment to build with it: CUDA_HOME (before
    torch.utils.cpp_extension is imported), TORCH_CUDA_ARCH_LIST, MAX_JOBS. Returns the
    workbook.toolkit.Toolkit, or None when there is none (`toolkit.reason()` says why)."""
    from . import toolkit

    found = toolkit.use()
    if found is not None:
        os.environ["TORCH_CUDA_ARCH_LIST"] = cuda_arch_list()
        max_jobs()
    return found


def max_jobs() -> str:
    """Parallel compile jobs: MAX_JOBS when set, else the number of cores."""
    value = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
    os.environ["MAX_JOBS"] = value  # torch's ninja build reads it from the environment
    return value


def setup_options(setup_file: str | Path) -> dict:
    """setuptools options that keep build/ and *.egg-info out of the source tree: a stage's
    setup.py passes its own path (``__file__``), and its build goes to build/stages/<folder>."""
    path = Path(setup_file).resolve()
    folder = path.parent if path.suffix == ".py" else path
    base = (stages.read(folder).build_dir if (folder / "stage.toml").is_file()
            else build_root() / "stages" / folder.name)
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
    """Every file whose change must trigger a rebuild of stage s (its tests are not among them)."""
    patterns = ("*.cpp", "*.cu", "*.h", "*.cuh", "*.py")
    files = [p for folder in s.source_dirs for pat in patterns for p in folder.rglob(pat)
             if not p.name.startswith("test_")]
    files += [p for p in COMMON_INCLUDE.rglob("*") if p.is_file()]
    files.append(Path(__file__))
    return files


def _built_libraries(s: Stage) -> list[Path]:
    return list((s.lib_dir / s.package).glob("*.so")) if s.lib_dir.is_dir() else []


def _toolkit_for(s: Stage):
    """The CUDA toolkit stage s builds with: None for a stage without CUDA sources, for a
    CPU-only build (Stage.cpu_only_build()), and where none is found."""
    return cuda_toolkit() if s.cuda and not s.cpu_only else None


def _toolkit_used(s: Stage) -> str:
    """The CUDA toolkit a CUDA stage builds with now ("none": CPU-only), to rebuild on a change."""
    found = _toolkit_for(s)
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
    import torch

    record = (f"torch {torch.__version__}\ncxx_flags {' '.join(cxx_flags())}\n"
              f"cpu_simd_flags {' '.join(cpu_simd_flags()) or 'none'}\n")
    if s is not None and s.cuda:
        found = _toolkit_for(s)  # sets TORCH_CUDA_ARCH_LIST, as the build does
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
    record = _record_file(s)
    if not record.is_file() or record.read_text() != build_record(s):
        return False
    if s.cuda:
        stamp = _toolkit_stamp(s)
        if not stamp.is_file() or stamp.read_text() != _toolkit_used(s):
            return False
    built = min(p.stat().st_mtime for p in libs)
    return all(p.stat().st_mtime <= built for p in _sources(s))


def _first_errors(log: Path, limit: int = 12) -> str:
    """The first compiler errors of a build log: what a reader needs, not the Python traceback."""
    lines = log.read_text(errors="replace").splitlines()
    errors = [ln for ln in lines if "error" in ln.lower() and not ln.lstrip().startswith("File ")]
    shown = errors[:limit] or lines[-limit:]
    return "--- first errors ---\n" + "\n".join(shown)


def build_stage(number_or_folder: int | str | Stage, *, quiet: bool = False,
                force: bool = False) -> Path:
    """Build a setup.py stage under build/ and return the folder to put on sys.path.

    A no-op when the built library is newer than every source. The compiler's output goes to
    build/stages/<stage>/build.log; on failure its tail is raised with the error.
    """
    s = stage(number_or_folder)
    if s.kind != "setup":
        raise ValueError(f"stage {s.number} ({s.folder}) is built when imported, not with setup.py")
    if s.cuda and _toolkit_for(s) is None:
        from . import toolkit

        why = "asked for" if s.cpu_only and not stages.cuda_disabled() else toolkit.reason()
        if not s.cpu_fallback:
            raise StageSkipped(f"stage {s.number} ({s.folder}) skipped: CUDA only, and no CUDA "
                               f"build here ({why})")
        cpu_only = f" CPU-only, without its CUDA kernels ({why}),"
    else:
        cpu_only = ""
    if not force and is_up_to_date(s):
        if not quiet:
            print(f"[build] stage {s.number} ({s.folder}) is up to date in {s.lib_dir}")
        return s.lib_dir
    s.build_dir.mkdir(parents=True, exist_ok=True)
    if force:  # every object too, not only the library
        for temp in s.build_dir.glob("temp.*"):
            shutil.rmtree(temp)
    tools_on_path()
    log = s.build_dir / "build.log"
    _record_file(s).unlink(missing_ok=True)
    env = dict(os.environ, MAX_JOBS=max_jobs())
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
        raise RuntimeError(
            f"building stage {s.number} ({s.folder}) failed (exit {proc.returncode}); "
            f"full log: {log}\n{_first_errors(log)}"
        )
    if s.cuda:
        _toolkit_stamp(s).write_text(_toolkit_used(s))
    _record_file(s).write_text(build_record(s))
    if not quiet:
        print(f"[build] stage {s.number} ({s.folder}) built in {time.perf_counter() - start:.1f} s")
    return s.lib_dir


def tools_on_path() -> None:
    """Put this interpreter's bin folder first on PATH: torch runs `ninja` by name, and a venv's
    ninja lives there even when the venv is not activated. Set up the compiler cache too."""
    bin_dir = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    compiler_cache()


def compiler_cache() -> str:
    """The compiler cache the builds use, set up; in words, for the build's first line.

    torch's extension builder puts ccache (or sccache) in front of g++ and nvcc wherever it is
    on PATH (torch 2.13.0 and 2.14.1 do, since pytorch PR 175696): a file compiled once is not
    compiled again, in this clone or another, until it or its flags change. For hits across
    clones, paths under the repository are taken relative to it (CCACHE_BASEDIR; the venv lives
    there too) and the working directory is not hashed (CCACHE_NOHASHDIR). Not required:
    without it every clean build compiles everything (apt install ccache, brew install ccache,
    conda install ccache).
    """
    if shutil.which("ccache"):
        # ccache 4 takes CCACHE_DISABLE as true when set to anything (0, false and no it refuses).
        disabled = os.environ.get("CCACHE_DISABLE")
        if disabled is not None and disabled.lower() not in ("0", "false", "disable", "no"):
            return "ccache, disabled (CCACHE_DISABLE is set): every file is compiled"
        os.environ.setdefault("CCACHE_BASEDIR", str(REPO))
        os.environ.setdefault("CCACHE_NOHASHDIR", "1")
        return "ccache (torch puts it before the compiler)"
    if shutil.which("sccache"):
        return "sccache (torch puts it before the compiler)"
    return "none (`apt install ccache` makes a second clean build of the same files fast)"


def prepare() -> None:
    """Set up what torch's extension builder reads from the environment, before it is imported:
    this interpreter's ninja first on PATH, and CUDA_HOME where a matching toolkit is found
    (torch picks CUDA_HOME once, at import; its own guess from a wrapper nvcc can be wrong).
    (Its "No CUDA runtime is found" notice on a machine without a GPU is filtered out by the
    workbook package's __init__.)"""
    tools_on_path()
    cuda_toolkit()


def import_stage(number_or_folder: int | str | Stage, *, quiet: bool = True):
    """Build stage N if needed and import its package. JIT stages build themselves on import.

    Where the CUDA tests run on the emulated device (workbook.emulate, once the test base asked
    for it with emulate.cuda_device()), a CUDA stage's kernels are built for it too: as an
    add-on registered beside the package's own kernels, or, for a stage whose .cu files are
    launchers behind a C++ front (stage 04), as an emulated copy of the package, which is then
    the one imported.

    Raises StageConflict when another stage's package of the same name is already imported
    (a copied stage, or stages 06 and 07, which both build `extops`): one per process.
    """
    from . import emulate

    s = stage(number_or_folder)
    # A test that calls the op thousands of times, as gradcheck does, comes here on each call:
    # a stage this function has imported already is returned before anything is looked over
    # (the emulated build's plan reads every .cu file, a few ms). A library rebuilt now could
    # not replace the one loaded anyway.
    imported = _imported.get(s.folder)
    if imported is not None and sys.modules.get(s.package) is imported:
        return imported
    tools_on_path()
    emulated = s.cuda and emulate.wanted()
    whole = emulated and emulate.plan(s).whole
    loaded = sys.modules.get(s.package)
    if loaded is not None and not whole:
        # Imported already, from this stage's build (by a test's own import, say).
        origin = Path(getattr(loaded, "__file__", None) or "/").resolve()
        if origin.is_relative_to((s.lib_dir if s.kind == "setup" else s.source_dir).resolve()):
            if emulated:
                emulate.load_stage(s)  # loaded once per process; a lookup from then on
            _imported[s.folder] = loaded
            return loaded
    if whole:
        path = emulate.load_stage(s)
    else:
        path = build_stage(s, quiet=quiet) if s.kind == "setup" else s.source_dir
    loaded = sys.modules.get(s.package)
    if loaded is not None:
        origin = Path(getattr(loaded, "__file__", None) or "/").resolve()
        if not origin.is_relative_to(path.resolve()):
            raise StageConflict(
                f"{s.label} provides the package `{s.package}`, which this process has already "
                f"imported from {origin.parent}; a package loads once per process, so test this "
                f"stage in a process of its own (`make stage {s.number}`)")
    else:
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
        loaded = importlib.import_module(s.package)
    if emulated and not whole:
        emulate.load_stage(s)  # after the package: its ops must be defined first
    _imported[s.folder] = loaded
    return loaded


_imported: dict[str, object] = {}  # stage folder -> its package, as import_stage returned it


def _build_one(s: Stage, *, force: bool = False, require_cuda: bool = False) -> int:
    """Build (or, for a JIT stage, import) one stage, printing what happens; the exit status."""
    if s.kind == "jit":
        print(f"[build] stage {s.number} ({s.folder}) compiles just in time when imported; "
              f"importing it (cached under {build_root() / 'jit'}) ...", flush=True)
        start = time.perf_counter()
        try:
            import_stage(s)
        except Exception as error:  # a compile error surfaces as an ImportError or RuntimeError
            print(f"[build] {s.label} failed to build: {error}")
            return 1
        print(f"[build] stage {s.number} ({s.folder}) ready in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        return 0
    try:
        build_stage(s, force=force)
    except StageSkipped as skipped:
        print(f"[build] {skipped}", flush=True)
        return 1 if require_cuda else 0
    except RuntimeError as error:
        print(f"[build] {error}", flush=True)
        return 1
    return 0


def _weight(s: Stage) -> int:
    """A rough cost of building s, to start the longest builds first: its translation units,
    a .cu file (nvcc, for one or more GPU architectures) counting as three."""
    if s.kind == "jit":
        return 1
    units = [p for folder in s.source_dirs for pat in ("*.cpp", "*.cu") for p in folder.rglob(pat)]
    with_cuda = _toolkit_for(s) is not None
    return sum(3 if p.suffix == ".cu" else 1 for p in units if with_cuda or p.suffix != ".cu")


@dataclasses.dataclass
class _Task:
    """One build of build_side_by_side: a command, run in a process of its own."""

    label: str
    command: list[str]
    weight: int
    env: dict[str, str] = dataclasses.field(default_factory=dict)


def _tasks(targets: list[Stage], *, force: bool, require_cuda: bool,
           emulated: bool) -> list[_Task]:
    tasks = []
    for s in targets:
        if not force and s.kind != "jit" and is_up_to_date(s):
            print(f"[build] {s.label} is up to date in {s.lib_dir}")
            continue
        command = [sys.executable, "-m", "workbook.build", str(s.source_dir)]
        command += ["--force"] * force + ["--require-cuda"] * require_cuda
        tasks.append(_Task(s.label, command, _weight(s),
                           {"WORKBOOK_NO_CUDA": "1"} if s.cpu_only else {}))
    for s in targets if emulated else []:
        if s.cuda:  # its .cu files for the emulated device (host code), as its tests will load
            units = [p for folder in s.source_dirs for p in folder.rglob("*.cu")]
            tasks.append(_Task(f"{s.label}, emulated", [sys.executable, "-m", "workbook.emulate",
                                                         "build", str(s.source_dir)],
                               2 * len(units)))
    return tasks


def build_side_by_side(targets: list[Stage], *, force: bool = False,
                       require_cuda: bool = False, emulated: bool = False) -> int:
    """Build several stages at the same time, each in a process of its own; the exit status.

    A stage is a chain of compiles, and one that has a single file (stage 01) keeps one core
    busy however many there are: so the stages are built side by side, as many at a time as
    MAX_JOBS allows, each with twice its share of MAX_JOBS. At most twice MAX_JOBS compilers run
    at once, and the stage still compiling when the others are done is not left with one job.
    The longest builds start first. Each stage writes its compiler output to its own build.log,
    and its lines of progress here. `emulated`: the CUDA stages' kernels for the emulated CUDA
    device too (workbook.emulate), which their tests would otherwise compile one after the
    other when they first need them.
    """
    tasks = _tasks(targets, force=force, require_cuda=require_cuda, emulated=emulated)
    slots = int(max_jobs())
    at_once = max(1, min(slots, len(tasks)))
    jobs = str(max(1, min(slots, 2 * slots // at_once)))
    queue = sorted(tasks, key=lambda task: task.weight, reverse=True)
    if len(queue) > 1:
        print(f"[build] {len(queue)} builds side by side, {at_once} at a time with MAX_JOBS="
              f"{jobs} each, the longest first; compiler cache: {compiler_cache()}", flush=True)
    start = time.perf_counter()
    running: dict[subprocess.Popen, _Task] = {}
    failed = []
    while queue or running:
        while queue and len(running) < at_once:
            task = queue.pop(0)
            env = dict(os.environ, MAX_JOBS=jobs, **task.env)
            running[subprocess.Popen(task.command, env=env)] = task
        time.sleep(0.2)
        for proc in [p for p in running if p.poll() is not None]:
            if proc.returncode:
                failed.append(running[proc].label)
                print(f"[build] {running[proc].label}: FAILED (see above)", flush=True)
            del running[proc]
    if len(tasks) > 1:
        print(f"[build] {len(tasks)} builds done in {time.perf_counter() - start:.1f} s"
              + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Build workbook stages under build/.")
    parser.add_argument("stage", help="stage number, folder name or path, or `all`")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--require-cuda", action="store_true",
                        help="exit 1 when a CUDA stage cannot be built with its CUDA kernels "
                        "(skipped, or CPU-only): what a GPU machine's check wants")
    args = parser.parse_args(argv)
    targets = stages.all_stages() if args.stage == "all" else [stage(args.stage)]
    if args.require_cuda and any(s.cuda for s in targets) and cuda_toolkit() is None:
        from . import toolkit

        print(f"[build] no CUDA toolkit for the CUDA stages: {toolkit.reason()}")
        return 1
    if len(targets) > 1:
        from . import emulate

        # `make test` builds all: where the CUDA tests will run on the emulated device, its
        # kernels are built here too, side by side with the rest.
        return build_side_by_side(targets, force=args.force, require_cuda=args.require_cuda,
                                  emulated=args.stage == "all" and emulate.active())
    return _build_one(targets[0], force=args.force, require_cuda=args.require_cuda)


if __name__ == "__main__":
    sys.exit(main())
