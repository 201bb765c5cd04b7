// Stage 05: the LLTM cell's pointwise math as fused CUDA kernels, and their launchers.
//
// Two kinds of library compile them: the ATen ones (lltm_cuda.cu beside this file, which stages
// 06 and 07 compile too) and stage 10's, on the stable ABI (its csrc/lltm/cuda/lltm_cuda.cu). So
// this file includes nothing of ATen's, and the kernels read their matrices through a type the
// glue chooses, Matrix<T, index_t>, anything that indexes as m[b][s] and answers m.size(0) and
// m.size(1): stage 05's packed accessor (at::GenericPackedTensorAccessor, 2-D, restrict
// pointers), or stage 10's RowMajor (a pointer and two sizes). A launch failure throws through
// workbook/checks.h. The run card, and what accessors add over raw pointers, are in lltm_cuda.cu.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "workbook/checks.h"
#include "workbook/host_device.h"
#include "workbook/lltm_math.h"
#include "workbook/opmath.h"

// ----------------------------------------------------------------------------------------------
// Reference
//
// With G = [h, x] W^T + b split into three S-wide chunks G0 | G1 | G2 (row b, column s):
//   forward:   i = sigmoid(G0)  o = sigmoid(G1)  c^ = elu(G2)
//              c' = c + c^ i    h' = tanh(c') o
//   backward:  dc' = grad_c' + grad_h' o tanh'(c')        (the gradient of old_cell, too)
//              dG0 = dc' c^ sigmoid'(G0)   dG1 = grad_h' tanh(c') sigmoid'(G1)
//              dG2 = dc' i elu'(G2)
// The float64 PyTorch version the tests compare against is common/workbook/ops/lltm/reference.py.

namespace lltm_cuda_kernels {

constexpr int kThreads = 256;         // the most threads a block has
constexpr int kWarp = 32;             // a block's x size is whole warps
constexpr int64_t kMaxGridY = 65535;  // CUDA's limit on gridDim.y

// A load through the read-only data cache (ld.global.nc). nvcc emits it by itself for a kernel
// parameter `const T* __restrict__` (stage 04's), not for a pointer inside a struct such as an
// accessor, so the kernels ask for it. __ldg takes float and double; half and bfloat16 are
// loaded as their 16 bits.
template <typename scalar_t>
__device__ __forceinline__ scalar_t load(const scalar_t& value) {
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
    return __ldg(&value);
  } else {
    static_assert(sizeof(scalar_t) == sizeof(unsigned short), "half and bfloat16: 16 bits");
    return scalar_t(__ldg(reinterpret_cast<const unsigned short*>(&value)), scalar_t::from_bits());
  }
}

// ----------------------------------------------------------------------------------------------
// Kernels
//
// x covers the S columns of the state, y the batch rows: a block is blockDim.y rows of
// blockDim.x columns (block_for below), and rows past gridDim.y x blockDim.y (only when batch
// needs more than 65535 blocks in y) are taken in turn by the same threads. index_t is int32_t
// when every tensor has fewer than 2^31 elements, else int64_t. Half and bfloat16 compute in
// opmath_t (float).

// Bytes per element: reads gates (3) + old_cell (1), writes new_h + new_cell (2): 6 values,
// 24 B in float32 (12 B in half). About 30 FLOPs, three exp and a tanh: memory-bound on any GPU
// (an H200 moves 4.8 TB/s, so B x S = 16M float elements should take about 80 us).
template <template <typename, typename> class Matrix, typename scalar_t, typename index_t>
__global__ void lltm_forward_kernel(Matrix<const scalar_t, index_t> gates,
                                    Matrix<const scalar_t, index_t> old_cell,
                                    Matrix<scalar_t, index_t> new_h,
                                    Matrix<scalar_t, index_t> new_cell) {
  using opmath_t = workbook::opmath_t<scalar_t>;
  // EXERCISE accessor-kernel: new_h[b][s], new_cell[b][s] via the accessors: s on x, rows b on y
  // checked by: test_lltm.py::test_against_reference, ::test_cuda_matches_cpu, ::test_edge_cases
  const index_t batch = old_cell.size(0), state = old_cell.size(1);
  const index_t s = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= state) return;
  const index_t rows_per_grid = static_cast<index_t>(gridDim.y) * blockDim.y;
  for (index_t b = static_cast<index_t>(blockIdx.y) * blockDim.y + threadIdx.y; b < batch;
       b += rows_per_grid) {
    const opmath_t input_gate = workbook::sigmoid(static_cast<opmath_t>(load(gates[b][s])));
    const opmath_t output_gate =
        workbook::sigmoid(static_cast<opmath_t>(load(gates[b][state + s])));
    const opmath_t candidate = workbook::elu(static_cast<opmath_t>(load(gates[b][2 * state + s])));

    const opmath_t cell = static_cast<opmath_t>(load(old_cell[b][s])) + candidate * input_gate;
    new_cell[b][s] = static_cast<scalar_t>(cell);
    new_h[b][s] = static_cast<scalar_t>(std::tanh(cell) * output_gate);
  }
  // END EXERCISE accessor-kernel
}

