// Stage 06: the deformable convolution's CPU kernels, over raw pointers: the sample table,
// im2col, the scatter back (col2im) and the offset and mask gradients.
//
// Two kinds of library compile them, as stage 05's lltm_cpu.h: the ATen ones (stage 06's
// deform_conv2d_cpu.cpp, which stage 07 compiles too) and stage 10's, on the stable ABI (its
// csrc/deform_conv2d/cpu/deform_conv2d_cpu.cpp). So this file includes nothing of ATen's: the
// parallel loop comes from workbook/cpu.h, the checks and geometry from workbook/deform_conv2d.h,
// the bilinear arithmetic from workbook/bilinear.h (the last two shared with stage 07's CUDA
// kernels). One part differs by ABI, in the open: the four dot products of the offset gradient
// (CornerDots). What the glue around these kernels does (converting the inputs into the layouts
// below, the GEMMs, dtype dispatch, registration) is each library's own: `make diff 10`.
//
// The run card, the timings and the napkin math are in deform_conv2d_cpu.cpp beside this file.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <vector>

#include "workbook/bilinear.h"
#include "workbook/cpu.h"
#include "workbook/deform_conv2d.h"
#include "workbook/host_device.h"

namespace deform_conv2d_kernels {

using workbook::ceil_div;
using workbook::deform_conv2d::Chunk;
using workbook::deform_conv2d::Geometry;

// ----------------------------------------------------------------------------------------------
// Kernels
//
// Layouts (compute type T, all contiguous; K = kh kw taps, P = Ho Wo positions, G offset groups):
//   input    [N, plane, C]       channels-last, each image in a zero-bordered padded plane
//   offset   [N, 2 G K, P]       as given: (dy, dx) of (offset group g, tap k) at 2 (g K + k)
//   mask     [N, G K, P]         or null (a mask of ones)
//   columns  [images, Pc, C K]   the chunk's images and positions; a row holds, per conv group
//                                gw, [K][C / groups] (tap-major), matching the weight permuted
//                                to [O, kh, kw, C / groups]
//   table    [images, Pc, G K]   one bilinear sample (base index, 4 weights), shared by the
//                                channels of its offset group
//
// The padded plane: the image sits at rows 1..H, columns 1..W of a (H + 3) x (W + 2) plane whose
// border is zero. Every point bilinear.h calls in range (-1 <= y < H, -1 <= x < W) then has its
// four corners inside the padded plane, so a sample is one base pixel plus the fixed steps +1,
// +row, +row + 1, with no validity test in the inner loops: a corner outside the image reads
// zeros (and, in the backward, scatters into the border, which is thrown away). Points out of
// range, and NaN points, use `outside`, rows H + 1 and H + 2, zero too. Why not give invalid
// corners a zero weight instead: 0 * inf is NaN, and a pixel's inf must not leak into samples
// that do not touch it.
struct PaddedPlane {
  int64_t row;      // W + 2 pixels
  int64_t size;     // (H + 3) (W + 2) pixels
  int64_t outside;  // (H + 1) (W + 2): a base pixel whose four corners are all zero

  explicit PaddedPlane(const Geometry& g) {
    // The checks bound the output, not the input: an expanded (stride 0) input can pass them with
    // sizes that no padded copy could hold.
    int64_t rows = 0, image = 0;
    WORKBOOK_CHECK(!workbook::add_overflows(g.height, 3, &rows) &&
                       !workbook::add_overflows(g.width, 2, &row) &&
                       !workbook::mul_overflows(rows, row, &size) &&
                       !workbook::mul_overflows(size, g.in_channels, &image),
                   workbook::text("deform_conv2d: `input` of height ", g.height, ", width ",
                                  g.width, " and ", g.in_channels,
                                  " channels is too large for the CPU kernel's padded copy of it"));
    outside = (g.height + 1) * row;
  }

