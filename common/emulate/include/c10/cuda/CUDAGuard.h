// The emulated device's stand-in for c10/cuda/CUDAGuard.h (see emulated_cuda.h). There is one
// emulated device; the guard refuses anything else, as CUDA's refuses a device that is not CUDA.
#pragma once

#include <c10/core/Device.h>

#include <optional>

#include "emulated_cuda.h"

namespace c10::cuda {

struct CUDAGuard {
  explicit CUDAGuard(c10::Device device) {
    TORCH_CHECK(device.is_privateuseone(), "Expected a CUDA device (the emulated one, ",
                c10::DeviceTypeName(c10::DeviceType::PrivateUse1, /*lower_case=*/true),
                "), but got: ", device);
  }
  explicit CUDAGuard(c10::DeviceIndex /*index*/) {}
  CUDAGuard(const CUDAGuard&) = delete;
  CUDAGuard& operator=(const CUDAGuard&) = delete;
};

struct OptionalCUDAGuard {
  OptionalCUDAGuard() = default;
  explicit OptionalCUDAGuard(std::optional<c10::Device> device) {
    if (device.has_value()) CUDAGuard{*device};
  }
};

}  // namespace c10::cuda

namespace at::cuda {
using c10::cuda::CUDAGuard;
using c10::cuda::OptionalCUDAGuard;
}  // namespace at::cuda
