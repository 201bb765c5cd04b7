// Stage 04: the LLTM cell's pointwise math as fused CUDA kernels on raw pointers.
//
// Run card
//   build + test:  make stage 4            (compiles on any machine with nvcc; runs on a GPU)
//   by hand:       cd stages/04_cuda_raw && python setup.py build   (common/ on PYTHONPATH)
//   v1 (here):     raw pointers, a flat index, one thread per (batch, state) element; the
//                  index math in 32 bits when the tensors fit, in 64 bits when they do not
//   v2 (stage 05): packed accessors, 2-D grid, plus a fused CPU kernel and torch.library ops
//
// The two GEMMs stay in ATen (cuBLAS does them better than anything we would write here); what
// this file fuses is everything between them. Stage 02 ran the pointwise part as about fifteen
// separate ATen ops, each reading and writing whole B x S tensors; here it is one kernel each way,
// reading every input once and writing every output once.
//
// Sections: reference, kernels, launchers. (The checks and the Python bindings are in lltm.cpp,
// which nvcc never sees: C++ front, CUDA back.)
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "workbook/host_device.h"
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
// The float64 PyTorch version the tests compare against is common/workbook/ops/lltm/reference.py.

namespace {

constexpr int kThreads = 256;

// ----------------------------------------------------------------------------------------------
// Kernels
//
// One thread per element n = b * S + s of the B x S state. Every tensor is contiguous (lltm.cpp
// checks it), so row b of gates starts at b * 3S and its three gates of column s sit S apart.
// Each thread divides n by S, which a GPU does in software: index_t is int32_t when the largest
// offset, into the B x 3S gates, fits in 32 bits (an inline sequence of some twenty
// instructions), and int64_t when it does not (a call to a routine several times longer): B * 3S
// can pass 2^31 on a big GPU, where a 32-bit n would wrap silently. Half and bfloat16 load into
// opmath_t (float) and compute there, as ATen's kernels do. The inputs are `const __restrict__`
// kernel parameters, so nvcc loads them through the read-only data cache (ld.global.nc).

// Bytes per element: reads gates (3) + old_cell (1), writes new_h + new_cell (2): 6 values,
// 24 B in float32 (12 B in half). About 30 FLOPs, three exp and a tanh: memory-bound on any GPU
// (an H200 moves 4.8 TB/s, so B x S = 16M float elements should take about 80 us).
template <typename scalar_t, typename index_t>
__global__ void lltm_forward_kernel(const scalar_t* __restrict__ gates,
                                    const scalar_t* __restrict__ old_cell,
                                    scalar_t* __restrict__ new_h, scalar_t* __restrict__ new_cell,
                                    index_t state, index_t numel) {
  using opmath_t = at::opmath_type<scalar_t>;
  // EXERCISE cuda-forward-kernel: element n = (b, s): new_cell[n] and new_h[n] from its 3 gates
  // checked by: test_lltm_cuda_raw.py::test_against_reference,
  //   ::test_matches_the_cpu_extension_of_stage_02, ::test_edge_cases
  const index_t n = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= numel) return;
  const index_t b = n / state, s = n - b * state;
  const scalar_t* row = gates + b * 3 * state;

  const opmath_t input_gate = workbook::sigmoid(static_cast<opmath_t>(row[s]));
  const opmath_t output_gate = workbook::sigmoid(static_cast<opmath_t>(row[state + s]));
  const opmath_t candidate = workbook::elu(static_cast<opmath_t>(row[2 * state + s]));

  const opmath_t cell = static_cast<opmath_t>(old_cell[n]) + candidate * input_gate;
  new_cell[n] = static_cast<scalar_t>(cell);
  new_h[n] = static_cast<scalar_t>(std::tanh(cell) * output_gate);
  // END EXERCISE cuda-forward-kernel
}

