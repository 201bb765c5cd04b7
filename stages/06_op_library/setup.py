"""Build or install stage 06, the `extops` library.

    make stage 6                                                 build under build/ and test
    pip install --no-build-isolation ./stages/06_op_library     then: import extops

(Stage 07 builds these same sources with the deformable convolution's CUDA kernels added: that is
the production library `make install` installs.)

The sources are found, not listed: every .cpp under csrc/ goes into the library, and every .cu
too where a CUDA toolkit is found, so an op is added by adding its folder (csrc/<op>/<op>.cpp for
the schemas, csrc/<op>/cpu/ and csrc/<op>/cuda/ for the kernels) and its Python module
(extops/<op>.py). The LLTM's kernels are the one exception: they are stage 05's files, compiled
into this library as they are (they register under OPS_NAMESPACE, the library's name), so the
lesson's kernels exist once. Without a toolkit the library is built CPU-only, and says so.

--no-build-isolation builds against the torch already installed (an isolated build would fetch
another torch, whose ABI need not match). The workbook's build helpers (common/workbook) are used
at build time only: the installed package needs torch alone.
"""

from pathlib import Path

from setuptools import setup

from workbook.build import compiler, toolkit

found = compiler.cuda_toolkit()  # sets CUDA_HOME and TORCH_CUDA_ARCH_LIST when it finds one

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

HERE = Path(__file__).resolve().parent
# Stage 05's LLTM kernels, registered into this library: torch.ops.extops.lltm_forward, ...
LLTM_KERNELS = "../05_cuda_accessors/csrc"
cpp_sources = sorted(str(p.relative_to(HERE)) for p in HERE.glob("csrc/**/*.cpp")) + [
    f"{LLTM_KERNELS}/lltm_cpu.cpp"]
cuda_sources = sorted(str(p.relative_to(HERE)) for p in HERE.glob("csrc/**/*.cu")) + [
    f"{LLTM_KERNELS}/lltm_cuda.cu"]
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
    install_requires=["torch"],
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension},
    options=compiler.setup_options(__file__),
)
