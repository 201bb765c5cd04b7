// The emulated device's stand-in for c10/cuda/CUDAFunctions.h: one device, index 0.
#pragma once

#include <c10/core/Device.h>

#include "emulated_cuda.h"

namespace c10::cuda {
inline c10::DeviceIndex device_count() noexcept { return 1; }
inline c10::DeviceIndex current_device() { return 0; }
inline void device_synchronize() {}
}  // namespace c10::cuda
