"""The emulated CUDA device: a stage's own .cu files, compiled by the host compiler, run on the CPU.

Where no GPU is visible, the CUDA stages' tests run their kernels here instead of skipping. A CUDA
kernel file goes through three steps (common/emulate/include/emulated_cuda.h says what each
construct becomes):

1. `rewrite`, a source pass that keeps every line where it was: each launch
   ``kernel<<<grid, block, shmem, stream>>>(args)`` becomes
   ``::workbook::emulate::launch({"kernel", cooperates}, kernel, grid, block, shmem,
   stream)(args)``, where `cooperates` says whether the kernel, or a function it calls by name,
   uses a barrier, shared memory, a warp shuffle or vote or cooperative groups (`cooperating`
   finds them over every file the build rewrites); such a kernel runs its threads as fibers
   that meet at its barriers, any other one thread at a time. Each ``__shared__ T name[N];``
   becomes a reference to the block's shared memory (``T (&name)[N] =
   ::workbook::emulate::shared_variable<T[N]>([] {});``) and each ``extern __shared__ T
   name[];`` a pointer to the launch's dynamic shared memory. Where the file names CUDA as a
   dispatch key or device type (``TORCH_LIBRARY_IMPL(ns, CUDA, m)``, ``c10::DeviceType::CUDA``,
   ``is_cuda()``) it names the emulated device. The rewritten file lands in
   ``build/emulated/<stage>/src/``, where a reader can see it.
2. g++ compiles it with ``common/emulate/include`` first on the include path, whose small
   headers stand in for the CUDA ones (streams, guards, launch checks, CUB's sort and scans,
   cooperative groups). The fibers switch with Boost.Context where it is installed (Debian's
   libboost-context-dev), else with glibc's ucontext, each of whose switches is a system call
   (``python -m workbook.build.emulate fibers`` times both; ``WORKBOOK_EMULATE_FIBERS=ucontext``
   forces the second).
3. The library is loaded beside the stage's own: a file that registers its kernels itself
   (``TORCH_LIBRARY_IMPL``) is built as an add-on that registers them for the emulated device;
   a stage whose .cu files hold launchers called from a C++ front (stage 04) is built whole, as
   a copy of its package.

The device is PyTorch's PrivateUse1 backend named ``emulated_cuda`` (common/emulate/runtime/):
its memory is host memory, kernels registered for it are the emulated CUDA kernels, and every
other ATen op runs the CPU kernel on the same memory. Tensors move to it with ``.to(DEVICE)``.

When it is used: ``WORKBOOK_CUDA`` unset, where no GPU is visible; ``WORKBOOK_CUDA=emulate``,
always (to compare with a GPU's run); ``WORKBOOK_CUDA=off``, never (the CUDA tests skip without
a GPU, as before). What it proves and what it cannot: the kernels' arithmetic, indexing, launch
configuration, barriers and warp collectives (synccheck), under ``make sanitize`` memory safety,
and under ``make racecheck`` (workbook.net.racecheck) races between emulated threads; not their
speed, the GPU's weak memory ordering or real concurrency. Results on it are emulated and are
labelled so (test ids say ``emulated_cuda``); the benchmark never times it.

    python -m workbook.build.emulate rewrite FILE.cu     print what the source pass makes of a file
    python -m workbook.build.emulate build 7             build stage 7's emulated kernels
    python -m workbook.build.emulate fibers              time a fiber switch, both mechanisms
"""

from __future__ import annotations

import contextlib
import ctypes.util
import dataclasses
import os
import re
import shutil
import sys
import time
from pathlib import Path

from workbook.build.builder import BuildFailed
from workbook.build.stages import NVCC, REPO, Stage, build_root
from workbook.measure import runlog

DEVICE = "emulated_cuda"
EMULATE_DIR = REPO / "common" / "emulate"
EMULATE_INCLUDE = EMULATE_DIR / "include"
RUNTIME_SOURCE = EMULATE_DIR / "runtime" / "emulated_device.cpp"


class EmulationRefused(RuntimeError):
    """A source the emulated device cannot take as written; says what and where."""


# ----------------------------------------------------------------------------------------------
# When


def setting() -> str:
    """WORKBOOK_CUDA: "" (emulate where no GPU is visible), "emulate" or "off"."""
    value = os.environ.get("WORKBOOK_CUDA", "").strip().lower()
    if value not in ("", "emulate", "off"):
        raise ValueError(f"WORKBOOK_CUDA must be unset, 'emulate' or 'off', got {value!r}")
    return value


