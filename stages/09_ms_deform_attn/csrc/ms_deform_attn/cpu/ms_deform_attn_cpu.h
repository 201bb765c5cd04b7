// Stage 09: multi-scale deformable attention's CPU kernels, over raw pointers.
//
// Like stage 06's deform_conv2d_cpu.h, this file includes nothing of ATen's, so the ATen library
// (ms_deform_attn_cpu.cpp beside it) and the stable-ABI one compile the same kernels: the
// parallel loop is workbook/cpu.h's, the geometry and the sampling workbook/ms_deform_attn.h's,
// shared with the CUDA kernels (../cuda/ms_deform_attn_cuda.cuh).
//
// Layouts (all contiguous, element type T, computed in acc_t = opmath_t<T>: float for half and
// bfloat16):
//   value               [N, S, M, D]     a value row (n, s) holds every head's D channels
//   sampling_locations  [N, Lq, M, L, P, 2]
//   attention_weights   [N, Lq, M, L, P]
//   out, grad_output    [N, Lq, M, D]    (the op's [N, Lq, M D], viewed)
//   shapes [L][2], starts [L]            the level table, on the host, checked
//
// Work and ownership, so that no two tasks write one element and every sum runs in an order fixed
// by the shapes alone: the same bits for any number of threads, no atomics.
//   forward   tasks over (n, q): each writes out[n, q] for every head, summing its L P samples
//             in order, each sample's 4 corners in order, D channels at a time (a vector loop).
//   backward  tasks over (n, m): value's gradient for head m of image n is a scatter from every
//             query of that image and head, and no other query touches those rows, so one task
//             owns grad_value[n, :, m, :] and walks the queries in order. The same walk reads the
//             4 corner rows it scatters into and gives the location and weight gradients of each
//             sample (dot products of grad_output with the corners), which the task owns too.
//   That is N M tasks: 8 per image for Deformable DETR's heads, enough for the cores a CPU
//   training step has, with none idle for N M at or above the thread count.
//
// The napkin floor and the measured times are in the stage's README (`make bench`).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "workbook/cpu.h"
#include "workbook/ms_deform_attn.h"

namespace ms_deform_attn_kernels {

using workbook::ms_deform_attn::Geometry;

// Sums of D products kept as kLanes partial sums, added in a fixed order at the end: the loop
// over j is the vector the compiler makes (no reassociation needed, so no -ffast-math), and the
// result does not depend on the machine's vector width.
constexpr int64_t kLanes = 16;

template <typename acc_t, typename T>
inline acc_t dot(const acc_t* a, const T* b, int64_t n) {
  acc_t part[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) part[j] += a[d + j] * static_cast<acc_t>(b[d + j]);
  }
  for (int64_t j = 0; d + j < n; ++j) part[j] += a[d + j] * static_cast<acc_t>(b[d + j]);
  acc_t sum = 0;
  for (int64_t j = 0; j < kLanes; ++j) sum += part[j];
  return sum;
}

// The level table, one entry per level: its plane's size and where its rows start.
struct Level {
  int64_t height, width, start;
};

inline std::vector<Level> level_table(const Geometry& g, const int64_t* shapes,
                                      const int64_t* starts) {
  std::vector<Level> levels(g.levels);
  for (int64_t l = 0; l < g.levels; ++l) levels[l] = {shapes[2 * l], shapes[2 * l + 1], starts[l]};
  return levels;
}

// ----------------------------------------------------------------------------------------------
// Forward

