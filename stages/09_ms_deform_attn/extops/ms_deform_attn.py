"""extops.ms_deform_attn: multi-scale deformable attention (Deformable DETR's op) as a library op.

    out = ms_deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                         attention_weights)                       # [N, Lq, M D]
    attn = MSDeformAttn(d_model=256, n_levels=4, n_heads=8, n_points=4)
    out = attn(query, reference_points, input_flatten, spatial_shapes, level_start_index)

The C++ library defines torch.ops.extops.ms_deform_attn and .ms_deform_attn_backward (schemas:
csrc/ms_deform_attn/ms_deform_attn.cpp) with CPU kernels (and CUDA ones, where built). What torch
needs besides is here, as for the library's other ops:

* a fake kernel per op, running the metadata checks of workbook/ms_deform_attn.h in the same order
  with the same messages. The level table's values (spatial_shapes must tile value's rows,
  level_start_index must be their running sum) are checked by the kernels, which read them; a
  fake kernel has no values to read;
* the autograd formula: the backward op for the gradients that are wanted, no double backward.

Callers of Deformable DETR's MSDeformAttnFunction.apply(value, shapes, start, locations, weights,
im2col_step) and of mmcv's multi_scale_deformable_attn get the same call here: im2col_step is
accepted and changes nothing (the kernels take any batch), and the level tables may be int32, as
mmcv builds some (the op takes int64: the functional form converts them).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from . import errors
from .errors import check_dense, check_dim, check_inputs, check_reverse_mode_only, check_size

_INT64_MAX = 2**63 - 1

# ----------------------------------------------------------------------------------------------
# Checks: workbook/ms_deform_attn.h, line for line, on extops/errors.py's (workbook/checks.h's).


def _check_index_tensor(op, name, t, first_name, first):
    check_dense(op, ((name, t),))
    torch._check_type(t.dtype == torch.int64,
                      lambda: f"{op}: `{name}` must be a torch.int64 tensor, got {t.dtype}")
    torch._check(t.device == first.device,
                 lambda: errors.say("device", op=op, arg=name, first=first_name,
                                    expected=first.device, got=t.device))


def _check_common(op, grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                  attention_weights):
    """The checks of both ops; returns (batch, queries, heads * channels)."""
    named = [("grad_output", grad_output)] if grad_output is not None else []
    named += [("value", value), ("sampling_locations", sampling_locations),
              ("attention_weights", attention_weights)]
    check_inputs(op, named)
    first_name, first = named[0]
    _check_index_tensor(op, "spatial_shapes", spatial_shapes, first_name, first)
    _check_index_tensor(op, "level_start_index", level_start_index, first_name, first)

    if grad_output is not None:
        check_dim(op, "grad_output", grad_output, 3, "(batch, queries, heads * channels)")
    check_dim(op, "value", value, 4, "(batch, values, heads, channels)")
    check_dim(op, "spatial_shapes", spatial_shapes, 2, "(levels, 2)")
    check_dim(op, "level_start_index", level_start_index, 1, "(levels)")
    check_dim(op, "sampling_locations", sampling_locations, 6,
              "(batch, queries, heads, levels, points, 2)")
    check_dim(op, "attention_weights", attention_weights, 5,
              "(batch, queries, heads, levels, points)")

    batch, _, heads, channels = value.shape
    levels = spatial_shapes.shape[0]
    queries, points = sampling_locations.shape[1], sampling_locations.shape[4]
    torch._check_value(levels >= 1,
                       lambda: f"{op}: `spatial_shapes` must have at least 1 level (dimension 0), "
                               f"got sizes {list(spatial_shapes.shape)}")
    check_size(op, "spatial_shapes", spatial_shapes, 1, 2, "a (height, width) pair per level")
    check_size(op, "level_start_index", level_start_index, 0, levels,
               "levels of `spatial_shapes`")
    check_size(op, "sampling_locations", sampling_locations, 0, batch, "batch size of `value`")
    check_size(op, "sampling_locations", sampling_locations, 2, heads, "heads of `value`")
    check_size(op, "sampling_locations", sampling_locations, 3, levels,
               "levels of `spatial_shapes`")
    check_size(op, "sampling_locations", sampling_locations, 5, 2, "an (x, y) pair per point")
    for dim, (expected, why) in enumerate(((batch, "batch size of `value`"),
                                           (queries, "queries of `sampling_locations`"),
                                           (heads, "heads of `value`"),
                                           (levels, "levels of `spatial_shapes`"),
                                           (points, "points of `sampling_locations`"))):
        check_size(op, "attention_weights", attention_weights, dim, expected, why)

    row = heads * channels
    if not isinstance(batch * queries * row, torch.SymInt):
        torch._check_value(batch * queries * row <= _INT64_MAX and row <= _INT64_MAX,
                           lambda: f"{op}: the output [{batch}, {queries}, {heads} * {channels}] "
                                   f"would have more than 2^63 - 1 elements")
    if grad_output is not None:
        expected = [batch, queries, row]
        torch._check_value(list(grad_output.shape) == expected,
                           lambda: f"{op}: `grad_output` must have sizes {expected} (batch, "
                                   f"queries, heads * channels of the forward), got sizes "
                                   f"{list(grad_output.shape)}")
    return batch, queries, row


# ----------------------------------------------------------------------------------------------
# Fake kernels: what the kernels return, from shapes alone (contiguous, value's dtype).


@torch.library.register_fake("extops::ms_deform_attn")
def _ms_deform_attn_fake(value, spatial_shapes, level_start_index, sampling_locations,
                         attention_weights):
    shape = _check_common("ms_deform_attn", None, value, spatial_shapes, level_start_index,
                          sampling_locations, attention_weights)
    return value.new_empty(shape)


@torch.library.register_fake("extops::ms_deform_attn_backward")
def _ms_deform_attn_backward_fake(grad_output, value, spatial_shapes, level_start_index,
                                  sampling_locations, attention_weights, output_mask,
                                  deterministic):
    torch._check(len(output_mask) == 3,
                 lambda: f"Tried to convert a List with {len(output_mask)} elements to a "
                         f"fixed-size array of size 3")
    _check_common("ms_deform_attn_backward", grad_output, value, spatial_shapes,
                  level_start_index, sampling_locations, attention_weights)
    shapes = (value.shape, sampling_locations.shape, attention_weights.shape)
    return tuple(value.new_empty(shape if wanted else (0,))
                 for wanted, shape in zip(output_mask, shapes))


# ----------------------------------------------------------------------------------------------
# Autograd


def _setup_context(ctx, inputs, output):
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = inputs
    needs = ctx.needs_input_grad
    ctx.output_mask = (needs[0], needs[3], needs[4])
    # Every gradient reads the value (the corners), the locations (where) and the weights
    # (value's gradient is weighted by them); the index tensors are small.
    ctx.save_for_backward(value, spatial_shapes, level_start_index, sampling_locations,
                          attention_weights)


def _backward(ctx, grad_output):
    grads = torch.ops.extops.ms_deform_attn_backward(
        grad_output, *ctx.saved_tensors, list(ctx.output_mask),
        torch.are_deterministic_algorithms_enabled())
    grad_value, grad_locations, grad_weights = (
        g if wanted else None for g, wanted in zip(grads, ctx.output_mask))
    return grad_value, None, None, grad_locations, grad_weights


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "ms_deform_attn: double backward is not supported (the ms_deform_attn_backward op has no "
        "derivative); for second derivatives use the grid_sample decomposition")


torch.library.register_autograd("extops::ms_deform_attn", _backward,
                                setup_context=_setup_context)
torch.library.register_autograd("extops::ms_deform_attn_backward", _no_double_backward)


# ----------------------------------------------------------------------------------------------
# The functional form


_NAMES = ("value", "spatial_shapes", "level_start_index", "sampling_locations",
          "attention_weights")


def ms_deform_attn(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                   sampling_locations: Tensor, attention_weights: Tensor,
                   im2col_step: int | None = None) -> Tensor:
    """Multi-scale deformable attention: Deformable DETR's MSDeformAttnFunction, any batch.

    value [N, S, M, D] (the L levels' pixels stacked along S, each row-major); spatial_shapes
    [L, 2] int64, (height, width) per level; level_start_index [L] int64, each level's first
    row in S; sampling_locations [N, Lq, M, L, P, 2], (x, y) in [0, 1] of the level (points
    outside sample zeros); attention_weights [N, Lq, M, L, P]. Returns [N, Lq, M D]. float64,
    float32, float16 or bfloat16 (half and bfloat16 compute in float); differentiable (reverse
    mode) in value, sampling_locations and attention_weights. The level tables may also be int32
    (converted to the op's int64). im2col_step is accepted for Deformable DETR's and mmcv's call
    and changes nothing.

    Bad input raises extops.ExtopsValueError or ExtopsTypeError naming the argument, also a
    level table that does not match value (extops/errors.py).
    """
    if torch.jit.is_scripting():
        if spatial_shapes.dtype == torch.int32:
            spatial_shapes = spatial_shapes.long()
        if level_start_index.dtype == torch.int32:
            level_start_index = level_start_index.long()
        return torch.ops.extops.ms_deform_attn(value, spatial_shapes, level_start_index,
                                               sampling_locations, attention_weights)
    return errors.call(_ms_deform_attn_eager, value, spatial_shapes, level_start_index,
                       sampling_locations, attention_weights, im2col_step)


torch.fx.wrap("ms_deform_attn")


def _ms_deform_attn_eager(value, spatial_shapes, level_start_index, sampling_locations,
                          attention_weights, im2col_step):
    tensors = (value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    for name, t in zip(_NAMES, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ms_deform_attn: `{name}` must be a tensor, got {type(t).__name__}")
    if im2col_step is not None and (not isinstance(im2col_step, (int, torch.SymInt))
                                    or isinstance(im2col_step, bool)):
        raise TypeError(f"ms_deform_attn: `im2col_step` must be an int or None, got "
                        f"{type(im2col_step).__name__}")
    check_dense("ms_deform_attn", tuple(zip(_NAMES, tensors)))
    check_reverse_mode_only("ms_deform_attn", (value, sampling_locations, attention_weights))
    return torch.ops.extops.ms_deform_attn(value, _int64_table("spatial_shapes", spatial_shapes),
                                           _int64_table("level_start_index", level_start_index),
                                           sampling_locations, attention_weights)


def _int64_table(name, t):
    """A level table as the op takes it: int64 as it is, int32 converted (a few numbers per
    level), any other dtype refused here, where int32 is still a valid answer to name."""
    if t.dtype == torch.int32:
        return t.long()
    if t.dtype != torch.int64:  # a plain `if`: traced, the dtype is known and the branch folds
        raise TypeError(f"ms_deform_attn: `{name}` must be a torch.int64 or torch.int32 tensor, "
                        f"got {t.dtype}")
    return t


# ----------------------------------------------------------------------------------------------
# The module


class MSDeformAttn(nn.Module):
    """Deformable DETR's multi-scale deformable attention layer, on extops.ms_deform_attn.

    forward(query [N, Lq, d_model], reference_points [N, Lq, L, 2] ((x, y) in [0, 1]) or
    [N, Lq, L, 4] (boxes: centre x, y, width, height), input_flatten [N, S, d_model],
    input_spatial_shapes [L, 2], input_level_start_index [L], input_padding_mask [N, S] or None
    (True where a row is padding)) -> [N, Lq, d_model].

    Each head predicts n_points offsets per level from the query (`sampling_offsets`) and their
    softmaxed weights (`attention_weights`), reads value (`value_proj` of the input) there, and
    `output_proj` mixes the heads. The parameter names, shapes and initialisation are Deformable
    DETR's (models/ops/modules/ms_deform_attn.py), so its checkpoints' encoder and decoder
    attention keys load as they are.
    """

    def __init__(self, d_model: int = 256, n_levels: int = 4, n_heads: int = 8,
                 n_points: int = 4):
        super().__init__()
        for name, v in (("d_model", d_model), ("n_levels", n_levels), ("n_heads", n_heads),
                        ("n_points", n_points)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise errors.ExtopsTypeError(f"MSDeformAttn: `{name}` must be an int, got "
                                             f"{type(v).__name__}")
            if v < 1:
                raise errors.ExtopsValueError(f"MSDeformAttn: `{name}` must be positive, got {v}")
        if d_model % n_heads:
            raise errors.ExtopsValueError(f"MSDeformAttn: `d_model` ({d_model}) must be a "
                                          f"multiple of `n_heads` ({n_heads})")
        self.d_model, self.n_levels, self.n_heads, self.n_points = (d_model, n_levels, n_heads,
                                                                    n_points)
        # Deformable DETR's layer carries im2col_step (the batch its CUDA kernel takes at once)
        # and code that builds or tunes the layer sets it; here it is kept and changes nothing.
        self.im2col_step = 64
        samples = n_heads * n_levels * n_points
        self.sampling_offsets = nn.Linear(d_model, samples * 2)
        self.attention_weights = nn.Linear(d_model, samples)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # The paper's start: zero offset weights, and offset biases that put head h's points on
        # a ray at angle 2 pi h / M, k pixels out for point k; uniform attention.
        nn.init.constant_(self.sampling_offsets.weight, 0.0)
        angles = torch.arange(self.n_heads, dtype=torch.float32) * (2.0 * math.pi / self.n_heads)
        grid = torch.stack([angles.cos(), angles.sin()], -1)
        grid = grid / grid.abs().max(-1, keepdim=True)[0]
        grid = grid.view(self.n_heads, 1, 1, 2).repeat(1, self.n_levels, self.n_points, 1)
        grid = grid * torch.arange(1, self.n_points + 1, dtype=torch.float32).view(1, 1, -1, 1)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(grid.reshape(-1))
        nn.init.constant_(self.attention_weights.weight, 0.0)
        nn.init.constant_(self.attention_weights.bias, 0.0)
        nn.init.xavier_uniform_(self.value_proj.weight)
        nn.init.constant_(self.value_proj.bias, 0.0)
        nn.init.xavier_uniform_(self.output_proj.weight)
        nn.init.constant_(self.output_proj.bias, 0.0)

    def _reset_parameters(self) -> None:
        """reset_parameters under Deformable DETR's name: its transformer calls it on each layer."""
        self.reset_parameters()

    def forward(self, query: Tensor, reference_points: Tensor, input_flatten: Tensor,
                input_spatial_shapes: Tensor, input_level_start_index: Tensor,
                input_padding_mask: Tensor | None = None) -> Tensor:
        n, queries, _ = query.shape
        _, values, _ = input_flatten.shape
        heads, levels, points = self.n_heads, self.n_levels, self.n_points
        value = self.value_proj(input_flatten)
        if input_padding_mask is not None:
            value = value.masked_fill(input_padding_mask[..., None], 0.0)
        # value_proj's width, split by the heads: d_model here, another in a subclass (mmcv's
        # value_proj_ratio). Not -1: a batch of 0 would leave it undetermined.
        value = value.view(n, values, heads, self.value_proj.out_features // heads)
        offsets = self.sampling_offsets(query).view(n, queries, heads, levels, points, 2)
        weights = self.attention_weights(query).view(n, queries, heads, levels * points)
        weights = weights.softmax(-1).view(n, queries, heads, levels, points)
        if reference_points.shape[-1] == 2:
            # Offsets are in pixels of each level: divided by (W, H) into the level's [0, 1].
            normalizer = torch.stack([input_spatial_shapes[..., 1], input_spatial_shapes[..., 0]],
                                     -1).to(offsets.dtype)
            locations = (reference_points[:, :, None, :, None, :]
                         + offsets / normalizer[None, None, None, :, None, :])
        elif reference_points.shape[-1] == 4:
            # Boxes: offsets in units of half the box, per point.
            locations = (reference_points[:, :, None, :, None, :2]
                         + offsets / points * reference_points[:, :, None, :, None, 2:] * 0.5)
        else:
            raise errors.ExtopsValueError(
                f"MSDeformAttn: `reference_points` must end in 2 ((x, y)) or 4 ((x, y, w, h)) "
                f"values, got sizes {list(reference_points.shape)}")
        out = ms_deform_attn(value, input_spatial_shapes, input_level_start_index, locations,
                             weights)
        return self.output_proj(out)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_levels={self.n_levels}, n_heads={self.n_heads}, "
                f"n_points={self.n_points}")


__all__ = ["MSDeformAttn", "ms_deform_attn"]
