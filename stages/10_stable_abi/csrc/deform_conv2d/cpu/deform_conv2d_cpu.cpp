// Stage 10: extops::deform_conv2d and its backward on the CPU, on the stable ABI: stage 06's
// kernels, new glue.
//
// Run card
//   build + test:  make stage 10
//   the kernels:   stage 06's deform_conv2d_cpu.h, compiled here as they are (its run card, timings
//                  and napkin math are stage 06's deform_conv2d_cpu.cpp); the one part that
//                  differs on this ABI is the offset gradient's dot products, a SIMD reduction the
//                  compiler writes instead of at::vec (CornerDots)
//   timings:       make bench OP=deform_conv2d (this stage against stage 07's ATen build)
//
// What changes against stage 06's deform_conv2d_cpu.cpp (`make diff 10` shows it line by line):
//
//   at::Tensor                        torch::stable::Tensor
//   AT_DISPATCH_FLOATING_TYPES        a switch on the compute type (dispatch_compute_type)
//   t.detach().to(type).contiguous()  torch::stable::to and contiguous (the dispatcher shim; the
//                                     kernel runs below autograd, so there is nothing to detach)
//   at::zeros, permute, copy_, view   torch::stable::empty, zero_, permute, copy_, view
//   at::mm_out, at::addmm_out on      aoti_torch_cpu_mm_out, aoti_torch_cpu_addmm_out on
//     select/narrow views               matrices made with torch::stable::from_blob over the
//                                       buffers' memory. These shims call ATen's CPU kernels
//                                       directly, not through the dispatcher, so the worker
//                                       threads need no dispatch-key guard
//   TORCH_CHECK (the padded copy)     WORKBOOK_CHECK (workbook/checks.h): std::runtime_error
//   TORCH_LIBRARY_IMPL                STABLE_TORCH_LIBRARY_IMPL, each kernel boxed by TORCH_BOX
//
// The schedule, the buffers, the chunks and the order of every sum are stage 06's, so the
// results are bitwise the same run to run and for any number of threads here too.
//
// Sections: GEMMs, launchers (the ops), registration.
#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "deform_conv2d_cpu.h"  // the kernels: stage 06's

namespace {

using namespace deform_conv2d_kernels;  // the kernels: this file is their stable-ABI glue
using torch::stable::Tensor;
using workbook::deform_conv2d::ChunkPlan;
using workbook::deform_conv2d::for_each_chunk;
using ScalarType = c10::ScalarType;

// ----------------------------------------------------------------------------------------------
// GEMMs
//
// On matrices over the buffers' memory, made inside the tasks: matrix(t, offset, rows, cols,
// row_stride, col_stride) is the [rows, cols] matrix starting `offset` elements into contiguous
// `t`, what stage 06 makes with select and narrow. The tasks and their blocks are stage 06's.
//
// weight3 [groups, O / groups, K C / groups] (the weight permuted to [O, kh, kw, C / groups]),
// columns [images, Pc, C K], output and grad_output [N, groups, O / groups, P].

Tensor matrix(const Tensor& t, int64_t offset, int64_t rows, int64_t cols, int64_t row_stride,
              int64_t col_stride) {
  return torch::stable::from_blob(t.data_ptr(), {rows, cols}, {row_stride, col_stride}, t.device(),
                                  t.scalar_type(), offset);
}

// output[n, gw, :, p0 + block] (+)= W_gw @ columns[i, block, gw]^T, written in place into the
// NCHW output: its rows are P apart, which BLAS takes as the leading dimension.
void forward_gemm(const Geometry& g, const Tensor& weight3, const std::optional<Tensor>& bias,
                  const Tensor& columns, const Tensor& output, const Chunk& ch) {
  const int64_t groups = g.groups, rows = g.out_channels_per_group(), P = g.positions();
  const int64_t width = g.taps() * g.channels_per_group(), row = g.groups * width;
  const int64_t blocks = ceil_div(ch.positions, kGemmPositions);
  if (rows == 0) return;  // no output channel
  workbook::cpu::parallel_for(0, ch.images * groups * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / (groups * blocks), gw = (t / blocks) % groups;
      const int64_t q0 = (t % blocks) * kGemmPositions;
      const int64_t len = std::min(kGemmPositions, ch.positions - q0);
      const Tensor cols_t =  // columns[i, q0 : q0 + len, gw block]^T
          matrix(columns, (i * ch.positions + q0) * row + gw * width, width, len, 1, row);
      const Tensor w = matrix(weight3, gw * rows * width, rows, width, width, 1);
      Tensor out =
          matrix(output, ((ch.n0 + i) * groups + gw) * rows * P + ch.p0 + q0, rows, len, P, 1);
      if (bias) {  // a column, broadcast along the positions
        const Tensor b = matrix(*bias, gw * rows, rows, 1, 1, 1);
        STABLE_TORCH_ERROR_CODE_CHECK(
            aoti_torch_cpu_addmm_out(out.get(), b.get(), w.get(), cols_t.get(), 1.0, 1.0));
      } else {
        STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_mm_out(out.get(), w.get(), cols_t.get()));
      }
    }
  });
}