// Bytes per element: reads grad_h, grad_cell, new_cell, gates (3): 6 values; writes d_gates (3)
// and d_old_cell (1): 4 values. 10 values, 40 B in float32 (20 B in half). Memory-bound as well.
// The two sigmoids and the tanh are computed once each, and their derivatives from them.
template <template <typename, typename> class Matrix, typename scalar_t, typename index_t>
__global__ void lltm_backward_kernel(Matrix<const scalar_t, index_t> grad_h,
                                     Matrix<const scalar_t, index_t> grad_cell,
                                     Matrix<const scalar_t, index_t> new_cell,
                                     Matrix<const scalar_t, index_t> gates,
                                     Matrix<scalar_t, index_t> d_gates,
                                     Matrix<scalar_t, index_t> d_old_cell) {
  using opmath_t = workbook::opmath_t<scalar_t>;
  const index_t batch = new_cell.size(0), state = new_cell.size(1);
  const index_t s = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= state) return;
  const index_t rows_per_grid = static_cast<index_t>(gridDim.y) * blockDim.y;
  for (index_t b = static_cast<index_t>(blockIdx.y) * blockDim.y + threadIdx.y; b < batch;
       b += rows_per_grid) {
    const opmath_t g_input = static_cast<opmath_t>(load(gates[b][s]));
    const opmath_t g_output = static_cast<opmath_t>(load(gates[b][state + s]));
    const opmath_t g_candidate = static_cast<opmath_t>(load(gates[b][2 * state + s]));
    const opmath_t cell = static_cast<opmath_t>(load(new_cell[b][s]));
    const opmath_t dh = static_cast<opmath_t>(load(grad_h[b][s]));

    const opmath_t input_gate = workbook::sigmoid(g_input);
    const opmath_t output_gate = workbook::sigmoid(g_output);
    const opmath_t tanh_cell = std::tanh(cell);
    // workbook::d_sigmoid and workbook::d_tanh, term for term, from the values above.
    const opmath_t d_input_gate = (opmath_t(1) - input_gate) * input_gate;
    const opmath_t d_output_gate = (opmath_t(1) - output_gate) * output_gate;
    const opmath_t d_tanh_cell = opmath_t(1) - tanh_cell * tanh_cell;

    // c' reaches the loss directly (grad_cell) and through h' = tanh(c') o.
    const opmath_t d_cell =
        static_cast<opmath_t>(load(grad_cell[b][s])) + dh * output_gate * d_tanh_cell;
    d_old_cell[b][s] = static_cast<scalar_t>(d_cell);
    d_gates[b][s] = static_cast<scalar_t>(d_cell * workbook::elu(g_candidate) * d_input_gate);
    d_gates[b][state + s] = static_cast<scalar_t>(dh * tanh_cell * d_output_gate);
    d_gates[b][2 * state + s] =
        static_cast<scalar_t>(d_cell * input_gate * workbook::d_elu(g_candidate));
  }
}

// ----------------------------------------------------------------------------------------------
// Launchers, generic over the matrix type.

// The block: x spans the state in whole warps (the state rounded up to a multiple of 32, at most
// kThreads), y stacks the rows that fit beside it (kThreads / x). A fixed 256 x 1 block would
// leave half its threads idle at state 128 (the tutorial's size): 128 x 2 keeps every one busy,
// and state 3 takes 32 x 8. From state 225 on the block is 256 x 1, and the last block in x may
// still be mostly idle (state 257: 1 thread of 256 works), as with any fixed width.
inline dim3 block_for(int64_t state) {
  const int64_t x = std::min<int64_t>(workbook::ceil_div<int64_t>(state, kWarp) * kWarp, kThreads);
  return dim3(static_cast<unsigned int>(x), static_cast<unsigned int>(kThreads / x));
}

// Called with batch, state > 0 (the launchers return early on empty tensors: a grid of 0 blocks
// is an invalid launch).
inline dim3 grid_for(int64_t batch, int64_t state, const dim3& block) {
  return dim3(
      static_cast<unsigned int>(workbook::ceil_div<int64_t>(state, block.x)),
      static_cast<unsigned int>(std::min(workbook::ceil_div<int64_t>(batch, block.y), kMaxGridY)));
}

inline void check_launch(const char* kernel) {
  const cudaError_t error = cudaGetLastError();
  WORKBOOK_CHECK(error == cudaSuccess, std::string("lltm: the CUDA kernel ") + kernel +
                                           " failed: " + cudaGetErrorString(error));
}

// Each launcher is called with batch, state > 0 (a grid of 0 blocks is an invalid launch), on
// `stream`, and checks its launch.
template <template <typename, typename> class Matrix, typename scalar_t, typename index_t>
void launch_forward(Matrix<const scalar_t, index_t> gates, Matrix<const scalar_t, index_t> old_cell,
                    Matrix<scalar_t, index_t> new_h, Matrix<scalar_t, index_t> new_cell,
                    int64_t batch, int64_t state, cudaStream_t stream) {
  const dim3 block = block_for(state);
  lltm_forward_kernel<Matrix, scalar_t, index_t>
      <<<grid_for(batch, state, block), block, 0, stream>>>(gates, old_cell, new_h, new_cell);
  check_launch("lltm_forward_kernel");
}

template <template <typename, typename> class Matrix, typename scalar_t, typename index_t>
void launch_backward(Matrix<const scalar_t, index_t> grad_h,
                     Matrix<const scalar_t, index_t> grad_cell,
                     Matrix<const scalar_t, index_t> new_cell,
                     Matrix<const scalar_t, index_t> gates, Matrix<scalar_t, index_t> d_gates,
                     Matrix<scalar_t, index_t> d_old_cell, int64_t batch, int64_t state,
                     cudaStream_t stream) {
  const dim3 block = block_for(state);
  lltm_backward_kernel<Matrix, scalar_t, index_t>
      <<<grid_for(batch, state, block), block, 0, stream>>>(grad_h, grad_cell, new_cell, gates,
                                                            d_gates, d_old_cell);
  check_launch("lltm_backward_kernel");
}

}  // namespace lltm_cuda_kernels
