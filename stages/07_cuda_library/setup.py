"""Build or install stage 07, the `extops` library on ATen: stage 06's sources plus the CUDA
kernels of the deformable convolution (`make install` installs stage 10's: the same kernels on the
stable ABI).

    make stage 7                                           build under build/ and test
    pip install --no-build-isolation ./stages/07_cuda_library    then: import extops

Why this folder holds one kernel file and its glue: stage 07 differs from stage 06 by
csrc/deform_conv2d/cuda/ alone (deform_conv2d_cuda.cuh, the kernels, which stage 10 compiles too;
deform_conv2d_cuda.cu, their ATen glue). A copy of stage 06's schemas, CPU kernels, LLTM and
Python package would be the same files twice, to keep in step by hand, and `diff -ru` against
stage 06 would show nothing but that folder anyway; so the library is built from
stage 06's files where they are (../06_op_library/csrc and ../06_op_library/extops) and this
folder's csrc/. The sources are found, not listed: every .cpp under ../06_op_library/csrc, and,
where a CUDA toolkit is found, every .cu under ../06_op_library/csrc and ./csrc; and, as in stage
06, the LLTM's kernels from stage 05. Without a toolkit the library is built CPU-only (the CPU
kernels alone), and says so.

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
STAGE_06 = HERE.parent / "06_op_library"


def sources(folder: Path, pattern: str) -> list[str]:
    """The files matching `pattern` under `folder`, relative to this folder (setuptools wants
    relative paths): ../06_op_library/csrc/... for stage 06's, csrc/... for this stage's."""
    return sorted(os.path.relpath(p, HERE) for p in folder.glob(pattern))


# Stage 06's library, with the LLTM kernels it takes from stage 05 (registered into this library
# by OPS_NAMESPACE), plus this folder's CUDA kernels of the deformable convolution.
LLTM_KERNELS = HERE.parent / "05_cuda_accessors" / "csrc"
cpp_sources = sources(STAGE_06 / "csrc", "**/*.cpp") + sources(LLTM_KERNELS, "lltm_cpu.cpp")
cuda_sources = (sources(STAGE_06 / "csrc", "**/*.cu") + sources(LLTM_KERNELS, "lltm_cuda.cu") +
                sources(HERE / "csrc", "**/*.cu"))
library = [("OPS_NAMESPACE", "extops")]  # the namespace the kernel files register into

# The CPU kernels run on at::parallel_for, which is OpenMP inside torch's headers (without
# -fopenmp it compiles to a serial loop), and on at::vec, which needs SIMD flags to be SIMD.
cxx_flags = compiler.cxx_flags() + compiler.openmp_flags() + compiler.cpu_simd_flags()
if found:
    print(f"building extops with CUDA kernels ({len(cuda_sources)} .cu files): {found}, for "
          f"TORCH_CUDA_ARCH_LIST={compiler.cuda_arch_list()}")
    extension = CUDAExtension(
        "extops._C",
        cpp_sources + cuda_sources,
        include_dirs=compiler.include_dirs(),
        define_macros=library,
        extra_compile_args={"cxx": cxx_flags, "nvcc": compiler.nvcc_flags()},
        extra_link_args=compiler.openmp_flags(),
    )
else:
    print(f"CUDA toolkit not found ({toolkit.reason()}): building extops CPU-only, without "
          f"{', '.join(cuda_sources)}")
    extension = CppExtension(
        "extops._C",
        cpp_sources,
        include_dirs=compiler.include_dirs(),
        define_macros=library,
        extra_compile_args=cxx_flags,
        extra_link_args=compiler.openmp_flags(),
    )

setup(
    name="extops",
    version="0.1.0",
    description="Custom PyTorch ops with CPU and CUDA kernels: the LLTM cell, deformable "
    "convolution v2",
    packages=["extops"],
    package_dir={"extops": "../06_op_library/extops"},
    install_requires=["torch"],
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension},
    options=compiler.setup_options(__file__),
)