  template <typename T>
  int64_t base(const workbook::bilinear::Point<T>& s) const {
    return s.in_range ? (s.y0 + 1) * row + (s.x0 + 1) : outside;
  }
};

// Column buffers (and the table) never exceed this: a batch is cut into chunks of whole images
// when one fits, else one image into blocks of output rows (workbook/deform_conv2d.h,
// the CUDA kernel's planner too, with a budget of its own). 32 MiB: large enough that the GEMMs
// see thousands of positions, small enough not to matter next to a network's activations.
constexpr int64_t kColumnBudgetBytes = int64_t{32} << 20;

// Positions (GEMM rows or columns) per GEMM task. The GEMMs are cut into fixed blocks (never
// along the reduction) and run one per task inside at::parallel_for, where BLAS runs
// single-threaded (measured: an mm inside a 2-thread region takes its 1-thread time, though
// MKL reports 2 threads there): each output element comes from one BLAS call whose shape does not
// depend on the thread count, hence the same bits for any thread count. 256 leaves several tasks
// per image even at 28 x 28; 1024 measured within noise of it at 56 x 56.
constexpr int64_t kGemmPositions = 256;
// Columns of grad_weight (kh kw C / groups of them) per task. Each task packs the whole chunk's
// grad_output for BLAS, so fewer, wider tasks pack less: 96 makes 6 tasks at C 64, 3 x 3, even
// on 2 or 3 threads (32, 18 tasks, measured a few per cent slower).
constexpr int64_t kWeightGradColumns = 96;
// Channels per scatter task: 16 floats, one 64-byte line when C is a multiple of 16.
constexpr int64_t kChannelBlock = 16;

// The channels of one offset group, cut where a conv group ends. Within a run, channel c and tap
// k sit at column `column + k * per_group + (c - c0)` of a position's row: contiguous in c.
struct ChannelRun {
  int64_t offset_group, c0, c1, column;
};

struct ColumnLayout {
  int64_t taps, per_group, width;             // width = C K, the length of a column row
  std::vector<std::vector<ChannelRun>> runs;  // per offset group
  std::vector<ChannelRun> blocks;             // runs cut to <= kChannelBlock: the scatter's tasks