// grad_columns[i, block, gw] = grad_output[n, gw, :, p0 + block]^T @ W_gw.
void columns_gradient_gemm(const Geometry& g, const Tensor& weight3, const Tensor& grad_output,
                           const Tensor& grad_columns, const Chunk& ch) {
  const int64_t groups = g.groups, rows = g.out_channels_per_group(), P = g.positions();
  const int64_t width = g.taps() * g.channels_per_group(), row = g.groups * width;
  const int64_t blocks = ceil_div(ch.positions, kGemmPositions);
  workbook::cpu::parallel_for(0, ch.images * groups * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / (groups * blocks), gw = (t / blocks) % groups;
      const int64_t q0 = (t % blocks) * kGemmPositions;
      const int64_t len = std::min(kGemmPositions, ch.positions - q0);
      Tensor out =
          matrix(grad_columns, (i * ch.positions + q0) * row + gw * width, len, width, row, 1);
      const Tensor grad_t =  // grad_output[n, gw, :, p0 + q0 : + len]^T
          matrix(grad_output, ((ch.n0 + i) * groups + gw) * rows * P + ch.p0 + q0, len, rows, 1, P);
      const Tensor w = matrix(weight3, gw * rows * width, rows, width, width, 1);
      STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_mm_out(out.get(), grad_t.get(), w.get()));
    }
  });
}

