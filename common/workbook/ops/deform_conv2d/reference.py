"""The deformable convolution (DCNv2) in plain PyTorch, three ways: the definition as loops
(deform_conv2d_loops), the reference (deform_conv2d, a gather) and grid_sample.

Written with ordinary differentiable torch calls, so autograd gives its gradients. It serves
twice: as the *reference*, called on float64 copies of a sample's inputs (Sample.float64), its
outputs and gradients are what every kernel is compared with; as the *baseline*, called in the
working dtype, it is the "plain PyTorch" that the demo and the benchmark time the kernels
against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# Deformable convolution (DCNv2): torchvision.ops.deform_conv2d's signature and semantics.
#
#   out[n, o, oh, ow] = bias[o] + sum_{c, i, j} weight[o, c, i, j] mask[n, g k, oh, ow]
#                                                input[n, c](y, x)
#   y = oh stride_h - pad_h + i dilation_h + offset[n, 2 (g k) + 0, oh, ow]     k = i kw + j
#   x = ow stride_w - pad_w + j dilation_w + offset[n, 2 (g k) + 1, oh, ow]     g: c's offset group
#
# with input(y, x) bilinear between pixels, zero outside the image (see
# common/include/workbook/bilinear.h for the conventions: edges, integer points, inf, NaN).


def _int_pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else tuple(value)


def _bilinear_at(plane, height: int, width: int, y: float, x: float) -> float:
    if y != y or x != x:  # NaN
        return float("nan")
    if not (-1 < y < height and -1 < x < width):
        return 0.0
    y0, x0 = int(y // 1), int(x // 1)  # floor
    ly, lx = y - y0, x - x0

    def pixel(r, c):
        return plane[r][c] if 0 <= r < height and 0 <= c < width else 0.0

    return ((1 - ly) * (1 - lx) * pixel(y0, x0) + (1 - ly) * lx * pixel(y0, x0 + 1)
            + ly * (1 - lx) * pixel(y0 + 1, x0) + ly * lx * pixel(y0 + 1, x0 + 1))


def deform_conv2d_loops(input, offset, weight, bias=None, stride=1, padding=0, dilation=1,
                        mask=None):
    """The forward straight from the definition, one sample at a time, in float64 Python floats.

    For tiny sizes only (it is a few microseconds per multiply-add); not differentiable.
    """
    (sh, sw), (ph, pw), (dh, dw) = _int_pair(stride), _int_pair(padding), _int_pair(dilation)
    batch, channels, height, width = input.shape
    out_channels, per_group, kh, kw = weight.shape
    out_h, out_w = offset.shape[2:]
    offset_groups = offset.shape[1] // (2 * kh * kw)
    per_offset_group = channels // offset_groups
    out_per_group = out_channels // (channels // per_group)
    x_, off_, w_ = (t.detach().double().tolist() for t in (input, offset, weight))
    m_ = mask.detach().double().tolist() if mask is not None else None
    b_ = bias.detach().double().tolist() if bias is not None else [0.0] * out_channels
    out = [[[[0.0] * out_w for _ in range(out_h)] for _ in range(out_channels)]
           for _ in range(batch)]
    for n in range(batch):
        for o in range(out_channels):
            for oh in range(out_h):
                for ow in range(out_w):
                    total = b_[o]
                    for cw in range(per_group):
                        c = (o // out_per_group) * per_group + cw
                        g = c // per_offset_group
                        for i in range(kh):
                            for j in range(kw):
                                tap = g * kh * kw + i * kw + j
                                y = oh * sh - ph + i * dh + off_[n][2 * tap][oh][ow]
                                x = ow * sw - pw + j * dw + off_[n][2 * tap + 1][oh][ow]
                                m = m_[n][tap][oh][ow] if m_ is not None else 1.0
                                value = _bilinear_at(x_[n][c], height, width, y, x)
                                total += w_[o][cw][i][j] * m * value
                    out[n][o][oh][ow] = total
    return torch.tensor(out, dtype=torch.float64).reshape(batch, out_channels, out_h, out_w)


def _sample_points(input, offset, weight, stride, padding, dilation):
    """Sampling points y, x [N, G, K, Ho, Wo] in the input's dtype: integer grid + offsets."""
    (sh, sw), (ph, pw), (dh, dw) = _int_pair(stride), _int_pair(padding), _int_pair(dilation)
    kh, kw = weight.shape[2:]
    batch, _, out_h, out_w = offset.shape
    groups = offset.shape[1] // (2 * kh * kw)
    device = input.device
    rows = (torch.arange(out_h, device=device) * sh - ph)[None, :, None] + (
        torch.arange(kh, device=device) * dh).repeat_interleave(kw)[:, None, None]
    cols = (torch.arange(out_w, device=device) * sw - pw)[None, None, :] + (
        torch.arange(kw, device=device) * dw).repeat(kh)[:, None, None]
    pairs = offset.reshape(batch, groups, kh * kw, 2, out_h, out_w)
    return rows.to(input.dtype) + pairs[:, :, :, 0], cols.to(input.dtype) + pairs[:, :, :, 1]


