"""Deformable convolution v2 (stages 06, 07): the descriptor.

    deform_conv2d(input [N, C, H, W], offset [N, 2 G kh kw, Ho, Wo], weight [O, C / groups, kh, kw],
                  bias [O] or None, stride=1, padding=0, dilation=1,
                  mask [N, G kh kw, Ho, Wo] or None) -> [N, O, Ho, Wo]

torchvision.ops.deform_conv2d's signature and semantics (G: offset groups). A sample passes the
four tensors positionally and stride, padding, dilation and mask by keyword, as callers do.
"""

from __future__ import annotations

import zlib

import torch

from workbook.ops.deform_conv2d import reference
from workbook.spec import BadInput, Case, OpSpec, Sample, other_device

ARG_NAMES = ("input", "offset", "weight", "bias")
KEYWORDS = ("stride", "padding", "dilation", "mask")


def _pair(case: Case, name: str, default: int) -> tuple[int, int]:
    return case.sizes.get(f"{name}_h", default), case.sizes.get(f"{name}_w", default)


def out_size(case: Case) -> tuple[int, int]:
    """(Ho, Wo) of the case: (size + 2 pad - dilation (k - 1) - 1) / stride + 1."""
    (sh, sw), (ph, pw), (dh, dw) = (_pair(case, n, d) for n, d in
                                    (("stride", 1), ("pad", 0), ("dilation", 1)))
    return ((case["height"] + 2 * ph - dh * (case["kernel_h"] - 1) - 1) // sh + 1,
            (case["width"] + 2 * pw - dw * (case["kernel_w"] - 1) - 1) // sw + 1)


def make(case: Case, *, device="cpu", dtype=torch.float32, requires_grad=True,
         seed=None) -> Sample:
    """Inputs uniform in +-1, weight scaled by 1/sqrt(fan-in), offsets in +-`offset_scale` pixels
    (default 2.5: near the border, samples land outside the image), mask uniform in [0, 1).
    Sizes: batch, in_channels, out_channels, groups, offset_groups, height, width, kernel_h/_w,
    stride_h/_w, pad_h/_w, dilation_h/_w; mask and bias (0 or 1).

    Each offset's fractional part is kept in [0.1, 0.9], so every sampling point lies at least
    0.1 px from a pixel row or column (the kernel's taps are whole pixels). The gradient of an
    offset jumps where its point crosses a row or column (the bilinear weights switch to the next
    pair of pixels); a float32 kernel rounds the point and may land on the other side of the line
    than the float64 reference, and over many points a few do (at N 4, C 64, 56 x 56, for every
    implementation alike, torchvision's included). Points exactly on the lines have tests of
    their own (test_integer_points_and_border_match_torchvision)."""
    s = case.sizes
    gen = torch.Generator().manual_seed(
        zlib.crc32(repr(sorted(s.items())).encode()) if seed is None else seed)
    n, c, o, g = s["batch"], s["in_channels"], s["out_channels"], s.get("groups", 1)
    taps = s["offset_groups"] * s["kernel_h"] * s["kernel_w"]
    out_h, out_w = out_size(case)
    scale = s.get("offset_scale", 2.5)

    def uniform(*shape, low=-1.0, high=1.0, between_pixels=False):
        t = torch.rand(shape, generator=gen, dtype=torch.float64) * (high - low) + low
        if between_pixels:
            t = t.floor() + 0.1 + 0.8 * (t - t.floor())
        return t.to(device=device, dtype=dtype).requires_grad_(requires_grad)

    fan_in = (c // g) * s["kernel_h"] * s["kernel_w"]
    bound = fan_in ** -0.5
    args = (uniform(n, c, s["height"], s["width"]),
            uniform(n, 2 * taps, out_h, out_w, low=-scale, high=scale, between_pixels=True),
            uniform(o, c // g, s["kernel_h"], s["kernel_w"], low=-bound, high=bound))
    kwargs = {"stride": _pair(case, "stride", 1), "padding": _pair(case, "pad", 0),
              "dilation": _pair(case, "dilation", 1)}
    # Without bias or mask the sample leaves them out, as callers do: the defaults are tested too.
    if s.get("bias", 1):
        args += (uniform(o, low=-bound, high=bound),)
    if s.get("mask", 1):
        kwargs["mask"] = uniform(n, taps, out_h, out_w, low=0.0)
    return Sample(case.name, args, kwargs, arg_names=ARG_NAMES)


# torchvision's own test configuration (test/test_ops.py, TestDeformConv): in 6, out 2, groups 2,
# offset groups 3, kernel 3 x 2, stride (2, 1), padding (1, 0), dilation (2, 1), input 5 x 4.
TORCHVISION = {"in_channels": 6, "out_channels": 2, "groups": 2, "offset_groups": 3,
               "height": 5, "width": 4, "kernel_h": 3, "kernel_w": 2, "stride_h": 2,
               "stride_w": 1, "pad_h": 1, "pad_w": 0, "dilation_h": 2, "dilation_w": 1}


def torchvision_case(name: str, batch: int, **changes: int) -> Case:
    return Case(name, {**TORCHVISION, "batch": batch, **changes}, full_gradcheck=batch <= 2)


def bad_inputs(device: str) -> list[BadInput]:
    """Inputs refused with a message naming the argument; the valid ones are torchvision's
    configuration at batch 2 on the device make() is given, with one argument replaced."""
    valid = torchvision_case("valid", 2)

    def good(**changes):
        def build(on):
            sample = make(valid, device=on, requires_grad=False)
            named = {**dict(zip(ARG_NAMES, sample.args)), **sample.kwargs}
            named.update({k: v(on) if callable(v) else v for k, v in changes.items()})
            return Sample("bad", tuple(named[k] for k in ARG_NAMES),
                          {k: named[k] for k in KEYWORDS}, arg_names=ARG_NAMES)
        return build

    def t(*shape, dtype=torch.float32, elsewhere=False):
        """A tensor maker: on make()'s device, or on another one when `elsewhere`."""
        return lambda on: torch.zeros(*shape, dtype=dtype,
                                      device=other_device(on) if elsewhere else on)

    # Valid shapes: input [2, 6, 5, 4], offset [2, 36, 2, 3], weight [2, 3, 3, 2], mask
    # [2, 18, 2, 3], bias [2]; groups 2, offset groups 3.
    op = r"deform_conv2d: "
    return [
        # Not tensors, not ints: refused in Python before the op is called.
        BadInput("input_not_a_tensor", good(input=lambda on: [[1.0]]), TypeError,
                 op + r"`input` must be a tensor, got list"),
        BadInput("mask_not_a_tensor", good(mask=1.0), TypeError,
                 op + r"`mask` must be a tensor or None, got float"),
        BadInput("stride_float", good(stride=1.5), TypeError, op + r"`stride` must be an int"),
        BadInput("padding_three_values", good(padding=(1, 0, 0)), ValueError,
                 op + r"`padding` must be an int or a pair of ints, got 3 values"),
        BadInput("dilation_past_int64", good(dilation=2**64), ValueError,
                 op + r"`dilation` must fit in a 64-bit integer"),
        # dtypes and devices
        BadInput("int64_input", good(input=t(2, 6, 5, 4, dtype=torch.int64)), TypeError,
                 op + r"`input` must be a float64, float32, float16 or bfloat16 tensor"),
        BadInput("float8_input", good(input=t(2, 6, 5, 4, dtype=torch.float8_e4m3fn)), TypeError,
                 op + r"`input` must be a float64, float32, float16 or bfloat16 tensor"),
        BadInput("float64_offset", good(offset=t(2, 36, 2, 3, dtype=torch.float64)), TypeError,
                 op + r"`offset` must have dtype"),
        BadInput("int64_bias", good(bias=t(2, dtype=torch.int64)), TypeError,
                 op + r"`bias` must have dtype"),
        BadInput("offset_on_another_device", good(offset=t(2, 36, 2, 3, elsewhere=True)),
                 RuntimeError,
                 op + r"`offset` must be on the same device as `input`"),
        BadInput("mask_on_another_device", good(mask=t(2, 18, 2, 3, elsewhere=True)),
                 RuntimeError,
                 op + r"`mask` must be on the same device as `input`"),
        # dimensions
        BadInput("input_3d", good(input=t(6, 5, 4)), ValueError,
                 op + r"`input` must have 4 dimensions"),
        BadInput("offset_3d", good(offset=t(36, 2, 3)), ValueError,
                 op + r"`offset` must have 4 dimensions"),
        BadInput("weight_5d", good(weight=t(2, 3, 3, 2, 1)), ValueError,
                 op + r"`weight` must have 4 dimensions"),
        BadInput("mask_3d", good(mask=t(18, 2, 3)), ValueError,
                 op + r"`mask` must have 4 dimensions"),
        BadInput("bias_2d", good(bias=t(2, 1)), ValueError, op + r"`bias` must have 1 dimension"),
        # channels and groups
        BadInput("zero_input_channels", good(input=t(2, 0, 5, 4)), ValueError,
                 op + r"`input` must have at least 1 channel"),
        BadInput("weight_channels_not_dividing", good(weight=t(2, 4, 3, 2)), ValueError,
                 op + r"`weight` has 4 input channels per group .* must divide the 6 channels"),
        BadInput("out_channels_not_multiple_of_groups", good(weight=t(3, 3, 3, 2),
                                                             bias=t(3)), ValueError,
                 op + r"`weight` must have a multiple of groups = 2 output channels"),
        BadInput("empty_kernel", good(weight=t(2, 3, 0, 2)), ValueError,
                 op + r"`weight` must have a kernel of at least 1 x 1"),
        BadInput("offset_channels_not_kernel_multiple", good(offset=t(2, 35, 2, 3)), ValueError,
                 op + r"`offset` must have a positive multiple of 2 \* kernel_h \* kernel_w"),
        BadInput("offset_groups_not_dividing", good(offset=t(2, 48, 2, 3)), ValueError,
                 op + r"`offset` has 4 offset groups .* must divide the 6 channels"),
        BadInput("mask_channels", good(mask=t(2, 12, 2, 3)), ValueError,
                 op + r"`mask` must have size 18 in dimension 1"),
        BadInput("bias_length", good(bias=t(3)), ValueError,
                 op + r"`bias` must have size 2 in dimension 0"),
        # batch and spatial sizes
        BadInput("offset_batch", good(offset=t(3, 36, 2, 3)), ValueError,
                 op + r"`offset` must have size 2 in dimension 0 \(batch size of `input`\)"),
        BadInput("mask_batch", good(mask=t(1, 18, 2, 3)), ValueError,
                 op + r"`mask` must have size 2 in dimension 0"),
        BadInput("offset_spatial", good(offset=t(2, 36, 3, 3)), ValueError,
                 op + r"`offset` must have size 2 in dimension 2 \(out_h"),
        BadInput("mask_spatial", good(mask=t(2, 18, 2, 4)), ValueError,
                 op + r"`mask` must have size 3 in dimension 3 \(out_w"),
        # geometry
        BadInput("stride_zero", good(stride=0), ValueError, op + r"`stride` must be positive"),
        BadInput("stride_negative", good(stride=(2, -1)), ValueError,
                 op + r"`stride` must be positive"),
        BadInput("dilation_zero", good(dilation=(0, 1)), ValueError,
                 op + r"`dilation` must be positive"),
        BadInput("padding_negative", good(padding=-1), ValueError,
                 op + r"`padding` must be non-negative"),
        BadInput("padding_past_64_bits", good(padding=2**62), ValueError,
                 op + r"`padding` .* is too large"),
        BadInput("dilation_past_64_bits", good(dilation=2**62), ValueError,
                 op + r"`dilation` .* is too large"),
        BadInput("kernel_larger_than_input", good(input=t(2, 6, 2, 1)), ValueError,
                 op + r"the kernel spans .* no output position"),
    ]


def baselines():
    """What the demo times extops.deform_conv2d against: torchvision's (where it imports) and the
    plain PyTorch reference."""
    found = {}
    try:
        import torchvision.ops

        found["torchvision.ops.deform_conv2d"] = torchvision.ops.deform_conv2d
    except ImportError:
        pass
    found["plain PyTorch (gather)"] = reference.deform_conv2d
    return found


# Groups, offset groups, strides and dilation all off 1, padding 2: one of the cases, and the one
# threads call at once (tests/test_concurrency.py).
GROUPED = Case("b3_c8_o4_g4_og2_k3_s2_d2", {"batch": 3, "in_channels": 8, "out_channels": 4,
                                            "groups": 4, "offset_groups": 2, "height": 11,
                                            "width": 10, "kernel_h": 3, "kernel_w": 3,
                                            "stride_h": 2, "stride_w": 2, "pad_h": 2, "pad_w": 2,
                                            "dilation_h": 2, "dilation_w": 2},
               full_gradcheck=False)

OP = OpSpec(
    name="deform_conv2d",
    arg_names=ARG_NAMES,
    output_names=("out",),
    reference=reference.deform_conv2d,
    make=make,
    cases=(
        torchvision_case("torchvision_b1", 1),
        torchvision_case("torchvision_b33", 33),
        torchvision_case("torchvision_b2_no_mask_no_bias", 2, mask=0, bias=0),
        Case("b2_c4_o5_k3_pad1", {"batch": 2, "in_channels": 4, "out_channels": 5,
                                  "offset_groups": 1, "height": 7, "width": 9, "kernel_h": 3,
                                  "kernel_w": 3, "pad_h": 1, "pad_w": 1}),
        # Default stride and dilation and no mask: the call leaves trailing arguments at their
        # defaults, which the dispatcher then drops before autograd sees them.
        Case("b2_c3_o4_k3_pad1_no_mask", {"batch": 2, "in_channels": 3, "out_channels": 4,
                                          "offset_groups": 1, "height": 6, "width": 5,
                                          "kernel_h": 3, "kernel_w": 3, "pad_h": 1, "pad_w": 1,
                                          "mask": 0}),
        Case("b1_c3_o2_k1", {"batch": 1, "in_channels": 3, "out_channels": 2, "offset_groups": 3,
                             "height": 3, "width": 5, "kernel_h": 1, "kernel_w": 1}),
        GROUPED,
        Case("b2_c16_o16_16x16_k3", {"batch": 2, "in_channels": 16, "out_channels": 16,
                                     "offset_groups": 1, "height": 16, "width": 16,
                                     "kernel_h": 3, "kernel_w": 3, "pad_h": 1, "pad_w": 1},
             full_gradcheck=False),
    ),
    batch_key="batch",
    demo_case=Case("demo", {"batch": 2, "in_channels": 32, "out_channels": 32,
                            "offset_groups": 1, "height": 28, "width": 28, "kernel_h": 3,
                            "kernel_w": 3, "pad_h": 1, "pad_w": 1}),
    # The sampling sums four corners per tap, then a GEMM over C kh kw: float32 rounding grows
    # with both, and so does half's; bfloat16's 8 bits dominate everything.
    tolerances={torch.float64: (1e-7, 1e-7), torch.float32: (1e-5, 2e-5),
                torch.float16: (2e-2, 2e-2), torch.bfloat16: (8e-2, 8e-2)},
    layouts=("strided", "permuted", "expanded", "channels_last"),
    bad_inputs=bad_inputs,
    concurrency_case=GROUPED,
    baselines=baselines,
)
