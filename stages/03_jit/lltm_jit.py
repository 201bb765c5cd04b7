"""Stage 03: the LLTM extension of stage 02, built just in time with cpp_extension.load.

No setup.py and no separate build step: the first `import lltm_jit` compiles
stages/02_lltm_cpp/csrc/lltm.cpp and bindings.cpp with ninja into build/jit/lltm_jit/ and loads
the result. Later imports (in this process or the next) find the build up to date and only load
it; editing a source makes the next load recompile that file and relink.

    WORKBOOK_VERBOSE_BUILD=1 python -c "import lltm_jit"    # watch the compiler lines

The C++ is stage 02's, unchanged: the same sources, two ways to build them.
"""

from __future__ import annotations

import os
from pathlib import Path

from workbook.build import compiler

compiler.prepare()  # ninja on PATH, CUDA_HOME: torch's extension builder reads both on import

from torch.utils.cpp_extension import load  # noqa: E402

from workbook.ops.lltm.pybind import bind  # noqa: E402

# Stage 02's C++, next door in stages/: the op, and its pybind11 module.
SOURCES = [Path(__file__).resolve().parents[1] / "02_lltm_cpp" / "csrc" / name
           for name in ("lltm.cpp", "bindings.cpp")]


def load_extension(name: str = "lltm_jit", sources=SOURCES, verbose: bool = False):
    """Compile (if needed) and load the extension; returns the Python module.

    torch decides whether to rebuild by hashing the sources and flags: unchanged, the load takes
    well under a second; changed, ninja recompiles what changed. The build folder is returned
    by `compiler.jit_dir(name)`: build.ninja, the object files and `<name>.so` live there.
    """
    # EXERCISE jit-load: compile `sources` just in time with load(), into compiler.jit_dir(name)
    # checked by: test_lltm_jit.py::test_against_reference, ::test_build_lands_in_build_folder,
    #   ::test_second_load_is_cached
    return load(
        name=name,
        sources=[str(s) for s in sources],
        extra_include_paths=compiler.include_dirs(),
        extra_cflags=compiler.cxx_flags(),
        build_directory=str(compiler.jit_dir(name)),
        verbose=verbose,
    )
    # END EXERCISE jit-load


_C = load_extension(verbose=os.environ.get("WORKBOOK_VERBOSE_BUILD") == "1")

LLTMFunction, lltm, LLTM = bind(_C, name="lltm_jit")

__all__ = ["LLTMFunction", "lltm", "LLTM", "load_extension"]
