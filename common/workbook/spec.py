"""Op descriptors: each op of the workbook described once, for tests, notebooks, demo and benchmark.

An op lives in ``common/workbook/ops/<name>/`` as an `OpSpec`:

* ``arg_names``: the parameters of its functional form, in order (for messages and samples);
* ``make(case, device=, dtype=, requires_grad=, seed=)``: the input maker, returning a `Sample`;
* ``reference``: the plain PyTorch version, differentiable, which called on float64 copies of a
  sample is what every kernel is compared with (and, in the working dtype, the eager baseline);
* ``tolerances`` per dtype and ``gradcheck`` options (``nondet_tol`` for an atomic backward);
* ``cases``: named, irregular sizes; ``batch_key``: which size is the batch, so every op is also
  tested at batch 0; ``demo_case``: the sizes the demo and the notebooks time;
* ``bad_inputs(device)``: the inputs it must refuse, each with the exception and message;
* ``layouts``: the memory layouts its samples can be re-stored in (see `relayout`).

A `Sample` is one call: positional and keyword arguments, which may be tensors, ints, tuples or
None. `compare(fn, spec, sample)` runs fn and the float64 reference on the same values, with the
same random incoming gradients, and compares outputs and every input gradient: the one
comparison the tests assert, the demo prints and the benchmark validates with.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

# (rtol, atol) per dtype, the default of every op. Both are applied elementwise as
#   |actual - expected| <= atol * scale + rtol * |expected|,   scale = max(1, max |expected|)
# so atol is relative to the tensor's magnitude once that exceeds 1: a float32 gradient summed
# over a large batch may be in the hundreds, and its rounding error grows with it.
DEFAULT_TOLERANCES: Mapping[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1e-5),
    # Half and bfloat16 round every stored value (and, in GEMMs, partial sums): 11 and 8 bits.
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (8e-2, 8e-2),
}

# torch.autograd.gradcheck options, in float64. nondet_tol: how far two backward passes on the
# same inputs may differ (0 for a deterministic backward; an atomic one needs a little).
DEFAULT_GRADCHECK: Mapping[str, Any] = {"eps": 1e-6, "atol": 1e-5, "rtol": 1e-4, "nondet_tol": 0.0}

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------
# Cases and samples


@dataclasses.dataclass(frozen=True)
class Case:
    """One input configuration: a name for test ids and the sizes an op's `make` reads."""

    name: str
    sizes: Mapping[str, int]
    full_gradcheck: bool = True  # False: gradcheck in fast mode (random projections), for size
    # True: its size is the point (a grid past a launch limit, a loop's many turns), which no
    # element type changes: on the emulated device it runs in one dtype (testing.params).
    sized: bool = False

    def __getitem__(self, key: str) -> int:
        return self.sizes[key]

    def with_sizes(self, name: str | None = None, **changes: int) -> Case:
        """The same case with some sizes changed (say, batch=0), under a new name."""
        suffix = "_".join(f"{k}{v}" for k, v in changes.items())
        return dataclasses.replace(self, name=name or f"{self.name}_{suffix}",
                                   sizes={**self.sizes, **changes})


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


