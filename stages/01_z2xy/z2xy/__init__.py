"""Stage 01: z = 2x + y as a C++ extension, wrapped for autograd.

The C++ side (csrc/z2xy.cpp) computes the forward and the backward; this file teaches autograd
how to use them: `Z2xyFunction.forward` calls the extension, `Z2xyFunction.backward` calls its
backward. `z2xy(x, y)` is the functional form and `Z2xy` the nn.Module.
"""

import torch

from . import _C

__all__ = ["Z2xyFunction", "z2xy", "Z2xy"]


class Z2xyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        # Nothing to save: the gradients of 2x + y do not depend on x or y.
        return _C.forward(x, y)

    @staticmethod
    def backward(ctx, grad_z):
        grad_x, grad_y = _C.backward(grad_z.contiguous())
        # Return a gradient only where autograd asked for one.
        return (
            grad_x if ctx.needs_input_grad[0] else None,
            grad_y if ctx.needs_input_grad[1] else None,
        )


def z2xy(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """z = 2x + y, differentiable in both inputs."""
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TypeError(
            f"z2xy: `x` and `y` must be tensors, got {type(x).__name__} and {type(y).__name__}"
        )
    return Z2xyFunction.apply(x, y)


class Z2xy(torch.nn.Module):
    """z = 2x + y as a layer, so it can sit in an nn.Sequential."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return z2xy(x, y)
