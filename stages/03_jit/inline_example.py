"""load_inline: an extension whose C++ lives in a Python string, for quick experiments.

`load_inline` writes the string to a file in its build folder, generates the pybind11 bindings
for the functions listed in `functions`, and compiles and loads it like `load` does. Handy for
trying an idea in a notebook; for anything you keep, put the C++ in a file (stage 02, 03).

    python stages/03_jit/inline_example.py
"""

from __future__ import annotations

from workbook.build import compiler

compiler.prepare()  # ninja on PATH, CUDA_HOME: torch's extension builder reads both on import

import torch  # noqa: E402
from torch.utils.cpp_extension import load_inline  # noqa: E402

CPP_SOURCE = r"""
#include "workbook/checks.h"

// z = 2x + y, checked like every op of the workbook.
at::Tensor z2xy(const at::Tensor& x, const at::Tensor& y) {
  const workbook::Arg x_arg{"z2xy_inline", "x"}, y_arg{"z2xy_inline", "y"};
  workbook::check_floating(x, x_arg);
  workbook::check_dtype(y, y_arg, x, x_arg);
  workbook::check_same_device(y, y_arg, x, x_arg);
  workbook::check_same_shape(y, y_arg, x, x_arg);
  return at::add(y, x, /*alpha=*/2);
}
"""


def load_z2xy_inline(verbose: bool = False):
    return load_inline(
        name="z2xy_inline",
        cpp_sources=[CPP_SOURCE],
        functions=["z2xy"],
        extra_include_paths=compiler.include_dirs(),
        extra_cflags=compiler.cxx_flags(),
        build_directory=str(compiler.jit_dir("z2xy_inline")),
        verbose=verbose,
    )


if __name__ == "__main__":
    module = load_z2xy_inline(verbose=True)
    x, y = torch.randn(3), torch.randn(3)
    print("x =", x, "\ny =", y, "\nz2xy(x, y) =", module.z2xy(x, y))