def gpu_visible() -> bool:
    """Whether torch sees a CUDA GPU. On Linux without an NVIDIA device node (/dev/nvidia0, or
    WSL's /dev/dxg) it cannot: said without loading torch, which takes seconds."""
    if sys.platform.startswith("linux") and not (any(Path("/dev").glob("nvidia[0-9]*"))
                                                 or Path("/dev/dxg").exists()):
        return False
    import torch

    return bool(torch.version.cuda) and torch.cuda.is_available()


def active() -> bool:
    """Whether the CUDA tests run on the emulated device in this process."""
    choice = setting()
    if choice == "off":
        return False
    return choice == "emulate" or not gpu_visible()


def choose_builds() -> str | None:
    """Where no GPU is visible and the CUDA tests run on the emulated device, build the CUDA
    stages that have a CPU fallback CPU-only: set WORKBOOK_NVCC=0 (workbook.build.stages), for
    this process and those it starts. Returns the line that says so, or None where nothing was
    chosen (a GPU is visible, WORKBOOK_CUDA=off, or WORKBOOK_NVCC set already).

    nvcc's output for those stages could not run here: their CUDA tests load the kernels built
    for the emulated device from the same .cu files, beside the CPU-only library. So `make test`
    does not compile every .cu file with nvcc as well, the slowest compiles of a clean clone;
    `make nvcc-check` does, and checks each library loads with its CUDA kernels. A stage that is
    CUDA-only (stage 04) is built with nvcc as before: it has no CPU library to build instead.
    """
    if os.environ.get(NVCC) is not None or setting() == "off" or gpu_visible():
        return None
    os.environ[NVCC] = "0"
    return ("no GPU visible: the CUDA stages with a CPU fallback are built CPU-only (build/"
            "stages-cpu/), their CUDA tests run on the emulated device; `make nvcc-check` "
            "compiles them with nvcc (WORKBOOK_NVCC=1 here does too)")


_requested = False


def cuda_device() -> str:
    """The device the CUDA tests run on: "cuda" (a GPU, or skipped), or the emulated one (named
    here, so that torch.device understands it; its library loads with ensure_device()). Asking
    is what makes this process build and load the emulated kernels of the CUDA stages it imports
    (the test base asks; the demo and the benchmark, which never time emulated kernels, do not)."""
    global _requested
    if not active():
        return "cuda"
    name_device()
    _requested = True
    return DEVICE


def wanted() -> bool:
    """Whether the CUDA stages this process imports get their emulated kernels too."""
    return _requested and active()


def name_device() -> None:
    """Name the device (torch.device understands the name from here on) and register its module,
    torch.<device>, which says it is available once ensure_device() has loaded it. torch asks for
    that module as soon as the device has a name (torch.accelerator, torch.compile's tracer), even
    in a process whose tests never load it (a stage without CUDA kernels, stage 10)."""
    import torch

    if torch._C._get_privateuse1_backend_name() != DEVICE:
        torch.utils.rename_privateuse1_backend(DEVICE)
    if getattr(torch, DEVICE, None) is None:
        torch._register_device_module(DEVICE, _DeviceModule())


def is_emulated(device) -> bool:
    """Whether `device` (a string or torch.device) is the emulated CUDA device."""
    return str(device).split(":")[0] == DEVICE


# ----------------------------------------------------------------------------------------------
# The source pass

# What makes threads of a block wait for each other or share memory: a kernel that uses any of
# these, itself or through a function it calls, runs its threads as fibers (emulated_cuda.h).
COOPERATIVE = re.compile(
    r"\b(?:__syncthreads\w*|__syncwarp|__shared__|__shfl\w*_sync|__ballot_sync|__any_sync|"
    r"__all_sync|__activemask|cooperative_groups|this_thread_block|tiled_partition|"
    r"thread_block_tile)\b")

