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

import torch

_FORWARD_NAMES = ("input", "weights", "bias", "old_h", "old_cell")
_BACKWARD_NAMES = ("grad_h", "grad_cell", "new_cell", "gates", "input", "old_h", "weights")

# dtypes by the names C++ prints them with (c10::ScalarType), so that a bad input gets the same
# message from the fake kernel as from the C++ checks: "got Long", not "got torch.int64".
_SCALAR_TYPE_NAMES = {torch.float64: "Double", torch.float32: "Float", torch.float16: "Half",
                      torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int",
                      torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
                      torch.bool: "Bool", torch.complex64: "ComplexFloat",
                      torch.complex128: "ComplexDouble"}


def _dtype_name(dtype: torch.dtype) -> str:
    return _SCALAR_TYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.").capitalize()


def _check_same_dtype_and_device(op: str, names, tensors) -> None:
    first_name, first = names[0], tensors[0]
    torch._check_type(first.dtype.is_floating_point,
                      lambda: f"{op}: `{first_name}` must be a floating-point tensor, "
                              f"got {_dtype_name(first.dtype)}")
    for name, t in zip(names, tensors):
        torch._check_type(t.dtype == first.dtype,
                          lambda: f"{op}: `{name}` must have dtype {_dtype_name(first.dtype)} "
                                  f"(the dtype of the first input), got {_dtype_name(t.dtype)}")
    for name, t in zip(names, tensors):
        torch._check(t.device == first.device,
                     lambda: f"{op}: `{name}` must be on the same device as `{first_name}` "
                             f"({first.device}), got {t.device}")


def _check_dim(op: str, name: str, t, ndim: int, what: str) -> None:
    torch._check_value(t.dim() == ndim,
                       lambda: f"{op}: `{name}` must have {ndim} dimension{'s' * (ndim != 1)} "
                               f"{what}, got {t.dim()} with sizes {list(t.shape)}")


def _check_size(op: str, name: str, t, dim: int, expected, why: str) -> None:
    torch._check_value(t.shape[dim] == expected,
                       lambda: f"{op}: `{name}` must have size {expected} in dimension {dim} "
                               f"({why}), got sizes {list(t.shape)}")


@torch.library.register_fake("extops::lltm_forward")
def _forward_fake(input, weights, bias, old_h, old_cell):
    op = "lltm"
    _check_same_dtype_and_device(op, _FORWARD_NAMES, (input, weights, bias, old_h, old_cell))
    _check_dim(op, "input", input, 2, "(batch, features)")
    _check_dim(op, "old_h", old_h, 2, "(batch, state)")
    _check_dim(op, "old_cell", old_cell, 2, "(batch, state)")
    _check_dim(op, "weights", weights, 2, "(3 * state, state + features)")
    _check_dim(op, "bias", bias, 1, "(3 * state)")
    (batch, features), state = input.shape, old_h.shape[1]
    _check_size(op, "old_h", old_h, 0, batch, "batch size of `input`")
    torch._check_value(old_cell.shape == old_h.shape,
                       lambda: f"{op}: `old_cell` must have the shape of `old_h` "
                               f"{list(old_h.shape)}, got {list(old_cell.shape)}")
    _check_size(op, "weights", weights, 0, 3 * state, "3 * state size of `old_h`")
    _check_size(op, "weights", weights, 1, state + features,
                "state size of `old_h` + features of `input`")
    _check_size(op, "bias", bias, 0, 3 * state, "3 * state size of `old_h`")
    return (input.new_empty(batch, state), input.new_empty(batch, state),
            input.new_empty(batch, 3 * state))


@torch.library.register_fake("extops::lltm_backward")
def _backward_fake(grad_h, grad_cell, new_cell, gates, input, old_h, weights):
    op = "lltm_backward"
    tensors = (grad_h, grad_cell, new_cell, gates, input, old_h, weights)
    _check_same_dtype_and_device(op, _BACKWARD_NAMES, tensors)
    _check_dim(op, "new_cell", new_cell, 2, "(batch, state)")
    _check_dim(op, "gates", gates, 2, "(batch, 3 * state)")
    _check_dim(op, "input", input, 2, "(batch, features)")
    _check_dim(op, "weights", weights, 2, "(3 * state, state + features)")
    for name, t in (("grad_h", grad_h), ("grad_cell", grad_cell), ("old_h", old_h)):
        torch._check_value(t.shape == new_cell.shape,
                           lambda: f"{op}: `{name}` must have the shape of `new_cell` "
                                   f"{list(new_cell.shape)}, got {list(t.shape)}")
    (batch, state), features = new_cell.shape, input.shape[1]
    _check_size(op, "gates", gates, 0, batch, "batch size of `new_cell`")
    _check_size(op, "gates", gates, 1, 3 * state, "3 * state size of `new_cell`")
    _check_size(op, "input", input, 0, batch, "batch size of `new_cell`")
    _check_size(op, "weights", weights, 0, 3 * state, "3 * state size of `new_cell`")
    _check_size(op, "weights", weights, 1, state + features,
                "state size of `new_cell` + features of `input`")
    return (input.new_empty(batch, features), weights.new_empty(3 * state, state + features),
            weights.new_empty(3 * state), input.new_empty(batch, state),
            input.new_empty(batch, state))


def lltm(input, weights, bias, old_h, old_cell):
    """One LLTM step: (new_h, new_cell), differentiable with respect to every input.

    input [B, F], weights [3S, S + F], bias [3S], old_h and old_cell [B, S]; any floating dtype
    (half and bfloat16 compute in float), on the CPU or a CUDA device.
    """
    for name, value in zip(_FORWARD_NAMES, (input, weights, bias, old_h, old_cell)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"lltm: `{name}` must be a tensor, got {type(value).__name__}")
    new_h, new_cell, _gates = torch.ops.extops.lltm_forward(input, weights, bias, old_h, old_cell)
    return new_h, new_cell


class LLTM(torch.nn.Module):
    """An LLTM cell with `input_features` inputs and `state_size` state.

    forward(input, (h, c)) -> (new_h, new_cell). Weights and bias start uniform in
    +-1/sqrt(state_size), as in torch.nn.LSTM.
    """

    def __init__(self, input_features: int, state_size: int, *, device=None, dtype=None):
        super().__init__()
        if input_features < 1 or state_size < 1:
            raise ValueError(
                f"extops.LLTM: input_features and state_size must be >= 1, "
                f"got {input_features} and {state_size}"
            )
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

    def forward(self, input: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]):
        old_h, old_cell = state
        return lltm(input, self.weights, self.bias, old_h, old_cell)

    def extra_repr(self) -> str:
        return f"input_features={self.input_features}, state_size={self.state_size}"
