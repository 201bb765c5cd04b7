// The emulated device's stand-in for CUB's DeviceRadixSort: SortPairs, with CUB's calling
// convention (a first call with no scratch space asks how much it needs) and semantics (stable,
// by the bits [begin_bit, end_bit) alone), on the host: the sort of ATen/cuda/cub.h's stand-in.
#pragma once

#include <cstddef>

#include "ATen/cuda/cub.h"
#include "emulated_cuda.h"

namespace cub {

struct DeviceRadixSort {
  template <typename KeyT, typename ValueT, typename NumItemsT>
  static cudaError_t SortPairs(void* d_temp_storage, size_t& temp_storage_bytes,
                               const KeyT* d_keys_in, KeyT* d_keys_out, const ValueT* d_values_in,
                               ValueT* d_values_out, NumItemsT num_items, int begin_bit = 0,
                               int end_bit = sizeof(KeyT) * 8, cudaStream_t stream = nullptr) {
    (void)stream;
    if (d_temp_storage == nullptr) {
      temp_storage_bytes = 1;  // the host sort needs none; CUB never asks for 0
      return cudaSuccess;
    }
    at::cuda::cub::radix_sort_pairs(d_keys_in, d_keys_out, d_values_in, d_values_out,
                                    static_cast<int64_t>(num_items), /*descending=*/false,
                                    begin_bit, end_bit);
    return cudaSuccess;
  }
};

}  // namespace cub
