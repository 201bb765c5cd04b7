"""mmcv's names (mmcv.ops.multi_scale_deform_attn) over extops' multi-scale deformable attention.

    # in place of: from mmcv.ops import MultiScaleDeformableAttention
    from extops.integrations.mmcv import MultiScaleDeformableAttention

    attn = MultiScaleDeformableAttention(embed_dims=256, num_heads=8, num_levels=4, num_points=4)
    out = attn(query, value=value, reference_points=reference_points,
               spatial_shapes=spatial_shapes, level_start_index=level_start_index)

mmcv runs its kernel on CUDA (float32, float64, float16) and the grid_sample decomposition
elsewhere; these run extops' kernels on every device it has them for, in every float dtype.

* MultiScaleDeformableAttnFunction.apply(value, value_spatial_shapes, value_level_start_index,
  sampling_locations, attention_weights, im2col_step): extops.ms_deform_attn under mmcv's names,
  by position or by keyword; the level tables may be int32, as some of mmcv's are.
* multi_scale_deformable_attn_pytorch(value, value_spatial_shapes, sampling_locations,
  attention_weights): the call of mmcv's PyTorch version, which its layer makes off CUDA, on the
  op. Assigned over mmcv's own (mmcv.ops.multi_scale_deform_attn), mmcv's layer runs extops' CPU
  kernel.
* MultiScaleDeformableAttention: mmcv's layer, its arguments, forward and parameter names, so an
  mmcv checkpoint's keys load.
"""

from __future__ import annotations

from torch import Tensor, nn

from .. import errors
from ..ms_deform_attn import MSDeformAttn
from . import ApplyFunction, without_start_index


class MultiScaleDeformableAttnFunction(ApplyFunction):
    """mmcv's `MultiScaleDeformableAttnFunction.apply(...)` on extops.ms_deform_attn."""


multi_scale_deformable_attn_pytorch = without_start_index


class MultiScaleDeformableAttention(MSDeformAttn):
    """mmcv's MultiScaleDeformableAttention on extops.ms_deform_attn.

    forward(query, key=None, value=None, identity=None, query_pos=None, key_padding_mask=None,
    reference_points=None, spatial_shapes=None, level_start_index=None) -> dropout(attention) +
    identity. Sequence first ([Lq, N, C], value [S, N, C]) unless batch_first. value defaults to
    query, identity to query before query_pos is added; key is not read (mmcv's is not either);
    key_padding_mask is True where value's row is padding. value_proj_ratio sets value_proj's
    width (embed_dims * ratio), which the heads split.

    The four projections are MSDeformAttn's (mmcv keeps Deformable DETR's names and start), so
    the state-dict keys are mmcv's. norm_cfg is accepted and unused, as in mmcv; init_cfg is
    mmengine's initialisation config, which this layer does not read: it must be None.
    """

    def __init__(self, embed_dims: int = 256, num_heads: int = 8, num_levels: int = 4,
                 num_points: int = 4, im2col_step: int = 64, dropout: float = 0.1,
                 batch_first: bool = False, norm_cfg: dict | None = None,
                 init_cfg: dict | None = None, value_proj_ratio: float = 1.0):
        if init_cfg is not None:
            raise errors.ExtopsValueError(
                "MultiScaleDeformableAttention: `init_cfg` (mmengine's initialisation config) is "
                "not read here: pass None, then init_weights() or load a checkpoint")
        value_dims = int(embed_dims * value_proj_ratio)
        if value_dims < 1 or value_dims % num_heads:
            raise errors.ExtopsValueError(
                f"MultiScaleDeformableAttention: value_proj's width, `embed_dims` * "
                f"`value_proj_ratio` ({embed_dims} * {value_proj_ratio} = {value_dims}), must be "
                f"a positive multiple of `num_heads` ({num_heads})")
        # MSDeformAttn checks the sizes (with its own argument names in the message).
        super().__init__(d_model=embed_dims, n_levels=num_levels, n_heads=num_heads,
                         n_points=num_points)
        self.embed_dims, self.num_heads = embed_dims, num_heads
        self.num_levels, self.num_points = num_levels, num_points
        self.im2col_step, self.batch_first, self.norm_cfg = im2col_step, batch_first, norm_cfg
        self.dropout = nn.Dropout(dropout)
        if value_dims != embed_dims:
            self.value_proj = nn.Linear(embed_dims, value_dims)
            self.output_proj = nn.Linear(value_dims, embed_dims)
            self.reset_parameters()

    def init_weights(self) -> None:
        """reset_parameters under mmcv's name (mmcv's start is Deformable DETR's)."""
        self.reset_parameters()

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None,
                identity: Tensor | None = None, query_pos: Tensor | None = None,
                key_padding_mask: Tensor | None = None,
                reference_points: Tensor | None = None, spatial_shapes: Tensor | None = None,
                level_start_index: Tensor | None = None, **kwargs) -> Tensor:
        for name, t in (("reference_points", reference_points),
                        ("spatial_shapes", spatial_shapes),
                        ("level_start_index", level_start_index)):
            if t is None:
                raise errors.ExtopsValueError(f"MultiScaleDeformableAttention: `{name}` is "
                                              f"required")
        value = query if value is None else value
        identity = query if identity is None else identity
        if query_pos is not None:
            query = query + query_pos
        if not self.batch_first:  # [L, N, C] -> [N, L, C]
            query, value = query.transpose(0, 1), value.transpose(0, 1)
        out = super().forward(query, reference_points, value, spatial_shapes, level_start_index,
                              key_padding_mask)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return self.dropout(out) + identity

    def extra_repr(self) -> str:
        return (f"embed_dims={self.embed_dims}, num_heads={self.num_heads}, "
                f"num_levels={self.num_levels}, num_points={self.num_points}, "
                f"batch_first={self.batch_first}")


__all__ = ["MultiScaleDeformableAttention", "MultiScaleDeformableAttnFunction",
           "multi_scale_deformable_attn_pytorch"]