# Where a CUDA file names CUDA as a place to run, it names the emulated device instead.
_RENAMES = [
    (re.compile(r"(TORCH_LIBRARY_IMPL\s*\(\s*\w+\s*,\s*)CUDA(\s*,)"), r"\1PrivateUse1\2"),
    (re.compile(r"(TORCH_LIBRARY_IMPL\s*\(\s*\w+\s*,\s*)AutocastCUDA(\s*,)"),
     r"\1AutocastPrivateUse1\2"),
    (re.compile(r"\b(?:c10|at|torch)::DeviceType::CUDA\b"), "c10::DeviceType::PrivateUse1"),
    (re.compile(r"\b(?:c10|at|torch)::kCUDA\b"), "c10::kPrivateUse1"),
    (re.compile(r"\.is_cuda\(\)"), ".is_privateuseone()"),
]


def _code_mask(text: str) -> str:
    """text with comments and string literals blanked (newlines kept): where code is."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif text[i] in "\"'":
            j = i + 1
            while j < n and text[j] != text[i]:
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
        else:
            out.append(text[i])
            i += 1
            continue
        out.append(re.sub(r"[^\n]", " ", text[i:j]))
        i = j
    return "".join(out)


def _callee_start(code: str, end: int) -> int:
    """Where the kernel name before `<<<` at `end` begins (a name, maybe with template args)."""
    i = end
    while i > 0 and code[i - 1].isspace():
        i -= 1
    if i > 0 and code[i - 1] == ">":  # template arguments: back to the matching <
        depth = 0
        while i > 0:
            i -= 1
            depth += {">": 1, "<": -1}.get(code[i], 0)
            if depth == 0:
                break
        while i > 0 and code[i - 1].isspace():
            i -= 1
    while i > 0 and (code[i - 1].isalnum() or code[i - 1] in "_:"):
        i -= 1
    return i


_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
# What may follow a function's parameter list before its body (a constructor's member
# initialisers end in `)` too, and are taken for one: harmless, as a name only adds fibers).
_AFTER_PARAMETERS = re.compile(r"\)\s*(?:const|volatile|noexcept|override|final|&&?|\s)*"
                               r"(?:->[^;{}]*)?\s*$")


def _matching_open(code: str, close: int) -> int:
    """Where the bracket that `code[close]` closes opens (-1 when unbalanced)."""
    pair = {")": "(", "]": "[", "}": "{"}[code[close]]
    depth = 0
    for i in range(close, -1, -1):
        if code[i] == code[close]:
            depth += 1
        elif code[i] == pair:
            depth -= 1
            if depth == 0:
                return i
    return -1


def _matching_close(code: str, open_: int) -> int:
    """Where the `{` at `open_` closes (the end of code when unbalanced)."""
    depth = 0
    for i in range(open_, len(code)):
        if code[i] == "{":
            depth += 1
        elif code[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return len(code) - 1


def functions(code: str) -> list[tuple[str, str]]:
    """(name, text from its head to its closing brace) of every function `code` defines (comments
    and strings masked), members of classes and functions in namespaces included: a `{` at the
    level of the file, a namespace or a class, after a parameter list."""
    found = []
    i, head_start = 0, 0
    while (brace := code.find("{", i)) >= 0:
        before = code[head_start:brace]
        # The head of this brace: what follows the last `;`, `{` or `}` at this level.
        cut = max(before.rfind(";"), before.rfind("}"), before.rfind("{"))
        head = before[cut + 1:]
        if _AFTER_PARAMETERS.search(head) and not re.search(
                r"\b(?:namespace|struct|class|union|enum)\b[^()]*$", head):
            open_ = _matching_open(head, head.rfind(")"))
            name = re.search(r"([A-Za-z_]\w*)\s*$", head[:max(open_, 0)])
            end = _matching_close(code, brace)
            if name:
                found.append((name.group(1), head + code[brace:end + 1]))
            i = head_start = end + 1  # a body's own braces are not heads
        else:
            i = head_start = brace + 1  # into a namespace, a class or an initialiser
    return found


def cooperating(texts: list[str]) -> set[str]:
    """The names of the functions the sources define that use a construct of COOPERATIVE, or call
    (name) one that does: a launch of a kernel by one of these names runs its threads as fibers.
    By name, so overloads and namesakes in other scopes count too (which costs time, never
    results)."""
    defined = [f for text in texts for f in functions(_code_mask(text))]
    names = {name for name, body in defined if COOPERATIVE.search(body)}
    while True:
        more = {name for name, body in defined
                if name not in names and names.intersection(_IDENTIFIER.findall(body))}
        if not more:
            return names
        names |= more


def _kernel_name(callee: str) -> str:
    """The name a launch calls its kernel by: `ns::kernel<T, 4>` is `kernel`."""
    unqualified = callee.split("<", 1)[0].strip().split("::")[-1]
    return unqualified.strip()


def _depth_zero(text: str, char: str) -> bool:
    """Whether `char` occurs in text outside (), [], <> and {}."""
    depth = 0
    for c in text:
        depth += (c in "([<{") - (c in ")]>}")
        if c == char and depth == 0:
            return True
    return False


_ALIGN = re.compile(r"\b(?:__align__|alignas)\s*\((?:[^()]|\([^()]*\))*\)")
_DECLARATOR = re.compile(r"(?P<type>.*?[\w>*&\s])\s*\b(?P<name>[A-Za-z_]\w*)\s*"
                         r"(?P<dims>(?:\[[^\]]*\]\s*)*)", re.S)


def _shared_edits(text: str, code: str, origin: str) -> list[tuple[int, int, str]]:
    """The edits that turn each `__shared__` declaration into shared memory of the block (see the
    module docstring); each keeps the lines the declaration spanned."""
    edits = []
    for match in re.finditer(r"\b__shared__\b", code):
        line = code.count("\n", 0, match.start()) + 1
        end = code.find(";", match.end())
        extern = re.search(r"\bextern\s*$", code[:match.start()])
        start = extern.start() if extern else match.start()
        declaration = _ALIGN.sub(" ", code[match.end():end]).strip()
        if end < 0 or "=" in declaration or _depth_zero(declaration, ","):
            raise EmulationRefused(
                f"{origin}:{line}: the emulated device takes one `__shared__` variable per "
                f"declaration, without an initialiser (CUDA allows none either), as in "
                f"`__shared__ float tile[32][33];`")
        parts = _DECLARATOR.fullmatch(declaration)
        if parts is None:
            raise EmulationRefused(f"{origin}:{line}: cannot read this `__shared__` declaration")
        type_, name = " ".join(parts["type"].split()), parts["name"]
        dims = "".join(parts["dims"].split())
        if extern:
            if dims != "[]":
                raise EmulationRefused(f"{origin}:{line}: `extern __shared__` declares an array "
                                       f"of unknown size, as in `extern __shared__ float buf[];`")
            new = f"{type_}* const {name} = ::workbook::emulate::dynamic_shared<{type_}>()"
        else:
            new = (f"{type_} (&{name}){dims} = "
                   f"::workbook::emulate::shared_variable<{type_}{dims}>([] {{}})")
        edits.append((start, end + 1, new + ";" + "\n" * code.count("\n", start, end)))
    return edits


def rewrite(text: str, origin: str = "<source>", cooperative: set[str] | None = None) -> str:
    """What the emulated device compiles of a CUDA source (see the module docstring).
    `cooperative`: the names of the functions that cooperate, found over every file of the
    build (`cooperating`); by default, over this one."""
    code = _code_mask(text)
    if cooperative is None:
        cooperative = cooperating([text])
    edits = _shared_edits(text, code, origin)  # (start, end, replacement)
    position = 0
    while (begin := code.find("<<<", position)) >= 0:
        close = code.find(">>>", begin + 3)
        if close < 0:
            line = code.count("\n", 0, begin) + 1
            raise EmulationRefused(f"{origin}:{line}: a launch `<<<` without its `>>>`")
        start = _callee_start(code, begin)
        callee = text[start:begin]
        config = text[begin + 3:close]
        name = _kernel_name(code[start:begin])
        kernel = f'{{"{name}", {"true" if name in cooperative else "false"}}}'
        edits.append((start, close + 3,
                      f"::workbook::emulate::launch({kernel}, {callee},{config})"))
        position = close + 3
    pieces, last = [], 0
    for start, end, replacement in sorted(edits):
        pieces += [text[last:start], replacement]
        last = end
    body = "".join(pieces) + text[last:]
    for pattern, replacement in _RENAMES:
        body = pattern.sub(replacement, body)
    return (f'#include "emulated_cuda.h"  // the emulated CUDA device (workbook/build/emulate.py)\n'
            f'#line 1 "{origin}"\n{body}')


# ----------------------------------------------------------------------------------------------
# Building and loading


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the emulated build of a stage compiles: `sources` (the .cu files rewritten, plus the
    C++ front for a whole build) and whether it is an add-on or a copy of the package."""

    stage: Stage
    sources: tuple[Path, ...]
    whole: bool

    @property
    def build_dir(self) -> Path:
        return emulated_root() / self.stage.folder

    @property
    def lib_dir(self) -> Path:
        """For a whole build: the folder holding the emulated copy of the package."""
        return self.build_dir / "lib"

    @property
    def includes(self) -> tuple[Path, ...]:
        """The include path a kernel file is compiled with, before the emulator's and the
        workbook's: the rewritten kernel headers, then the csrc/ folders of the stage's sources
        (as its setup.py names them, for headers such as stage 10's lltm/lltm_stable.h)."""
        return (self.include_dir, *(d / "csrc" for d in self.stage.source_dirs))

    @property
    def include_dir(self) -> Path:
        """The kernel headers (.cuh) of the stage's source folders, rewritten as its .cu files
        are: first on the include path, so that a kernel file's `#include "x.cuh"` finds them."""
        return self.build_dir / "include"


