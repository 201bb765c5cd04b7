"""One vocabulary: every message of the library names a dtype, a layout and a device as PyTorch's
Python prints it (str(torch.int64) is "torch.int64"), from the C++ checks (workbook/checks.h:
dtype_name, layout_name) and from the fake kernels (extops/errors.py: str() itself) alike.

Every dtype torch can make a tensor of goes through each ops' first argument, on the CPU (the C++
checks) and on meta tensors (the fake kernel), and every sparse layout through the C++ checks; the
message must say str() of it, and both must say the same.
"""

import warnings

import pytest
import torch

from workbook.build import stages
from workbook.build.loader import import_stage
from workbook.ops import lltm as lltm_op


def _makeable(dtype: torch.dtype) -> bool:
    """Whether torch makes a tensor of `dtype` (it warns that some of them are experimental or
    deprecated: this asks, it does not use them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.zeros(2, dtype=dtype)
        except (RuntimeError, TypeError):
            return False
    return True


# Every dtype of this torch that a tensor can be made of, but the one the valid inputs have.
DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype) and _makeable(d)
                 and d != torch.float32}, key=str)
LAYOUTS = {"sparse_coo": lambda t: t.to_sparse(), "sparse_csr": lambda t: t.to_sparse_csr(),
           "sparse_csc": lambda t: t.to_sparse_csc(),
           "sparse_bsr": lambda t: t.to_sparse_bsr((1, 1)),
           "sparse_bsc": lambda t: t.to_sparse_bsc((1, 1))}


class Library:
    """A library's ops (torch.ops.extops) and its errors module: the C++ checks' errors as the
    user sees them (extops.errors.as_runtime_error: on the stable ABI a check raises RuntimeError
    with the class it means first in the message, which the functional forms raise as that
    class)."""

    def __init__(self, s: stages.Stage):
        self.errors = import_stage(s).errors
        self.ops = getattr(torch.ops, s.package)

    def named(self, error: Exception) -> Exception:
        return self.errors.as_runtime_error(error)


@pytest.fixture(scope="module")
def library():
    """The production package's library, from the stage a process loads on the CPU
    (stages.fullest, as the matrix and the fuzzer take it: one per process)."""
    package = stages.production().package
    return Library(stages.fullest([s for s in stages.all_stages() if "cpu" in s.devices])[package])


def lltm_forward_error(library, device: str, **replace) -> str:
    named = dict(zip(lltm_op.ARG_NAMES, lltm_op.inputs(2, 3, 4, device=device,
                                                        requires_grad=False)))
    named.update(replace)
    with pytest.raises((TypeError, ValueError, RuntimeError)) as caught:
        library.ops.lltm_forward(*named.values())
    return str(library.named(caught.value))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_dtype_is_named_as_python_prints_it(library, dtype):
    said = {device: lltm_forward_error(library, device,
                                       input=torch.zeros(2, 3, dtype=dtype, device=device))
            for device in ("cpu", "meta")}
    assert str(dtype) in said["cpu"], said["cpu"]
    assert said["cpu"] == said["meta"], f"the kernel says {said['cpu']!r}, the fake kernel " \
                                         f"says {said['meta']!r}"


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_layout_is_named_as_python_prints_it(library, layout):
    sparse = LAYOUTS[layout](torch.zeros(2, 3))
    # Straight to the kernel: the dispatcher would pick no kernel for a sparse input otherwise.
    x, w, b, h, c = lltm_op.inputs(2, 3, 4, requires_grad=False)
    with pytest.raises((TypeError, RuntimeError)) as caught:
        library.ops.lltm_forward.default.redispatch(
            torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), sparse, w, b, h, c)
    error = library.named(caught.value)
    assert isinstance(error, TypeError), repr(error)
    assert f"got layout {sparse.layout}" in str(error), str(error)


def test_a_device_is_named_as_python_prints_it(library):
    said = lltm_forward_error(library, "cpu", weights=torch.zeros(12, 7, device="meta"))
    assert said.endswith("`weights` must be on the same device as `input` (cpu), got meta"), said
