// Stage 09: multi-scale deformable attention's CUDA kernels and their launchers, over raw
// pointers: the forward, the backward with a warp's channels reduced by shuffles, and value's
// gradient scattered with atomics (the default) or gathered in sorted order (reproducible).
//
// Like stage 07's deform_conv2d_cuda.cuh this file includes nothing of ATen's: each launcher
// takes raw pointers, the geometry and the stream, and throws through workbook/checks.h when a
// launch fails, so a library on the stable ABI can compile the same kernels. The glue (checks,
// buffers, dtype dispatch, the device guard, registration) is ms_deform_attn_cuda.cu beside it.
//
// Reference (workbook/ms_deform_attn.h): with a head row r = (n, q, m) and its samples
// k = (l, p), at the point s_k of level l whose 4 corners j carry bilinear weights w_kj,
//   out[r, d]          = sum_k a_k sum_j w_kj value[n, row_kj, m, d]
//   grad_value[n, row_kj, m, d] += a_k w_kj grad_out[r, d]
//   grad_a[r, k]       = sum_d grad_out[r, d] sum_j w_kj value[.., d]
//   grad_loc[r, k, 0]  = a_k W_l sum_d grad_out[r, d] sum_j dw_kj/dx value[.., d]     (1: H_l, y)
// The float64 PyTorch version the tests compare with is common/workbook/ops/ms_deform_attn/.
//
// One warp per head row. Its 32 lanes take the row's channels (d = lane, lane + 32, ...), so a
// corner's D channels are one coalesced read (D = 32: 128 bytes in float32) and every lane
// computes the same point (broadcast loads of the location and the weight). The backward's
// per-sample sums over channels (grad_a, grad_loc) are a warp reduction: 5 shuffle steps, no
// shared memory and no barrier, since the warp is the whole reduction; any D works, past 1024
// too (the lanes loop), where Deformable DETR's kernel picks one of several kernels by D.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "workbook/checks.h"
#include "workbook/host_device.h"
#include "workbook/ms_deform_attn.h"
#include "workbook/opmath.h"

namespace ms_deform_attn_cuda_kernels {

using workbook::opmath_t;  // float for half and bfloat16, else the type itself
using workbook::ms_deform_attn::Geometry;

constexpr int kWarp = 32;
constexpr int kThreads = 256;  // 8 head rows per block
constexpr int kRowsPerBlock = kThreads / kWarp;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;  // a grid-stride loop covers the rest

// The sizes a kernel reads, by value (the level table stays on the device: its L rows are read
// by every sample, from the cache).
struct Shape {
  int64_t batch, values, heads, channels, queries, levels, points;
  WORKBOOK_HOST_DEVICE int64_t rows() const { return batch * queries * heads; }  // (n, q, m)
};

inline Shape shape_of(const Geometry& g) {
  return {g.batch, g.values, g.heads, g.channels, g.queries, g.levels, g.points};
}

// The warp's head row and how many rows the grid covers at once (a grid-stride loop over rows).
__device__ __forceinline__ int64_t first_row() {
  return static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
}
__device__ __forceinline__ int64_t row_stride() {
  return static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
}

// Sample k of head row r: its point on level l and its weight. `start` is the level's first row.
template <typename T, typename scalar_t>
__device__ __forceinline__ workbook::bilinear::Point<T> sample_point(const Shape& s,
                                                                     const int64_t* shapes,
                                                                     const scalar_t* locations,
                                                                     int64_t r, int64_t k) {
  const int64_t l = k / s.points;
  const scalar_t* loc = locations + (r * s.levels * s.points + k) * 2;
  return workbook::ms_deform_attn::locate<T>(static_cast<T>(loc[0]), static_cast<T>(loc[1]),
                                             shapes[2 * l], shapes[2 * l + 1]);
}

// The first value row of head row r's level l, image n, head m: rows of that level are
// start + pixel, each M D apart.
__device__ __forceinline__ int64_t level_base(const Shape& s, const int64_t* starts, int64_t r,
                                              int64_t l) {
  const int64_t n = r / (s.queries * s.heads), m = r % s.heads;
  return ((n * s.values + starts[l]) * s.heads + m) * s.channels;
}

// The sum of v over the warp's 32 lanes, in every lane (a butterfly: after the step of offset
// o each lane holds the sum of 32 / o lanes). Every lane of the warp must call it.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  // EXERCISE msda-warp-sum: five __shfl_xor_sync steps, offsets 16, 8, 4, 2, 1
  // checked by: test_ms_deform_attn_cuda.py::test_against_reference, ::test_gradcheck
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  // END EXERCISE msda-warp-sum
  return v;
}

