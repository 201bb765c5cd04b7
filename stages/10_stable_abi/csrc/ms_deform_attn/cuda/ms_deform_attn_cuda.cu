// Stage 10: extops::ms_deform_attn and its backward on CUDA, on the stable ABI: stage 09's
// kernels, new glue.
//
// Run card
//   build + test:  make stage 10           (compiles wherever nvcc is found; runs on a GPU, and on
//                                          the emulated device elsewhere)
//   race check:    make racecheck 10
//   the kernels:   stage 09's ms_deform_attn_cuda.cuh, compiled here as they are (their run card
//                  is stage 09's ms_deform_attn_cuda.cu)
//
// What changes against stage 09's ms_deform_attn_cuda.cu (`make diff 10` shows it line by line):
//
//   at::Tensor                          torch::stable::Tensor
//   AT_DISPATCH_FLOATING_TYPES_AND2     a switch on the dtype (dispatch_floating: stable_dtypes.h)
//   c10::cuda::CUDAGuard                aoti_torch_create_cuda_guard (CudaGuard: stable_cuda.cuh)
//   c10::cuda::getCurrentCUDAStream()   aoti_torch_get_current_cuda_stream
//   t.to(at::kCPU), .to(dtype)          torch::stable::to (the dispatcher shim)
//   at::zeros, at::empty                torch::stable::empty, and zero_
//   at::toOpMathType                    opmath_type (stable_dtypes.h)
//   std::array<bool, 3> output_mask     std::vector<bool>, its length checked here
//   TORCH_LIBRARY_IMPL                  STABLE_TORCH_LIBRARY_IMPL, each kernel boxed by TORCH_BOX
//
// Sections: the level table; launchers (the ops); registration.
#include <cuda_runtime.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "ms_deform_attn_cuda.cuh"  // the kernels and their launchers: stage 09's
#include "stable_cuda.cuh"          // the CUDA shims: guard, stream; the dtype switch

