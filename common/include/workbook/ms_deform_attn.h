// workbook/ms_deform_attn.h: what multi-scale deformable attention's CPU kernels and CUDA kernels
// (stage 09) share: the op's geometry, the checks of its inputs, and where a sampling point falls.
//
//   ms_deform_attn(value [N, S, M, D], spatial_shapes [L, 2] int64, level_start_index [L] int64,
//                  sampling_locations [N, Lq, M, L, P, 2], attention_weights [N, Lq, M, L, P])
//     -> out [N, Lq, M D]
//
//   out[n, q, m D + d] = sum_{l < L, p < P} attention_weights[n, q, m, l, p]
//                          * level_l[n, m, d](y, x)
//   x = sampling_locations[n, q, m, l, p, 0] * W_l - 0.5
//   y = sampling_locations[n, q, m, l, p, 1] * H_l - 0.5
//
// with (H_l, W_l) = spatial_shapes[l], level_l[n, m, d] the H_l x W_l plane of value[n, s, m, d]
// for s in [start_l, start_l + H_l W_l) (row-major: s = start_l + row W_l + column),
// start_l = level_start_index[l], and (y, x) sampled bilinearly with zeros outside the plane
// (workbook/bilinear.h): grid_sample(align_corners=False, padding_mode="zeros") at the grid point
// 2 location - 1, as Deformable DETR defines the op. A location is (x, y), in [0, 1] across the
// level: the same point on every level, whatever its resolution.
//
// The checks come in two parts. check_forward_inputs / check_backward_inputs read metadata only,
// as every op's checks do, and extops/ms_deform_attn.py runs them in its fake kernels in the same
// order, with the same messages (edit the two together). check_levels reads the two index
// tensors' values, which a fake kernel does not have: spatial_shapes must tile value's S rows and
// level_start_index must be their running sum. The kernels call it on a host copy of the two
// (a CUDA caller copies 3 L integers to the host: a synchronisation, the price of refusing a
// wrong level table rather than reading the wrong rows of value).
//
// Two ABIs, one header, as workbook/checks.h and workbook/deform_conv2d.h.
//
// Sections: geometry, checks, sampling.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "workbook/bilinear.h"
#include "workbook/checks.h"
#include "workbook/host_device.h"

namespace workbook::ms_deform_attn {

// ----------------------------------------------------------------------------------------------
// Geometry

struct Geometry {
  int64_t batch;     // N
  int64_t values;    // S: the rows of value, every level's pixels one after the other
  int64_t heads;     // M
  int64_t channels;  // D: per head
  int64_t queries;   // Lq
  int64_t levels;    // L
  int64_t points;    // P: per query, head and level