@dataclasses.dataclass(frozen=True)
class Sample:
    """The arguments of one call of an op: positional `args` (named by `arg_names`) and `kwargs`.

    Arguments may be tensors, ints, tuples or None; only tensors are moved, copied or
    re-laid-out by the methods below, everything else passes through unchanged.
    """

    name: str
    args: tuple
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    arg_names: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.name

    def call(self, fn: Callable) -> Any:
        return fn(*self.args, **self.kwargs)

    def named(self) -> Iterator[tuple[str, Any]]:
        """(name, value) of every argument, positional first; unnamed positions are `arg<k>`."""
        for k, value in enumerate(self.args):
            yield (self.arg_names[k] if k < len(self.arg_names) else f"arg{k}"), value
        yield from self.kwargs.items()

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, v) for name, v in self.named() if _is_tensor(v)]

    def differentiable(self) -> list[tuple[str, torch.Tensor]]:
        """The tensor arguments that require grad, in order: the ones gradients are taken of."""
        return [(name, t) for name, t in self.tensors() if t.requires_grad]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the first floating tensor: the dtype the op computes and returns in."""
        return next(t.dtype for _, t in self.tensors() if t.is_floating_point())

    @property
    def device(self) -> torch.device:
        return self.tensors()[0][1].device

    def map(self, fn: Callable[[str, torch.Tensor], Any], name: str | None = None) -> Sample:
        """A sample with fn(name, tensor) in place of every tensor argument."""
        def apply(arg_name, value):
            return fn(arg_name, value) if _is_tensor(value) else value

        names = dict(self.named())
        args = tuple(apply(n, v) for n, v in zip(list(names)[: len(self.args)], self.args))
        kwargs = {k: apply(k, v) for k, v in self.kwargs.items()}
        return dataclasses.replace(self, name=name or self.name, args=args, kwargs=kwargs)

    def replaced(self, name: str, value: Any) -> Sample:
        """The sample with argument `name` (positional or keyword) replaced by `value`."""
        names = [n for n, _ in self.named()][: len(self.args)]
        if name in names:
            args = list(self.args)
            args[names.index(name)] = value
            return dataclasses.replace(self, args=tuple(args))
        return dataclasses.replace(self, kwargs={**self.kwargs, name: value})

    def float64(self) -> Sample:
        """Detached float64 copies of the tensors, each keeping its requires_grad: the reference's
        inputs. Integer tensors stay as they are."""
        def copy(_, t):
            if not t.is_floating_point():
                return t
            return t.detach().to(torch.float64).requires_grad_(t.requires_grad)

        return self.map(copy)

    def bind(self, fn: Callable) -> tuple[Callable, tuple[torch.Tensor, ...]]:
        """fn as a function of the differentiable tensors alone, and those tensors: the form
        gradcheck and the timing harness want (every other argument fixed to the sample's)."""
        names = [name for name, _ in self.differentiable()]
        tensors = tuple(t for _, t in self.differentiable())

        def call(*values):
            by_name = dict(zip(names, values))
            return self.map(lambda name, t: by_name.get(name, t)).call(fn)

        return call, tensors

    def detached(self, requires_grad: bool | Sequence[str] = False) -> Sample:
        """Fresh leaf copies; requires_grad True/False for all floating tensors, or the names of
        those that should require it."""
        def copy(name, t):
            wanted = name in requires_grad if not isinstance(requires_grad, bool) else requires_grad
            return t.detach().clone().requires_grad_(wanted and t.is_floating_point())

        return self.map(copy)


@dataclasses.dataclass(frozen=True)
class BadInput:
    """Inputs an op must refuse: `make(device)` builds them (a Sample), on `device` where a tensor
    is meant to be valid; the call must raise `error` with a message matching `match`."""

    name: str
    make: Callable[[str], Sample]
    error: type[BaseException] | tuple[type[BaseException], ...]
    match: str

    def __str__(self) -> str:
        return self.name


def raised_as(error: BaseException) -> tuple[type[BaseException], str]:
    """The class an op's error means and its message. Mostly the error's own; but a library on
    the stable ABI (stage 10) cannot raise c10's ValueError and TypeError from C++, so its checks
    raise RuntimeError with the class first in the message, "[ValueError] lltm: ..."
    (workbook/checks.h): that is read as the class it names. (Its functional forms raise the
    class itself: extops/errors.py.)"""
    message = str(error)
    if isinstance(error, RuntimeError):
        for kind in (ValueError, TypeError):
            prefix = f"[{kind.__name__}] "
            if message.startswith(prefix):
                return kind, message[len(prefix):]
    return type(error), message


# The modes a row of the hostile-input matrix runs in (workbook.net.matrix): eager on CPU tensors
# (the C++ checks), on meta tensors (the fake kernel), and through torch.compile(fullgraph=True).
MATRIX_MODES = ("eager", "meta", "compile")


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of an op's hostile-input matrix (workbook.net.matrix; an op's own rows are in
    ops/<op>/matrix.py).

    `make(device)` builds the sample (tensors meant to be valid on `device`). With `error` set,
    every mode must raise that class (or a subclass) with a message naming `arg` in backticks.
    With `error` None the op must accept the input; `check` says what else: "reference" (the
    outputs match the float64 reference; eager and compile), or "runs" (no error, outputs of the
    reference's shapes: for NaN and inf, whose propagation the reference does not pin).
    """

    name: str
    kind: str
    make: Callable[[str], Sample]
    error: type[BaseException] | None = None
    arg: str | None = None
    check: str = "reference"
    modes: tuple[str, ...] = MATRIX_MODES
    # The output shapes, for rows too large to run the reference on (meta mode only).
    shapes: tuple[tuple[int, ...], ...] | None = None

    def expects(self) -> str:
        if self.error is None:
            return f"accepted ({self.check})"
        return f"{self.error.__name__} naming `{self.arg}`"


def other_device(device: str) -> str:
    """Another device than `device`, for an input left on the wrong one: the CPU for a GPU or
    meta tensor (the classic mistake), meta for a CPU tensor (present on every machine)."""
    return "meta" if torch.device(device).type == "cpu" else "cpu"


# ----------------------------------------------------------------------------------------------
# Layouts: the same values, stored differently


def _strided(t: torch.Tensor) -> torch.Tensor:
    """Every other element of a twice-as-wide buffer along the last dimension."""
    if t.dim() == 0:
        return t
    storage = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
    view = storage[..., ::2]
    view.copy_(t)
    return view


def _permuted(t: torch.Tensor) -> torch.Tensor:
    """Stored with the dimensions in reverse order (a transposed matrix, say), then viewed back."""
    if t.dim() < 2:
        return _strided(t)
    order = tuple(reversed(range(t.dim())))
    return t.permute(order).contiguous().permute(order)


def _expanded(t: torch.Tensor) -> torch.Tensor:
    """The first slice along dimension 0, broadcast over it with stride 0 (changes the values:
    every slice becomes the first; the reference is computed on the same values)."""
    if t.dim() == 0 or t.shape[0] < 2:
        return _strided(t)
    return t[:1].expand(t.shape)


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t.clone()


LAYOUTS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "strided": _strided,
    "permuted": _permuted,
    "expanded": _expanded,
    "channels_last": _channels_last,
}


def relayout(sample: Sample, layout: str) -> Sample:
    """The sample with every tensor stored in `layout`: leaves with the same requires_grad. An
    integer tensor (an index table, as multi-scale deformable attention's level table) keeps its
    values: "expanded", which would change them into another valid-looking table, stores it
    strided instead."""
    store = LAYOUTS[layout]

    def move(_, t):
        keep = layout == "expanded" and not t.is_floating_point()
        with torch.no_grad():
            moved = (_strided if keep else store)(t.detach())
        return moved.requires_grad_(t.requires_grad) if t.is_floating_point() else moved

    return sample.map(move, name=f"{sample.name}-{layout}")


# ----------------------------------------------------------------------------------------------
# The descriptor


@dataclasses.dataclass(frozen=True)
class OpSpec:
    name: str
    arg_names: tuple[str, ...]
    output_names: tuple[str, ...]
    reference: Callable[..., Any]
    make: Callable[..., Sample]
    cases: tuple[Case, ...]
    batch_key: str
    demo_case: Case
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    tolerances: Mapping[torch.dtype, tuple[float, float]] = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_TOLERANCES))
    gradcheck: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_GRADCHECK))
    bad_inputs: Callable[[str], list[BadInput]] = lambda device: []
    layouts: tuple[str, ...] = ("strided", "permuted", "expanded")
    # Threads calling the op at once (tests/test_concurrency.py) use this case: large enough that
    # calls overlap (None: the demo case).
    concurrency_case: Case | None = None
    # What the demo times the op's implementations against: label -> function with the op's
    # signature. A callable, so an optional baseline (torchvision) is imported only when asked.
    baselines: Callable[[], Mapping[str, Callable]] | None = None

    def baseline_functions(self) -> Mapping[str, Callable]:
        return self.baselines() if self.baselines else {"plain PyTorch": self.reference}

    def case(self, name: str) -> Case:
        for c in self.cases:
            if c.name == name:
                return c
        raise KeyError(f"{self.name}: no case {name!r}; cases: {[c.name for c in self.cases]}")

    def batch0(self, case: Case | None = None) -> Case:
        """A case at batch size 0 (the smallest case's other sizes): empty inputs, empty outputs."""
        base = case or min(self.cases, key=lambda c: math.prod(c.sizes.values()))
        return base.with_sizes(f"{base.name}_batch0", **{self.batch_key: 0})

    def tolerance(self, dtype: torch.dtype) -> tuple[float, float]:
        return self.tolerances[dtype]


# ----------------------------------------------------------------------------------------------
# Comparing an implementation with the reference


def as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def random_like(tensors: Sequence[torch.Tensor], seed: int = 1234) -> tuple[torch.Tensor, ...]:
    """Seeded standard-normal float64 tensors shaped like `tensors` (incoming gradients: ones
    would let a swapped or transposed gradient pass)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device)
                 for t in tensors)


@dataclasses.dataclass(frozen=True)
class Difference:
    """One output or gradient against the reference's."""

    what: str  # "output new_h", "gradient of weights"
    max_abs: float  # max |actual - expected| (nan when NaNs disagree)
    max_rel: float  # max_abs / max |expected|
    ok: bool
    problem: str = ""  # set when the tensor is missing or has the wrong shape, dtype or device


@dataclasses.dataclass(frozen=True)
class Comparison:
    differences: tuple[Difference, ...]
    tolerance: tuple[float, float]
    dtype: torch.dtype

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.differences)

    def worst(self, kind: str = "") -> float:
        """Largest relative error among the differences whose name starts with `kind`."""
        values = [d.max_rel for d in self.differences if d.what.startswith(kind) and not d.problem]
        return max(values, default=0.0)

    def failures(self) -> list[str]:
        rtol, atol = self.tolerance
        return [f"{d.what}: {d.problem}" if d.problem else
                f"{d.what}: max |error| {d.max_abs:.3g} ({_share(d.max_rel)} its largest value) "
                f"exceeds rtol={rtol:g}, atol={atol:g} in {dtype_name(self.dtype)}"
                for d in self.differences if not d.ok]

    def assert_ok(self) -> None:
        assert self.ok, "against the float64 reference:\n  " + "\n  ".join(self.failures())


def _share(ratio: float) -> str:
    """An error as a share of the largest expected value: "0.341 of", or "17 times" where it
    outgrows it (a wrong sign, or a value from another place)."""
    return f"{ratio:.3g} of" if ratio < 1 else f"{ratio:.3g} times"


def _difference(what: str, actual, expected: torch.Tensor, dtype: torch.dtype,
                device: torch.device, tolerance: tuple[float, float]) -> Difference:
    if actual is None:
        return Difference(what, math.nan, math.nan, False, "no tensor (None)")
    if actual.shape != expected.shape:
        return Difference(what, math.nan, math.nan, False,
                          f"shape {list(actual.shape)}, expected {list(expected.shape)}")
    if actual.dtype != dtype:
        return Difference(what, math.nan, math.nan, False,
                          f"dtype {dtype_name(actual.dtype)}, expected {dtype_name(dtype)}")
    if actual.device != device:
        return Difference(what, math.nan, math.nan, False, f"on {actual.device}, expected {device}")
    if actual.numel() == 0:
        return Difference(what, 0.0, 0.0, True)
    # Compared where the reference is (the emulated device's values are host memory anyway).
    a, e = actual.detach().to(expected.device).double(), expected.detach().double()
    both_nan = a.isnan() & e.isnan()
    error = torch.where(both_nan, torch.zeros_like(a), (a - e).abs())
    error = torch.where(error.isnan(), torch.full_like(error, math.inf), error)
    finite = e[e.isfinite()]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    rtol, atol = tolerance
    allowed = atol * max(1.0, scale) + rtol * e.abs().nan_to_num(posinf=0.0, neginf=0.0)
    same_inf = (a == e) & e.isinf()
    ok = bool(((error <= allowed) | same_inf).all())
    max_abs = torch.where(same_inf, torch.zeros_like(error), error).max().item()
    return Difference(what, max_abs, max_abs / scale if scale else max_abs, ok)


def compare(fn: Callable, spec: OpSpec, sample: Sample, *, gradients: bool = True,
            grad_outputs: Sequence[torch.Tensor] | None = None,
            tolerance: tuple[float, float] | None = None) -> Comparison:
    """fn against spec.reference in float64 on the same sample: outputs, then the gradient of
    every input that requires grad (when `gradients`), with the same incoming gradients.

    Raises whatever fn raises; everything else (a missing gradient, a wrong shape, dtype or
    device, values out of tolerance, NaN where the reference has none) is in the Comparison.
    """
    dtype, device = sample.dtype, sample.device
    tolerance = tolerance or spec.tolerance(dtype)
    wanted = [t for _, t in sample.differentiable()] if gradients else []
    outputs = as_tuple(sample.call(fn))
    reference_sample = sample.float64()
    if str(device).startswith("emulated_cuda"):  # the reference is plain PyTorch: on the CPU
        reference_sample = reference_sample.map(
            lambda _, t: t.detach().cpu().requires_grad_(t.requires_grad))
    expected = as_tuple(reference_sample.call(spec.reference))
    names = spec.output_names if len(spec.output_names) == len(expected) else \
        tuple(f"{k}" for k in range(len(expected)))
    differences = []
    if len(outputs) != len(expected):
        differences.append(Difference("outputs", math.nan, math.nan, False,
                                      f"{len(outputs)} returned, expected {len(expected)}"))
        return Comparison(tuple(differences), tolerance, dtype)
    for name, out, ref in zip(names, outputs, expected):
        differences.append(_difference(f"output {name}", out, ref, dtype, device, tolerance))
    if wanted and all(d.ok or not d.problem for d in differences):
        grad_outputs = grad_outputs or random_like(expected)
        grads = torch.autograd.grad(outputs, wanted, [g.to(o.device, o.dtype) for g, o in
                                                      zip(grad_outputs, outputs)],
                                    allow_unused=True)
        ref_wanted = [t for _, t in reference_sample.differentiable()]
        ref_grads = torch.autograd.grad(expected, ref_wanted, list(grad_outputs),
                                        allow_unused=True)
        for (name, t), g, ref in zip(sample.differentiable(), grads, ref_grads):
            if ref is None:  # the reference does not depend on it: zero gradient
                ref = torch.zeros_like(t, dtype=torch.float64)
            differences.append(_difference(f"gradient of {name}", g, ref, t.dtype, t.device,
                                           tolerance))
    return Comparison(tuple(differences), tolerance, dtype)


def assert_rows_close(what: str, rows: slice, actual: torch.Tensor, expected: torch.Tensor,
                      tolerance: tuple[float, float]) -> None:
    """workbook.spec.compare's criterion, |a - e| <= atol max(1, max |e|) + rtol |e|, on one
    chunk along the first dimension (rows of a matrix, images of a batch; a NaN fails it): for
    outputs too large to compare in float64 at once."""
    rtol, atol = tolerance
    error = (actual.double() - expected).abs()
    allowed = atol * max(1.0, expected.abs().max().item()) + rtol * expected.abs()
    bad = ~(error <= allowed)
    assert not bad.any(), (f"{what}, rows {rows.start}-{rows.stop - 1}: {int(bad.sum())} elements "
                           f"off, max |error| {error.max().item():.3g}")
