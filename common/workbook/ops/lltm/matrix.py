"""The LLTM's rows of the hostile-input matrix (workbook.net.matrix), beyond the generic rows
every op gets and the bad inputs of its descriptor: empty sizes, dimensions, shapes, rows past
2^31.
"""

from __future__ import annotations

import torch

from workbook.ops.lltm import ARG_NAMES, make
from workbook.spec import Case, Row, Sample


def valid(device: str) -> Sample:
    """The valid sample every generic row starts from (float32, no grad)."""
    return make(Case("b2_f3_s4", {"batch": 2, "features": 3, "state": 4}), device=device,
                requires_grad=False)


def rows() -> list[Row]:
    """The rows of this op beyond the generic ones and the bad inputs."""

    def sizes(batch, features, state):
        return lambda on: make(Case("sizes", {"batch": batch, "features": features,
                                              "state": state}), device=on, requires_grad=False)

    def valid_with(**changes):
        return lambda on: Sample("bad", tuple(changes[n](on) if n in changes else v for n, v in
                                              zip(ARG_NAMES, valid(on).args)),
                                 arg_names=ARG_NAMES)

    def t(*shape):
        return lambda on: torch.zeros(shape, device=on)

    big = 2**31 + 1  # rows past 32-bit indexing, expanded from one row: no memory behind them

    def past_32_bits(on):
        x, w, b, h, c = valid(on).args
        return Sample("past_2_31", (x[:1].expand(big, 3), w, b, h[:1].expand(big, 4),
                                    c[:1].expand(big, 4)), arg_names=ARG_NAMES)

    return [
        Row("state_0", "empty", sizes(2, 3, 0)),
        Row("features_0", "empty", sizes(2, 0, 4)),
        Row("batch_1_state_1", "empty", sizes(1, 1, 1)),
        Row("weights_1d", "ndim", valid_with(weights=t(12)), ValueError, "weights"),
        Row("bias_2d", "ndim", valid_with(bias=t(12, 1)), ValueError, "bias"),
        Row("old_cell_3d", "ndim", valid_with(old_cell=t(2, 4, 1)), ValueError, "old_cell"),
        Row("input_0d", "ndim", valid_with(input=t()), ValueError, "input"),
        Row("old_h_batch_0", "shape", valid_with(old_h=t(0, 4)), ValueError, "old_h"),
        Row("old_cell_transposed_shape", "shape", valid_with(old_cell=t(4, 2)), ValueError,
              "old_cell"),
        Row("rows_past_2_31", "overflow", past_32_bits, check="runs", modes=("meta",),
              shapes=((big, 4), (big, 4))),
    ]
