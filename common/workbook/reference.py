"""Plain PyTorch versions of every op in the workbook.

Each function is written with ordinary differentiable torch calls, so autograd gives its
gradients. They serve twice:

* as the *reference*: called on float64 copies of the inputs (`in_float64`), their outputs and
  gradients are what the tests compare every kernel against;
* as the *baseline*: called in the working dtype, they are the "plain PyTorch" that the demo and
  the benchmark time each extension against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def z2xy(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 2 * x + y


def lltm(input, weights, bias, old_h, old_cell):
    """One LLTM step (see stages/02_lltm_cpp/csrc/lltm.cpp for the equations)."""
    X = torch.cat([old_h, input], dim=1)
    gates = F.linear(X, weights, bias)
    i, o, candidate = gates.chunk(3, dim=1)
    new_cell = old_cell + F.elu(candidate, alpha=1.0) * torch.sigmoid(i)
    new_h = torch.tanh(new_cell) * torch.sigmoid(o)
    return new_h, new_cell


def in_float64(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Detached float64 copies that keep each input's requires_grad, on the same device."""
    return tuple(t.detach().to(torch.float64).requires_grad_(t.requires_grad) for t in tensors)
