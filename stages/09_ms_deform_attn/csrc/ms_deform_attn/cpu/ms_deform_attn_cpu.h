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
// What the loads alone cost, the floor of both kernels at Deformable DETR's sizes:
// bench/ms_deform_attn_floor.cpp. The kernels' times: make bench OP=ms_deform_attn
// (bench/results/ms_deform_attn/).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
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

// One row of D channels in acc_t, and what the kernels do with it: the forward sums weighted rows
// of value into it (add), the backward holds grad_output's row in it (load) and takes its dot
// product with rows of value (dot) and adds it, weighted, into rows of value's gradient (scatter).
// Each channel's sums run in the order of the calls, and dot's in the order of dot() above, so
// the results are those of the plain loops, whatever the vectors.
//
// kD > 0 (the channels known at compile time): the row is kept as 64-byte vectors of GCC's and
// Clang's vector extension, which the compiler holds in registers across the calls (the widest
// the build targets: one zmm with AVX-512, two ymm with AVX2, four xmm with SSE2). A plain array
// of kD channels, the obvious code, is kept on the stack instead, and every add then waits on a
// store and a load of it. kD == 0: an array of D, for any other channel count.
template <typename acc_t>
struct Vector64;  // acc_t's 64-byte vector (declared apart: the attribute needs a known type)
template <>
struct Vector64<float> {
  typedef float type __attribute__((vector_size(64)));
};
template <>
struct Vector64<double> {
  typedef double type __attribute__((vector_size(64)));
};

