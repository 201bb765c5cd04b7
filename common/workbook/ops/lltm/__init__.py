"""The LLTM cell (stages 02-06): the descriptor, and the checks every LLTM module shares.

    lltm(input [B, F], weights [3S, S + F], bias [3S], old_h [B, S], old_cell [B, S])
        -> (new_h, new_cell)
"""

from __future__ import annotations

import re

import torch

from workbook.ops.lltm import reference
from workbook.spec import (
    BadInput,
    Case,
    OpSpec,
    Sample,
    assert_rows_close,
    other_device,
    raised_as,
)

ARG_NAMES = ("input", "weights", "bias", "old_h", "old_cell")


def make(case: Case, *, device="cpu", dtype=torch.float32, requires_grad=True,
         seed=None) -> Sample:
    """(input, weights, bias, old_h, old_cell), uniform in +-1, weights and bias in the module's
    +-1/sqrt(S) range; drawn in float64 on the CPU, so every device and dtype sees the same values
    (up to rounding)."""
    batch, features, state = case["batch"], case["features"], case["state"]
    gen = torch.Generator().manual_seed(batch * 10_000 + state if seed is None else seed)
    bound = max(state, 1) ** -0.5

    def uniform(*shape, scale=1.0):
        t = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * scale
        return t.to(device=device, dtype=dtype).requires_grad_(requires_grad)

    args = (uniform(batch, features), uniform(3 * state, features + state, scale=bound),
            uniform(3 * state, scale=bound), uniform(batch, state), uniform(batch, state))
    return Sample(case.name, args, arg_names=ARG_NAMES)


def inputs(batch: int, features: int, state: int, **kwargs) -> tuple[torch.Tensor, ...]:
    """make()'s tensors for the given sizes, as a tuple: lltm(*inputs(16, 32, 128))."""
    return make(Case("sizes", {"batch": batch, "features": features, "state": state}),
                **kwargs).args


def bad_inputs(device: str) -> list[BadInput]:
    """Inputs every LLTM implementation refuses, with the same message; valid ones are B=2, F=3,
    S=4 on the device make() is given, with one argument replaced."""

    def good(**changes):
        def build(on):
            valid = dict(zip(ARG_NAMES, inputs(2, 3, 4, device=on, requires_grad=False)))
            valid.update({k: v(on) for k, v in changes.items()})
            return Sample("bad", tuple(valid[n] for n in ARG_NAMES), arg_names=ARG_NAMES)
        return build

    def t(*shape, dtype=torch.float32, elsewhere=False):
        """A tensor maker: on make()'s device, or on another one when `elsewhere`."""
        return lambda on: torch.zeros(*shape, dtype=dtype,
                                      device=other_device(on) if elsewhere else on)

    return [
        BadInput("int64_input", good(input=t(2, 3, dtype=torch.int64)),
                 TypeError, r"`input` must be a float64, float32, float16 or bfloat16 tensor, got "
                 r"torch.int64"),
        BadInput("int64_weights", good(weights=t(12, 7, dtype=torch.int64)),
                 TypeError, r"`weights` must have dtype torch.float32 \(the dtype of `input`\), "
                 r"got torch.int64"),
        BadInput("float64_bias", good(bias=t(12, dtype=torch.float64)),
                 TypeError, r"`bias` must have dtype torch.float32 .* got torch.float64"),
        BadInput("input_3d", good(input=t(2, 3, 1)),
                 ValueError, r"`input` must have 2 dimensions .* got 3"),
        BadInput("old_h_1d", good(old_h=t(4)),
                 ValueError, r"`old_h` must have 2 dimensions .* got 1"),
        BadInput("batch_mismatch", good(old_h=t(5, 4)),
                 ValueError, r"`old_h` must have size 2 in dimension 0 \(batch size of `input`\)"),
        BadInput("cell_mismatch", good(old_cell=t(2, 5)),
                 ValueError, r"`old_cell` must have the shape of `old_h`"),
        BadInput("features_mismatch", good(weights=t(12, 8)),
                 ValueError, r"`weights` must have size 7 in dimension 1"),
        BadInput("state_mismatch", good(weights=t(15, 7)),
                 ValueError, r"`weights` must have size 12 in dimension 0"),
        BadInput("bias_mismatch", good(bias=t(11)),
                 ValueError, r"`bias` must have size 12 in dimension 0"),
        BadInput("weights_on_another_device", good(weights=t(12, 7, elsewhere=True)),
                 RuntimeError, r"`weights` must be on the same device as `input`"),
    ]


