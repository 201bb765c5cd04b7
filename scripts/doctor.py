"""Check the build environment, one line per thing that commonly breaks an extension build.

    make doctor                     (or: python scripts/doctor.py, with the interpreter to check)

Each line is marked OK, WARN (works, but something will be skipped or is worth knowing) or FAIL
(a build or an import will break), and says how to fix it. Exit status 1 when a line is FAIL.

What it looks at: the interpreter; torch, its CUDA version and C++11 ABI; the ABI builds will use
(WORKBOOK_CXX11_ABI can force the other one); the C++ compiler; ninja; nvcc and whether its major
version is torch's; CUDA_HOME; the visible GPUs; the CUDA arch list; the build folder and the ABI
each built stage was compiled with; JIT lock files a build left behind.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

try:  # the workbook's shared Python: `make` puts common/ on PYTHONPATH, .venv has it installed
    from workbook.build import compiler, stages, toolkit
except ImportError as error:
    sys.exit(f"FAIL workbook cannot import the workbook package ({error}): run `make doctor`, "
             f"which sets PYTHONPATH=common, or `pip install -e common`")

STATUS_ORDER = ("OK", "WARN", "FAIL")
results: list[tuple[str, str, str, str]] = []  # (status, what, finding, fix)


def report(status: str, what: str, finding: str, fix: str = "") -> None:
    results.append((status, what, finding, fix))
    line = f"{status:<4}  {what:<10}  {finding}"
    if fix:
        line += f"  -> fix: {fix}"
    print(line, flush=True)


def short(path: str | Path) -> str:
    path = Path(path)
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


def interpreter_path() -> str:
    """PATH as the build sees it: the interpreter's bin folder first (compiler.tools_on_path)."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


# ----------------------------------------------------------------------------------------------
# The checks, in the order they are printed


def check_python() -> None:
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info < (3, 11):  # noqa: UP036  (this checks the interpreter it runs on)
        report("FAIL", "python", f"{version} ({sys.executable})", "use Python 3.11 or newer")
    else:
        report("OK", "python", f"{version} ({sys.executable})")


def check_torch():
    try:
        import torch
    except Exception as error:  # noqa: BLE001  (any failure to import is the finding)
        report("FAIL", "torch", f"cannot import torch: {error}",
               "run `make env`, or PYTHON=/path/to/python that has torch")
        return None
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    report("OK", "torch", f"{torch.__version__}, {cuda}, C++11 ABI {abi} ({short(torch.__file__)})")
    return torch


def check_abi(torch) -> None:
    theirs = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    forced = os.environ.get("WORKBOOK_CXX11_ABI", "")
    try:
        ours = compiler.cxx11_abi()
    except ValueError as error:
        report("FAIL", "abi", str(error), "unset WORKBOOK_CXX11_ABI")
        return
    if ours != theirs:
        report("FAIL", "abi", f"WORKBOOK_CXX11_ABI={forced} forces "
               f"-D_GLIBCXX_USE_CXX11_ABI={ours}, "
               f"torch uses {theirs}: extensions built now fail to import (undefined symbol)",
               "unset WORKBOOK_CXX11_ABI; repair a stage built so with scripts/fix_abi.sh N")
    else:
        how = f"WORKBOOK_CXX11_ABI={forced}" if forced else "torch's setting"
        report("OK", "abi", f"builds use -D_GLIBCXX_USE_CXX11_ABI={ours} ({how})")


