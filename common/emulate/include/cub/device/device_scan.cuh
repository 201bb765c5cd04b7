// The emulated device's stand-in for CUB's DeviceScan: InclusiveSum, with CUB's calling
// convention (a first call with no scratch space asks how much it needs), on the host.
#pragma once

#include <cstddef>

#include "ATen/cuda/cub.h"
#include "emulated_cuda.h"

namespace cub {

struct DeviceScan {
  template <typename InputIteratorT, typename OutputIteratorT, typename NumItemsT>
  static cudaError_t InclusiveSum(void* d_temp_storage, size_t& temp_storage_bytes,
                                  InputIteratorT d_in, OutputIteratorT d_out, NumItemsT num_items,
                                  cudaStream_t stream = nullptr) {
    (void)stream;
    if (d_temp_storage == nullptr) {
      temp_storage_bytes = 1;
      return cudaSuccess;
    }
    at::cuda::cub::inclusive_sum(d_in, d_out, static_cast<int64_t>(num_items));
    return cudaSuccess;
  }
};

}  // namespace cub
