// Stage 09: the schemas of extops::ms_deform_attn and its backward.
//
// Multi-scale deformable attention, Deformable DETR's op (workbook/ms_deform_attn.h says what it
// computes): each query reads P points per head from each of L feature levels, stacked in one
// value tensor, and sums them with its attention weights.
//
//   value [N, S, M, D], spatial_shapes [L, 2] int64 (height, width per level),
//   level_start_index [L] int64 (the first row of each level in value's S),
//   sampling_locations [N, Lq, M, L, P, 2] ((x, y) in [0, 1]), attention_weights [N, Lq, M, L, P]
//   -> out [N, Lq, M D]
//
// One more op in the library is one more folder: this file (its schemas, a fragment of the
// extops library, as stage 06's ops declare theirs), cpu/ and cuda/ (its kernels, registered
// there), and extops/ms_deform_attn.py (its fake kernels, autograd and functional form).
//
// ms_deform_attn_backward returns (grad_value, grad_sampling_locations, grad_attention_weights);
// output_mask says which are wanted, and an unwanted one is an empty tensor of shape [0].
// deterministic asks the CUDA kernels for value's gradient without atomics (the CPU kernels are
// deterministic in any case), passed as the deformable convolution's is: the autograd formula
// reads torch.are_deterministic_algorithms_enabled().
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(extops, m) {
  m.def(
      "ms_deform_attn(Tensor value, Tensor spatial_shapes, Tensor level_start_index,"
      " Tensor sampling_locations, Tensor attention_weights) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "ms_deform_attn_backward(Tensor grad_output, Tensor value, Tensor spatial_shapes,"
      " Tensor level_start_index, Tensor sampling_locations, Tensor attention_weights,"
      " bool[3] output_mask, bool deterministic) -> (Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
}
