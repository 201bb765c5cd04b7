// Stage 06: the schemas of extops::deform_conv2d and extops::deform_conv2d_backward.
//
// The extops library holds several ops; each declares its own schemas in its own file with
// TORCH_LIBRARY_FRAGMENT, so an op is added by adding files, and no file owns the namespace
// (there is no TORCH_LIBRARY(extops) anywhere: two of them would clash at load time). The
// kernels of each backend register themselves in cpu/ (and, in stage 07, cuda/); the fake
// kernels and the autograd formula are Python, in extops/deform_conv2d.py.
//
// Semantics are torchvision.ops.deform_conv2d's (DCNv1 without a mask, DCNv2 with one), with
// torchvision's argument order for the functional form:
//
//   out[n, o, oh, ow] = bias[o] + sum_{c in group(o), i < kh, j < kw}
//                         weight[o, c, i, j] * mask[n, g k, oh, ow] * input[n, c](y, x)
//   y = oh * stride_h - pad_h + i * dilation_h + offset[n, 2 (g k) + 0, oh, ow]
//   x = ow * stride_w - pad_w + j * dilation_w + offset[n, 2 (g k) + 1, oh, ow]
//
// with k = i * kw + j the kernel tap, g = c / (in_channels / offset_groups) the offset group of
// channel c, input[n, c](y, x) bilinear between pixels and zero outside the image
// (workbook/bilinear.h), groups = in_channels / weight.size(1) and
// offset_groups = offset.size(1) / (2 kh kw). A missing mask is a mask of ones.
#include <torch/library.h>

// pt2_compliant_tag: with the fake kernels of extops/deform_conv2d.py the ops trace under
// torch.compile(fullgraph=True) and run on meta tensors.
//
// `int[2]` accepts an int (broadcast to both dimensions by the dispatcher) or a list of any
// length: the kernels' checks (workbook/deform_conv2d.h) insist on exactly 2 values.
//
// deform_conv2d_backward returns (grad_input, grad_offset, grad_weight, grad_bias, grad_mask),
// the gradients of the forward's input, offset, weight, bias and mask. output_mask says which of
// the five are wanted, in the same order; an unwanted one, and grad_mask when mask is None, is an
// empty tensor of shape [0] (the schema has no optional outputs), so the kernel skips its work.
// grad_bias, when wanted, is grad_output summed over (batch, out_h, out_w). deterministic asks
// for a backward whose result is the same bits run to run: the autograd formula passes
// torch.are_deterministic_algorithms_enabled(). The CPU kernels are so in any case; the CUDA
// kernels then sort instead of scattering with atomics (stage 07). An argument rather than a
// read of ATen's global flag inside the kernel, because the stable ABI (stage 10) has no shim
// for that flag: both libraries take it the same way.
TORCH_LIBRARY_FRAGMENT(extops, m) {
  m.def(
      "deform_conv2d(Tensor input, Tensor offset, Tensor weight, Tensor? bias=None,"
      " int[2] stride=1, int[2] padding=0, int[2] dilation=1, Tensor? mask=None) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "deform_conv2d_backward(Tensor grad_output, Tensor input, Tensor offset, Tensor weight,"
      " Tensor? mask, int[2] stride, int[2] padding, int[2] dilation, bool[5] output_mask,"
      " bool deterministic)"
      " -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
}
