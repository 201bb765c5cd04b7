// Stage 06: the deformable convolution inside torch.autocast regions (AutocastCPU, AutocastCUDA).
//
// A convolution, so autocast's rule for convolutions: floating inputs cast to the region's dtype
// (bfloat16 on the CPU by default, float16 on CUDA), outputs of that dtype (workbook/autocast.h);
// the kernels compute half and bfloat16 in float. torchvision's deform_conv2d instead runs in
// float32 and casts the result back: its half kernels accumulate in half. Only the forward:
// autograd runs the backward op on the saved tensors, already of one dtype.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

#include "workbook/autocast.h"

namespace {

template <c10::DeviceType device>
at::Tensor deform_conv2d_autocast(const at::Tensor& input, const at::Tensor& offset,
                                  const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                  at::IntArrayRef stride, at::IntArrayRef padding,
                                  at::IntArrayRef dilation, const std::optional<at::Tensor>& mask) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("extops::deform_conv2d", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, at::IntArrayRef, at::IntArrayRef,
                            at::IntArrayRef, const std::optional<at::Tensor>&)>();
  workbook::BelowAutocast<device> below;
  using workbook::autocast_input;
  return op.call(autocast_input<device>(input), autocast_input<device>(offset),
                 autocast_input<device>(weight), autocast_input<device>(bias), stride, padding,
                 dilation, autocast_input<device>(mask));
}

}  // namespace

TORCH_LIBRARY_IMPL(extops, AutocastCPU, m) {
  m.impl("deform_conv2d", &deform_conv2d_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(extops, AutocastCUDA, m) {
  m.impl("deform_conv2d", &deform_conv2d_autocast<c10::DeviceType::CUDA>);
}
