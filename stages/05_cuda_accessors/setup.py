"""Build or install stage 05, the `lltm` package.

    make stage 5                                                 build under build/ and test
    pip install --no-build-isolation ./stages/05_cuda_accessors  install `lltm` into this Python

--no-build-isolation builds against the torch already installed (an isolated build would fetch
another torch, whose ABI need not match). The workbook's build helpers (common/workbook) are used
here, at build time only: they find a CUDA toolkit matching torch and set CUDA_HOME before
torch.utils.cpp_extension is imported, choose the GPU architectures and the compiler flags, and
keep build/ and *.egg-info out of this folder. Without a toolkit, lltm is built CPU-only.
"""

from setuptools import setup

from workbook.build import compiler, toolkit

found = compiler.cuda_toolkit()  # sets CUDA_HOME and TORCH_CUDA_ARCH_LIST when it finds one

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

# The CPU kernel runs on at::parallel_for, which is OpenMP inside torch's headers (without
# -fopenmp it would compile to a serial loop), and on at::vec, which needs SIMD flags to be SIMD.
cpu_sources = ["csrc/lltm.cpp", "csrc/lltm_cpu.cpp"]
cxx_flags = compiler.cxx_flags() + compiler.openmp_flags() + compiler.cpu_simd_flags()
# The kernel files register into the library named here (torch.ops.lltm.*); stage 06 compiles
# them into its own (OPS_NAMESPACE=extops).
library = [("OPS_NAMESPACE", "lltm")]
if found:
    print(f"building lltm with CUDA kernels: {found}, for TORCH_CUDA_ARCH_LIST="
          f"{compiler.cuda_arch_list()}")
    extension = CUDAExtension(
        "lltm._C",
        cpu_sources + ["csrc/lltm_cuda.cu"],
        include_dirs=compiler.include_dirs(),
        define_macros=library,
        extra_compile_args={"cxx": cxx_flags, "nvcc": compiler.nvcc_flags()},
        extra_link_args=compiler.openmp_flags(),
    )
else:
    print(f"CUDA toolkit not found ({toolkit.reason()}): building lltm CPU-only")
    extension = CppExtension(
        "lltm._C",
        cpu_sources,
        include_dirs=compiler.include_dirs(),
        define_macros=library,
        extra_compile_args=cxx_flags,
        extra_link_args=compiler.openmp_flags(),
    )

setup(
    name="lltm",
    version="0.1.0",
    description="The LLTM recurrent cell as PyTorch custom ops with fused CPU and CUDA kernels",
    packages=["lltm"],
    install_requires=["torch"],
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension},
    options=compiler.setup_options(__file__),
)
