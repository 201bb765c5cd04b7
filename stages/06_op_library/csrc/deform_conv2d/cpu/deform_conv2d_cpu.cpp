// Stage 06: extops::deform_conv2d and its backward on the CPU: deterministic, thread-parallel.
//
// Run card
//   build + test:  make stage 6            (this file builds everywhere, with or without nvcc)
//   scratch:       torch.utils.cpp_extension.load of ../deform_conv2d.cpp and this file, with
//                  workbook.build's cxx_flags() + openmp_flags() + cpu_simd_flags()
//   timings:       forward | forward + backward, N 4, C = O = 64, 56 x 56, 3 x 3, pad 1, mask,
//                  float32, 1 | 2 threads of a 2-core AVX-512 machine (median, interleaved)
//   v0 torchvision 0.29: one bilinear sample per (channel, tap, position) in serial loops, ~85%
//                  of its time; the backward the same        100 | 855 ms, 97 | 877 ms
//   v1:            the sampling computed once per (image, offset group, tap, position) into a
//                  table every channel reuses; classic im2col columns [C kh kw, Ho Wo], so an
//                  entry is 4 gathers from one channel plane, which gcc leaves scalar (its generic
//                  tuning avoids AVX-512 gathers, slow on many CPUs)
//                                                             22 | 84 ms, 11.3 | 44 ms
//   v2 (here):     the same table, with the input and the columns channels-last: a position's
//                  column row is [kh kw][C], so one sample's 4 corners are 4 contiguous runs of
//                  channels, blended with plain vector loads and FMAs. The GEMMs read the columns
//                  transposed, which BLAS does for free      17 | 60 ms, 8.9 | 31 ms
//                  (F.conv2d of the same shape: 8.7 | 28.5 ms, 4.3 | 14.6 ms)
//   Every pass is an at::parallel_for over tasks that each own their outputs: no atomics, and
//   bitwise the same results run to run and for any number of threads.
//
// Napkin math (N 4, C = O = 64, 56 x 56, 3 x 3, pad 1, float32; per image):
//   columns Ho Wo x kh kw C = 3136 x 576 = 1.8M floats (7.2 MB), each 4 loads + 4 FMAs, 16 at a
//   time; the 4 corner runs (256 B each) come from a 0.9 MB padded image, mostly in L2. Written
//   once and read once by the GEMM: 14 MB of traffic, ~1 ms at ~15 GB/s.
//   GEMM O x Ho Wo x C kh kw: 2 x 64 x 3136 x 576 = 231 MFLOP, ~2.6 ms at ~90 GFLOP/s a core:
//   the forward is GEMM-bound once the sampling is vectorised, as a plain conv2d is.
//   backward: two GEMMs of that size (grad columns, grad weight), im2col again, a scatter of 4
//   vector read-modify-writes per sample and run of channels, and 4 dot products per sample for
//   the offset and mask gradients.
//
// Sections: GEMMs, launchers (the ops), registration. The kernels are in deform_conv2d_cpu.h
// beside this file (compiled by stage 10 too, on the stable ABI), the checks in
// workbook/deform_conv2d.h and the bilinear arithmetic in workbook/bilinear.h, both shared with
// the CUDA kernels of stage 07.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <tuple>

#include "deform_conv2d_cpu.h"  // the kernels

