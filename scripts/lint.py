"""make lint: ruff over the Python, clang-format over the C++ and CUDA, of every tracked file.

    python scripts/lint.py          check (exit 1 on a finding); what `make lint` and CI run
    python scripts/lint.py --fix    let ruff fix what it can and clang-format rewrite the files

Settings: [tool.ruff] in pyproject.toml and .clang-format, both at the repository root. The
templates of `make new-stage` (scripts/new_stage/) are not source until rendered, and are skipped.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CXX_SUFFIXES = (".cpp", ".h", ".cu", ".cuh")
SKIPPED = ("scripts/new_stage/",)


def tool(name: str) -> str:
    """The tool beside this interpreter (the environment's), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if not found:
        sys.exit(f"[lint] {name} not found: pip install -r requirements-dev.txt (make lint does)")
    return found


def tracked(suffixes: tuple[str, ...]) -> list[str]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split("\0")
    return [n for n in names if n.endswith(suffixes) and not n.startswith(SKIPPED)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fix", action="store_true", help="fix what the tools can fix")
    args = parser.parse_args(argv)
    failed = []

    python = tracked((".py",))
    ruff = [tool("ruff"), "check", *(["--fix"] if args.fix else []), *python]
    print(f"[lint] ruff check: {len(python)} Python files", flush=True)
    if subprocess.run(ruff, cwd=REPO).returncode != 0:
        failed.append("ruff")

    cxx = tracked(CXX_SUFFIXES)
    mode = ["-i"] if args.fix else ["--dry-run", "-Werror"]
    print(f"[lint] clang-format: {len(cxx)} C++/CUDA files", flush=True)
    if subprocess.run([tool("clang-format"), *mode, *cxx], cwd=REPO).returncode != 0:
        failed.append("clang-format (python scripts/lint.py --fix rewrites the files)")

    if failed:
        print(f"[lint] FAILED: {', '.join(failed)}")
        return 1
    print("[lint] clean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
