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
// Sections: kernels, launchers (the ops), registration. The checks are in
// workbook/deform_conv2d.h and the bilinear arithmetic in workbook/bilinear.h, both shared
// with the CUDA kernels of stage 07.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "workbook/bilinear.h"
#include "workbook/deform_conv2d.h"
#include "workbook/host_device.h"

namespace {

using workbook::ceil_div;
using workbook::deform_conv2d::Chunk;
using workbook::deform_conv2d::ChunkPlan;
using workbook::deform_conv2d::for_each_chunk;
using workbook::deform_conv2d::Geometry;
using workbook::deform_conv2d::plan_chunks;

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
    TORCH_CHECK(!c10::add_overflows<int64_t>(g.height, 3, &rows) &&
                    !c10::add_overflows<int64_t>(g.width, 2, &row) &&
                    !c10::mul_overflows<int64_t>(rows, row, &size) &&
                    !c10::mul_overflows<int64_t>(size, g.in_channels, &image),
                "deform_conv2d: `input` of height ", g.height, ", width ", g.width, " and ",
                g.in_channels, " channels is too large for the CPU kernel's padded copy of it");
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

template <typename T>
int64_t table_bytes_per_position(const Geometry& g) {
  return g.offset_groups * g.taps() * static_cast<int64_t>(sizeof(int64_t) + 4 * sizeof(T));
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
void build_sample_table(const Problem<T>& pb, const Chunk& ch, int64_t* base, T* weight) {
  const Geometry& g = pb.g;
  const int64_t GK = g.offset_groups * g.taps(), P = g.positions();
  at::parallel_for(0, ch.images * ch.positions, 1, [&](int64_t begin, int64_t end) {
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
  });
}

// The inner loops, over a run of contiguous channels. x0..x3 are the run in the four corner
// pixels; distinct pixels, so the restrict promises hold.
template <typename T>
inline void blend_corners(T* __restrict__ out, const T* __restrict__ x0, const T* __restrict__ x1,
                          const T* __restrict__ x2, const T* __restrict__ x3, const T* w,
                          int64_t len) {
  const T w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
  for (int64_t c = 0; c < len; ++c) out[c] = w0 * x0[c] + w1 * x1[c] + w2 * x2[c] + w3 * x3[c];
}

template <typename T>
inline void spread_corners(T* __restrict__ x0, T* __restrict__ x1, T* __restrict__ x2,
                           T* __restrict__ x3, const T* __restrict__ grad, const T* w,
                           int64_t len) {
  const T w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
  for (int64_t c = 0; c < len; ++c) {
    const T v = grad[c];
    x0[c] += w0 * v;
    x1[c] += w1 * v;
    x2[c] += w2 * v;
    x3[c] += w3 * v;
  }
}

// Four dot products over runs of channels, sum_c grad[c] x_j[c] for the corners j, in at::vec
// registers (lane = channel mod the vector size), folded by at::vec's fixed shuffle tree: the
// same sums for any thread count. Stage 05 uses at::vec the same way.
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

// im2col, one task per (image, position) row: for each sample, each run of its offset group's
// channels is one blend of four contiguous runs.
template <typename T>
void sample_columns(const Problem<T>& pb, const Chunk& ch, const int64_t* base, const T* weight,
                    T* columns) {
  const Geometry& g = pb.g;
  const ColumnLayout& layout = *pb.layout;
  const int64_t C = g.in_channels, K = g.taps(), GK = g.offset_groups * K;
  const int64_t row = pb.plane.row * C;
  at::parallel_for(0, ch.images * ch.positions, 1, [&](int64_t begin, int64_t end) {
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
  });
}

// col2im for grad_input: the grad columns scattered back through the table. Which pixels a
// sample touches depends on the data, but channel c of the columns only ever reaches channel c of
// the input: one task per (image, block of channels) owns those channels of the whole image and
// adds into them in a fixed order. Race-free without atomics, and deterministic.
template <typename T>
void scatter_columns(const Problem<T>& pb, const Chunk& ch, const int64_t* base, const T* weight,
                     const T* grad_columns, T* grad_input) {
  const Geometry& g = pb.g;
  const ColumnLayout& layout = *pb.layout;
  const int64_t C = g.in_channels, K = g.taps(), GK = g.offset_groups * K;
  const int64_t row = pb.plane.row * C;
  const int64_t blocks = static_cast<int64_t>(layout.blocks.size());
  at::parallel_for(0, ch.images * blocks, 1, [&](int64_t begin, int64_t end) {
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
  });
}

// grad_offset and grad_mask. For a sample with mask m and corner weights w_j,
//   column_c = m sum_j w_j v_cj   for the channels c of its offset group, so with
//   A_j = sum_c grad_column_c v_cj  (dot products over the channel runs, in a fixed order)
//   grad_dy = m sum_j dw_j/dy A_j,   grad_dx = m sum_j dw_j/dx A_j,   grad_mask = sum_j w_j A_j.
// One task per (image, position) owns that position's gradients for every group and tap.
template <typename T>
void offset_and_mask_gradients(const Problem<T>& pb, const Chunk& ch, const int64_t* base,
                               const T* grad_columns, T* grad_offset, T* grad_mask) {
  const Geometry& g = pb.g;
  const ColumnLayout& layout = *pb.layout;
  const int64_t C = g.in_channels, K = g.taps(), GK = g.offset_groups * K, P = g.positions();
  const int64_t row = pb.plane.row * C;
  at::parallel_for(0, ch.images * ch.positions, 1, [&](int64_t begin, int64_t end) {
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
  });
}

// grad_bias[o] = sum over n, p of grad_output[n, o, p]: one task per channel, 8 double lanes in
// a fixed pattern (vectorisable without reassociation, the same for any thread count).
template <typename T>
void sum_bias_gradient(const T* grad_output, T* grad_bias, int64_t batch, int64_t channels,
                       int64_t positions) {
  constexpr int64_t kLanes = 8;
  at::parallel_for(0, channels, 1, [&](int64_t begin, int64_t end) {
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

// The GEMMs, on tensor views made inside the tasks. The guard skips the autograd and
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

at::ScalarType compute_type(at::ScalarType type) {
  return type == at::kDouble ? at::kDouble : at::kFloat;
}

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
      const int64_t per_position =
          layout.width * static_cast<int64_t>(sizeof(T)) + table_bytes_per_position<T>(g);
      const ChunkPlan plan = plan_chunks(g, per_position, kColumnBudgetBytes);
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
    at::IntArrayRef padding, at::IntArrayRef dilation, std::array<bool, 5> output_mask) {
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
      // Per position: the columns (for grad_weight, with the chunk's grad_output beside them),
      // the grad columns, the table.
      const int64_t values = (want_weight ? layout.width + g.out_channels : 0) +
                             (want_columns_grad ? layout.width : 0);
      const int64_t per_position =
          values * static_cast<int64_t>(sizeof(T)) + table_bytes_per_position<T>(g);
      const ChunkPlan plan = plan_chunks(g, per_position, kColumnBudgetBytes);
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
