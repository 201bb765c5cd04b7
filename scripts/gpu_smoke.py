"""Every CUDA kernel of every stage, once, on small inputs: what compute-sanitizer watches.

    python scripts/gpu_smoke.py                      every CUDA stage, every op it implements
    compute-sanitizer --tool memcheck --error-exitcode 1 python scripts/gpu_smoke.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python scripts/gpu_smoke.py

For each stage with CUDA sources and each of its ops: the descriptor's smallest case and one
larger one, forward and backward on the GPU in float32 and half, checked against the float64
reference (so a kernel that runs clean but wrong fails too). Small on purpose: under the
sanitizer every memory access is instrumented, and a kernel runs 10-100x slower. Stages that
share a package (06 and 07 build `extops`) run in separate processes (--stage N).
Exit status 1 on a mismatch or an error; 2 where no GPU is visible.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys

import torch

from workbook import ops
from workbook.build import stages
from workbook.build.loader import import_stage
from workbook.spec import compare


def smoke_op(stage: stages.Stage, module, name: str) -> bool:
    spec = ops.get(name)
    by_size = sorted(spec.cases, key=lambda c: math.prod(c.sizes.values()))
    ok = True
    for case in (spec.batch0(), by_size[0], by_size[len(by_size) // 2]):
        for dtype in (torch.float32, torch.float16):
            sample = spec.make(case, device="cuda", dtype=dtype)
            try:
                result = compare(getattr(module, name), spec, sample)
            except NotImplementedError as error:  # stage 06's deform_conv2d: CPU kernels only
                if "'CUDA' backend" not in str(error):
                    raise
                print(f"[gpu-smoke] {stage.label} {name}: no CUDA kernel in this stage, skipped",
                      flush=True)
                return True
            torch.cuda.synchronize()
            status = "ok" if result.ok else "MISMATCH"
            print(f"[gpu-smoke] {stage.label} {name} {case.name} {dtype}: {status}", flush=True)
            for failure in result.failures():
                print(f"    {failure}")
            ok &= result.ok
    return ok


def smoke_stage(number: int) -> bool:
    stage = stages.get(number)
    module = import_stage(stage)
    results = [smoke_op(stage, module, name) for name in stage.ops]  # each op, whatever the others
    return all(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, help="one stage (default: every CUDA stage, each "
                        "in a process of its own)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("[gpu-smoke] no CUDA device visible: nothing to run", file=sys.stderr)
        return 2
    if args.stage is not None:
        return 0 if smoke_stage(args.stage) else 1
    failed = []
    for stage in (s for s in stages.all_stages() if s.cuda):
        proc = subprocess.run([sys.executable, __file__, "--stage", str(stage.number)])
        if proc.returncode != 0:
            failed.append(stage.label)
    if failed:
        print(f"[gpu-smoke] FAILED: {', '.join(failed)}")
        return 1
    print("[gpu-smoke] every CUDA kernel ran and matched its reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