def _sources(folders: list[Path], pattern: str) -> list[Path]:
    """The files matching `pattern` under each folder's csrc/, a stage's own folder first: its
    file replaces one of the same path in a folder it takes sources from (stage 08's
    lltm_cuda.cu, stage 05's), as its setup.py compiles it instead."""
    found: dict[Path, Path] = {}
    for folder in folders:
        for path in sorted((folder / "csrc").rglob(pattern)):
            found.setdefault(path.relative_to(folder / "csrc"), path)
    return sorted(found.values())


def plan(stage: Stage) -> Plan:
    # A stable-ABI stage compiles only its own .cu files (its glue); what it takes from the ATen
    # stages are headers (the kernels, .cuh), which it includes.
    folders = [stage.source_dir] if stage.stable_abi else stage.source_dirs
    kernels = _sources(folders, "*.cu")
    if not kernels:
        raise ValueError(f"{stage.label} has no .cu files to emulate")
    registers = [p for p in kernels if "TORCH_LIBRARY_IMPL" in _code_mask(p.read_text())]
    if len(registers) == len(kernels):
        return Plan(stage, tuple(kernels), whole=False)
    fronts = _sources(stage.source_dirs, "*.cpp")
    return Plan(stage, tuple(fronts + kernels), whole=True)


def racecheck() -> bool:
    """Whether this process builds and runs the emulated kernels under ThreadSanitizer
    (``WORKBOOK_RACECHECK=1``, set by make racecheck: workbook.net.racecheck)."""
    return os.environ.get("WORKBOOK_RACECHECK", "").strip() not in ("", "0")


