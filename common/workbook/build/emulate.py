"""The emulated CUDA device: a stage's own .cu files, compiled by the host compiler, run on the CPU.

Where no GPU is visible, the CUDA stages' tests run their kernels here instead of skipping. A CUDA
kernel file goes through three steps (common/emulate/include/emulated_cuda.h says what each
construct becomes):

1. `rewrite`, a source pass that keeps every line where it was: each launch
   ``kernel<<<grid, block, shmem, stream>>>(args)`` becomes
   ``::workbook::emulate::launch(kernel, grid, block, shmem, stream)(args)``; where the file names
   CUDA as a dispatch key or device type (``TORCH_LIBRARY_IMPL(ns, CUDA, m)``,
   ``c10::DeviceType::CUDA``, ``is_cuda()``) it names the emulated device; a construct the
   emulation cannot run faithfully (``__syncthreads``, ``__shared__``, warp shuffles and votes)
   is refused here, naming it and its line. The rewritten file lands in
   ``build/emulated/<stage>/src/``, where a reader can see it.
2. g++ compiles it with ``common/emulate/include`` first on the include path, whose small
   headers stand in for the CUDA ones (streams, guards, launch checks, CUB's sort and scans).
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
configuration and, under ``make sanitize``, memory safety; not their speed, the GPU's memory model
or real concurrency. Results on it are emulated and are labelled so (test ids say
``emulated_cuda``); the benchmark never times it.

    python -m workbook.build.emulate rewrite FILE.cu     print what the source pass makes of a file
    python -m workbook.build.emulate build 7             build stage 7's emulated kernels
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import sys
from pathlib import Path

from workbook.build.stages import REPO, Stage, build_root

DEVICE = "emulated_cuda"
EMULATE_DIR = REPO / "common" / "emulate"
EMULATE_INCLUDE = EMULATE_DIR / "include"
RUNTIME_SOURCE = EMULATE_DIR / "runtime" / "emulated_device.cpp"


class EmulationRefused(RuntimeError):
    """A kernel uses a construct the emulated device cannot run faithfully; says which and where."""


# ----------------------------------------------------------------------------------------------
# When


def setting() -> str:
    """WORKBOOK_CUDA: "" (emulate where no GPU is visible), "emulate" or "off"."""
    value = os.environ.get("WORKBOOK_CUDA", "").strip().lower()
    if value not in ("", "emulate", "off"):
        raise ValueError(f"WORKBOOK_CUDA must be unset, 'emulate' or 'off', got {value!r}")
    return value


def gpu_visible() -> bool:
    import torch

    return bool(torch.version.cuda) and torch.cuda.is_available()


def active() -> bool:
    """Whether the CUDA tests run on the emulated device in this process."""
    choice = setting()
    if choice == "off":
        return False
    return choice == "emulate" or not gpu_visible()


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
    in a process whose tests never load it (a stage without CUDA kernels, stage 08)."""
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

# Constructs that need threads of a block to run side by side, which one-body-at-a-time cannot.
REFUSED = {
    "__syncthreads": "a block-wide barrier",
    "__syncwarp": "a warp barrier",
    "__shared__": "shared memory, which threads of a block share between barriers",
    "__shfl": "a warp shuffle",
    "__ballot_sync": "a warp vote",
    "__any_sync": "a warp vote",
    "__all_sync": "a warp vote",
    "__activemask": "a warp's active mask",
    "cooperative_groups": "cooperative groups",
}
_REFUSED = re.compile(r"\b(" + "|".join(REFUSED) + r")\w*")

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


def rewrite(text: str, origin: str = "<source>") -> str:
    """What the emulated device compiles of a CUDA source (see the module docstring)."""
    code = _code_mask(text)
    for match in _REFUSED.finditer(code):
        line = code.count("\n", 0, match.start()) + 1
        name = match.group(1)
        raise EmulationRefused(
            f"{origin}:{line}: `{match.group(0)}` ({REFUSED[name]}) cannot run on the emulated "
            f"CUDA device, which runs each thread's kernel body to its end before the next "
            f"starts; test this kernel on a GPU (WORKBOOK_CUDA=off skips it here)")
    edits = []  # (start, end, replacement), in order
    position = 0
    while (begin := code.find("<<<", position)) >= 0:
        close = code.find(">>>", begin + 3)
        if close < 0:
            line = code.count("\n", 0, begin) + 1
            raise EmulationRefused(f"{origin}:{line}: a launch `<<<` without its `>>>`")
        start = _callee_start(code, begin)
        callee = text[start:begin]
        config = text[begin + 3:close]
        edits.append((start, close + 3, f"::workbook::emulate::launch({callee},{config})"))
        position = close + 3
    pieces, last = [], 0
    for start, end, replacement in edits:
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
        return build_root() / "emulated" / self.stage.folder

    @property
    def lib_dir(self) -> Path:
        """For a whole build: the folder holding the emulated copy of the package."""
        return self.build_dir / "lib"

    @property
    def includes(self) -> tuple[Path, ...]:
        """The include path a kernel file is compiled with, before the emulator's and the
        workbook's: the rewritten kernel headers, then the csrc/ folders of the stage's sources
        (as its setup.py names them, for headers such as stage 08's lltm/lltm_stable.h)."""
        return (self.include_dir, *(d / "csrc" for d in self.stage.source_dirs))

    @property
    def include_dir(self) -> Path:
        """The kernel headers (.cuh) of the stage's source folders, rewritten as its .cu files
        are: first on the include path, so that a kernel file's `#include "x.cuh"` finds them."""
        return self.build_dir / "include"


