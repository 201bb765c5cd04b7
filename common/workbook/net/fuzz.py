"""Property-based fuzzing of the ops with hypothesis: what to draw, and the one check per example.

An `Example` is one drawn call of an op: a `Case` of its descriptor (sizes, 0 and 1 included),
a dtype, a memory layout per tensor argument, which arguments require grad, the seed of the
values and the number of CPU threads. `assert_example(fn, spec, example)` builds the sample with the
descriptor's input maker, stores each tensor in its layout and compares fn with the float64
reference (workbook.spec.compare: outputs and the gradient of every input that requires grad,
within the descriptor's tolerances for the dtype). A failing example's repr is the reproducer:

    from workbook import ops
    from workbook.net import fuzz
    fuzz.assert_example(extops.lltm, ops.get("lltm"), fuzz.Example(...))  # as hypothesis printed

What each op's sizes are is the op's own knowledge, in its folder (ops/<op>/fuzz.py); `test_of`
makes one hypothesis test of an op as one stage implements it (tests/test_fuzz.py makes them for
every op and stage).

How many examples: `settings(ci=, long=)`, the short count in `make test`, the long one with
WORKBOOK_FUZZ=long (`make fuzz`). Examples are derandomized (a fixed seed per test), so a run
draws the same examples every time and a failure reproduces; nothing is stored between runs
(no hypothesis database: the fixed seed makes one unnecessary), and what hypothesis caches
goes under build/hypothesis/.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence

import torch
from hypothesis import HealthCheck, event, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from workbook import ops
from workbook.build.stages import build_root
from workbook.spec import LAYOUTS, Case, OpSpec, Sample, compare, dtype_name

LONG = os.environ.get("WORKBOOK_FUZZ", "") == "long"

# Not .hypothesis/ in the working directory: everything written goes under build/.
set_hypothesis_home_dir(build_root() / "hypothesis")

# What every fuzz test shares. No deadline: the first call of an op may load or compile it, and a
# loaded 2-core machine varies widely. print_blob: a failure also prints hypothesis' own
# reproducer (@reproduce_failure), for the rare case the Example's repr is not enough.
_COMMON = {"derandomize": True, "database": None, "deadline": None, "print_blob": True,
           "report_multiple_bugs": False, "suppress_health_check": [HealthCheck.too_slow]}


def settings(*, ci: int, long: int) -> hypothesis_settings:
    """hypothesis settings for one fuzz test: `ci` examples in `make test`, `long` under
    WORKBOOK_FUZZ=long (`make fuzz`)."""
    return hypothesis_settings(max_examples=long if LONG else ci, **_COMMON)


# ----------------------------------------------------------------------------------------------
# Layouts: workbook.spec's (the ones the stage tests use), plus contiguous, a storage offset and
# a slice


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


def _storage_offset(t: torch.Tensor) -> torch.Tensor:
    """Contiguous, but starting 3 elements into its storage (a slice of a larger buffer)."""
    buffer = t.new_zeros(t.numel() + 3)
    view = buffer[3:].view(t.shape)
    view.copy_(t)
    return view


def _sliced(t: torch.Tensor) -> torch.Tensor:
    """Columns 2 to n + 1 of a tensor 3 columns wider (a chunk of a larger tensor, as
    gates.chunk(3) gives): rows are strided, each row contiguous, the first one at offset 2."""
    if t.dim() == 0:
        return _storage_offset(t)
    buffer = t.new_zeros(*t.shape[:-1], t.shape[-1] + 3)
    view = buffer[..., 2:2 + t.shape[-1]]
    view.copy_(t)
    return view


STORES: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": _contiguous, "offset": _storage_offset, "sliced": _sliced, **LAYOUTS}


def relayout_each(sample: Sample, layouts: Mapping[str, str]) -> Sample:
    """The sample with each tensor argument stored in its own layout (name -> layout; missing:
    contiguous): leaves with the same requires_grad, as spec.relayout makes them."""
    def move(name, t):
        with torch.no_grad():
            moved = STORES[layouts.get(name, "contiguous")](t.detach())
        return moved.requires_grad_(t.requires_grad) if t.is_floating_point() else moved

    return sample.map(move)


# ----------------------------------------------------------------------------------------------
# Examples


@dataclasses.dataclass(frozen=True)
class Example:
    """One drawn call: its repr is a reproducer (pass it to `assert_example`; Case is
    workbook.spec's)."""

    case: Case
    dtype: torch.dtype
    layouts: Mapping[str, str]
    requires_grad: tuple[str, ...]
    seed: int
    threads: int

    def sample(self, spec: OpSpec) -> Sample:
        made = spec.make(self.case, dtype=self.dtype, requires_grad=False, seed=self.seed)
        with_grads = made.detached(requires_grad=list(self.requires_grad))
        return relayout_each(with_grads, self.layouts)


THREADS = st.sampled_from((1, 2))
SEEDS = st.integers(0, 2**16)


@st.composite
def examples(draw, spec: OpSpec, cases: st.SearchStrategy[Case],
             layouts: Sequence[str] = tuple(STORES)) -> Example:
    """Examples of op `spec` over `cases`: any dtype the descriptor has (float64, float32,
    float16, bfloat16: FLOAT_DTYPES), each tensor argument in any of `layouts`, each requiring
    grad or not (all of them, most often), 1 or 2 threads."""
    case = draw(cases)
    dtype = draw(st.sampled_from(spec.dtypes))
    tensors = spec.make(case, requires_grad=False).tensors()
    names = [name for name, _ in tensors]
    # An integer argument (an index table) keeps its values: not "expanded", which changes them.
    keeping = [layout for layout in layouts if layout != "expanded"]
    chosen = {name: draw(st.sampled_from(layouts if t.is_floating_point() else keeping))
              for name, t in tensors}
    everything = draw(st.booleans()) or draw(st.booleans())  # all inputs require grad: 3 in 4
    grads = tuple(names) if everything else tuple(n for n in names if draw(st.booleans()))
    example = Example(case, dtype, chosen, grads, draw(SEEDS), draw(THREADS))
    _describe(example, names)
    return example


def _describe(example: Example, names: Sequence[str]) -> None:
    """Events for hypothesis' statistics (`--hypothesis-show-statistics`): how often each dtype,
    layout, thread count and empty or size-1 dimension was drawn."""
    event(f"dtype {dtype_name(example.dtype)}")
    event(f"threads {example.threads}")
    for layout in sorted(set(example.layouts.values())):
        event(f"some tensor {layout}")
    event(f"{len(example.requires_grad)} of {len(names)} inputs require grad")
    sizes = example.case.sizes
    for key, size in sorted(sizes.items()):
        if size in (0, 1) and not key.startswith(("stride", "dilation", "pad", "offset_scale")):
            event(f"{key} {size}")


def assert_example(fn: Callable, spec: OpSpec, example: Example) -> None:
    """fn on the example against the float64 reference, with `example.threads` CPU threads."""
    sample = example.sample(spec)
    threads = torch.get_num_threads()
    torch.set_num_threads(example.threads)
    try:
        comparison = compare(fn, spec, sample, gradients=bool(example.requires_grad))
    finally:
        torch.set_num_threads(threads)
    assert comparison.ok, (f"{spec.name}: {example!r}\nagainst the float64 reference:\n  "
                           + "\n  ".join(comparison.failures()))


# ----------------------------------------------------------------------------------------------
# One test per op and stage


def test_of(implementation: ops.Implementation) -> Callable[..., None]:
    """A hypothesis test of one op as one stage implements it, named test_<op>_at_stage_NN: its
    examples are drawn by the op's folder (ops/<op>/fuzz.py: `cases()`, `EXAMPLES`, and
    optionally `spec(OP)`, the descriptor to fuzz with) and checked against its reference."""
    drawn = ops.part(implementation.op, "fuzz")
    spec = drawn.spec(implementation.spec) if hasattr(drawn, "spec") else implementation.spec

    @settings(ci=drawn.EXAMPLES["ci"], long=drawn.EXAMPLES["long"])
    @given(examples(spec, drawn.cases()))
    def test(example):
        assert_example(implementation.function(), spec, example)

    test.__name__ = test.__qualname__ = (f"test_{implementation.op}_at_stage_"
                                         f"{implementation.stage.number:02d}")
    test.__doc__ = (f"{implementation.op} as stage {implementation.stage.number:02d}'s package "
                    f"`{implementation.stage.package}` implements it, against its reference.")
    return test
