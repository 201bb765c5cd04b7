// Stage 09: extops::ms_deform_attn and its backward on the CPU: one fused pass each, parallel,
// deterministic.
//
// Run card
//   build + test:  make stage 9
//   bench:         make bench OP=ms_deform_attn (against the grid_sample decomposition that
//                  HF transformers runs off CUDA; the figures are in the stage's README)
//
// What the fusion saves: the decomposition samples every level with grid_sample into a tensor
// [N M, D, Lq, L P] (for Deformable DETR's encoder at 800 x 1333: 2.8M samples x 32 channels,
// 364 MB in float32), then multiplies by the weights and sums; its backward writes that tensor's
// gradient and scatters it with grid_sample's backward. Here each sample's 4 corners are read and
// blended into the query's output row at once: out is the only tensor written, and the backward
// writes only the three gradients. Napkin floor for that encoder, per pass: 2.8M samples x 4
// corners x 32 channels = 0.36 G fused multiply-adds, from a 23 MB value tensor.
//
// Sections: the level table, the ops, registration. The kernels are ms_deform_attn_cpu.h beside
// this file, the checks and the sampling point workbook/ms_deform_attn.h (shared with the CUDA
// kernels).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <tuple>
#include <vector>

#include "ms_deform_attn_cpu.h"  // the kernels

namespace {

using namespace ms_deform_attn_kernels;  // the kernels: this file is their ATen glue

// The level table's values, checked against value's rows (workbook/ms_deform_attn.h).
std::vector<Level> checked_levels(const char* op, const Geometry& g,
                                  const at::Tensor& spatial_shapes,
                                  const at::Tensor& level_start_index) {
  const auto shapes = spatial_shapes.contiguous();
  const auto starts = level_start_index.contiguous();
  workbook::ms_deform_attn::check_levels(op, g, shapes.const_data_ptr<int64_t>(),
                                         starts.const_data_ptr<int64_t>());
  return level_table(g, shapes.const_data_ptr<int64_t>(), starts.const_data_ptr<int64_t>());
}

at::Tensor ms_deform_attn_cpu(const at::Tensor& value, const at::Tensor& spatial_shapes,
                              const at::Tensor& level_start_index,
                              const at::Tensor& sampling_locations,
                              const at::Tensor& attention_weights) {
  const Geometry g = workbook::ms_deform_attn::check_forward_inputs(
      value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
      c10::DeviceType::CPU);
  const auto levels = checked_levels("ms_deform_attn", g, spatial_shapes, level_start_index);
  auto out = at::empty({g.batch, g.queries, g.out_row()}, value.options());
  if (out.numel() == 0) return out;
  const auto value_c = value.contiguous();
  const auto locations_c = sampling_locations.contiguous();
  const auto weights_c = attention_weights.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, value.scalar_type(), "ms_deform_attn_cpu", [&] {
        forward<scalar_t>(g, levels, value_c.const_data_ptr<scalar_t>(),
                          locations_c.const_data_ptr<scalar_t>(),
                          weights_c.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>());
      });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights, std::array<bool, 3> output_mask,
    bool /*deterministic: the CPU kernels are, always*/) {
  const Geometry g = workbook::ms_deform_attn::check_backward_inputs(
      grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
      c10::DeviceType::CPU);
  const auto levels =
      checked_levels("ms_deform_attn_backward", g, spatial_shapes, level_start_index);
  const Wanted want{output_mask[0], output_mask[1], output_mask[2]};
  const auto options = value.options();
  auto result = [&](bool wanted, at::IntArrayRef shape, bool zeroed) {
    if (!wanted) return at::empty({0}, options);
    return zeroed ? at::zeros(shape, options) : at::empty(shape, options);
  };
  // value's gradient is a scatter into rows the samples touch: it starts at zero (half and
  // bfloat16 sum in a float buffer and write every row, so they need no zeroing).
  const bool widened = value.scalar_type() == at::kHalf || value.scalar_type() == at::kBFloat16;
  auto grad_value = result(want.value, value.sizes(), !widened);
  auto grad_locations = result(want.locations, sampling_locations.sizes(), false);
  auto grad_weights = result(want.weights, attention_weights.sizes(), false);
  if (g.batch * g.heads == 0 || !(want.value || want.locations || want.weights)) {
    return {grad_value, grad_locations, grad_weights};
  }
  const auto grad_c = grad_output.contiguous();
  const auto value_c = value.contiguous();
  const auto locations_c = sampling_locations.contiguous();
  const auto weights_c = attention_weights.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, value.scalar_type(), "ms_deform_attn_backward_cpu", [&] {
        backward<scalar_t>(
            g, levels, grad_c.const_data_ptr<scalar_t>(), value_c.const_data_ptr<scalar_t>(),
            locations_c.const_data_ptr<scalar_t>(), weights_c.const_data_ptr<scalar_t>(),
            want.value ? grad_value.mutable_data_ptr<scalar_t>() : nullptr,
            want.locations ? grad_locations.mutable_data_ptr<scalar_t>() : nullptr,
            want.weights ? grad_weights.mutable_data_ptr<scalar_t>() : nullptr, want);
      });
  return {grad_value, grad_locations, grad_weights};
}

}  // namespace

TORCH_LIBRARY_IMPL(extops, CPU, m) {
  m.impl("ms_deform_attn", &ms_deform_attn_cpu);
  m.impl("ms_deform_attn_backward", &ms_deform_attn_backward_cpu);
}
