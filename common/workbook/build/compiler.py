"""How every extension of the workbook is compiled: the flags, headers and tools that each stage's
setup.py, the JIT stage and the emulated CUDA device share.

* every extension sees ``common/include`` (``#include "workbook/checks.h"``) and is compiled with
  torch's C++11 ABI setting, spelled out so it can be read (and, for the ABI lesson, flipped with
  ``WORKBOOK_CXX11_ABI=0|1``);
* ``MAX_JOBS`` is honoured; when unset, it defaults to the number of cores;
* CUDA stages build with the toolkit `workbook.build.toolkit` finds (``CUDA_HOME`` is set for
  torch), for the GPUs that are visible, or for sm_90 plus its PTX when none is
  (``TORCH_CUDA_ARCH_LIST``);
* everything built lands under ``build/`` at the repository root (``WORKBOOK_BUILD_DIR``
  overrides it): setup.py's temporary folders and JIT builds too (`setup_options`, `jit_dir`);
* torch's builder finds this interpreter's ninja and, where installed, a compiler cache
  (`prepare`);
* what the flags need of torch itself (its version, ABI, CPU capability) is asked once and kept
  (`torch_facts`): a build process need not load torch before its compiler starts.

Building a stage is `workbook.build.builder`; importing it, `workbook.build.loader`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from workbook.build import stages, toolkit
from workbook.build.stages import REPO, build_root

COMMON_INCLUDE = REPO / "common" / "include"


# ----------------------------------------------------------------------------------------------
# Flags


def include_dirs() -> list[str]:
    return [str(COMMON_INCLUDE)]


def torch_facts() -> dict:
    """What the flags and a build's record need of torch itself: its version, the C++11 ABI it was
    built with, the CPU capability ATen runs at here, whether it parallelises with OpenMP.

    Loading torch to ask takes seconds, and a build process asks before it compiles (make
    verify's, on every try). So the answers are kept in build/torch-facts.json under a key of
    what they depend on: torch's files (their size and time), this CPU's flags and
    ATEN_CPU_CAPABILITY. Another torch, machine or setting asks torch again.
    """
    key = _torch_facts_key()
    kept = build_root() / "torch-facts.json"
    try:
        facts = json.loads(kept.read_text())
        if facts.pop("key") == key:
            return facts
    except (OSError, ValueError, KeyError, AttributeError):
        pass  # none kept yet, or kept for another torch or machine
    import torch

    facts = {"version": torch.__version__, "cxx11_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
             "cpu_capability": torch.backends.cpu.get_cpu_capability(),
             "openmp": "OpenMP" in torch.__config__.parallel_info()}
    kept.parent.mkdir(parents=True, exist_ok=True)
    partial = kept.with_name(f"{kept.name}.{os.getpid()}")  # whole, then moved into place
    partial.write_text(json.dumps({"key": key, **facts}))
    partial.replace(kept)
    return facts


def _torch_facts_key() -> str:
    spec = importlib.util.find_spec("torch")  # where it is, without importing it
    folder = Path(spec.origin).parent if spec and spec.origin else None
    files = [] if folder is None else [folder / "version.py", *sorted(folder.glob("_C*.so")),
                                       *sorted((folder / "lib").glob("libtorch_cpu.*"))]
    stamps = [f"{f} {f.stat().st_size} {f.stat().st_mtime_ns}" for f in files if f.is_file()]
    try:
        cpu = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("flags"))
    except (OSError, StopIteration):
        cpu = sys.platform
    text = "\n".join([*stamps, cpu, os.environ.get("ATEN_CPU_CAPABILITY", "")])
    return hashlib.sha256(text.encode()).hexdigest()


def torch_cxx11_abi() -> int:
    """The C++11 ABI setting torch was built with (1 on every recent Linux wheel)."""
    return torch_facts()["cxx11_abi"]


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
    return ["-O3", abi_flag(), *([] if debug else ["-g0"]), *cache_flags()] + sanitizer_flags()


def cache_flags() -> list[str]:
    """-fno-canonical-system-headers where the host compiler is GCC, for the compiler cache.

    torch's just-in-time builder (stage 03, the emulated CUDA device) hands torch's headers to the
    compiler with -isystem. The cache makes that path relative to the clone (CCACHE_BASEDIR), but
    GCC then names each system header by its absolute path wherever that is the shorter of the
    two: the clone's folder ends up in the preprocessed text (every __FILE__ in torch's checks),
    and a build in any other clone misses. The flag keeps the name the compiler was given.
    setup.py builds pass torch's headers with -I and are not affected.
    """
    return ["-fno-canonical-system-headers"] if _host_compiler_is_gcc() else []


@functools.cache
def _host_compiler_is_gcc() -> bool:
    cxx = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Free Software Foundation" in version


def sanitizer_flags() -> list[str]:
    """With ``WORKBOOK_SANITIZE=1`` (set by `make sanitize`, see workbook.net.sanitize): compile
    the host C++ with AddressSanitizer and UndefinedBehaviorSanitizer; otherwise nothing.

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
    openmp = torch_facts()["openmp"] and sys.platform.startswith("linux")
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
    capability = torch_facts()["cpu_capability"]
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
    workbook.build.toolkit.Toolkit, or None when there is none (`toolkit.reason()` says why)."""
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
# The tools torch's builder runs


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
        # A base dir set for a folder holding this clone is kept (a working copy under build/,
        # as make test-template makes, shares its clone's); one set for another clone, inherited
        # from a process there, is not.
        base = os.environ.get("CCACHE_BASEDIR")
        if not base or not REPO.is_relative_to(base):
            os.environ["CCACHE_BASEDIR"] = str(REPO)
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


