"""Build stage 04 ahead of time: `make stage 4`, or from this folder `python setup.py build`.

Needs nvcc (a CUDA toolkit matching torch's CUDA version), not a GPU: the build helper finds the
toolkit and sets CUDA_HOME before torch.utils.cpp_extension is imported, and compiles for the
visible GPUs or, with none, for sm_90 with PTX (9.0+PTX). The build goes under the
repository's build/ folder.
"""

import sys

from setuptools import setup

from workbook.build import compiler, toolkit

if compiler.cuda_toolkit() is None:  # sets CUDA_HOME and TORCH_CUDA_ARCH_LIST when it finds one
    sys.exit(f"stage 04 needs a CUDA toolkit: {toolkit.reason()}")

from torch.utils.cpp_extension import BuildExtension, CUDAExtension  # noqa: E402

setup(
    name="lltm_cuda_raw",
    version="0.1.0",
    packages=["lltm_cuda_raw"],
    ext_modules=[
        CUDAExtension(
            "lltm_cuda_raw._C",
            ["csrc/lltm.cpp", "csrc/lltm_cuda.cu"],
            include_dirs=compiler.include_dirs(),
            extra_compile_args={"cxx": compiler.cxx_flags(), "nvcc": compiler.nvcc_flags()},
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    options=compiler.setup_options(__file__),
)
