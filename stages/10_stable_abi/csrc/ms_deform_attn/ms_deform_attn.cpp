// Stage 10: the schemas of extops::ms_deform_attn and its backward, on the stable ABI.
//
// Stage 09's csrc/ms_deform_attn/ms_deform_attn.cpp, which says what the op computes and what each
// argument means, with STABLE_TORCH_LIBRARY_FRAGMENT for TORCH_LIBRARY_FRAGMENT and without the
// pt2_compliant_tag (a stable def takes tags from torch 2.12; this library targets 2.10: see
// csrc/lltm/lltm.cpp). The fake kernels and the autograd formula are stage 09's
// extops/ms_deform_attn.py, as they are for the ATen library; autocast is registered from Python
// (extops/python_keys.py).
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY_FRAGMENT(extops, m) {
  m.def(
      "ms_deform_attn(Tensor value, Tensor spatial_shapes, Tensor level_start_index,"
      " Tensor sampling_locations, Tensor attention_weights) -> Tensor");
  m.def(
      "ms_deform_attn_backward(Tensor grad_output, Tensor value, Tensor spatial_shapes,"
      " Tensor level_start_index, Tensor sampling_locations, Tensor attention_weights,"
      " bool[3] output_mask, bool deterministic) -> (Tensor, Tensor, Tensor)");
}
