"""The LLTM cell in plain PyTorch.

Written with ordinary differentiable torch calls, so autograd gives its gradients. It serves
twice: as the *reference*, called on float64 copies of a sample's inputs (Sample.float64), its
outputs and gradients are what every kernel is compared with; as the *baseline*, called in the
working dtype, it is the "plain PyTorch" that the demo and the benchmark time the kernels
against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lltm(input, weights, bias, old_h, old_cell):
    """One LLTM step (see stages/02_lltm_cpp/csrc/lltm.cpp for the equations)."""
    X = torch.cat([old_h, input], dim=1)
    gates = F.linear(X, weights, bias)
    i, o, candidate = gates.chunk(3, dim=1)
    new_cell = old_cell + F.elu(candidate, alpha=1.0) * torch.sigmoid(i)
    new_h = torch.tanh(new_cell) * torch.sigmoid(o)
    return new_h, new_cell
