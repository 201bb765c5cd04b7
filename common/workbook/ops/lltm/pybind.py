"""The autograd.Function and nn.Module around any LLTM extension with the workbook's interface.

Stages 02, 03 and 04 build the same two functions in different ways (ahead of time, just in
time, with CUDA kernels); their Python side is identical, so it lives here, once:

    forward(input, weights, bias, old_h, old_cell)              -> [new_h, new_cell, gates]
    backward(grad_h, grad_cell, new_cell, gates, input, old_h, weights)
                                  -> [d_input, d_weights, d_bias, d_old_h, d_old_cell]

`bind(ext)` returns the Function, a functional form and an nn.Module for one extension. Stage 05
registers its ops with torch.library instead, and does not use this file.
"""

from __future__ import annotations

import math

import torch


def bind(ext, name: str):
    """Return (Function, lltm, LLTM) that run the extension module `ext`."""

    class LLTMFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input, weights, bias, old_h, old_cell):
            new_h, new_cell, gates = ext.forward(input, weights, bias, old_h, old_cell)
            # The backward recomputes the gate activations from the pre-activation `gates`.
            ctx.save_for_backward(new_cell, gates, input, old_h, weights)
            return new_h, new_cell

        @staticmethod
        def backward(ctx, grad_h, grad_cell):
            grads = ext.backward(grad_h.contiguous(), grad_cell.contiguous(), *ctx.saved_tensors)
            # grads follow the inputs' order: input, weights, bias, old_h, old_cell.
            return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad))

    LLTMFunction.__name__ = LLTMFunction.__qualname__ = f"{name}_LLTMFunction"

    def lltm(input, weights, bias, old_h, old_cell):
        """One LLTM step: returns (new_h, new_cell)."""
        for arg, value in zip(("input", "weights", "bias", "old_h", "old_cell"),
                              (input, weights, bias, old_h, old_cell)):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name}: `{arg}` must be a tensor, got {type(value).__name__}")
        return LLTMFunction.apply(input, weights, bias, old_h, old_cell)

    class LLTM(torch.nn.Module):
        """An LLTM cell with `input_features` inputs and `state_size` state.

        forward(input, (h, c)) -> (new_h, new_cell). Weights and bias start uniform in
        +-1/sqrt(state_size), as in torch.nn.LSTM.
        """

        def __init__(self, input_features: int, state_size: int, *, device=None, dtype=None):
            super().__init__()
            if input_features < 1 or state_size < 1:
                raise ValueError(
                    f"{name}.LLTM: input_features and state_size must be >= 1, "
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

        def forward(self, input, state):
            old_h, old_cell = state
            return lltm(input, self.weights, self.bias, old_h, old_cell)

        def extra_repr(self) -> str:
            return f"input_features={self.input_features}, state_size={self.state_size}"

    LLTM.__qualname__ = f"{name}.LLTM"
    return LLTMFunction, lltm, LLTM
