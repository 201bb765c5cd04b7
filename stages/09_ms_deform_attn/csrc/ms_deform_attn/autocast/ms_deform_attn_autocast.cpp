// Stage 09: multi-scale deformable attention inside torch.autocast regions (AutocastCPU,
// AutocastCUDA).
//
// The rule of the library's other ops (workbook/autocast.h): the floating inputs (value, the
// locations, the weights) cast to the region's dtype, the output of that dtype, the kernels
// computing in float. That is what fixes the "expected scalar type Half" of Deformable DETR's
// kernel under AMP, where value arrives in half and the locations in float. The cost, said here
// because it is the op's own: a location in half keeps 11 bits, so on the largest level of
// Deformable DETR's encoder (167 pixels wide) a point moves by up to 167 / 2^12 = 0.04 pixel;
// bfloat16's 8 bits make that 0.3 pixel. Call the op outside the region (or on float32 inputs
// with autocast disabled) where that matters.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "workbook/autocast.h"

namespace {

template <c10::DeviceType device>
at::Tensor ms_deform_attn_autocast(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                   const at::Tensor& level_start_index,
                                   const at::Tensor& sampling_locations,
                                   const at::Tensor& attention_weights) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("extops::ms_deform_attn", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&)>();
  workbook::BelowAutocast<device> below;
  using workbook::autocast_input;
  // The index tensors are int64: autocast_input passes them through as they are.
  return op.call(autocast_input<device>(value), spatial_shapes, level_start_index,
                 autocast_input<device>(sampling_locations),
                 autocast_input<device>(attention_weights));
}

}  // namespace

TORCH_LIBRARY_IMPL(extops, AutocastCPU, m) {
  m.impl("ms_deform_attn", &ms_deform_attn_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(extops, AutocastCUDA, m) {
  m.impl("ms_deform_attn", &ms_deform_attn_autocast<c10::DeviceType::CUDA>);
}
