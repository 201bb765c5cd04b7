// workbook/deform_conv2d.h: what the deformable convolution's CPU kernel (stage 06) and CUDA
// kernel (stage 07) share besides the bilinear arithmetic (bilinear.h): the op's geometry, the
// checks of its inputs, and how a batch is cut into chunks.
//
//   deform_conv2d(input [N, C, H, W], offset [N, 2 G kh kw, Ho, Wo],
//                 weight [O, C / groups, kh, kw], bias [O]?, stride, padding, dilation,
//                 mask [N, G kh kw, Ho, Wo]?)
//   deform_conv2d_backward(grad_output [N, O, Ho, Wo], input, offset, weight, mask?, stride,
//                          padding, dilation, output_mask)
//
// The checks return the op's geometry (sizes, groups, output size) once every one has passed.
// The geometry is derived in 64-bit integers and each step is checked before it is used, so that
// no size ever wraps around and nothing is divided or allocated on a bad input:
//
//   ValueError: deform_conv2d: `padding` [4611686018427387904, 0] is too large: height +
//               2 * padding overflows a 64-bit integer (height 5)
//
// extops/deform_conv2d.py runs the same checks, in the same order and with the same messages
// (workbook/checks.h's words, which extops/errors.py mirrors), in the ops' fake kernels, so an
// input fails alike on CPU tensors, meta tensors and under torch.compile. Change one, change the
// other: the tests compare the two on every bad input.
//
// Two ABIs, one header, as workbook/checks.h: the ATen stages (06, 07) pass at::Tensor and
// IntList, stage 10 torch::stable::Tensor and the stable ABI's HeaderOnlyArrayRef
// (workbook::Tensor, workbook::IntList), and the messages are the same text on both.
//
// Sections: geometry, checks, chunks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "workbook/checks.h"

namespace workbook::deform_conv2d {

// ----------------------------------------------------------------------------------------------
// Geometry

struct Geometry {
  int64_t batch, in_channels, height, width;
  int64_t out_channels, groups, offset_groups;
  int64_t kernel_h, kernel_w;
  int64_t stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
  int64_t out_h, out_w;