// ----------------------------------------------------------------------------------------------
// Kernels

// out[r, d] for each head row r of the warp, its lanes over the channels.
//   Per sample and channel: 4 loads (L2 hits: a query's points cluster), 4 FMAs. Deformable
//   DETR's encoder at 800 x 1333: 2.8M samples x 32 channels x 4 = 364M loads of 4 bytes from a
//   23 MB value tensor that stays in an H200's 60 MB L2; out is 2.8 MB.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const Shape s, const int64_t* __restrict__ shapes,
                   const int64_t* __restrict__ starts, const scalar_t* __restrict__ value,
                   const scalar_t* __restrict__ locations, const scalar_t* __restrict__ weights,
                   scalar_t* __restrict__ out) {
  using T = opmath_t<scalar_t>;
  const int lane = threadIdx.x % kWarp;
  const int64_t samples = s.levels * s.points, row_step = s.heads * s.channels;
  for (int64_t r = first_row(); r < s.rows(); r += row_stride()) {
    for (int64_t d0 = 0; d0 < s.channels; d0 += kWarp) {
      const int64_t d = d0 + lane;
      T acc = T(0);
      for (int64_t k = 0; k < samples; ++k) {
        const auto p = sample_point<T>(s, shapes, locations, r, k);
        if (!p.in_range || d >= s.channels) continue;
        const T a = static_cast<T>(weights[r * samples + k]);
        const scalar_t* plane = value + level_base(s, starts, r, k / s.points) + d;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (p.valid(j)) acc += a * p.weight(j) * static_cast<T>(plane[p.index(j) * row_step]);
        }
      }
      if (d < s.channels) out[r * s.channels + d] = static_cast<scalar_t>(acc);
    }
  }
}