  // Each product below is of sizes of one tensor the checks have seen, so it fits in int64.
  int64_t samples_per_query() const { return levels * points; }  // per query and head
  int64_t out_row() const { return heads * channels; }           // out's last dimension
  int64_t value_row() const { return heads * channels; }         // value's row of one s
};

// ----------------------------------------------------------------------------------------------
// Checks

namespace detail {

inline void check_index_tensor(const Tensor& t, const Arg& arg, const Tensor& value,
                               const Arg& value_arg) {
  check_strided(t, arg);
  WORKBOOK_CHECK_TYPE(
      dtype_of(t) == c10::ScalarType::Long,
      text(describe(arg), " must be a torch.int64 tensor, got ", dtype_name(dtype_of(t))));
  check_same_device(t, arg, value, value_arg);
}

// Everything both ops check. `grad_output` is null for the forward.
inline Geometry check_common(const char* op, const Tensor* grad_output, const Tensor& value,
                             const Tensor& spatial_shapes, const Tensor& level_start_index,
                             const Tensor& sampling_locations, const Tensor& attention_weights,
                             c10::DeviceType device) {
  const Arg grad_arg{op, "grad_output"}, value_arg{op, "value"}, shapes_arg{op, "spatial_shapes"},
      starts_arg{op, "level_start_index"}, locations_arg{op, "sampling_locations"},
      weights_arg{op, "attention_weights"};

  // The floating tensors in the schema's order (the first sets dtype and device), as checks.h's
  // check_inputs does; then the two index tensors, int64 on the same device.
  std::vector<NamedTensor> floats;
  if (grad_output != nullptr) floats.emplace_back(*grad_output, grad_arg);
  floats.emplace_back(value, value_arg);
  floats.emplace_back(sampling_locations, locations_arg);
  floats.emplace_back(attention_weights, weights_arg);
  for (const auto& [t, arg] : floats) check_strided(t, arg);
  const auto& [first, first_arg] = floats.front();
  check_floating(first, first_arg);
  for (const auto& [t, arg] : floats) check_dtype(t, arg, first, first_arg);
  for (const auto& [t, arg] : floats) check_same_device(t, arg, first, first_arg);
  check_index_tensor(spatial_shapes, shapes_arg, first, first_arg);
  check_index_tensor(level_start_index, starts_arg, first, first_arg);
  check_device_type(first, first_arg, device);

  if (grad_output != nullptr)
    check_dim(*grad_output, grad_arg, 3, "(batch, queries, heads * channels)");
  check_dim(value, value_arg, 4, "(batch, values, heads, channels)");
  check_dim(spatial_shapes, shapes_arg, 2, "(levels, 2)");
  check_dim(level_start_index, starts_arg, 1, "(levels)");
  check_dim(sampling_locations, locations_arg, 6, "(batch, queries, heads, levels, points, 2)");
  check_dim(attention_weights, weights_arg, 5, "(batch, queries, heads, levels, points)");

  Geometry g{};
  g.batch = value.size(0);
  g.values = value.size(1);
  g.heads = value.size(2);
  g.channels = value.size(3);
  g.levels = spatial_shapes.size(0);
  g.queries = sampling_locations.size(1);
  g.points = sampling_locations.size(4);

  WORKBOOK_CHECK_VALUE(g.levels >= 1, text(describe(shapes_arg),
                                           " must have at least 1 level (dimension 0), got "
                                           "sizes ",
                                           spatial_shapes.sizes()));
  check_size(spatial_shapes, shapes_arg, 1, 2, "a (height, width) pair per level");
  check_size(level_start_index, starts_arg, 0, g.levels, "levels of `spatial_shapes`");
  check_size(sampling_locations, locations_arg, 0, g.batch, "batch size of `value`");
  check_size(sampling_locations, locations_arg, 2, g.heads, "heads of `value`");
  check_size(sampling_locations, locations_arg, 3, g.levels, "levels of `spatial_shapes`");
  check_size(sampling_locations, locations_arg, 5, 2, "an (x, y) pair per point");
  const char* whys[] = {"batch size of `value`", "queries of `sampling_locations`",
                        "heads of `value`", "levels of `spatial_shapes`",
                        "points of `sampling_locations`"};
  const int64_t expected[] = {g.batch, g.queries, g.heads, g.levels, g.points};
  for (int64_t d = 0; d < 5; ++d) {
    check_size(attention_weights, weights_arg, d, expected[d], whys[d]);
  }

  // The output [N, Lq, M D]: sampling_locations bounds N Lq M, not M D times it.
  int64_t row = 0, rows = 0, total = 0;
  WORKBOOK_CHECK_VALUE(!mul_overflows(g.heads, g.channels, &row) &&
                           !mul_overflows(g.batch, g.queries, &rows) &&
                           !mul_overflows(rows, row, &total),
                       text(op, ": the output [", g.batch, ", ", g.queries, ", ", g.heads, " * ",
                            g.channels, "] would have more than 2^63 - 1 elements"));
  if (grad_output != nullptr) {
    const int64_t want[] = {g.batch, g.queries, row};
    bool same = true;
    for (int64_t d = 0; d < 3; ++d) same = same && grad_output->size(d) == want[d];
    WORKBOOK_CHECK_VALUE(
        same, text(describe(grad_arg), " must have sizes [", g.batch, ", ", g.queries, ", ", row,
                   "] (batch, queries, heads * channels of the forward), got "
                   "sizes ",
                   grad_output->sizes()));
  }
  return g;
}

}  // namespace detail

inline Geometry check_forward_inputs(const Tensor& value, const Tensor& spatial_shapes,
                                     const Tensor& level_start_index,
                                     const Tensor& sampling_locations,
                                     const Tensor& attention_weights, c10::DeviceType device) {
  return detail::check_common("ms_deform_attn", nullptr, value, spatial_shapes, level_start_index,
                              sampling_locations, attention_weights, device);
}

inline Geometry check_backward_inputs(const Tensor& grad_output, const Tensor& value,
                                      const Tensor& spatial_shapes, const Tensor& level_start_index,
                                      const Tensor& sampling_locations,
                                      const Tensor& attention_weights, c10::DeviceType device) {
  return detail::check_common("ms_deform_attn_backward", &grad_output, value, spatial_shapes,
                              level_start_index, sampling_locations, attention_weights, device);
}

// The level table's values: shapes [L][2] (height, width) and starts [L], read from a host copy.
// Every height and width non-negative, their areas tiling value's rows exactly (the sum, taken
// without overflow, is S) and each start the sum of the areas before it. The first wrong entry
// is named with its level.
inline void check_levels(const char* op, const Geometry& g, const int64_t* shapes,
                         const int64_t* starts) {
  int64_t start = 0;
  for (int64_t l = 0; l < g.levels; ++l) {
    const int64_t h = shapes[2 * l], w = shapes[2 * l + 1];
    WORKBOOK_CHECK_VALUE(h >= 0 && w >= 0,
                         text(op,
                              ": `spatial_shapes` must hold non-negative (height, width) "
                              "pairs, got (",
                              h, ", ", w, ") at level ", l));
    WORKBOOK_CHECK_VALUE(starts[l] == start,
                         text(op,
                              ": `level_start_index` must be the running sum of the levels' "
                              "areas (height * width of `spatial_shapes`): level ",
                              l, " starts at row ", start, ", got ", starts[l]));
    int64_t area = 0;
    WORKBOOK_CHECK_VALUE(
        !mul_overflows(h, w, &area) && !add_overflows(start, area, &start) && start <= g.values,
        text(op, ": `spatial_shapes` must tile the ", g.values,
             " rows of `value` (dimension 1), but levels 0..", l, " already cover more (level ", l,
             ": ", h, " x ", w, ")"));
  }
  WORKBOOK_CHECK_VALUE(start == g.values,
                       text(op, ": `spatial_shapes` must tile the ", g.values,
                            " rows of `value` (dimension 1): its levels' areas (height * width) "
                            "sum to ",
                            start));
}

// ----------------------------------------------------------------------------------------------
// Sampling
//
// Where the location (lx, ly) of a level of height x width falls, in the level's pixels:
// grid_sample's unnormalisation with align_corners=False, x = lx W - 0.5. A point outside the
// plane, or a NaN location, is out of range (bilinear.h: in_range false) and contributes nothing,
// as in the reference kernel (which tests h > -1 && w > -1 && h < H && w < W; at exactly -1 the
// value is 0 either way). The CPU and the CUDA kernels call this one function.
template <typename T>
WORKBOOK_HOST_DEVICE inline bilinear::Point<T> locate(T lx, T ly, int64_t height, int64_t width) {
  return bilinear::locate(ly * static_cast<T>(height) - T(0.5), lx * static_cast<T>(width) - T(0.5),
                          height, width);
}

}  // namespace workbook::ms_deform_attn
