// Stage 10: the LLTM ops on CUDA, on the stable ABI: stage 05's kernels, new glue.
//
// Run card
//   build + test:  make stage 10           (compiles wherever nvcc is found; runs on a GPU, and on
//                                          the emulated device elsewhere)
//   the kernels:   stage 05's lltm_cuda.cuh, compiled here as they are, reading their matrices
//                  through RowMajor (below) instead of ATen's packed accessors
//
// What changes against stage 05's lltm_cuda.cu (`make diff 10` shows it line by line):
//
//   at::GenericPackedTensorAccessor     RowMajor: a pointer and two sizes, indexed m[b][s] as
//     (ATen's, from the tensor)           the accessor is; the kernels take either
//   AT_DISPATCH_FLOATING_TYPES_AND2     a switch on the dtype (dispatch_floating)
//   c10::cuda::CUDAGuard, the stream    aoti_torch_create_cuda_guard, _get_current_cuda_stream
//   at::cat, at::addmm                  an empty tensor and two copies; aoti_torch_cuda_addmm_out
//   mm, sum (the backward's GEMMs)      torch::stable::matmul, sum, clone (the dispatcher shim)
//   TORCH_LIBRARY_IMPL                  STABLE_TORCH_LIBRARY_IMPL, each kernel boxed by TORCH_BOX
//
// Sections: the matrix type; launchers (the ops); registration.
#include <cuda_runtime.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "lltm/lltm_stable.h"  // the concatenation and the backward's GEMMs
#include "lltm_cuda.cuh"       // the kernels and their launchers: stage 05's
#include "stable_cuda.cuh"     // the CUDA shims: guard, stream, GEMMs
#include "workbook/host_device.h"
#include "workbook/lltm_checks.h"

namespace {

using lltm_cuda_kernels::launch_backward;
using lltm_cuda_kernels::launch_forward;
using lltm_stable::concat_columns;
using lltm_stable::gates_backward;
using stable_cuda::addmm_out;
using stable_cuda::CudaGuard;
using stable_cuda::current_stream;
using stable_cuda::dispatch_floating;
using torch::stable::Tensor;

// ----------------------------------------------------------------------------------------------
// The matrix type

// What the kernels index as m[b][s]: a contiguous [rows, cols] tensor's data and sizes, passed to
// a kernel by value as an accessor is. index_t is int32_t when every tensor has fewer than 2^31
// elements, else int64_t.
template <typename T, typename index_t>
struct RowMajor {
  T* data;
  index_t rows, cols;

  WORKBOOK_HOST_DEVICE T* operator[](index_t row) const { return data + row * cols; }
  WORKBOOK_HOST_DEVICE index_t size(int dim) const { return dim == 0 ? rows : cols; }
};

template <typename T, typename index_t>
RowMajor<T, index_t> matrix(const Tensor& t) {  // t: 2-D and contiguous
  return {static_cast<T*>(t.data_ptr()), static_cast<index_t>(t.size(0)),
          static_cast<index_t>(t.size(1))};
}

// The largest tensor a kernel touches is the B x 3S gates: when it fits, all the others do.
bool fits_32bit(const Tensor& gates) {
  return gates.numel() <= std::numeric_limits<int32_t>::max();
}

// ----------------------------------------------------------------------------------------------
// Launchers: the ops' CUDA implementations, as stage 05's: checked first, under a guard for the
// input's device, on its current stream.

std::tuple<Tensor, Tensor, Tensor> lltm_forward_cuda(Tensor input, Tensor weights, Tensor bias,
                                                     Tensor old_h, Tensor old_cell) {
  workbook::lltm::check_forward_inputs(input, weights, bias, old_h, old_cell,
                                       c10::DeviceType::CUDA);
  const CudaGuard device_guard(input);
  const int64_t batch = old_h.size(0), state = old_h.size(1);
  const auto type = input.scalar_type();
  const auto device = input.device();

  const Tensor X = concat_columns(old_h, input);
  Tensor gates = torch::stable::empty({batch, 3 * state}, type, std::nullopt, device);
  addmm_out(gates, bias, X, torch::stable::transpose(weights, 0, 1));  // b + X W^T
  // Coalesced loads want rows that are dense: strided inputs are copied once here.
  const Tensor cell = torch::stable::contiguous(old_cell);
  Tensor new_h = torch::stable::empty({batch, state}, type, std::nullopt, device);
  Tensor new_cell = torch::stable::empty({batch, state}, type, std::nullopt, device);
  // Batch 0 or state 0: nothing to compute, and a grid of 0 blocks would be an invalid launch.
  if (new_h.numel() == 0) return {new_h, new_cell, gates};

  const cudaStream_t stream = current_stream(input);
  dispatch_floating(type, "lltm_forward", [&](auto zero) {
    using scalar_t = decltype(zero);
    const auto launch = [&](auto index) {
      using index_t = decltype(index);
      launch_forward<RowMajor, scalar_t, index_t>(
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

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> lltm_backward_cuda(Tensor grad_h,
                                                                      Tensor grad_cell,
                                                                      Tensor new_cell, Tensor gates,
                                                                      Tensor input, Tensor old_h,
                                                                      Tensor weights) {
  workbook::lltm::check_backward_inputs(grad_h, grad_cell, new_cell, gates, input, old_h, weights,
                                        c10::DeviceType::CUDA);
  const CudaGuard device_guard(input);
  const int64_t batch = new_cell.size(0), state = new_cell.size(1);
  const auto type = gates.scalar_type();
  const auto device = gates.device();
  const Tensor grad_h_ = torch::stable::contiguous(grad_h),
               grad_cell_ = torch::stable::contiguous(grad_cell),
               new_cell_ = torch::stable::contiguous(new_cell),
               gates_ = torch::stable::contiguous(gates);
  Tensor d_gates = torch::stable::empty({batch, 3 * state}, type, std::nullopt, device);
  Tensor d_old_cell = torch::stable::empty({batch, state}, type, std::nullopt, device);

  if (d_old_cell.numel() > 0) {  // else no kernel: a grid of 0 blocks is an invalid launch
    const cudaStream_t stream = current_stream(input);
    dispatch_floating(type, "lltm_backward", [&](auto zero) {
      using scalar_t = decltype(zero);
      const auto launch = [&](auto index) {
        using index_t = decltype(index);
        launch_backward<RowMajor, scalar_t, index_t>(
            matrix<const scalar_t, index_t>(grad_h_), matrix<const scalar_t, index_t>(grad_cell_),
            matrix<const scalar_t, index_t>(new_cell_), matrix<const scalar_t, index_t>(gates_),
            matrix<scalar_t, index_t>(d_gates), matrix<scalar_t, index_t>(d_old_cell), batch, state,
            stream);
      };
      if (fits_32bit(d_gates)) {
        launch(int32_t{});
      } else {
        launch(int64_t{});
      }
    });
  }

  const auto [d_input, d_weights, d_bias, d_old_h] =  // the GEMMs: lltm/lltm_stable.h
      gates_backward(d_gates, input, old_h, weights);
  return {d_input, d_weights, d_bias, d_old_h, d_old_cell};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Registration: these kernels run the library's LLTM ops for CUDA tensors.

STABLE_TORCH_LIBRARY_IMPL(extops, CUDA, m) {
  m.impl("lltm_forward", TORCH_BOX(&lltm_forward_cuda));
  m.impl("lltm_backward", TORCH_BOX(&lltm_backward_cuda));
}
