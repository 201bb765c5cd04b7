// The emulated device's stand-in for cooperative_groups.h: the groups the workbook's kernels use,
// over the emulated barriers and warp collectives (emulated_cuda.h), with CUDA's meaning.
//
//   this_thread_block()        the block: sync() is __syncthreads, thread_rank() the thread's
//                              linear index in it
//   tiled_partition<N>(group)  tiles of N = 1, 2, 4, 8, 16 or 32 consecutive threads of a warp:
//                              sync() is __syncwarp over the tile's lanes, shfl* and ballot, any,
//                              all the warp's, with the tile's mask and width N; thread_rank() is
//                              the lane in the tile, meta_group_rank() the tile in the block
//
// cooperative_groups/reduce.h adds cg::reduce with cg::plus, cg::less and cg::greater.
#pragma once

#include "emulated_cuda.h"

namespace cooperative_groups {

namespace details {
inline unsigned linear_thread() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
inline unsigned block_threads() { return blockDim.x * blockDim.y * blockDim.z; }
}  // namespace details

class thread_block {
 public:
  void sync(WORKBOOK_EMULATE_CALLER) const { __syncthreads(file, line); }
  unsigned long long thread_rank() const { return details::linear_thread(); }
  unsigned long long num_threads() const { return details::block_threads(); }
  unsigned long long size() const { return num_threads(); }
  dim3 group_index() const { return dim3(blockIdx.x, blockIdx.y, blockIdx.z); }
  dim3 thread_index() const { return dim3(threadIdx.x, threadIdx.y, threadIdx.z); }
  dim3 group_dim() const { return blockDim; }
};

inline thread_block this_thread_block() { return thread_block{}; }

template <unsigned Size, typename Parent = void>
class thread_block_tile {
  static_assert(Size >= 1 && Size <= 32 && (Size & (Size - 1)) == 0,
                "the emulated tiled_partition takes tiles of 1, 2, 4, 8, 16 or 32 threads");

 public:
  thread_block_tile() = default;
  template <typename Other>
  thread_block_tile(const thread_block_tile<Size, Other>&) {}  // NOLINT: CUDA's conversion

  static constexpr unsigned long long num_threads() { return Size; }
  static constexpr unsigned long long size() { return Size; }
  unsigned long long thread_rank() const { return details::linear_thread() % Size; }
  unsigned long long meta_group_rank() const { return details::linear_thread() / Size; }
  unsigned long long meta_group_size() const {
    return (details::block_threads() + Size - 1) / Size;
  }

  void sync(WORKBOOK_EMULATE_CALLER) const { __syncwarp(mask(), file, line); }

  template <typename T>
  T shfl(T var, int source_rank, WORKBOOK_EMULATE_CALLER) const {
    return __shfl_sync(mask(), var, source_rank, Size, file, line);
  }
  template <typename T>
  T shfl_down(T var, unsigned delta, WORKBOOK_EMULATE_CALLER) const {
    return __shfl_down_sync(mask(), var, delta, Size, file, line);
  }
  template <typename T>
  T shfl_up(T var, unsigned delta, WORKBOOK_EMULATE_CALLER) const {
    return __shfl_up_sync(mask(), var, delta, Size, file, line);
  }
  template <typename T>
  T shfl_xor(T var, unsigned lane_mask, WORKBOOK_EMULATE_CALLER) const {
    return __shfl_xor_sync(mask(), var, static_cast<int>(lane_mask), Size, file, line);
  }
  // The votes, as bits of the tile's ranks.
  unsigned ballot(int predicate, WORKBOOK_EMULATE_CALLER) const {
    return __ballot_sync(mask(), predicate, file, line) >> first_lane();
  }
  bool any(int predicate, WORKBOOK_EMULATE_CALLER) const {
    return __any_sync(mask(), predicate, file, line) != 0;
  }
  bool all(int predicate, WORKBOOK_EMULATE_CALLER) const {
    return __all_sync(mask(), predicate, file, line) != 0;
  }

 private:
  static unsigned first_lane() { return details::linear_thread() % 32 / Size * Size; }
  static unsigned mask() {
    return (Size == 32 ? 0xffffffffu : ((1u << Size) - 1u)) << first_lane();
  }
};

template <unsigned Size, typename Parent>
thread_block_tile<Size, Parent> tiled_partition(const Parent&) {
  return thread_block_tile<Size, Parent>{};
}

template <typename Group>
void sync(const Group& group, WORKBOOK_EMULATE_CALLER) {
  group.sync(file, line);
}

}  // namespace cooperative_groups
