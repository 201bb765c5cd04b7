// Stage 10: what the CUDA glue of the ops needs from torch's CUDA C shims, on the stable ABI.
//
//   CudaGuard              c10::cuda::CUDAGuard        aoti_torch_create_cuda_guard
//   current_stream(t)      getCurrentCUDAStream()      aoti_torch_get_current_cuda_stream
//   mm_out, addmm_out      at::mm_out, at::addmm_out   aoti_torch_cuda_mm_out, _addmm_out
//                          (cuBLAS)                    (AOTInductor's generated shims: cuBLAS)
//   dispatch_floating      AT_DISPATCH_FLOATING_TYPES_AND2(kHalf, kBFloat16, ...): a switch
//                          (stable_dtypes.h, the CPU glue's too)
//
// torch's c/shim.h declares the first two only where USE_CUDA is defined (setup.py defines it
// for a CUDA build); they and the GEMMs are symbols of libtorch_cuda, so a library built with
// them loads beside a CUDA build of torch only. On the emulated device the emulator stands in for
// all four (common/emulate/include/torch/csrc/inductor/aoti_torch/generated/c_shim_cuda.h).
#pragma once

#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cuda.h>
#include <torch/csrc/stable/tensor.h>

#include "stable_dtypes.h"
#include "workbook/checks.h"

namespace stable_cuda {

// The tensor's device is the current one until the end of the scope.
class CudaGuard {
 public:
  explicit CudaGuard(const torch::stable::Tensor& t) {
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_create_cuda_guard(t.get_device(), &guard_));
  }
  ~CudaGuard() { aoti_torch_delete_cuda_guard(guard_); }
  CudaGuard(const CudaGuard&) = delete;
  CudaGuard& operator=(const CudaGuard&) = delete;

 private:
  CUDAGuardHandle guard_ = nullptr;
};

// The stream the kernels of an op on `t` launch on: the current one of t's device.
inline cudaStream_t current_stream(const torch::stable::Tensor& t) {
  void* stream = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(t.get_device(), &stream));
  return static_cast<cudaStream_t>(stream);
}

inline void mm_out(const torch::stable::Tensor& out, const torch::stable::Tensor& a,
                   const torch::stable::Tensor& b) {
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_cuda_mm_out(out.get(), a.get(), b.get()));
}

// out = added + a @ b (`added` may be `out` itself, or broadcast to it).
inline void addmm_out(const torch::stable::Tensor& out, const torch::stable::Tensor& added,
                      const torch::stable::Tensor& a, const torch::stable::Tensor& b) {
  STABLE_TORCH_ERROR_CODE_CHECK(
      aoti_torch_cuda_addmm_out(out.get(), added.get(), a.get(), b.get(), 1.0, 1.0));
}

// The dtype switch, shared with the CPU glue (stable_dtypes.h).
using stable_dtypes::dispatch_floating;

}  // namespace stable_cuda