// float16 to float, 16 channels at once, exactly as c10::Half converts one: in 32-bit lanes
// (h: sign, 5 exponent bits, 10 mantissa bits), a normal number's exponent and mantissa move to
// float's places and a multiply by 2^-112 rebiases the exponent (15 to 127), which also keeps
// infinities and NaNs; a subnormal (exponent 0) is its mantissa m read as 0.5 + m 2^-24, less 0.5.
// Both are computed, and the exponent picks one. c10::Half widens one value per call (a scalar
// vcvtph2ps with F16C): over 32 channels of 4 corners a sample, that conversion was the forward's
// time at float16. These lanes are vectors any x86-64 target has (SSE2 up), in every clone.
inline Vector64<float>::type widen_halves(const void* halves) {
  using Floats = Vector64<float>::type;
  typedef uint32_t Bits __attribute__((vector_size(64)));
  typedef uint16_t Narrow __attribute__((vector_size(32)));
  Narrow narrow;
  std::memcpy(&narrow, halves, sizeof(narrow));
  const Bits h = __builtin_convertvector(narrow, Bits);
  const Bits sign = (h & 0x8000u) << 16;
  const Bits magnitude = h << 17;  // exponent and mantissa at the top, the sign shifted out
  const Floats normal = (Floats)((magnitude >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const Floats subnormal = (Floats)((magnitude >> 17) | (126u << 23)) - 0.5f;
  const Bits is_subnormal = (Bits)(magnitude < (1u << 27));  // all ones where the exponent is 0
  return (Floats)(sign | (is_subnormal & (Bits)subnormal) | (~is_subnormal & (Bits)normal));
}

template <int kD, typename acc_t>
struct Channels {
  using Lanes = typename Vector64<acc_t>::type;
  static constexpr int kWidth = sizeof(Lanes) / sizeof(acc_t);  // channels per vector
  static constexpr int kVectors = kD / kWidth;
  static constexpr int kParts = kLanes / kWidth;  // vectors of dot's kLanes partial sums
  static_assert(kD % kLanes == 0 && kLanes % kWidth == 0, "kD: a multiple of kLanes");
  Lanes row[kVectors];

  explicit Channels(int64_t /*channels: kD*/) { clear(); }

  void clear() {
    for (auto& v : row) v = Lanes{};
  }
  template <typename T>
  static Lanes vector(const T* v) {  // kWidth channels of T from v, in acc_t (unaligned)
    Lanes x;
    if constexpr (std::is_same_v<T, acc_t>) {
      std::memcpy(&x, v, sizeof(x));
    } else if constexpr (std::is_same_v<T, c10::Half> && std::is_same_v<acc_t, float>) {
      x = widen_halves(v);
    } else {
      acc_t wide[kWidth];
      for (int j = 0; j < kWidth; ++j) wide[j] = static_cast<acc_t>(v[j]);
      std::memcpy(&x, wide, sizeof(x));
    }
    return x;
  }
  template <typename T>
  void load(const T* v) {
    for (int i = 0; i < kVectors; ++i) row[i] = vector(v + i * kWidth);
  }
  template <typename T>
  void store(T* out) const {
    acc_t sums[kD];
    std::memcpy(sums, row, sizeof(sums));
    for (int d = 0; d < kD; ++d) out[d] = static_cast<T>(sums[d]);
  }
  template <typename T>
  void add(acc_t w, const T* v) {  // row += w v
    for (int i = 0; i < kVectors; ++i) row[i] += w * vector(v + i * kWidth);
  }
  template <typename T>
  acc_t dot(const T* v) const {  // row . v, as dot(row, v, kD)
    Lanes part[kParts] = {};
    for (int i = 0; i < kVectors; ++i) part[i % kParts] += row[i] * vector(v + i * kWidth);
    acc_t lanes[kLanes];
    std::memcpy(lanes, part, sizeof(lanes));
    acc_t sum = 0;
    for (int j = 0; j < kLanes; ++j) sum += lanes[j];
    return sum;
  }
  void scatter(acc_t w, acc_t* out) const {  // out += w row, for a row of acc_t
    for (int i = 0; i < kVectors; ++i) {
      Lanes x = vector(out + i * kWidth) + w * row[i];
      std::memcpy(out + i * kWidth, &x, sizeof(x));
    }
  }
};

template <typename acc_t>
struct Channels<0, acc_t> {
  std::vector<acc_t> row;

  explicit Channels(int64_t channels) : row(channels) {}
  void clear() { std::fill(row.begin(), row.end(), acc_t(0)); }
  template <typename T>
  void load(const T* v) {
    for (size_t d = 0; d < row.size(); ++d) row[d] = static_cast<acc_t>(v[d]);
  }
  template <typename T>
  void store(T* out) const {
    for (size_t d = 0; d < row.size(); ++d) out[d] = static_cast<T>(row[d]);
  }
  template <typename T>
  void add(acc_t w, const T* v) {
    const int64_t D = static_cast<int64_t>(row.size());
    acc_t* a = row.data();
    WORKBOOK_SIMD_LOOP
    for (int64_t d = 0; d < D; ++d) a[d] += w * static_cast<acc_t>(v[d]);
  }
  template <typename T>
  acc_t dot(const T* v) const {
    return ms_deform_attn_kernels::dot(row.data(), v, static_cast<int64_t>(row.size()));
  }
  void scatter(acc_t w, acc_t* out) const {
    const int64_t D = static_cast<int64_t>(row.size());
    const acc_t* a = row.data();
    WORKBOOK_SIMD_LOOP
    for (int64_t d = 0; d < D; ++d) out[d] += w * a[d];
  }
};

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
  Channels<kD, acc_t> acc(D);
  for (int64_t r = begin; r < end; ++r) {
    const int64_t n = r / g.queries;
    for (int64_t m = 0; m < M; ++m) {
      acc.clear();
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
            // The corner's row: M D apart per pixel.
            acc.add(a * s.weight(c), plane + s.index(c) * M * D);
          }
          // END EXERCISE msda-corner-blend
        }
      }
      acc.store(out + head * D);
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
  const bool dots = want.locations || want.weights;
  // The task's rows of value, (n, :, m), lie M D apart, among every head's, and so do those of
  // its gradient. A task with at least as many samples as rows (the encoder's: 16 a row) first
  // copies its value rows into a buffer of its own, [S, D], and sums their gradient in another:
  // its samples then read and add into 2 S D elements side by side, not into rows spread over
  // all of value and its gradient, each a miss in the caches and the TLB. A task with fewer (the
  // decoder's queries) reads and adds in place, as copying would cost more than it saves. Half
  // and bfloat16 sum the gradient in a buffer always, in float.
  constexpr bool kWiden = !std::is_same_v<acc_t, T>;
  const bool many = g.queries * L * P >= S;
  const bool copy_value = dots && many;
  const bool own_grad = want.value && (kWiden || many);
  std::vector<T> value_rows(copy_value ? S * D : 0);
  std::vector<acc_t> grad_rows(own_grad ? S * D : 0);
  Channels<kD, acc_t> grad(D);  // grad_output's row of the (query, head)
  for (int64_t task = begin; task < end; ++task) {
    const int64_t n = task / M, m = task % M;
    const T* head_value = value + (n * S * M + m) * D;                       // row s at s M D
    T* head_grad = want.value ? grad_value + (n * S * M + m) * D : nullptr;  // the same
    if (copy_value) {
      for (int64_t s = 0; s < S; ++s) {
        std::copy(head_value + s * M * D, head_value + s * M * D + D, value_rows.data() + s * D);
      }
    }
    const T* rows = copy_value ? value_rows.data() : head_value;
    const int64_t value_stride = copy_value ? D : M * D;
    std::fill(grad_rows.begin(), grad_rows.end(), acc_t(0));
    for (int64_t q = 0; q < g.queries; ++q) {
      const int64_t head = (n * g.queries + q) * M + m;
      const T* go = grad_output + head * D;
      grad.load(go);
      const T* loc = locations + head * L * P * 2;
      const T* weight = weights + head * L * P;
      for (int64_t l = 0; l < L; ++l) {
        const Level& lv = levels[l];
        const T* plane = rows + lv.start * value_stride;
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
                const acc_t corner = grad.dot(plane + s.index(c) * value_stride);
                sample += s.weight(c) * corner;
                d_dx += s.d_weight_dx(c) * corner;
                d_dy += s.d_weight_dy(c) * corner;
              }
              if (want.value) {
                const acc_t w = a * s.weight(c);
                if constexpr (kWiden) {
                  grad.scatter(w, grad_rows.data() + row * D);
                } else {  // T is acc_t
                  grad.scatter(w, own_grad ? grad_rows.data() + row * D : head_grad + row * M * D);
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
    if (own_grad) {
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t d = 0; d < D; ++d)
          head_grad[s * M * D + d] = static_cast<T>(grad_rows[s * D + d]);
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
