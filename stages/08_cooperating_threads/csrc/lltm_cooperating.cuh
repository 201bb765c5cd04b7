// Stage 08: threads that cooperate. The LLTM cell's matrix products as a tiled kernel, and its
// bias gradient as a block reduction: kernels in which the threads of a block share memory and
// wait for each other.
//
// Run card
//   build + test:  make stage 8          (a GPU, or the emulated device: its barriers checked by
//                                         synccheck on every run, its races by make racecheck)
//   the lesson:    make diff 8           (stage 05's glue against this stage's; these kernels)
//   v1 (stage 05): the four matrix products and the bias gradient are ATen's (cuBLAS, a reduction)
//   v2 (here):     matmul_tiled_kernel: a 16 x 16 tile of C per block, one element a thread; the
//                  K dimension walked in 16 x 16 tiles of A and B staged in shared memory
//                  column_sums_kernel: a block per column of d_gates; each thread sums a
//                  stride of its rows, the block halves in shared memory down to one warp, the
//                  warp finishes with shuffles
//
// The pointwise kernels are stage 05's (lltm_cuda.cuh, unchanged). The production library keeps
// cuBLAS: this stage is how a block's threads share work, not a faster GEMM (cuBLAS gives each
// thread a block of outputs in registers, double-buffers its loads and uses tensor cores).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "workbook/checks.h"
#include "workbook/opmath.h"

// ----------------------------------------------------------------------------------------------
// Reference
//
//   C [M, N] = A [M, K] B [K, N] (+ bias [N] on every row)
//     forward:  gates = [h, x] W^T + b                      M = batch, N = 3 S, K = S + F
//     backward: d_old_h = d_gates W[:, :S],  d_input = d_gates W[:, S:],  d_W = d_gates^T [h, x]
//   sums [N] = the column sums of D [M, N]:  d_bias = sum over the batch of d_gates
// The float64 PyTorch version the tests compare against is common/workbook/ops/lltm/reference.py.

