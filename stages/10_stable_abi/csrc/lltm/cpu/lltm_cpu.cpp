// Stage 10: the LLTM ops on the CPU, on the stable ABI: stage 05's kernels, new glue.
//
// Run card
//   build + test:  make stage 10
//   the kernels:   stage 05's lltm_cpu.h, compiled here as they are; on this ABI without at::vec:
//                  their loop is vectorised by the compiler, with glibc's vector exp and tanh
//                  (workbook/cpu.h says why and how; the README measures it)
//
// What changes against stage 05's lltm_cpu.cpp (`make diff 10` shows it line by line):
//
//   at::Tensor                        torch::stable::Tensor: a handle to libtorch's tensor, read
//                                     and written through C functions (aoti_torch_get_dim, ...)
//   AT_DISPATCH_FLOATING_TYPES_AND2   a switch on the dtype (dispatch_floating, below)
//   at::cat, at::addmm, mm, sum       torch::stable's ops (empty, narrow, copy_, matmul, sum,
//                                     clone), which call the dispatcher through one C shim
//                                     (torch_call_dispatcher), and one AOTInductor C shim,
//                                     aoti_torch_cpu_addmm_out: the dispatcher shim converts no
//                                     Scalar argument (addmm's beta and alpha) in torch 2.14
//   TORCH_CHECK_TYPE, _VALUE          the same checks (workbook/lltm_checks.h), which on this
//                                     ABI throw std::runtime_error: see workbook/checks.h
//   TORCH_LIBRARY_IMPL                STABLE_TORCH_LIBRARY_IMPL, each kernel boxed by TORCH_BOX
//
// Sections: launchers (the ops), registration.
#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <stdexcept>
#include <tuple>

#include "lltm/lltm_stable.h"  // the concatenation and the backward's GEMMs
#include "lltm_cpu.h"          // the kernels: stage 05's
#include "workbook/lltm_checks.h"

namespace {

using lltm_kernels::lltm_backward_kernel;
using lltm_kernels::lltm_forward_kernel;
using lltm_stable::concat_columns;
using lltm_stable::gates_backward;
using torch::stable::Tensor;

// fn(scalar_t{}) for the dtype `type`, as AT_DISPATCH_FLOATING_TYPES_AND2(kHalf, kBFloat16, ...)
// would call its lambda: the checks have refused every other dtype by then.
template <typename Fn>
void dispatch_floating(c10::ScalarType type, const Fn& fn) {
  // EXERCISE stable-dtype-dispatch: call fn with a value of each floating dtype's C++ type
  // checked by: test_stable_abi.py::test_every_dtype_reaches_its_kernel
  switch (type) {
    case c10::ScalarType::Double:
      return fn(double{});
    case c10::ScalarType::Float:
      return fn(float{});
    case c10::ScalarType::Half:
      return fn(c10::Half{});
    case c10::ScalarType::BFloat16:
      return fn(c10::BFloat16{});
    default:
      throw std::runtime_error("lltm: no CPU kernel for dtype " + workbook::dtype_name(type));
  }
  // END EXERCISE stable-dtype-dispatch
}

// ----------------------------------------------------------------------------------------------
// Launchers: the ops' CPU implementations. GEMMs in ATen (MKL or OpenBLAS), pointwise fused.

std::tuple<Tensor, Tensor, Tensor> lltm_forward_cpu(Tensor input, Tensor weights, Tensor bias,
                                                    Tensor old_h, Tensor old_cell) {
  workbook::lltm::check_forward_inputs(input, weights, bias, old_h, old_cell, c10::DeviceType::CPU);
  const int64_t batch = old_h.size(0), state = old_h.size(1);
  const auto type = input.scalar_type();
  const auto device = input.device();

  const Tensor X = concat_columns(old_h, input);
  Tensor gates = torch::stable::empty({batch, 3 * state}, type, std::nullopt, device);
  const Tensor weights_t = torch::stable::transpose(weights, 0, 1);
  STABLE_TORCH_ERROR_CODE_CHECK(  // b + X W^T
      aoti_torch_cpu_addmm_out(gates.get(), bias.get(), X.get(), weights_t.get(), 1.0, 1.0));
  const Tensor cell = torch::stable::contiguous(old_cell);  // strided inputs: one copy here
  Tensor new_h = torch::stable::empty({batch, state}, type, std::nullopt, device);
  Tensor new_cell = torch::stable::empty({batch, state}, type, std::nullopt, device);

  dispatch_floating(type, [&](auto zero) {
    using scalar_t = decltype(zero);
    lltm_forward_kernel<scalar_t>(gates.const_data_ptr<scalar_t>(), cell.const_data_ptr<scalar_t>(),
                                  new_h.mutable_data_ptr<scalar_t>(),
                                  new_cell.mutable_data_ptr<scalar_t>(), batch, state);
  });
  return {new_h, new_cell, gates};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> lltm_backward_cpu(Tensor grad_h,
                                                                     Tensor grad_cell,
                                                                     Tensor new_cell, Tensor gates,
                                                                     Tensor input, Tensor old_h,
                                                                     Tensor weights) {
  workbook::lltm::check_backward_inputs(grad_h, grad_cell, new_cell, gates, input, old_h, weights,
                                        c10::DeviceType::CPU);
  const int64_t batch = new_cell.size(0), state = new_cell.size(1);
  const auto type = gates.scalar_type();
  const auto device = gates.device();
  const Tensor grad_h_ = torch::stable::contiguous(grad_h),
               grad_cell_ = torch::stable::contiguous(grad_cell),
               new_cell_ = torch::stable::contiguous(new_cell),
               gates_ = torch::stable::contiguous(gates);
  Tensor d_gates = torch::stable::empty({batch, 3 * state}, type, std::nullopt, device);
  Tensor d_old_cell = torch::stable::empty({batch, state}, type, std::nullopt, device);

  dispatch_floating(type, [&](auto zero) {
    using scalar_t = decltype(zero);
    lltm_backward_kernel<scalar_t>(
        grad_h_.const_data_ptr<scalar_t>(), grad_cell_.const_data_ptr<scalar_t>(),
        new_cell_.const_data_ptr<scalar_t>(), gates_.const_data_ptr<scalar_t>(),
        d_gates.mutable_data_ptr<scalar_t>(), d_old_cell.mutable_data_ptr<scalar_t>(), batch,
        state);
  });

  const auto [d_input, d_weights, d_bias, d_old_h] =  // the GEMMs: lltm/lltm_stable.h
      gates_backward(d_gates, input, old_h, weights);
  return {d_input, d_weights, d_bias, d_old_h, d_old_cell};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Registration: these kernels run the library's LLTM ops for CPU tensors. TORCH_BOX wraps each
// in the boxed calling convention the C shim registers: a stack of StableIValues in, the
// outputs written back onto it.

STABLE_TORCH_LIBRARY_IMPL(extops, CPU, m) {
  m.impl("lltm_forward", TORCH_BOX(&lltm_forward_cpu));
  m.impl("lltm_backward", TORCH_BOX(&lltm_backward_cpu));
}