  explicit ColumnLayout(const Geometry& g)
      : taps(g.taps()), per_group(g.channels_per_group()), width(g.in_channels * g.taps()) {
    const int64_t per_offset_group = g.channels_per_offset_group();
    runs.resize(g.offset_groups);
    for (int64_t og = 0; og < g.offset_groups; ++og) {
      for (int64_t c = og * per_offset_group; c < (og + 1) * per_offset_group;) {
        const int64_t gw = c / per_group;
        const int64_t c1 = std::min((og + 1) * per_offset_group, (gw + 1) * per_group);
        runs[og].push_back({og, c, c1, gw * taps * per_group + (c - gw * per_group)});
        c = c1;
      }
    }
    for (const auto& group_runs : runs) {
      for (const auto& run : group_runs) {
        for (int64_t c = run.c0; c < run.c1; c += kChannelBlock) {
          blocks.push_back({run.offset_group, c, std::min(run.c1, c + kChannelBlock),
                            run.column + (c - run.c0)});
        }
      }
    }
  }
};

template <typename T>
struct Problem {
  Geometry g;
  PaddedPlane plane;
  const ColumnLayout* layout;
  const T* input;  // padded channels-last planes; null when no pass reads the input
  const T* offset;
  const T* mask;  // null: no mask
};

// The dtype a kernel computes in: half and bfloat16 in float, float and double natively.
inline c10::ScalarType compute_type(c10::ScalarType type) {
  return type == c10::ScalarType::Double ? c10::ScalarType::Double : c10::ScalarType::Float;
}

template <typename T>
int64_t table_bytes_per_position(const Geometry& g) {
  return g.offset_groups * g.taps() * static_cast<int64_t>(sizeof(int64_t) + 4 * sizeof(T));
}

// How a launcher cuts its batch (workbook/deform_conv2d.h), from the bytes its buffers take per
// output position. The forward: the columns and the table.
template <typename T>
workbook::deform_conv2d::ChunkPlan plan_forward(const Geometry& g, const ColumnLayout& layout) {
  const int64_t per_position =
      layout.width * static_cast<int64_t>(sizeof(T)) + table_bytes_per_position<T>(g);
  return workbook::deform_conv2d::plan_chunks(g, per_position, kColumnBudgetBytes);
}

// The backward: the columns (for grad_weight, with the chunk's grad_output beside them), the grad
// columns (for the other gradients), the table.
template <typename T>
workbook::deform_conv2d::ChunkPlan plan_backward(const Geometry& g, const ColumnLayout& layout,
                                                 bool want_weight, bool want_columns_grad) {
  const int64_t values =
      (want_weight ? layout.width + g.out_channels : 0) + (want_columns_grad ? layout.width : 0);
  const int64_t per_position =
      values * static_cast<int64_t>(sizeof(T)) + table_bytes_per_position<T>(g);
  return workbook::deform_conv2d::plan_chunks(g, per_position, kColumnBudgetBytes);
}

// Calls fn(gk, sample) for every offset group g and tap k (gk = g K + k) of output position p of
// image n, in that order: where that tap samples the input. One division per position; the taps'
// integer offsets are stepped.
template <typename T, typename Fn>
void for_each_sample(const Problem<T>& pb, int64_t n, int64_t p, const Fn& fn) {
  const Geometry& g = pb.g;
  const int64_t P = g.positions(), oh = p / g.out_w, ow = p % g.out_w;
  const T* offsets = pb.offset + n * 2 * g.offset_groups * g.taps() * P + p;
  int64_t gk = 0;
  for (int64_t og = 0; og < g.offset_groups; ++og) {
    for (int64_t ki = 0; ki < g.kernel_h; ++ki) {
      // Integer part in int64 (it lies in [-pad, H + pad), checked to fit), then one rounding.
      const T y0 = static_cast<T>(oh * g.stride_h - g.pad_h + ki * g.dilation_h);
      for (int64_t kj = 0; kj < g.kernel_w; ++kj, ++gk) {
        const T x0 = static_cast<T>(ow * g.stride_w - g.pad_w + kj * g.dilation_w);
        const T y = y0 + offsets[2 * gk * P], x = x0 + offsets[(2 * gk + 1) * P];
        fn(gk, workbook::bilinear::locate<T>(y, x, g.height, g.width));
      }
    }
  }
}

// The sample table of a chunk: for entry e = (i Pc + q) G K + g K + k (image n0 + i, position
// p0 + q, offset group g, tap k), base[e] is the padded-plane pixel of corner c0 and
// weight[4 e + c] = mask * bilinear weight of corner c.
template <typename T>
WORKBOOK_CPU_CLONES void build_sample_table_tasks(const Problem<T>& pb, const Chunk& ch,
                                                  int64_t* base, T* weight, int64_t begin,
                                                  int64_t end) {
  const Geometry& g = pb.g;
  const int64_t GK = g.offset_groups * g.taps(), P = g.positions();
  for (int64_t t = begin; t < end; ++t) {
    const int64_t n = ch.n0 + t / ch.positions, p = ch.p0 + t % ch.positions;
    for_each_sample(pb, n, p, [&](int64_t gk, const workbook::bilinear::Point<T>& s) {
      // EXERCISE bilinear-sample: entry e: base[e] (corner c0's pixel), weight[4e + c] = mask w_c
      // checked by: test_deform_conv2d.py::test_against_reference,
      //   ::test_zero_offsets_and_unit_mask_are_a_convolution, ::test_matches_torchvision
      const T scale = pb.mask ? pb.mask[(n * GK + gk) * P + p] : T(1);
      const int64_t e = t * GK + gk;
      base[e] = pb.plane.base(s);
      for (int c = 0; c < 4; ++c) weight[4 * e + c] = scale * s.weight(c);
      // END EXERCISE bilinear-sample
    });
  }
}

template <typename T>
void build_sample_table(const Problem<T>& pb, const Chunk& ch, int64_t* base, T* weight) {
  workbook::cpu::parallel_for(0, ch.images * ch.positions, 1, [&](int64_t begin, int64_t end) {
    build_sample_table_tasks(pb, ch, base, weight, begin, end);
  });
}

// The inner loops, over a run of contiguous channels. x0..x3 are the run in the four corner
// pixels; distinct pixels, so the restrict promises hold.
template <typename T>
inline void blend_corners(T* __restrict__ out, const T* __restrict__ x0, const T* __restrict__ x1,
                          const T* __restrict__ x2, const T* __restrict__ x3, const T* w,
                          int64_t len) {
  const T w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
  WORKBOOK_SIMD_LOOP for (int64_t c = 0; c < len; ++c) out[c] =
      w0 * x0[c] + w1 * x1[c] + w2 * x2[c] + w3 * x3[c];
}

template <typename T>
inline void spread_corners(T* __restrict__ x0, T* __restrict__ x1, T* __restrict__ x2,
                           T* __restrict__ x3, const T* __restrict__ grad, const T* w,
                           int64_t len) {
  const T w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
  WORKBOOK_SIMD_LOOP for (int64_t c = 0; c < len; ++c) {
    const T v = grad[c];
    x0[c] += w0 * v;
    x1[c] += w1 * v;
    x2[c] += w2 * v;
    x3[c] += w3 * v;
  }
}

// Four dot products over runs of channels, sum_c grad[c] x_j[c] for the corners j, in a fixed
// order: the same sums for any thread count. Built with ATen, in at::vec registers (lane =
// channel mod the vector size), folded by at::vec's fixed shuffle tree, as stage 05 uses at::vec;
// on the stable ABI, which has no at::vec (workbook/cpu.h), a loop the compiler vectorises as a
// SIMD reduction, its order fixed when the library is compiled.
#ifndef TORCH_TARGET_VERSION
template <typename T>
struct CornerDots {
  using V = at::vec::Vectorized<T>;
  V sums[4] = {V(T(0)), V(T(0)), V(T(0)), V(T(0))};

