// Stage 05: the LLTM ops on the CPU: the same fusion as the CUDA kernels, as one parallel loop.
//
// Run card
//   build + test:  make stage 5            (this file builds everywhere, with or without nvcc)
//   v1 (stage 02): about fifteen ATen ops between the GEMMs, each a full pass over B x S memory
//   v2 (here):     one pass over the gates each way, split over threads with at::parallel_for,
//                  a SIMD vector at a time with at::vec: 16 floats with AVX-512, 8 with AVX2,
//                  the width ATen itself runs on the build machine (build.cpu_simd_flags())
//
// Sections: launchers (the ops), registration. The kernels are in lltm_cpu.h (stage 10 compiles
// them too, on the stable ABI), the checks in workbook/lltm_checks.h.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "lltm_cpu.h"  // the kernels
#include "workbook/lltm_checks.h"

namespace {

using lltm_kernels::lltm_backward_kernel;
using lltm_kernels::lltm_forward_kernel;

// ----------------------------------------------------------------------------------------------
// Launchers: the ops' CPU implementations. GEMMs in ATen (MKL or OpenBLAS), pointwise fused.

std::tuple<at::Tensor, at::Tensor, at::Tensor> lltm_forward_cpu(const at::Tensor& input,
                                                                const at::Tensor& weights,
                                                                const at::Tensor& bias,
                                                                const at::Tensor& old_h,
                                                                const at::Tensor& old_cell) {
  workbook::lltm::check_forward_inputs(input, weights, bias, old_h, old_cell, c10::DeviceType::CPU);
  const int64_t batch = old_h.size(0), state = old_h.size(1);

  const auto X = at::cat({old_h, input}, /*dim=*/1);
  const auto gates = at::addmm(bias, X, weights.t()).contiguous();  // b + X W^T
  const auto cell = old_cell.contiguous();  // strided inputs are accepted: one copy here
  auto new_h = at::empty({batch, state}, cell.options());
  auto new_cell = at::empty({batch, state}, cell.options());

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "lltm_forward_cpu", [&] {
        lltm_forward_kernel<scalar_t>(gates.const_data_ptr<scalar_t>(),
                                      cell.const_data_ptr<scalar_t>(),
                                      new_h.mutable_data_ptr<scalar_t>(),
                                      new_cell.mutable_data_ptr<scalar_t>(), batch, state);
      });
  return {new_h, new_cell, gates};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lltm_backward_cpu(
    const at::Tensor& grad_h, const at::Tensor& grad_cell, const at::Tensor& new_cell,
    const at::Tensor& gates, const at::Tensor& input, const at::Tensor& old_h,
    const at::Tensor& weights) {
  workbook::lltm::check_backward_inputs(grad_h, grad_cell, new_cell, gates, input, old_h, weights,
                                        c10::DeviceType::CPU);
  const int64_t batch = new_cell.size(0), state = new_cell.size(1);
  const auto grad_h_ = grad_h.contiguous(), grad_cell_ = grad_cell.contiguous(),
             new_cell_ = new_cell.contiguous(), gates_ = gates.contiguous();
  auto d_gates = at::empty({batch, 3 * state}, gates.options());
  auto d_old_cell = at::empty({batch, state}, gates.options());

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, gates.scalar_type(), "lltm_backward_cpu", [&] {
        lltm_backward_kernel<scalar_t>(
            grad_h_.const_data_ptr<scalar_t>(), grad_cell_.const_data_ptr<scalar_t>(),
            new_cell_.const_data_ptr<scalar_t>(), gates_.const_data_ptr<scalar_t>(),
            d_gates.mutable_data_ptr<scalar_t>(), d_old_cell.mutable_data_ptr<scalar_t>(), batch,
            state);
      });

  // Back through G = X W^T + b: one GEMM for d_X = [d_old_h, d_input] against the dense W, then
  // each half copied out, since an op's outputs must not alias one another. Against two GEMMs on
  // strided slices of W: 25.5 vs 26.4 ms at B 256, F 512, S 2048 on 2 threads; even at B 16.
  const auto X = at::cat({old_h, input}, /*dim=*/1);
  const auto d_X = d_gates.mm(weights);
  // clone, not contiguous(): with batch 1 a slice is already contiguous and would stay a view.
  return {d_X.slice(/*dim=*/1, state).clone(at::MemoryFormat::Contiguous), d_gates.t().mm(X),
          d_gates.sum(/*dim=*/0),
          d_X.slice(/*dim=*/1, 0, state).clone(at::MemoryFormat::Contiguous), d_old_cell};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Registration: these kernels run the library's LLTM ops for CPU tensors.
//
// Which library: OPS_NAMESPACE, which setup.py defines as the package it builds. Here that is
// `lltm` (torch.ops.lltm.lltm_forward); stage 06 compiles this same file into `extops`
// (torch.ops.extops.lltm_forward). A kernel file does not need to know which library it ends up
// in; the file that defines the library (lltm.cpp, TORCH_LIBRARY) does.

TORCH_LIBRARY_IMPL(OPS_NAMESPACE, CPU, m) {
  m.impl("lltm_forward", &lltm_forward_cpu);
  m.impl("lltm_backward", &lltm_backward_cpu);
}
