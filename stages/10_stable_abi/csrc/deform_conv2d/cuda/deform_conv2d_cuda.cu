// Stage 10: extops::deform_conv2d and its backward on CUDA, on the stable ABI: stage 07's
// kernels, new glue.
//
// Run card
//   build + test:  make stage 10           (compiles wherever nvcc is found; runs on a GPU, and on
//                                          the emulated device elsewhere)
//   the kernels:   stage 07's deform_conv2d_cuda.cuh, compiled here as they are (their run card,
//                  register counts and napkin math are stage 07's deform_conv2d_cuda.cu)
//
// What changes against stage 07's deform_conv2d_cuda.cu (`make diff 10` shows it line by line):
//
//   at::Tensor                          torch::stable::Tensor
//   AT_DISPATCH_FLOATING_TYPES_AND2     a switch on the dtype (dispatch_floating)
//   c10::cuda::CUDAGuard                aoti_torch_create_cuda_guard (CudaGuard: stable_cuda.cuh)
//   c10::cuda::getCurrentCUDAStream()   aoti_torch_get_current_cuda_stream
//   at::mm_out, addmm_ on views         aoti_torch_cuda_mm_out and _addmm_out (cuBLAS, as ATen's)
//                                       on matrices made with torch::stable::from_blob
//   at::add_out (the bias)              an addmm whose added matrix is the bias as a column
//   acc.add_(at::mm(...)) (half)        one addmm in float on float copies of the operands
//   at::zeros, copy_                    torch::stable::empty + zero_, copy_
//   view, permute, select              strided(): torch::stable::from_blob over the same memory
//   the sort buffers, at::cuda::cub     one byte tensor, carved by SortBuffers; CUB itself
//   TORCH_LIBRARY_IMPL                  STABLE_TORCH_LIBRARY_IMPL, each kernel boxed by TORCH_BOX
//
// The CUDA shims exist only in a CUDA build of torch (../../stable_cuda.cuh says which, and how
// the emulated device stands in for them).
//
// Sections: views and dtypes; launchers (the ops); registration.
#include <cuda_runtime.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "deform_conv2d_cuda.cuh"  // the kernels and their launchers: stage 07's
#include "stable_cuda.cuh"         // the CUDA shims: guard, stream, GEMMs
#include "workbook/deform_conv2d.h"