  void add(const T* grad, const T* x0, const T* x1, const T* x2, const T* x3, int64_t len) {
    int64_t c = 0;
    for (; c + V::size() <= len; c += V::size()) {
      const V v = V::loadu(grad + c);
      sums[0] = at::vec::fmadd(v, V::loadu(x0 + c), sums[0]);
      sums[1] = at::vec::fmadd(v, V::loadu(x1 + c), sums[1]);
      sums[2] = at::vec::fmadd(v, V::loadu(x2 + c), sums[2]);
      sums[3] = at::vec::fmadd(v, V::loadu(x3 + c), sums[3]);
    }
    if (c < len) {  // partial loads fill the missing lanes with zeros
      const int64_t rest = len - c;
      const V v = V::loadu(grad + c, rest);
      sums[0] = at::vec::fmadd(v, V::loadu(x0 + c, rest), sums[0]);
      sums[1] = at::vec::fmadd(v, V::loadu(x1 + c, rest), sums[1]);
      sums[2] = at::vec::fmadd(v, V::loadu(x2 + c, rest), sums[2]);
      sums[3] = at::vec::fmadd(v, V::loadu(x3 + c, rest), sums[3]);
    }
  }

  std::array<T, 4> fold() const {
    const std::plus<V> plus;
    return {at::vec::vec_reduce_all<T>(plus, sums[0]), at::vec::vec_reduce_all<T>(plus, sums[1]),
            at::vec::vec_reduce_all<T>(plus, sums[2]), at::vec::vec_reduce_all<T>(plus, sums[3])};
  }
};
#else
template <typename T>
struct CornerDots {
  T sums[4] = {T(0), T(0), T(0), T(0)};

  void add(const T* grad, const T* x0, const T* x1, const T* x2, const T* x3, int64_t len) {
    T s0 = T(0), s1 = T(0), s2 = T(0), s3 = T(0);
    WORKBOOK_SIMD_SUM(s0, s1, s2, s3) for (int64_t c = 0; c < len; ++c) {
      const T v = grad[c];
      s0 += v * x0[c];
      s1 += v * x1[c];
      s2 += v * x2[c];
      s3 += v * x3[c];
    }
    sums[0] += s0;
    sums[1] += s1;
    sums[2] += s2;
    sums[3] += s3;
  }

