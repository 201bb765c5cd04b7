// The emulated device's stand-in for torch's CUDA C shims, the ones stage 10's CUDA glue calls (a
// stable-ABI kernel file: it reaches CUDA through these, not through c10::cuda). The real ones
// live in a CUDA build of libtorch, declared by this header and by torch's c/shim.h under
// USE_CUDA, which an emulated build does not define:
//
//   aoti_torch_create_cuda_guard, _delete_   one device, always current: nothing to switch
//   aoti_torch_get_current_cuda_stream        the emulated stream (every launch runs to its end)
//   aoti_torch_cuda_mm_out, _addmm_out        the CPU shims (ATen's CPU kernels) on CPU tensors
//                                             over the same memory: the device's memory is host
//                                             memory, so the product is the CPU's, in place
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h>

#include <cstdint>

#include "emulated_cuda.h"

struct CUDAGuardOpaque;
using CUDAGuardHandle = CUDAGuardOpaque*;

inline AOTITorchError aoti_torch_create_cuda_guard(int32_t device_index, CUDAGuardHandle* guard) {
  *guard = nullptr;
  return device_index == 0 ? AOTI_TORCH_SUCCESS : AOTI_TORCH_FAILURE;
}

inline AOTITorchError aoti_torch_delete_cuda_guard(CUDAGuardHandle) { return AOTI_TORCH_SUCCESS; }

inline AOTITorchError aoti_torch_get_current_cuda_stream(int32_t device_index, void** stream) {
  *stream = nullptr;
  return device_index == 0 ? AOTI_TORCH_SUCCESS : AOTI_TORCH_FAILURE;
}

namespace workbook::emulate {

// A CPU tensor over t's memory, with t's sizes, strides and dtype (a new reference; the caller
// deletes it). t's data pointer already includes its storage offset.
inline AOTITorchError host_view(AtenTensorHandle t, AtenTensorHandle* view) {
  void* data = nullptr;
  int64_t dim = 0;
  int64_t *sizes = nullptr, *strides = nullptr;
  int32_t dtype = 0;
  if (aoti_torch_get_data_ptr(t, &data) != AOTI_TORCH_SUCCESS ||
      aoti_torch_get_dim(t, &dim) != AOTI_TORCH_SUCCESS ||
      aoti_torch_get_sizes(t, &sizes) != AOTI_TORCH_SUCCESS ||
      aoti_torch_get_strides(t, &strides) != AOTI_TORCH_SUCCESS ||
      aoti_torch_get_dtype(t, &dtype) != AOTI_TORCH_SUCCESS) {
    return AOTI_TORCH_FAILURE;
  }
  return aoti_torch_create_tensor_from_blob(data, dim, sizes, strides, 0, dtype,
                                            aoti_torch_device_type_cpu(), 0, view);
}

// op on the host views of `tensors`, which it then deletes.
template <int N, typename Op>
AOTITorchError on_host(const AtenTensorHandle (&tensors)[N], const Op& op) {
  AtenTensorHandle views[N] = {};
  AOTITorchError error = AOTI_TORCH_SUCCESS;
  for (int i = 0; i < N && error == AOTI_TORCH_SUCCESS; ++i)
    error = host_view(tensors[i], &views[i]);
  if (error == AOTI_TORCH_SUCCESS) error = op(views);
  for (AtenTensorHandle view : views) {
    if (view != nullptr) aoti_torch_delete_tensor_object(view);
  }
  return error;
}

}  // namespace workbook::emulate

inline AOTITorchError aoti_torch_cuda_mm_out(AtenTensorHandle out, AtenTensorHandle self,
                                             AtenTensorHandle mat2) {
  return workbook::emulate::on_host<3>({out, self, mat2}, [](const AtenTensorHandle* v) {
    return aoti_torch_cpu_mm_out(v[0], v[1], v[2]);
  });
}

inline AOTITorchError aoti_torch_cuda_addmm_out(AtenTensorHandle out, AtenTensorHandle self,
                                                AtenTensorHandle mat1, AtenTensorHandle mat2,
                                                double beta, double alpha) {
  return workbook::emulate::on_host<4>({out, self, mat1, mat2}, [&](const AtenTensorHandle* v) {
    return aoti_torch_cpu_addmm_out(v[0], v[1], v[2], v[3], beta, alpha);
  });
}
