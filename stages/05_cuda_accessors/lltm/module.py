"""lltm.LLTM: the cell as an nn.Module that owns its weights.

The same module as common/workbook/ops/lltm/pybind.py gives stages 02-04, written again on purpose:
this package is installed and imported on its own, so it may depend on torch alone, not on the
workbook's helpers.
"""

from __future__ import annotations

import math
import operator

import torch

from .ops import _DTYPES, LIBRARY, lltm

_OWNER = f"{LIBRARY}.LLTM"  # how messages name the class: lltm.LLTM (lltm_coop.LLTM in stage 08)


def _check_size_arg(name: str, value) -> int:
    """`value` as an int >= 1 (a Python or NumPy integer, not a bool), or an error naming it."""
    if isinstance(value, bool):
        raise TypeError(f"{_OWNER}: `{name}` must be an int, got bool {value}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{_OWNER}: `{name}` must be an int, got {type(value).__name__} "
                        f"{value!r}") from None
    if value < 1:
        raise ValueError(f"{_OWNER}: `{name}` must be >= 1, got {value}")
    return value


def _check_state(state) -> tuple[torch.Tensor, torch.Tensor]:
    """`state` as the pair (h, c) of tensors, or an error saying what it is instead."""
    if isinstance(state, torch.Tensor):
        raise TypeError(f"{_OWNER}: `state` must be a pair (h, c) of tensors, got one tensor of "
                        f"shape {list(state.shape)}")
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        what = (f"a {type(state).__name__} of {len(state)}"
                if isinstance(state, (tuple, list)) else type(state).__name__)
        raise TypeError(f"{_OWNER}: `state` must be a pair (h, c) of tensors, got {what}")
    return state[0], state[1]


class LLTM(torch.nn.Module):
    """An LLTM cell with `input_features` inputs and `state_size` state.

    forward(input, (h, c)) -> (new_h, new_cell). Weights and bias start uniform in
    +-1/sqrt(state_size), as in torch.nn.LSTM.
    """

    def __init__(self, input_features: int, state_size: int, *, device=None, dtype=None):
        super().__init__()
        input_features = _check_size_arg("input_features", input_features)
        state_size = _check_size_arg("state_size", state_size)
        if dtype is not None and dtype not in _DTYPES:
            raise TypeError(f"{_OWNER}: `dtype` must be torch.float64, float32, float16 or "
                            f"bfloat16 (or None: the default dtype), got {dtype}")
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
        old_h, old_cell = _check_state(state)
        return lltm(input, self.weights, self.bias, old_h, old_cell)

    def extra_repr(self) -> str:
        return f"input_features={self.input_features}, state_size={self.state_size}"
