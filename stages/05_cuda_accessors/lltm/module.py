"""lltm.LLTM: the cell as an nn.Module that owns its weights.

The same module as common/workbook/lltm.py gives stages 02-04, written again on purpose: this
package is installed and imported on its own, so it may depend on torch alone, not on the
workbook's helpers.
"""

from __future__ import annotations

import math

import torch

from .ops import lltm


class LLTM(torch.nn.Module):
    """An LLTM cell with `input_features` inputs and `state_size` state.

    forward(input, (h, c)) -> (new_h, new_cell). Weights and bias start uniform in
    +-1/sqrt(state_size), as in torch.nn.LSTM.
    """

    def __init__(self, input_features: int, state_size: int, *, device=None, dtype=None):
        super().__init__()
        if input_features < 1 or state_size < 1:
            raise ValueError(
                f"lltm.LLTM: input_features and state_size must be >= 1, "
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