def emulated_root() -> Path:
    """Where the emulated builds go: build/emulated/, or build/racecheck/ for the instrumented
    ones (the same sources, other flags)."""
    return build_root() / ("racecheck" if racecheck() else "emulated")


def _boost_context() -> bool:
    """Whether Boost.Context's fcontext can be compiled and linked here (header and library)."""
    include_dirs = ["/usr/include", "/usr/local/include",
                    *filter(None, os.environ.get("CPATH", "").split(os.pathsep))]
    header = any((Path(d) / "boost/context/detail/fcontext.hpp").is_file() for d in include_dirs)
    return header and ctypes.util.find_library("boost_context") is not None


def fibers() -> str:
    """How the emulated threads of a cooperating block switch: "boost" (Boost.Context, where
    installed) or "ucontext" (glibc); ``WORKBOOK_EMULATE_FIBERS`` chooses."""
    choice = os.environ.get("WORKBOOK_EMULATE_FIBERS", "").strip().lower()
    if choice not in ("", "boost", "ucontext"):
        raise ValueError(f"WORKBOOK_EMULATE_FIBERS must be unset, 'boost' or 'ucontext', "
                         f"got {choice!r}")
    if choice == "boost" and not _boost_context():
        raise ValueError("WORKBOOK_EMULATE_FIBERS=boost, but Boost.Context is not installed "
                         "(Debian, Ubuntu: apt install libboost-context-dev)")
    return choice or ("boost" if _boost_context() else "ucontext")


