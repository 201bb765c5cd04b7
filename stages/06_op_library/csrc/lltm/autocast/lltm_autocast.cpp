// Stage 06: the LLTM forward inside torch.autocast regions (AutocastCPU and AutocastCUDA keys).
//
// The cell is two matrix products and an element-wise loop, so it follows autocast's rule for
// matrix products: its inputs are cast to the region's dtype (bfloat16 on the CPU by default,
// float16 on CUDA), and it returns outputs of that dtype (workbook/autocast.h). Without this
// kernel a region that casts `old_h` (the output of a matmul, say) and not `weights` would hand
// the op a dtype mix it refuses. Only the forward: autograd runs the backward op on the saved
// tensors, already of one dtype, outside the region.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>

#include "workbook/autocast.h"

namespace {

template <c10::DeviceType device>
std::tuple<at::Tensor, at::Tensor, at::Tensor> lltm_forward_autocast(const at::Tensor& input,
                                                                     const at::Tensor& weights,
                                                                     const at::Tensor& bias,
                                                                     const at::Tensor& old_h,
                                                                     const at::Tensor& old_cell) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("extops::lltm_forward", "")
                             .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&)>();
  workbook::BelowAutocast<device> below;
  using workbook::autocast_input;
  return op.call(autocast_input<device>(input), autocast_input<device>(weights),
                 autocast_input<device>(bias), autocast_input<device>(old_h),
                 autocast_input<device>(old_cell));
}

}  // namespace

TORCH_LIBRARY_IMPL(extops, AutocastCPU, m) {
  m.impl("lltm_forward", &lltm_forward_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(extops, AutocastCUDA, m) {
  m.impl("lltm_forward", &lltm_forward_autocast<c10::DeviceType::CUDA>);
}
