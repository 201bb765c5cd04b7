"""Find a CUDA toolkit that matches torch, or install one from pip wheels where there is none.

The CUDA stages need `nvcc` and the CUDA headers of the same major version as the CUDA torch was
built with (``torch.version.cuda``). `find()` looks, in order, at:

1. ``CUDA_HOME`` / ``CUDA_PATH``, when set;
2. the ``nvcc`` on ``PATH``, followed to the toolkit it really runs: nvcc reports its own folder
   under ``--dryrun``, which sees through wrapper scripts such as a ``/usr/local/bin/nvcc`` that
   execs ``/usr/local/cuda-13.0/bin/nvcc`` (where torch's own guess, the wrapper's parent
   ``/usr/local``, has no headers);
3. ``/usr/local/cuda`` and ``/usr/local/cuda-X.Y``;
4. the toolkit `install()` puts together from NVIDIA's pip wheels (``nvidia-cuda-nvcc``,
   ``nvidia-cuda-runtime``, ``nvidia-cuda-cccl``, ``nvidia-cuda-crt``, ``nvidia-nvvm``, pulled in
   through the ``cuda-toolkit`` meta-package's extras), by default in ``.venv/cuda-X.Y``.

A candidate counts when it has ``bin/nvcc``, ``include/cuda_runtime.h`` and a ``libcudart.so`` to
link against, and its nvcc's major version is torch's. The first that counts wins; when none does,
`find()` returns None and `reason()` says what was looked at and how to get one.

From the command line (with ``common/`` on ``sys.path``):

    python -m workbook.build.toolkit          print the toolkit found, or why there is none (exit 1)
    python -m workbook.build.toolkit install  install nvcc and headers from pip wheels if none is
                                              found (exit 1, with the reason, where that cannot be
                                              done)

``WORKBOOK_CUDA_PREFIX`` moves the pip-installed toolkit elsewhere (it must then be set for the
builds as well). ``WORKBOOK_NO_CUDA=1`` makes `find()` report none: CUDA stages are skipped and
stage 05 builds CPU-only, as on a machine without nvcc.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from workbook.build.stages import REPO, cuda_disabled

# The parts of the toolkit an extension build needs, as extras of the `cuda-toolkit` wheel.
WHEEL_EXTRAS = ("nvcc", "cudart", "cccl", "crt", "nvvm")


@dataclasses.dataclass(frozen=True)
class Toolkit:
    home: Path  # what CUDA_HOME must be: bin/nvcc, include/, lib64/ or lib/
    version: str  # nvcc's release, e.g. "13.0"
    found_by: str  # where it was found, for messages

    @property
    def nvcc(self) -> Path:
        return self.home / "bin" / "nvcc"

    def __str__(self) -> str:
        return f"CUDA {self.version} at {self.home} (found by {self.found_by})"


def torch_cuda_version() -> str | None:
    """The CUDA version torch was built with, e.g. "13.0"; None for a CPU-only torch."""
    import torch

    return torch.version.cuda


def default_prefix() -> Path:
    """Where `install` puts the wheels: WORKBOOK_CUDA_PREFIX, else .venv/cuda-X.Y in the repo."""
    if os.environ.get("WORKBOOK_CUDA_PREFIX"):
        return Path(os.environ["WORKBOOK_CUDA_PREFIX"]).resolve()
    return REPO / ".venv" / f"cuda-{torch_cuda_version()}"


def major(version: str) -> str:
    """The major version of a CUDA release: "13" of "13.0"."""
    return version.split(".")[0]


def nvcc_release(nvcc: Path | str) -> str | None:
    """The CUDA release an nvcc reports ("13.0"), or None when it does not run."""
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"release (\d+\.\d+)", out.stdout)
    return match.group(1) if match else None


def _nvcc_home(nvcc: str) -> Path:
    """The toolkit folder an `nvcc` command really runs from, even through a wrapper script."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
        match = re.search(r"^#\$ _HERE_=(.+)$", out.stdout + out.stderr, re.MULTILINE)
        if match:
            return Path(match.group(1).strip()).resolve().parent
    except (OSError, subprocess.TimeoutExpired):
        pass
    return Path(nvcc).resolve().parents[1]


def _has_cudart(home: Path) -> bool:
    return any((home / lib / "libcudart.so").exists() for lib in ("lib64", "lib"))


def check_home(home: Path, wanted: str | None) -> str | None:
    """Why the toolkit at `home` can't build for torch's CUDA `wanted` (None: any version);
    None when it can."""
    if not (home / "bin" / "nvcc").is_file():
        return "no bin/nvcc"
    if not (home / "include" / "cuda_runtime.h").is_file():
        return "no include/cuda_runtime.h"
    if not _has_cudart(home):
        return "no lib64/libcudart.so or lib/libcudart.so"
    release = nvcc_release(home / "bin" / "nvcc")
    if release is None:
        return "bin/nvcc does not run"
    if wanted and major(release) != major(wanted):
        return f"nvcc is CUDA {release}, torch needs CUDA {major(wanted)}.x"
    return None


