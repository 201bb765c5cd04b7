"""Stage 03: the LLTM extension built just in time, and what the JIT build does for you.

Against the float64 reference, as stage 02 (the same C++); then the JIT build itself: where it
lands, that a second load is cached, and that load_inline rebuilds after an edit.
"""

import functools
import importlib.util
import os

import pytest
import torch

from workbook import ops, testing
from workbook.build import compiler, stages
from workbook.build.loader import import_stage
from workbook.ops import lltm as lltm_op

SPEC = ops.get("lltm")
STAGE = stages.here(__file__)


@functools.cache  # imported on first use, then kept: gradcheck calls the op thousands of times
def lltm_jit():
    return import_stage(STAGE)


def lltm(*args, **kwargs):
    return lltm_jit().lltm(*args, **kwargs)


@functools.cache
def inline_example():
    path = STAGE.source_dir / "inline_example.py"
    spec = importlib.util.spec_from_file_location("inline_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], [torch.float32, torch.float64]))
def test_against_reference(p):
    testing.assert_against_reference(lltm, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], [torch.float64], batch0=False))
def test_gradcheck(p):
    testing.assert_gradcheck(lltm, SPEC, p.sample(SPEC), fast_mode=not p.case.full_gradcheck)


@pytest.mark.parametrize("layout", ["strided", "permuted", "expanded"])
def test_layouts(layout):
    testing.assert_layout(lltm, SPEC, SPEC.make(SPEC.case("b5_f17_s33")), layout)


@pytest.mark.parametrize(("device", "bad"), testing.bad_input_params(SPEC, ["cpu"]))
def test_bad_input(device, bad):
    testing.assert_bad_input(lltm, bad, device)


# -- the JIT build ----------------------------------------------------------------------------


def built_library(name):
    return compiler.jit_dir(name) / f"{name}.so"


def test_build_lands_in_build_folder():
    lltm_jit()
    folder = compiler.jit_dir("lltm_jit")
    assert folder.is_relative_to(stages.build_root())
    assert (folder / "build.ninja").is_file()
    assert built_library("lltm_jit").is_file()


def test_second_load_is_cached():
    lltm_jit()
    before = os.stat(built_library("lltm_jit")).st_mtime_ns
    again = lltm_jit().load_extension()  # same name, same sources: nothing to compile
    assert os.stat(built_library("lltm_jit")).st_mtime_ns == before
    x = lltm_op.inputs(2, 3, 4, requires_grad=False)
    for a, b in zip(again.forward(*x), lltm_jit()._C.forward(*x)):
        torch.testing.assert_close(a, b)


def test_load_inline_and_rebuild_after_edit():
    example = inline_example()
    first = example.load_z2xy_inline()
    x, y = torch.randn(5), torch.randn(5)
    torch.testing.assert_close(first.z2xy(x, y), 2 * x + y)

    # Change the source (a comment is enough: torch hashes the text) and load again: torch sees
    # the new hash, rebuilds, and loads the result as a new version of the module.
    original = example.CPP_SOURCE
    try:
        example.CPP_SOURCE = original + "\n// edited: forces a rebuild\n"
        second = example.load_z2xy_inline()
    finally:
        example.CPP_SOURCE = original
    assert second is not first
    assert second.__name__ != first.__name__  # z2xy_inline_v1, z2xy_inline_v2, ...
    assert (compiler.jit_dir("z2xy_inline") / f"{second.__name__}.so").is_file()
    torch.testing.assert_close(second.z2xy(x, y), 2 * x + y)