OP = OpSpec(
    name="lltm",
    arg_names=ARG_NAMES,
    output_names=("new_h", "new_cell"),
    reference=reference.lltm,
    make=make,
    # Irregular sizes on purpose: batch 1, state 1, odd and non-power-of-two sizes.
    cases=(
        Case("b1_f1_s1", {"batch": 1, "features": 1, "state": 1}),
        Case("b5_f17_s33", {"batch": 5, "features": 17, "state": 33}),
        Case("b1_f32_s128", {"batch": 1, "features": 32, "state": 128}, full_gradcheck=False),
        Case("b3_f1_s129", {"batch": 3, "features": 1, "state": 129}, full_gradcheck=False),
        Case("b16_f32_s128", {"batch": 16, "features": 32, "state": 128}, full_gradcheck=False),
        Case("b2_f3_s4", {"batch": 2, "features": 3, "state": 4}),
    ),
    batch_key="batch",
    # The sizes the PyTorch C++ extension tutorial times its LLTM at.
    demo_case=Case("tutorial", {"batch": 16, "features": 32, "state": 128}),
    # Threads calling it at once (tests/test_concurrency.py): B x S = 8960, past the CPU
    # kernels' 8192-element grain, so that two intra-op threads share each call too.
    concurrency_case=Case("b70_f8_s128", {"batch": 70, "features": 8, "state": 128}),
    bad_inputs=bad_inputs,
)

# Beyond OP.cases, for CUDA kernels: a state wider than one block, with a partial last block.
CUDA_CASES = (
    *OP.cases,
    Case("b1_f8_s1025", {"batch": 1, "features": 8, "state": 1025}, full_gradcheck=False,
         sized=True),
    Case("b3_f5_s1500", {"batch": 3, "features": 5, "state": 1500}, full_gradcheck=False,
         sized=True),
)


def assert_module(LLTM) -> None:
    """An LLTM module starts with weights and bias spread over +-1/sqrt(S), runs and trains, and
    refuses sizes below 1."""
    torch.manual_seed(0)
    cell = LLTM(input_features=32, state_size=128)
    bound = 128 ** -0.5
    for p in (cell.weights, cell.bias):
        assert p.abs().max() <= bound
        assert p.abs().max() > 0.9 * bound  # spread over the range, not all zeros
    x, _, _, h, c = inputs(16, 32, 128, requires_grad=False)
    new_h, new_c = cell(x, (h, c))
    assert new_h.shape == new_c.shape == (16, 128)
    (new_h.sum() + new_c.sum()).backward()
    assert cell.weights.grad is not None and cell.bias.grad is not None


def assert_module_arguments(LLTM, owner: str) -> None:
    """An LLTM module refuses bad constructor and call arguments, naming the argument: sizes
    that are not ints >= 1, a dtype it cannot compute in, a state that is not an (h, c) pair.
    NumPy integers are ints."""
    import numpy as np
    import pytest

    refused = [
        ((6, 2.5), {}, TypeError, r"`state_size` must be an int, got float 2.5"),
        (("6", 8), {}, TypeError, r"`input_features` must be an int, got str '6'"),
        ((True, 8), {}, TypeError, r"`input_features` must be an int, got bool"),
        ((0, 8), {}, ValueError, r"`input_features` must be >= 1, got 0"),
        ((6, -1), {}, ValueError, r"`state_size` must be >= 1, got -1"),
        ((6, 8), {"dtype": torch.int64}, TypeError, r"`dtype` must be torch.float64, .* got "
                                                    r"torch.int64"),
    ]
    for args, kwargs, error, match in refused:
        with pytest.raises(error, match=rf"^{owner}: {match}"):
            LLTM(*args, **kwargs)
    cell = LLTM(np.int64(3), 4)
    assert (cell.input_features, cell.state_size) == (3, 4)
    x, _, _, h, c = inputs(2, 3, 4, requires_grad=False)
    for state, what in ((h, r"one tensor of shape \[2, 4\]"), ((h,), "a tuple of 1"),
                        ([h, c, c], "a list of 3"), (None, "NoneType")):
        with pytest.raises(TypeError, match=rf"^{owner}: `state` must be a pair \(h, c\) of "
                                            rf"tensors, got {what}"):
            cell(x, state)
    assert cell(x, [h, c])[0].shape == (2, 4)


class TwoSteps(torch.nn.Module):
    """A small model around an LLTM module: two steps of the cell, then a linear read-out (for
    torch.compile tests)."""

    def __init__(self, cell_type, features=8, state=16):
        super().__init__()
        self.cell = cell_type(features, state)
        self.head = torch.nn.Linear(state, 1)

    def forward(self, x0, x1, h, c):
        h, c = self.cell(x0, (h, c))
        h, c = self.cell(x1, (h, c))
        return self.head(h).sum() + c.mean()


