// Stage 09: extops::ms_deform_attn and its backward on CUDA: the ATen glue of the kernels in
// ms_deform_attn_cuda.cuh beside this file.
//
// Run card
//   build + test:  make stage 9 (on a GPU; without one the kernels run on the emulated device)
//   race check:    make racecheck 9 (the backward's warp sums and the scatter, under TSan)
//
// What the glue does: the checks (workbook/ms_deform_attn.h, the same as the CPU kernels'), the
// level table's values checked on a host copy (3 L integers: a synchronisation), contiguous
// inputs, the outputs, dtype dispatch, the device guard and the current stream, registration.
// The backward's value gradient is summed in the opmath type (float for half and bfloat16),
// by atomics unless `deterministic`, then by a sorted gather (the .cuh says how).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <tuple>

#include "ms_deform_attn_cuda.cuh"  // the kernels

namespace {

using namespace ms_deform_attn_cuda_kernels;  // the kernels: this file is their ATen glue

// The deterministic backward's sort buffers of one chunk of images stay under this.
constexpr size_t kSortBudgetBytes = size_t{1} << 30;

// The level table on the host, checked against value's rows.
void check_level_table(const char* op, const Geometry& g, const at::Tensor& spatial_shapes,
                       const at::Tensor& level_start_index) {
  const auto shapes = spatial_shapes.to(at::kCPU).contiguous();
  const auto starts = level_start_index.to(at::kCPU).contiguous();
  workbook::ms_deform_attn::check_levels(op, g, shapes.const_data_ptr<int64_t>(),
                                         starts.const_data_ptr<int64_t>());
}

at::Tensor ms_deform_attn_cuda(const at::Tensor& value, const at::Tensor& spatial_shapes,
                               const at::Tensor& level_start_index,
                               const at::Tensor& sampling_locations,
                               const at::Tensor& attention_weights) {
  const Geometry g = workbook::ms_deform_attn::check_forward_inputs(
      value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
      c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard device_guard(value.device());
  check_level_table("ms_deform_attn", g, spatial_shapes, level_start_index);
  auto out = at::empty({g.batch, g.queries, g.out_row()}, value.options());
  if (out.numel() == 0) return out;
  const auto value_c = value.contiguous(), locations_c = sampling_locations.contiguous();
  const auto weights_c = attention_weights.contiguous();
  const auto shapes_c = spatial_shapes.contiguous(), starts_c = level_start_index.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, value.scalar_type(), "ms_deform_attn_cuda", [&] {
        forward<scalar_t>(
            g, shapes_c.const_data_ptr<int64_t>(), starts_c.const_data_ptr<int64_t>(),
            value_c.const_data_ptr<scalar_t>(), locations_c.const_data_ptr<scalar_t>(),
            weights_c.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), stream);
      });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights, std::array<bool, 3> output_mask, bool deterministic) {
  const Geometry g = workbook::ms_deform_attn::check_backward_inputs(
      grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
      c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard device_guard(value.device());
  check_level_table("ms_deform_attn_backward", g, spatial_shapes, level_start_index);
  const bool want_value = output_mask[0], want_locations = output_mask[1],
             want_weights = output_mask[2];
  const auto options = value.options();
  const auto acc_options = options.dtype(at::toOpMathType(value.scalar_type()));
  // Every sample writes its location and weight gradient (zeros where the point is outside),
  // so those need no zeroing; value's is a sum.
  at::Tensor grad_value_acc =
      want_value ? at::zeros(value.sizes(), acc_options) : at::empty({0}, acc_options);
  at::Tensor grad_locations =
      want_locations ? at::empty(sampling_locations.sizes(), options) : at::empty({0}, options);
  at::Tensor grad_weights =
      want_weights ? at::empty(attention_weights.sizes(), options) : at::empty({0}, options);
  if (grad_locations.numel() > 0 && g.channels == 0) grad_locations.zero_();
  if (grad_weights.numel() > 0 && g.channels == 0) grad_weights.zero_();
  const auto finish = [&]() {
    at::Tensor grad_value =
        want_value ? grad_value_acc.to(value.scalar_type()) : at::empty({0}, options);
    return std::make_tuple(grad_value, grad_locations, grad_weights);
  };
  if (g.batch * g.queries * g.heads == 0 || g.channels == 0) return finish();

  const auto grad_c = grad_output.contiguous(), value_c = value.contiguous();
  const auto locations_c = sampling_locations.contiguous();
  const auto weights_c = attention_weights.contiguous();
  const auto shapes_c = spatial_shapes.contiguous(), starts_c = level_start_index.contiguous();
  const int64_t* shapes = shapes_c.const_data_ptr<int64_t>();
  const int64_t* starts = starts_c.const_data_ptr<int64_t>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, value.scalar_type(), "ms_deform_attn_backward_cuda", [&] {
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
          auto space = at::empty({static_cast<int64_t>(SortBuffers<T>::bytes(entries))},
                                 options.dtype(at::kByte));
          const auto buffers = SortBuffers<T>::carve(space.mutable_data_ptr(), entries);
          for (int64_t n0 = 0; n0 < g.batch; n0 += images) {
            gather_value_gradient<scalar_t>(g, n0, std::min(images, g.batch - n0), shapes, starts,
                                            go, locations, weights, gv, buffers, stream);
          }
        }
      });
  return finish();
}

}  // namespace

TORCH_LIBRARY_IMPL(extops, CUDA, m) {
  m.impl("ms_deform_attn", &ms_deform_attn_cuda);
  m.impl("ms_deform_attn_backward", &ms_deform_attn_backward_cuda);
}
