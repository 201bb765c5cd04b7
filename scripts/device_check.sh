#!/usr/bin/env bash
# The GPU check, in one command that fits a 10-minute slot: on a machine with an NVIDIA GPU and a
# python3 that already has torch (the lent H200: torch 2.11, nvcc, ninja, pytest; no network).
#
#   PYTHON=python3 OUT=/tmp/out scripts/device_check.sh        (make gpu-check does the same)
#
# Steps, each with a timeout of its own; the first that cannot go on stops the run, non-zero, with
# one line saying why:
#   1. preflight: a GPU is visible, nvcc's major version is torch's CUDA's, the Python has what
#      the builds and tests need;
#   2. build every CUDA stage (stage.toml: cuda = true) for the visible GPU only, in parallel; a
#      stage that is skipped, fails to build or fails to import stops the run;
#   3. test every CUDA stage (one pytest process each, --junitxml, --durations); a GPU test that
#      is skipped on this GPU machine counts as a failure;
#   4. compute-sanitizer memcheck over a small run of every CUDA kernel (scripts/gpu_smoke.py),
#      racecheck where a stage's kernels use shared memory (CUB's sort in stage 07, the tiles and
#      the block reduction of stage 08), synccheck where they have barriers or shuffles;
#   Estimated on a 16-core H200 from this 2-core machine's figures: builds ~1.5 min (in parallel;
#   the longest single nvcc unit, stage 07's .cu, bounds it), tests ~3 min (here the CPU parts
#   take ~2 min; the GPU adds torch.compile and opcheck runs), sanitizer ~2 min (torch's import,
#   ~5 s, dominates each small run), quick benchmark ~1 min: about 7.5 minutes. Each step prints
#   its time in summary.txt.
#   5. the GPU benchmark in its quick mode (bench/run.py --device cuda --smoke), which writes its
#      JSON and Markdown after every configuration.
# Everything lands in $OUT (default build/device-check), bundled into a few files: summary.txt
# (one line per step), logs.tgz (every log, build log and JUnit file) and the benchmark results.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=${OUT:-$repo/build/device-check}
mkdir -p "$out" && out=$(cd "$out" && pwd)
logs=$out/logs
mkdir -p "$logs"
export PYTHON=${PYTHON:-python3} PYTHONUNBUFFERED=1 PYTHONPATH=$repo/common
export WORKBOOK_BUILD_DIR=${WORKBOOK_BUILD_DIR:-$repo/build}
export TORCH_EXTENSIONS_DIR=$WORKBOOK_BUILD_DIR/jit TORCHINDUCTOR_CACHE_DIR=$WORKBOOK_BUILD_DIR/inductor
summary=$out/summary.txt
: > "$summary"
status=0
start_all=$SECONDS

note() { echo "[device-check] $*" | tee -a "$summary"; }

