"""extops.deform_conv2d: deformable convolution (DCNv1, and DCNv2 with a mask) as a library op.

    out = deform_conv2d(input, offset, weight, bias, stride=1, padding=0, dilation=1, mask=None)
    layer = DeformConv2d(64, 64, 3, padding=1)       # forward(input, offset, mask=None)
    block = DCNv2(64, 64, 3, padding=1)              # predicts its own offsets and mask

Semantics and arguments are torchvision.ops.deform_conv2d's. The C++ library (loaded by the
package's __init__ before this module is imported) defines torch.ops.extops.deform_conv2d and
.deform_conv2d_backward (schemas: csrc/deform_conv2d/deform_conv2d.cpp) and their CPU kernels.
What torch needs besides is registered here:

* a fake kernel per op: shapes, dtype and device from the inputs alone, for torch.compile and
  meta tensors. It runs the checks of workbook/deform_conv2d.h in the same order, with
  the same messages and exception types, so a bad input fails alike in eager mode, on meta
  tensors and while tracing: edit the two together;
* the autograd formula of deform_conv2d: save what the wanted gradients read, call the backward
  op for exactly those. The backward op has no derivative; differentiating it raises.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from . import errors
from .errors import check_dense, check_dim, check_inputs, check_reverse_mode_only, check_size

_INT64_MAX = 2**63 - 1
_OUT_H_WHY = ("out_h of the convolution: (height + 2 * padding - dilation * (kernel_h - 1) - 1) "
              "/ stride + 1")
_OUT_W_WHY = ("out_w of the convolution: (width + 2 * padding - dilation * (kernel_w - 1) - 1) "
              "/ stride + 1")

# ----------------------------------------------------------------------------------------------
# Checks: workbook/deform_conv2d.h, line for line, on extops/errors.py's (workbook/checks.h's).


def _fits_int64(size) -> bool:
    # A symbolic size (torch.export or torch.compile with a dynamic dimension) is checked by the
    # kernel when it runs on a real one; as a guard here it would only narrow the exported range
    # (torch.export refuses a Dim("batch") whose range the guard does not cover).
    return isinstance(size, torch.SymInt) or size <= _INT64_MAX


def _check_int_pair(op, name, values, minimum, must_be):
    torch._check_value(len(values) == 2,
                       lambda: f"{op}: `{name}` must have 2 values (height, width), got "
                               f"{len(values)}: {list(values)}")
    torch._check_value(values[0] >= minimum and values[1] >= minimum,
                       lambda: f"{op}: `{name}` must be {must_be}, got {list(values)}")


def _output_size(op, dim, k_name, size, kernel, padding, dilation, index, stride):
    pad, dil = padding[index], dilation[index]
    padded, extent = size + 2 * pad, dil * (kernel - 1) + 1
    torch._check_value(_fits_int64(padded),
                       lambda: f"{op}: `padding` {list(padding)} is too large: {dim} + 2 * padding "
                               f"overflows a 64-bit integer ({dim} {size})")
    torch._check_value(_fits_int64(extent),
                       lambda: f"{op}: `dilation` {list(dilation)} is too large: dilation * "
                               f"({k_name} - 1) + 1 overflows a 64-bit integer ({k_name} {kernel})")
    torch._check_value(padded >= extent,
                       lambda: f"{op}: the kernel spans {extent} along the {dim} (`dilation` {dil} "
                               f"* ({k_name} - 1) + 1) but the padded `input` has {padded} ({dim} "
                               f"{size} + 2 * `padding` {pad}): no output position")
    return (padded - extent) // stride + 1


def _check_common(op, grad_output, input, offset, weight, bias, stride, padding, dilation, mask):
    """The checks of both ops; returns (groups, offset_groups, out_h, out_w)."""
    named = [("grad_output", grad_output)] if grad_output is not None else []
    named += [("input", input), ("offset", offset), ("weight", weight)]
    named += [("bias", bias)] if bias is not None else []
    named += [("mask", mask)] if mask is not None else []
    check_inputs(op, named)

    if grad_output is not None:
        check_dim(op, "grad_output", grad_output, 4, "(batch, out_channels, out_h, out_w)")
    check_dim(op, "input", input, 4, "(batch, in_channels, height, width)")
    check_dim(op, "offset", offset, 4,
               "(batch, 2 * offset_groups * kernel_h * kernel_w, out_h, out_w)")
    check_dim(op, "weight", weight, 4, "(out_channels, in_channels / groups, kernel_h, kernel_w)")
    if bias is not None:
        check_dim(op, "bias", bias, 1, "(out_channels)")
    if mask is not None:
        check_dim(op, "mask", mask, 4,
                   "(batch, offset_groups * kernel_h * kernel_w, out_h, out_w)")

    _check_int_pair(op, "stride", stride, 1, "positive")
    _check_int_pair(op, "padding", padding, 0, "non-negative")
    _check_int_pair(op, "dilation", dilation, 1, "positive")

    batch, in_channels, height, width = input.shape
    out_channels, per_group, kernel_h, kernel_w = weight.shape
    torch._check_value(in_channels >= 1,
                       lambda: f"{op}: `input` must have at least 1 channel (dimension 1), got "
                               f"sizes {list(input.shape)}")
    torch._check_value(per_group >= 1,
                       lambda: f"{op}: `weight` must have at least 1 input channel per group "
                               f"(dimension 1), got sizes {list(weight.shape)}")
    torch._check_value(in_channels % per_group == 0,
                       lambda: f"{op}: `weight` has {per_group} input channels per group "
                               f"(dimension 1), which must divide the {in_channels} channels of "
                               f"`input`, got sizes {list(weight.shape)}")
    groups = in_channels // per_group
    torch._check_value(out_channels % groups == 0,
                       lambda: f"{op}: `weight` must have a multiple of groups = {groups} output "
                               f"channels (dimension 0; groups = input channels / weight.size(1)), "
                               f"got sizes {list(weight.shape)}")
    torch._check_value(kernel_h >= 1 and kernel_w >= 1,
                       lambda: f"{op}: `weight` must have a kernel of at least 1 x 1 (dimensions 2 "
                               f"and 3), got sizes {list(weight.shape)}")
    taps = kernel_h * kernel_w
    torch._check_value(_fits_int64(taps),
                       lambda: f"{op}: `weight` must have at most 2^63 - 1 kernel taps (kernel_h * "
                               f"kernel_w), got sizes {list(weight.shape)}")

    check_size(op, "offset", offset, 0, batch, "batch size of `input`")
    offset_channels = offset.shape[1]
    torch._check_value(offset_channels > 0 and offset_channels % (2 * taps) == 0,
                       lambda: f"{op}: `offset` must have a positive multiple of 2 * kernel_h * "
                               f"kernel_w = 2 * {kernel_h} * {kernel_w} channels (dimension 1: a "
                               f"(dy, dx) pair per kernel tap and offset group), got sizes "
                               f"{list(offset.shape)}")
    offset_groups = offset_channels // (2 * taps)
    torch._check_value(in_channels % offset_groups == 0,
                       lambda: f"{op}: `offset` has {offset_groups} offset groups (channels / (2 * "
                               f"kernel_h * kernel_w)), which must divide the {in_channels} "
                               f"channels of `input`, got sizes {list(offset.shape)}")

    out_h = _output_size(op, "height", "kernel_h", height, kernel_h, padding, dilation, 0,
                         stride[0])
    out_w = _output_size(op, "width", "kernel_w", width, kernel_w, padding, dilation, 1,
                         stride[1])
    check_size(op, "offset", offset, 2, out_h, _OUT_H_WHY)
    check_size(op, "offset", offset, 3, out_w, _OUT_W_WHY)
    if mask is not None:
        check_size(op, "mask", mask, 0, batch, "batch size of `input`")
        check_size(op, "mask", mask, 1, offset_groups * taps,
                    "offset_groups * kernel_h * kernel_w, from `offset` and `weight`")
        check_size(op, "mask", mask, 2, out_h, _OUT_H_WHY)
        check_size(op, "mask", mask, 3, out_w, _OUT_W_WHY)
    if bias is not None:
        check_size(op, "bias", bias, 0, out_channels, "out_channels of `weight`")

    torch._check_value(_fits_int64(batch * out_channels * out_h * out_w),
                       lambda: f"{op}: the output [{batch}, {out_channels}, {out_h}, {out_w}] "
                               f"would have more than 2^63 - 1 elements")
    torch._check_value(_fits_int64(in_channels * taps * out_h * out_w),
                       lambda: f"{op}: the sampled columns of one image [{in_channels} * "
                               f"{kernel_h} * {kernel_w}, {out_h} * {out_w}] would have more than "
                               f"2^63 - 1 elements")
    if grad_output is not None:
        expected = [batch, out_channels, out_h, out_w]
        torch._check_value(list(grad_output.shape) == expected,
                           lambda: f"{op}: `grad_output` must have sizes {expected} (batch, "
                                   f"out_channels, out_h, out_w of the forward), got sizes "
                                   f"{list(grad_output.shape)}")
    return groups, offset_groups, out_h, out_w


# ----------------------------------------------------------------------------------------------
# Fake kernels: what the CPU kernels return, from shapes alone (contiguous, the input's dtype).


@torch.library.register_fake("extops::deform_conv2d")
def _deform_conv2d_fake(input, offset, weight, bias=None, stride=(1, 1), padding=(0, 0),
                        dilation=(1, 1), mask=None):
    _, _, out_h, out_w = _check_common("deform_conv2d", None, input, offset, weight, bias, stride,
                                       padding, dilation, mask)
    return input.new_empty((input.shape[0], weight.shape[0], out_h, out_w))


@torch.library.register_fake("extops::deform_conv2d_backward")
def _deform_conv2d_backward_fake(grad_output, input, offset, weight, mask, stride, padding,
                                 dilation, output_mask, deterministic):
    # `bool[5]` reaches the C++ kernel as std::array<bool, 5>; the dispatcher refuses another
    # length with this message before the kernel runs.
    torch._check(len(output_mask) == 5,
                 lambda: f"Tried to convert a List with {len(output_mask)} elements to a "
                         f"fixed-size array of size 5")
    _check_common("deform_conv2d_backward", grad_output, input, offset, weight, None, stride,
                  padding, dilation, mask)
    want_input, want_offset, want_weight, want_bias, want_mask = output_mask
    want_mask = want_mask and mask is not None

    def result(wanted, shape):
        return input.new_empty(shape if wanted else (0,))

    return (result(want_input, input.shape), result(want_offset, offset.shape),
            result(want_weight, weight.shape), result(want_bias, (weight.shape[0],)),
            result(want_mask, mask.shape if mask is not None else (0,)))


# ----------------------------------------------------------------------------------------------
# Autograd


def _setup_context(ctx, inputs, output):
    input, offset, weight, bias, stride, padding, dilation, mask = inputs
    # The dispatcher drops trailing arguments left at their defaults (mask=None, dilation=1)
    # before autograd sees them, so needs_input_grad can be shorter than the 8 arguments: a
    # dropped one is a default, which needs no gradient. Backward returns all 8 (torch accepts
    # one gradient per argument of the schema).
    needs = tuple(ctx.needs_input_grad) + (False,) * (8 - len(ctx.needs_input_grad))
    ctx.output_mask = (needs[0], needs[1], needs[2], needs[3] and bias is not None,
                       needs[7] and mask is not None)
    want_input, want_offset, want_weight, _, want_mask = ctx.output_mask
    # What each gradient reads: grad_input the weight and the sampling (offset, mask);
    # grad_weight the input and the sampling; grad_offset and grad_mask all of them; grad_bias
    # only grad_output. An unsaved tensor is replaced by a stand-in of its shape in backward.
    samples = want_input or want_offset or want_weight or want_mask
    reads_input = want_weight or want_offset or want_mask
    reads_weight = want_input or want_offset or want_mask
    ctx.save_for_backward(input if reads_input else None, offset if samples else None,
                          weight if reads_weight else None, mask if samples else None)
    ctx.shapes = (input.shape, offset.shape, weight.shape)
    ctx.has_mask = mask is not None
    ctx.geometry = (stride, padding, dilation)


def _stand_in(like, shape):
    # Right shape, dtype and device, one element of storage: the backward op reads only its size.
    return like.new_zeros(()).expand(shape)


def _backward(ctx, grad_output):
    input, offset, weight, mask = ctx.saved_tensors
    input_shape, offset_shape, weight_shape = ctx.shapes
    input = _stand_in(grad_output, input_shape) if input is None else input
    offset = _stand_in(grad_output, offset_shape) if offset is None else offset
    weight = _stand_in(grad_output, weight_shape) if weight is None else weight
    if mask is None and ctx.has_mask:  # saved as None: nothing reads it, only its presence counts
        mask = _stand_in(grad_output, (offset_shape[0], offset_shape[1] // 2, *offset_shape[2:]))
    grads = torch.ops.extops.deform_conv2d_backward(grad_output, input, offset, weight, mask,
                                                     *ctx.geometry, list(ctx.output_mask),
                                                     torch.are_deterministic_algorithms_enabled())
    grad_input, grad_offset, grad_weight, grad_bias, grad_mask = (
        g if wanted else None for g, wanted in zip(grads, ctx.output_mask))
    # In the order of the forward's arguments: input, offset, weight, bias, stride, padding,
    # dilation, mask.
    return grad_input, grad_offset, grad_weight, grad_bias, None, None, None, grad_mask


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "deform_conv2d: double backward is not supported (the deform_conv2d_backward op has no "
        "derivative); for second derivatives use a plain PyTorch deformable convolution")


torch.library.register_autograd("extops::deform_conv2d", _backward, setup_context=_setup_context)
torch.library.register_autograd("extops::deform_conv2d_backward", _no_double_backward)


# ----------------------------------------------------------------------------------------------
# The functional form


def _is_int(value) -> bool:
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def _int_pair(owner: str, name: str, value) -> tuple:
    """An int or a pair of ints as a pair, refused with a TypeError / ValueError naming `name`."""
    if _is_int(value):
        items = (value, value)
    elif isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{owner}: `{name}` must be an int or a pair of ints, got "
                             f"{len(value)} values: {list(value)}")
        items = tuple(value)
    else:
        raise TypeError(f"{owner}: `{name}` must be an int or a pair of ints, got "
                        f"{type(value).__name__}")
    for item in items:
        if not _is_int(item):
            raise TypeError(f"{owner}: `{name}` must be an int or a pair of ints, got {value!r} "
                            f"(an element of type {type(item).__name__})")
        if isinstance(item, int) and not -(2**63) <= item <= _INT64_MAX:
            raise ValueError(f"{owner}: `{name}` must fit in a 64-bit integer, got {item}")
    return items


_Pair = int | tuple[int, int] | list[int]


def deform_conv2d(input: Tensor, offset: Tensor, weight: Tensor, bias: Tensor | None = None,
                  stride: _Pair = 1, padding: _Pair = 0, dilation: _Pair = 1,
                  mask: Tensor | None = None) -> Tensor:
    """Deformable convolution: torchvision.ops.deform_conv2d's arguments and results.

    input [N, C, H, W]; offset [N, 2 G kh kw, Ho, Wo] with (dy, dx) of offset group g, tap
    (i, j) at channels 2 (g kh kw + i kw + j) + 0, 1; weight [O, C / groups, kh, kw]; bias [O] or
    None; stride, padding, dilation an int or a pair; mask [N, G kh kw, Ho, Wo] or None (DCNv1).
    float64, float32, float16 or bfloat16 (half and bfloat16 compute in float); dense tensors;
    differentiable (reverse mode) in input, offset, weight, bias and mask. Inside a torch.autocast
    region the inputs are cast to the region's dtype (csrc/deform_conv2d/autocast/). Forward-mode
    AD and torch.func's gradient transforms are refused (errors.check_reverse_mode_only).

    Bad input raises extops.ExtopsValueError or ExtopsTypeError, which `except RuntimeError`
    catches too (extops/errors.py). Under torch.jit.script it calls the op directly, whose C++
    checks name the argument alike.
    """
    if torch.jit.is_scripting():
        return torch.ops.extops.deform_conv2d(input, offset, weight, bias, _script_pair(stride),
                                              _script_pair(padding), _script_pair(dilation), mask)
    return errors.call(_deform_conv2d_eager, input, offset, weight, bias, stride, padding,
                       dilation, mask)


# torch.fx.symbolic_trace records a call of deform_conv2d from this module's code (the modules'
# forward) as one node instead of tracing into its checks, which a Proxy cannot pass.
torch.fx.wrap("deform_conv2d")


def _script_pair(value: _Pair) -> list[int]:
    # TorchScript only: the op's `int[2]` as a list (its C++ checks refuse another length).
    if isinstance(value, int):
        return [value, value]
    if isinstance(value, tuple):
        return [value[0], value[1]]
    return value


def _deform_conv2d_eager(input, offset, weight, bias, stride, padding, dilation, mask):
    for name, value in (("input", input), ("offset", offset), ("weight", weight)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"deform_conv2d: `{name}` must be a tensor, got {type(value).__name__}")
    for name, value in (("bias", bias), ("mask", mask)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"deform_conv2d: `{name}` must be a tensor or None, got "
                            f"{type(value).__name__}")
    check_dense("deform_conv2d", (("input", input), ("offset", offset), ("weight", weight),
                                  ("bias", bias), ("mask", mask)))
    check_reverse_mode_only("deform_conv2d", (input, offset, weight, bias, mask))
    stride = _int_pair("deform_conv2d", "stride", stride)
    padding = _int_pair("deform_conv2d", "padding", padding)
    dilation = _int_pair("deform_conv2d", "dilation", dilation)
    return torch.ops.extops.deform_conv2d(input, offset, weight, bias, stride, padding, dilation,
                                          mask)


# ----------------------------------------------------------------------------------------------
# Modules


def _check_module_args(owner, in_channels, out_channels, kernel_size, stride, padding, dilation,
                       groups, bias, offset_groups=1):
    """Validated (kernel_size, stride, padding, dilation) pairs; raises naming the argument."""
    for name, value in (("in_channels", in_channels), ("out_channels", out_channels),
                        ("groups", groups), ("offset_groups", offset_groups)):
        if not _is_int(value):
            raise TypeError(f"{owner}: `{name}` must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{owner}: `{name}` must be positive, got {value}")
    pairs = {}
    for name, value, minimum in (("kernel_size", kernel_size, 1), ("stride", stride, 1),
                                 ("padding", padding, 0), ("dilation", dilation, 1)):
        pairs[name] = _int_pair(owner, name, value)
        if min(pairs[name]) < minimum:
            raise ValueError(f"{owner}: `{name}` must be "
                             f"{'non-negative' if minimum == 0 else 'positive'}, got {value}")
    if in_channels % groups or out_channels % groups:
        raise ValueError(f"{owner}: `groups` ({groups}) must divide in_channels ({in_channels}) "
                         f"and out_channels ({out_channels})")
    if in_channels % offset_groups:
        raise ValueError(f"{owner}: `offset_groups` ({offset_groups}) must divide in_channels "
                         f"({in_channels})")
    if not isinstance(bias, bool):
        raise TypeError(f"{owner}: `bias` must be a bool, got {type(bias).__name__}")
    return pairs["kernel_size"], pairs["stride"], pairs["padding"], pairs["dilation"]


def _reset_conv_parameters(weight, bias) -> None:
    # nn.Conv2d's init, which torchvision's DeformConv2d uses too.
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in, _ = nn.init._calculate_fan_in_and_fan_out(weight)
        bound = 1 / math.sqrt(fan_in)
        nn.init.uniform_(bias, -bound, bound)


def _conv_repr(m, extra="") -> str:
    text = f"{m.in_channels}, {m.out_channels}, kernel_size={m.kernel_size}, stride={m.stride}"
    text += f", padding={m.padding}" if m.padding != (0, 0) else ""
    text += f", dilation={m.dilation}" if m.dilation != (1, 1) else ""
    text += f", groups={m.groups}" if m.groups != 1 else ""
    return text + extra + (", bias=False" if m.bias is None else "")


class DeformConv2d(nn.Module):
    """A deformable convolution layer: torchvision.ops.DeformConv2d's arguments and init.

    forward(input, offset, mask=None): the offsets (and the mask) come from the caller. Its
    parameters are torchvision's (`weight`, `bias`), so a torchvision.ops.DeformConv2d state dict
    loads as it is; torch.jit.script takes the module.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True):
        super().__init__()
        self.kernel_size, self.stride, self.padding, self.dilation = errors.call(
            _check_module_args, type(self).__name__, in_channels, out_channels, kernel_size,
            stride, padding, dilation, groups, bias)
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups,
                                               *self.kernel_size))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_conv_parameters(self.weight, self.bias)

    def forward(self, input: Tensor, offset: Tensor, mask: Tensor | None = None) -> Tensor:
        return deform_conv2d(input, offset, self.weight, self.bias, self.stride, self.padding,
                             self.dilation, mask)

    def extra_repr(self) -> str:
        return _conv_repr(self)