namespace lltm_cooperating {

constexpr int kTile = 16;         // C's tile: kTile x kTile threads, one element each
constexpr int kSumThreads = 256;  // the threads that sum one column
constexpr int kWarp = 32;
constexpr int64_t kMaxGridY = 65535;     // CUDA's limit on gridDim.y: more row tiles loop
constexpr int64_t kMaxBlocks = 1 << 20;  // column blocks beyond this loop too

// A read-only matrix: element (r, c) at data[r * row_stride + c * col_stride]. A transpose is
// the same data with the strides swapped, as at::Tensor::t() is: no copy.
template <typename scalar_t>
struct Operand {
  const scalar_t* data;
  int64_t row_stride, col_stride;
  __device__ __forceinline__ scalar_t at(int64_t r, int64_t c) const {
    return data[r * row_stride + c * col_stride];
  }
};

// ----------------------------------------------------------------------------------------------
// Kernels

// C = A B (+ bias), C dense, row-major. Each thread computes one element of C, (row, col): a dot
// product of A's row and B's column over K. Read straight from global memory, every element of A
// would be loaded N times and every element of B M times. Here the block's 256 threads load a
// 16 x 16 tile of A and one of B together, one element each, into shared memory, and each thread
// then reads the 16 values of its row and column from there: every global element is loaded
// N / 16 (or M / 16) times instead.
//
// Napkin math, float32: 2 M N K FLOPs against 4 (M K N / 16 + K N M / 16) = M N K / 2 bytes of
// loads, 4 FLOPs a byte: at an H200's 4.8 TB/s about 19 TFLOP/s, under its fp32 peak, so the
// loads still bound it (a larger tile per thread is what raises the ratio).
template <typename scalar_t>
__global__ void matmul_tiled_kernel(Operand<scalar_t> a, Operand<scalar_t> b,
                                    const scalar_t* __restrict__ bias, scalar_t* __restrict__ c,
                                    int64_t m, int64_t n, int64_t k) {
  using opmath_t = workbook::opmath_t<scalar_t>;
  __shared__ opmath_t a_tile[kTile][kTile];  // A[row0 + ty][k0 + tx]
  __shared__ opmath_t b_tile[kTile][kTile];  // B[k0 + ty][col0 + tx]
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTile + tx;
  const int64_t row_tiles = (m + kTile - 1) / kTile;
  // Every thread of the block takes every turn of these loops (the bounds are the block's, not
  // the thread's), so each reaches every barrier; threads past the edge of C load zeros.
  for (int64_t tile = blockIdx.y; tile < row_tiles; tile += gridDim.y) {
    const int64_t row = tile * kTile + ty;
    opmath_t sum = 0;
    for (int64_t k0 = 0; k0 < k; k0 += kTile) {
      // EXERCISE tile-loop: load this thread's element of each tile, wait, add row x column, wait
      // checked by: test_lltm_cooperating.py::test_against_reference,
      //   ::test_tiles_that_do_not_fill, ::test_gradcheck
      a_tile[ty][tx] = row < m && k0 + tx < k ? static_cast<opmath_t>(a.at(row, k0 + tx)) : 0;
      b_tile[ty][tx] = k0 + ty < k && col < n ? static_cast<opmath_t>(b.at(k0 + ty, col)) : 0;
      __syncthreads();  // both tiles are whole before any thread reads them
      for (int j = 0; j < kTile; ++j) sum += a_tile[ty][j] * b_tile[j][tx];
      __syncthreads();  // every thread has read them before the next turn overwrites them
      // END EXERCISE tile-loop
    }
    if (row < m && col < n) {
      c[row * n + col] =
          static_cast<scalar_t>(bias != nullptr ? sum + static_cast<opmath_t>(bias[col]) : sum);
    }
  }
}

// sums[col] = the sum of D's column col over its rows, D dense [rows, cols], row-major: a block
// per column. Each of the 256 threads adds every 256th row into a register; then the block adds
// its 256 partial sums, halving in shared memory (a barrier between halvings: a thread reads
// what another wrote) until 32 remain, which the first warp adds with shuffles: lanes trade
// registers directly, with no shared memory and no barrier. The order of the additions is the
// same on every run: the bias gradient is reproducible, with no atomics.
//
// Napkin math: rows x cols elements read once; memory-bound. The loads of one block are a
// column, strided by cols; the 8 warps of neighbouring blocks read the same cache lines.
template <typename scalar_t>
__global__ void column_sums_kernel(const scalar_t* __restrict__ d, scalar_t* __restrict__ sums,
                                   int64_t rows, int64_t cols) {
  using opmath_t = workbook::opmath_t<scalar_t>;
  __shared__ opmath_t partial[kSumThreads];
  const unsigned t = threadIdx.x;
  for (int64_t col = blockIdx.x; col < cols; col += gridDim.x) {
    opmath_t sum = 0;
    for (int64_t row = t; row < rows; row += kSumThreads) {
      sum += static_cast<opmath_t>(d[row * cols + col]);
    }
    // EXERCISE block-tree: the 256 partial sums into shared memory, halved to 32 with barriers
    // checked by: test_lltm_cooperating.py::test_bias_gradient_sums_every_row,
    //   ::test_against_reference
    partial[t] = sum;
    __syncthreads();
    for (unsigned half = kSumThreads / 2; half >= kWarp; half /= 2) {
      if (t < half) partial[t] += partial[t + half];
      __syncthreads();
    }
    // END EXERCISE block-tree
    if (t < kWarp) {
      // EXERCISE warp-shuffle: the first warp adds the 32 sums left with __shfl_down_sync
      // checked by: test_lltm_cooperating.py::test_bias_gradient_sums_every_row,
      //   ::test_against_reference
      sum = partial[t];
      for (int offset = kWarp / 2; offset > 0; offset /= 2) {
        sum += __shfl_down_sync(0xffffffffu, sum, offset);
      }
      if (t == 0) sums[col] = static_cast<scalar_t>(sum);
      // END EXERCISE warp-shuffle
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Launchers: on `stream`, each checks its launch. The caller owns the memory.

inline void check_launch(const char* kernel) {
  const cudaError_t error = cudaGetLastError();
  WORKBOOK_CHECK(error == cudaSuccess, std::string("lltm: the CUDA kernel ") + kernel +
                                           " failed: " + cudaGetErrorString(error));
}

// C [m, n] = A B (+ bias); nothing to launch when C is empty. K may be 0: C is then the bias, or
// zeros.
template <typename scalar_t>
void launch_matmul(Operand<scalar_t> a, Operand<scalar_t> b, const scalar_t* bias, scalar_t* c,
                   int64_t m, int64_t n, int64_t k, cudaStream_t stream) {
  if (m == 0 || n == 0) return;
  const dim3 block(kTile, kTile);
  const dim3 grid(static_cast<unsigned int>((n + kTile - 1) / kTile),
                  static_cast<unsigned int>(std::min((m + kTile - 1) / kTile, kMaxGridY)));
  matmul_tiled_kernel<scalar_t><<<grid, block, 0, stream>>>(a, b, bias, c, m, n, k);
  check_launch("matmul_tiled_kernel");
}

// sums [cols] = the column sums of d [rows, cols]; rows may be 0 (sums of nothing: zeros).
template <typename scalar_t>
void launch_column_sums(const scalar_t* d, scalar_t* sums, int64_t rows, int64_t cols,
                        cudaStream_t stream) {
  if (cols == 0) return;
  const auto blocks = static_cast<unsigned int>(std::min(cols, kMaxBlocks));
  column_sums_kernel<scalar_t><<<blocks, kSumThreads, 0, stream>>>(d, sums, rows, cols);
  check_launch("column_sums_kernel");
}

}  // namespace lltm_cooperating