  // Both products were checked to fit in int64 (with in_channels, as one image's columns).
  int64_t taps() const { return kernel_h * kernel_w; }
  int64_t positions() const { return out_h * out_w; }
  int64_t channels_per_group() const { return in_channels / groups; }
  int64_t out_channels_per_group() const { return out_channels / groups; }
  int64_t channels_per_offset_group() const { return in_channels / offset_groups; }
};

// ----------------------------------------------------------------------------------------------
// Checks

namespace detail {

inline void check_int_pair(IntList values, const Arg& arg, int64_t minimum, const char* must_be) {
  WORKBOOK_CHECK_VALUE(values.size() == 2,
                       text(describe(arg), " must have 2 values (height, width), got ",
                            values.size(), ": ", values));
  WORKBOOK_CHECK_VALUE(values[0] >= minimum && values[1] >= minimum,
                       text(describe(arg), " must be ", must_be, ", got ", values));
}

// Output size along one dimension ("height" or "width"), each step checked before it is taken.
inline int64_t output_size(const char* op, const char* dim, const char* k_name, int64_t size,
                           int64_t kernel, IntList padding, IntList dilation, int64_t index,
                           int64_t stride) {
  const int64_t pad = padding[index], dil = dilation[index];
  int64_t twice_pad = 0, padded = 0, span = 0, extent = 0;
  WORKBOOK_CHECK_VALUE(
      !mul_overflows(2, pad, &twice_pad) && !add_overflows(size, twice_pad, &padded),
      text(op, ": `padding` ", padding, " is too large: ", dim,
           " + 2 * padding overflows a 64-bit integer (", dim, " ", size, ")"));
  WORKBOOK_CHECK_VALUE(!mul_overflows(dil, kernel - 1, &span) && !add_overflows(span, 1, &extent),
                       text(op, ": `dilation` ", dilation, " is too large: dilation * (", k_name,
                            " - 1) + 1 overflows a 64-bit integer (", k_name, " ", kernel, ")"));
  WORKBOOK_CHECK_VALUE(
      padded >= extent,
      text(op, ": the kernel spans ", extent, " along the ", dim, " (`dilation` ", dil, " * (",
           k_name, " - 1) + 1) but the padded `input` has ", padded, " (", dim, " ", size,
           " + 2 * `padding` ", pad, "): no output position"));
  return (padded - extent) / stride + 1;  // stride >= 1 was checked; padded - extent >= 0
}

// Whether the product of non-negative sizes fits in int64 (a zero anywhere makes it 0).
inline bool product_fits(std::initializer_list<int64_t> sizes) {
  for (int64_t s : sizes) {
    if (s == 0) return true;
  }
  int64_t total = 1;
  for (int64_t s : sizes) {
    if (mul_overflows(total, s, &total)) return false;
  }
  return true;
}

// Everything both ops check. `grad_output` is null for the forward; `bias` is the forward's.
inline Geometry check_common(const char* op, const Tensor* grad_output, const Tensor& input,
                             const Tensor& offset, const Tensor& weight,
                             const std::optional<Tensor>& bias, IntList stride, IntList padding,
                             IntList dilation, const std::optional<Tensor>& mask,
                             c10::DeviceType device) {
  const Arg grad_arg{op, "grad_output"}, input_arg{op, "input"}, offset_arg{op, "offset"},
      weight_arg{op, "weight"}, bias_arg{op, "bias"}, mask_arg{op, "mask"};
  const bool has_bias = bias.has_value() && bias->defined();
  const bool has_mask = mask.has_value() && mask->defined();

  // Tensors in the schema's order; the first one sets the dtype and the device.
  std::vector<NamedTensor> tensors;
  if (grad_output != nullptr) tensors.emplace_back(*grad_output, grad_arg);
  tensors.emplace_back(input, input_arg);
  tensors.emplace_back(offset, offset_arg);
  tensors.emplace_back(weight, weight_arg);
  if (has_bias) tensors.emplace_back(*bias, bias_arg);
  if (has_mask) tensors.emplace_back(*mask, mask_arg);
  // checks.h's checks of every op, in its order: dense, floating, one dtype, one device.
  for (const auto& [t, arg] : tensors) check_strided(t, arg);
  const auto& [first, first_arg] = tensors.front();
  check_floating(first, first_arg);
  for (const auto& [t, arg] : tensors) check_dtype(t, arg, first, first_arg);
  // Devices are compared before the device type, as checks.h does: a tensor left on another
  // device gets this message whichever kernel (or the fake one) the dispatcher picked.
  for (const auto& [t, arg] : tensors) check_same_device(t, arg, first, first_arg);
  check_device_type(first, first_arg, device);

  if (grad_output != nullptr) {
    check_dim(*grad_output, grad_arg, 4, "(batch, out_channels, out_h, out_w)");
  }
  check_dim(input, input_arg, 4, "(batch, in_channels, height, width)");
  check_dim(offset, offset_arg, 4,
            "(batch, 2 * offset_groups * kernel_h * kernel_w, out_h, out_w)");
  check_dim(weight, weight_arg, 4, "(out_channels, in_channels / groups, kernel_h, kernel_w)");
  if (has_bias) check_dim(*bias, bias_arg, 1, "(out_channels)");
  if (has_mask)
    check_dim(*mask, mask_arg, 4, "(batch, offset_groups * kernel_h * kernel_w, out_h, out_w)");

  check_int_pair(stride, Arg{op, "stride"}, 1, "positive");
  check_int_pair(padding, Arg{op, "padding"}, 0, "non-negative");
  check_int_pair(dilation, Arg{op, "dilation"}, 1, "positive");

  Geometry g{};
  g.batch = input.size(0);
  g.in_channels = input.size(1);
  g.height = input.size(2);
  g.width = input.size(3);
  g.out_channels = weight.size(0);
  g.kernel_h = weight.size(2);
  g.kernel_w = weight.size(3);
  g.stride_h = stride[0];
  g.stride_w = stride[1];
  g.pad_h = padding[0];
  g.pad_w = padding[1];
  g.dilation_h = dilation[0];
  g.dilation_w = dilation[1];

  WORKBOOK_CHECK_VALUE(
      g.in_channels >= 1,
      text(describe(input_arg), " must have at least 1 channel (dimension 1), got sizes ",
           input.sizes()));
  const int64_t per_group = weight.size(1);
  WORKBOOK_CHECK_VALUE(
      per_group >= 1,
      text(describe(weight_arg),
           " must have at least 1 input channel per group (dimension 1), got sizes ",
           weight.sizes()));
  WORKBOOK_CHECK_VALUE(g.in_channels % per_group == 0,
                       text(describe(weight_arg), " has ", per_group,
                            " input channels per group (dimension 1), which must divide the ",
                            g.in_channels, " channels of `input`, got sizes ", weight.sizes()));
  g.groups = g.in_channels / per_group;
  WORKBOOK_CHECK_VALUE(
      g.out_channels % g.groups == 0,
      text(describe(weight_arg), " must have a multiple of groups = ", g.groups,
           " output channels (dimension 0; groups = input channels / weight.size(1)), got sizes ",
           weight.sizes()));
  WORKBOOK_CHECK_VALUE(
      g.kernel_h >= 1 && g.kernel_w >= 1,
      text(describe(weight_arg),
           " must have a kernel of at least 1 x 1 (dimensions 2 and 3), got sizes ",
           weight.sizes()));
  // A weight with no output channel holds no element, so its kernel can be any size.
  WORKBOOK_CHECK_VALUE(
      product_fits({g.kernel_h, g.kernel_w}),
      text(describe(weight_arg),
           " must have at most 2^63 - 1 kernel taps (kernel_h * kernel_w), got sizes ",
           weight.sizes()));

  check_size(offset, offset_arg, 0, g.batch, "batch size of `input`");
  // offset.size(1) = 2 * G * kh * kw, tested without forming 2 * kh * kw, which could overflow.
  const int64_t offset_channels = offset.size(1), taps = g.taps();
  WORKBOOK_CHECK_VALUE(
      offset_channels > 0 && offset_channels % 2 == 0 && (offset_channels / 2) % taps == 0,
      text(describe(offset_arg), " must have a positive multiple of 2 * kernel_h * kernel_w = 2 * ",
           g.kernel_h, " * ", g.kernel_w,
           " channels (dimension 1: a (dy, dx) pair per kernel tap and offset group), got sizes ",
           offset.sizes()));
  g.offset_groups = offset_channels / 2 / taps;
  WORKBOOK_CHECK_VALUE(
      g.in_channels % g.offset_groups == 0,
      text(describe(offset_arg), " has ", g.offset_groups,
           " offset groups (channels / (2 * kernel_h * kernel_w)), which must divide the ",
           g.in_channels, " channels of `input`, got sizes ", offset.sizes()));

  g.out_h =
      output_size(op, "height", "kernel_h", g.height, g.kernel_h, padding, dilation, 0, g.stride_h);
  g.out_w =
      output_size(op, "width", "kernel_w", g.width, g.kernel_w, padding, dilation, 1, g.stride_w);
  const char* out_h_why =
      "out_h of the convolution: (height + 2 * padding - dilation * "
      "(kernel_h - 1) - 1) / stride + 1";
  const char* out_w_why =
      "out_w of the convolution: (width + 2 * padding - dilation * "
      "(kernel_w - 1) - 1) / stride + 1";
  check_size(offset, offset_arg, 2, g.out_h, out_h_why);
  check_size(offset, offset_arg, 3, g.out_w, out_w_why);

  if (has_mask) {
    check_size(*mask, mask_arg, 0, g.batch, "batch size of `input`");
    check_size(*mask, mask_arg, 1, g.offset_groups * taps,
               "offset_groups * kernel_h * kernel_w, from `offset` and `weight`");
    check_size(*mask, mask_arg, 2, g.out_h, out_h_why);
    check_size(*mask, mask_arg, 3, g.out_w, out_w_why);
  }
  if (has_bias) check_size(*bias, bias_arg, 0, g.out_channels, "out_channels of `weight`");

  // Offsets and masks exist, so N * Ho * Wo fits; with meta tensors, sizes alone can still make
  // the output or one image's columns too large to count.
  WORKBOOK_CHECK_VALUE(product_fits({g.batch, g.out_channels, g.out_h, g.out_w}),
                       text(op, ": the output [", g.batch, ", ", g.out_channels, ", ", g.out_h,
                            ", ", g.out_w, "] would have more than 2^63 - 1 elements"));
  WORKBOOK_CHECK_VALUE(
      product_fits({g.in_channels, g.kernel_h, g.kernel_w, g.out_h, g.out_w}),
      text(op, ": the sampled columns of one image [", g.in_channels, " * ", g.kernel_h, " * ",
           g.kernel_w, ", ", g.out_h, " * ", g.out_w, "] would have more than 2^63 - 1 elements"));

  if (grad_output != nullptr) {
    const std::vector<int64_t> expected{g.batch, g.out_channels, g.out_h, g.out_w};
    bool same = grad_output->dim() == 4;
    for (int64_t d = 0; same && d < 4; ++d) same = grad_output->size(d) == expected[d];
    WORKBOOK_CHECK_VALUE(same,
                         text(describe(grad_arg), " must have sizes ", expected,
                              " (batch, out_channels, out_h, out_w of the forward), got sizes ",
                              grad_output->sizes()));
  }
  return g;
}

}  // namespace detail

inline Geometry check_forward_inputs(const Tensor& input, const Tensor& offset,
                                     const Tensor& weight, const std::optional<Tensor>& bias,
                                     IntList stride, IntList padding, IntList dilation,
                                     const std::optional<Tensor>& mask, c10::DeviceType device) {
  return detail::check_common("deform_conv2d", nullptr, input, offset, weight, bias, stride,
                              padding, dilation, mask, device);
}

// Autograd calls the backward with what the forward saw, so this passes by construction there;
// it guards direct calls, which are part of the op's public schema.
inline Geometry check_backward_inputs(const Tensor& grad_output, const Tensor& input,
                                      const Tensor& offset, const Tensor& weight,
                                      const std::optional<Tensor>& mask, IntList stride,
                                      IntList padding, IntList dilation, c10::DeviceType device) {
  return detail::check_common("deform_conv2d_backward", &grad_output, input, offset, weight,
                              std::nullopt, stride, padding, dilation, mask, device);
}

// ----------------------------------------------------------------------------------------------
// Chunks
//
// The kernels cut a batch into chunks, so that the column buffers of one chunk stay within a
// memory budget of their own choosing (32 MiB on the CPU, 256 MiB on a GPU: its GEMMs want more
// columns to fill it): chunks of whole images when one image fits the budget, else each image
// into blocks of whole output rows. The plan is made once; the chunks are then visited in order,
// the largest first, so a kernel allocates its buffers once, at that size.

// One chunk of the work: images [n0, n0 + images), output positions [p0, p0 + positions) of each
// (whole rows, so p0 is a multiple of Wo).
struct Chunk {
  int64_t n0, images, p0, positions;
};

// How a batch is cut: chunks of `images` whole images, or, when one image alone exceeds the
// budget (then images == 1), blocks of `rows` output rows of each image.
struct ChunkPlan {
  int64_t images, rows;
  // The positions of the largest chunk: what the buffers are allocated for.
  int64_t most_positions(const Geometry& g) const { return images * rows * g.out_w; }
};

constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();

// a * b, or kNoLimit where the product would overflow (a size that large exceeds any budget).
inline int64_t saturating_mul(int64_t a, int64_t b) {
  int64_t out = 0;
  return mul_overflows(a, b, &out) ? kNoLimit : out;
}

// bytes_per_position: the bytes of the buffers that grow with a chunk's positions. max_positions:
// a cap on the positions of one chunk besides the budget (the CUDA kernel's deterministic
// backward sorts fewer than 2^31 entries at once); the caller makes sure one output row is within
// it. Empty geometries (no position) plan one chunk of everything, which visits nothing.
inline ChunkPlan plan_chunks(const Geometry& g, int64_t bytes_per_position, int64_t budget_bytes,
                             int64_t max_positions = kNoLimit) {
  const int64_t positions = std::max<int64_t>(g.positions(), 1);
  const int64_t image_bytes = saturating_mul(bytes_per_position, positions);
  if (image_bytes <= budget_bytes && positions <= max_positions) {
    const int64_t images = budget_bytes / std::max<int64_t>(image_bytes, 1);
    return {std::min({g.batch, std::max<int64_t>(1, images), max_positions / positions}), g.out_h};
  }
  const int64_t row = std::max<int64_t>(g.out_w, 1);
  const int64_t rows = budget_bytes / std::max<int64_t>(saturating_mul(bytes_per_position, row), 1);
  return {1, std::min({g.out_h, std::max<int64_t>(1, rows), max_positions / row})};
}

// The chunks in order, fn(chunk) for each. The first is the largest.
template <typename Fn>
void for_each_chunk(const Geometry& g, const ChunkPlan& plan, const Fn& fn) {
  for (int64_t n0 = 0; n0 < g.batch; n0 += plan.images) {
    for (int64_t r0 = 0; r0 < g.out_h; r0 += plan.rows) {
      fn(Chunk{n0, std::min(plan.images, g.batch - n0), r0 * g.out_w,
               std::min(plan.rows, g.out_h - r0) * g.out_w});
    }
  }
}

}  // namespace workbook::deform_conv2d