namespace {

using namespace ms_deform_attn_cuda_kernels;  // the kernels: this file is their stable-ABI glue
using stable_cuda::CudaGuard;
using stable_cuda::current_stream;
using stable_cuda::dispatch_floating;
using stable_dtypes::opmath_type;
using torch::stable::Tensor;

// The deterministic backward's sort buffers of one chunk of images stay under this.
constexpr size_t kSortBudgetBytes = size_t{1} << 30;

// ----------------------------------------------------------------------------------------------
// The level table

// The level table on the host, checked against value's rows (3 L integers: a synchronisation).
void check_level_table(const char* op, const Geometry& g, const Tensor& spatial_shapes,
                       const Tensor& level_start_index) {
  const torch::stable::Device host(c10::DeviceType::CPU);
  const Tensor shapes = torch::stable::contiguous(torch::stable::to(spatial_shapes, host));
  const Tensor starts = torch::stable::contiguous(torch::stable::to(level_start_index, host));
  workbook::ms_deform_attn::check_levels(op, g, shapes.const_data_ptr<int64_t>(),
                                         starts.const_data_ptr<int64_t>());
}

// ----------------------------------------------------------------------------------------------
// Launchers: the ops' CUDA implementations, as stage 09's: checked first, under a guard for
// value's device, on its current stream.

Tensor empty(torch::headeronly::IntHeaderOnlyArrayRef sizes, c10::ScalarType type,
             const Tensor& like) {
  return torch::stable::empty(sizes, type, std::nullopt, like.device());
}

Tensor ms_deform_attn_cuda(const Tensor& value, const Tensor& spatial_shapes,
                           const Tensor& level_start_index, const Tensor& sampling_locations,
                           const Tensor& attention_weights) {
  const Geometry g = workbook::ms_deform_attn::check_forward_inputs(
      value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
      c10::DeviceType::CUDA);
  const CudaGuard device_guard(value);
  check_level_table("ms_deform_attn", g, spatial_shapes, level_start_index);
  Tensor out = empty({g.batch, g.queries, g.out_row()}, value.scalar_type(), value);
  if (out.numel() == 0) return out;
  const Tensor value_c = torch::stable::contiguous(value);
  const Tensor locations_c = torch::stable::contiguous(sampling_locations);
  const Tensor weights_c = torch::stable::contiguous(attention_weights);
  const Tensor shapes_c = torch::stable::contiguous(spatial_shapes);
  const Tensor starts_c = torch::stable::contiguous(level_start_index);
  const cudaStream_t stream = current_stream(value);
  dispatch_floating(value.scalar_type(), "ms_deform_attn", [&](auto zero) {
    using scalar_t = decltype(zero);
    forward<scalar_t>(g, shapes_c.const_data_ptr<int64_t>(), starts_c.const_data_ptr<int64_t>(),
                      value_c.const_data_ptr<scalar_t>(), locations_c.const_data_ptr<scalar_t>(),
                      weights_c.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
                      stream);
  });
  return out;
}

std::tuple<Tensor, Tensor, Tensor> ms_deform_attn_backward_cuda(
    const Tensor& grad_output, const Tensor& value, const Tensor& spatial_shapes,
    const Tensor& level_start_index, const Tensor& sampling_locations,
    const Tensor& attention_weights, std::vector<bool> output_mask, bool deterministic) {
  const Geometry g = workbook::ms_deform_attn::check_backward_inputs(
      grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
      c10::DeviceType::CUDA);
  WORKBOOK_CHECK_VALUE(output_mask.size() == 3,
                       workbook::text("ms_deform_attn_backward: `output_mask` must have 3 values "
                                      "(value, sampling_locations, attention_weights), got ",
                                      output_mask.size()));
  const CudaGuard device_guard(value);
  check_level_table("ms_deform_attn_backward", g, spatial_shapes, level_start_index);
  const bool want_value = output_mask[0], want_locations = output_mask[1],
             want_weights = output_mask[2];
  const auto type = value.scalar_type(), acc_type = opmath_type(type);
  // Every sample writes its location and weight gradient (zeros where the point is outside),
  // so those need no zeroing; value's is a sum.
  Tensor grad_value_acc = empty({0}, acc_type, value);
  if (want_value) {
    grad_value_acc = empty(value.sizes(), acc_type, value);
    torch::stable::zero_(grad_value_acc);
  }
  const auto result = [&](bool wanted, const Tensor& like) {
    return wanted ? empty(like.sizes(), type, value) : empty({0}, type, value);
  };
  Tensor grad_locations = result(want_locations, sampling_locations);
  Tensor grad_weights = result(want_weights, attention_weights);
  if (grad_locations.numel() > 0 && g.channels == 0) torch::stable::zero_(grad_locations);
  if (grad_weights.numel() > 0 && g.channels == 0) torch::stable::zero_(grad_weights);
  const auto finish = [&]() {
    Tensor grad_value =
        want_value ? torch::stable::to(grad_value_acc, type) : empty({0}, type, value);
    return std::make_tuple(grad_value, grad_locations, grad_weights);
  };
  if (g.batch * g.queries * g.heads == 0 || g.channels == 0) return finish();

  const Tensor grad_c = torch::stable::contiguous(grad_output);
  const Tensor value_c = torch::stable::contiguous(value);
  const Tensor locations_c = torch::stable::contiguous(sampling_locations);
  const Tensor weights_c = torch::stable::contiguous(attention_weights);
  const Tensor shapes_c = torch::stable::contiguous(spatial_shapes);
  const Tensor starts_c = torch::stable::contiguous(level_start_index);
  const int64_t* shapes = shapes_c.const_data_ptr<int64_t>();
  const int64_t* starts = starts_c.const_data_ptr<int64_t>();
  const cudaStream_t stream = current_stream(value);
  dispatch_floating(type, "ms_deform_attn_backward", [&](auto zero) {
    using scalar_t = decltype(zero);
    using T = opmath_t<scalar_t>;
    const scalar_t* go = grad_c.const_data_ptr<scalar_t>();
    const scalar_t* locations = locations_c.const_data_ptr<scalar_t>();
    const scalar_t* weights = weights_c.const_data_ptr<scalar_t>();
    T* gv = want_value ? grad_value_acc.mutable_data_ptr<T>() : nullptr;
    if (want_locations || want_weights || (want_value && !deterministic)) {
      backward_atomic<scalar_t>(
          g, shapes, starts, go, value_c.const_data_ptr<scalar_t>(), locations, weights,
          deterministic ? nullptr : gv,
          want_locations ? grad_locations.mutable_data_ptr<scalar_t>() : nullptr,
          want_weights ? grad_weights.mutable_data_ptr<scalar_t>() : nullptr, stream);
    }
    if (want_value && deterministic) {
      const int64_t images = images_per_chunk<T>(g, kSortBudgetBytes);
      const int64_t entries = 4 * images * g.queries * g.heads * g.levels * g.points;
      // One allocation on the device, from torch's allocator, carved up by SortBuffers.
      Tensor space = empty({static_cast<int64_t>(SortBuffers<T>::bytes(entries))},
                           c10::ScalarType::Byte, value);
      const auto buffers = SortBuffers<T>::carve(space.data_ptr(), entries);
      for (int64_t n0 = 0; n0 < g.batch; n0 += images) {
        gather_value_gradient<scalar_t>(g, n0, std::min(images, g.batch - n0), shapes, starts, go,
                                        locations, weights, gv, buffers, stream);
      }
    }
  });
  return finish();
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Registration: these kernels run the extops ms_deform_attn ops for CUDA tensors.

STABLE_TORCH_LIBRARY_IMPL(extops, CUDA, m) {
  m.impl("ms_deform_attn", TORCH_BOX(&ms_deform_attn_cuda));
  m.impl("ms_deform_attn_backward", TORCH_BOX(&ms_deform_attn_backward_cuda));
}
