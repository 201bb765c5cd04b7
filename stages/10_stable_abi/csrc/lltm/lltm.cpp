// Stage 10: the schemas of the LLTM ops, on the stable ABI.
//
// Stage 06's csrc/lltm/lltm.cpp, with STABLE_TORCH_LIBRARY_FRAGMENT for TORCH_LIBRARY_FRAGMENT:
// the same two schemas, registered through libtorch's C shims (aoti_torch_library_def) instead of
// torch::Library, a C++ class whose layout can change from one torch release to the next.
//
// One thing is left out: the pt2_compliant_tag. A stable-ABI def takes tags from torch 2.12
// (TORCH_VERSION_2_12_0 in torch/csrc/stable/library.h), and this library targets 2.10. The tag
// only asserts what the fake kernels (extops/lltm.py) make true: the ops still trace under
// torch.compile(fullgraph=True), and stage 05's tests check it.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY_FRAGMENT(extops, m) {
  m.def(
      "lltm_forward(Tensor input, Tensor weights, Tensor bias, Tensor old_h, Tensor old_cell)"
      " -> (Tensor, Tensor, Tensor)");
  m.def(
      "lltm_backward(Tensor grad_h, Tensor grad_cell, Tensor new_cell, Tensor gates,"
      " Tensor input, Tensor old_h, Tensor weights) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}