bundle() {  # logs (build logs, JUnit files) into one archive; bench results beside it
  for f in "$WORKBOOK_BUILD_DIR"/stages/*/build.log; do
    [ -f "$f" ] && cp "$f" "$logs/build-$(basename "$(dirname "$f")").log"
  done
  tar -C "$out" -czf "$out/logs.tgz" logs 2>/dev/null && rm -rf "$logs"
  note "total $((SECONDS - start_all)) s; exit $status; files in $out"
}

stop() {  # stop NAME WHY: the run cannot go on
  status=1
  note "STOP at $1: $2"
  bundle
  exit 1
}

step() {  # step NAME TIMEOUT_S COMMAND...: run under timeout, log to logs/NAME.log
  local name=$1 limit=$2
  shift 2
  local begin=$SECONDS
  echo "[device-check] $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  local took=$((SECONDS - begin))
  if [ $rc -eq 0 ]; then
    note "ok   $name ${took}s"
  else
    [ $rc -eq 124 ] && why="timed out after ${limit}s" || why="exit $rc"
    note "FAIL $name ${took}s ($why); last lines:"
    tail -n 8 "$logs/$name.log" | sed 's/^/       /' | tee -a "$summary"
    status=1
  fi
  return $rc
}

# -- 1. preflight ---------------------------------------------------------------------------------

command -v "$PYTHON" > /dev/null || stop preflight "no interpreter '$PYTHON'"
step preflight 120 "$PYTHON" - <<'PY' || stop preflight "$(tail -n 1 "$logs/preflight.log")"
import importlib.util, subprocess, sys
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, python {sys.version.split()[0]}")
if not torch.cuda.is_available():
    sys.exit("no GPU visible: torch.cuda.is_available() is False")
for i in range(torch.cuda.device_count()):
    print(f"GPU {i}: {torch.cuda.get_device_name(i)}, sm_{''.join(map(str, torch.cuda.get_device_capability(i)))}")
missing = [m for m in ("ninja", "pytest", "numpy", "setuptools") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"this Python lacks {', '.join(missing)}")
from workbook.build import toolkit
found = toolkit.find()
if found is None:
    sys.exit(f"no CUDA toolkit matching torch's CUDA {torch.version.cuda}: {toolkit.reason()}")
print(f"toolkit: {found}")
print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
PY
arch=$("$PYTHON" -c 'from workbook.build import compiler; print(compiler.cuda_arch_list())')
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch}
cuda_stages=$("$PYTHON" -c 'from workbook.build import stages; print(" ".join(str(s.number) for s in stages.all_stages() if s.cuda))')
[ -n "$cuda_stages" ] || stop preflight "no stage has cuda = true"
note "CUDA stages: $cuda_stages; TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"

# -- 2. build, in parallel, then import -------------------------------------------------------

cores=$(nproc)
count=$(echo "$cuda_stages" | wc -w)
export MAX_JOBS=${MAX_JOBS:-$(( cores / count > 1 ? cores / count : 1 ))}
pids=()
for n in $cuda_stages; do
  ( step "build-$n" 420 "$PYTHON" -m workbook.build "$n" --require-cuda ) &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
[ $status -eq 0 ] || stop build "a CUDA stage was skipped or failed to build (see logs/build-*.log)"
for n in $cuda_stages; do
  step "import-$n" 120 "$PYTHON" -c "from workbook.build.loader import import_stage; print(import_stage($n).__file__)" ||
    stop "import-$n" "stage $n does not import"
done

# -- 3. tests ---------------------------------------------------------------------------------

for n in $cuda_stages; do
  folder=$("$PYTHON" -c "from workbook.build import stages; print(stages.get($n).source_dir)")
  step "test-$n" 300 "$PYTHON" -m pytest "$folder" -q -rs -p no:cacheprovider \
    --junitxml="$logs/junit-$n.xml" --durations=15
  if grep -q "SKIPPED.*no CUDA device" "$logs/test-$n.log"; then
    note "FAIL test-$n: GPU tests skipped on a GPU machine"
    status=1
  fi
  grep -E "passed|failed" "$logs/test-$n.log" | tail -n 1 | sed "s/^/       stage $n: /" | tee -a "$summary"
done

# -- 4. compute-sanitizer ---------------------------------------------------------------------

if command -v compute-sanitizer > /dev/null; then
  for n in $cuda_stages; do
    tools=memcheck
    # racecheck looks for hazards in shared memory: only kernels that use it (or CUB's, which
    # does) can have them, and it is slow; synccheck, for barriers and warp collectives that not
    # every thread reaches, where a kernel has them (stage 08's).
    folder=$("$PYTHON" -c "from workbook.build import stages; print(stages.get($n).source_dir)")
    kernels=(--include='*.cu' --include='*.cuh')
    if grep -rqE "__shared__|cub::" "${kernels[@]}" "$folder"; then tools="$tools racecheck"; fi
    if grep -rqE "__syncthreads|__syncwarp|__shfl_|_sync\(" "${kernels[@]}" "$folder"; then
      tools="$tools synccheck"
    fi
    for tool in $tools; do
      step "sanitizer-$tool-$n" 240 compute-sanitizer --tool "$tool" --error-exitcode 1 \
        "$PYTHON" scripts/gpu_smoke.py --stage "$n"
    done
  done
else
  step gpu-smoke 240 "$PYTHON" scripts/gpu_smoke.py
  note "note: no compute-sanitizer here; the kernels ran unwatched"
fi

# -- 5. benchmark (quick) ---------------------------------------------------------------------

step bench 300 "$PYTHON" bench/run.py --device cuda --smoke --out "$out/bench"
for f in "$out"/bench/*/*.json "$out"/bench/*/*.md; do
  [ -f "$f" ] && mv "$f" "$out/bench-$(basename "$(dirname "$f")")-$(basename "$f")"
done
rm -rf "$out/bench"

bundle
exit $status
