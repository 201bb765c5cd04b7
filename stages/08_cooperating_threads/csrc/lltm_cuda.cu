// Stage 08: the LLTM cell on CUDA with its matrix products and bias gradient computed by kernels
// of its own, whose threads cooperate (lltm_cooperating.cuh), beside stage 05's pointwise kernels.
//
// Run card
//   build + test:  make stage 8            (compiles on any machine with nvcc; on a GPU, or on the
//                                           emulated device, which checks every barrier)
//   race check:    make racecheck 8
//   the lesson:    make diff 8             (stage 05's version of this file against this one)
//
// This file is stage 05's ATen glue with five calls changed: at::addmm and the three at::mm
// become launch_matmul, d_gates.sum(0) becomes launch_column_sums. Everything else (the checks,
// the accessors, the pointwise kernels and their launch, the registration) is stage 05's.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <tuple>

#include "lltm_cooperating.cuh"  // the tiled matrix product and the column sums
#include "lltm_cuda.cuh"         // stage 05's pointwise kernels and their launchers
#include "workbook/lltm_checks.h"

namespace {

using lltm_cooperating::launch_column_sums;
using lltm_cooperating::launch_matmul;
using lltm_cooperating::Operand;
using lltm_cuda_kernels::launch_backward;
using lltm_cuda_kernels::launch_forward;

// What the kernels index as m[b][s]: a packed accessor of a 2-D tensor. index_t is int32_t when
// every tensor has fewer than 2^31 elements, else int64_t.
template <typename scalar_t, typename index_t>
using Matrix = at::GenericPackedTensorAccessor<scalar_t, 2, at::RestrictPtrTraits, index_t>;

// ----------------------------------------------------------------------------------------------
// Launchers: the ops' CUDA implementations.
//
// Each runs on the current stream of the inputs' device, under a guard that makes that device
// current, and checks its launch. The matrix products are this stage's tiled kernel, on the same
// stream.

template <typename scalar_t, typename index_t>
Matrix<scalar_t, index_t> matrix(const at::Tensor& t) {
  return t.generic_packed_accessor<scalar_t, 2, at::RestrictPtrTraits, index_t>();
}

// The largest tensor a kernel touches is the B x 3S gates: when it fits, all the others do.
bool fits_32bit(const at::Tensor& gates) {
  return gates.numel() <= std::numeric_limits<int32_t>::max();
}

// A tensor as the tiled kernel reads it: its data and two strides (a transposed view is the same
// data, strides swapped).
template <typename scalar_t>
Operand<scalar_t> operand(const at::Tensor& t) {
  return {t.const_data_ptr<scalar_t>(), t.stride(0), t.stride(1)};
}

// a @ b (+ bias), as a new dense tensor, by the tiled kernel.
at::Tensor tiled_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias = {}) {
  auto c = at::empty({a.size(0), b.size(1)}, a.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "lltm_matmul", [&] {
    launch_matmul<scalar_t>(operand<scalar_t>(a), operand<scalar_t>(b),
                            bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr,
                            c.mutable_data_ptr<scalar_t>(), c.size(0), c.size(1), a.size(1),
                            c10::cuda::getCurrentCUDAStream());
  });
  return c;
}

// The sum of d's rows (d dense), by the block reduction.
at::Tensor column_sums(const at::Tensor& d) {
  auto sums = at::empty({d.size(1)}, d.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, d.scalar_type(), "lltm_sums", [&] {
    launch_column_sums<scalar_t>(d.const_data_ptr<scalar_t>(), sums.mutable_data_ptr<scalar_t>(),
                                 d.size(0), d.size(1), c10::cuda::getCurrentCUDAStream());
  });
  return sums;
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
  const auto gates = tiled_matmul(X, weights.t(), bias.contiguous());  // b + X W^T
  // Accessors would cope with strides, but coalesced loads want rows that are dense: strided
  // inputs are accepted and copied once here (a no-op for contiguous ones).
  const auto cell = old_cell.contiguous();
  auto new_h = at::empty({batch, state}, cell.options());
  auto new_cell = at::empty({batch, state}, cell.options());
  // Batch 0 or state 0: nothing to compute, and a grid of 0 blocks would be an invalid launch.
  if (new_h.numel() == 0) return {new_h, new_cell, gates};

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "lltm_forward_cuda", [&] {
        const auto launch = [&](auto index) {
          using index_t = decltype(index);
          launch_forward<Matrix, scalar_t, index_t>(
              matrix<const scalar_t, index_t>(gates), matrix<const scalar_t, index_t>(cell),
              matrix<scalar_t, index_t>(new_h), matrix<scalar_t, index_t>(new_cell), batch, state,
              stream);
        };
        if (fits_32bit(gates)) {
          launch(int32_t{});
        } else {
          launch(int64_t{});
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
          const auto launch = [&](auto index) {
            using index_t = decltype(index);
            launch_backward<Matrix, scalar_t, index_t>(
                matrix<const scalar_t, index_t>(grad_h_),
                matrix<const scalar_t, index_t>(grad_cell_),
                matrix<const scalar_t, index_t>(new_cell_), matrix<const scalar_t, index_t>(gates_),
                matrix<scalar_t, index_t>(d_gates), matrix<scalar_t, index_t>(d_old_cell), batch,
                state, c10::cuda::getCurrentCUDAStream());
          };
          if (fits_32bit(d_gates)) {
            launch(int32_t{});
          } else {
            launch(int64_t{});
          }
        });
  }

  // Back through G = X W^T + b. d_old_h and d_input come from their own slice of W, so each is
  // a fresh tensor rather than a view into one [d_old_h, d_input] block.
  const auto X = at::cat({old_h, input}, /*dim=*/1);
  return {tiled_matmul(d_gates, weights.slice(/*dim=*/1, state)), tiled_matmul(d_gates.t(), X),
          column_sums(d_gates), tiled_matmul(d_gates, weights.slice(/*dim=*/1, 0, state)),
          d_old_cell};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Registration: these kernels run the library's LLTM ops for CUDA tensors, in the library
// setup.py names (OPS_NAMESPACE: `lltm_coop`; stage 05's lltm.cpp declares the ops in it).

TORCH_LIBRARY_IMPL(OPS_NAMESPACE, CUDA, m) {
  m.impl("lltm_forward", &lltm_forward_cuda);
  m.impl("lltm_backward", &lltm_backward_cuda);
}
