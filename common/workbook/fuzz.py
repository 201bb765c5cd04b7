"""Property-based fuzzing of the ops with hypothesis: what to draw, and the one check per example.

An `Example` is one drawn call of an op: a `Case` of its descriptor (sizes, 0 and 1 included),
a dtype, a memory layout per tensor argument, which arguments require grad, the seed of the
values and the number of CPU threads. `check(fn, spec, example)` builds the sample with the
descriptor's input maker, stores each tensor in its layout and compares fn with the float64
reference (workbook.opspec.compare: outputs and the gradient of every input that requires grad,
within the descriptor's tolerances for the dtype). A failing example's repr is the reproducer:

    from workbook import fuzz, ops
    fuzz.check(extops.lltm, ops.get("lltm"), fuzz.Example(...))      # as hypothesis printed it

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
from hypothesis import HealthCheck, event
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from . import build
from .opspec import LAYOUTS, Case, OpSpec, Sample, compare, dtype_name
from .stages import build_root

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


def package(stage):
    """A stage's package, built if needed (build.import_stage). The production library is
    `extops`, which stage 06 builds too, from the same CPU sources, and a package loads once per
    process: where this one already holds stage 06's (another test loaded it), that one is used."""
    try:
        return build.import_stage(stage)
    except build.StageConflict:
        import extops

        return extops


# ----------------------------------------------------------------------------------------------
# Layouts: opspec's (the ones the stage tests use), plus contiguous, a storage offset and a slice


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
    contiguous): leaves with the same requires_grad, as opspec.relayout makes them."""
    def move(name, t):
        with torch.no_grad():
            moved = STORES[layouts.get(name, "contiguous")](t.detach())
        return moved.requires_grad_(t.requires_grad) if t.is_floating_point() else moved

    return sample.map(move)


# ----------------------------------------------------------------------------------------------
# Examples


@dataclasses.dataclass(frozen=True)
class Example:
    """One drawn call: its repr is a reproducer (pass it to `check`; Case is workbook.opspec's)."""

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
    names = [name for name, _ in spec.make(case, requires_grad=False).tensors()]
    chosen = {name: draw(st.sampled_from(layouts)) for name in names}
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


def check(fn: Callable, spec: OpSpec, example: Example) -> None:
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
# Sizes: small, with 0 and 1 often (hypothesis shrinks towards the smallest)


@st.composite
def z2xy_cases(draw) -> Case:
    """z2xy is elementwise on any shape: 0 to 4 dimensions of 0 to 40 elements (the leading ones
    0 to 4), held as dim0, dim1, ... beside the rows x cols the descriptor's maker reads."""
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    if draw(st.booleans()):
        shape.append(draw(st.integers(0, 40)))
    rows = 1
    for size in shape[:-1]:
        rows *= size
    name = "x".join(map(str, shape)) or "scalar"
    return Case(name, {"rows": rows, "cols": shape[-1] if shape else 1, "ndim": len(shape),
                       **{f"dim{k}": size for k, size in enumerate(shape)}})


def any_shape(spec: OpSpec) -> OpSpec:
    """The z2xy descriptor with a maker for the shapes of z2xy_cases: the descriptor's own
    rows x cols inputs, viewed as the case's shape. Reference and tolerances are unchanged."""
    def make(case: Case, **kwargs) -> Sample:
        shape = tuple(case[f"dim{k}"] for k in range(case["ndim"]))
        made = spec.make(case, **kwargs)
        return made.map(lambda _, t: t.detach().reshape(shape).requires_grad_(t.requires_grad))

    return dataclasses.replace(spec, make=make)


# The LLTM CPU kernels split B x S elements over threads in chunks of at least this many
# (kGrainElements in lltm_cpu.cpp): below it, a second thread never takes part.
LLTM_GRAIN = 8192


@st.composite
def lltm_cases(draw) -> Case:
    """Batch, features and state 0 to 12; one case in sixteen just past the CPU kernels' grain
    (B x S over 8192, where two threads share the rows), with state 42 to 128 (the weights are
    3S x (S + F): a larger state costs the reference more than it tests)."""
    if draw(st.integers(0, 15)) < 15:  # shrinks towards the small sizes
        batch, state = draw(st.integers(0, 12)), draw(st.integers(0, 12))
    else:
        state = draw(st.integers(42, 128))
        least = -(-(LLTM_GRAIN + 1) // state)
        batch = draw(st.integers(least, least + 8))
    features = draw(st.integers(0, 12))
    return Case(f"b{batch}_f{features}_s{state}",
                {"batch": batch, "features": features, "state": state})


@st.composite
def deform_conv2d_cases(draw) -> Case:
    """Every configuration the op accepts, small: groups and offset groups dividing the channels,
    kernel 1 to 3, stride and dilation 1 to 3, padding 0 to 2, images from the smallest that
    leaves one output position up to 6 pixels larger, with and without mask and bias."""
    groups = draw(st.integers(1, 3))
    in_channels = groups * draw(st.integers(1, 3))
    out_channels = groups * draw(st.integers(1, 3))
    offset_groups = draw(st.sampled_from([d for d in range(1, 5) if in_channels % d == 0]))
    sizes = {"batch": draw(st.integers(0, 3)), "in_channels": in_channels,
             "out_channels": out_channels, "groups": groups, "offset_groups": offset_groups,
             "mask": int(draw(st.booleans())), "bias": int(draw(st.booleans())),
             "offset_scale": draw(st.sampled_from([1, 3, 6]))}
    for axis, image in (("h", "height"), ("w", "width")):
        kernel, stride = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        pad, dilation = draw(st.integers(0, 2)), draw(st.integers(1, 3))
        smallest = max(1, dilation * (kernel - 1) + 1 - 2 * pad)  # one output position
        sizes.update({f"kernel_{axis}": kernel, f"stride_{axis}": stride, f"pad_{axis}": pad,
                      f"dilation_{axis}": dilation,
                      image: draw(st.integers(smallest, smallest + 6))})
    name = "_".join(f"{k}{v}" for k, v in sizes.items())
    return Case(name, sizes)
