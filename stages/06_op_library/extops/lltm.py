"""extops.lltm: the LLTM cell as two ops of the library, its functional form and its nn.Module.

    cell = extops.LLTM(input_features=32, state_size=128)         # an nn.Module
    new_h, new_cell = cell(x, (h, c))
    new_h, new_cell = extops.lltm(x, weights, bias, h, c)         # the functional form

Stage 05's lltm package moved into the library unchanged in behaviour. The C++ library (loaded by
the package's __init__ before this module is imported) defines torch.ops.extops.lltm_forward and
.lltm_backward (schemas: csrc/lltm/lltm.cpp), their CPU and CUDA kernels, and, unlike stage 05,
their autograd (csrc/lltm/autograd/lltm_autograd.cpp, on the Autograd dispatch key: stage 05's
Python register_autograd costs tens of microseconds a call at the tutorial's size, which that
file's header measures). What torch needs besides, registered here with torch.library:

* a fake kernel per op: output shapes, dtypes and devices from the inputs' alone, which is how
  torch.compile traces the ops and how they run on meta tensors. It checks what the C++ checks,
  so a bad input fails at trace time, not only when the kernel runs.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import Tensor

from . import errors
from .errors import (
    check_dense,
    check_dim,
    check_inputs,
    check_reverse_mode_only,
    check_same_shape,
    check_size,
)

_FORWARD_NAMES = ("input", "weights", "bias", "old_h", "old_cell")
_BACKWARD_NAMES = ("grad_h", "grad_cell", "new_cell", "gates", "input", "old_h", "weights")


@torch.library.register_fake("extops::lltm_forward")
def _forward_fake(input, weights, bias, old_h, old_cell):
    # workbook/lltm_checks.h's check_forward_inputs, check for check.
    op = "lltm"
    check_inputs(op, list(zip(_FORWARD_NAMES, (input, weights, bias, old_h, old_cell))))
    check_dim(op, "input", input, 2, "(batch, features)")
    check_dim(op, "old_h", old_h, 2, "(batch, state)")
    check_dim(op, "old_cell", old_cell, 2, "(batch, state)")
    check_dim(op, "weights", weights, 2, "(3 * state, state + features)")
    check_dim(op, "bias", bias, 1, "(3 * state)")
    (batch, features), state = input.shape, old_h.shape[1]
    check_size(op, "old_h", old_h, 0, batch, "batch size of `input`")
    check_same_shape(op, "old_cell", old_cell, "old_h", old_h)
    check_size(op, "weights", weights, 0, 3 * state, "3 * state size of `old_h`")
    check_size(op, "weights", weights, 1, state + features,
               "state size of `old_h` + features of `input`")
    check_size(op, "bias", bias, 0, 3 * state, "3 * state size of `old_h`")
    return (input.new_empty(batch, state), input.new_empty(batch, state),
            input.new_empty(batch, 3 * state))


@torch.library.register_fake("extops::lltm_backward")
def _backward_fake(grad_h, grad_cell, new_cell, gates, input, old_h, weights):
    # workbook/lltm_checks.h's check_backward_inputs, check for check.
    op = "lltm_backward"
    tensors = (grad_h, grad_cell, new_cell, gates, input, old_h, weights)
    check_inputs(op, list(zip(_BACKWARD_NAMES, tensors)))
    check_dim(op, "new_cell", new_cell, 2, "(batch, state)")
    check_dim(op, "gates", gates, 2, "(batch, 3 * state)")
    check_dim(op, "input", input, 2, "(batch, features)")
    check_dim(op, "weights", weights, 2, "(3 * state, state + features)")
    for name, t in (("grad_h", grad_h), ("grad_cell", grad_cell), ("old_h", old_h)):
        check_same_shape(op, name, t, "new_cell", new_cell)
    (batch, state), features = new_cell.shape, input.shape[1]
    check_size(op, "gates", gates, 0, batch, "batch size of `new_cell`")
    check_size(op, "gates", gates, 1, 3 * state, "3 * state size of `new_cell`")
    check_size(op, "input", input, 0, batch, "batch size of `new_cell`")
    check_size(op, "weights", weights, 0, 3 * state, "3 * state size of `new_cell`")
    check_size(op, "weights", weights, 1, state + features,
               "state size of `new_cell` + features of `input`")
    return (input.new_empty(batch, features), weights.new_empty(3 * state, state + features),
            weights.new_empty(3 * state), input.new_empty(batch, state),
            input.new_empty(batch, state))


def lltm(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor,
         old_cell: Tensor) -> tuple[Tensor, Tensor]:
    """One LLTM step: (new_h, new_cell), differentiable (reverse mode) in every input.

    input [B, F], weights [3S, S + F], bias [3S], old_h and old_cell [B, S]; dense tensors of one
    dtype, float64, float32, float16 or bfloat16 (half and bfloat16 compute in float), on the CPU
    or a CUDA device. Inside a torch.autocast region the inputs are cast to the region's dtype
    (csrc/lltm/autocast/). Forward-mode AD and torch.func's gradient transforms are refused
    (errors.check_reverse_mode_only); torch.vmap works.

    The op itself, torch.ops.extops.lltm_forward, returns a third output, the pre-activation
    gates: an intermediate for its backward, not differentiable, and not part of this form.

    Bad input raises extops.ExtopsValueError or ExtopsTypeError, which `except RuntimeError`
    catches too (extops/errors.py). Under torch.jit.script it calls the op directly.
    """
    if torch.jit.is_scripting():
        outputs = torch.ops.extops.lltm_forward(input, weights, bias, old_h, old_cell)
        return outputs[0], outputs[1]
    return errors.call(_lltm_eager, input, weights, bias, old_h, old_cell)


def _lltm_eager(input, weights, bias, old_h, old_cell):
    tensors = (input, weights, bias, old_h, old_cell)
    for name, value in zip(_FORWARD_NAMES, tensors):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"lltm: `{name}` must be a tensor, got {type(value).__name__}")
    check_dense("lltm", zip(_FORWARD_NAMES, tensors))
    check_reverse_mode_only("lltm", tensors)
    new_h, new_cell, _gates = torch.ops.extops.lltm_forward(input, weights, bias, old_h, old_cell)
    return new_h, new_cell


def check_size_arg(owner: str, name: str, value) -> int:
    """`value` as an int >= 1 (a Python or NumPy integer, not a bool), or an error naming it."""
    if isinstance(value, bool):
        raise TypeError(f"{owner}: `{name}` must be an int, got bool {value}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{owner}: `{name}` must be an int, got {type(value).__name__} "
                        f"{value!r}") from None
    if value < 1:
        raise ValueError(f"{owner}: `{name}` must be >= 1, got {value}")
    return value


def check_state(owner: str, state) -> tuple[torch.Tensor, torch.Tensor]:
    """`state` as the pair (h, c) of tensors, or an error saying what it is instead."""
    if isinstance(state, torch.Tensor):
        raise TypeError(f"{owner}: `state` must be a pair (h, c) of tensors, got one tensor of "
                        f"shape {list(state.shape)}")
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        what = (f"a {type(state).__name__} of {len(state)}"
                if isinstance(state, (tuple, list)) else type(state).__name__)
        raise TypeError(f"{owner}: `state` must be a pair (h, c) of tensors, got {what}")
    return state[0], state[1]


class LLTM(torch.nn.Module):
    """An LLTM cell with `input_features` inputs and `state_size` state.

    forward(input, (h, c)) -> (new_h, new_cell). Weights and bias start uniform in
    +-1/sqrt(state_size), as in torch.nn.LSTM. torch.jit.script takes the module.
    """

    def __init__(self, input_features: int, state_size: int, *, device=None, dtype=None):
        super().__init__()
        input_features = errors.call(check_size_arg, "extops.LLTM", "input_features",
                                     input_features)
        state_size = errors.call(check_size_arg, "extops.LLTM", "state_size", state_size)
        if dtype is not None and dtype not in errors.DTYPES:
            raise errors.ExtopsTypeError(
                f"extops.LLTM: `dtype` must be torch.float64, float32, float16 or bfloat16 (or "
                f"None: the default dtype), got {dtype}")
        self.input_features = input_features
        self.state_size = state_size
        factory = {"device": device, "dtype": dtype}
        self.weights = torch.nn.Parameter(
            torch.empty(3 * state_size, input_features + state_size, **factory)
        )
        self.bias = torch.nn.Parameter(torch.empty(3 * state_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.state_size)
        with torch.no_grad():
            self.weights.uniform_(-bound, bound)
            self.bias.uniform_(-bound, bound)

    def forward(self, input: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        if torch.jit.is_scripting():
            return lltm(input, self.weights, self.bias, state[0], state[1])
        old_h, old_cell = errors.call(check_state, "extops.LLTM", state)
        return lltm(input, self.weights, self.bias, old_h, old_cell)

    def extra_repr(self) -> str:
        return f"input_features={self.input_features}, state_size={self.state_size}"
