"""The deformable convolution's rows of the hostile-input matrix (workbook.net.matrix),
beyond the generic rows every op gets and the bad inputs of its descriptor: the optional
arguments, the integers' range, an output past 2^31 elements.
"""

from __future__ import annotations

import torch

from workbook.ops.deform_conv2d import ARG_NAMES, make, torchvision_case
from workbook.spec import Row, Sample

OPTIONAL = ("bias", "mask")  # None is a valid value of these


def valid(device: str) -> Sample:
    """The valid sample every generic row starts from (float32, no grad)."""
    return make(torchvision_case("valid", 2), device=device, requires_grad=False)


def rows() -> list[Row]:
    """The rows of this op beyond the generic ones and the bad inputs."""

    def valid_with(**changes):
        def build(on):
            sample = valid(on)
            for name, value in changes.items():
                sample = sample.replaced(name, value(on) if callable(value) else value)
            return sample
        return build

    def past_32_bits(on):
        # A 1 x 1 kernel over a 46341 x 46341 image: 2^31 + 10^5 output pixels per channel.
        side = 46341
        return Sample("past_2_31", (torch.zeros(1, 1, 1, 1, device=on).expand(1, 1, side, side),
                                    torch.zeros(1, 2, 1, 1, device=on).expand(1, 2, side, side),
                                    torch.ones(1, 1, 1, 1, device=on), None),
                      {"stride": 1, "padding": 0, "dilation": 1, "mask": None},
                      arg_names=ARG_NAMES)

    return [
        Row("no_bias_no_mask", "optional", valid_with(bias=None, mask=None)),
        Row("stride_past_int64", "int range", valid_with(stride=2**63), ValueError, "stride"),
        Row("padding_negative_pair", "int range", valid_with(padding=(0, -1)), ValueError,
              "padding"),
        Row("dilation_bool", "int range", valid_with(dilation=True), TypeError, "dilation"),
        Row("stride_tensor", "int range", valid_with(stride=lambda on: torch.tensor([1, 1])),
              TypeError, "stride"),
        Row("output_past_2_31", "overflow", past_32_bits, check="runs", modes=("meta",),
              shapes=((1, 1, 46341, 46341),)),
    ]
