// The emulated device's stand-in for c10/cuda/CUDAException.h: C10_CUDA_CHECK and
// C10_CUDA_KERNEL_LAUNCH_CHECK are defined in emulated_cuda.h.
#pragma once

#include "emulated_cuda.h"