def plan(stage: Stage) -> Plan:
    # A stable-ABI stage compiles only its own .cu files (its glue); what it takes from the ATen
    # stages are headers (the kernels, .cuh), which it includes.
    folders = [stage.source_dir] if stage.stable_abi else stage.source_dirs
    kernels = sorted(p for folder in folders for p in (folder / "csrc").rglob("*.cu"))
    if not kernels:
        raise ValueError(f"{stage.label} has no .cu files to emulate")
    registers = [p for p in kernels if "TORCH_LIBRARY_IMPL" in _code_mask(p.read_text())]
    if len(registers) == len(kernels):
        return Plan(stage, tuple(kernels), whole=False)
    fronts = sorted(p for folder in stage.source_dirs for p in (folder / "csrc").rglob("*.cpp"))
    return Plan(stage, tuple(fronts + kernels), whole=True)


def _flags() -> list[str]:
    from workbook.build import compiler

    # -O2: every thread of a launch is a call of the kernel body. The initial-exec TLS model
    # makes blockIdx and threadIdx (thread_local) plain loads instead of a call each access.
    # OpenMP: a launch shares its blocks out with at::parallel_for (emulated_cuda.h).
    return [*compiler.cxx_flags(), "-O2", "-ftls-model=initial-exec", "-DWORKBOOK_EMULATE_CUDA",
            "-Wno-unknown-pragmas", *compiler.openmp_flags()] + (
                ["-O1", "-g1"] if compiler.sanitizer_flags() else [])


def _load(name: str, sources: list[Path], build_dir: Path, *, python_module: bool,
          library: str | None = None, includes: tuple[Path, ...] = (),
          torch_target: str | None = None):
    """Compile and load `sources`. `library`: the namespace a stage's kernel files register into
    (OPS_NAMESPACE, which the stage's setup.py defines as its package's name). `includes`: folders
    searched first. `torch_target`: the stage's TORCH_TARGET_VERSION (a stable-ABI stage's
    files compile only with it)."""
    from workbook.build import compiler

    compiler.prepare()
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    defines = [f"-DOPS_NAMESPACE={library}"] if library else []
    if torch_target:
        defines.append(f"-DTORCH_TARGET_VERSION={torch_target}")
    return cpp_extension.load(
        name=name, sources=[str(p) for p in sources], build_directory=str(build_dir),
        extra_include_paths=[*map(str, includes), str(EMULATE_INCLUDE), *compiler.include_dirs()],
        extra_cflags=_flags() + defines, extra_ldflags=compiler.openmp_flags(),
        is_python_module=python_module, verbose=False)


_device_ready = False


def ensure_device() -> str:
    """Build (once; cached under build/emulated/runtime) and load the emulated device, name it;
    returns its name. Idempotent."""
    global _device_ready
    if _device_ready:
        return DEVICE
    name_device()
    _progress("the emulated CUDA device (runtime)")
    _load("workbook_emulated_device", [RUNTIME_SOURCE], build_root() / "emulated" / "runtime",
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


def _write_sources(p: Plan) -> list[Path]:
    """The plan's sources, the .cu files rewritten, under build/emulated/<stage>/src/ (a file is
    rewritten only when its text changes, so ninja rebuilds only what changed)."""
    out = []
    for source in p.sources:
        relative = next(source.relative_to(d) for d in p.stage.source_dirs
                        if source.is_relative_to(d))
        target = p.build_dir / "src" / relative.with_suffix(".cpp" if source.suffix == ".cu"
                                                             else source.suffix)
        text = source.read_text()
        origin = str(source.relative_to(REPO) if source.is_relative_to(REPO) else source)
        new = rewrite(text, origin) if source.suffix == ".cu" else \
            f'#include "emulated_cuda.h"\n#line 1 "{origin}"\n' + text
        if source.suffix != ".cu":
            for pattern, replacement in _RENAMES:
                new = pattern.sub(replacement, new)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.is_file() or target.read_text() != new:
            target.write_text(new)
        out.append(target)
    for header in sorted(h for folder in p.stage.source_dirs for h in folder.rglob("*.cuh")):
        target = p.include_dir / header.name
        origin = str(header.relative_to(REPO) if header.is_relative_to(REPO) else header)
        new = rewrite(header.read_text(), origin)
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
    for source in sources:
        header = source.suffix == ".cuh"
        target = build_dir / "src" / (source.name if header else source.with_suffix(".cpp").name)
        target.parent.mkdir(parents=True, exist_ok=True)
        new = rewrite(source.read_text(), str(source))
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
        _load("_C", sources, p.build_dir / "objects", python_module=False,
              library=stage.package, includes=p.includes,
              torch_target=stage.torch_target_version)
        package = p.lib_dir / stage.package
        package.mkdir(parents=True, exist_ok=True)
        for py in (stage.source_dir / stage.package).glob("*.py"):
            shutil.copy2(py, package / py.name)
        built = next((p.build_dir / "objects").glob("_C*.so"))
        shutil.copy2(built, package / built.name)
        result = p.lib_dir
    _loaded[stage.folder] = result
    return result


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="The emulated CUDA device.")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("rewrite", help="print what the source pass makes of a .cu file")
    show.add_argument("file", type=Path)
    built = sub.add_parser("build", help="build (and load) a stage's emulated kernels")
    built.add_argument("stage")
    args = parser.parse_args(argv)
    if args.command == "rewrite":
        print(rewrite(args.file.read_text(), str(args.file)))
        return 0
    from workbook.build import stages

    s = stages.get(args.stage)
    p = plan(s)
    how = "whole, as a copy of its package" if p.whole else "as an add-on to its package"
    print(f"[emulate] {s.label}: {', '.join(src.name for src in p.sources)}, built {how}",
          flush=True)
    load_stage(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