def _flags() -> list[str]:
    from workbook.build import compiler

    # -O2: every thread of a launch is a call of the kernel body. The initial-exec TLS model
    # makes blockIdx and threadIdx (thread_local) plain loads instead of a call each access.
    # OpenMP: a launch shares its blocks out with at::parallel_for (emulated_cuda.h).
    flags = [*compiler.cxx_flags(), "-O2", "-ftls-model=initial-exec", "-DWORKBOOK_EMULATE_CUDA",
             "-Wno-unknown-pragmas", *compiler.openmp_flags()]
    if fibers() == "boost":
        flags.append("-DWORKBOOK_EMULATE_FIBERS_BOOST")
    if racecheck():
        # ThreadSanitizer on the kernels alone (torch and the stage's own library are not
        # instrumented; the runtime is preloaded, as for make sanitize). Line tables for the
        # reports; -O1 keeps the stacks whole.
        flags += ["-fsanitize=thread", "-O1", "-g1", "-fno-omit-frame-pointer"]
    elif compiler.sanitizer_flags():
        flags += ["-O1", "-g1"]
    return flags


def _ldflags() -> list[str]:
    from workbook.build import compiler

    return [*compiler.openmp_flags(), *(["-lboost_context"] if fibers() == "boost" else [])]


@contextlib.contextmanager
def _compilers_without_preload():
    """The compiler runs without the sanitizer runtimes a racecheck or sanitize process preloads
    (g++ under ThreadSanitizer's crashes); the library built then loads into this process, which
    has them."""
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        yield
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload


def _load(name: str, sources: list[Path], build_dir: Path, *, python_module: bool,
          library: str | None = None, includes: tuple[Path, ...] = (),
          torch_target: str | None = None):
    """Compile and load `sources`. `library`: the namespace a stage's kernel files register into
    (OPS_NAMESPACE, which the stage's setup.py defines as its package's name). `includes`: folders
    searched first. `torch_target`: the stage's TORCH_TARGET_VERSION (a stable-ABI stage's
    files compile only with it)."""
    from workbook.build import builder, compiler

    compiler.prepare()
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    defines = [f"-DOPS_NAMESPACE={library}"] if library else []
    if torch_target:
        defines.append(f"-DTORCH_TARGET_VERSION={torch_target}")
    key = (name, str(build_dir))
    if key in _failed:
        raise BuildFailed(_failed[key])
    start = time.perf_counter()
    try:
        with _compilers_without_preload():
            loaded = cpp_extension.load(
                name=name, sources=[str(p) for p in sources], build_directory=str(build_dir),
                extra_include_paths=[*map(str, includes), str(EMULATE_INCLUDE),
                                     *compiler.include_dirs()],
                extra_cflags=_flags() + defines, extra_ldflags=_ldflags(),
                is_python_module=python_module, verbose=False)
    except Exception as error:
        # torch's loader, called again in this process with the same sources, skips the build
        # it has seen fail and loads the library in the folder: an earlier, successful build's.
        # So the library goes, and this process answers every later load with this failure.
        for stale in build_dir.glob(f"{name}*.so"):
            stale.unlink()
        text = str(error)
        first = next((ln.strip() for ln in text.splitlines() if ": error: " in ln), None)
        _failed[key] = (f"building {name} (CUDA kernels for the emulated device) failed"
                        f"{': ' + first if first else ''}\nNo earlier build is loaded in its "
                        f"place. {builder.first_errors(text)}")
        raise BuildFailed(_failed[key]) from error
    # The run log's build time of the emulated kernels: a load that finds them built costs
    # ninja's look at them (a second or so).
    runlog.record("build", name, time.perf_counter() - start, stage=runlog.stage_of(
        str(build_dir) + "/"), flavour=runlog.checks_flavour() or "emulated")
    return loaded


# The emulated builds that failed in this process, (name, folder) -> the message: a later load
# of the same sources fails alike, at once, instead of loading what an earlier build left.
_failed: dict[tuple[str, str], str] = {}

_device_ready = False


def ensure_device() -> str:
    """Build (once; cached under build/emulated/runtime/<fibers>) and load the emulated device,
    name it; returns its name. Idempotent.

    A folder per fiber mechanism: a process that asks for the other one (a test of the ucontext
    fibers, WORKBOOK_EMULATE_FIBERS) would otherwise rebuild the one library every process
    loads, under the processes running beside it."""
    global _device_ready
    if _device_ready:
        return DEVICE
    name_device()
    _progress("the emulated CUDA device (runtime)")
    _load("workbook_emulated_device", [RUNTIME_SOURCE], emulated_root() / "runtime" / fibers(),
          python_module=False)
    _device_ready = True
    return DEVICE