// grad_weight[gw][:, block] += grad_output_chunk[gw] @ columns[:, gw block], one BLAS call per
// task and chunk: grad_output_chunk [groups, O / groups, images Pc] is the chunk's grad_output
// gathered image after image, so that the reduction runs over the images and positions of the
// chunk at once, as the columns' rows do. It is never split within a chunk; across chunks the
// order is the chunks', fixed by the memory budget alone.
void weight_gradient_gemm(const Geometry& g, const Tensor& grad_weight3,
                          const Tensor& grad_output_chunk, const Tensor& columns, const Chunk& ch) {
  const int64_t groups = g.groups, rows = g.out_channels_per_group();
  const int64_t width = g.taps() * g.channels_per_group(), row = g.groups * width;
  const int64_t reduction = ch.images * ch.positions;
  const int64_t blocks = ceil_div(width, kWeightGradColumns);
  if (rows == 0) return;
  workbook::cpu::parallel_for(0, groups * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t gw = t / blocks, r0 = (t % blocks) * kWeightGradColumns;
      const int64_t len = std::min(kWeightGradColumns, width - r0);
      Tensor out = matrix(grad_weight3, gw * rows * width + r0, rows, len, width, 1);
      const Tensor grad =
          matrix(grad_output_chunk, gw * rows * reduction, rows, reduction, reduction, 1);
      const Tensor cols = matrix(columns, gw * width + r0, reduction, len, row, 1);
      STABLE_TORCH_ERROR_CODE_CHECK(
          aoti_torch_cpu_addmm_out(out.get(), out.get(), grad.get(), cols.get(), 1.0, 1.0));
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

// fn(T{}) for the compute type, as AT_DISPATCH_FLOATING_TYPES would call its lambda.
template <typename Fn>
void dispatch_compute_type(ScalarType type, const Fn& fn) {
  if (type == ScalarType::Double) {
    fn(double{});
  } else {
    fn(float{});
  }
}

Tensor in_compute_type(const Tensor& t, ScalarType type) {
  return torch::stable::contiguous(torch::stable::to(t, type));
}

// torch::stable::narrow, which takes its tensor by non-const reference, for any tensor.
Tensor narrowed(Tensor t, int64_t dim, int64_t start, int64_t length) {
  return torch::stable::narrow(t, dim, start, length);
}

Tensor zeros(std::vector<int64_t> sizes, ScalarType type, const Tensor& like) {
  Tensor t = torch::stable::empty(sizes, type, std::nullopt, like.device());
  return torch::stable::zero_(t);
}

// [N, C, H, W] -> [N, H + 3, W + 2, C], zero border, compute type.
Tensor padded_channels_last(const Tensor& input, const Geometry& g, ScalarType type) {
  Tensor padded = zeros({g.batch, g.height + 3, g.width + 2, g.in_channels}, type, input);
  Tensor image = narrowed(narrowed(padded, 1, 1, g.height), 2, 1, g.width);
  torch::stable::copy_(image, torch::stable::permute(input, {0, 2, 3, 1}));
  return padded;
}

// The inverse, for grad_input: the image's pixels back into a contiguous NCHW tensor.
Tensor unpadded(const Tensor& padded, const Geometry& g, ScalarType type) {
  Tensor out = torch::stable::empty({g.batch, g.in_channels, g.height, g.width}, type, std::nullopt,
                                    padded.device());
  const Tensor view =
      torch::stable::view(padded, {g.batch, g.height + 3, g.width + 2, g.in_channels});
  const Tensor image = narrowed(narrowed(view, 1, 1, g.height), 2, 1, g.width);
  torch::stable::copy_(out, torch::stable::permute(image, {0, 3, 1, 2}));
  return out;
}

// [O, C / groups, kh, kw] -> [groups, O / groups, kh kw C / groups], the columns' order.
Tensor weight_by_tap(const Tensor& weight, const Geometry& g, ScalarType type) {
  return torch::stable::view(
      in_compute_type(torch::stable::permute(weight, {0, 2, 3, 1}), type),
      {g.groups, g.out_channels_per_group(), g.taps() * g.channels_per_group()});
}

std::optional<Tensor> defined_or_null(const std::optional<Tensor>& t) {
  return (t.has_value() && t->defined()) ? t : std::nullopt;
}

// A buffer's data, or null where there is no buffer (a result or an input not needed).
template <typename T>
const T* data_or_null(const std::optional<Tensor>& t) {
  return t ? t->const_data_ptr<T>() : nullptr;
}

template <typename T>
T* mutable_data_or_null(const std::optional<Tensor>& t) {
  return t ? t->mutable_data_ptr<T>() : nullptr;
}

Tensor deform_conv2d_cpu(const Tensor& input, const Tensor& offset, const Tensor& weight,
                         const std::optional<Tensor>& bias_in, std::vector<int64_t> stride,
                         std::vector<int64_t> padding, std::vector<int64_t> dilation,
                         const std::optional<Tensor>& mask_in) {
  const Geometry g = workbook::deform_conv2d::check_forward_inputs(
      input, offset, weight, bias_in, stride, padding, dilation, mask_in, c10::DeviceType::CPU);
  const auto bias = defined_or_null(bias_in);
  const auto mask = defined_or_null(mask_in);
  const ScalarType type = compute_type(input.scalar_type());

  Tensor output = torch::stable::empty({g.batch, g.out_channels, g.out_h, g.out_w}, type,
                                       std::nullopt, input.device());
  if (g.batch > 0 && g.out_channels > 0) {
    const PaddedPlane plane(g);
    const Tensor input_c = padded_channels_last(input, g, type);
    const Tensor offset_c = in_compute_type(offset, type);
    const auto mask_c = mask ? std::optional(in_compute_type(*mask, type)) : std::nullopt;
    const Tensor weight3 = weight_by_tap(weight, g, type);
    const auto bias_c = bias ? std::optional(in_compute_type(*bias, type)) : std::nullopt;
    const ColumnLayout layout(g);
    const int64_t K = g.taps();

    dispatch_compute_type(type, [&](auto zero) {
      using T = decltype(zero);
      const Problem<T> pb{g,
                          plane,
                          &layout,
                          input_c.const_data_ptr<T>(),
                          offset_c.const_data_ptr<T>(),
                          data_or_null<T>(mask_c)};
      const ChunkPlan plan = plan_forward<T>(g, layout);
      const int64_t positions = plan.most_positions(g);
      Tensor base = torch::stable::empty({positions * g.offset_groups * K}, ScalarType::Long,
                                         std::nullopt, input.device());
      Tensor weights = torch::stable::empty({4 * positions * g.offset_groups * K}, type,
                                            std::nullopt, input.device());
      Tensor columns =
          torch::stable::empty({positions * layout.width}, type, std::nullopt, input.device());
      for_each_chunk(g, plan, [&](const Chunk& ch) {
        build_sample_table<T>(pb, ch, base.mutable_data_ptr<int64_t>(),
                              weights.mutable_data_ptr<T>());
        sample_columns<T>(pb, ch, base.const_data_ptr<int64_t>(), weights.const_data_ptr<T>(),
                          columns.mutable_data_ptr<T>());
        forward_gemm(g, weight3, bias_c, columns, output, ch);
      });
    });
  }
  return torch::stable::to(output, input.scalar_type());
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> deform_conv2d_backward_cpu(
    const Tensor& grad_output, const Tensor& input, const Tensor& offset, const Tensor& weight,
    const std::optional<Tensor>& mask_in, std::vector<int64_t> stride, std::vector<int64_t> padding,
    std::vector<int64_t> dilation, std::vector<bool> output_mask,
    bool /*deterministic: the CPU kernels are, always*/) {
  const Geometry g = workbook::deform_conv2d::check_backward_inputs(
      grad_output, input, offset, weight, mask_in, stride, padding, dilation, c10::DeviceType::CPU);
  // ATen's std::array<bool, 5> checks the length as it converts the list; a std::vector does not.
  WORKBOOK_CHECK_VALUE(output_mask.size() == 5,
                       workbook::text("deform_conv2d_backward: `output_mask` must have 5 values "
                                      "(input, offset, weight, bias, mask), got ",
                                      output_mask.size()));
  const auto mask = defined_or_null(mask_in);
  const bool want_input = output_mask[0], want_offset = output_mask[1],
             want_weight = output_mask[2], want_bias = output_mask[3],
             want_mask = output_mask[4] && mask.has_value();
  // grad_input, grad_offset and grad_mask all start from the gradient of the columns.
  const bool want_columns_grad = want_input || want_offset || want_mask;
  const ScalarType type = compute_type(input.scalar_type()), given = input.scalar_type();
  const auto device = input.device();
  const int64_t P = g.positions(), K = g.taps();

  // Unwanted results are empty [0] tensors (the schema's convention).
  const auto nothing = [&] { return torch::stable::empty({0}, given, std::nullopt, device); };
  Tensor grad_input = nothing(), grad_offset = nothing(), grad_weight = nothing(),
         grad_bias = nothing(), grad_mask = nothing();
  if (!(want_columns_grad || want_weight || want_bias)) {
    return {grad_input, grad_offset, grad_weight, grad_bias, grad_mask};
  }
  const Tensor grad_output_c = in_compute_type(grad_output, type);
  if (want_bias) {
    Tensor bias_c = torch::stable::empty({g.out_channels}, type, std::nullopt, device);
    dispatch_compute_type(type, [&](auto zero) {
      using T = decltype(zero);
      sum_bias_gradient<T>(grad_output_c.const_data_ptr<T>(), bias_c.mutable_data_ptr<T>(), g.batch,
                           g.out_channels, P);
    });
    grad_bias = torch::stable::to(bias_c, given);
  }
  if (!(want_columns_grad || want_weight)) {
    return {grad_input, grad_offset, grad_weight, grad_bias, grad_mask};
  }

  // Results in the compute type. grad_offset and grad_mask are written exactly once per element,
  // so they need no zero fill; grad_input is the padded channels-last accumulator.
  std::optional<Tensor> grad_input_c, grad_offset_c, grad_weight_c, grad_mask_c;
  if (want_offset) {
    grad_offset_c = torch::stable::empty({g.batch, 2 * g.offset_groups * K, g.out_h, g.out_w}, type,
                                         std::nullopt, device);
  }
  if (want_mask) {
    grad_mask_c = torch::stable::empty({g.batch, g.offset_groups * K, g.out_h, g.out_w}, type,
                                       std::nullopt, device);
  }
  if (want_weight) {  // in the columns' order, [O, kh, kw, C / groups]
    grad_weight_c =
        zeros({g.out_channels, g.kernel_h, g.kernel_w, g.channels_per_group()}, type, input);
  }

  if (g.batch > 0) {
    const PaddedPlane plane(g);
    if (want_input) grad_input_c = zeros({g.batch, plane.size, g.in_channels}, type, input);
    // Convert only what some pass reads: the input feeds im2col (for grad_weight) and the
    // offset pass; the weight feeds the grad-columns GEMM.
    const bool read_input = want_weight || want_offset || want_mask;
    const auto input_c =
        read_input ? std::optional(padded_channels_last(input, g, type)) : std::nullopt;
    const Tensor offset_c = in_compute_type(offset, type);
    const auto mask_c = mask ? std::optional(in_compute_type(*mask, type)) : std::nullopt;
    const auto weight3 =
        want_columns_grad ? std::optional(weight_by_tap(weight, g, type)) : std::nullopt;
    const ColumnLayout layout(g);

    dispatch_compute_type(type, [&](auto zero) {
      using T = decltype(zero);
      const Problem<T> pb{g,
                          plane,
                          &layout,
                          data_or_null<T>(input_c),
                          offset_c.const_data_ptr<T>(),
                          data_or_null<T>(mask_c)};
      const ChunkPlan plan = plan_backward<T>(g, layout, want_weight, want_columns_grad);
      const int64_t positions = plan.most_positions(g);
      const auto buffer = [&](int64_t size, ScalarType dtype) {
        return torch::stable::empty({size}, dtype, std::nullopt, device);
      };
      Tensor base = buffer(positions * g.offset_groups * K, ScalarType::Long);
      Tensor weights = buffer(4 * positions * g.offset_groups * K, type);
      const auto columns =
          want_weight ? std::optional(buffer(positions * layout.width, type)) : std::nullopt;
      const auto grad_columns =
          want_columns_grad ? std::optional(buffer(positions * layout.width, type)) : std::nullopt;

      for_each_chunk(g, plan, [&](const Chunk& ch) {
        build_sample_table<T>(pb, ch, base.mutable_data_ptr<int64_t>(),
                              weights.mutable_data_ptr<T>());
        if (want_weight) {
          sample_columns<T>(pb, ch, base.const_data_ptr<int64_t>(), weights.const_data_ptr<T>(),
                            mutable_data_or_null<T>(columns));
          const Tensor grad_output_chunk = torch::stable::contiguous(torch::stable::permute(
              narrowed(narrowed(torch::stable::view(grad_output_c, {g.batch, g.out_channels, P}), 0,
                                ch.n0, ch.images),
                       2, ch.p0, ch.positions),
              {1, 0, 2}));
          weight_gradient_gemm(g, *grad_weight_c, grad_output_chunk, *columns, ch);
        }
        if (!want_columns_grad) return;
        columns_gradient_gemm(g, *weight3, grad_output_c, *grad_columns, ch);
        if (want_input) {
          scatter_columns<T>(pb, ch, base.const_data_ptr<int64_t>(), weights.const_data_ptr<T>(),
                             data_or_null<T>(grad_columns), mutable_data_or_null<T>(grad_input_c));
        }
        if (want_offset || want_mask) {
          offset_and_mask_gradients<T>(
              pb, ch, base.const_data_ptr<int64_t>(), data_or_null<T>(grad_columns),
              mutable_data_or_null<T>(grad_offset_c), mutable_data_or_null<T>(grad_mask_c));
        }
      });
    });
  }

  if (want_input) {
    grad_input = g.batch > 0 ? unpadded(*grad_input_c, g, given)
                             : torch::stable::empty({0, g.in_channels, g.height, g.width}, given,
                                                    std::nullopt, device);
  }
  if (want_offset) grad_offset = torch::stable::to(*grad_offset_c, given);
  if (want_weight) {
    grad_weight = torch::stable::empty(weight.sizes(), given, std::nullopt, device);
    torch::stable::copy_(grad_weight, torch::stable::permute(*grad_weight_c, {0, 3, 1, 2}));
  }
  if (want_mask) grad_mask = torch::stable::to(*grad_mask_c, given);
  return {grad_input, grad_offset, grad_weight, grad_bias, grad_mask};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Registration: these kernels run the extops deform_conv2d ops for CPU tensors.

STABLE_TORCH_LIBRARY_IMPL(extops, CPU, m) {
  m.impl("deform_conv2d", TORCH_BOX(&deform_conv2d_cpu));
  m.impl("deform_conv2d_backward", TORCH_BOX(&deform_conv2d_backward_cpu));
}
