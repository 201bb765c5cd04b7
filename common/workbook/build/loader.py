"""Importing a stage's package, built first where it is not up to date: what a stage's tests
(``import_stage(stage)`` is this), the demo, the notebooks and the benchmark call.

The one place that puts a built stage on sys.path.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from workbook.build import emulate, stages
from workbook.build.builder import build_stage
from workbook.build.compiler import tools_on_path
from workbook.build.stages import Stage


class StageConflict(ImportError):
    """Two stages provide the same package, and one of them is already imported in this process.

    A package (and, for torch.library stages, its op namespace) can be loaded once per process:
    run the other stage's tests in a process of its own, as `make test` does.
    """


def import_stage(number_or_folder: int | str | Stage, *, quiet: bool = True):
    """Build stage N if needed and import its package. JIT stages build themselves on import.

    Where the CUDA tests run on the emulated device (workbook.build.emulate, once the test base
    asked for it with emulate.cuda_device()), a CUDA stage's kernels are built for it too: as an
    add-on registered beside the package's own kernels, or, for a stage whose .cu files are
    launchers behind a C++ front (stage 04), as an emulated copy of the package, which is then
    the one imported.

    Raises StageConflict when another stage's package of the same name is already imported
    (a copied stage, or stages 06 and 07, which both build `extops`): one per process.
    """
    s = stages.get(number_or_folder)
    # A test that calls the op thousands of times, as gradcheck does, comes here on each call:
    # a stage this function has imported already is returned before anything is looked over
    # (the emulated build's plan reads every .cu file, a few ms). A library rebuilt now could
    # not replace the one loaded anyway.
    imported = _imported.get(s.folder)
    if imported is not None and sys.modules.get(s.package) is imported:
        return imported
    if os.environ.get(INSTALLED) == s.folder:
        return _import_installed(s)
    tools_on_path()
    emulated = s.cuda and emulate.wanted()
    whole = emulated and emulate.plan(s).whole
    loaded = sys.modules.get(s.package)
    if loaded is not None and not whole:
        # Imported already, from this stage's build (by a test's own import, say).
        origin = Path(getattr(loaded, "__file__", None) or "/").resolve()
        if origin.is_relative_to((s.lib_dir if s.kind == "setup" else s.source_dir).resolve()):
            if emulated:
                emulate.load_stage(s)  # loaded once per process; a lookup from then on
            _imported[s.folder] = loaded
            return loaded
    if whole:
        path = emulate.load_stage(s)
    else:
        path = build_stage(s, quiet=quiet) if s.kind == "setup" else s.source_dir
    loaded = sys.modules.get(s.package)
    if loaded is not None:
        origin = Path(getattr(loaded, "__file__", None) or "/").resolve()
        if not origin.is_relative_to(path.resolve()):
            raise StageConflict(
                f"{s.label} provides the package `{s.package}`, which this process has already "
                f"imported from {origin.parent}; a package loads once per process, so test this "
                f"stage in a process of its own (`make stage {s.number}`)")
    else:
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
        loaded = importlib.import_module(s.package)
    if emulated and not whole:
        emulate.load_stage(s)  # after the package: its ops must be defined first
    _imported[s.folder] = loaded
    return loaded


_imported: dict[str, object] = {}  # stage folder -> its package, as import_stage returned it

# WORKBOOK_INSTALLED=<stage folder>: that stage's tests run on its package as installed in this
# Python (a wheel, say), not on a build under build/: how `make abi-check` tests one wheel under
# two torch versions without building it again.
INSTALLED = "WORKBOOK_INSTALLED"


def _import_installed(s: Stage):
    loaded = importlib.import_module(s.package)
    origin = Path(getattr(loaded, "__file__", None) or "/").resolve()
    builds = (s.lib_dir, s.cpu_only_build().lib_dir, stages.STAGES_DIR)
    if any(origin.is_relative_to(folder.resolve()) for folder in builds):
        raise ImportError(f"{INSTALLED}={s.folder}: `{s.package}` was imported from "
                          f"{origin.parent}, a build of the workbook's, not an installed package")
    _imported[s.folder] = loaded
    return loaded


