#!/usr/bin/env bash
# Prepare the Python environment every target runs in. Called by the Makefile; safe to rerun.
#
#   scripts/bootstrap.sh venv .venv python3   create .venv (if needed) and install requirements.txt
#   scripts/bootstrap.sh check /path/python   check an interpreter that already has torch (PYTHON=)
#
# A missing prerequisite stops here with one line saying what to install.
set -euo pipefail

mode=${1:?usage: bootstrap.sh venv DIR PYTHON | check PYTHON}
repo=$(cd "$(dirname "$0")/.." && pwd)

say() { printf '[bootstrap] %s\n' "$*"; }
die() { printf '[bootstrap] error: %s\n' "$*" >&2; exit 1; }

check_python() {  # $1: interpreter
  command -v "$1" >/dev/null 2>&1 || die "no Python interpreter '$1'; install Python 3.11 or newer (e.g. apt-get install python3 python3-venv)"
  "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    die "$1 is Python $("$1" -c 'import platform; print(platform.python_version())'); the workbook needs 3.11 or newer (it reads stage.toml with tomllib)"
}

check_compiler() {
  local cxx=${CXX:-c++}
  command -v "$cxx" >/dev/null 2>&1 ||
    die "no C++ compiler ('$cxx' not found); install one (e.g. apt-get install g++) or set CXX"
}

case "$mode" in
  venv)
    venv=${2:?venv dir}; python=${3:-python3}
    check_python "$python"
    check_compiler
    if [ ! -x "$venv/bin/python" ]; then
      say "creating $venv with $python ($("$python" --version 2>&1))"
      "$python" -m venv "$venv" ||
        die "could not create a venv with $python; install the venv module (e.g. apt-get install python3-venv)"
    fi
    say "installing requirements.txt into $venv (torch is large: the first time takes minutes) ..."
    "$venv/bin/python" -m pip install --disable-pip-version-check -q --upgrade pip
    "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q -r "$repo/requirements.txt"
    # The workbook's shared Python, editable: stages, tests and scripts import it from common/.
    "$venv/bin/python" -m pip install --disable-pip-version-check -q --no-build-isolation --no-deps -e "$repo/common"
    # CUDA stages need an nvcc whose major version matches torch's CUDA; where the machine has
    # none, this installs one from pip wheels (a no-op where one is found, or for a CPU torch).
    "$venv/bin/python" -m workbook.build.toolkit install ||
      say "no CUDA toolkit: stage 4 will be skipped and stage 5 built CPU-only"
    say "done: $("$venv/bin/python" -c 'import torch; print(f"torch {torch.__version__} (CUDA {torch.version.cuda})")')"
    ;;
  check)
    python=${2:?python}
    check_python "$python"
    check_compiler
    "$python" -c 'import torch' 2>/dev/null ||
      die "PYTHON=$python cannot import torch; install torch there, or run make without PYTHON= to use a .venv"
    missing=$("$python" -c '
import importlib.util
print(" ".join(m for m in ("ninja", "pytest", "numpy", "setuptools") if importlib.util.find_spec(m) is None))')
    [ -z "$missing" ] || die "PYTHON=$python lacks: $missing (pip install $missing)"
    ;;
  *) die "unknown mode '$mode'" ;;
esac