  std::array<T, 4> fold() const { return {sums[0], sums[1], sums[2], sums[3]}; }
};
#endif

// im2col, one task per (image, position) row: for each sample, each run of its offset group's
// channels is one blend of four contiguous runs.
template <typename T>
WORKBOOK_CPU_CLONES void sample_columns_tasks(const Problem<T>& pb, const Chunk& ch,
                                              const int64_t* base, const T* weight, T* columns,
                                              int64_t begin, int64_t end) {
  const Geometry& g = pb.g;
  const ColumnLayout& layout = *pb.layout;
  const int64_t C = g.in_channels, K = g.taps(), GK = g.offset_groups * K;
  const int64_t row = pb.plane.row * C;
  for (int64_t t = begin; t < end; ++t) {
    const T* image = pb.input + (ch.n0 + t / ch.positions) * pb.plane.size * C;
    T* out = columns + t * layout.width;
    for (int64_t gk = 0; gk < GK; ++gk) {
      const int64_t e = t * GK + gk, k = gk % K;
      const T* x0 = image + base[e] * C;
      for (const auto& run : layout.runs[gk / K]) {
        blend_corners(out + run.column + k * layout.per_group, x0 + run.c0, x0 + C + run.c0,
                      x0 + row + run.c0, x0 + row + C + run.c0, weight + 4 * e, run.c1 - run.c0);
      }
    }
  }
}

template <typename T>
void sample_columns(const Problem<T>& pb, const Chunk& ch, const int64_t* base, const T* weight,
                    T* columns) {
  workbook::cpu::parallel_for(0, ch.images * ch.positions, 1, [&](int64_t begin, int64_t end) {
    sample_columns_tasks(pb, ch, base, weight, columns, begin, end);
  });
}

// col2im for grad_input: the grad columns scattered back through the table. Which pixels a
// sample touches depends on the data, but channel c of the columns only ever reaches channel c of
// the input: one task per (image, block of channels) owns those channels of the whole image and
// adds into them in a fixed order. Race-free without atomics, and deterministic.
template <typename T>
WORKBOOK_CPU_CLONES void scatter_columns_tasks(const Problem<T>& pb, const Chunk& ch,
                                               const int64_t* base, const T* weight,
                                               const T* grad_columns, T* grad_input, int64_t begin,
                                               int64_t end) {
  const Geometry& g = pb.g;
  const ColumnLayout& layout = *pb.layout;
  const int64_t C = g.in_channels, K = g.taps(), GK = g.offset_groups * K;
  const int64_t row = pb.plane.row * C;
  const int64_t blocks = static_cast<int64_t>(layout.blocks.size());
  for (int64_t t = begin; t < end; ++t) {
    const int64_t i = t / blocks;
    const ChannelRun& block = layout.blocks[t % blocks];
    T* image = grad_input + (ch.n0 + i) * pb.plane.size * C + block.c0;
    for (int64_t q = 0; q < ch.positions; ++q) {
      const int64_t entry = (i * ch.positions + q) * GK + block.offset_group * K;
      const T* grad = grad_columns + (i * ch.positions + q) * layout.width + block.column;
      for (int64_t k = 0; k < K; ++k) {
        T* x0 = image + base[entry + k] * C;
        spread_corners(x0, x0 + C, x0 + row, x0 + row + C, grad + k * layout.per_group,
                       weight + 4 * (entry + k), block.c1 - block.c0);
      }
    }
  }
}

template <typename T>
void scatter_columns(const Problem<T>& pb, const Chunk& ch, const int64_t* base, const T* weight,
                     const T* grad_columns, T* grad_input) {
  const int64_t blocks = static_cast<int64_t>(pb.layout->blocks.size());
  workbook::cpu::parallel_for(0, ch.images * blocks, 1, [&](int64_t begin, int64_t end) {
    scatter_columns_tasks(pb, ch, base, weight, grad_columns, grad_input, begin, end);
  });
}

// grad_offset and grad_mask. For a sample with mask m and corner weights w_j,
//   column_c = m sum_j w_j v_cj   for the channels c of its offset group, so with
//   A_j = sum_c grad_column_c v_cj  (dot products over the channel runs, in a fixed order)
//   grad_dy = m sum_j dw_j/dy A_j,   grad_dx = m sum_j dw_j/dx A_j,   grad_mask = sum_j w_j A_j.
// One task per (image, position) owns that position's gradients for every group and tap.
template <typename T>
WORKBOOK_CPU_CLONES void offset_and_mask_gradients_tasks(const Problem<T>& pb, const Chunk& ch,
                                                         const int64_t* base, const T* grad_columns,
                                                         T* grad_offset, T* grad_mask,
                                                         int64_t begin, int64_t end) {
  const Geometry& g = pb.g;
  const ColumnLayout& layout = *pb.layout;
  const int64_t C = g.in_channels, K = g.taps(), GK = g.offset_groups * K, P = g.positions();
  const int64_t row = pb.plane.row * C;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t n = ch.n0 + t / ch.positions, p = ch.p0 + t % ch.positions;
    const T* image = pb.input + n * pb.plane.size * C;
    const T* grad = grad_columns + t * layout.width;
    // The derivative weights come from the same samples the table was built from.
    for_each_sample(pb, n, p, [&](int64_t gk, const workbook::bilinear::Point<T>& s) {
      const int64_t k = gk % K;
      const T* x0 = image + base[t * GK + gk] * C;
      CornerDots<T> dots;
      for (const auto& run : layout.runs[gk / K]) {
        dots.add(grad + run.column + k * layout.per_group, x0 + run.c0, x0 + C + run.c0,
                 x0 + row + run.c0, x0 + row + C + run.c0, run.c1 - run.c0);
      }
      const std::array<T, 4> acc = dots.fold();
      // EXERCISE bilinear-gradient: grad_offset (m sum_j dw_j A_j), grad_mask (sum_j w_j A_j)
      // checked by: test_deform_conv2d.py::test_against_reference, ::test_gradcheck,
      //   ::test_offsets_far_outside_give_zero_and_finite_zero_gradients
      T d_y = T(0), d_x = T(0), d_m = T(0);
      for (int j = 0; j < 4; ++j) {
        d_y += s.d_weight_dy(j) * acc[j];
        d_x += s.d_weight_dx(j) * acc[j];
        d_m += s.weight(j) * acc[j];
      }
      const T scale = pb.mask ? pb.mask[(n * GK + gk) * P + p] : T(1);
      if (grad_offset != nullptr) {
        grad_offset[(n * 2 * GK + 2 * gk) * P + p] = scale * d_y;
        grad_offset[(n * 2 * GK + 2 * gk + 1) * P + p] = scale * d_x;
      }
      if (grad_mask != nullptr) grad_mask[(n * GK + gk) * P + p] = d_m;
      // END EXERCISE bilinear-gradient
    });
  }
}