namespace {

using namespace deform_conv2d_kernels;  // the kernels: this file is their ATen glue
using workbook::deform_conv2d::ChunkPlan;
using workbook::deform_conv2d::for_each_chunk;

// ----------------------------------------------------------------------------------------------
// GEMMs
//
// On tensor views made inside the tasks. The guard skips the autograd and
// ADInplaceOrView kernels, which at::parallel_for's worker threads would otherwise run: they do
// not inherit the caller's dispatch state (an out= op would then refuse a weight that requires
// grad, or an inference tensor).
//
// weight3 [groups, O / groups, K C / groups] (the weight permuted to [O, kh, kw, C / groups]),
// columns3 [images, Pc, C K], output4 and grad_output4 [N, groups, O / groups, P].

// output[n, gw, :, p0 + block] (+)= W_gw @ columns[i, block, gw]^T, written in place into the
// NCHW output: its rows are P apart, which BLAS takes as the leading dimension.
void forward_gemm(const at::Tensor& weight3, const std::optional<at::Tensor>& bias3,
                  const at::Tensor& columns3, const at::Tensor& output4, const Chunk& ch) {
  const int64_t groups = weight3.size(0), width = weight3.size(2);
  const int64_t blocks = ceil_div(ch.positions, kGemmPositions);
  if (weight3.size(1) == 0) return;  // no output channel
  at::parallel_for(0, ch.images * groups * blocks, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView guard;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / (groups * blocks), gw = (t / blocks) % groups;
      const int64_t q0 = (t % blocks) * kGemmPositions;
      const int64_t len = std::min(kGemmPositions, ch.positions - q0);
      const auto cols = columns3.select(0, i).narrow(0, q0, len).narrow(1, gw * width, width);
      auto out = output4.select(0, ch.n0 + i).select(0, gw).narrow(1, ch.p0 + q0, len);
      if (bias3) {
        at::addmm_out(out, bias3->select(0, gw), weight3.select(0, gw), cols.t());
      } else {
        at::mm_out(out, weight3.select(0, gw), cols.t());
      }
    }
  });
}

// grad_columns[i, block, gw] = grad_output[n, gw, :, p0 + block]^T @ W_gw.
void columns_gradient_gemm(const at::Tensor& weight3, const at::Tensor& grad_output4,
                           const at::Tensor& grad_columns3, const Chunk& ch) {
  const int64_t groups = weight3.size(0), width = weight3.size(2);
  const int64_t blocks = ceil_div(ch.positions, kGemmPositions);
  at::parallel_for(0, ch.images * groups * blocks, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView guard;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / (groups * blocks), gw = (t / blocks) % groups;
      const int64_t q0 = (t % blocks) * kGemmPositions;
      const int64_t len = std::min(kGemmPositions, ch.positions - q0);
      auto out = grad_columns3.select(0, i).narrow(0, q0, len).narrow(1, gw * width, width);
      const auto grad = grad_output4.select(0, ch.n0 + i).select(0, gw).narrow(1, ch.p0 + q0, len);
      at::mm_out(out, grad.t(), weight3.select(0, gw));
    }
  });
}

// grad_weight[gw][:, block] += grad_output_chunk[gw] @ columns[:, gw block], one BLAS call per
// task and chunk: grad_output_chunk [groups, O / groups, images Pc] is the chunk's grad_output
// gathered image after image, so that the reduction runs over the images and positions of the
// chunk at once, as the columns' rows do. It is never split within a chunk; across chunks the
// order is the chunks', fixed by the memory budget alone.
void weight_gradient_gemm(const at::Tensor& grad_weight3, const at::Tensor& grad_output_chunk3,
                          const at::Tensor& columns2) {
  const int64_t groups = grad_weight3.size(0), width = grad_weight3.size(2);
  const int64_t blocks = ceil_div(width, kWeightGradColumns);
  if (grad_weight3.size(1) == 0) return;
  at::parallel_for(0, groups * blocks, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView guard;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t gw = t / blocks, r0 = (t % blocks) * kWeightGradColumns;
      const int64_t len = std::min(kWeightGradColumns, width - r0);
      auto out = grad_weight3.select(0, gw).narrow(1, r0, len);
      at::addmm_out(out, out, grad_output_chunk3.select(0, gw),
                    columns2.narrow(1, gw * width + r0, len));
    }
  });
}

// ----------------------------------------------------------------------------------------------
// Launchers: the ops' CPU implementations.
//
// Half and bfloat16 are computed in float: every input is converted once on entry and the
// results once on exit, so sampling coordinates and all accumulation are float. float and
// double run natively. Inputs of any layout are accepted: each is copied once into the layout
// above (for the input, with the padding), which costs little next to the columns.

at::Tensor in_compute_type(const at::Tensor& t, at::ScalarType type) {
  return t.detach().to(type).contiguous();
}

