"""Build stage 01 ahead of time: `make stage 1`, or from this folder `python setup.py build`.

The build goes under the repository's build/ folder (see common/workbook/build/compiler.py), never
into the source tree.
"""

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

from workbook.build import compiler

setup(
    name="z2xy",
    version="0.1.0",
    packages=["z2xy"],
    ext_modules=[
        CppExtension(
            "z2xy._C",
            ["csrc/z2xy.cpp", "csrc/bindings.cpp"],
            include_dirs=compiler.include_dirs(),
            extra_compile_args=compiler.cxx_flags(),
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    options=compiler.setup_options(__file__),
)
