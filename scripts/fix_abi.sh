#!/usr/bin/env bash
# Find and repair a C++11 ABI mismatch between a built extension and torch.
#
#   scripts/fix_abi.sh [--check] [STAGE | path/to/extension.so]
#   make fix-abi STAGE=N
#
# The failure it repairs: an extension compiled with -D_GLIBCXX_USE_CXX11_ABI=0 while torch was
# built with 1 (or the other way round) names std::string differently from torch, so importing it
# stops with `ImportError: ... undefined symbol: _ZN3c10...Ss...`. The evidence is in the
# extension's undefined symbols (nm -D, demangled with c++filt): the new ABI spells the string
# `std::__cxx11::basic_string` (mangled with `__cxx11`/`B5cxx11`), the old one plain
# `std::basic_string` (mangled `Ss`), and torch exports its functions in one form only.
#
# For a workbook stage (a number, a stage folder name, or a library built under build/) it says
# what it found, rebuilds the stage through the project's own build with torch's ABI
# (`python -m workbook.build N --force`) and checks the result imports. With no argument it
# checks every stage built so far. A library that is not a workbook stage is only diagnosed.
#
#   --check   report only, change nothing
#
# Exit status: 0 when the build is (now) consistent with torch, 1 when it is not and was not (or
# could not be) repaired, 2 on a usage error.
# Environment: PYTHON (the interpreter with torch; default .venv/bin/python, then python3),
# WORKBOOK_BUILD_DIR (the build folder, as for `make`), WORKBOOK_CXX11_ABI (what is being undone).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)

say() { printf '[fix-abi] %s\n' "$*"; }
die() { printf '[fix-abi] error: %s\n' "$1" >&2; exit "${2:-1}"; }
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }

check_only=0
target=""
while [ $# -gt 0 ]; do
  case "$1" in
    --check) check_only=1 ;;
    -h | --help) usage; exit 0 ;;
    -*) die "unknown option '$1' (usage: fix_abi.sh [--check] [STAGE | path/to/extension.so])" 2 ;;
    *) [ -z "$target" ] || die "one stage or library at a time (got '$target' and '$1')" 2
       target=$1 ;;
  esac
  shift
done

# -- tools and interpreter ---------------------------------------------------------------------

for tool in nm c++filt; do
  command -v "$tool" >/dev/null 2>&1 ||
    die "'$tool' not found; it comes with binutils (e.g. apt-get install binutils)"
done

if [ -n "${PYTHON:-}" ]; then
  py=$PYTHON
elif [ -x "$repo/.venv/bin/python" ]; then
  py=$repo/.venv/bin/python
else
  py=python3
fi
command -v "$py" >/dev/null 2>&1 || die "no Python interpreter '$py' (set PYTHON=/path/to/python)"
py=$(command -v "$py")
# The workbook package, and the interpreter's bin folder first (torch runs `ninja` by name).
export PYTHONPATH="$repo/common${PYTHONPATH:+:$PYTHONPATH}"
PATH="$(dirname "$py"):$PATH"
export PATH

torch_line=$("$py" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI), torch.__version__)' 2>/dev/null) ||
  die "$py cannot import torch (set PYTHON= to an interpreter that has it, or run make env)"
