"""make nvcc-check: the CUDA stages compiled with nvcc, linked, and loaded with their CUDA kernels.

    python -m workbook.build.nvcc_check            every CUDA stage
    python -m workbook.build.nvcc_check 7 9        those

Where no GPU is visible, `make test` builds the CUDA stages that have a CPU fallback without nvcc
(workbook.build.emulate.choose_builds): their CUDA tests run on the emulated device, whose kernels
are the same .cu files compiled for the CPU. What only nvcc can tell, that it accepts those files
and that the library links and loads with their kernels, is told here. Each stage is built as on
a GPU machine (WORKBOOK_NVCC=1, into build/stages/), then the tests that check such a build run,
each stage's in a pytest process of its own (workbook.testing.suite), the CUDA tests off: the
package imports (from anywhere, without the workbook) and registers CUDA kernels for its ops.
Where a GPU is visible, `make test` has done all of this, and the builds here are up to date.
Without a CUDA toolkit there is nothing to compile, and it says so.
"""

from __future__ import annotations

import argparse
import os
import sys

from workbook.build import stages, toolkit

# The tests of a stage that check its build rather than its arithmetic, by name.
BUILD_TESTS = ("cuda_kernels_are_compiled_in or cuda_kernels_are_built or imports_with_both or "
               "imports_from_anywhere")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", nargs="*", help="stage numbers or folder names (default: every "
                        "CUDA stage)")
    args = parser.parse_args(argv)
    os.environ[stages.NVCC] = "1"  # before any stage is read: their nvcc builds
    os.environ["WORKBOOK_CUDA"] = "off"  # the packages as built, not the emulated device's copy
    targets = [stages.get(s) for s in args.stage] or stages.all_stages()
    targets = [s for s in targets if s.cuda]
    if not targets:
        print("[nvcc-check] no CUDA stage among those named: nothing to compile")
        return 0
    from workbook.build.compiler import cuda_toolkit

    found = cuda_toolkit()
    if found is None:
        print(f"[nvcc-check] no CUDA toolkit, so nothing to compile: {toolkit.reason()}")
        return 0
    numbers = [str(s.number) for s in targets]
    print(f"[nvcc-check] stages {', '.join(numbers)} with nvcc ({found}), then the tests of "
          f"their builds (-k '{BUILD_TESTS}')", flush=True)
    from workbook.build.side_by_side import build_side_by_side
    from workbook.testing import suite

    if build_side_by_side(targets, require_cuda=True) != 0:
        return 1
    return suite.main([*numbers, "--", "-k", BUILD_TESTS])


if __name__ == "__main__":
    sys.exit(main())