// Bytes per element: reads grad_h, grad_cell, new_cell, gates (3): 6 values; writes d_gates (3)
// and d_old_cell (1): 4 values. 10 values, 40 B in float32 (20 B in half). Memory-bound as well.
// The two sigmoids and the tanh are computed once each, and their derivatives from them.
template <typename scalar_t, typename index_t>
__global__ void lltm_backward_kernel(const scalar_t* __restrict__ grad_h,
                                     const scalar_t* __restrict__ grad_cell,
                                     const scalar_t* __restrict__ new_cell,
                                     const scalar_t* __restrict__ gates,
                                     scalar_t* __restrict__ d_gates,
                                     scalar_t* __restrict__ d_old_cell, index_t state,
                                     index_t numel) {
  using opmath_t = at::opmath_type<scalar_t>;
  // EXERCISE cuda-backward-kernel: element n = (b, s): d_old_cell[n] and its 3 d_gates (see above)
  // checked by: test_lltm_cuda_raw.py::test_against_reference, ::test_gradcheck
  const index_t n = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= numel) return;
  const index_t b = n / state, s = n - b * state;
  const scalar_t* row = gates + b * 3 * state;
  scalar_t* d_row = d_gates + b * 3 * state;

  const opmath_t g_input = static_cast<opmath_t>(row[s]);
  const opmath_t g_output = static_cast<opmath_t>(row[state + s]);
  const opmath_t g_candidate = static_cast<opmath_t>(row[2 * state + s]);
  const opmath_t cell = static_cast<opmath_t>(new_cell[n]);
  const opmath_t dh = static_cast<opmath_t>(grad_h[n]);

  const opmath_t input_gate = workbook::sigmoid(g_input);
  const opmath_t output_gate = workbook::sigmoid(g_output);
  const opmath_t tanh_cell = std::tanh(cell);
  // workbook::d_sigmoid and workbook::d_tanh, term for term, from the values above.
  const opmath_t d_input_gate = (opmath_t(1) - input_gate) * input_gate;
  const opmath_t d_output_gate = (opmath_t(1) - output_gate) * output_gate;
  const opmath_t d_tanh_cell = opmath_t(1) - tanh_cell * tanh_cell;

  // c' reaches the loss directly (grad_cell) and through h' = tanh(c') o.
  const opmath_t d_cell = static_cast<opmath_t>(grad_cell[n]) + dh * output_gate * d_tanh_cell;
  d_old_cell[n] = static_cast<scalar_t>(d_cell);
  d_row[s] = static_cast<scalar_t>(d_cell * workbook::elu(g_candidate) * d_input_gate);
  d_row[state + s] = static_cast<scalar_t>(dh * tanh_cell * d_output_gate);
  d_row[2 * state + s] = static_cast<scalar_t>(d_cell * input_gate * workbook::d_elu(g_candidate));
  // END EXERCISE cuda-backward-kernel
}

// Enough blocks of kThreads for numel elements; CUDA allows up to 2^31 - 1 blocks in x. Called
// with numel > 0 (the launchers return early on empty tensors: a grid of 0 blocks is an invalid
// launch).
unsigned int blocks_for(int64_t numel) {
  // EXERCISE cuda-launch: how many blocks of kThreads cover numel elements (at most INT32_MAX)
  // checked by: test_lltm_cuda_raw.py::test_against_reference, ::test_edge_cases
  const int64_t blocks = workbook::ceil_div<int64_t>(numel, kThreads);
  TORCH_CHECK(blocks <= INT32_MAX, "lltm: ", numel, " elements need more than 2^31 - 1 blocks");
  return static_cast<unsigned int>(blocks);
  // END EXERCISE cuda-launch
}

// The largest tensor a kernel indexes is the B x 3S gates: when it fits in int32, so does every
// index, n included (n < B S + kThreads).
bool fits_32bit(const at::Tensor& gates) {
  return gates.numel() <= std::numeric_limits<int32_t>::max();
}

template <typename scalar_t, typename index_t>
void launch_forward(const at::Tensor& gates, const at::Tensor& old_cell, at::Tensor& new_h,
                    at::Tensor& new_cell) {
  const int64_t numel = old_cell.numel();
  lltm_forward_kernel<scalar_t, index_t>
      <<<blocks_for(numel), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          gates.const_data_ptr<scalar_t>(), old_cell.const_data_ptr<scalar_t>(),
          new_h.mutable_data_ptr<scalar_t>(), new_cell.mutable_data_ptr<scalar_t>(),
          static_cast<index_t>(old_cell.size(1)), static_cast<index_t>(numel));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename index_t>
