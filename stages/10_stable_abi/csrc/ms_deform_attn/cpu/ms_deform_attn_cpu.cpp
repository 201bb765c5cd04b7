// Stage 10: extops::ms_deform_attn and its backward on the CPU, on the stable ABI: stage 09's
// kernels, new glue.
//
// Run card
//   build + test:  make stage 10
//   the kernels:   stage 09's ms_deform_attn_cpu.h, compiled here as they are (their run card and
//                  napkin math are stage 09's ms_deform_attn_cpu.cpp)
//   timings:       make bench OP=ms_deform_attn
//
// What changes against stage 09's ms_deform_attn_cpu.cpp (`make diff 10` shows it line by line):
//
//   at::Tensor                        torch::stable::Tensor
//   AT_DISPATCH_FLOATING_TYPES_AND2   a switch on the dtype (dispatch_floating: stable_dtypes.h)
//   .contiguous()                     torch::stable::contiguous (the dispatcher shim)
//   at::empty, at::zeros              torch::stable::empty, and zero_
//   std::array<bool, 3> output_mask   std::vector<bool>, its length checked here (ATen's array
//                                     checks it as it converts the list)
//   TORCH_LIBRARY_IMPL                STABLE_TORCH_LIBRARY_IMPL, each kernel boxed by TORCH_BOX
//
// The kernels' tasks and the order of every sum are stage 09's, so the results are bitwise the
// same run to run and for any number of threads here too.
//
// Sections: the level table, launchers (the ops), registration.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "ms_deform_attn_cpu.h"  // the kernels: stage 09's
#include "stable_dtypes.h"       // the dtype switch

namespace {

using namespace ms_deform_attn_kernels;  // the kernels: this file is their stable-ABI glue
using stable_dtypes::dispatch_floating;
using torch::stable::Tensor;
using ScalarType = c10::ScalarType;

// ----------------------------------------------------------------------------------------------
// The level table

// The level table's values, checked against value's rows (workbook/ms_deform_attn.h).
std::vector<Level> checked_levels(const char* op, const Geometry& g, const Tensor& spatial_shapes,
                                  const Tensor& level_start_index) {
  const Tensor shapes = torch::stable::contiguous(spatial_shapes);
  const Tensor starts = torch::stable::contiguous(level_start_index);
  workbook::ms_deform_attn::check_levels(op, g, shapes.const_data_ptr<int64_t>(),
                                         starts.const_data_ptr<int64_t>());
  return level_table(g, shapes.const_data_ptr<int64_t>(), starts.const_data_ptr<int64_t>());
}

// ----------------------------------------------------------------------------------------------
// Launchers: the ops' CPU implementations.

// An uninitialised tensor of `like`'s dtype and device.
Tensor empty(torch::headeronly::IntHeaderOnlyArrayRef sizes, const Tensor& like) {
  return torch::stable::empty(sizes, like.scalar_type(), std::nullopt, like.device());
}

Tensor ms_deform_attn_cpu(const Tensor& value, const Tensor& spatial_shapes,
                          const Tensor& level_start_index, const Tensor& sampling_locations,
                          const Tensor& attention_weights) {
  const Geometry g = workbook::ms_deform_attn::check_forward_inputs(
      value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
      c10::DeviceType::CPU);
  const auto levels = checked_levels("ms_deform_attn", g, spatial_shapes, level_start_index);
  Tensor out = empty({g.batch, g.queries, g.out_row()}, value);
  if (out.numel() == 0) return out;
  const Tensor value_c = torch::stable::contiguous(value);
  const Tensor locations_c = torch::stable::contiguous(sampling_locations);
  const Tensor weights_c = torch::stable::contiguous(attention_weights);
  dispatch_floating(value.scalar_type(), "ms_deform_attn", [&](auto zero) {
    using scalar_t = decltype(zero);
    forward<scalar_t>(g, levels, value_c.const_data_ptr<scalar_t>(),
                      locations_c.const_data_ptr<scalar_t>(), weights_c.const_data_ptr<scalar_t>(),
                      out.mutable_data_ptr<scalar_t>());
  });
  return out;
}

std::tuple<Tensor, Tensor, Tensor> ms_deform_attn_backward_cpu(
    const Tensor& grad_output, const Tensor& value, const Tensor& spatial_shapes,
    const Tensor& level_start_index, const Tensor& sampling_locations,
    const Tensor& attention_weights, std::vector<bool> output_mask,
    bool /*deterministic: the CPU kernels are, always*/) {
  const Geometry g = workbook::ms_deform_attn::check_backward_inputs(
      grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
      c10::DeviceType::CPU);
  WORKBOOK_CHECK_VALUE(output_mask.size() == 3,
                       workbook::text("ms_deform_attn_backward: `output_mask` must have 3 values "
                                      "(value, sampling_locations, attention_weights), got ",
                                      output_mask.size()));
  const auto levels =
      checked_levels("ms_deform_attn_backward", g, spatial_shapes, level_start_index);
  const Wanted want{output_mask[0], output_mask[1], output_mask[2]};
  const auto result = [&](bool wanted, const Tensor& like, bool zeroed) {
    if (!wanted) return empty({0}, value);
    Tensor t = empty(like.sizes(), value);
    return zeroed ? torch::stable::zero_(t) : t;
  };
  // value's gradient is a scatter into rows the samples touch: it starts at zero (half and
  // bfloat16 sum in a float buffer and write every row, so they need no zeroing).
  const ScalarType type = value.scalar_type();
  const bool widened = type == ScalarType::Half || type == ScalarType::BFloat16;
  Tensor grad_value = result(want.value, value, !widened);
  Tensor grad_locations = result(want.locations, sampling_locations, false);
  Tensor grad_weights = result(want.weights, attention_weights, false);
  if (g.batch * g.heads == 0 || !(want.value || want.locations || want.weights)) {
    return {grad_value, grad_locations, grad_weights};
  }
  const Tensor grad_c = torch::stable::contiguous(grad_output);
  const Tensor value_c = torch::stable::contiguous(value);
  const Tensor locations_c = torch::stable::contiguous(sampling_locations);
  const Tensor weights_c = torch::stable::contiguous(attention_weights);
  dispatch_floating(type, "ms_deform_attn_backward", [&](auto zero) {
    using scalar_t = decltype(zero);
    backward<scalar_t>(g, levels, grad_c.const_data_ptr<scalar_t>(),
                       value_c.const_data_ptr<scalar_t>(), locations_c.const_data_ptr<scalar_t>(),
                       weights_c.const_data_ptr<scalar_t>(),
                       want.value ? grad_value.mutable_data_ptr<scalar_t>() : nullptr,
                       want.locations ? grad_locations.mutable_data_ptr<scalar_t>() : nullptr,
                       want.weights ? grad_weights.mutable_data_ptr<scalar_t>() : nullptr, want);
  });
  return {grad_value, grad_locations, grad_weights};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Registration: these kernels run the extops ms_deform_attn ops for CPU tensors.

STABLE_TORCH_LIBRARY_IMPL(extops, CPU, m) {
  m.impl("ms_deform_attn", TORCH_BOX(&ms_deform_attn_cpu));
  m.impl("ms_deform_attn_backward", TORCH_BOX(&ms_deform_attn_backward_cpu));
}