torch_abi=${torch_line%% *}
torch_version=${torch_line#* }

abi_words() {  # $1: 0 or 1
  if [ "$1" = 1 ]; then echo "the new C++11 ABI (_GLIBCXX_USE_CXX11_ABI=1)"
  else echo "the old pre-C++11 ABI (_GLIBCXX_USE_CXX11_ABI=0)"; fi
}
abi_name() { if [ "$1" = 1 ]; then echo new; else echo old; fi; }

say "torch $torch_version ($py) is built with $(abi_words "$torch_abi")"
other_abi=$((1 - torch_abi))
if [ "${WORKBOOK_CXX11_ABI:-}" = "$other_abi" ]; then
  say "note: WORKBOOK_CXX11_ABI=$other_abi is set here: it forces the other ABI on every build;" \
      "unset it (unset WORKBOOK_CXX11_ABI) or the next build makes the same mistake"
fi

# -- which libraries -------------------------------------------------------------------------

# One line per library: stage number, stage folder, build kind, build root, library path; "-" for
# the stage fields of a library that no workbook stage built. With no target, every stage built.
resolve() {  # $1: target ("" for all)
  "$py" - "$1" <<'PY'
import sys
from pathlib import Path

from workbook.build import stages

target = sys.argv[1]


def libraries(s, root):
    if s.kind == "setup":
        return sorted((root / "stages" / s.folder / "lib" / s.package).glob("*.so"))
    jit = root / "jit" / s.package / f"{s.package}.so"  # what a fresh process loads
    return [jit] if jit.is_file() else []


def emit(s, root, lib):
    fields = (s.number, s.folder, s.kind) if s else ("-", "-", "-")
    print(*fields, root, lib, sep="\t")


def owner(lib):
    """(stage, build root) of a library under <root>/stages/<folder>/lib/<package>/ or
    <root>/jit/<package>/; (None, None) for any other library."""
    parts = lib.parts
    for s in stages.all_stages():
        if s.kind == "setup" and parts[-5:-1] == ("stages", s.folder, "lib", s.package):
            return s, Path(*parts[:-5])
        if s.kind == "jit" and parts[-3:-1] == ("jit", s.package):
            return s, Path(*parts[:-3])
    return None, None


if target and ("/" in target or target.endswith(".so")):
    lib = Path(target).resolve()
    if not lib.is_file():
        sys.exit(f"[fix-abi] error: no such file: {target}")
    s, root = owner(lib)
    emit(s, root or "-", lib)
elif target:
    try:
        s = stages.get(target)
    except ValueError as error:
        sys.exit(f"[fix-abi] error: {error}")
    libs = libraries(s, stages.build_root())
    if not libs:  # not built yet: report it with no library
        emit(s, stages.build_root(), "-")
    for lib in libs:
        emit(s, stages.build_root(), lib)
else:
    for s in stages.all_stages():
        for lib in libraries(s, stages.build_root()):
            emit(s, stages.build_root(), lib)
PY
}

# -- evidence ------------------------------------------------------------------------------------

# Sets lib_abi (0, 1, mixed or none), n_new, n_old, old_torch (demangled torch symbols spelled the
# old way) and new_torch (the same, spelled the new way) from the library's undefined symbols.
inspect_symbols() {  # $1: library
  local mangled demangled new old
  mangled=$(nm -D --undefined-only "$1" | awk '{print $NF}')
  demangled=$(c++filt <<<"$mangled")
  # New ABI: the string types live in std::__cxx11 (mangled St7__cxx11 or the B5cxx11 tag).
  new=$(paste <(printf '%s\n' "$mangled") <(printf '%s\n' "$demangled") |
    awk -F'\t' '$1 ~ /B5cxx11|St7__cxx11/ {print $2}')
  # Old ABI: std::string / basic_string and the string streams straight in std::.
  old=$(grep -E 'std::(string|basic_string<|basic_[io]?stringstream<|basic_stringbuf<)' <<<"$demangled" || true)
  n_new=$(grep -c . <<<"$new" || true)
  n_old=$(grep -c . <<<"$old" || true)
  old_torch=$(grep -E '^(c10|at|torch|caffe2)::' <<<"$old" || true)
  new_torch=$(grep -E '^(c10|at|torch|caffe2)::' <<<"$new" || true)
  if [ "$n_new" -gt 0 ] && [ "$n_old" -eq 0 ]; then lib_abi=1
  elif [ "$n_old" -gt 0 ] && [ "$n_new" -eq 0 ]; then lib_abi=0
  elif [ "$n_old" -gt 0 ]; then lib_abi=mixed
  else lib_abi=none
  fi
}

# A stable-ABI build (stage 10) calls libtorch through its C shims only (aoti_torch_*, torch_*):
# no C++ name of c10, ATen or torch among its undefined symbols, so its C++11 ABI setting cannot
# clash with torch's. True for such a library.
stable_abi() {  # $1: library
  local names
  names=$(nm -D --undefined-only "$1" | awk '{print $NF}' | sed 's/@.*//')
  grep -qE '^(aoti_torch_|torch_)' <<<"$names" || return 1
  ! c++filt <<<"$names" | grep -qE '^(c10|at|torch|caffe2)::'
}

# Loads the library in a fresh interpreter after torch, as `import` would. Sets import_error ("" when
# it loads) and missing (the undefined symbol it names, if any).
try_import() {  # $1: kind, $2: library
  import_error=$("$py" - "$1" "$2" <<'PY' 2>&1
import importlib
import importlib.util
import sys
from pathlib import Path

import torch  # noqa: F401  (loads libc10 and libtorch, which the extension links against)

kind, lib = sys.argv[1], Path(sys.argv[2])
try:
    if kind == "setup":  # the stage's package: <lib dir>/<package>/<library>.so
        sys.path.insert(0, str(lib.parents[1]))
        importlib.import_module(lib.parent.name)
    else:
        name = lib.name.split(".")[0]
        spec = importlib.util.spec_from_file_location(name, lib)
        try:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        except ImportError as error:
            if "module export function" not in str(error):
                raise
            torch.ops.load_library(str(lib))  # an op library with no Python module in it
except Exception as error:  # noqa: BLE001  (whatever stops the import is the answer)
    print(f"{type(error).__name__}: {error}")
PY
  ) || true
  import_error=$(tail -n 1 <<<"$import_error")
  missing=$(grep -oE 'undefined symbol: [^ ,]+' <<<"$import_error" | sed 's/undefined symbol: //' || true)
}

show() {  # $1: indent, $2: lines; prints at most three of them
  local line count=0
  while IFS= read -r line; do
    [ -n "$line" ] || continue
    count=$((count + 1))
    [ "$count" -le 3 ] || { say "$1... and $(($(grep -c . <<<"$2") - 3)) more"; break; }
    say "$1$line"
  done <<<"$2"
}

# Reports on one library in plain words. Returns 0 when it is consistent with torch and imports.
diagnose() {  # $1: kind, $2: library, $3: build record file (may not exist)
  inspect_symbols "$2"
  try_import "$1" "$2"
  case "$lib_abi" in
    "$torch_abi")
      say "  symbols: built with $(abi_words "$lib_abi"), as torch is ($((n_new + n_old)) undefined symbols" \
          "spell std::string the $(abi_name "$lib_abi") way, none the other)" ;;
    none)
      say "  symbols: none of its undefined symbols passes a std::string, so either ABI links" ;;
    mixed)
      say "  symbols: MIXED: $n_new undefined symbols use the new std::__cxx11::basic_string and" \
          "$n_old the old std::basic_string: its object files were compiled with different" \
          "_GLIBCXX_USE_CXX11_ABI settings"
      show "    old: " "$old_torch" ;;
    *)
      say "  symbols: built with $(abi_words "$lib_abi"), but torch uses $(abi_words "$torch_abi")"
      local wrong=$old_torch
      [ "$lib_abi" = 0 ] || wrong=$new_torch
      if [ -n "$wrong" ]; then
        say "  $(grep -c . <<<"$wrong") of its undefined symbols are torch functions taking a" \
            "std::string in the form torch does not export, e.g."
        show "    " "$wrong"
      fi ;;
  esac
  if [ -f "$3" ]; then
    local recorded
    recorded=$(grep -oE '_GLIBCXX_USE_CXX11_ABI=[01]' "$3" || true)
    [ -z "$recorded" ] || say "  build record ($(basename "$3")): compiled with -D$recorded"
  fi
  if [ -z "$import_error" ]; then
    say "  import: loads"
  else
    say "  import: FAILS: $import_error"
    [ -z "$missing" ] || say "    the missing symbol is $(c++filt <<<"$missing")"
  fi
  [ -z "$import_error" ] && { [ "$lib_abi" = "$torch_abi" ] || [ "$lib_abi" = none ]; }
}

