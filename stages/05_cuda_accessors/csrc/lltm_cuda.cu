// Stage 05: the LLTM cell's pointwise math as fused CUDA kernels on packed tensor accessors.
//
// Run card
//   build + test:  make stage 5            (compiles on any machine with nvcc; runs on a GPU)
//   install:       pip install --no-build-isolation ./stages/05_cuda_accessors
//   v1 (stage 04): raw pointers, a flat index (32-bit when it fits), one thread per (batch,
//                  state) element
//   v2 (here):     packed accessors ([b][s] indexing, 32-bit index math when it fits, 64-bit
//                  when it does not; inputs read-only, loaded through the read-only cache), a 2-D
//                  grid (state across x, batch across y) of blocks shaped to the state, registered
//                  as the CUDA kernels of torch.ops.lltm.lltm_forward / .lltm_backward (and of
//                  torch.ops.extops.lltm_*: stage 06 compiles this file into its library)
//
// What accessors add over raw pointers: the kernel reads gates[b][s] instead of computing
// gates + b * 3S + s by hand, and sizes travel with the data. A *packed* accessor carries sizes
// and strides by value, so it can be passed to a kernel; the 32-bit flavour does the index math
// in int32, which is faster, and is only correct below 2^31 elements, hence the choice below.
// Inputs get accessors of `const scalar_t`: the kernel cannot write them by mistake.
//
// Sections: reference, kernels, launchers, registration. The input checks are
// workbook/lltm_checks.h, shared with the CPU kernel; the schemas are in lltm.cpp.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>

#include "workbook/host_device.h"
#include "workbook/lltm_checks.h"
#include "workbook/lltm_math.h"

// ----------------------------------------------------------------------------------------------
// Reference
//
// With G = [h, x] W^T + b split into three S-wide chunks G0 | G1 | G2 (row b, column s):
//   forward:   i = sigmoid(G0)  o = sigmoid(G1)  c^ = elu(G2)
//              c' = c + c^ i    h' = tanh(c') o
//   backward:  dc' = grad_c' + grad_h' o tanh'(c')        (the gradient of old_cell, too)
//              dG0 = dc' c^ sigmoid'(G0)   dG1 = grad_h' tanh(c') sigmoid'(G1)
//              dG2 = dc' i elu'(G2)
// The float64 PyTorch version the tests compare against is common/workbook/reference.py.

