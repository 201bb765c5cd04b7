"""Stage 10: what makes the library one binary for many torch versions, read off the built one.

The library may call libtorch only through its C shims (aoti_torch_*, torch_*), whose names and
signatures stay from release to release; a C++ symbol of libtorch or c10 (a mangled name under
at::, c10:: or torch::) would tie it to the torch it was built with, as the ATen stages are tied.
And it must be a limited-API module (`_C.abi3.so`), which every CPython from 3.10 on imports.
`make abi-check` then loads the same wheel under two torch versions and runs every test there.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

from workbook import ops, testing
from workbook.build import stages, toolkit
from workbook.build.loader import import_stage
from workbook.spec import dtype_name

STAGE = stages.here(__file__)
SPEC = ops.get("lltm")
BINUTILS = None if shutil.which("nm") and shutil.which("c++filt") else "nm and c++filt (binutils)"
# What a C++ library may take from the C++ runtime: libstdc++ and its ABI support (functions,
# and the type information and virtual tables of its classes).
RUNTIME_NAMES = ("std::", "__cxxabiv1::", "__gnu_cxx::", "operator new", "operator delete")
CXX_RUNTIME = tuple(f"{kind}{name}" for kind in ("", "typeinfo for ", "vtable for ", "VTT for ")
                    for name in RUNTIME_NAMES)


def library() -> Path:
    return Path(import_stage(STAGE)._C.__file__)


def undefined_symbols(path: Path) -> list[str]:
    out = subprocess.run(["nm", "-D", "--undefined-only", path], capture_output=True, text=True,
                         check=True).stdout
    return [line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()]


def test_the_library_is_a_limited_api_module():
    assert library().name.endswith(".abi3.so"), library().name


@pytest.mark.skipif(BINUTILS is not None, reason=f"{BINUTILS} not found")
def test_it_imports_no_cpp_symbol_of_libtorch_or_c10():
    symbols = undefined_symbols(library())
    # _ZGV... are not C++: the vector versions of C math functions (glibc's libmvec, which the
    # kernels' loops call: workbook/cpu.h), named by the vector function ABI.
    mangled = [s for s in symbols if s.startswith("_Z") and not s.startswith("_ZGV")]
    demangled = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True,
                               text=True, check=True).stdout.splitlines()
    foreign = [d for d in demangled if not d.startswith(CXX_RUNTIME)]
    assert not foreign, f"C++ symbols from outside the C++ runtime: {foreign}"
    shims = [s for s in symbols if s.startswith(("aoti_torch_", "torch_"))]
    # The glue calls libtorch through its C shims: the dispatcher, the library registration.
    assert {"torch_call_dispatcher", "torch_library_impl", "torch_parallel_for"} <= set(shims)
    if has_cuda_kernels():  # and the CUDA glue its CUDA shims (stable_cuda.cuh), no c10::cuda
        assert {"aoti_torch_create_cuda_guard", "aoti_torch_get_current_cuda_stream",
                "aoti_torch_cuda_mm_out", "aoti_torch_cuda_addmm_out"} <= set(shims)


def has_cuda_kernels() -> bool:
    import torch

    import_stage(STAGE)
    return torch._C._dispatch_has_kernel_for_dispatch_key("extops::deform_conv2d", "CUDA")


def test_cuda_kernels_are_built_where_nvcc_is_found():
    assert has_cuda_kernels() == (not STAGE.cpu_only and toolkit.find() is not None), \
        toolkit.reason()


@pytest.mark.parametrize("dtype", SPEC.dtypes, ids=dtype_name)
def test_every_dtype_reaches_its_kernel(dtype):
    """The glue's own dtype switch (what AT_DISPATCH_FLOATING_TYPES_AND2 writes for the ATen
    stages) sends each dtype to the kernel of its C++ type: forward and backward against the
    float64 reference."""
    sample = SPEC.make(SPEC.case("b5_f17_s33"), device="cpu", dtype=dtype, requires_grad=True)
    testing.assert_against_reference(import_stage(STAGE).lltm, SPEC, sample)