template <typename T>
void offset_and_mask_gradients(const Problem<T>& pb, const Chunk& ch, const int64_t* base,
                               const T* grad_columns, T* grad_offset, T* grad_mask) {
  workbook::cpu::parallel_for(0, ch.images * ch.positions, 1, [&](int64_t begin, int64_t end) {
    offset_and_mask_gradients_tasks(pb, ch, base, grad_columns, grad_offset, grad_mask, begin, end);
  });
}

// grad_bias[o] = sum over n, p of grad_output[n, o, p]: one task per channel, 8 double lanes in
// a fixed pattern (vectorisable without reassociation, the same for any thread count).
template <typename T>
void sum_bias_gradient(const T* grad_output, T* grad_bias, int64_t batch, int64_t channels,
                       int64_t positions) {
  constexpr int64_t kLanes = 8;
  workbook::cpu::parallel_for(0, channels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      double lanes[kLanes] = {};
      for (int64_t n = 0; n < batch; ++n) {
        const T* row = grad_output + (n * channels + o) * positions;
        int64_t p = 0;
        for (; p + kLanes <= positions; p += kLanes) {
          for (int64_t l = 0; l < kLanes; ++l) lanes[l] += static_cast<double>(row[p + l]);
        }
        for (int64_t l = 0; p < positions; ++p, ++l) lanes[l] += static_cast<double>(row[p]);
      }
      double total = 0;
      for (int64_t l = 0; l < kLanes; ++l) total += lanes[l];
      grad_bias[o] = static_cast<T>(total);
    }
  });
}

}  // namespace deform_conv2d_kernels