namespace {

template <typename scalar_t, typename index_t>
using Matrix = at::GenericPackedTensorAccessor<scalar_t, 2, at::RestrictPtrTraits, index_t>;
template <typename scalar_t, typename index_t>
using InputMatrix = Matrix<const scalar_t, index_t>;  // read-only

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
template <typename scalar_t, typename index_t>
__global__ void lltm_forward_kernel(InputMatrix<scalar_t, index_t> gates,
                                    InputMatrix<scalar_t, index_t> old_cell,
                                    Matrix<scalar_t, index_t> new_h,
                                    Matrix<scalar_t, index_t> new_cell) {
  using opmath_t = at::opmath_type<scalar_t>;
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
template <typename scalar_t, typename index_t>
__global__ void lltm_backward_kernel(InputMatrix<scalar_t, index_t> grad_h,
                                     InputMatrix<scalar_t, index_t> grad_cell,
                                     InputMatrix<scalar_t, index_t> new_cell,
                                     InputMatrix<scalar_t, index_t> gates,
                                     Matrix<scalar_t, index_t> d_gates,
                                     Matrix<scalar_t, index_t> d_old_cell) {
  using opmath_t = at::opmath_type<scalar_t>;
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
// Launchers: the ops' CUDA implementations.
//
// Each runs on the current stream of the inputs' device, under a guard that makes that device
// current, and checks its launch. GEMMs are ATen's (cuBLAS), on the same stream.

template <typename scalar_t, typename index_t>
Matrix<scalar_t, index_t> matrix(const at::Tensor& t) {
  return t.generic_packed_accessor<scalar_t, 2, at::RestrictPtrTraits, index_t>();
}

// The largest tensor a kernel touches is the B x 3S gates: when it fits, all the others do.
bool fits_32bit(const at::Tensor& gates) {
  return gates.numel() <= std::numeric_limits<int32_t>::max();
}

// The block: x spans the state in whole warps (the state rounded up to a multiple of 32, at most
// kThreads), y stacks the rows that fit beside it (kThreads / x). A fixed 256 x 1 block would
// leave half its threads idle at state 128 (the tutorial's size): 128 x 2 keeps every one busy,
// and state 3 takes 32 x 8. From state 225 on the block is 256 x 1, and the last block in x may
// still be mostly idle (state 257: 1 thread of 256 works), as with any fixed width.
dim3 block_for(int64_t state) {
  const int64_t x = std::min<int64_t>(workbook::ceil_div<int64_t>(state, kWarp) * kWarp, kThreads);
  return dim3(static_cast<unsigned int>(x), static_cast<unsigned int>(kThreads / x));
}

// Called with batch, state > 0 (the launchers return early on empty tensors: a grid of 0 blocks
// is an invalid launch).
dim3 grid_for(int64_t batch, int64_t state, const dim3& block) {
  return dim3(
      static_cast<unsigned int>(workbook::ceil_div<int64_t>(state, block.x)),
      static_cast<unsigned int>(std::min(workbook::ceil_div<int64_t>(batch, block.y), kMaxGridY)));
}

template <typename scalar_t, typename index_t>
void launch_forward(const at::Tensor& gates, const at::Tensor& old_cell, at::Tensor& new_h,
                    at::Tensor& new_cell) {
  const int64_t batch = old_cell.size(0), state = old_cell.size(1);
  const dim3 block = block_for(state);
  lltm_forward_kernel<scalar_t, index_t>
      <<<grid_for(batch, state, block), block, 0, c10::cuda::getCurrentCUDAStream()>>>(
          matrix<const scalar_t, index_t>(gates), matrix<const scalar_t, index_t>(old_cell),
          matrix<scalar_t, index_t>(new_h), matrix<scalar_t, index_t>(new_cell));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename index_t>
void launch_backward(const at::Tensor& grad_h, const at::Tensor& grad_cell,
                     const at::Tensor& new_cell, const at::Tensor& gates, at::Tensor& d_gates,
                     at::Tensor& d_old_cell) {
  const int64_t batch = new_cell.size(0), state = new_cell.size(1);
  const dim3 block = block_for(state);
  lltm_backward_kernel<scalar_t, index_t>
      <<<grid_for(batch, state, block), block, 0, c10::cuda::getCurrentCUDAStream()>>>(
          matrix<const scalar_t, index_t>(grad_h), matrix<const scalar_t, index_t>(grad_cell),
          matrix<const scalar_t, index_t>(new_cell), matrix<const scalar_t, index_t>(gates),
          matrix<scalar_t, index_t>(d_gates), matrix<scalar_t, index_t>(d_old_cell));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lltm_forward_cuda(const at::Tensor& input,
                                                                 const at::Tensor& weights,
                                                                 const at::Tensor& bias,
                                                                 const at::Tensor& old_h,
                                                                 const at::Tensor& old_cell) {
  workbook::lltm::check_forward_inputs(input, weights, bias, old_h, old_cell,
                                       c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const int64_t batch = old_h.size(0), state = old_h.size(1);

  const auto X = at::cat({old_h, input}, /*dim=*/1);
  const auto gates = at::addmm(bias, X, weights.t()).contiguous();  // b + X W^T
  // Accessors would cope with strides, but coalesced loads want rows that are dense: strided
  // inputs are accepted and copied once here (a no-op for contiguous ones).
  const auto cell = old_cell.contiguous();
  auto new_h = at::empty({batch, state}, cell.options());
  auto new_cell = at::empty({batch, state}, cell.options());
  // Batch 0 or state 0: nothing to compute, and a grid of 0 blocks would be an invalid launch.
  if (new_h.numel() == 0) return {new_h, new_cell, gates};

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "lltm_forward_cuda", [&] {
        if (fits_32bit(gates)) {
          launch_forward<scalar_t, int32_t>(gates, cell, new_h, new_cell);
        } else {
          launch_forward<scalar_t, int64_t>(gates, cell, new_h, new_cell);
        }
      });
  return {new_h, new_cell, gates};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lltm_backward_cuda(
    const at::Tensor& grad_h, const at::Tensor& grad_cell, const at::Tensor& new_cell,
    const at::Tensor& gates, const at::Tensor& input, const at::Tensor& old_h,
    const at::Tensor& weights) {
  workbook::lltm::check_backward_inputs(grad_h, grad_cell, new_cell, gates, input, old_h, weights,
                                        c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const int64_t batch = new_cell.size(0), state = new_cell.size(1);
  const auto grad_h_ = grad_h.contiguous(), grad_cell_ = grad_cell.contiguous(),
             new_cell_ = new_cell.contiguous(), gates_ = gates.contiguous();
  auto d_gates = at::empty({batch, 3 * state}, gates.options());
  auto d_old_cell = at::empty({batch, state}, gates.options());

  if (d_old_cell.numel() > 0) {  // else no kernel: a grid of 0 blocks is an invalid launch
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, gates.scalar_type(), "lltm_backward_cuda", [&] {
          if (fits_32bit(d_gates)) {
            launch_backward<scalar_t, int32_t>(grad_h_, grad_cell_, new_cell_, gates_, d_gates,
                                               d_old_cell);
          } else {
            launch_backward<scalar_t, int64_t>(grad_h_, grad_cell_, new_cell_, gates_, d_gates,
                                               d_old_cell);
          }
        });
  }

  // Back through G = X W^T + b. d_old_h and d_input come from their own slice of W, so each is
  // a fresh tensor rather than a view into one [d_old_h, d_input] block.
  const auto X = at::cat({old_h, input}, /*dim=*/1);
  return {d_gates.mm(weights.slice(/*dim=*/1, state)), d_gates.t().mm(X), d_gates.sum(/*dim=*/0),
          d_gates.mm(weights.slice(/*dim=*/1, 0, state)), d_old_cell};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Registration: these kernels run the library's LLTM ops for CUDA tensors, in the library
// setup.py names (OPS_NAMESPACE: `lltm` here, `extops` when stage 06 compiles this file; see
// lltm_cpu.cpp).

TORCH_LIBRARY_IMPL(OPS_NAMESPACE, CUDA, m) {
  m.impl("lltm_forward", &lltm_forward_cuda);
  m.impl("lltm_backward", &lltm_backward_cuda);
}