// The backward of each head row r of the warp: grad_weights and grad_locations of its samples
// (warp sums over the channels), and, when `grad_value` is not null, value's gradient scattered
// with atomics into the opmath buffer (float for half and bfloat16: no half atomics, and one
// rounding at the end). Many rows reach one value row, so the adds must be atomic, and their
// order (hence the float rounding) changes from run to run: the deterministic backward passes
// null here and gathers value's gradient in sorted order instead (below).
//   Per sample and channel: 4 loads, 1 load of grad_out (hoisted: the lane's channels of one
//   row), 12 FMAs, 4 atomics; per sample 3 warp sums of 5 shuffles.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const Shape s, const int64_t* __restrict__ shapes,
                    const int64_t* __restrict__ starts, const scalar_t* __restrict__ grad_output,
                    const scalar_t* __restrict__ value, const scalar_t* __restrict__ locations,
                    const scalar_t* __restrict__ weights, acc_t* __restrict__ grad_value,
                    scalar_t* __restrict__ grad_locations, scalar_t* __restrict__ grad_weights) {
  using T = opmath_t<scalar_t>;
  const int lane = threadIdx.x % kWarp;
  const int64_t samples = s.levels * s.points, row_step = s.heads * s.channels;
  for (int64_t r = first_row(); r < s.rows(); r += row_stride()) {
    for (int64_t k = 0; k < samples; ++k) {
      const auto p = sample_point<T>(s, shapes, locations, r, k);
      if (!p.in_range) {  // the whole warp: the point is the same in every lane
        if (lane == 0) {
          if (grad_weights != nullptr) grad_weights[r * samples + k] = scalar_t(0);
          if (grad_locations != nullptr) {
            grad_locations[2 * (r * samples + k)] = scalar_t(0);
            grad_locations[2 * (r * samples + k) + 1] = scalar_t(0);
          }
        }
        continue;
      }
      const int64_t l = k / s.points;
      const T a = static_cast<T>(weights[r * samples + k]);
      const int64_t base = level_base(s, starts, r, l);
      T sample = T(0), d_dx = T(0), d_dy = T(0);  // this lane's share of the channel sums
      for (int64_t d = lane; d < s.channels; d += kWarp) {
        const T g = static_cast<T>(grad_output[r * s.channels + d]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (!p.valid(j)) continue;
          const int64_t at = base + p.index(j) * row_step + d;
          const T v = static_cast<T>(value[at]);
          sample += p.weight(j) * v * g;
          d_dx += p.d_weight_dx(j) * v * g;
          d_dy += p.d_weight_dy(j) * v * g;
          if (grad_value != nullptr)
            atomicAdd(grad_value + at, static_cast<acc_t>(a * p.weight(j) * g));
        }
      }
      sample = warp_sum(sample);
      d_dx = warp_sum(d_dx);
      d_dy = warp_sum(d_dy);
      if (lane == 0) {
        if (grad_weights != nullptr) grad_weights[r * samples + k] = static_cast<scalar_t>(sample);
        if (grad_locations != nullptr) {
          grad_locations[2 * (r * samples + k)] =
              static_cast<scalar_t>(a * static_cast<T>(shapes[2 * l + 1]) * d_dx);
          grad_locations[2 * (r * samples + k) + 1] =
              static_cast<scalar_t>(a * static_cast<T>(shapes[2 * l]) * d_dy);
        }
      }
    }
  }
}

// The deterministic backward of value. The race is between head rows whose samples share a
// corner; the fix is to give each value row (n, s, m) one owner that sums its contributions in an
// order fixed by the inputs alone:
//   1. corner_entries: entry e = 4 (r samples + k) + j of every sample's corner j, its key the
//      value row it lands on, ((n S + row) M + m) (or `none` for a corner outside the level),
//      and its weight a_k w_kj;
//   2. a stable radix sort of the keys, carrying the entry numbers: entries with one key end up
//      next to each other, in increasing entry order;
//   3. run_heads: a flag where a run of one key starts; an inclusive scan numbers the runs;
//   4. run_starts: where each run starts, from the flags and their numbers;
//   5. gather_runs: per run and channel, one thread sums the run's contributions
//      weight[e] grad_out[r(e), d] in sorted order and writes the sum into the grad_value element
//      it alone owns.
// The entries of one image number 4 Lq M L P (11.4M for Deformable DETR's encoder); images go
// in chunks of fewer than 2^31 entries, and a chunk's keys count from its first image.

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    corner_entries_kernel(const Shape s, int64_t n0, int64_t images,
                          const int64_t* __restrict__ shapes, const int64_t* __restrict__ starts,
                          const scalar_t* __restrict__ locations,
                          const scalar_t* __restrict__ weights, int64_t* __restrict__ keys,
                          int32_t* __restrict__ entries, opmath_t<scalar_t>* __restrict__ factors) {
  using T = opmath_t<scalar_t>;
  const int64_t samples = s.levels * s.points;
  const int64_t count = images * s.queries * s.heads * samples;  // the chunk's samples
  const int64_t none = images * s.values * s.heads;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < count;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = n0 * s.queries * s.heads + t / samples, k = t % samples;
    const int64_t l = k / s.points, n = r / (s.queries * s.heads), m = r % s.heads;
    const auto p = sample_point<T>(s, shapes, locations, r, k);
    const T a = static_cast<T>(weights[r * samples + k]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t e = 4 * t + j;
      const bool live = p.in_range && p.valid(j);
      keys[e] = live ? ((n - n0) * s.values + starts[l] + p.index(j)) * s.heads + m : none;
      entries[e] = static_cast<int32_t>(e);
      factors[e] = live ? a * p.weight(j) : T(0);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    run_heads_kernel(int64_t count, int64_t none, const int64_t* __restrict__ sorted_keys,
                     int32_t* __restrict__ heads) {
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < count;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t key = sorted_keys[t];
    heads[t] = key != none && (t == 0 || sorted_keys[t - 1] != key);
  }
}

// starts[run] = the run's first sorted position; starts[runs] = the end of the live entries
// (the `none` keys sort last).
__global__ void __launch_bounds__(kThreads)
    run_starts_kernel(int64_t count, int64_t none, const int64_t* __restrict__ sorted_keys,
                      const int32_t* __restrict__ heads, const int32_t* __restrict__ runs,
                      int32_t* __restrict__ starts) {
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < count;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (sorted_keys[t] == none) continue;
    if (heads[t]) starts[runs[t] - 1] = static_cast<int32_t>(t);
    if (t + 1 == count || sorted_keys[t + 1] == none) starts[runs[t]] = static_cast<int32_t>(t + 1);
  }
}

