"""One descriptor per op (workbook.opspec.OpSpec), one module each: ``ops.get("lltm")``.

A module here defines ``OP``, the op's OpSpec: argument names, input maker, float64 reference,
tolerances, gradcheck options, bad inputs. A stage's stage.toml names the ops it implements;
its package exposes each as a function of the same name (``lltm.lltm``, ``extops.deform_conv2d``).
"""

from __future__ import annotations

import importlib
import pkgutil

from ..opspec import OpSpec


def module(name: str):
    """The descriptor module of op `name`: workbook/ops/<name>.py."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise
        raise LookupError(f"no descriptor for op {name!r}: expected common/workbook/ops/{name}.py; "
                          f"known: {', '.join(names())}") from None


def get(name: str) -> OpSpec:
    """The descriptor of op `name` (the OP of workbook/ops/<name>.py)."""
    return module(name).OP


def names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
