"""The shared test base: one set of correctness tests that every op of the workbook runs.

A stage's test file subclasses `OpTest` (pytest collects the subclass, whose name starts with
`Test`) and describes its op; the base turns that into tests:

    class TestZ2xy(OpTest):
        cases = [Case("scalar", {"n": 1}), Case("odd", {"n": 129})]

        def fn(self, x, y):              # the implementation under test
            return z2xy_module().z2xy(x, y)

        def expected_fn(self, x, y):     # the plain PyTorch reference, run in float64
            return reference.z2xy(x, y)

        def make_inputs(self, case, device, dtype, requires_grad):
            ...                          # a tuple of tensors for one case

        def bad_inputs(self):
            ...                          # BadInput(...)s that must raise, naming the argument

What the base checks, for every case, device and dtype the subclass lists:

* test_forward: outputs against the float64 reference, with tolerances for the dtype;
* test_backward: the gradient of every input against the reference's;
* test_gradcheck: torch.autograd.gradcheck in float64 (fast mode on the large cases);
* test_noncontiguous: the same op on strided views gives the same answer (or, for kernels that
  require contiguous inputs, a clear error);
* test_mixed_requires_grad: only some inputs require grad; the others get no gradient;
* test_bad_input: each bad input raises the expected exception with a message naming the argument.

Devices that are not present (a CUDA device on this machine) are skipped with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
import torch

from .reference import in_float64


@dataclasses.dataclass(frozen=True)
class Case:
    """One input configuration: a name for test ids and the sizes make_inputs reads."""

    name: str
    sizes: dict[str, int]
    full_gradcheck: bool = True  # False: gradcheck in fast mode (random projections), for size

    def __getitem__(self, key: str) -> int:
        return self.sizes[key]


@dataclasses.dataclass(frozen=True)
class BadInput:
    """Inputs the op must refuse: `make()` builds them, the call must raise `error` matching `match`."""

    name: str
    make: Callable[[], tuple]
    error: type[BaseException] | tuple[type[BaseException], ...]
    match: str


# (rtol, atol) for comparing an output in `dtype` with the float64 reference.
TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (3e-2, 3e-2),
}


def device_param(device: str):
    """A pytest param for a device, skipped with the reason when the device is not here."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        reason = (
            "no CUDA device visible (torch.cuda.is_available() is False)"
            if torch.version.cuda
            else f"this torch ({torch.__version__}) is a CPU-only build"
        )
        return pytest.param(device, marks=pytest.mark.skip(reason=reason), id=device)
    return pytest.param(device, id=device)


