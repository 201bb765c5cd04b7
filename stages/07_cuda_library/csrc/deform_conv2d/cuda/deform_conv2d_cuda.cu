// Stage 07: extops::deform_conv2d and its backward on CUDA: the sampling, its scatter back into
// the input's gradient and the offset and mask gradients as kernels, the GEMMs on cuBLAS, and a
// backward that is fast by default and bitwise reproducible under
// torch.use_deterministic_algorithms(True).
//
// Run card
//   build + test:  make stage 7            (compiles wherever nvcc is found; runs on a GPU)
//   install:       make install            (pip install --no-build-isolation
//                                           ./stages/07_cuda_library)
//   validate:      python -m workbook.suite 7   (against the float64 reference, stage 06's CPU
//                  kernel and torchvision, in both backward modes)
//   time:          make bench OP=deform_conv2d   (on a GPU; every line below: to be measured)
//   ptxas:         sm_90, -O3 (-Xptxas -v): 46 kernels (4 dtypes x int32 / int64 index), no
//                  spills and no stack frame in any; registers, float32 with int32 index:
//                  sample_columns 40, scatter_columns_atomic 40, corner_keys 40, sorted_entries
//                  32, run_starts 28, gather_runs 32, offset_mask_gradients 48 (the most: 62,
//                  offset_mask_gradients in double). An SM has 65536 registers: 8 blocks of 256
//                  threads (full occupancy) at 32 registers, 6 at 40, 5 at 48
//   v0 torchvision 0.29: one thread per column element (channel, tap, position), each computing
//                  its sample's coordinates again for every channel; grad_input by atomicAdd in
//                  the data's type (half atomics for half); the offset gradient one thread per
//                  (offset channel, position), reading the input twice; 32-bit indices
//   v1 (here, default): the sample located once per (image, offset group, tap, position) and
//                  reused by a slice of its channels; grad_input by atomicAdd into a float (or
//                  double) buffer; grad_offset and grad_mask owned per sample, no atomics;
//                  32-bit index math where every buffer fits, 64-bit where one does not
//   v1d (here, under torch.use_deterministic_algorithms(True)): the scatter replaced by a sort
//                  of the corners by destination and a gather that owns each pixel: bitwise the
//                  same result run to run; what it costs over v1 is what `make bench` measures
//
// Napkin math, for the workbook's main configuration (N 4, C = O = 64, 56 x 56, 3 x 3, pad 1,
// mask, float32), on an H200 (4.8 TB/s HBM, ~60 TFLOP/s float32 without tensor cores; TF32 is
// off unless torch.backends.cuda.matmul.allow_tf32 says otherwise):
//   columns: C kh kw x N Ho Wo = 576 x 12544 = 7.2M values, 29 MB; written once by the sampling,
//   read once per GEMM. The three GEMMs (forward; grad columns and grad weight in the backward)
//   are 2 x 64 x 576 x 12544 = 0.93 GFLOP each, ~15 us apiece at 60 TFLOP/s. The input (3.2 MB)
//   sits in L2 (50 MB), so the sampling's 4 gathers per value are L2 traffic, not HBM: the
//   forward should take tens of microseconds, GEMM and column traffic about even.
//
// This file is the ATen glue: the ops (checks, buffers, GEMMs, the chunk loop) and their
// registration. The kernels and their launchers are deform_conv2d_cuda.cuh beside it, which stage
// 10 compiles too, with its own glue on the stable ABI. The input checks are
// workbook/deform_conv2d.h and the bilinear arithmetic workbook/bilinear.h, shared with the CPU
// kernels of stage 06 (../06_op_library/csrc/deform_conv2d/cpu/deform_conv2d_cpu.h), so the CPU
// suite tests the arithmetic these kernels run. The schemas are in
// ../06_op_library/csrc/deform_conv2d/deform_conv2d.cpp.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>

#include "deform_conv2d_cuda.cuh"  // the kernels and their launchers
#include "workbook/deform_conv2d.h"