void launch_backward(const at::Tensor& grad_h, const at::Tensor& grad_cell,
                     const at::Tensor& new_cell, const at::Tensor& gates, at::Tensor& d_gates,
                     at::Tensor& d_old_cell) {
  const int64_t numel = new_cell.numel();
  lltm_backward_kernel<scalar_t, index_t>
      <<<blocks_for(numel), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          grad_h.const_data_ptr<scalar_t>(), grad_cell.const_data_ptr<scalar_t>(),
          new_cell.const_data_ptr<scalar_t>(), gates.const_data_ptr<scalar_t>(),
          d_gates.mutable_data_ptr<scalar_t>(), d_old_cell.mutable_data_ptr<scalar_t>(),
          static_cast<index_t>(new_cell.size(1)), static_cast<index_t>(numel));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Launchers: called by lltm.cpp once the inputs are checked (CUDA, contiguous, one device).
//
// Each runs its kernel on the current stream of the inputs' device, under a guard that makes
// that device current (a tensor on cuda:1 while cuda:0 is current would otherwise launch on the
// wrong device), and checks the launch right after it.

std::vector<at::Tensor> lltm_cuda_forward(const at::Tensor& input, const at::Tensor& weights,
                                          const at::Tensor& bias, const at::Tensor& old_h,
                                          const at::Tensor& old_cell) {
  const c10::cuda::CUDAGuard device_guard(input.device());
  const auto X = at::cat({old_h, input}, /*dim=*/1);
  const auto gates = at::addmm(bias, X, weights.t());  // b + X W^T, one cuBLAS GEMM

  auto new_h = at::empty_like(old_cell);
  auto new_cell = at::empty_like(old_cell);
  // Batch 0 or state 0: nothing to compute, and a grid of 0 blocks would be an invalid launch.
  if (old_cell.numel() == 0) return {new_h, new_cell, gates};

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "lltm_forward_cuda", [&] {
        if (fits_32bit(gates)) {
          launch_forward<scalar_t, int32_t>(gates, old_cell, new_h, new_cell);
        } else {
          launch_forward<scalar_t, int64_t>(gates, old_cell, new_h, new_cell);
        }
      });
  return {new_h, new_cell, gates};
}

std::vector<at::Tensor> lltm_cuda_backward(const at::Tensor& grad_h, const at::Tensor& grad_cell,
                                           const at::Tensor& new_cell, const at::Tensor& gates,
                                           const at::Tensor& input, const at::Tensor& old_h,
                                           const at::Tensor& weights) {
  const c10::cuda::CUDAGuard device_guard(input.device());
  auto d_gates = at::empty_like(gates);
  auto d_old_cell = at::empty_like(new_cell);

  if (new_cell.numel() > 0) {  // else no kernel: a grid of 0 blocks is an invalid launch
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, gates.scalar_type(), "lltm_backward_cuda", [&] {
          if (fits_32bit(gates)) {
            launch_backward<scalar_t, int32_t>(grad_h, grad_cell, new_cell, gates, d_gates,
                                               d_old_cell);
          } else {
            launch_backward<scalar_t, int64_t>(grad_h, grad_cell, new_cell, gates, d_gates,
                                               d_old_cell);
          }
        });
  }

  // Back through G = X W^T + b: two more GEMMs and a column sum, in ATen.
  const auto X = at::cat({old_h, input}, /*dim=*/1);
  const auto d_weights = d_gates.t().mm(X);
  const auto d_bias = d_gates.sum(/*dim=*/0);
  const auto d_X = d_gates.mm(weights);
  const int64_t features_start = old_h.size(1);
  return {d_X.slice(/*dim=*/1, features_start), d_weights, d_bias,
          d_X.slice(/*dim=*/1, 0, features_start), d_old_cell};
}
