#!/usr/bin/env bash
# The GPU check, in one run: on a machine with an NVIDIA GPU and a python3 that already has torch
# (the lent H200: torch 2.11, nvcc, ninja, pytest, matplotlib; no network), build the CUDA stages
# for the chip, run their tests (the GPU tests included) and the GPU benchmark. Everything it
# prints goes to $OUT (default build/device-check): environment, test logs, bench results.
#
#   OUT=/tmp/out scripts/device_check.sh          # on the GPU machine, from the repository root
#
# About 6-9 minutes on an H200 with 16 cores, most of it nvcc and torch.compile.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/device-check}
mkdir -p "$out"
export PYTHON=${PYTHON:-python3} PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}

status=0
step() {  # step NAME COMMAND...: run, log to $out/NAME.txt, remember a failure
  local name=$1; shift
  echo "[device-check] $name: $*"
  local start=$SECONDS
  "$@" > "$out/$name.txt" 2>&1 || { status=1; echo "[device-check] $name FAILED"; }
  echo "[device-check] $name: $((SECONDS - start)) s; last lines:"
  tail -n 4 "$out/$name.txt"
}

step env bash -c 'nvidia-smi; make doctor'
step stage4 make stage 4
step stage5 make stage 5
step bench make bench BENCH_ARGS="--device cuda --out $out"
echo "[device-check] done, exit $status; files in $out"
exit $status