// Per (run, channel): the run's sum, written into grad_value (in the opmath type) at its key.
// `runs_total` is the scan's last value, on the device: the grid covers the most runs there can
// be, and threads past the real count return.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    gather_runs_kernel(const Shape s, int64_t n0, int64_t count,
                       const int64_t* __restrict__ sorted_keys, const int32_t* __restrict__ order,
                       const int32_t* __restrict__ runs, const int32_t* __restrict__ starts,
                       const opmath_t<scalar_t>* __restrict__ factors,
                       const scalar_t* __restrict__ grad_output,
                       opmath_t<scalar_t>* __restrict__ grad_value) {
  using T = opmath_t<scalar_t>;
  const int64_t samples = s.levels * s.points;
  const int64_t total = count == 0 ? 0 : runs[count - 1];
  const int64_t items = total * s.channels;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < items;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t run = t / s.channels, d = t % s.channels;
    const int32_t first = starts[run], end = starts[run + 1];
    T sum = T(0);
    for (int32_t i = first; i < end; ++i) {
      const int64_t e = order[i];
      const int64_t r = n0 * s.queries * s.heads + e / (4 * samples);
      sum += factors[e] * static_cast<T>(grad_output[r * s.channels + d]);
    }
    const int64_t key = sorted_keys[first];  // (n - n0) S M + row M + m: value's row, chunk-local
    grad_value[(n0 * s.values * s.heads + key) * s.channels + d] = sum;
  }
}

// ----------------------------------------------------------------------------------------------
// Launchers, over raw pointers: each launches on `stream` and checks the launch. The caller owns
// the memory, the device guard and the stream.

inline void check_launch(const char* kernel) {
  const cudaError_t error = cudaGetLastError();
  WORKBOOK_CHECK(error == cudaSuccess, std::string("ms_deform_attn: the CUDA kernel ") + kernel +
                                           " failed: " + cudaGetErrorString(error));
}

inline unsigned int blocks_for(int64_t items, int64_t per_block) {
  return static_cast<unsigned int>(
      std::clamp<int64_t>((items + per_block - 1) / per_block, 1, kMaxBlocks));
}

template <typename scalar_t>
void forward(const Geometry& g, const int64_t* shapes, const int64_t* starts, const scalar_t* value,
             const scalar_t* locations, const scalar_t* weights, scalar_t* out,
             cudaStream_t stream) {
  const Shape s = shape_of(g);
  if (s.rows() == 0 || s.channels == 0) return;
  forward_kernel<scalar_t><<<blocks_for(s.rows(), kRowsPerBlock), kThreads, 0, stream>>>(
      s, shapes, starts, value, locations, weights, out);
  check_launch("forward");
}