short() { local p=$1; echo "${p#"$repo"/}"; }

# -- check, and repair -------------------------------------------------------------------------

lines=$(resolve "$target") || exit 2
if [ -z "$lines" ]; then
  say "no stage is built under $(short "$("$py" -c 'from workbook.build import stages; print(stages.build_root())')");" \
      "nothing to check (build one with make stage N)"
  exit 0
fi

status=0
while IFS=$'\t' read -r number folder kind root lib <&3; do
  if [ "$lib" = - ]; then
    say "stage $number ($folder) is not built under $(short "$root")"
    if [ "$check_only" = 1 ]; then say "  NOT BUILT: make stage $number"; status=1; continue; fi
  else
    if [ "$number" = - ]; then say "$(short "$lib"): not built by a workbook stage"
    else say "stage $number ($folder): $(short "$lib")"; fi
    if ! nm -D --undefined-only "$lib" >/dev/null 2>&1; then
      why=$(nm -D "$lib" 2>&1 | head -n 1 || true)
      say "  NOT A SHARED LIBRARY: nm cannot read its dynamic symbols${why:+ ($why)}"
      status=1; continue
    fi
    if stable_abi "$lib"; then
      say "  symbols: a stable-ABI build: it calls libtorch through C shims only (aoti_torch_*," \
          "torch_*), no C++ name of c10, ATen or torch, so the C++11 ABI cannot clash: nothing" \
          "to repair"
      try_import "$kind" "$lib"
      if [ -z "$import_error" ]; then say "  import: loads"; say "  OK: consistent with torch"
      else
        say "  import: FAILS: $import_error"
        say "  NOT AN ABI PROBLEM: a torch older than the one it targets (TORCH_TARGET_VERSION)?"
        status=1
      fi
      continue
    fi
    if diagnose "$kind" "$lib" "$root/stages/$folder/build-flags.txt"; then
      say "  OK: consistent with torch"
      continue
    fi
    if [ "$lib_abi" = "$torch_abi" ] || [ "$lib_abi" = none ]; then
      say "  NOT AN ABI PROBLEM: its ABI matches torch's, yet it does not import." \
          "Built against another torch version? Rebuild it (make stage N) or read the error above"
      status=1; continue
    fi
    if [ "$number" = - ]; then
      say "  MISMATCH, CANNOT REPAIR: this library is not a workbook stage, so there is no build to" \
          "rerun; rebuild it from its own sources with -D_GLIBCXX_USE_CXX11_ABI=$torch_abi"
      status=1; continue
    fi
    if [ "$check_only" = 1 ]; then
      say "  MISMATCH: repair it with scripts/fix_abi.sh $number (make fix-abi STAGE=$number)"
      status=1; continue
    fi
  fi
  say "  rebuilding stage $number with torch's ABI: WORKBOOK_CXX11_ABI=$torch_abi" \
      "WORKBOOK_BUILD_DIR=$(short "$root") python -m workbook.build $number --force"
  if ! WORKBOOK_CXX11_ABI=$torch_abi WORKBOOK_BUILD_DIR=$root "$py" -m workbook.build "$number" --force; then
    say "  FAILED: the rebuild did not succeed (see the errors above)"; status=1; continue
  fi
  [ "$lib" != - ] || lib=$(WORKBOOK_BUILD_DIR=$root resolve "$number" | cut -f5 | head -n 1)
  if [ ! -f "$lib" ]; then
    say "  FAILED: the rebuild left no library at $(short "$lib")"; status=1; continue
  fi
  say "  after the rebuild:"
  if diagnose "$kind" "$lib" "$root/stages/$folder/build-flags.txt"; then
    say "  FIXED: stage $number is built with torch's ABI and imports"
  else
    say "  FAILED: still inconsistent after the rebuild"; status=1
  fi
done 3<<<"$lines"
exit "$status"
