"""Everything the workbook knows about its ops: one folder per op, found on disk.

    ops/<op>/__init__.py    the descriptor, OP (workbook.spec.OpSpec): argument names, input
                            maker, cases, tolerances, gradcheck options, the bad inputs it refuses
    ops/<op>/reference.py   the op in plain PyTorch: the float64 reference, the eager baseline
    ops/<op>/matrix.py      its rows of the hostile-input matrix (workbook.net.matrix)
    ops/<op>/fuzz.py        how hypothesis draws its sizes (workbook.net.fuzz)
    ops/<op>/bench.py       its benchmark: configurations, baselines, targets (make bench)

``ops.get("lltm")`` is the descriptor. The stages that implement an op say so in their
stage.toml (``ops = [...]``), and their packages expose it as a function of the same name
(``lltm.lltm``, ``extops.deform_conv2d``); `implementations` pairs the two, for every tool that
runs each op wherever it is implemented. Nothing else lists the ops or the stages.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from pathlib import Path
from types import ModuleType

from workbook.build import stages
from workbook.build.stages import Stage
from workbook.spec import OpSpec


def folder(name: str) -> Path:
    """common/workbook/ops/<name>/: everything the workbook knows about op `name`."""
    return Path(__file__).resolve().parent / name


def names() -> list[str]:
    """The ops: the folders here."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__)
                  if m.ispkg and not m.name.startswith("_"))


def module(name: str) -> ModuleType:
    """The descriptor module of op `name`: workbook/ops/<name>/__init__.py."""
    if name not in names():
        raise LookupError(f"no op {name!r}: expected a folder common/workbook/ops/{name}/ "
                          f"whose __init__.py defines OP; known: {', '.join(names())}")
    return importlib.import_module(f"{__name__}.{name}")


def part(name: str, what: str) -> ModuleType | None:
    """One part of op `name`'s folder (`what`: "matrix", "fuzz", "bench"), or None where the
    op has none."""
    if not (folder(name) / f"{what}.py").is_file():
        return None
    return importlib.import_module(f"{__name__}.{name}.{what}")


def having(what: str) -> list[str]:
    """The ops whose folder has a part `what` ("matrix", "fuzz", "bench")."""
    return [name for name in names() if (folder(name) / f"{what}.py").is_file()]


def get(name: str) -> OpSpec:
    """The descriptor of op `name` (the OP of workbook/ops/<name>/)."""
    return module(name).OP


# ----------------------------------------------------------------------------------------------
# Where each op is implemented


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One op as one stage's package provides it: its functional form, `package.<op>`."""

    op: str
    stage: Stage

    @property
    def key(self) -> str:
        """op@stage, as tests and commands name it: "lltm@5"."""
        return f"{self.op}@{self.stage.number}"

    @property
    def spec(self) -> OpSpec:
        return get(self.op)

    @property
    def traceable(self) -> bool:
        """Registered as a dispatcher op with a fake kernel (torch.library), so that it runs on
        meta tensors and traces whole under torch.compile(fullgraph=True); a pybind11 function
        (stages 01-04) does neither: a graph break."""
        return self.stage.registers_ops

    def function(self):
        """The functional form, from the stage's package (built and imported first)."""
        from workbook.build.loader import import_stage

        return getattr(import_stage(self.stage), self.op)


def implementations(op: str | None = None, device: str = "cpu") -> list[Implementation]:
    """Every op (or `op`) in every package that provides it, where it runs on `device`.

    A package built by several stages (06, 07, 09 and 10 build `extops`) is taken from one of them,
    as one process can import a package once: the one with the most ops, the newest of those
    (stages.fullest). Stages that run elsewhere only (stage 04: CUDA) are left out, and on the
    CPU those whose CPU kernels are another stage's (Stage.own_cpu_kernels: stage 08's are
    stage 05's).
    """
    chosen = stages.fullest([s for s in stages.all_stages() if device in s.devices and
                             (device != "cpu" or not s.cuda or s.own_cpu_kernels)])
    return [Implementation(name, s) for s in sorted(chosen.values(), key=lambda s: s.number)
            for name in s.ops if op in (None, name)]