// The location and weight gradients, and value's with atomics when `grad_value` is not null.
template <typename scalar_t>
void backward_atomic(const Geometry& g, const int64_t* shapes, const int64_t* starts,
                     const scalar_t* grad_output, const scalar_t* value, const scalar_t* locations,
                     const scalar_t* weights, opmath_t<scalar_t>* grad_value,
                     scalar_t* grad_locations, scalar_t* grad_weights, cudaStream_t stream) {
  const Shape s = shape_of(g);
  if (s.rows() == 0 || s.levels * s.points == 0) return;
  backward_kernel<scalar_t, opmath_t<scalar_t>>
      <<<blocks_for(s.rows(), kRowsPerBlock), kThreads, 0, stream>>>(
          s, shapes, starts, grad_output, value, locations, weights, grad_value, grad_locations,
          grad_weights);
  check_launch("backward");
}

// The deterministic backward's buffers for `entries` corner entries, carved out of one
// allocation of bytes(entries) that the caller makes on the device (from its allocator, on its
// stream), CUB's scratch included.
template <typename T>
struct SortBuffers {
  int64_t *keys, *sorted_keys;
  int32_t *entries, *order, *heads, *runs, *starts;
  T* factors;
  void* scratch;
  size_t scratch_bytes;
  static constexpr size_t kAlign = 256;
  static size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
  static size_t cub_bytes(int64_t n) {
    size_t sort_bytes = 0, scan_bytes = 0;
    cudaError_t error = cub::DeviceRadixSort::SortPairs(
        nullptr, sort_bytes, static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr),
        static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), n);
    if (error == cudaSuccess) {
      error =
          cub::DeviceScan::InclusiveSum(nullptr, scan_bytes, static_cast<const int32_t*>(nullptr),
                                        static_cast<int32_t*>(nullptr), n);
    }
    WORKBOOK_CHECK(error == cudaSuccess,
                   std::string("ms_deform_attn: sizing CUB's scratch space failed: ") +
                       cudaGetErrorString(error));
    return std::max(sort_bytes, scan_bytes);
  }
  static size_t bytes(int64_t entries) {
    const size_t n = static_cast<size_t>(entries);
    return 2 * aligned(n * sizeof(int64_t)) + 4 * aligned(n * sizeof(int32_t)) +
           aligned((n + 1) * sizeof(int32_t)) + aligned(n * sizeof(T)) +
           aligned(cub_bytes(entries));
  }
  static SortBuffers carve(void* base, int64_t entries) {
    const size_t n = static_cast<size_t>(entries);
    char* next = static_cast<char*>(base);
    const auto take = [&next](size_t size) {
      char* at = next;
      next += aligned(size);
      return at;
    };
    SortBuffers b{};
    b.keys = reinterpret_cast<int64_t*>(take(n * sizeof(int64_t)));
    b.sorted_keys = reinterpret_cast<int64_t*>(take(n * sizeof(int64_t)));
    b.entries = reinterpret_cast<int32_t*>(take(n * sizeof(int32_t)));
    b.order = reinterpret_cast<int32_t*>(take(n * sizeof(int32_t)));
    b.heads = reinterpret_cast<int32_t*>(take(n * sizeof(int32_t)));
    b.runs = reinterpret_cast<int32_t*>(take(n * sizeof(int32_t)));
    b.starts = reinterpret_cast<int32_t*>(take((n + 1) * sizeof(int32_t)));
    b.factors = reinterpret_cast<T*>(take(n * sizeof(T)));
    b.scratch_bytes = cub_bytes(entries);
    b.scratch = take(b.scratch_bytes);
    return b;
  }
};

