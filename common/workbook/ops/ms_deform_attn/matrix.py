"""Multi-scale deformable attention's rows of the hostile-input matrix (workbook.net.matrix),
beyond the generic rows every op gets and the bad inputs of its descriptor: an output past 2^31
elements, run on meta tensors.
"""

from __future__ import annotations

import torch

from workbook.ops.ms_deform_attn import ARG_NAMES, case, make
from workbook.spec import Row, Sample

VALID = case("valid", 2, 3, 2, 4, 2, [(3, 4), (2, 2)])


def valid(device: str) -> Sample:
    """The valid sample every generic row starts from (float32, no grad)."""
    return make(VALID, device=device, requires_grad=False)


def rows() -> list[Row]:
    """The rows of this op beyond the generic ones and the bad inputs."""

    def past_32_bits(on):
        # 2^16 queries x 2^16 channels of one head: an output of 2^32 elements.
        value = torch.zeros(1, 1, 1, 1, device=on).expand(1, 4, 1, 2**16)
        shapes = torch.tensor([[2, 2]], device=on)
        starts = torch.zeros(1, dtype=torch.int64, device=on)
        locations = torch.zeros(1, 1, 1, 1, 1, 2, device=on).expand(1, 2**16, 1, 1, 1, 2)
        weights = torch.zeros(1, 1, 1, 1, 1, device=on).expand(1, 2**16, 1, 1, 1)
        return Sample("past_2_31", (value, shapes, starts, locations, weights),
                      arg_names=ARG_NAMES)

    return [Row("output_past_2_31", "overflow", past_32_bits, check="runs", modes=("meta",),
                shapes=((1, 2**16, 2**16),))]