class DCNv2(nn.Module):
    """A modulated deformable convolution block (DCNv2) that predicts its own offsets and mask.

    forward(input). A plain nn.Conv2d of the same kernel, stride, padding and dilation reads the
    input and gives 3 offset_groups kh kw channels per position: a (dy, dx) pair and a mask logit
    per tap and offset group; the mask is 2 sigmoid(logit). That conv starts at zero, so a fresh
    block has offsets 0 and mask 1: it computes the plain convolution with its weight and bias,
    and can replace an nn.Conv2d of a pretrained backbone (copy the conv's weight and bias in)
    without changing its output until the offsets learn something. Not a DeformConv2d subclass:
    its forward takes no offsets.

    mmcv checkpoints: mmcv's ModulatedDeformConv2dPack is the same block (its `conv_offset` is
    this `offset_mask`, with the same channels: the (dy, dx) pairs, then the mask logits) with the
    mask sigmoid(logit). DCNv2(..., mask_activation="sigmoid") computes mmcv's outputs and loads
    its state dict as it is (`conv_offset.*` is read as `offset_mask.*`); loading those keys into
    a block with the default "2sigmoid" is refused, since it would compute something else. One
    difference remains in the gradients: mmcv gives no offset gradient to a sample exactly at -1
    or at H (or W), which a zero-offset start with padding 1 hits at the border; torchvision and
    extops take the one-sided derivative there.
    """

    MASK_ACTIVATIONS = ("2sigmoid", "sigmoid")

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, offset_groups=1, bias=True, mask_activation="2sigmoid"):
        super().__init__()
        self.kernel_size, self.stride, self.padding, self.dilation = errors.call(
            _check_module_args, type(self).__name__, in_channels, out_channels, kernel_size,
            stride, padding, dilation, groups, bias, offset_groups)
        if not isinstance(mask_activation, str):
            raise errors.ExtopsTypeError(f"DCNv2: `mask_activation` must be a str, \"2sigmoid\" "
                                         f"or \"sigmoid\", got {type(mask_activation).__name__}")
        if mask_activation not in self.MASK_ACTIVATIONS:
            raise errors.ExtopsValueError(
                f"DCNv2: `mask_activation` must be \"2sigmoid\" (extops' own: a fresh block is "
                f"the plain convolution) or \"sigmoid\" (mmcv's ModulatedDeformConv2dPack), got "
                f"{mask_activation!r}")
        self.mask_activation = mask_activation
        self.in_channels, self.out_channels = in_channels, out_channels
        self.groups, self.offset_groups = groups, offset_groups
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups,
                                               *self.kernel_size))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.offset_mask = nn.Conv2d(in_channels, 3 * self._taps(), self.kernel_size, self.stride,
                                     self.padding, self.dilation, bias=True)
        self.reset_parameters()

    def _taps(self) -> int:
        return self.offset_groups * self.kernel_size[0] * self.kernel_size[1]

    def reset_parameters(self) -> None:
        _reset_conv_parameters(self.weight, self.bias)
        nn.init.zeros_(self.offset_mask.weight)
        nn.init.zeros_(self.offset_mask.bias)

    def forward(self, input: Tensor) -> Tensor:
        taps = self._taps()
        offset_and_logits = self.offset_mask(input).split([2 * taps, taps], dim=1)
        offset, logits = offset_and_logits[0], offset_and_logits[1]
        # A copy, not the split's view: autograd saves the offsets, and under torch.compile
        # (dynamic shapes, batch 1, a conv after this block) Inductor fails to order the strides
        # of a saved view of a channels-last conv output (torch 2.14). The copy is 2 G kh kw
        # values per position, against C kh kw for the op's columns.
        offset = offset.clone(memory_format=torch.contiguous_format)
        mask = torch.sigmoid(logits)
        if self.mask_activation == "2sigmoid":
            mask = 2 * mask
        return deform_conv2d(input, offset, self.weight, self.bias, self.stride, self.padding,
                             self.dilation, mask)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # mmcv's ModulatedDeformConv2dPack names the offset-and-mask convolution `conv_offset`.
        mmcv = [k for k in state_dict if k.startswith(f"{prefix}conv_offset.")]
        if mmcv and self.mask_activation != "sigmoid":
            error_msgs.append(
                f"DCNv2 `{prefix or '(root)'}`: the state dict has mmcv's keys "
                f"({', '.join(mmcv)}): mmcv's ModulatedDeformConv2dPack computes its mask as "
                f"sigmoid(logit), this block as 2 sigmoid(logit); build it with "
                f"mask_activation=\"sigmoid\" to load them")
        for key in mmcv:
            state_dict[f"{prefix}offset_mask." + key[len(f"{prefix}conv_offset."):]] = \
                state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        extra = f", offset_groups={self.offset_groups}" if self.offset_groups != 1 else ""
        extra += (f", mask_activation={self.mask_activation!r}"
                  if self.mask_activation != "2sigmoid" else "")
        return _conv_repr(self, extra)


__all__ = ["DCNv2", "DeformConv2d", "deform_conv2d"]
