"""Build or install stage 08, the `lltm_coop` package: stage 05's LLTM with CUDA kernels of its
own for the matrix products and the bias gradient, kernels whose threads cooperate.

    make stage 8                                                    build under build/ and test
    pip install --no-build-isolation ./stages/08_cooperating_threads  then: import lltm_coop

What this folder holds is the lesson alone: csrc/lltm_cooperating.cuh (the tiled matrix product,
the block reduction) and csrc/lltm_cuda.cu (stage 05's CUDA glue, calling them). The rest is
stage 05's, built from where it is: the schemas and the CPU kernels (../05_cuda_accessors/csrc),
the pointwise CUDA kernels (its lltm_cuda.cuh) and the Python package (../05_cuda_accessors/lltm,
installed here as `lltm_coop`, the library's name: OPS_NAMESPACE). Without a CUDA toolkit the
package is built CPU-only, stage 05's CPU kernels alone, and says so.

--no-build-isolation builds against the torch already installed (an isolated build would fetch
another torch, whose ABI need not match). The workbook's build helpers (common/workbook) are used
at build time only: the installed package needs torch alone.
"""

import os
from pathlib import Path

from setuptools import setup

from workbook.build import compiler, toolkit

found = compiler.cuda_toolkit()  # sets CUDA_HOME and TORCH_CUDA_ARCH_LIST when it finds one

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

HERE = Path(__file__).resolve().parent
STAGE_05 = HERE.parent / "05_cuda_accessors"


def relative(path: Path) -> str:
    return os.path.relpath(path, HERE)  # setuptools wants paths relative to this folder


cpp_sources = [relative(STAGE_05 / "csrc" / name) for name in ("lltm.cpp", "lltm_cpu.cpp")]
cuda_sources = [relative(HERE / "csrc" / "lltm_cuda.cu")]  # in place of stage 05's
include_dirs = compiler.include_dirs() + [str(HERE / "csrc"), str(STAGE_05 / "csrc")]
library = [("OPS_NAMESPACE", "lltm_coop")]  # the library the files declare and register into

# The CPU kernel runs on at::parallel_for, which is OpenMP inside torch's headers (without
# -fopenmp it compiles to a serial loop), and on at::vec, which needs SIMD flags to be SIMD.
cxx_flags = compiler.cxx_flags() + compiler.openmp_flags() + compiler.cpu_simd_flags()
if found:
    print(f"building lltm_coop with CUDA kernels: {found}, for TORCH_CUDA_ARCH_LIST="
          f"{compiler.cuda_arch_list()}")
    extension = CUDAExtension(
        "lltm_coop._C",
        cpp_sources + cuda_sources,
        include_dirs=include_dirs,
        define_macros=library,
        extra_compile_args={"cxx": cxx_flags, "nvcc": compiler.nvcc_flags()},
        extra_link_args=compiler.openmp_flags(),
    )
else:
    print(f"CUDA toolkit not found ({toolkit.reason()}): building lltm_coop CPU-only")
    extension = CppExtension(
        "lltm_coop._C",
        cpp_sources,
        include_dirs=include_dirs,
        define_macros=library,
        extra_compile_args=cxx_flags,
        extra_link_args=compiler.openmp_flags(),
    )

setup(
    name="lltm_coop",
    version="0.1.0",
    description="The LLTM cell as PyTorch custom ops, with CUDA kernels whose threads cooperate "
    "(a tiled matrix product, a block reduction)",
    packages=["lltm_coop"],
    package_dir={"lltm_coop": relative(STAGE_05 / "lltm")},
    install_requires=["torch"],
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension},
    options=compiler.setup_options(__file__),
)
