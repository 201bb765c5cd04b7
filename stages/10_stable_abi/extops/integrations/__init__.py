"""extops where other projects call multi-scale deformable attention: one module per project,
each with that project's names and call forms over extops.ms_deform_attn.

    extops.integrations.transformers       use_extops(model): HF transformers' DETR-family
                                           models (Deformable DETR, RT-DETR, Grounding DINO, ...)
    extops.integrations.deformable_detr    MSDeformAttnFunction, MSDeformAttn,
                                           ms_deform_attn_core_pytorch (its models/ops)
    extops.integrations.mmcv               MultiScaleDeformableAttnFunction,
                                           multi_scale_deformable_attn_pytorch,
                                           MultiScaleDeformableAttention (mmcv.ops)

None of them imports the project it serves (transformers' route imports nothing of transformers
either): they are names and argument orders, checked against those projects' own code by the
stage's tests.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ms_deform_attn import ms_deform_attn


def level_start_index(spatial_shapes: Tensor) -> Tensor:
    """Each level's first row in value, from the level table [L, 2] (height, width): the running
    sum of the areas, starting at 0."""
    areas = spatial_shapes.prod(1)
    return torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])


class ApplyFunction:
    """`apply(value, value_spatial_shapes, value_level_start_index, sampling_locations,
    attention_weights, im2col_step)`, positional or by keyword: the call Deformable DETR's
    MSDeformAttnFunction and mmcv's MultiScaleDeformableAttnFunction share, on
    extops.ms_deform_attn. Not a torch.autograd.Function (the op is differentiable as it is),
    only the one call their code makes."""

    @staticmethod
    def apply(value: Tensor, value_spatial_shapes: Tensor, value_level_start_index: Tensor,
              sampling_locations: Tensor, attention_weights: Tensor,
              im2col_step: int | None = None) -> Tensor:
        return ms_deform_attn(value, value_spatial_shapes, value_level_start_index,
                              sampling_locations, attention_weights, im2col_step)


def without_start_index(value: Tensor, value_spatial_shapes: Tensor, sampling_locations: Tensor,
                        attention_weights: Tensor) -> Tensor:
    """The call of Deformable DETR's and mmcv's PyTorch versions (no start index), on the op:
    the start index computed from the shapes."""
    return ms_deform_attn(value, value_spatial_shapes, level_start_index(value_spatial_shapes),
                          sampling_locations, attention_weights)
