"""Build or install stage 09, the `extops` library on ATen with a third op: multi-scale
deformable attention (`make install` installs stage 10's: every op on the stable ABI).

    make stage 9                                                   build under build/ and test
    pip install --no-build-isolation ./stages/09_ms_deform_attn   then: import extops

The stage differs from stage 07 by one op's folder (csrc/ms_deform_attn/: its schemas, CPU and
CUDA kernels) and its Python module (extops/ms_deform_attn.py), so the rest of the library is
built from where it lives, as stage 07 builds stage 06's: every .cpp under ../06_op_library/csrc
and ./csrc, stage 05's LLTM kernels and, where a CUDA toolkit is found, every .cu of stages 06, 07
and this one. The Python package is this folder's extops/ (its __init__ and the new module) with
stage 06's modules copied in by build_py. Without a toolkit the library is built CPU-only, and
says so.
"""

import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

from workbook.build import compiler, toolkit

found = compiler.cuda_toolkit()  # sets CUDA_HOME and TORCH_CUDA_ARCH_LIST when it finds one

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

HERE = Path(__file__).resolve().parent
STAGE_05, STAGE_06 = HERE.parent / "05_cuda_accessors", HERE.parent / "06_op_library"
STAGE_07 = HERE.parent / "07_cuda_library"
SHARED_MODULES = ["errors.py", "lltm.py", "deform_conv2d.py", "onnx.py"]  # stage 06's extops/


class BuildPyWithStage06(build_py):
    """build_py, then stage 06's Python modules copied into the built package."""

    def run(self):
        super().run()
        package = Path(self.build_lib) / "extops"
        for name in SHARED_MODULES:
            shutil.copy2(STAGE_06 / "extops" / name, package / name)


def sources(folder: Path, pattern: str) -> list[str]:
    """The files matching `pattern` under `folder`, relative to this folder."""
    return sorted(os.path.relpath(p, HERE) for p in folder.glob(pattern))


cpp_sources = (sources(STAGE_06 / "csrc", "**/*.cpp") + sources(STAGE_05 / "csrc", "lltm_cpu.cpp")
               + sources(HERE / "csrc", "**/*.cpp"))
cuda_sources = (sources(STAGE_06 / "csrc", "**/*.cu") + sources(STAGE_05 / "csrc", "lltm_cuda.cu")
                + sources(STAGE_07 / "csrc", "**/*.cu") + sources(HERE / "csrc", "**/*.cu"))
library = [("OPS_NAMESPACE", "extops")]  # the namespace the LLTM's kernel files register into

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
    "convolution v2, multi-scale deformable attention",
    packages=["extops"],
    install_requires=["torch"],
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension, "build_py": BuildPyWithStage06},
    options=compiler.setup_options(__file__),
)
