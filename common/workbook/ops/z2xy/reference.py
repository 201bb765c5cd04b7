"""z2xy in plain PyTorch: z = 2x + y.

Written with ordinary differentiable torch calls, so autograd gives its gradients. It serves
twice: as the *reference*, called on float64 copies of a sample's inputs (Sample.float64), its
outputs and gradients are what every kernel is compared with; as the *baseline*, called in the
working dtype, it is the "plain PyTorch" that the demo and the benchmark time the kernels
against.
"""

from __future__ import annotations

import torch


def z2xy(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 2 * x + y
