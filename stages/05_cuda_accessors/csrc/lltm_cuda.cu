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
// This file is the ATen glue: the accessors, the ops (checks, the GEMMs, the launches) and their
// registration. The kernels and their launchers are lltm_cuda.cuh beside it, generic over the
// matrix type so that stage 10 compiles them too, with its own glue on the stable ABI. The input
// checks are workbook/lltm_checks.h, shared with the CPU kernel; the schemas are in lltm.cpp.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <tuple>

#include "lltm_cuda.cuh"  // the kernels and their launchers
#include "workbook/lltm_checks.h"

namespace {

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
// current, and checks its launch. GEMMs are ATen's (cuBLAS), on the same stream.

template <typename scalar_t, typename index_t>
Matrix<scalar_t, index_t> matrix(const at::Tensor& t) {
  return t.generic_packed_accessor<scalar_t, 2, at::RestrictPtrTraits, index_t>();
}

// The largest tensor a kernel touches is the B x 3S gates: when it fits, all the others do.
bool fits_32bit(const at::Tensor& gates) {
  return gates.numel() <= std::numeric_limits<int32_t>::max();
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