# ----------------------------------------------------------------------------------------------
# Checks of an LLTM registered as torch.library ops (stages 05, 06): `forward_op` and
# `backward_op` are the OpOverloads, `fn` the functional form.


def backward_sample(sample: Sample, forward_op, requires_grad: bool) -> Sample:
    """The arguments of the backward op for a forward sample: incoming gradients, then what the
    forward saves."""
    x, w, b, h, c = sample.detached(requires_grad=False).args
    _, new_cell, gates = forward_op(x, w, b, h, c)
    gen = torch.Generator().manual_seed(5)
    grad_h, grad_cell = (torch.randn(new_cell.shape, generator=gen, dtype=torch.float64)
                         .to(new_cell) for _ in range(2))
    args = tuple(t.requires_grad_(requires_grad)
                 for t in (grad_h, grad_cell, new_cell, gates, x, h, w))
    names = ("grad_h", "grad_cell", "new_cell", "gates", "input", "old_h", "weights")
    return Sample(f"{sample.name}-backward", args, arg_names=names)


def assert_fake_kernels(forward_op, backward_op) -> None:
    """Meta tensors run the fake kernels: right shapes, dtype and device, no kernel launched."""
    x, w, b, h, c = inputs(2, 3, 4, device="meta", requires_grad=False)
    outputs = forward_op(x, w, b, h, c)
    assert [tuple(o.shape) for o in outputs] == [(2, 4), (2, 4), (2, 12)]
    assert all(o.device.type == "meta" and o.dtype == torch.float32 for o in outputs)
    grads = backward_op(c, c, c, outputs[2], x, h, w)
    assert [tuple(g.shape) for g in grads] == [(2, 3), (12, 7), (12,), (2, 4), (2, 4)]


def assert_gates_take_no_gradient(forward_op) -> None:
    new_h, new_cell, gates = forward_op(*inputs(2, 3, 4))
    assert new_h.requires_grad and new_cell.requires_grad and not gates.requires_grad


def assert_gradient_through_one_output(fn, used: str) -> None:
    """A loss on one output only: the other's gradient reaches the backward as None."""
    args = inputs(3, 5, 7, dtype=torch.float64)
    index = OP.output_names.index(used)
    grads = torch.autograd.grad(fn(*args)[index].sum(), args)
    ref_args = tuple(t.detach().requires_grad_() for t in args)
    expected = torch.autograd.grad(reference.lltm(*ref_args)[index].sum(), ref_args)
    for name, g, e in zip(ARG_NAMES, grads, expected):
        torch.testing.assert_close(g, e, msg=lambda m, name=name: f"gradient of {name}: {m}")


def assert_double_backward_raises(fn) -> None:
    import pytest

    args = inputs(2, 3, 4, dtype=torch.float64)
    new_h, new_cell = fn(*args)
    grads = torch.autograd.grad(new_h.sum() + new_cell.sum(), args, create_graph=True)
    with pytest.raises(RuntimeError, match="lltm: double backward is not supported"):
        torch.autograd.grad(grads[1].sum(), args)


def assert_backward_op_checks_its_inputs(backward_op) -> None:
    import pytest

    x, w, _, h, c = inputs(2, 3, 4, requires_grad=False)
    for kind, match, args in (
            (ValueError, r"^lltm_backward: `gates` must have size 12 in dimension 1",
             (c, c, c, torch.zeros(2, 11), x, h, w)),
            (TypeError, r"^lltm_backward: `weights` must have dtype torch.float32",
             (c, c, c, torch.zeros(2, 12), x, h, w.double()))):
        with pytest.raises((kind, RuntimeError)) as caught:
            backward_op(*args)
        raised, message = raised_as(caught.value)  # a stable-ABI check names its class
        assert issubclass(raised, kind), f"{kind.__name__} expected, got {caught.value!r}"
        assert re.search(match, message), message


def assert_not_a_tensor_raises(fn) -> None:
    import pytest

    x, w, b, h, c = inputs(2, 3, 4, requires_grad=False)
    with pytest.raises(TypeError, match="`old_h` must be a tensor, got list"):
        fn(x, w, b, [[0.0] * 4] * 2, c)


