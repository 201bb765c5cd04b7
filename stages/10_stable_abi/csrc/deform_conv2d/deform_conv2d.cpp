// Stage 10: the schemas of extops::deform_conv2d and its backward, on the stable ABI.
//
// Stage 06's csrc/deform_conv2d/deform_conv2d.cpp, which says what the op computes and what each
// argument means, with STABLE_TORCH_LIBRARY_FRAGMENT for TORCH_LIBRARY_FRAGMENT and without the
// pt2_compliant_tag (a stable def takes tags from torch 2.12; this library targets 2.10: see
// csrc/lltm/lltm.cpp). The fake kernels and the autograd formula are stage 06's
// extops/deform_conv2d.py, as they are for the ATen library.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY_FRAGMENT(extops, m) {
  m.def(
      "deform_conv2d(Tensor input, Tensor offset, Tensor weight, Tensor? bias=None,"
      " int[2] stride=1, int[2] padding=0, int[2] dilation=1, Tensor? mask=None) -> Tensor");
  m.def(
      "deform_conv2d_backward(Tensor grad_output, Tensor input, Tensor offset, Tensor weight,"
      " Tensor? mask, int[2] stride, int[2] padding, int[2] dilation, bool[5] output_mask,"
      " bool deterministic)"
      " -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}
