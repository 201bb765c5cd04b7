"""Build or install stage 10, the `extops` library on PyTorch's stable ABI: the production library.

    make stage 10                                    build under build/ and test
    make wheel                                       the wheel, in dist/ (tagged cp310-abi3)
    make abi-check                                   that one wheel's tests under two torch versions
    make install    (pip install --no-build-isolation ./stages/10_stable_abi)    import extops

Two promises make the one binary, and this file asks for both:

* TORCH_TARGET_VERSION: the oldest torch the library must load under. The stable headers
  (torch/csrc/stable, torch/headeronly) then offer only what that release's C shims provide, and
  the build refuses any header of c10 or ATen, whose C++ symbols change from release to release.
  2.10 is the oldest release with what the glue calls: torch_call_dispatcher (the ops empty,
  narrow, copy_, permute, view, to, contiguous, matmul, sum, clone go through it),
  torch_parallel_for, aoti_torch_create_tensor_from_blob_v2 (torch::stable::from_blob) and the
  typed data pointers of torch::stable::Tensor. The README lists each shim.
* py_limited_api: torch's BuildExtension then defines Py_LIMITED_API as the oldest CPython that
  torch supports (3.10, 0x030A0000), so the module (the module object and a dict: stage 06's
  csrc/extops.cpp) may use only CPython's limited API of 3.10, and one build imports under every
  CPython from 3.10 on; the wheel is tagged cp310-abi3 to say so.

No -fopenmp and no SIMD flags: the parallel loop is libtorch's own (torch::stable::parallel_for),
and a wheel meant for any machine must not use instructions the build machine has and a user's
may not (the ATen stages compile for the build machine's CPU: workbook.build.compiler). The
kernels' loops are vectorised all the same, for the SSE2 every x86-64 has (-fopenmp-simd and
glibc's vector math, libmvec: workbook/cpu.h).

Sources: every .cpp under csrc/ (the schemas and the glue), stage 06's csrc/extops.cpp (the
module, which hands the checks' messages to Python), and the kernels, included: stage 05's
lltm_cpu.h, stage 06's deform_conv2d_cpu.h and stage 09's ms_deform_attn_cpu.h. Where a CUDA
toolkit is found, every .cu under csrc/ too (the CUDA glue), which includes stage 07's
deform_conv2d_cuda.cuh and stage 09's ms_deform_attn_cuda.cuh; built so, the library
links libtorch_cuda's C shims and the CUDA runtime, and loads only beside a CUDA build of torch.
WORKBOOK_NO_CUDA=1 builds it CPU-only (`make abi-check` does: the torch it checks against is a CPU
build). Python: extops/ here (its __init__ and
python_keys.py) and stage 06's and 09's modules, copied into the build by build_py: the fake
kernels, functional forms, modules and the ONNX export are theirs.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

from workbook.build import compiler, toolkit

found = compiler.cuda_toolkit()  # sets CUDA_HOME and TORCH_CUDA_ARCH_LIST when it finds one

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

HERE = Path(__file__).resolve().parent
STAGE_05, STAGE_06 = HERE.parent / "05_cuda_accessors", HERE.parent / "06_op_library"
STAGE_07, STAGE_09 = HERE.parent / "07_cuda_library", HERE.parent / "09_ms_deform_attn"

TORCH_TARGET = "0x020a000000000000"  # torch 2.10: TORCH_VERSION_2_10_0 in torch/csrc/stable
# The wheel's tag: the CPython of the Py_LIMITED_API torch's BuildExtension defines (3.10).
PYTHON_TAG = "cp310"
# The ATen stages' extops/ modules this package shares.
SHARED_MODULES = [STAGE_06 / "extops" / name
                  for name in ("errors.py", "lltm.py", "deform_conv2d.py", "onnx.py")]
SHARED_MODULES.append(STAGE_09 / "extops" / "ms_deform_attn.py")


class BuildPyWithShared(build_py):
    """build_py, then stage 06's and 09's Python modules copied into the built package."""

    def run(self):
        super().run()
        package = Path(self.build_lib) / "extops"
        for module in SHARED_MODULES:
            shutil.copy2(module, package / module.name)


sources = sorted(str(p.relative_to(HERE)) for p in HERE.glob("csrc/**/*.cpp"))
sources.append(str(STAGE_06 / "csrc" / "extops.cpp"))
cuda_sources = sorted(str(p.relative_to(HERE)) for p in HERE.glob("csrc/**/*.cu"))
include_dirs = compiler.include_dirs() + [str(HERE / "csrc"), str(STAGE_05 / "csrc"),
                                          str(STAGE_06 / "csrc" / "deform_conv2d" / "cpu"),
                                          str(STAGE_07 / "csrc" / "deform_conv2d" / "cuda"),
                                          str(STAGE_09 / "csrc" / "ms_deform_attn" / "cpu"),
                                          str(STAGE_09 / "csrc" / "ms_deform_attn" / "cuda")]
# -fopenmp-simd: the kernels' `#pragma omp simd` loops (workbook/cpu.h), vectorised with glibc's
# vector exp and tanh (libmvec), no OpenMP runtime. gcc vectorises a loop that calls them only
# when the calls may neither set errno nor trap (-fno-math-errno, -fno-trapping-math); nothing
# here reads errno or traps, and NaN and inf are kept as they are (unlike -ffast-math).
cxx_flags = compiler.cxx_flags() + ["-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math"]
macros = [("TORCH_TARGET_VERSION", TORCH_TARGET)]
if found:
    print(f"building extops (stable ABI) with CUDA kernels ({len(cuda_sources)} .cu files): "
          f"{found}, for TORCH_CUDA_ARCH_LIST={compiler.cuda_arch_list()}")
    # USE_CUDA: torch's c/shim.h declares its CUDA shims (the guard, the current stream) only so.
    extension = CUDAExtension(
        "extops._C",
        sources + cuda_sources,
        include_dirs=include_dirs,
        define_macros=macros + [("USE_CUDA", None)],
        extra_compile_args={"cxx": cxx_flags, "nvcc": compiler.nvcc_flags()},
        extra_link_args=["-lmvec"],
        py_limited_api=True,
    )
else:
    print(f"CUDA toolkit not found ({toolkit.reason()}): building extops (stable ABI) CPU-only, "
          f"without {', '.join(cuda_sources)}")
    extension = CppExtension(
        "extops._C",
        sources,
        include_dirs=include_dirs,
        define_macros=macros,
        extra_compile_args=cxx_flags,
        extra_link_args=["-lmvec"],
        py_limited_api=True,
    )

options = compiler.setup_options(__file__)
options["bdist_wheel"] = {"py_limited_api": PYTHON_TAG}
setup(
    name="extops",
    version="0.2.0",
    description=("Custom PyTorch ops on the stable ABI, one binary for torch >= 2.10: the LLTM, "
                 "the deformable convolution and multi-scale deformable attention"),
    packages=["extops", "extops.integrations"],
    python_requires=">=3.10",
    install_requires=["torch>=2.10"],
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension, "build_py": BuildPyWithShared},
    options=options,
)