# The launch configurations no other case reaches, for every CUDA kernel (issue 14): empty
# tensors (the launchers return before launching, as a grid of 0 blocks is an invalid launch),
# state 1, and batches past CUDA's 65535 blocks in y. Stages 05 and 06 stack rows in a block (8
# at state <= 32, 1 from state 225), so their row loop over gridDim.y runs from batch
# 65535 x 8 + 1 at state 3 and from 65536 at state 257. Stage 04's flat grid has blocks to spare.
CUDA_EDGE_CASES = (
    Case("b0_f3_s257", {"batch": 0, "features": 3, "state": 257}, full_gradcheck=False),
    Case("b3_f4_s0", {"batch": 3, "features": 4, "state": 0}),
    Case("b0_f4_s0", {"batch": 0, "features": 4, "state": 0}),
    Case("b4_f3_s1", {"batch": 4, "features": 3, "state": 1}),
    Case("b70000_f2_s3", {"batch": 70000, "features": 2, "state": 3}, full_gradcheck=False,
         sized=True),
    Case("b600000_f1_s3", {"batch": 600_000, "features": 1, "state": 3}, full_gradcheck=False,
         sized=True),
    Case("b65536_f3_s257", {"batch": 65536, "features": 3, "state": 257}, full_gradcheck=False,
         sized=True),
)

# The edge cases the CPU kernels run too: state 0 and state 1 (batch 0 is in every params()).
CPU_EDGE_CASES = CUDA_EDGE_CASES[1:4]

# The opt-in case past 2^31 elements (WORKBOOK_HUGE_TESTS=1, bfloat16, on a GPU): B x S =
# 2^31 + 1024, so new_h, new_cell and old_cell hold elements past 2^31 and the gates (3 B S)
# past 2^32: the 64-bit index path of every LLTM kernel.
HUGE_CASE = Case("b2097153_f1_s1024", {"batch": 2**21 + 1, "features": 1, "state": 1024},
                 full_gradcheck=False)


def assert_past_2_31_elements(fn, case=None, device="cuda", rows=1 << 16) -> None:
    """fn forward and backward once in bfloat16 on `case` (B x S past 2^31: the 64-bit index
    path), then every output and gradient against the float64 reference, `rows` rows at a time:
    a float64 copy of the whole would need four times the memory. The weights' and bias'
    gradients, sums over all rows, are summed chunk by chunk in float64. Peak on the GPU, in
    the backward: about 16 tensors of B x S bfloat16 (4.3 GB each; the gates and their gradient
    count 3 each), 70 GB."""
    case = case or HUGE_CASE
    batch, features, state = case["batch"], case["features"], case["state"]
    gen = torch.Generator(device=device).manual_seed(0)

    def uniform(*shape, scale=1.0):
        return torch.empty(shape, dtype=torch.bfloat16, device=device).uniform_(
            -scale, scale, generator=gen)

    bound = state**-0.5
    inputs = (uniform(batch, features), uniform(3 * state, state + features, scale=bound),
              uniform(3 * state, scale=bound), uniform(batch, state), uniform(batch, state))
    inputs = tuple(t.requires_grad_() for t in inputs)
    outputs = fn(*inputs)
    incoming = (uniform(batch, state), uniform(batch, state))
    grads = torch.autograd.grad(outputs, inputs, incoming)
    new_h, new_cell = (t.detach() for t in outputs)
    tolerance = OP.tolerance(torch.bfloat16)
    weights, bias = (t.detach().double().requires_grad_() for t in inputs[1:3])
    sums = [torch.zeros_like(weights), torch.zeros_like(bias)]
    for start in range(0, batch, rows):
        part = slice(start, min(start + rows, batch))
        x, h, c = (inputs[k].detach()[part].double().requires_grad_() for k in (0, 3, 4))
        expected = OP.reference(x, weights, bias, h, c)
        expected_grads = torch.autograd.grad(expected, (x, weights, bias, h, c),
                                             tuple(g[part].double() for g in incoming))
        for what, actual, wanted in (("new_h", new_h[part], expected[0]),
                                     ("new_cell", new_cell[part], expected[1]),
                                     ("gradient of input", grads[0][part], expected_grads[0]),
                                     ("gradient of old_h", grads[3][part], expected_grads[3]),
                                     ("gradient of old_cell", grads[4][part], expected_grads[4])):
            assert_rows_close(what, part, actual, wanted.detach(), tolerance)
        sums[0] += expected_grads[1]
        sums[1] += expected_grads[2]
    everything = slice(0, batch)
    assert_rows_close("gradient of weights", everything, grads[1], sums[0], tolerance)
    assert_rows_close("gradient of bias", everything, grads[2], sums[1], tolerance)