namespace {

using namespace deform_conv2d_cuda_kernels;  // the kernels: this file is their stable-ABI glue
using stable_cuda::addmm_out;
using stable_cuda::CudaGuard;
using stable_cuda::current_stream;
using stable_cuda::dispatch_floating;
using stable_cuda::mm_out;
using stable_dtypes::opmath_type;
using torch::stable::Tensor;
using workbook::deform_conv2d::Chunk;
using workbook::deform_conv2d::ChunkPlan;
using workbook::deform_conv2d::for_each_chunk;
using workbook::deform_conv2d::Geometry;
using workbook::deform_conv2d::kNoLimit;
using workbook::deform_conv2d::plan_chunks;

// ----------------------------------------------------------------------------------------------
// Views and dtypes

// A view of contiguous `t` starting `offset` elements in, with the given sizes and strides: what
// stage 07 makes with select, narrow, view and permute. (torch::stable::view, which goes through
// the dispatcher shim, fails under opcheck's schema-checking mode in torch 2.14: "Expected IntList
// but got GenericList".)
Tensor strided(const Tensor& t, int64_t offset, std::initializer_list<int64_t> sizes,
               std::initializer_list<int64_t> strides) {
  return torch::stable::from_blob(t.data_ptr(), sizes, strides, t.device(), t.scalar_type(),
                                  offset);
}

// The [rows, cols] matrix starting `offset` elements into contiguous `t`.
Tensor matrix(const Tensor& t, int64_t offset, int64_t rows, int64_t cols, int64_t row_stride,
              int64_t col_stride) {
  return strided(t, offset, {rows, cols}, {row_stride, col_stride});
}

// torch::stable::narrow, which takes its tensor by non-const reference, for any tensor.
Tensor narrowed(Tensor t, int64_t dim, int64_t start, int64_t length) {
  return torch::stable::narrow(t, dim, start, length);
}

Tensor empty(std::vector<int64_t> sizes, c10::ScalarType type, const Tensor& like) {
  return torch::stable::empty(sizes, type, std::nullopt, like.device());
}

Tensor zeros(std::vector<int64_t> sizes, c10::ScalarType type, const Tensor& like) {
  Tensor t = empty(std::move(sizes), type, like);
  torch::stable::zero_(t);
  return t;
}

template <typename scalar_t>
const scalar_t* data_or_null(const std::optional<Tensor>& t) {
  return t ? t->const_data_ptr<scalar_t>() : nullptr;
}

// ----------------------------------------------------------------------------------------------
// Launchers: the ops' CUDA implementations, as stage 07's: checked first, under a guard for the
// input's device, on its current stream.

// [N, O, rows, Wo] of a chunk, as a [images, O, rows, Wo] view (any strides).
Tensor chunk_of(const Tensor& nchw, const Geometry& g, const Chunk& ch) {
  return narrowed(narrowed(nchw, 0, ch.n0, ch.images), 2, ch.p0 / g.out_w, ch.positions / g.out_w);
}

Tensor deform_conv2d_cuda(const Tensor& input, const Tensor& offset, const Tensor& weight,
                          const std::optional<Tensor>& bias, std::vector<int64_t> stride,
                          std::vector<int64_t> padding, std::vector<int64_t> dilation,
                          const std::optional<Tensor>& mask) {
  const Geometry g = workbook::deform_conv2d::check_forward_inputs(
      input, offset, weight, bias, stride, padding, dilation, mask, c10::DeviceType::CUDA);
  const CudaGuard device_guard(input);
  const auto type = input.scalar_type();
  Tensor output = empty({g.batch, g.out_channels, g.out_h, g.out_w}, type, input);
  if (output.numel() == 0) return output;  // batch 0, or no output channel

  const Tensor input_c = torch::stable::contiguous(input),
               offset_c = torch::stable::contiguous(offset),
               weight_c = torch::stable::contiguous(weight);
  const auto mask_c = mask ? std::optional(torch::stable::contiguous(*mask)) : std::nullopt;
  const auto bias_c = bias ? std::optional(torch::stable::contiguous(*bias)) : std::nullopt;
  const int64_t groups = g.groups, out_per_group = g.out_channels_per_group();
  const int64_t width = g.in_channels * g.taps(), group_width = width / groups;

  const ChunkPlan plan =
      plan_chunks(g, (width + g.out_channels) * input.element_size(), kColumnBudgetBytes);
  const int64_t most = plan.most_positions(g);
  Tensor columns = empty({width * most}, type, input);
  Tensor product = empty({g.out_channels * most}, type, input);
  const bool small =
      fits_32bit({input.numel(), offset.numel(), width * most, g.offset_groups * g.taps() * most});
  const cudaStream_t stream = current_stream(input);

  dispatch_floating(type, "deform_conv2d", [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* in = input_c.const_data_ptr<scalar_t>();
    const scalar_t* off = offset_c.const_data_ptr<scalar_t>();
    const scalar_t* m = data_or_null<scalar_t>(mask_c);
    for_each_chunk(g, plan, [&](const Chunk& ch) {
      const int64_t cols = ch.images * ch.positions;
      scalar_t* out_columns = columns.mutable_data_ptr<scalar_t>();
      if (small) {
        sample_columns(shape_of<int32_t>(g, ch), in, off, m, out_columns, stream);
      } else {
        sample_columns(shape_of<int64_t>(g, ch), in, off, m, out_columns, stream);
      }
      // product [O, images Pc] = W_gw @ columns_gw (+ the bias, a column broadcast along it).
      for (int64_t gw = 0; gw < groups; ++gw) {
        const Tensor out = matrix(product, gw * out_per_group * cols, out_per_group, cols, cols, 1);
        const Tensor w = matrix(weight_c, gw * out_per_group * group_width, out_per_group,
                                group_width, group_width, 1);
        const Tensor col = matrix(columns, gw * group_width * cols, group_width, cols, cols, 1);
        if (bias_c) {
          addmm_out(out, matrix(*bias_c, gw * out_per_group, out_per_group, 1, 1, 1), w, col);
        } else {
          mm_out(out, w, col);
        }
      }
      // product [O, images, rows, Wo], read as the output's [images, O, rows, Wo].
      const Tensor result =
          strided(product, 0, {ch.images, g.out_channels, ch.positions / g.out_w, g.out_w},
                  {ch.positions, cols, g.out_w, 1});
      Tensor out = chunk_of(output, g, ch);
      torch::stable::copy_(out, result);
    });
  });
  return output;
}

// What the backward's chunk loop reads and writes (nullopt: not wanted, not read).
struct BackwardIO {
  std::optional<Tensor> input, offset, mask, weight, grad_output;
  std::optional<Tensor> grad_input_acc, grad_weight_acc, grad_offset, grad_mask;  // opmath sums
  std::optional<Tensor> columns, grad_output_chunk, grad_columns;                 // chunk buffers
  std::optional<Tensor> sort_space;  // the deterministic backward's SortBuffers: in that mode
  int64_t entries = 0;               // the most corner entries a chunk has
};

template <typename scalar_t>
scalar_t* mutable_or_null(const std::optional<Tensor>& t) {
  return t ? t->mutable_data_ptr<scalar_t>() : nullptr;
}

template <typename scalar_t, typename index_t>
void backward_chunks(const Geometry& g, const ChunkPlan& plan, BackwardIO& io) {
  using T = opmath_t<scalar_t>;
  const int64_t groups = g.groups, out_per_group = g.out_channels_per_group();
  const int64_t width = g.in_channels * g.taps(), group_width = width / groups;
  const cudaStream_t stream = current_stream(*io.offset);
  const scalar_t* offset = io.offset->const_data_ptr<scalar_t>();
  const scalar_t* mask = data_or_null<scalar_t>(io.mask);
  const auto sort = io.sort_space
                        ? SortBuffers<T, index_t>::carve(io.sort_space->data_ptr(), io.entries)
                        : SortBuffers<T, index_t>{};
  const bool same_type = opmath_type(io.offset->scalar_type()) == io.offset->scalar_type();
  for_each_chunk(g, plan, [&](const Chunk& ch) {
    const Shape<index_t> s = shape_of<index_t>(g, ch);
    const int64_t cols = ch.images * ch.positions;
    // The chunk's grad_output as [O, images Pc], the GEMMs' operand (any input layout), written
    // through a view of it as [images, O, rows, Wo].
    const Tensor& grad_out2 = *io.grad_output_chunk;
    Tensor grad_out4 =
        strided(grad_out2, 0, {ch.images, g.out_channels, ch.positions / g.out_w, g.out_w},
                {ch.positions, cols, g.out_w, 1});
    torch::stable::copy_(grad_out4, chunk_of(*io.grad_output, g, ch));
    if (io.grad_weight_acc && g.out_channels > 0) {
      sample_columns(s, io.input->const_data_ptr<scalar_t>(), offset, mask,
                     io.columns->mutable_data_ptr<scalar_t>(), stream);
      for (int64_t gw = 0; gw < groups; ++gw) {
        const Tensor acc = matrix(*io.grad_weight_acc, gw * out_per_group * group_width,
                                  out_per_group, group_width, group_width, 1);
        const Tensor grad =
            matrix(grad_out2, gw * out_per_group * cols, out_per_group, cols, cols, 1);
        const Tensor cols_t =
            matrix(*io.columns, gw * group_width * cols, cols, group_width, 1, cols);
        if (same_type) {
          addmm_out(acc, acc, grad, cols_t);
        } else {  // half, bfloat16: summed in float, from float copies of the operands
          const auto type = acc.scalar_type();
          addmm_out(acc, acc, torch::stable::to(grad, type), torch::stable::to(cols_t, type));
        }
      }
    }
    if (!io.grad_columns) return;
    if (g.out_channels == 0) {
      Tensor all = narrowed(*io.grad_columns, 0, 0, width * cols);
      torch::stable::zero_(all);
    } else {
      for (int64_t gw = 0; gw < groups; ++gw) {
        const Tensor out =
            matrix(*io.grad_columns, gw * group_width * cols, group_width, cols, cols, 1);
        const Tensor w_t =  // W_gw^T
            matrix(*io.weight, gw * out_per_group * group_width, group_width, out_per_group, 1,
                   group_width);
        const Tensor grad =
            matrix(grad_out2, gw * out_per_group * cols, out_per_group, cols, cols, 1);
        mm_out(out, w_t, grad);
      }
    }
    const scalar_t* grad_columns = io.grad_columns->const_data_ptr<scalar_t>();
    if (io.grad_input_acc && g.height * g.width > 0) {
      T* grad_input = io.grad_input_acc->mutable_data_ptr<T>();
      if (io.sort_space) {
        scatter_columns_sorted(s, offset, mask, grad_columns, grad_input, sort, stream);
      } else {
        scatter_columns_atomic(s, offset, mask, grad_columns, grad_input, stream);
      }
    }
    if (io.grad_offset || io.grad_mask) {
      offset_mask_gradients(s, io.input->const_data_ptr<scalar_t>(), offset, mask, grad_columns,
                            mutable_or_null<scalar_t>(io.grad_offset),
                            mutable_or_null<scalar_t>(io.grad_mask), stream);
    }
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> deform_conv2d_backward_cuda(
    const Tensor& grad_output, const Tensor& input, const Tensor& offset, const Tensor& weight,
    const std::optional<Tensor>& mask, std::vector<int64_t> stride, std::vector<int64_t> padding,
    std::vector<int64_t> dilation, std::vector<bool> output_mask, bool deterministic_wanted) {
  const Geometry g = workbook::deform_conv2d::check_backward_inputs(
      grad_output, input, offset, weight, mask, stride, padding, dilation, c10::DeviceType::CUDA);
  // ATen's std::array<bool, 5> checks the length as it converts the list; a std::vector does not.
  WORKBOOK_CHECK_VALUE(output_mask.size() == 5,
                       workbook::text("deform_conv2d_backward: `output_mask` must have 5 values "
                                      "(input, offset, weight, bias, mask), got ",
                                      output_mask.size()));
  const CudaGuard device_guard(input);
  const bool want_input = output_mask[0], want_offset = output_mask[1],
             want_weight = output_mask[2], want_bias = output_mask[3],
             want_mask = output_mask[4] && mask.has_value();
  const bool want_columns_grad = want_input || want_offset || want_mask;
  const auto type = input.scalar_type(), acc_type = opmath_type(type);

  // Unwanted results are empty [0] tensors (the schema's convention).
  const auto nothing = [&] { return empty({0}, type, input); };
  Tensor grad_bias = nothing();
  if (want_bias) {  // reduced in a fixed order by ATen (no atomics): reproducible in both modes
    const int64_t dims[] = {0, 2, 3};
    grad_bias = torch::stable::sum(grad_output, dims);
  }
  if (!(want_columns_grad || want_weight)) {
    return {nothing(), nothing(), nothing(), grad_bias, nothing()};
  }

  const int64_t groups = g.groups, K = g.taps(), width = g.in_channels * K;
  BackwardIO io;
  if (want_input)
    io.grad_input_acc = zeros({g.batch, g.in_channels, g.height, g.width}, acc_type, input);
  // [O, C / groups, kh, kw]: [groups, O / groups, width / groups] in memory, as the GEMMs see it.
  if (want_weight)
    io.grad_weight_acc =
        zeros(std::vector<int64_t>(weight.sizes().begin(), weight.sizes().end()), acc_type, input);
  if (want_offset) {
    io.grad_offset = empty({g.batch, 2 * g.offset_groups * K, g.out_h, g.out_w}, type, input);
  }
  if (want_mask)
    io.grad_mask = empty({g.batch, g.offset_groups * K, g.out_h, g.out_w}, type, input);

  if (g.batch > 0) {
    // Read only what some pass reads: autograd passes stand-ins (expanded zeros) for the rest,
    // which must not be copied to full size.
    if (want_weight || want_offset || want_mask) io.input = torch::stable::contiguous(input);
    io.offset = torch::stable::contiguous(offset);
    if (mask) io.mask = torch::stable::contiguous(*mask);
    if (want_columns_grad) io.weight = torch::stable::contiguous(weight);
    io.grad_output = grad_output;
    const bool deterministic = want_input && deterministic_wanted;

    const int64_t element = input.element_size(), GK = g.offset_groups * K;
    const int64_t values =
        (want_weight ? width : 0) + (want_columns_grad ? width : 0) + g.out_channels;
    const int64_t per_position = values * element + (deterministic ? 4 * GK * kEntryBytes : 0);
    const int64_t plane = g.height * g.width;
    const int64_t max_positions =
        deterministic ? std::numeric_limits<int32_t>::max() / (4 * GK) : kNoLimit;
    WORKBOOK_CHECK(
        g.out_w <= max_positions,
        workbook::text("deform_conv2d_backward: one output row (", g.out_w, " positions, ", GK,
                       " samples each, 4 corners a sample) has more corners than the "
                       "deterministic backward sorts at once (2^31 - 1); use the "
                       "default (atomic) backward"));
    const ChunkPlan plan = plan_chunks(g, per_position, kColumnBudgetBytes, max_positions);
    const int64_t most = plan.most_positions(g), entries = 4 * GK * most;
    const bool small =
        fits_32bit({g.batch * g.in_channels * plane, offset.numel(), width * most,
                    deterministic ? entries : GK * most, plan.images * g.offset_groups * plane});

    if (want_weight) io.columns = empty({width * most}, type, input);
    io.grad_output_chunk = empty({g.out_channels * most}, type, input);
    if (want_columns_grad) io.grad_columns = empty({width * most}, type, input);
    io.entries = entries;
    dispatch_floating(type, "deform_conv2d_backward", [&](auto zero) {
      using scalar_t = decltype(zero);
      const auto run = [&](auto index) {
        using index_t = decltype(index);
        if (deterministic) {  // one allocation, carved up by SortBuffers
          const size_t bytes = SortBuffers<opmath_t<scalar_t>, index_t>::bytes(entries);
          io.sort_space = empty({static_cast<int64_t>(bytes)}, c10::ScalarType::Byte, input);
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

  const auto result = [&](std::optional<Tensor>& t) { return t ? *t : nothing(); };
  Tensor grad_input = io.grad_input_acc ? torch::stable::to(*io.grad_input_acc, type) : nothing();
  Tensor grad_weight =
      io.grad_weight_acc ? torch::stable::to(*io.grad_weight_acc, type) : nothing();
  return {grad_input, result(io.grad_offset), grad_weight, grad_bias, result(io.grad_mask)};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Registration: these kernels run the extops deform_conv2d ops for CUDA tensors.

STABLE_TORCH_LIBRARY_IMPL(extops, CUDA, m) {
  m.impl("deform_conv2d", TORCH_BOX(&deform_conv2d_cuda));
  m.impl("deform_conv2d_backward", TORCH_BOX(&deform_conv2d_backward_cuda));
}
