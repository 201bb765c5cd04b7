"""make notebooks: execute every notebook headless through a real Jupyter kernel.

    python scripts/run_notebooks.py                      every notebook in notebooks/: the stages'
                                                         (NN_name) in order, then the appendices
                                                         (A1_name, ...)
    python scripts/run_notebooks.py 03                   the notebooks whose name contains 03
    python scripts/run_notebooks.py --check-clean        only check that notebooks/ holds no outputs

Each notebook runs top to bottom in a fresh ipykernel started with *this* interpreter and this
process's environment (the Makefile's: build folder, PATH with the venv's ninja, MAX_JOBS), with
notebooks/ as its working directory, as when opened in Jupyter. The executed copy, outputs and
all, goes to build/notebooks/<name>.ipynb; the notebooks in notebooks/ are never written, and
are committed without outputs. Any cell error fails the run (exit 1), after every notebook has
had its turn.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
KERNEL_NAME = "workbook-python"


def build_root() -> Path:
    return Path(os.environ.get("WORKBOOK_BUILD_DIR", REPO / "build")).resolve()


def find_notebooks(patterns: list[str]) -> list[Path]:
    # Stage notebooks (NN_name) first, in stage order, then appendices (A1_name, A2_name, ...).
    found = sorted(NOTEBOOKS.glob("*.ipynb"), key=lambda p: (not p.name[:2].isdigit(), p.name))
    if patterns:
        found = [p for p in found if any(pat in p.name for pat in patterns)]
    return found


def outputs_left_in(path: Path) -> list[str]:
    """Why the committed notebook at `path` is not clean: cells with outputs or execution counts."""
    problems = []
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] != "code":
            continue
        if cell.get("outputs"):
            problems.append(f"cell {index} has outputs")
        if cell.get("execution_count") is not None:
            problems.append(f"cell {index} has execution_count {cell['execution_count']}")
    return problems


def write_kernel_spec(folder: Path) -> Path:
    """A kernel spec that starts ipykernel with this very interpreter.

    Jupyter's `python3` spec names plain "python", which a user-level spec or another Python on
    PATH can shadow; this one names sys.executable, so the kernel sees the same torch, the same
    built extensions and the same environment as the process that runs the notebooks.
    """
    spec_dir = folder / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"workbook ({sys.executable})",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1) + "\n")
    return folder


def execute(path: Path, out_dir: Path, kernel_dir: Path, timeout: int) -> tuple[bool, str]:
    """Run one notebook; write the executed copy to out_dir. Returns (ok, error text)."""
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    specs = KernelSpecManager(kernel_dirs=[str(kernel_dir)], ensure_native_kernel=False)
    # IPC sockets instead of TCP: the kernel is local, and ipykernel warns about plain TCP. They
    # live in a short temporary folder (a socket path may not pass ~100 characters).
    sockets = tempfile.mkdtemp(prefix="workbook-kernel-")
    km = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs, transport="ipc",
                       ip=os.path.join(sockets, "kernel"))
    client = NotebookClient(nb, km=km, timeout=timeout, kernel_name=KERNEL_NAME,
                            resources={"metadata": {"path": str(path.parent)}})
    error = ""
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as err:
        error = str(err)
    finally:
        # The client does not own a kernel manager it was handed: stop the kernel here, or it
        # lives (with torch loaded) until this process exits.
        if km.has_kernel:
            km.shutdown_kernel(now=True)
        shutil.rmtree(sockets, ignore_errors=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out_dir / path.name)
    return not error, error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Execute the workbook's notebooks headless.")
    parser.add_argument("patterns", nargs="*", help="run only notebooks whose name contains one")
    parser.add_argument("--timeout", type=int, default=1800,
                        help="seconds one cell may take (default 1800: a CUDA build on 2 cores)")
    parser.add_argument("--check-clean", action="store_true",
                        help="only check that the notebooks in notebooks/ carry no outputs")
    args = parser.parse_args(argv)

    notebooks = find_notebooks(args.patterns)
    if not notebooks:
        print(f"[notebooks] no notebook in {NOTEBOOKS} matches {args.patterns}")
        return 1

    dirty = {p.name: outputs_left_in(p) for p in notebooks}
    dirty = {name: problems for name, problems in dirty.items() if problems}
    for name, problems in dirty.items():
        print(f"[notebooks] notebooks/{name} is committed with outputs ({'; '.join(problems[:3])}"
              f"{'; ...' if len(problems) > 3 else ''}): clear them (Jupyter: Edit > Clear "
              f"Outputs of All Cells) before committing")
    if args.check_clean:
        if not dirty:
            print(f"[notebooks] {len(notebooks)} notebooks, all without outputs")
        return 1 if dirty else 0

    # The builds make test chose for these notebooks: without a GPU, the CUDA stages that have a
    # CPU fallback CPU-only (workbook.build.emulate.choose_builds), in this process's environment,
    # which each notebook's kernel inherits.
    from workbook.build import emulate

    chosen = emulate.choose_builds()
    if chosen:
        print(f"[notebooks] {chosen}", flush=True)
    out_dir = build_root() / "notebooks"
    kernel_dir = write_kernel_spec(out_dir / "kernels")
    print(f"[notebooks] executing {len(notebooks)} notebooks with {sys.executable}; "
          f"executed copies go to {out_dir}", flush=True)
    failed, total_start = [], time.perf_counter()
    for path in notebooks:
        print(f"[notebooks] {path.name} ...", flush=True)
        start = time.perf_counter()
        ok, error = execute(path, out_dir, kernel_dir, args.timeout)
        elapsed = time.perf_counter() - start
        if ok:
            print(f"[notebooks] {path.name} ok in {elapsed:.1f} s", flush=True)
        else:
            failed.append(path.name)
            print(f"[notebooks] {path.name} FAILED after {elapsed:.1f} s "
                  f"(executed copy: {out_dir / path.name}):\n{error}", flush=True)
    elapsed = time.perf_counter() - total_start
    if failed:
        print(f"[notebooks] {len(failed)} of {len(notebooks)} failed in {elapsed:.1f} s: "
              f"{', '.join(failed)}")
        return 1
    print(f"[notebooks] all {len(notebooks)} ran without errors in {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