// [N, C, H, W] -> [N, H + 3, W + 2, C], zero border, compute type.
at::Tensor padded_channels_last(const at::Tensor& input, const Geometry& g, at::ScalarType type) {
  auto padded =
      at::zeros({g.batch, g.height + 3, g.width + 2, g.in_channels}, input.options().dtype(type));
  padded.narrow(1, 1, g.height).narrow(2, 1, g.width).copy_(input.detach().permute({0, 2, 3, 1}));
  return padded;
}

// The inverse, for grad_input: the image's pixels back into a contiguous NCHW tensor.
at::Tensor unpadded(const at::Tensor& padded, const Geometry& g, const at::TensorOptions& options) {
  auto out = at::empty({g.batch, g.in_channels, g.height, g.width}, options);
  out.copy_(padded.view({g.batch, g.height + 3, g.width + 2, g.in_channels})
                .narrow(1, 1, g.height)
                .narrow(2, 1, g.width)
                .permute({0, 3, 1, 2}));
  return out;
}

// [O, C / groups, kh, kw] -> [groups, O / groups, kh kw C / groups], the columns' order.
at::Tensor weight_by_tap(const at::Tensor& weight, const Geometry& g, at::ScalarType type) {
  return in_compute_type(weight.permute({0, 2, 3, 1}), type)
      .view({g.groups, g.out_channels_per_group(), g.taps() * g.channels_per_group()});
}

std::optional<at::Tensor> defined_or_null(const std::optional<at::Tensor>& t) {
  return (t.has_value() && t->defined()) ? t : std::nullopt;
}

