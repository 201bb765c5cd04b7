"""Deformable DETR's names (its models/ops package) over extops' multi-scale deformable attention.

    # in place of: from models.ops.modules import MSDeformAttn
    #              from models.ops.functions import MSDeformAttnFunction
    from extops.integrations.deformable_detr import MSDeformAttn, MSDeformAttnFunction

    out = MSDeformAttnFunction.apply(value, value_spatial_shapes, value_level_start_index,
                                     sampling_locations, attention_weights, im2col_step)

Deformable DETR's function runs on CUDA only and its layer refuses anything else; these run on
every device extops has kernels for, the CPU included, in float64, float32, float16 and bfloat16.

* MSDeformAttnFunction.apply: extops.ms_deform_attn under Deformable DETR's argument names, by
  position or by keyword (integrations.ApplyFunction).
* MSDeformAttn: extops.MSDeformAttn, which keeps Deformable DETR's parameter names, shapes and
  initialisation, `_reset_parameters()` and `im2col_step`: its checkpoints' attention keys load.
* ms_deform_attn_core_pytorch(value, value_spatial_shapes, sampling_locations,
  attention_weights): the call of Deformable DETR's PyTorch version (no start index), on the op.
"""

from __future__ import annotations

from ..ms_deform_attn import MSDeformAttn
from . import ApplyFunction, without_start_index


class MSDeformAttnFunction(ApplyFunction):
    """Deformable DETR's `MSDeformAttnFunction.apply(...)` on extops.ms_deform_attn."""


ms_deform_attn_core_pytorch = without_start_index

__all__ = ["MSDeformAttn", "MSDeformAttnFunction", "ms_deform_attn_core_pytorch"]