def as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def noncontiguous_like(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` with the same values, stored as a strided view (every other element)."""
    storage = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = storage[..., ::2]
    with torch.no_grad():
        view.copy_(t)
    return view.requires_grad_(t.requires_grad)


class OpTest:
    """Base class: subclass it as `Test<Op>` and fill in the attributes and methods below."""

    # -- what a subclass provides --------------------------------------------------------------

    cases: Sequence[Case] = ()
    devices: Sequence[str] = ("cpu",)
    # Whether the op computes on strided inputs (True) or refuses them with an error (False).
    accepts_noncontiguous = True
    # The substring the error for a non-contiguous input must contain, when it is refused.
    noncontiguous_error = "contiguous"

    def dtypes(self, device: str) -> Sequence[torch.dtype]:
        return (torch.float32, torch.float64)

    def fn(self, *inputs: torch.Tensor):
        raise NotImplementedError

    def expected_fn(self, *inputs: torch.Tensor):
        raise NotImplementedError

    def make_inputs(
        self, case: Case, device: str, dtype: torch.dtype, requires_grad: bool = True
    ) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def bad_inputs(self) -> Iterable[BadInput]:
        return ()

    def tolerances(self, dtype: torch.dtype) -> tuple[float, float]:
        return TOLERANCES[dtype]

    # -- parametrization -------------------------------------------------------------------------

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        # pytest calls this method of the test class once per test function to parametrize it.
        names = metafunc.fixturenames
        if "case" in names:
            metafunc.parametrize("case", list(self.cases), ids=[c.name for c in self.cases])
        if "device" in names and "dtype" in names:
            combos = [
                pytest.param(
                    *device_param(d).values, dt, marks=device_param(d).marks,
                    id=f"{d}-{str(dt).removeprefix('torch.')}",
                )
                for d in self.devices
                for dt in self.dtypes(d)
            ]
            metafunc.parametrize(("device", "dtype"), combos)
        elif "device" in names:
            metafunc.parametrize("device", [device_param(d) for d in self.devices])
        if "bad" in names:
            bad = list(self.bad_inputs())
            metafunc.parametrize("bad", bad, ids=[b.name for b in bad])
        if "grad_index" in names:
            n = len(self.make_inputs(self.cases[0], "cpu", torch.float64, requires_grad=False))
            metafunc.parametrize("grad_index", [None, *range(n)],
                                 ids=["none", *(f"only{i}" for i in range(n))])

    # -- helpers ---------------------------------------------------------------------------------

    def run_with_grads(self, fn, inputs, grad_outputs=None):
        """Outputs of fn(*inputs), and the gradients of the inputs that require grad."""
        outputs = as_tuple(fn(*inputs))
        if grad_outputs is None:
            gen = torch.Generator().manual_seed(1234)
            grad_outputs = tuple(
                torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device) for o in outputs
            )
        wanted = [t for t in inputs if t.requires_grad]
        if not wanted:
            return outputs, (), grad_outputs
        grads = torch.autograd.grad(
            outputs, wanted, [g.to(o.dtype) for g, o in zip(grad_outputs, outputs)],
            allow_unused=True,
        )
        return outputs, grads, grad_outputs

    def assert_close(self, actual, expected, dtype, what: str) -> None:
        rtol, atol = self.tolerances(dtype)
        assert actual is not None, f"{what}: got no tensor (None)"
        assert actual.dtype == dtype, f"{what}: expected dtype {dtype}, got {actual.dtype}"
        torch.testing.assert_close(
            actual.double(), expected.double().to(actual.device), rtol=rtol, atol=atol,
            msg=lambda m: f"{what} ({dtype}): {m}",
        )

    def check_against_reference(self, inputs, dtype) -> None:
        outputs, grads, grad_outputs = self.run_with_grads(self.fn, inputs)
        ref_outputs, ref_grads, _ = self.run_with_grads(
            self.expected_fn, in_float64(*inputs), grad_outputs
        )
        assert len(outputs) == len(ref_outputs), (
            f"expected {len(ref_outputs)} outputs, got {len(outputs)}"
        )
        for k, (out, ref) in enumerate(zip(outputs, ref_outputs)):
            self.assert_close(out, ref, dtype, f"output {k}")
        for k, (g, ref) in enumerate(zip(grads, ref_grads)):
            self.assert_close(g, ref, dtype, f"gradient of input {k}")

    # -- the tests -------------------------------------------------------------------------------

    def test_forward(self, case, device, dtype):
        inputs = self.make_inputs(case, device, dtype, requires_grad=False)
        outputs = as_tuple(self.fn(*inputs))
        expected = as_tuple(self.expected_fn(*in_float64(*inputs)))
        assert len(outputs) == len(expected)
        for k, (out, ref) in enumerate(zip(outputs, expected)):
            assert out.shape == ref.shape, f"output {k}: shape {out.shape}, expected {ref.shape}"
            assert out.device == inputs[0].device, f"output {k} is on {out.device}"
            self.assert_close(out, ref, dtype, f"output {k}")

    def test_backward(self, case, device, dtype):
        self.check_against_reference(self.make_inputs(case, device, dtype), dtype)

    def test_gradcheck(self, case, device):
        inputs = self.make_inputs(case, device, torch.float64)
        assert torch.autograd.gradcheck(
            self.fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4, fast_mode=not case.full_gradcheck
        )

    def test_noncontiguous(self, device):
        case = max(self.cases, key=lambda c: sum(c.sizes.values()))
        dtype = self.dtypes(device)[0]
        inputs = tuple(noncontiguous_like(t) for t in self.make_inputs(case, device, dtype))
        assert not any(t.is_contiguous() for t in inputs if t.dim() and t.shape[-1] > 1)
        if self.accepts_noncontiguous:
            self.check_against_reference(inputs, dtype)
        else:
            with pytest.raises(RuntimeError, match=self.noncontiguous_error):
                self.fn(*inputs)

    def test_mixed_requires_grad(self, device, grad_index):
        case = self.cases[-1]
        inputs = self.make_inputs(case, device, torch.float64, requires_grad=False)
        if grad_index is not None:
            inputs[grad_index].requires_grad_(True)
        self.check_against_reference(inputs, torch.float64)
        if grad_index is None:
            assert all(o.grad_fn is None for o in as_tuple(self.fn(*inputs)))

    def test_bad_input(self, bad: BadInput):
        args = bad.make()
        with pytest.raises(bad.error, match=bad.match):
            self.fn(*args)
