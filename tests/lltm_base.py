"""What every LLTM implementation (stages 02-05) is tested with, on top of the shared base."""

import torch

from workbook import reference
from workbook.testing import BadInput, Case, OpTest

INPUT_NAMES = ("input", "weights", "bias", "old_h", "old_cell")


def lltm_inputs(batch, features, state, *, device="cpu", dtype=torch.float32,
                requires_grad=True, seed=0):
    """(input, weights, bias, old_h, old_cell) with weights in the module's +-1/sqrt(S) range."""
    gen = torch.Generator().manual_seed(seed)
    bound = state ** -0.5

    def make(*shape, scale=1.0):
        t = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * scale
        return t.to(device=device, dtype=dtype).requires_grad_(requires_grad)

    return (
        make(batch, features),
        make(3 * state, features + state, scale=bound),
        make(3 * state, scale=bound),
        make(batch, state),
        make(batch, state),
    )


def check_module_initialises_uniformly_and_runs(LLTM):
    """An LLTM module starts with weights and bias spread over +-1/sqrt(S) and trains."""
    torch.manual_seed(0)
    cell = LLTM(input_features=32, state_size=128)
    bound = 128 ** -0.5
    for p in (cell.weights, cell.bias):
        assert p.abs().max() <= bound
        assert p.abs().max() > 0.9 * bound  # spread over the range, not all zeros
    x, _, _, h, c = lltm_inputs(16, 32, 128, requires_grad=False)
    new_h, new_c = cell(x, (h, c))
    assert new_h.shape == new_c.shape == (16, 128)
    (new_h.sum() + new_c.sum()).backward()
    assert cell.weights.grad is not None and cell.bias.grad is not None


class LLTMOpTest(OpTest):
    """Irregular sizes on purpose: batch 1, state 1, odd and non-power-of-two sizes."""

    cases = [
        Case("b1_f1_s1", {"batch": 1, "features": 1, "state": 1}),
        Case("b5_f17_s33", {"batch": 5, "features": 17, "state": 33}),
        Case("b1_f32_s128", {"batch": 1, "features": 32, "state": 128}, full_gradcheck=False),
        Case("b3_f1_s129", {"batch": 3, "features": 1, "state": 129}, full_gradcheck=False),
        Case("b16_f32_s128", {"batch": 16, "features": 32, "state": 128}, full_gradcheck=False),
        Case("b2_f3_s4", {"batch": 2, "features": 3, "state": 4}),
    ]
    # The device the bad inputs are built on, and the name torch gives its type in messages.
    bad_input_device = "cpu"

    def expected_fn(self, *inputs):
        return reference.lltm(*inputs)

    def make_inputs(self, case, device, dtype, requires_grad=True):
        return lltm_inputs(case["batch"], case["features"], case["state"], device=device,
                           dtype=dtype, requires_grad=requires_grad,
                           seed=case["batch"] * 10_000 + case["state"])

    def bad_inputs(self):
        device = self.bad_input_device

        def good(**changes):
            """Valid inputs (B=2, F=3, S=4) with some replaced by name."""
            inputs = dict(zip(INPUT_NAMES, lltm_inputs(2, 3, 4, device=device,
                                                       requires_grad=False)))
            inputs.update(changes)
            return lambda: tuple(inputs[name] for name in INPUT_NAMES)

        def t(*shape, **kw):
            return torch.zeros(*shape, **{"device": device, **kw})

        return [
            BadInput("int64_input", good(input=t(2, 3, dtype=torch.int64)),
                     TypeError, r"`input` must be a floating-point tensor, got Long"),
            BadInput("int64_weights", good(weights=t(12, 7, dtype=torch.int64)),
                     TypeError, r"`weights` must have dtype Float.* got Long"),
            BadInput("float64_bias", good(bias=t(12, dtype=torch.float64)),
                     TypeError, r"`bias` must have dtype Float.* got Double"),
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
            BadInput("meta_weights", good(weights=torch.zeros(12, 7, device="meta")),
                     RuntimeError, rf"`weights` must be a {device.upper()} tensor, got a tensor on meta"),
            BadInput("all_on_meta", lambda: lltm_inputs(2, 3, 4, device="meta",
                                                        requires_grad=False),
                     RuntimeError, rf"`input` must be a {device.upper()} tensor, got a tensor on meta"),
        ]