// The rows [begin, end) of the forward: a task. Compiled once per instruction set on the
// stable ABI (WORKBOOK_CPU_CLONES, workbook/cpu.h), with the loops it inlines.
template <int kD, typename T>
WORKBOOK_CPU_CLONES void forward_rows(const Geometry& g, const std::vector<Level>& levels,
                                      const T* value, const T* locations, const T* weights, T* out,
                                      int64_t begin, int64_t end) {
  using acc_t = workbook::cpu::opmath_t<T>;
  const int64_t M = g.heads, D = kD > 0 ? kD : g.channels, L = g.levels, P = g.points;
  acc_t fixed[kD > 0 ? kD : 1];
  std::vector<acc_t> dynamic(kD > 0 ? 0 : D);
  acc_t* acc = kD > 0 ? fixed : dynamic.data();
  for (int64_t r = begin; r < end; ++r) {
    const int64_t n = r / g.queries;
    for (int64_t m = 0; m < M; ++m) {
      std::fill(acc, acc + D, acc_t(0));
      const int64_t head = r * M + m;  // (n, q, m)
      const T* loc = locations + head * L * P * 2;
      const T* weight = weights + head * L * P;
      for (int64_t l = 0; l < L; ++l) {
        const Level& lv = levels[l];
        const T* plane = value + ((n * g.values + lv.start) * M + m) * D;  // row stride M D
        for (int64_t p = 0; p < P; ++p) {
          const int64_t k = l * P + p;
          const auto s = workbook::ms_deform_attn::locate<acc_t>(static_cast<acc_t>(loc[2 * k]),
                                                                 static_cast<acc_t>(loc[2 * k + 1]),
                                                                 lv.height, lv.width);
          if (!s.in_range) continue;
          // EXERCISE msda-corner-blend: acc += a w_c value row, for each valid corner c of s
          // checked by: test_ms_deform_attn.py::test_against_reference, ::test_gradcheck,
          //   ::test_points_outside_or_nan_sample_nothing
          const acc_t a = static_cast<acc_t>(weight[k]);
          for (int c = 0; c < 4; ++c) {
            if (!s.valid(c)) continue;
            const acc_t w = a * s.weight(c);
            const T* v = plane + s.index(c) * M * D;  // the corner's row: M D apart per pixel
            WORKBOOK_SIMD_LOOP
            for (int64_t d = 0; d < D; ++d) acc[d] += w * static_cast<acc_t>(v[d]);
          }
          // END EXERCISE msda-corner-blend
        }
      }
      T* o = out + head * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d]);
    }
  }
}

// kD: the channels per head when known at compile time (0: g.channels, at run time). With kD
// known the compiler unrolls every loop over the channels and keeps the accumulator in registers
// (dispatched for Deformable DETR's 32: `forward` and `backward` below).
template <int kD, typename T>
void forward_channels(const Geometry& g, const std::vector<Level>& levels, const T* value,
                      const T* locations, const T* weights, T* out) {
  const int64_t M = g.heads, D = kD > 0 ? kD : g.channels, L = g.levels, P = g.points;
  const int64_t rows = g.batch * g.queries;
  // Enough samples per task that a task's overhead (a few microseconds) is noise.
  const int64_t per_row = std::max<int64_t>(1, M * L * P * std::max<int64_t>(D, 1));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / per_row);
  workbook::cpu::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    forward_rows<kD>(g, levels, value, locations, weights, out, begin, end);
  });
}

// ----------------------------------------------------------------------------------------------
// Backward
//
// Which gradients to compute: value's, the locations', the weights'. The caller zeroes
// grad_value (when wanted); the other two are written whole.
struct Wanted {
  bool value, locations, weights;
};