class _DeviceModule:
    """torch.<device>: what PyTorch's Python side asks of a device module."""

    @staticmethod
    def is_available() -> bool:
        return _device_ready  # named, but not loaded, until ensure_device()

    @staticmethod
    def device_count() -> int:
        return int(_device_ready)

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def synchronize(device=None) -> None:
        """Every emulated launch has finished when it returns."""

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    # Random numbers for the device are drawn on the CPU (the fallback): its generator's state.
    @staticmethod
    def manual_seed_all(seed: int) -> None:
        """torch.manual_seed calls this, then seeds the CPU generator, which is the device's."""

    @staticmethod
    def get_rng_state(device=None):
        import torch

        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device=None) -> None:
        import torch

        torch.set_rng_state(state)

    @staticmethod
    def get_amp_supported_dtype():
        import torch

        return [torch.float16, torch.bfloat16]


def _progress(what: str) -> None:
    if os.environ.get("WORKBOOK_EMULATE_QUIET") != "1":
        print(f"[emulate] building or loading {what} ...", file=sys.stderr, flush=True)


def _origin(source: Path) -> str:
    """The name a rewritten file's `#line` gives its source: relative to the clone where it lies
    in it, so that the compiler cache finds the same text from any clone (CCACHE_BASEDIR takes
    care of the command line, not of the text), and the sanitizers' reports name it the same."""
    return str(source.relative_to(REPO) if source.is_relative_to(REPO) else source)


def _write_sources(p: Plan) -> list[Path]:
    """The plan's sources, the .cu files rewritten, under build/emulated/<stage>/src/ (a file is
    rewritten only when its text changes, so ninja rebuilds only what changed)."""
    headers = sorted(h for folder in p.stage.source_dirs for h in folder.rglob("*.cuh"))
    cooperative = cooperating([f.read_text() for f in (*p.sources, *headers)
                               if f.suffix in (".cu", ".cuh")])
    out = []
    for source in p.sources:
        relative = next(source.relative_to(d) for d in p.stage.source_dirs
                        if source.is_relative_to(d))
        target = p.build_dir / "src" / relative.with_suffix(".cpp" if source.suffix == ".cu"
                                                             else source.suffix)
        text = source.read_text()
        new = rewrite(text, _origin(source), cooperative) if source.suffix == ".cu" else \
            f'#include "emulated_cuda.h"\n#line 1 "{_origin(source)}"\n' + text
        if source.suffix != ".cu":
            for pattern, replacement in _RENAMES:
                new = pattern.sub(replacement, new)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.is_file() or target.read_text() != new:
            target.write_text(new)
        out.append(target)
    for header in headers:
        target = p.include_dir / header.name
        new = rewrite(header.read_text(), _origin(header), cooperative)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.is_file() or target.read_text() != new:
            target.write_text(new)
    return out


def build_kernels(name: str, sources: list[Path], build_dir: Path) -> None:
    """Rewrite and compile CUDA files (`sources`, .cu) that register their own kernels, into
    build_dir, and load the library: its kernels are then the emulated device's. A .cuh among
    the sources is a header they include: rewritten beside them, not compiled. The tests use it
    for kernels of their own (a planted bug, a launch CUDA refuses)."""
    ensure_device()
    rewritten = []
    cooperative = cooperating([source.read_text() for source in sources])
    for source in sources:
        header = source.suffix == ".cuh"
        target = build_dir / "src" / (source.name if header else source.with_suffix(".cpp").name)
        target.parent.mkdir(parents=True, exist_ok=True)
        new = rewrite(source.read_text(), _origin(source), cooperative)
        if not target.is_file() or target.read_text() != new:
            target.write_text(new)
        if not header:
            rewritten.append(target)
    _load(name, rewritten, build_dir / "objects", python_module=False)


_loaded: dict[str, object] = {}


