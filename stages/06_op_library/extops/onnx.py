"""ONNX export of models that hold extops' deformable convolutions (ONNX's DeformConv, opset 19)
and, in the libraries of stages 09 and 10, multi-scale deformable attention (GridSample).

    extops.onnx.export(model, (x,), "model.onnx")              # dynamic batch by default
    torch.onnx.export(model, (x,), "model.onnx", dynamo=True, opset_version=19,
                      custom_translation_table=extops.onnx.translation_table())

torch.onnx's exporter (dynamo=True: torch.export, then onnxscript) knows torchvision's
deform_conv2d but not extops': the table maps torch.ops.extops.deform_conv2d to one ONNX
DeformConv node. The semantics agree (ONNX's DeformConv is torchvision's: offsets (dy, dx) per
tap and offset group, bilinear sampling with zeros outside the image, the mask multiplying each
sample), so ONNX Runtime computes eager's outputs to float32 rounding. Groups and offset groups
come from the channel counts, which must therefore be static; the batch and the image size may
be dynamic.

Multi-scale deformable attention (extops::ms_deform_attn, where the library has it) has no ONNX
operator: the table maps it to standard ops, one GridSample per level (opset 16 and later) and a
weighted sum, as transformers' and mmcv's PyTorch versions compute it. No custom domain, so any
runtime with GridSample runs it (stage 10's tests run it in ONNX Runtime). The levels' sizes are
read from the level tables when the model runs (the tables may be the graph's inputs); the
number of levels and points, the heads and the channels must be static.

What does not export: ONNX has no backward (an exported model is for inference; train in
PyTorch), and the LLTM ops (extops.lltm, extops.LLTM) have no translation: exporting them is
refused, naming the op. Needs the `onnx` and `onnxscript` packages (and onnxruntime to run the
result); they are imported when a function here is called, not with extops.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import ExtopsValueError

OPSET = 19  # the first opset with DeformConv


def _static(value, what: str, op: str = "deform_conv2d") -> int:
    if not isinstance(value, int):
        raise ExtopsValueError(f"extops.onnx: {op} needs a static {what} to build its ONNX "
                               f"graph, got a dynamic size ({value})")
    return value


def _deform_conv2d(input, offset, weight, bias=None, stride=(1, 1), padding=(0, 0),
                   dilation=(1, 1), mask=None):
    """extops::deform_conv2d as ONNX DeformConv (onnxscript, traced: the arguments are ONNX
    values whose shapes are known from the exported program)."""
    from onnxscript import opset19 as op

    channels = _static(input.shape[1], "number of input channels (input dimension 1)")
    per_group = _static(weight.shape[1], "weight dimension 1")
    kernel_h = _static(weight.shape[2], "kernel height (weight dimension 2)")
    kernel_w = _static(weight.shape[3], "kernel width (weight dimension 3)")
    offset_channels = _static(offset.shape[1], "number of offset channels (offset dimension 1)")
    return op.DeformConv(input, weight, offset, bias, mask,
                         dilations=[int(dilation[0]), int(dilation[1])],
                         group=channels // per_group,
                         kernel_shape=[kernel_h, kernel_w],
                         offset_group=offset_channels // (2 * kernel_h * kernel_w),
                         pads=[int(padding[0]), int(padding[1]), int(padding[0]), int(padding[1])],
                         strides=[int(stride[0]), int(stride[1])])


def _ms_deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                    attention_weights):
    """extops::ms_deform_attn (stages 09 and 10) in standard ONNX: one GridSample per level
    (bilinear, zeros outside, align_corners=0: the op's sampling), as transformers' and mmcv's
    PyTorch versions compute it, then the weighted sum. Each level's height, width and first row
    are read from the level tables when the model runs; the number of levels, points and heads
    and the channels must be static. The batch and the queries may be dynamic."""
    from onnxscript import opset19 as op

    heads = _static(value.shape[2], "number of heads (value dimension 2)", "ms_deform_attn")
    channels = _static(value.shape[3], "channels per head (value dimension 3)", "ms_deform_attn")
    levels = _static(sampling_locations.shape[3], "number of levels (sampling_locations "
                                                  "dimension 3)", "ms_deform_attn")
    points = _static(sampling_locations.shape[4], "number of points (sampling_locations "
                                                  "dimension 4)", "ms_deform_attn")
    batch = op.Shape(value, start=0, end=1)
    queries = op.Shape(sampling_locations, start=1, end=2)
    ints = lambda *v: op.Constant(value_ints=list(v))  # noqa: E731
    # GridSample's grid is in [-1, 1]; the op's locations are in [0, 1].
    grids = op.Sub(op.Mul(sampling_locations, op.CastLike(2.0, sampling_locations)),
                   op.CastLike(1.0, sampling_locations))
    sampled = []
    for level in range(levels):
        height_width = op.Gather(spatial_shapes, op.Constant(value_int=level), axis=0)  # [2]
        start = op.Gather(level_start_index, ints(level), axis=0)  # [1]
        rows = op.Slice(value, start, op.Add(start, op.ReduceProd(height_width, keepdims=1)),
                        ints(1))  # [N, H W, M, D]
        image = op.Reshape(op.Transpose(rows, perm=[0, 2, 3, 1]),  # [N M, D, H, W]
                           op.Concat(ints(-1, channels), height_width, axis=0))
        grid = op.Transpose(op.Gather(grids, op.Constant(value_int=level), axis=3),
                            perm=[0, 2, 1, 3, 4])  # [N, M, Lq, P, 2]
        grid = op.Reshape(grid, op.Concat(ints(-1), queries, ints(points, 2), axis=0))
        sampled.append(op.GridSample(image, grid, mode="bilinear", padding_mode="zeros",
                                     align_corners=0))  # [N M, D, Lq, P]
    samples = op.Concat(*sampled, axis=3)  # [N M, D, Lq, L P], level-major as the weights
    weights = op.Transpose(attention_weights, perm=[0, 2, 1, 3, 4])  # [N, M, Lq, L, P]
    weights = op.Reshape(weights, op.Concat(ints(-1, 1), queries, ints(levels * points), axis=0))
    out = op.ReduceSum(op.Mul(samples, weights), ints(3), keepdims=0)  # [N M, D, Lq]
    out = op.Reshape(out, op.Concat(batch, ints(heads * channels), queries, axis=0))
    return op.Transpose(out, perm=[0, 2, 1])  # [N, Lq, M D]


class NoTranslation(NotImplementedError):
    """An extops op that has no ONNX translation (the LLTM's); a RuntimeError too."""


def _refuse(name: str):
    def refuse(*args, **kwargs):
        raise NoTranslation(
            f"extops.onnx: {name} has no ONNX translation (the LLTM cell is not exported); keep "
            f"it in PyTorch, or export the part of the model without it")
    return refuse


def _refusal_in(error: BaseException):
    """The NoTranslation behind what torch.onnx raised, if any (it wraps it in errors of its
    own, with the whole graph in the message)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, NoTranslation):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def translation_table() -> dict:
    """{extops op overload: its ONNX translation}, for torch.onnx.export(...,
    custom_translation_table=...). The LLTM ops map to a translation that refuses by name."""
    ops = torch.ops.extops
    table = {ops.deform_conv2d.default: _deform_conv2d,
             ops.lltm_forward.default: _refuse("extops.lltm_forward (extops.lltm, extops.LLTM)")}
    if hasattr(ops, "ms_deform_attn"):  # the libraries of stages 09 and 10
        table[ops.ms_deform_attn.default] = _ms_deform_attn
    return table


def _batch_dynamic_shapes(args: tuple):
    """Dimension 0 of every tensor argument as one dynamic `batch` dimension."""
    batch = torch.export.Dim("batch")
    return tuple({0: batch} if isinstance(a, torch.Tensor) else None for a in args)


def export(model: torch.nn.Module, args: tuple, path, *, dynamic_batch: bool = True,
           opset_version: int = OPSET, **kwargs):
    """Export `model` called on `args` to ONNX at `path`; returns torch.onnx's ONNXProgram.

    dynamic_batch: dimension 0 of every tensor in `args` is one dynamic batch dimension (pass
    `dynamic_shapes=` yourself for anything else). Other keyword arguments go to
    torch.onnx.export (input_names, output_names, ...). The model is exported in eval mode as it
    is; ONNX has no backward.
    """
    if opset_version < OPSET:
        raise ExtopsValueError(f"extops.onnx.export: `opset_version` must be {OPSET} or later "
                               f"(ONNX DeformConv), got {opset_version}")
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    if dynamic_batch and "dynamic_shapes" not in kwargs:
        kwargs["dynamic_shapes"] = _batch_dynamic_shapes(args)
    table = dict(translation_table(), **kwargs.pop("custom_translation_table", {}))
    try:
        program = torch.onnx.export(model, args, dynamo=True, opset_version=opset_version,
                                    custom_translation_table=table, **kwargs)
    except Exception as error:
        refusal = _refusal_in(error)
        if refusal is None:
            raise
        raise NoTranslation(str(refusal)) from error
    program.save(str(Path(path)))
    return program


__all__ = ["OPSET", "NoTranslation", "export", "translation_table"]