def _columns_times_weight(columns, weight, bias, out_h, out_w):
    """columns [N, C, K, P] (sampled, masked) -> the convolution output [N, O, Ho, Wo]."""
    batch, channels = columns.shape[:2]
    out_channels, per_group = weight.shape[:2]
    groups = channels // per_group
    width = per_group * weight.shape[2] * weight.shape[3]
    cols = columns.reshape(batch, groups, width, out_h * out_w)
    w = weight.reshape(groups, out_channels // groups, width)
    out = torch.einsum("gok,ngkp->ngop", w, cols).reshape(batch, out_channels, out_h, out_w)
    return out if bias is None else out + bias[None, :, None, None]


def deform_conv2d(input, offset, weight, bias=None, stride=1, padding=0, dilation=1, mask=None):
    """Vectorised and differentiable (autograd gives every gradient): the tests' reference.

    Each of the four corners is gathered from the flattened planes with one torch.gather; a
    corner outside the image is redirected, by its validity mask, to a zero appended to each
    plane. Points out of range are moved to (0, 0) before any floor or index is taken, so
    +-inf offsets give 0 and finite zero gradients; NaN points are kept, so NaN propagates (into
    the value, both offset gradients and the mask gradient).
    The gradient at an integer point is the right one: floor() has zero derivative.
    """
    batch, channels, height, width = input.shape
    kh, kw = weight.shape[2:]
    out_h, out_w = offset.shape[2:]
    taps, positions = kh * kw, out_h * out_w
    y, x = _sample_points(input, offset, weight, stride, padding, dilation)
    groups = y.shape[1]
    inside = (y >= -1) & (y < height) & (x >= -1) & (x < width)
    keep = inside | torch.isnan(y) | torch.isnan(x)
    y, x = torch.where(keep, y, 0), torch.where(keep, x, 0)
    y, x = y + 0 * x, x + 0 * y  # a NaN in either makes both NaN (as bilinear.h's locate does)
    fy, fx = torch.floor(y), torch.floor(x)
    ly, lx = y - fy, x - fx
    y0 = torch.where(inside, fy, 0).long()
    x0 = torch.where(inside, fx, 0).long()

    planes = F.pad(input.reshape(batch, groups, channels // groups, height * width), (0, 1))
    shape = (batch, groups, channels // groups, taps * positions)
    value = 0
    for dy, dx in ((0, 0), (0, 1), (1, 0), (1, 1)):
        yc, xc = y0 + dy, x0 + dx
        valid = inside & (yc >= 0) & (yc < height) & (xc >= 0) & (xc < width)
        index = torch.where(valid, yc * width + xc, height * width)
        samples = (batch, groups, 1, taps * positions)
        corner = torch.gather(planes, 3, index.reshape(samples).expand(shape))
        weight_c = (ly if dy else 1 - ly) * (lx if dx else 1 - lx)
        value = value + weight_c.reshape(samples) * corner
    if mask is not None:
        value = value * mask.reshape(batch, groups, 1, taps * positions)
    columns = value.reshape(batch, channels, taps, positions)
    return _columns_times_weight(columns, weight, bias, out_h, out_w)


def deform_conv2d_grid_sample(input, offset, weight, bias=None, stride=1, padding=0, dilation=1,
                              mask=None):
    """The same op on F.grid_sample (bilinear, zeros padding): the plain-PyTorch speed baseline.

    align_corners=False puts pixel x at (2x + 1) / W - 1 in grid_sample's [-1, 1] coordinates,
    which stays defined for W = 1 (align_corners=True would divide by W - 1). Not meant for inf
    or NaN offsets.
    """
    batch, channels, height, width = input.shape
    kh, kw = weight.shape[2:]
    out_h, out_w = offset.shape[2:]
    y, x = _sample_points(input, offset, weight, stride, padding, dilation)
    groups = y.shape[1]
    grid = torch.stack(((2 * x + 1) / width - 1, (2 * y + 1) / height - 1), dim=-1)
    sampled = F.grid_sample(input.reshape(batch * groups, channels // groups, height, width),
                            grid.reshape(batch * groups, kh * kw * out_h, out_w, 2),
                            mode="bilinear", padding_mode="zeros", align_corners=False)
    samples = kh * kw * out_h * out_w
    value = sampled.reshape(batch, groups, channels // groups, samples)
    if mask is not None:
        value = value * mask.reshape(batch, groups, 1, samples)
    columns = value.reshape(batch, channels, kh * kw, out_h * out_w)
    return _columns_times_weight(columns, weight, bias, out_h, out_w)
