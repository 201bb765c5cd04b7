"""Stage 03: the LLTM extension built just in time, and what the JIT build does for you."""

import functools
import importlib.util
import os

import torch
from lltm_base import LLTMOpTest, lltm_inputs

from workbook import build


@functools.cache
def lltm_jit():
    return build.import_stage(3)


@functools.cache
def inline_example():
    path = build.stage(3).source_dir / "inline_example.py"
    spec = importlib.util.spec_from_file_location("inline_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TestLLTMJit(LLTMOpTest):
    def fn(self, *inputs):
        return lltm_jit().lltm(*inputs)


def built_library(name):
    return build.jit_dir(name) / f"{name}.so"


def test_build_lands_in_build_folder():
    lltm_jit()
    folder = build.jit_dir("lltm_jit")
    assert folder.is_relative_to(build.build_root())
    assert (folder / "build.ninja").is_file()
    assert built_library("lltm_jit").is_file()


def test_second_load_is_cached():
    lltm_jit()
    before = os.stat(built_library("lltm_jit")).st_mtime_ns
    again = lltm_jit().load_extension()  # same name, same sources: nothing to compile
    assert os.stat(built_library("lltm_jit")).st_mtime_ns == before
    x = lltm_inputs(2, 3, 4, requires_grad=False)
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
    assert (build.jit_dir("z2xy_inline") / f"{second.__name__}.so").is_file()
    torch.testing.assert_close(second.z2xy(x, y), 2 * x + y)