at::Tensor deform_conv2d_cpu(const at::Tensor& input, const at::Tensor& offset,
                             const at::Tensor& weight, const std::optional<at::Tensor>& bias_in,
                             at::IntArrayRef stride, at::IntArrayRef padding,
                             at::IntArrayRef dilation, const std::optional<at::Tensor>& mask_in) {
  const Geometry g = workbook::deform_conv2d::check_forward_inputs(
      input, offset, weight, bias_in, stride, padding, dilation, mask_in, c10::DeviceType::CPU);
  const auto bias = defined_or_null(bias_in);
  const auto mask = defined_or_null(mask_in);
  const at::ScalarType type = compute_type(input.scalar_type());
  const auto typed = input.options().dtype(type);

  auto output = at::empty({g.batch, g.out_channels, g.out_h, g.out_w}, typed);
  if (g.batch > 0 && g.out_channels > 0) {
    const PaddedPlane plane(g);
    const auto input_c = padded_channels_last(input, g, type);
    const auto offset_c = in_compute_type(offset, type);
    const auto mask_c = mask ? std::optional(in_compute_type(*mask, type)) : std::nullopt;
    const auto weight3 = weight_by_tap(weight, g, type);
    const auto bias3 =
        bias ? std::optional(
                   in_compute_type(*bias, type).view({g.groups, g.out_channels_per_group(), 1}))
             : std::nullopt;
    const auto output4 =
        output.view({g.batch, g.groups, g.out_channels_per_group(), g.positions()});
    const ColumnLayout layout(g);
    const int64_t K = g.taps();

    AT_DISPATCH_FLOATING_TYPES(type, "deform_conv2d_cpu", [&] {
      using T = scalar_t;
      const Problem<T> pb{g,
                          plane,
                          &layout,
                          input_c.const_data_ptr<T>(),
                          offset_c.const_data_ptr<T>(),
                          mask_c ? mask_c->const_data_ptr<T>() : nullptr};
      const ChunkPlan plan = plan_forward<T>(g, layout);
      const int64_t positions = plan.most_positions(g);
      auto base = at::empty({positions * g.offset_groups * K}, typed.dtype(at::kLong));
      auto weights = at::empty({4 * positions * g.offset_groups * K}, typed);
      auto columns = at::empty({positions * layout.width}, typed);
      for_each_chunk(g, plan, [&](const Chunk& ch) {
        build_sample_table<T>(pb, ch, base.mutable_data_ptr<int64_t>(),
                              weights.mutable_data_ptr<T>());
        sample_columns<T>(pb, ch, base.const_data_ptr<int64_t>(), weights.const_data_ptr<T>(),
                          columns.mutable_data_ptr<T>());
        const auto columns3 = columns.narrow(0, 0, ch.images * ch.positions * layout.width)
                                  .view({ch.images, ch.positions, layout.width});
        forward_gemm(weight3, bias3, columns3, output4, ch);
      });
    });
  }
  return output.to(input.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> deform_conv2d_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& weight, const std::optional<at::Tensor>& mask_in, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, std::array<bool, 5> output_mask,
    bool /*deterministic: the CPU kernels are, always*/) {
  const Geometry g = workbook::deform_conv2d::check_backward_inputs(
      grad_output, input, offset, weight, mask_in, stride, padding, dilation, c10::DeviceType::CPU);
  const auto mask = defined_or_null(mask_in);
  const bool want_input = output_mask[0], want_offset = output_mask[1],
             want_weight = output_mask[2], want_bias = output_mask[3],
             want_mask = output_mask[4] && mask.has_value();
  // grad_input, grad_offset and grad_mask all start from the gradient of the columns.
  const bool want_columns_grad = want_input || want_offset || want_mask;
  const at::ScalarType type = compute_type(input.scalar_type());
  const auto options = input.options();
  const auto typed = options.dtype(type);
  const int64_t P = g.positions(), K = g.taps();

  // Unwanted results are empty [0] tensors (the schema's convention).
  at::Tensor grad_input = at::empty({0}, options), grad_offset = at::empty({0}, options),
             grad_weight = at::empty({0}, options), grad_bias = at::empty({0}, options),
             grad_mask = at::empty({0}, options);
  if (!(want_columns_grad || want_weight || want_bias)) {
    return {grad_input, grad_offset, grad_weight, grad_bias, grad_mask};
  }
  const auto grad_output_c = in_compute_type(grad_output, type);
  if (want_bias) {
    auto bias_c = at::empty({g.out_channels}, typed);
    AT_DISPATCH_FLOATING_TYPES(type, "deform_conv2d_backward_cpu_bias", [&] {
      sum_bias_gradient<scalar_t>(grad_output_c.const_data_ptr<scalar_t>(),
                                  bias_c.mutable_data_ptr<scalar_t>(), g.batch, g.out_channels, P);
    });
    grad_bias = bias_c.to(input.scalar_type());
  }
  if (!(want_columns_grad || want_weight)) {
    return {grad_input, grad_offset, grad_weight, grad_bias, grad_mask};
  }

  // Results in the compute type. grad_offset and grad_mask are written exactly once per element,
  // so they need no zero fill; grad_input is the padded channels-last accumulator.
  at::Tensor grad_input_c, grad_offset_c, grad_weight_c, grad_mask_c;
  if (want_offset) {
    grad_offset_c = at::empty({g.batch, 2 * g.offset_groups * K, g.out_h, g.out_w}, typed);
  }
  if (want_mask) grad_mask_c = at::empty({g.batch, g.offset_groups * K, g.out_h, g.out_w}, typed);
  if (want_weight) {  // in the columns' order, [O, kh, kw, C / groups]
    grad_weight_c =
        at::zeros({g.out_channels, g.kernel_h, g.kernel_w, g.channels_per_group()}, typed);
  }

  if (g.batch > 0) {
    const PaddedPlane plane(g);
    if (want_input) grad_input_c = at::zeros({g.batch, plane.size, g.in_channels}, typed);
    // Convert only what some pass reads: the input feeds im2col (for grad_weight) and the
    // offset pass; the weight feeds the grad-columns GEMM.
    const bool read_input = want_weight || want_offset || want_mask;
    const auto input_c = read_input ? padded_channels_last(input, g, type) : at::Tensor();
    const auto offset_c = in_compute_type(offset, type);
    const auto mask_c = mask ? std::optional(in_compute_type(*mask, type)) : std::nullopt;
    const auto weight3 = want_columns_grad ? weight_by_tap(weight, g, type) : at::Tensor();
    const auto grad_output4 =
        grad_output_c.view({g.batch, g.groups, g.out_channels_per_group(), P});
    const auto grad_weight3 =
        want_weight
            ? grad_weight_c.view({g.groups, g.out_channels_per_group(), K * g.channels_per_group()})
            : at::Tensor();
    const ColumnLayout layout(g);

    AT_DISPATCH_FLOATING_TYPES(type, "deform_conv2d_backward_cpu", [&] {
      using T = scalar_t;
      const Problem<T> pb{g,
                          plane,
                          &layout,
                          read_input ? input_c.const_data_ptr<T>() : nullptr,
                          offset_c.const_data_ptr<T>(),
                          mask_c ? mask_c->const_data_ptr<T>() : nullptr};
      const ChunkPlan plan = plan_backward<T>(g, layout, want_weight, want_columns_grad);
      const int64_t positions = plan.most_positions(g);
      auto base = at::empty({positions * g.offset_groups * K}, options.dtype(at::kLong));
      auto weights = at::empty({4 * positions * g.offset_groups * K}, typed);
      auto columns = want_weight ? at::empty({positions * layout.width}, typed) : at::Tensor();
      auto grad_columns =
          want_columns_grad ? at::empty({positions * layout.width}, typed) : at::Tensor();

      for_each_chunk(g, plan, [&](const Chunk& ch) {
        const int64_t chunk_columns = ch.images * ch.positions * layout.width;
        const std::array<int64_t, 3> shape3{ch.images, ch.positions, layout.width};
        build_sample_table<T>(pb, ch, base.mutable_data_ptr<int64_t>(),
                              weights.mutable_data_ptr<T>());
        if (want_weight) {
          sample_columns<T>(pb, ch, base.const_data_ptr<int64_t>(), weights.const_data_ptr<T>(),
                            columns.mutable_data_ptr<T>());
          const auto grad_output_chunk =
              grad_output_c.view({g.batch, g.out_channels, P})
                  .narrow(0, ch.n0, ch.images)
                  .narrow(2, ch.p0, ch.positions)
                  .permute({1, 0, 2})
                  .contiguous()
                  .view({g.groups, g.out_channels_per_group(), ch.images * ch.positions});
          weight_gradient_gemm(
              grad_weight3, grad_output_chunk,
              columns.narrow(0, 0, chunk_columns).view({ch.images * ch.positions, layout.width}));
        }
        if (!want_columns_grad) return;
        columns_gradient_gemm(weight3, grad_output4,
                              grad_columns.narrow(0, 0, chunk_columns).view(shape3), ch);
        if (want_input) {
          scatter_columns<T>(pb, ch, base.const_data_ptr<int64_t>(), weights.const_data_ptr<T>(),
                             grad_columns.const_data_ptr<T>(), grad_input_c.mutable_data_ptr<T>());
        }
        if (want_offset || want_mask) {
          offset_and_mask_gradients<T>(pb, ch, base.const_data_ptr<int64_t>(),
                                       grad_columns.const_data_ptr<T>(),
                                       want_offset ? grad_offset_c.mutable_data_ptr<T>() : nullptr,
                                       want_mask ? grad_mask_c.mutable_data_ptr<T>() : nullptr);
        }
      });
    });
  }

  if (want_input) {
    grad_input = g.batch > 0 ? unpadded(grad_input_c, g, options)
                             : at::empty({0, g.in_channels, g.height, g.width}, options);
  }
  if (want_offset) grad_offset = grad_offset_c.to(input.scalar_type());
  if (want_weight) {
    grad_weight = at::empty(weight.sizes(), options);
    grad_weight.copy_(grad_weight_c.permute({0, 3, 1, 2}));
  }
  if (want_mask) grad_mask = grad_mask_c.to(input.scalar_type());
  return {grad_input, grad_offset, grad_weight, grad_bias, grad_mask};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Registration: these kernels run the extops deform_conv2d ops for CPU tensors.

TORCH_LIBRARY_IMPL(extops, CPU, m) {
  m.impl("deform_conv2d", &deform_conv2d_cpu);
  m.impl("deform_conv2d_backward", &deform_conv2d_backward_cpu);
}
