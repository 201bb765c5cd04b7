// workbook/autocast.h: what an op's kernel on an Autocast dispatch key needs.
//
// Inside a `torch.autocast` region the dispatcher sends every op first to its Autocast kernel
// (AutocastCPU, AutocastCUDA) if it has one. An op without one runs on its inputs as they come:
// autocast casts the inputs of ops *around* it (a matmul's to bfloat16, say), so a custom op gets
// a mix of dtypes and refuses it. The ops here follow the rule autocast applies to matrix
// products and convolutions ("lower precision"): every floating input is cast to the region's
// dtype (float16 or bfloat16: torch.get_autocast_dtype), then the op runs below the autocast layer
// on its usual kernels. Half and bfloat16 kernels here compute in float, so the cast costs
// memory traffic, not accuracy of the arithmetic.
//
//   template <c10::DeviceType device>
//   at::Tensor my_op_autocast(const at::Tensor& x, const at::Tensor& w) {
//     workbook::BelowAutocast<device> below;
//     return my_op(workbook::autocast_input<device>(x), workbook::autocast_input<device>(w));
//   }
//   TORCH_LIBRARY_IMPL(ns, AutocastCPU, m) { m.impl("my_op",
//   &my_op_autocast<c10::DeviceType::CPU>); }
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>

namespace workbook {

// For its lifetime, the dispatcher skips the autocast layer of `device`: the op called inside runs
// its autograd and backend kernels, not this Autocast kernel again.
template <c10::DeviceType device>
struct BelowAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{
      at::autocast::get_autocast_dispatch_key_from_device_type(device)};
};

// `t` in the region's lower-precision dtype, when it is a floating tensor on `device` (anything
// else is returned as it is, and the op's own checks judge it). Casts of weights are cached for
// the region, as autocast caches them for its own ops.
template <c10::DeviceType device>
at::Tensor autocast_input(const at::Tensor& t) {
  return at::autocast::cached_cast(at::autocast::get_lower_precision_fp_from_device_type(device), t,
                                   device);
}

template <c10::DeviceType device>
std::optional<at::Tensor> autocast_input(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return t;
  return autocast_input<device>(*t);
}

}  // namespace workbook