def _candidates(wanted: str) -> list[tuple[str, Path | None]]:
    """(where, folder) in the order they are tried; folder None when there is nothing there."""
    found = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        found.append((f"${var}", Path(os.environ[var]) if os.environ.get(var) else None))
    nvcc = shutil.which("nvcc")
    found.append(("nvcc on PATH", _nvcc_home(nvcc) if nvcc else None))
    for path in ("/usr/local/cuda", f"/usr/local/cuda-{wanted}"):
        found.append((path, Path(path) if Path(path).exists() else None))
    prefix = default_prefix()
    home = prefix / "nvidia" / f"cu{major(wanted)}"
    found.append((f"pip wheels in {_short(prefix)}", home if home.exists() else None))
    return found


def _short(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


@functools.cache
def _search() -> tuple[Toolkit | None, str]:
    if cuda_disabled():
        return None, "WORKBOOK_NO_CUDA is set"
    wanted = torch_cuda_version()
    if wanted is None:
        import torch

        return None, f"this torch ({torch.__version__}) is a CPU-only build"
    tried = []
    for where, home in _candidates(wanted):
        if home is None:
            tried.append(f"{where}: none")
            continue
        problem = check_home(home, wanted)
        if problem is None:
            return Toolkit(home.resolve(), nvcc_release(home / "bin" / "nvcc"), where), ""
        tried.append(f"{where} ({home}): {problem}")
    return None, (
        f"no CUDA {major(wanted)}.x toolkit for torch's CUDA {wanted}; looked at "
        + "; ".join(tried)
        + ". Install one with `python -m workbook.build.toolkit install` (nvcc and headers "
        "from pip)"
    )


def find() -> Toolkit | None:
    """The CUDA toolkit to build with, or None (then `reason()` says why)."""
    return _search()[0]


def reason() -> str:
    """Why `find()` found no toolkit ("" when it found one)."""
    return _search()[1]


def use(toolkit: Toolkit | None = None) -> Toolkit | None:
    """Point CUDA_HOME at the toolkit found, for torch.utils.cpp_extension to pick up.

    cpp_extension reads CUDA_HOME once, when it is first imported: call this before. If it was
    imported already, its module-level CUDA_HOME is updated too.
    """
    toolkit = toolkit or find()
    if toolkit is not None:
        os.environ["CUDA_HOME"] = str(toolkit.home)
        cpp_extension = sys.modules.get("torch.utils.cpp_extension")
        if cpp_extension is not None:
            cpp_extension.CUDA_HOME = str(toolkit.home)
    return toolkit


def install(prefix: Path | None = None) -> Toolkit:
    """Install nvcc, the CUDA headers and libcudart from pip wheels matching torch's CUDA.

    Only what an extension build needs (~270 MB): no cuBLAS, no profilers. A no-op when a
    matching toolkit is already found. Returns the toolkit.
    """
    found = find()
    if found is not None:
        print(f"[toolkit] using {found}; nothing to install")
        return found
    wanted = torch_cuda_version()
    if wanted is None:
        raise RuntimeError(reason())
    if int(major(wanted)) < 13:
        raise RuntimeError(
            f"torch uses CUDA {wanted}: NVIDIA's wheels before CUDA 13 spread the toolkit over one "
            "folder per package, which nvcc cannot use as one CUDA_HOME; install the CUDA "
            f"{wanted} toolkit from NVIDIA instead (and set CUDA_HOME)"
        )
    prefix = (prefix or default_prefix()).resolve()
    requirement = f"cuda-toolkit[{','.join(WHEEL_EXTRAS)}]=={wanted}.*"
    print(f"[toolkit] installing {requirement} into {_short(prefix)} ...", flush=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--quiet",
         "--upgrade", "--target", str(prefix), requirement],
        check=True,
    )
    home = prefix / "nvidia" / f"cu{major(wanted)}"
    # The wheel ships libcudart.so.N only; the linker's -lcudart looks for libcudart.so.
    lib = home / "lib"
    versioned = sorted(lib.glob("libcudart.so.*"))
    if versioned and not (lib / "libcudart.so").exists():
        (lib / "libcudart.so").symlink_to(versioned[0].name)
    _search.cache_clear()
    found = find()
    if found is None:
        raise RuntimeError(f"installed {requirement}, but it is not usable: {reason()}")
    print(f"[toolkit] installed {found}")
    return found


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", nargs="?", choices=("find", "install"), default="find")
    parser.add_argument("--prefix", type=Path, help="install folder (default: .venv/cuda-X.Y)")
    args = parser.parse_args(argv)
    if args.command == "install":
        try:
            install(args.prefix)
        except (RuntimeError, subprocess.CalledProcessError) as error:
            print(f"[toolkit] could not install a CUDA toolkit: {error}", file=sys.stderr)
            return 1
        return 0
    toolkit = find()
    print(f"[toolkit] {toolkit}" if toolkit else f"[toolkit] none: {reason()}")
    return 0 if toolkit else 1


if __name__ == "__main__":
    sys.exit(main())