def load_stage(stage: Stage):
    """Build the stage's emulated kernels and load them. An add-on registers them for the
    emulated device (call after importing the stage's package); a whole build returns the folder
    holding the emulated copy of the package, to import it from."""
    ensure_device()
    if stage.folder in _loaded:
        return _loaded[stage.folder]
    p = plan(stage)
    sources = _write_sources(p)
    _progress(f"{stage.label}'s CUDA kernels, emulated")
    name = "emulated_" + re.sub(r"\W", "_", stage.folder)
    if not p.whole:
        _load(name, sources, p.build_dir / "objects", python_module=False,
              library=stage.package, includes=p.includes,
              torch_target=stage.torch_target_version)
        result = None
    else:
        # The stage's extension is `<package>._C`; its emulated copy sits in a package folder of
        # its own, beside the stage's Python files.
        package = p.lib_dir / stage.package
        try:
            _load("_C", sources, p.build_dir / "objects", python_module=False,
                  library=stage.package, includes=p.includes,
                  torch_target=stage.torch_target_version)
        except BuildFailed:
            for stale in package.glob("_C*.so"):  # the copy of an earlier build goes too
                stale.unlink()
            raise
        package.mkdir(parents=True, exist_ok=True)
        for py in (stage.source_dir / stage.package).glob("*.py"):
            shutil.copy2(py, package / py.name)
        built = next((p.build_dir / "objects").glob("_C*.so"))
        shutil.copy2(built, package / built.name)
        result = p.lib_dir
    _loaded[stage.folder] = result
    return result


FIBER_TIMING = EMULATE_DIR / "runtime" / "fiber_timing.cu"
_TIMING_RUN = """
import ctypes, json
from workbook.build import emulate
build = emulate.emulated_root() / "fiber_timing" / emulate.fibers()
emulate.build_kernels("fiber_timing", [emulate.FIBER_TIMING], build)
lib = ctypes.CDLL(str(build / "objects" / "fiber_timing.so"))
for name in ("barrier_ns", "sum_threads_per_s", "copy_threads_per_s"):
    getattr(lib, name).restype = ctypes.c_double
print(json.dumps({"barrier_ns": min(lib.barrier_ns(256, 200) for _ in range(5)),
                  "sum": max(lib.sum_threads_per_s(1 << 20) for _ in range(5)),
                  "copy": max(lib.copy_threads_per_s(1 << 20) for _ in range(5))}))
"""


def time_fibers() -> int:
    """Build fiber_timing.cu with each mechanism found here (in a fresh interpreter each, on one
    CPU thread) and print what a barrier costs, best of five."""
    mechanisms = ["boost", "ucontext"] if _boost_context() else ["ucontext"]
    print(f"[emulate] fibers: {', '.join(mechanisms)} (one CPU thread, best of 5; "
          f"{FIBER_TIMING.relative_to(REPO)} says what each number is)", flush=True)
    import json
    import subprocess

    for mechanism in mechanisms:
        env = dict(os.environ, WORKBOOK_EMULATE_FIBERS=mechanism, WORKBOOK_EMULATE_ORDER="in-order",
                   WORKBOOK_EMULATE_QUIET="1", OMP_NUM_THREADS="1")
        run = subprocess.run([sys.executable, "-c", _TIMING_RUN], env=env, capture_output=True,
                             text=True)
        if run.returncode != 0:
            print(run.stderr[-3000:], file=sys.stderr)
            return 1
        r = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"  {mechanism:<9} a thread at a barrier (a switch out and back): "
              f"{r['barrier_ns']:7.1f} ns; block reduction: {r['sum'] / 1e6:5.2f} M emulated "
              f"threads/s; a copy that never waits: {r['copy'] / 1e6:6.1f} M/s", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="The emulated CUDA device.")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("rewrite", help="print what the source pass makes of a .cu file")
    show.add_argument("file", type=Path)
    built = sub.add_parser("build", help="build (and load) a stage's emulated kernels")
    built.add_argument("stage")
    sub.add_parser("fibers", help="time a barrier with each fiber mechanism found here")
    args = parser.parse_args(argv)
    if args.command == "fibers":
        return time_fibers()
    if args.command == "rewrite":
        print(rewrite(args.file.read_text(), str(args.file)))
        return 0
    from workbook.build import stages

    s = stages.get(args.stage)
    p = plan(s)
    how = "whole, as a copy of its package" if p.whole else "as an add-on to its package"
    print(f"[emulate] {s.label}: {', '.join(src.name for src in p.sources)}, built {how}",
          flush=True)
    try:
        load_stage(s)
    except BuildFailed as failed:  # its first compiler errors, without a traceback
        print(f"[emulate] {failed}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