def check_compiler(torch) -> None:
    cxx = os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension runs on Linux
    path = shutil.which(cxx)
    if path is None:
        report("FAIL", "compiler", f"no C++ compiler: `{cxx}` is not on PATH",
               "install one (apt-get install g++) or set CXX")
        return
    out = run([cxx, "--version"])
    name = out.stdout.splitlines()[0].strip() if out and out.stdout else "version unknown"
    # The C++ standard torch's headers need: C++20 since torch 2.10, C++17 before.
    std = "c++20"
    version = tuple(int(v) for v in re.findall(r"\d+", torch.__version__)[:2]) if torch else ()
    if torch is not None and version < (2, 10):
        std = "c++17"
    try:
        probe = subprocess.run([cxx, f"-std={std}", "-x", "c++", "-fsyntax-only", "-"],
                               input="int main() { return 0; }\n", capture_output=True, text=True,
                               timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        probe = None
    if probe is None or probe.returncode != 0:
        report("FAIL", "compiler", f"{cxx} ({name}) does not accept -std={std}, which torch's "
               "headers need", "use GCC 10 or newer (or set CXX to one)")
        return
    report("OK", "compiler", f"{cxx} -> {path}: {name}; -std={std} accepted")


def check_ninja() -> None:
    on_path = shutil.which("ninja")
    found = on_path or shutil.which("ninja", path=interpreter_path())
    if found is None:
        report("FAIL", "ninja", "not found (torch builds extensions with it)",
               "pip install ninja into the interpreter (make env does)")
        return
    out = run([found, "--version"])
    version = out.stdout.strip() if out else "?"
    where = short(found) if on_path else f"{short(found)}, beside the interpreter: make and the " \
                                         "build helper put it on PATH"
    report("OK", "ninja", f"{version} ({where})")


def check_compiler_cache() -> None:
    """ccache or sccache on PATH: torch's builder puts it before g++ and nvcc (optional)."""
    for name in ("ccache", "sccache"):
        found = shutil.which(name)
        if found:
            out = run([found, "--version"])
            version = out.stdout.splitlines()[0].strip() if out and out.stdout else "?"
            report("OK", "cache", f"{version} ({short(found)}): a file compiled once is not "
                   f"compiled again, in any clone, until it or its flags change")
            return
    report("OK", "cache", "no compiler cache (optional): every clean build compiles every file",
           "apt install ccache (or brew/conda install ccache) for fast rebuilds")


def check_fibers() -> None:
    """How the emulated CUDA device switches between the threads of a block that cooperate."""
    from workbook.build import emulate

    if emulate.fibers() == "boost":
        report("OK", "fibers", "Boost.Context: the emulated device switches between a block's "
               "threads in a few nanoseconds")
    else:
        report("OK", "fibers", "ucontext (Boost.Context not found): cooperating kernels run on the "
               "emulated device, each switch a system call slower",
               "apt install libboost-context-dev (python -m workbook.build.emulate fibers times "
               "both)")


def check_nvcc(torch) -> None:
    wanted = torch.version.cuda
    nvcc = shutil.which("nvcc")
    version = toolkit.nvcc_release(nvcc) if nvcc else None
    here = f"nvcc {version} ({nvcc})" if version else ("nvcc on PATH does not run" if nvcc
                                                      else "no nvcc on PATH")
    if wanted is None:
        report("OK", "nvcc", f"{here}; not needed: this torch is CPU-only")
        return
    if version and toolkit.major(version) == toolkit.major(wanted):
        report("OK", "nvcc", f"{here}; major matches torch's CUDA {wanted}")
        return
    found = toolkit.find()
    if found is not None:
        report("WARN", "nvcc", f"{here}, torch has CUDA {wanted}; the build helper uses "
               f"{found.nvcc} (CUDA {found.version}) instead",
               f"put {found.nvcc.parent} first on PATH for builds outside make")
        return
    problem = (f"its major differs from torch's CUDA {wanted}: torch refuses to build with it"
               if version else f"torch has CUDA {wanted}")
    report("WARN", "nvcc", f"{here}; {problem}; the CUDA stages are skipped",
           f"install a CUDA {toolkit.major(wanted)}.x toolkit and set CUDA_HOME, or run "
           f"`python -m workbook.build.toolkit install`")


def check_cuda_home(torch) -> None:
    wanted = torch.version.cuda
    var = "CUDA_HOME" if os.environ.get("CUDA_HOME") else "CUDA_PATH"
    value = os.environ.get(var)
    found = toolkit.find() if wanted else None
    if value:
        problem = toolkit.check_home(Path(value), wanted)
        if problem is None:
            report("OK", "CUDA_HOME", f"{var}={value}")
        elif wanted is None:
            report("OK", "CUDA_HOME", f"{var}={value} ({problem}); not needed: CPU-only torch")
        else:
            fix = (f"export CUDA_HOME={found.home}" if found else
                   "point it at a toolkit folder with bin/nvcc and include/, or unset it")
            report("WARN" if found else "FAIL", "CUDA_HOME", f"{var}={value} ({problem})"
                   + ("; the build helper uses " + str(found.home) if found else ""), fix)
        return
    # Unset: torch guesses from the nvcc on PATH (its parent's parent), else /usr/local/cuda.
    nvcc = shutil.which("nvcc")
    guess = Path(nvcc).parent.parent if nvcc else Path("/usr/local/cuda")
    guess_problem = toolkit.check_home(guess, wanted) if guess.exists() else "it does not exist"
    torch_guess = f"torch alone would guess {guess}" + (f" ({guess_problem})"
                                                        if guess_problem else "")
    if wanted is None:
        report("OK", "CUDA_HOME", "unset; not needed: CPU-only torch")
    elif found is not None:
        report("OK", "CUDA_HOME", f"unset; the build helper sets {found.home} ({torch_guess})")
    elif guess_problem is None:
        report("OK", "CUDA_HOME", f"unset; {torch_guess}")
    else:
        report("WARN", "CUDA_HOME", f"unset; {torch_guess}; the CUDA stages are skipped",
               f"export CUDA_HOME=/path/to/cuda-{toolkit.major(wanted)}.x "
               f"(the folder with bin/nvcc)")


def visible_gpus(torch) -> list[tuple[str, str]]:
    """(name, "major.minor") of each GPU torch sees."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not torch.cuda.is_available():
            return []
        return [(torch.cuda.get_device_name(i),
                 "{}.{}".format(*torch.cuda.get_device_capability(i)))
                for i in range(torch.cuda.device_count())]


def check_gpus(torch, gpus) -> None:
    if gpus:
        names = ", ".join(f"{name} (sm {cap})" for name, cap in gpus)
        report("OK", "gpus", f"{len(gpus)} visible: {names}")
        return
    if torch.version.cuda is None:
        report("OK", "gpus", "none used: this torch is CPU-only")
        return
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    why = f"CUDA_VISIBLE_DEVICES={hidden!r} hides them? " if hidden is not None else ""
    report("WARN", "gpus", "none visible: CUDA stages can still build (see the arch list), "
           "their GPU tests skip", f"{why}check `nvidia-smi` and the driver")


ARCH = re.compile(r"^(\d+)\.(\d+)a?(\+PTX)?$")


def check_arch_list(torch, gpus) -> None:
    if torch.version.cuda is None:
        report("OK", "arch list", "not needed: this torch is CPU-only")
        return
    value = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not value and not any(s.cuda for s in stages.all_stages()):
        report("OK", "arch list", "TORCH_CUDA_ARCH_LIST unset; not needed: no CUDA stage here")
        return
    if not value:
        helper = getattr(compiler, "cuda_arch_list", None)
        if gpus:
            chosen = ";".join(sorted({cap for _, cap in gpus}))
            report("OK", "arch list", f"TORCH_CUDA_ARCH_LIST unset: the visible GPUs' {chosen}")
        elif helper is not None:
            report("OK", "arch list", f"TORCH_CUDA_ARCH_LIST unset, no GPU visible: the build "
                   f"helper picks {helper()} (torch alone would fail with an empty list)")
        else:
            report("FAIL", "arch list", "empty: TORCH_CUDA_ARCH_LIST unset and no GPU visible; "
                   "torch fails on it (IndexError in _get_cuda_arch_flags)",
                   "export TORCH_CUDA_ARCH_LIST=9.0 (the GPU you build for)")
        return
    entries = [e for e in re.split(r"[;\s]+", value) if e]
    numeric = [e for e in entries if ARCH.match(e)]
    odd = [e for e in entries if not ARCH.match(e) and not e.isalpha() and "+" not in e]
    if odd:
        report("FAIL", "arch list", f"TORCH_CUDA_ARCH_LIST={value!r}: torch cannot read "
               f"{', '.join(odd)}", "use entries like 8.0;9.0+PTX or names like Hopper")
        return
    # Does nvcc compile for each? (CUDA 13 dropped everything before 7.5, for instance.)
    nvcc = shutil.which("nvcc")
    out = run([nvcc, "--list-gpu-arch"]) if nvcc else None
    listed = out.stdout if out and out.returncode == 0 else ""
    supported = set(re.findall(r"compute_(\d+)", listed))
    unsupported = [e for e in numeric
                   if supported and "{}{}".format(*ARCH.match(e).groups()[:2]) not in supported]
    if unsupported:
        report("FAIL", "arch list", f"TORCH_CUDA_ARCH_LIST={value!r}: nvcc "
               f"{toolkit.nvcc_release(nvcc)} cannot compile for {', '.join(unsupported)}",
               "drop those entries (nvcc --list-gpu-arch lists what it supports)")
        return
    report("OK", "arch list", f"TORCH_CUDA_ARCH_LIST={value!r}")


def check_build_dir() -> None:
    root = stages.build_root()
    source = "WORKBOOK_BUILD_DIR" if os.environ.get("WORKBOOK_BUILD_DIR") else "default"
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not os.access(existing, os.W_OK):
        report("FAIL", "build dir", f"{root} ({source}): {existing} is not writable",
               "set WORKBOOK_BUILD_DIR to a writable folder, or fix the permissions")
        return
    where = f"{short(root)} ({source}{'' if root.exists() else ', not created yet'})"
    if root.is_relative_to(REPO) and shutil.which("git"):
        ignored = run(["git", "-C", str(REPO), "check-ignore", "-q", str(root)])
        if ignored is not None and ignored.returncode == 1:
            report("WARN", "build dir", f"{where} is inside the repository but not git-ignored",
                   "keep builds under build/ (ignored), or add the folder to .gitignore")
            return
    jit = os.environ.get("TORCH_EXTENSIONS_DIR")
    jit_note = f"; TORCH_EXTENSIONS_DIR={short(jit)}" if jit else ""
    report("OK", "build dir", f"{where}, writable{jit_note}")


def stable_abi(library: Path) -> bool:
    """Whether a built library calls libtorch through the stable ABI's C shims only (stage 10):
    no C++ name of c10, ATen or torch among the symbols it needs, so no C++11 ABI to clash."""
    try:
        out = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True,
                             text=True, check=True).stdout
        names = [line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()]
        demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True,
                                   text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return False
    return (any(n.startswith(("aoti_torch_", "torch_")) for n in names)
            and not any(d.startswith(("c10::", "at::", "torch::", "caffe2::")) for d in demangled))


def check_built_stages(torch) -> None:
    """The ABI each built stage was compiled with, from the record the build writes."""
    theirs = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    built, wrong = [], []
    for s in stages.all_stages():
        libraries = list((s.lib_dir / s.package).glob("*.so")) if s.kind == "setup" else []
        if not libraries:
            continue
        if all(stable_abi(lib) for lib in libraries):
            built.append(f"{s.number} (stable ABI: no C++ symbol of torch, no C++11 ABI to match)")
            continue
        record = s.build_dir / "build-flags.txt"
        match = re.search(r"_GLIBCXX_USE_CXX11_ABI=([01])",
                          record.read_text() if record.is_file() else "")
        built.append(f"{s.number} (ABI {match.group(1) if match else '?'})")
        if match and int(match.group(1)) != theirs:
            wrong.append(str(s.number))
    if not built:
        report("OK", "stages", f"none built under {short(stages.build_root())} yet")
    elif wrong:
        report("FAIL", "stages", f"built: {', '.join(built)}; stage {', '.join(wrong)} has the "
               f"other ABI than torch ({theirs}) and will not import",
               f"scripts/fix_abi.sh {wrong[0]}  (make fix-abi STAGE={wrong[0]})")
    else:
        unknown = (" (ABI ?: built before builds recorded their flags)"
                   if any("?" in b for b in built) else "")
        report("OK", "stages", f"built: {', '.join(built)}{unknown}")


def lock_holders(locks: list[Path]) -> dict[Path, int]:
    """The process holding each lock file open (a build in progress), from /proc/<pid>/fd."""
    wanted = {str(p.resolve()): p for p in locks}
    holders = {}
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                target = os.readlink(fd)
                if target in wanted:
                    holders[wanted[target]] = int(fd_dir.parent.name)
        except OSError:
            continue  # gone, or another user's process
    return holders


def check_jit_locks(torch) -> None:
    from torch.utils import cpp_extension

    roots = [stages.build_root() / "jit"]
    for extra in (os.environ.get("TORCH_EXTENSIONS_DIR"), cpp_extension.get_default_build_root()):
        if extra and Path(extra).resolve() not in roots:
            roots.append(Path(extra).resolve())
    locks = sorted(p for root in roots if root.is_dir() for p in root.glob("*/lock"))
    if not locks:
        report("OK", "jit locks", f"no lock files under {', '.join(short(r) for r in roots)}")
        return
    holders = lock_holders(locks)
    stale = [p for p in locks if p not in holders]
    running = ", ".join(f"{short(p.parent)} (pid {pid})" for p, pid in holders.items())
    # Older torch locks with FileBaton: the file's mere existence makes the next load wait
    # forever. Newer torch holds an flock on it instead, so a leftover file is harmless.
    baton = hasattr(cpp_extension, "FileBaton")
    if stale and baton:
        names = " ".join(short(p) for p in stale)
        report("FAIL", "jit locks", f"{len(stale)} stale (no build running): {names}; the next "
               "load of that extension waits forever", f"rm {names}")
    elif stale:
        report("OK", "jit locks", f"{len(stale)} left over (not held); harmless: torch "
               f"{torch.__version__} locks with flock, not by the file's existence"
               + (f"; building now: {running}" if running else ""))
    else:
        report("OK", "jit locks", f"building now: {running}")


# ----------------------------------------------------------------------------------------------


def main() -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `make doctor | head` ends quietly
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    check_python()
    torch = check_torch()
    if torch is not None:
        check_abi(torch)
    check_compiler(torch)
    check_ninja()
    check_compiler_cache()
    check_fibers()
    if torch is not None:
        gpus = visible_gpus(torch)
        check_nvcc(torch)
        check_cuda_home(torch)
        check_gpus(torch, gpus)
        check_arch_list(torch, gpus)
    check_build_dir()
    if torch is not None:
        check_built_stages(torch)
        check_jit_locks(torch)
    failed = [what for status, what, _, _ in results if status == "FAIL"]
    warned = [what for status, what, _, _ in results if status == "WARN"]
    summary = f"{len(failed)} FAIL ({', '.join(failed)})" if failed else "no FAIL"
    summary += f", {len(warned)} WARN ({', '.join(warned)})" if warned else ", no WARN"
    print(f"doctor: {summary}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