namespace {

using namespace deform_conv2d_cuda_kernels;  // NOLINT(build/namespaces): this file's kernels
using workbook::deform_conv2d::Chunk;
using workbook::deform_conv2d::ChunkPlan;
using workbook::deform_conv2d::for_each_chunk;
using workbook::deform_conv2d::Geometry;
using workbook::deform_conv2d::kNoLimit;
using workbook::deform_conv2d::plan_chunks;

// ----------------------------------------------------------------------------------------------
// The ops' CUDA implementations.
//
// Each checks every tensor (device included: all on the input's device, a CUDA one) before
// anything is allocated or launched, runs under a guard for the input's device, launches on the
// current stream. The GEMMs are ATen's (cuBLAS), on the same stream. Half and bfloat16 are
// stored as such (columns, GEMM operands); the kernels compute in float, cuBLAS accumulates in
// float, and the sums over the batch (grad_input, grad_weight) are kept in float until the end.

template <typename scalar_t>
const scalar_t* data_or_null(const std::optional<at::Tensor>& t) {
  return t ? t->const_data_ptr<scalar_t>() : nullptr;
}

std::optional<at::Tensor> defined_or_null(const std::optional<at::Tensor>& t) {
  return (t.has_value() && t->defined()) ? t : std::nullopt;
}

// [N, O, rows, Wo] of a chunk, as a [images, O, rows, Wo] view (any strides).
at::Tensor chunk_of(const at::Tensor& nchw, const Geometry& g, const Chunk& ch) {
  return nchw.narrow(0, ch.n0, ch.images).narrow(2, ch.p0 / g.out_w, ch.positions / g.out_w);
}

at::Tensor deform_conv2d_cuda(const at::Tensor& input, const at::Tensor& offset,
                              const at::Tensor& weight, const std::optional<at::Tensor>& bias_in,
                              at::IntArrayRef stride, at::IntArrayRef padding,
                              at::IntArrayRef dilation, const std::optional<at::Tensor>& mask_in) {
  const Geometry g = workbook::deform_conv2d::check_forward_inputs(
      input, offset, weight, bias_in, stride, padding, dilation, mask_in, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const auto bias = defined_or_null(bias_in);
  const auto mask = defined_or_null(mask_in);
  auto output = at::empty({g.batch, g.out_channels, g.out_h, g.out_w}, input.options());
  if (output.numel() == 0) return output;  // batch 0, or no output channel

  // Kernels read dense NCHW: other layouts are copied once (a no-op for contiguous tensors).
  const auto input_c = input.contiguous(), offset_c = offset.contiguous();
  const auto mask_c = mask ? std::optional(mask->contiguous()) : std::nullopt;
  const int64_t groups = g.groups, out_per_group = g.out_channels_per_group();
  const int64_t width = g.in_channels * g.taps(), group_width = width / groups;
  const auto weight3 = weight.contiguous().view({groups, out_per_group, group_width});

  // Per position: a column of the columns, and one of the GEMM's product before it is permuted
  // into the NCHW output.
  const ChunkPlan plan =
      plan_chunks(g, (width + g.out_channels) * input.element_size(), kColumnBudgetBytes);
  const int64_t most = plan.most_positions(g);
  auto columns = at::empty({width * most}, input.options());
  auto product = at::empty({g.out_channels * most}, input.options());
  const bool small =
      fits_32bit({input.numel(), offset.numel(), width * most, g.offset_groups * g.taps() * most});

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "deform_conv2d_cuda", [&] {
        const scalar_t* in = input_c.const_data_ptr<scalar_t>();
        const scalar_t* off = offset_c.const_data_ptr<scalar_t>();
        const scalar_t* m = data_or_null<scalar_t>(mask_c);
        for_each_chunk(g, plan, [&](const Chunk& ch) {
          const int64_t cols = ch.images * ch.positions;
          auto columns2 = columns.narrow(0, 0, width * cols).view({width, cols});
          scalar_t* out_columns = columns2.mutable_data_ptr<scalar_t>();
          if (small) {
            sample_columns(shape_of<int32_t>(g, ch), in, off, m, out_columns, stream);
          } else {
            sample_columns(shape_of<int64_t>(g, ch), in, off, m, out_columns, stream);
          }
          auto product2 = product.narrow(0, 0, g.out_channels * cols).view({g.out_channels, cols});
          for (int64_t gw = 0; gw < groups; ++gw) {
            auto out = product2.narrow(0, gw * out_per_group, out_per_group);
            at::mm_out(out, weight3.select(0, gw),
                       columns2.narrow(0, gw * group_width, group_width));
          }
          // [O, images, rows, Wo] -> the output's [images, O, rows, Wo], with the bias.
          auto out = chunk_of(output, g, ch);
          const auto result =
              product2.view({g.out_channels, ch.images, ch.positions / g.out_w, g.out_w})
                  .permute({1, 0, 2, 3});
          if (bias) {
            at::add_out(out, result, bias->reshape({1, g.out_channels, 1, 1}));
          } else {
            out.copy_(result);
          }
        });
      });
  return output;
}

// What the backward's chunk loop reads and writes (undefined tensors: not wanted, not read).
struct BackwardIO {
  at::Tensor input, offset, weight3, grad_output;
  std::optional<at::Tensor> mask;
  at::Tensor grad_input_acc, grad_weight_acc, grad_offset, grad_mask;  // accumulators: opmath
  at::Tensor columns, grad_output_chunk, grad_columns;                 // chunk buffers
  at::Tensor sort_space;  // the deterministic backward's SortBuffers: defined in that mode
  int64_t entries = 0;    // the most corner entries a chunk has
};

template <typename scalar_t, typename index_t>
void backward_chunks(const Geometry& g, const ChunkPlan& plan, BackwardIO& io) {
  using T = opmath_t<scalar_t>;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const scalar_t* offset = io.offset.const_data_ptr<scalar_t>();
  const scalar_t* mask = data_or_null<scalar_t>(io.mask);
  const bool sorted = io.sort_space.defined();
  const auto sort =
      sorted ? SortBuffers<T, index_t>::carve(io.sort_space.mutable_data_ptr(), io.entries)
             : SortBuffers<T, index_t>{};
  const int64_t groups = g.groups, out_per_group = g.out_channels_per_group();
  const int64_t width = g.in_channels * g.taps(), group_width = width / groups;
  const bool want_weight = io.grad_weight_acc.defined(),
             want_columns_grad = io.grad_columns.defined();
  for_each_chunk(g, plan, [&](const Chunk& ch) {
    const Shape<index_t> s = shape_of<index_t>(g, ch);
    const int64_t cols = ch.images * ch.positions;
    // The chunk's grad_output as [O, images Pc], the GEMMs' operand (any input layout).
    auto grad_out2 =
        io.grad_output_chunk.narrow(0, 0, g.out_channels * cols).view({g.out_channels, cols});
    grad_out2.view({g.out_channels, ch.images, ch.positions / g.out_w, g.out_w})
        .copy_(chunk_of(io.grad_output, g, ch).permute({1, 0, 2, 3}));
    if (want_weight && g.out_channels > 0) {
      auto columns2 = io.columns.narrow(0, 0, width * cols).view({width, cols});
      sample_columns(s, io.input.const_data_ptr<scalar_t>(), offset, mask,
                     columns2.mutable_data_ptr<scalar_t>(), stream);
      for (int64_t gw = 0; gw < groups; ++gw) {
        auto acc = io.grad_weight_acc.select(0, gw);
        const auto grad = grad_out2.narrow(0, gw * out_per_group, out_per_group);
        const auto cols_t = columns2.narrow(0, gw * group_width, group_width).t();
        if (acc.scalar_type() == grad.scalar_type()) {
          acc.addmm_(grad, cols_t);
        } else {  // half, bfloat16: a product rounded once, summed over chunks in float
          acc.add_(at::mm(grad, cols_t));
        }
      }
    }
    if (!want_columns_grad) return;
    auto grad_columns2 = io.grad_columns.narrow(0, 0, width * cols).view({width, cols});
    if (g.out_channels == 0) {
      grad_columns2.zero_();
    } else {
      for (int64_t gw = 0; gw < groups; ++gw) {
        auto out = grad_columns2.narrow(0, gw * group_width, group_width);
        at::mm_out(out, io.weight3.select(0, gw).t(),
                   grad_out2.narrow(0, gw * out_per_group, out_per_group));
      }
    }
    if (io.grad_input_acc.defined() && g.height * g.width > 0) {
      const scalar_t* grad = grad_columns2.const_data_ptr<scalar_t>();
      T* grad_input = io.grad_input_acc.mutable_data_ptr<T>();
      if (sorted) {
        scatter_columns_sorted(s, offset, mask, grad, grad_input, sort, stream);
      } else {
        scatter_columns_atomic(s, offset, mask, grad, grad_input, stream);
      }
    }
    if (io.grad_offset.defined() || io.grad_mask.defined()) {
      offset_mask_gradients(
          s, io.input.const_data_ptr<scalar_t>(), offset, mask,
          grad_columns2.const_data_ptr<scalar_t>(),
          io.grad_offset.defined() ? io.grad_offset.mutable_data_ptr<scalar_t>() : nullptr,
          io.grad_mask.defined() ? io.grad_mask.mutable_data_ptr<scalar_t>() : nullptr, stream);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> deform_conv2d_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& weight, const std::optional<at::Tensor>& mask_in, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, std::array<bool, 5> output_mask,
    bool deterministic_wanted) {
  const Geometry g = workbook::deform_conv2d::check_backward_inputs(
      grad_output, input, offset, weight, mask_in, stride, padding, dilation,
      c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const auto mask = defined_or_null(mask_in);
  const bool want_input = output_mask[0], want_offset = output_mask[1],
             want_weight = output_mask[2], want_bias = output_mask[3],
             want_mask = output_mask[4] && mask.has_value();
  // grad_input, grad_offset and grad_mask all start from the gradient of the columns.
  const bool want_columns_grad = want_input || want_offset || want_mask;
  const auto options = input.options();
  const auto acc_options = options.dtype(at::toOpMathType(input.scalar_type()));

  // Unwanted results are empty [0] tensors (the schema's convention).
  at::Tensor grad_input = at::empty({0}, options), grad_offset = at::empty({0}, options),
             grad_weight = at::empty({0}, options), grad_bias = at::empty({0}, options),
             grad_mask = at::empty({0}, options);
  // Reduced in a fixed order by ATen (no atomics): reproducible in both modes.
  if (want_bias) grad_bias = grad_output.sum({0, 2, 3});
  if (!(want_columns_grad || want_weight)) {
    return {grad_input, grad_offset, grad_weight, grad_bias, grad_mask};
  }

  const int64_t groups = g.groups, K = g.taps(), width = g.in_channels * K;
  BackwardIO io;
  // The sums over the batch in the opmath type; grad_offset and grad_mask are written exactly
  // once per element, in the data's type.
  if (want_input) {
    io.grad_input_acc = at::zeros({g.batch, g.in_channels, g.height, g.width}, acc_options);
  }
  if (want_weight) {
    io.grad_weight_acc =
        at::zeros({groups, g.out_channels_per_group(), width / groups}, acc_options);
  }
  if (want_offset)
    io.grad_offset = at::empty({g.batch, 2 * g.offset_groups * K, g.out_h, g.out_w}, options);
  if (want_mask)
    io.grad_mask = at::empty({g.batch, g.offset_groups * K, g.out_h, g.out_w}, options);

  if (g.batch > 0) {
    // Read only what some pass reads: autograd passes stand-ins (expanded zeros) for the rest,
    // which must not be copied to full size.
    if (want_weight || want_offset || want_mask) io.input = input.contiguous();
    io.offset = offset.contiguous();
    if (mask) io.mask = mask->contiguous();
    if (want_columns_grad) {
      io.weight3 = weight.contiguous().view({groups, g.out_channels_per_group(), width / groups});
    }
    io.grad_output = grad_output;
    // The caller says which backward (the autograd formula passes
    // torch.are_deterministic_algorithms_enabled()): only grad_input's scatter differs.
    const bool deterministic = want_input && deterministic_wanted;

    const int64_t element = input.element_size(), GK = g.offset_groups * K;
    const int64_t values =
        (want_weight ? width : 0) + (want_columns_grad ? width : 0) + g.out_channels;
    const int64_t per_position = values * element + (deterministic ? 4 * GK * kEntryBytes : 0);
    const int64_t plane = g.height * g.width;
    // The deterministic backward sorts a chunk's 4 GK entries per position at once, fewer than
    // 2^31 of them: a cap on the chunk's positions besides the budget, which one output row
    // must meet.
    const int64_t max_positions =
        deterministic ? std::numeric_limits<int32_t>::max() / (4 * GK) : kNoLimit;
    TORCH_CHECK(g.out_w <= max_positions, "deform_conv2d_backward: one output row (", g.out_w,
                " positions, ", GK,
                " samples each, 4 corners a sample) has more corners than the "
                "deterministic backward sorts at once (2^31 - 1); use the default (atomic) "
                "backward");
    const ChunkPlan plan = plan_chunks(g, per_position, kColumnBudgetBytes, max_positions);
    const int64_t most = plan.most_positions(g), entries = 4 * GK * most;
    // A key, (i G + g) H W + pixel, is decoded in index_t: images G H W must fit too.
    const bool small =
        fits_32bit({g.batch * g.in_channels * plane, offset.numel(), width * most,
                    deterministic ? entries : GK * most, plan.images * g.offset_groups * plane});

    if (want_weight) io.columns = at::empty({width * most}, options);
    io.grad_output_chunk = at::empty({g.out_channels * most}, options);
    if (want_columns_grad) io.grad_columns = at::empty({width * most}, options);
    const auto type = input.scalar_type();
    io.entries = entries;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, type, "deform_conv2d_backward", [&] {
      const auto run = [&](auto index) {
        using index_t = decltype(index);
        if (deterministic) {  // one allocation, carved up by SortBuffers
          const size_t bytes = SortBuffers<opmath_t<scalar_t>, index_t>::bytes(entries);
          io.sort_space = at::empty({static_cast<int64_t>(bytes)}, options.dtype(at::kByte));
        }
        backward_chunks<scalar_t, index_t>(g, plan, io);
      };
      if (small) {
        run(int32_t{});
      } else {
        run(int64_t{});
      }
    });
  }

  if (want_input) grad_input = io.grad_input_acc.to(input.scalar_type());
  if (want_offset) grad_offset = io.grad_offset;
  if (want_weight) grad_weight = io.grad_weight_acc.view(weight.sizes()).to(input.scalar_type());
  if (want_mask) grad_mask = io.grad_mask;
  return {grad_input, grad_offset, grad_weight, grad_bias, grad_mask};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Registration: these kernels run the extops deform_conv2d ops for CUDA tensors.

TORCH_LIBRARY_IMPL(extops, CUDA, m) {
  m.impl("deform_conv2d", &deform_conv2d_cuda);
  m.impl("deform_conv2d_backward", &deform_conv2d_backward_cuda);
}
