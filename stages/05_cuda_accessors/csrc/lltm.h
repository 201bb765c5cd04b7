// Stage 05: what the library's three C++ files share: the input checks of both ops.
//
// Defined in lltm.cpp, called first by every kernel (lltm_cpu.cpp, lltm_cuda.cu), so a bad input
// gets the same message whichever backend it was sent to.
#pragma once

#include <ATen/ATen.h>

namespace lltm {

// Dtypes (one floating dtype), devices (`device` type, all on the first input's device), ranks
// and sizes. Not layout: the kernels make their inputs contiguous themselves.
void check_forward_inputs(const at::Tensor& input, const at::Tensor& weights,
                          const at::Tensor& bias, const at::Tensor& old_h,
                          const at::Tensor& old_cell, c10::DeviceType device);

void check_backward_inputs(const at::Tensor& grad_h, const at::Tensor& grad_cell,
                           const at::Tensor& new_cell, const at::Tensor& gates,
                           const at::Tensor& input, const at::Tensor& old_h,
                           const at::Tensor& weights, c10::DeviceType device);

}  // namespace lltm