// The tasks [begin, end) of the backward, one per (image, head). Compiled once per instruction
// set on the stable ABI (WORKBOOK_CPU_CLONES), as forward_rows.
template <int kD, typename T>
WORKBOOK_CPU_CLONES void backward_tasks(const Geometry& g, const std::vector<Level>& levels,
                                        const T* grad_output, const T* value, const T* locations,
                                        const T* weights, T* grad_value, T* grad_locations,
                                        T* grad_weights, Wanted want, int64_t begin, int64_t end) {
  using acc_t = workbook::cpu::opmath_t<T>;
  const int64_t M = g.heads, D = kD > 0 ? kD : g.channels, L = g.levels, P = g.points, S = g.values;
  // Half and bfloat16 sum value's gradient in float, in a buffer of the task's rows.
  constexpr bool kWiden = !std::is_same_v<acc_t, T>;
  const bool dots = want.locations || want.weights;
  acc_t fixed[kD > 0 ? kD : 1];
  std::vector<acc_t> dynamic(kD > 0 ? 0 : D), widened(kWiden && want.value ? S * D : 0);
  acc_t* grad = kD > 0 ? fixed : dynamic.data();
  for (int64_t task = begin; task < end; ++task) {
    const int64_t n = task / M, m = task % M;
    // The task's value rows (n, :, m): row s at s * row_stride.
    const int64_t row_stride = kWiden ? D : M * D;
    acc_t* gv_wide = widened.data();
    T* gv_own = kWiden ? nullptr : grad_value + (n * S * M + m) * D;
    if (kWiden) std::fill(widened.begin(), widened.end(), acc_t(0));
    for (int64_t q = 0; q < g.queries; ++q) {
      const int64_t head = (n * g.queries + q) * M + m;
      const T* go = grad_output + head * D;
      for (int64_t d = 0; d < D; ++d) grad[d] = static_cast<acc_t>(go[d]);
      const T* loc = locations + head * L * P * 2;
      const T* weight = weights + head * L * P;
      for (int64_t l = 0; l < L; ++l) {
        const Level& lv = levels[l];
        const T* plane = value + ((n * S + lv.start) * M + m) * D;
        for (int64_t p = 0; p < P; ++p) {
          const int64_t k = l * P + p;
          const auto s = workbook::ms_deform_attn::locate<acc_t>(static_cast<acc_t>(loc[2 * k]),
                                                                 static_cast<acc_t>(loc[2 * k + 1]),
                                                                 lv.height, lv.width);
          acc_t sample = 0, d_dx = 0, d_dy = 0;  // grad_output . (value, d/dx, d/dy) at s
          if (s.in_range) {
            const acc_t a = static_cast<acc_t>(weight[k]);
            for (int c = 0; c < 4; ++c) {
              if (!s.valid(c)) continue;
              const int64_t row = lv.start + s.index(c);
              if (dots) {
                const acc_t corner = dot(grad, plane + s.index(c) * M * D, D);
                sample += s.weight(c) * corner;
                d_dx += s.d_weight_dx(c) * corner;
                d_dy += s.d_weight_dy(c) * corner;
              }
              if (want.value) {
                const acc_t w = a * s.weight(c);
                if constexpr (kWiden) {
                  acc_t* gv = gv_wide + row * row_stride;
                  WORKBOOK_SIMD_LOOP
                  for (int64_t d = 0; d < D; ++d) gv[d] += w * grad[d];
                } else {
                  T* gv = gv_own + row * row_stride;
                  WORKBOOK_SIMD_LOOP
                  for (int64_t d = 0; d < D; ++d) gv[d] += w * grad[d];
                }
              }
            }
            if (want.locations) {
              // x = lx W - 0.5, y = ly H - 0.5: d/dlx = W d/dx, d/dly = H d/dy.
              grad_locations[2 * (head * L * P + k)] =
                  static_cast<T>(a * static_cast<acc_t>(lv.width) * d_dx);
              grad_locations[2 * (head * L * P + k) + 1] =
                  static_cast<T>(a * static_cast<acc_t>(lv.height) * d_dy);
            }
          } else if (want.locations) {
            grad_locations[2 * (head * L * P + k)] = T(0);
            grad_locations[2 * (head * L * P + k) + 1] = T(0);
          }
          if (want.weights) grad_weights[head * L * P + k] = static_cast<T>(sample);
        }
      }
    }
    if constexpr (kWiden) {
      if (want.value) {
        T* dst = grad_value + (n * S * M + m) * D;
        for (int64_t s = 0; s < S; ++s) {
          for (int64_t d = 0; d < D; ++d) {
            dst[s * M * D + d] = static_cast<T>(widened[s * D + d]);
          }
        }
      }
    }
  }
}

template <int kD, typename T>
void backward_channels(const Geometry& g, const std::vector<Level>& levels, const T* grad_output,
                       const T* value, const T* locations, const T* weights, T* grad_value,
                       T* grad_locations, T* grad_weights, Wanted want) {
  workbook::cpu::parallel_for(0, g.batch * g.heads, 1, [&](int64_t begin, int64_t end) {
    backward_tasks<kD>(g, levels, grad_output, value, locations, weights, grad_value,
                       grad_locations, grad_weights, want, begin, end);
  });
}

template <typename T>
void forward(const Geometry& g, const std::vector<Level>& levels, const T* value,
             const T* locations, const T* weights, T* out) {
  if (g.channels == 32) return forward_channels<32>(g, levels, value, locations, weights, out);
  forward_channels<0>(g, levels, value, locations, weights, out);
}

template <typename T>
void backward(const Geometry& g, const std::vector<Level>& levels, const T* grad_output,
              const T* value, const T* locations, const T* weights, T* grad_value,
              T* grad_locations, T* grad_weights, Wanted want) {
  if (g.channels == 32) {
    return backward_channels<32>(g, levels, grad_output, value, locations, weights, grad_value,
                                 grad_locations, grad_weights, want);
  }
  backward_channels<0>(g, levels, grad_output, value, locations, weights, grad_value,
                       grad_locations, grad_weights, want);
}

}  // namespace ms_deform_attn_kernels
