// The emulated device's stand-in for c10/cuda/CUDAStream.h (see emulated_cuda.h): one stream,
// the default one, on which every launch has finished by the time it returns.
#pragma once

#include "emulated_cuda.h"

namespace c10::cuda {

class CUDAStream {
 public:
  cudaStream_t stream() const { return nullptr; }
  operator cudaStream_t() const { return stream(); }
  int device_index() const { return 0; }
  void synchronize() const {}
};

inline CUDAStream getCurrentCUDAStream(int /*device_index*/ = -1) { return {}; }
inline CUDAStream getDefaultCUDAStream(int /*device_index*/ = -1) { return {}; }

}  // namespace c10::cuda

namespace at::cuda {
using c10::cuda::CUDAStream;
using c10::cuda::getCurrentCUDAStream;
using c10::cuda::getDefaultCUDAStream;
}  // namespace at::cuda
