// Stage 06: the schemas of the LLTM ops in the extops library.
//
// Stage 05's two ops, unchanged in behaviour, now two of a library's: extops::lltm_forward and
// extops::lltm_backward. Each op of the library declares its schemas in a file of its own with
// TORCH_LIBRARY_FRAGMENT (a TORCH_LIBRARY may appear once per namespace in a whole process; a
// fragment may appear any number of times), and its kernels register themselves from cpu/ and
// cuda/, its autograd from autograd/ and its autocast rule from autocast/. The fake kernels are
// Python, in extops/lltm.py.
#include <torch/library.h>

// forward returns the pre-activation gates as a third output: the backward rebuilds the gate
// activations from them. `gates` is internal: not differentiable (autograd marks it so: a loss
// through it gets no gradient from it), and not returned by the functional form extops.lltm,
// which returns (new_h, new_cell). pt2_compliant_tag: with the fake kernels the ops trace under
// torch.compile(fullgraph=True) and run on meta tensors.
TORCH_LIBRARY_FRAGMENT(extops, m) {
  m.def(
      "lltm_forward(Tensor input, Tensor weights, Tensor bias, Tensor old_h, Tensor old_cell)"
      " -> (Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "lltm_backward(Tensor grad_h, Tensor grad_cell, Tensor new_cell, Tensor gates,"
      " Tensor input, Tensor old_h, Tensor weights) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
}