// Images per chunk of the deterministic backward: fewer than 2^31 entries (int32 entry numbers)
// and at most `budget` bytes of buffers (the caller's), at least one image.
template <typename T>
int64_t images_per_chunk(const Geometry& g, size_t budget) {
  const int64_t per_image = 4 * g.queries * g.heads * g.levels * g.points;
  if (per_image == 0) return std::max<int64_t>(g.batch, 1);
  const int64_t by_count = (int64_t{std::numeric_limits<int32_t>::max()} - 1) / per_image;
  WORKBOOK_CHECK(by_count >= 1,
                 workbook::text("ms_deform_attn: the deterministic backward sorts the ", per_image,
                                " sample corners of one image at once, more than 2^31 - 1: call "
                                "it with torch.use_deterministic_algorithms(False)"));
  const int64_t bytes_per_image = static_cast<int64_t>(SortBuffers<T>::bytes(per_image));
  const int64_t by_budget = std::max<int64_t>(1, static_cast<int64_t>(budget) / bytes_per_image);
  return std::clamp<int64_t>(std::min(by_count, by_budget), 1, std::max<int64_t>(g.batch, 1));
}

inline int key_bits(uint64_t max_key) {
  int bits = 1;
  while (max_key >>= 1) ++bits;
  return bits;
}

inline void check_cub(cudaError_t error, const char* what) {
  WORKBOOK_CHECK(error == cudaSuccess, std::string("ms_deform_attn: CUB's ") + what +
                                           " failed: " + cudaGetErrorString(error));
}

// value's gradient (in the opmath type, zeroed by the caller) for images [n0, n0 + images),
// reproducibly: the five steps above, in `b` (sized for at least this chunk's entries).
template <typename scalar_t>
void gather_value_gradient(const Geometry& g, int64_t n0, int64_t images, const int64_t* shapes,
                           const int64_t* starts, const scalar_t* grad_output,
                           const scalar_t* locations, const scalar_t* weights,
                           opmath_t<scalar_t>* grad_value, const SortBuffers<opmath_t<scalar_t>>& b,
                           cudaStream_t stream) {
  const Shape s = shape_of(g);
  const int64_t samples = images * s.queries * s.heads * s.levels * s.points;
  const int64_t count = 4 * samples;
  if (count == 0 || s.channels == 0) return;
  const int64_t none = images * s.values * s.heads;
  corner_entries_kernel<scalar_t><<<blocks_for(samples, kThreads), kThreads, 0, stream>>>(
      s, n0, images, shapes, starts, locations, weights, b.keys, b.entries, b.factors);
  check_launch("corner_entries");
  // An LSD radix sort is stable; only the bits a key can have are sorted.
  size_t scratch = b.scratch_bytes;
  check_cub(cub::DeviceRadixSort::SortPairs(b.scratch, scratch, b.keys, b.sorted_keys, b.entries,
                                            b.order, count, 0, key_bits(none), stream),
            "radix sort");
  run_heads_kernel<<<blocks_for(count, kThreads), kThreads, 0, stream>>>(count, none, b.sorted_keys,
                                                                         b.heads);
  check_launch("run_heads");
  scratch = b.scratch_bytes;
  check_cub(cub::DeviceScan::InclusiveSum(b.scratch, scratch, b.heads, b.runs, count, stream),
            "scan");
  run_starts_kernel<<<blocks_for(count, kThreads), kThreads, 0, stream>>>(
      count, none, b.sorted_keys, b.heads, b.runs, b.starts);
  check_launch("run_starts");
  // At most min(count, images S M) runs: the grid covers that many (run, channel) pairs.
  const int64_t most = std::min(count, none) * s.channels;
  gather_runs_kernel<scalar_t><<<blocks_for(most, kThreads), kThreads, 0, stream>>>(
      s, n0, count, b.sorted_keys, b.order, b.runs, b.starts, b.factors, grad_output, grad_value);
  check_launch("gather_runs");
}

}  // namespace ms_deform_attn_cuda_kernels
