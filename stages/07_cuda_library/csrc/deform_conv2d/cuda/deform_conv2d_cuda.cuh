// Stage 07: the deformable convolution's CUDA kernels and their launchers, over raw pointers:
// the sampling (im2col), its scatter back into the input's gradient (atomic, or sorted for a
// reproducible backward) and the offset and mask gradients.
//
// Two kinds of library compile them, as stage 06's CPU kernels (deform_conv2d_cpu.h): the ATen
// one (deform_conv2d_cuda.cu beside this file) and stage 10's, on the stable ABI (its
// csrc/deform_conv2d/cuda/deform_conv2d_cuda.cu). So this file includes nothing of ATen's: each
// launcher takes raw pointers, a Shape and the stream to launch on, and throws through
// workbook/checks.h when a launch fails; the deterministic backward calls CUB itself, in scratch
// memory its caller allocates. What the glue does around them (the checks' call, the buffers, the
// GEMMs, the chunk loop, dtype dispatch, the device guard and the stream, registration) is each
// library's own: `make diff 10` shows the two side by side.
//
// The run card, the timings and the napkin math are in deform_conv2d_cuda.cu beside this file.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "workbook/bilinear.h"
#include "workbook/checks.h"
#include "workbook/deform_conv2d.h"
#include "workbook/host_device.h"
#include "workbook/opmath.h"

// ----------------------------------------------------------------------------------------------
// Reference
//
// With K = kh kw taps, G offset groups, P = Ho Wo output positions, and the sample of
// (image n, offset group g, tap k, position p) at
//   y = oh stride_h - pad_h + ki dilation_h + offset[n, 2 (g K + k), p]     (x likewise, + 1)
// whose four corners j carry bilinear weights w_j and the mask m = mask[n, g K + k, p]:
//   columns[c K + k, p]  = m sum_j w_j input[n, c, corner_j]      (c in offset group g)
//   output[n]            = weight [O, C K / groups] @ columns [C K, P]  (per conv group) + bias
// and backward, with grad_columns = weight^T @ grad_output[n] (per conv group):
//   grad_input[n, c, corner_j] += m w_j grad_columns[c K + k, p]      (the scatter)
//   A_j = sum_{c in g} grad_columns[c K + k, p] input[n, c, corner_j]
//   grad_offset[n, 2 (g K + k) + 0, p] = m sum_j dw_j/dy A_j,   (+ 1: dw_j/dx)
//   grad_mask[n, g K + k, p] = sum_j w_j A_j
//   grad_weight = sum_n grad_output[n] @ columns^T,   grad_bias = sum_{n, p} grad_output
// The tests compare against the float64 common/workbook/ops/deform_conv2d/reference.py.

namespace deform_conv2d_cuda_kernels {

using workbook::ceil_div;
using workbook::opmath_t;  // float for half and bfloat16, else the type itself
using workbook::bilinear::Point;
using workbook::deform_conv2d::Chunk;
using workbook::deform_conv2d::Geometry;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;  // a grid-stride loop covers the rest
constexpr int64_t kMaxSlices = 65535;             // CUDA's limit on gridDim.y
// Channel slices: enough threads to fill an H200 (132 SMs x 2048 threads) about twice, but at
// least kMinChannelsPerThread channels per thread, so that locating the sample (3 loads and a
// few dozen instructions) stays small next to the channels' 4 gathers each.
constexpr int64_t kTargetThreads = int64_t{1} << 19;
constexpr int64_t kMinChannelsPerThread = 8;
// The column buffers (and the deterministic backward's sort buffers) of one chunk stay under this:
// a batch is cut into chunks of whole images when one fits, else one image into blocks of output
// rows, as on the CPU. Larger than the CPU's 32 MiB: the GEMMs want tens of thousands of
// columns to fill the GPU, and 256 MiB is still small next to a network's activations.
constexpr int64_t kColumnBudgetBytes = int64_t{256} << 20;
// Bytes per corner entry of the deterministic backward: key and sorted key (8 + 8), entry and
// order (4 + 4), weight and sorted weight (2 x 4 or 8), sorted column (4 or 8), run head, run
// number and start (3 x 4), and CUB's own copies of keys and values (12); rounded up.
constexpr int64_t kEntryBytes = 80;

// What a kernel knows of the problem and of its chunk: images [n0, n0 + images), output
// positions [p0, p0 + chunk_positions) of each. index_t is int32 when every buffer a kernel
// touches has fewer than 2^31 elements, else int64. The geometry that makes the sampling
// coordinates stays int64, as on the CPU (the integer part of a coordinate lies in
// [-pad, H + pad), which the checks bound to int64, not to int32).
template <typename index_t>
struct Shape {
  index_t channels, plane, offset_groups, group_channels;  // plane = H W; per offset group
  index_t taps, kernel_w, positions, out_w;                // taps = kh kw, positions = Ho Wo
  int64_t height, width, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
  index_t n0, images, p0, chunk_positions;
  index_t columns;  // images x chunk_positions: the width of the column buffers
  index_t samples;  // images x G x K x chunk_positions
};

// A sample of the chunk, s = ((i G + g) K + k) chunk_positions + q: consecutive threads take
// consecutive positions of one (image, group, tap), so their offset and mask loads and their
// column stores are coalesced.
template <typename index_t>
struct SampleIndex {
  index_t i, g, k, q;
};

// ----------------------------------------------------------------------------------------------
// Kernels
//
// Layouts (all contiguous): input, grad_input [N, C, H W]; offset [N, 2 G K, P]; mask
// [N, G K, P] or null (a mask of ones); columns and grad_columns [C K, images x Pc] (row
// c K + k, column i Pc + q), which is the weight's [O / groups, C / groups x K] order, so every
// GEMM is one plain matrix product per convolution group. Every kernel runs a grid-stride loop
// with a 64-bit counter; the index math inside is index_t.

__device__ __forceinline__ int64_t first_item() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t item_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

template <typename index_t>
__device__ __forceinline__ SampleIndex<index_t> decode_sample(const Shape<index_t>& s, index_t t) {
  SampleIndex<index_t> d;
  d.q = t % s.chunk_positions;
  index_t rest = t / s.chunk_positions;
  d.k = rest % s.taps;
  rest /= s.taps;
  d.g = rest % s.offset_groups;
  d.i = rest / s.offset_groups;
  return d;
}

// Where sample d reads the input: the CPU kernel's arithmetic, step for step (integer part in
// int64, one rounding to T, then the offset added in T), then workbook::bilinear::locate.
template <typename T, typename scalar_t, typename index_t>
__device__ __forceinline__ Point<T> locate_sample(const Shape<index_t>& s,
                                                  const scalar_t* __restrict__ offset,
                                                  const SampleIndex<index_t>& d) {
  const index_t n = s.n0 + d.i, p = s.p0 + d.q;
  const index_t oh = p / s.out_w, ow = p - oh * s.out_w;
  const index_t ki = d.k / s.kernel_w, kj = d.k - ki * s.kernel_w;
  const T y0 = static_cast<T>(static_cast<int64_t>(oh) * s.stride_h - s.pad_h +
                              static_cast<int64_t>(ki) * s.dilation_h);
  const T x0 = static_cast<T>(static_cast<int64_t>(ow) * s.stride_w - s.pad_w +
                              static_cast<int64_t>(kj) * s.dilation_w);
  const index_t gk = d.g * s.taps + d.k, GK = s.offset_groups * s.taps;
  const scalar_t* dy = offset + (n * 2 * GK + 2 * gk) * s.positions + p;
  const T y = y0 + static_cast<T>(dy[0]), x = x0 + static_cast<T>(dy[s.positions]);
  return workbook::bilinear::locate<T>(y, x, s.height, s.width);
}

template <typename T, typename scalar_t, typename index_t>
__device__ __forceinline__ T mask_of(const Shape<index_t>& s, const scalar_t* __restrict__ mask,
                                     const SampleIndex<index_t>& d) {
  if (mask == nullptr) return T(1);
  const index_t gk = d.g * s.taps + d.k, GK = s.offset_groups * s.taps;
  return static_cast<T>(mask[((s.n0 + d.i) * GK + gk) * s.positions + s.p0 + d.q]);
}

// The channels [begin, end) of sample d's offset group that slice blockIdx.y takes.
template <typename index_t>
__device__ __forceinline__ void slice_channels(const Shape<index_t>& s,
                                               const SampleIndex<index_t>& d, index_t per_slice,
                                               index_t& begin, index_t& end) {
  const index_t group_begin = d.g * s.group_channels;
  begin = group_begin + static_cast<index_t>(blockIdx.y) * per_slice;
  end = min(begin + per_slice, group_begin + s.group_channels);
}

// im2col, for the forward and for grad_weight: one thread per (sample, slice of its offset
// group's channels); the sample is located once, then each channel is 4 gathers, 4 FMAs and one
// coalesced store. T is the opmath type: half and bfloat16 are blended in float, stored as such.
//   Per column value: 4 loads (L2 hits: neighbouring positions share corners), 1 store; per
//   sample: 2 offset loads, 1 mask load, ~40 instructions of locate, amortised over the slice.
//   Main configuration: 7.2M values x 4 B = 29 MB stored (~6 us at 4.8 TB/s), 29M gathers.
template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads)
    sample_columns_kernel(const Shape<index_t> s, const scalar_t* __restrict__ input,
                          const scalar_t* __restrict__ offset, const scalar_t* __restrict__ mask,
                          scalar_t* __restrict__ columns, index_t per_slice) {
  using T = opmath_t<scalar_t>;
  // EXERCISE deform-cuda-sampling: per sample: locate, mask, then each channel's m sum_j w_j v_j
  // checked by: test_deform_conv2d_cuda.py::test_against_reference,
  //   ::test_float32_matches_the_cpu_kernel, ::test_zero_offsets_and_unit_mask_are_a_convolution
  for (int64_t t = first_item(); t < s.samples; t += item_stride()) {
    const SampleIndex<index_t> d = decode_sample(s, static_cast<index_t>(t));
    const Point<T> sample = locate_sample<T>(s, offset, d);
    const T m = mask_of<T>(s, mask, d);
    T w[4];
    int64_t corner[4];
    bool valid[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = m * sample.weight(j);
      valid[j] = sample.valid(j);
      corner[j] = sample.index(j);
    }
    index_t c = 0, end = 0;
    slice_channels(s, d, per_slice, c, end);
    const scalar_t* plane = input + ((s.n0 + d.i) * s.channels + c) * s.plane;
    scalar_t* out = columns + (c * s.taps + d.k) * s.columns + d.i * s.chunk_positions + d.q;
    for (; c < end; ++c, plane += s.plane, out += s.taps * s.columns) {
      // An invalid corner reads 0 and still multiplies its weight: a NaN sample stays NaN.
      T v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = valid[j] ? static_cast<T>(plane[corner[j]]) : T(0);
      *out = static_cast<scalar_t>(w[0] * v[0] + w[1] * v[1] + w[2] * v[2] + w[3] * v[3]);
    }
  }
  // END EXERCISE deform-cuda-sampling
}

// col2im with atomics (the default backward): the same threads as im2col, each adding
// m w_j grad_column into the four corners of its sample, for each channel of its slice. Many
// threads reach one pixel (every tap of every nearby position, 36 on average at 3 x 3, stride 1),
// so the adds must be atomic, and their order, hence the float rounding, changes from run to
// run. acc_t is the opmath type (float for half and bfloat16: no half atomics, one rounding to
// half at the end).
//   Per grad column value: 1 coalesced load, 4 atomic adds (L2 read-modify-writes).
//   Main configuration: 29M atomics into a 3.2 MB buffer that stays in L2.
template <typename scalar_t, typename acc_t, typename index_t>
__global__ void __launch_bounds__(kThreads)
    scatter_columns_atomic_kernel(const Shape<index_t> s, const scalar_t* __restrict__ offset,
                                  const scalar_t* __restrict__ mask,
                                  const scalar_t* __restrict__ grad_columns,
                                  acc_t* __restrict__ grad_input, index_t per_slice) {
  using T = opmath_t<scalar_t>;
  static_assert(std::is_same_v<T, acc_t>, "the scatter accumulates in the opmath type");
  for (int64_t t = first_item(); t < s.samples; t += item_stride()) {
    const SampleIndex<index_t> d = decode_sample(s, static_cast<index_t>(t));
    const Point<T> sample = locate_sample<T>(s, offset, d);
    const T m = mask_of<T>(s, mask, d);
    T w[4];
    int64_t corner[4];
    bool valid[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = m * sample.weight(j);
      valid[j] = sample.valid(j);  // false for all four of a NaN sample: it has no place to go
      corner[j] = sample.index(j);
    }
    if (!(valid[0] || valid[1] || valid[2] || valid[3])) continue;
    index_t c = 0, end = 0;
    slice_channels(s, d, per_slice, c, end);
    acc_t* plane = grad_input + ((s.n0 + d.i) * s.channels + c) * s.plane;
    const scalar_t* grad =
        grad_columns + (c * s.taps + d.k) * s.columns + d.i * s.chunk_positions + d.q;
    for (; c < end; ++c, plane += s.plane, grad += s.taps * s.columns) {
      const T g = static_cast<T>(*grad);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (valid[j]) atomicAdd(plane + corner[j], w[j] * g);
      }
    }
  }
}

// The deterministic backward (v1d). The scatter's race is between threads of different samples
// whose corners land on one pixel; a pixel's channels all receive the same samples' corners
// (the sampling does not depend on the channel). So the corners are sorted once by destination,
// and each (destination, channel) is then summed by one thread in that fixed order:
//   1. corner_keys: one entry per (sample, corner), e = 4 s + j, keyed by its destination
//      (i G + g) H W + pixel (i: image in the chunk, g: offset group), or `none` (= images G H W,
//      larger than every destination) for a corner outside the image;
//   2. a stable radix sort of the keys, carrying the entry numbers: entries with one destination
//      become a run, in the order of their entry numbers, whatever the thread schedule;
//   3. sorted_entries: the runs' weights and column addresses in sorted order, a flag on the
//      first entry of each run; an inclusive scan of the flags numbers the runs;
//   4. run_starts: where each run starts (one writer per run), and where the last one ends;
//   5. gather_runs: one thread per (run, channel of its offset group) sums the run's
//      contributions in sorted order and adds the sum into the grad_input element it alone owns.
// No atomics anywhere, and every sum has a fixed order: the same bits every run. Every buffer
// grows with the chunk's entries, not with the input's planes, so chunks of a few output rows of
// a huge image stay cheap.

// Step 1. Per sample: 3 loads, 4 x (8 + 4 + sizeof(T)) B stored. Main configuration: 113K
// samples, 0.45M entries, 7 MB.
template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads)
    corner_keys_kernel(const Shape<index_t> s, const scalar_t* __restrict__ offset,
                       const scalar_t* __restrict__ mask, int64_t* __restrict__ keys,
                       int32_t* __restrict__ entries, opmath_t<scalar_t>* __restrict__ weights) {
  using T = opmath_t<scalar_t>;
  const int64_t none = static_cast<int64_t>(s.images) * s.offset_groups * s.plane;
  for (int64_t t = first_item(); t < s.samples; t += item_stride()) {
    const SampleIndex<index_t> d = decode_sample(s, static_cast<index_t>(t));
    const Point<T> sample = locate_sample<T>(s, offset, d);
    const T m = mask_of<T>(s, mask, d);
    const int64_t plane_key = (static_cast<int64_t>(d.i) * s.offset_groups + d.g) * s.plane;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t e = 4 * t + j;
      keys[e] = sample.valid(j) ? plane_key + sample.index(j) : none;
      entries[e] = static_cast<int32_t>(e);
      weights[e] = m * sample.weight(j);
    }
  }
}

// Step 3. One thread per sorted entry t: the entry's weight and the channel-free part of its
// column address, copied into sorted order so that step 5 reads a run contiguously, and
// heads[t] = 1 where a run starts. Entries keyed `none` (all after the last valid one) get 0.
//   Per entry: 4 loads, 3 stores.
template <typename T, typename index_t>
__global__ void __launch_bounds__(kThreads)
    sorted_entries_kernel(const Shape<index_t> s, int64_t count,
                          const int64_t* __restrict__ sorted_keys,
                          const int32_t* __restrict__ order, const T* __restrict__ weights,
                          T* __restrict__ sorted_weights, index_t* __restrict__ sorted_columns,
                          int32_t* __restrict__ heads) {
  const int64_t none = static_cast<int64_t>(s.images) * s.offset_groups * s.plane;
  for (int64_t t = first_item(); t < count; t += item_stride()) {
    const int64_t key = sorted_keys[t];
    const bool live = key != none;
    heads[t] = live && (t == 0 || sorted_keys[t - 1] != key);
    if (!live) continue;
    const int32_t e = order[t];
    sorted_weights[t] = weights[e];
    // The sample's (i, k, q), in 32 bits whatever index_t is: the sort takes fewer than 2^31
    // entries, so every factor fits, and no 64-bit division routine is called.
    const int32_t sample = e >> 2, positions = static_cast<int32_t>(s.chunk_positions);
    const int32_t rest = sample / positions, taps = static_cast<int32_t>(s.taps);
    const int32_t q = sample - rest * positions, k = rest % taps;
    const int32_t i = rest / taps / static_cast<int32_t>(s.offset_groups);
    sorted_columns[t] = static_cast<index_t>(k) * s.columns +
                        static_cast<index_t>(i) * s.chunk_positions + static_cast<index_t>(q);
  }
}

// Step 4, after runs = inclusive scan of heads (so run r's first entry has runs[t] = r + 1, and
// runs[count - 1] is the number of runs): starts[r] = the first entry of run r, each written by
// that entry's thread alone, and starts[number of runs] = the end of the last run.
template <typename index_t>
__global__ void __launch_bounds__(kThreads)
    run_starts_kernel(const Shape<index_t> s, int64_t count,
                      const int64_t* __restrict__ sorted_keys, const int32_t* __restrict__ heads,
                      const int32_t* __restrict__ runs, int32_t* __restrict__ starts) {
  const int64_t none = static_cast<int64_t>(s.images) * s.offset_groups * s.plane;
  for (int64_t t = first_item(); t < count; t += item_stride()) {
    if (sorted_keys[t] == none) continue;
    if (heads[t]) starts[runs[t] - 1] = static_cast<int32_t>(t);
    if (t + 1 == count || sorted_keys[t + 1] == none) starts[runs[t]] = static_cast<int32_t>(t + 1);
  }
}

// Step 5: col2im as a gather. The number of runs is read on the device (runs[count - 1]): the
// host never waits for it, so the backward still records into a CUDA graph. Threads take
// (run, channel) pairs run-fastest: a warp covers neighbouring destinations of one channel.
//   Per run and channel: 3 loads to find the run, then per contribution 2 loads from the sorted
//   arrays (shared by the group's channels: L1/L2 hits) and 1 gather from grad_columns; one
//   read-modify-write of grad_input. Main configuration: 12.5K runs of 36 entries on average,
//   x 64 channels = 29M gathers, as many as the atomic path's atomics, but loads; plus the sort:
//   0.45M 12-byte pairs with 14-bit keys, 2 passes of 8 bits, ~11 MB of traffic each.
template <typename scalar_t, typename acc_t, typename index_t>
__global__ void __launch_bounds__(kThreads)
    gather_runs_kernel(const Shape<index_t> s, const scalar_t* __restrict__ grad_columns,
                       const int64_t* __restrict__ sorted_keys,
                       const acc_t* __restrict__ sorted_weights,
                       const index_t* __restrict__ sorted_columns,
                       const int32_t* __restrict__ run_count, const int32_t* __restrict__ starts,
                       acc_t* __restrict__ grad_input) {
  using T = opmath_t<scalar_t>;
  static_assert(std::is_same_v<T, acc_t>, "the gather accumulates in the opmath type");
  const int64_t runs = *run_count;
  const int64_t items = runs * s.group_channels;
  for (int64_t t = first_item(); t < items; t += item_stride()) {
    const int32_t run = static_cast<int32_t>(t % runs);
    const index_t channel_in_group = static_cast<index_t>(t / runs);
    const int32_t first = starts[run], last = starts[run + 1];
    // The destination: key = (i G + g) H W + pixel, below images G H W, which fits index_t.
    const index_t key = static_cast<index_t>(sorted_keys[first]);
    const index_t pixel = key % s.plane, image_group = key / s.plane;
    const index_t i = image_group / s.offset_groups, g = image_group % s.offset_groups;
    const index_t c = g * s.group_channels + channel_in_group;
    const scalar_t* grad = grad_columns + c * s.taps * s.columns;
    T sum = T(0);
    for (int32_t e = first; e < last; ++e) {
      sum += sorted_weights[e] * static_cast<T>(grad[sorted_columns[e]]);
    }
    grad_input[((s.n0 + i) * s.channels + c) * s.plane + pixel] += sum;
  }
}

// grad_offset and grad_mask: one thread per sample owns its (dy, dx) and mask gradients and
// loops over its offset group's channels in order, so these need no atomics in either mode.
// The four dot products A_j = sum_c grad_column_c v_cj, then the derivative weights of
// workbook/bilinear.h, as the CPU kernel does.
//   Per sample and channel: 1 coalesced grad column load, 4 gathers (L2), 8 FMAs; 3 stores per
//   sample. Main configuration: 113K samples x 64 channels: 29M gathers, as im2col.
template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads)
    offset_mask_gradients_kernel(const Shape<index_t> s, const scalar_t* __restrict__ input,
                                 const scalar_t* __restrict__ offset,
                                 const scalar_t* __restrict__ mask,
                                 const scalar_t* __restrict__ grad_columns,
                                 scalar_t* __restrict__ grad_offset,
                                 scalar_t* __restrict__ grad_mask) {
  using T = opmath_t<scalar_t>;
  for (int64_t t = first_item(); t < s.samples; t += item_stride()) {
    const SampleIndex<index_t> d = decode_sample(s, static_cast<index_t>(t));
    const Point<T> sample = locate_sample<T>(s, offset, d);
    int64_t corner[4];
    bool valid[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      valid[j] = sample.valid(j);
      corner[j] = sample.index(j);
    }
    const index_t c_begin = d.g * s.group_channels;
    const scalar_t* plane = input + ((s.n0 + d.i) * s.channels + c_begin) * s.plane;
    const scalar_t* grad =
        grad_columns + (c_begin * s.taps + d.k) * s.columns + d.i * s.chunk_positions + d.q;
    T dots[4] = {T(0), T(0), T(0), T(0)};
    for (index_t c = 0; c < s.group_channels; ++c, plane += s.plane, grad += s.taps * s.columns) {
      const T g = static_cast<T>(*grad);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        dots[j] += g * (valid[j] ? static_cast<T>(plane[corner[j]]) : T(0));
      }
    }
    T d_y = T(0), d_x = T(0), d_m = T(0);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      d_y += sample.d_weight_dy(j) * dots[j];
      d_x += sample.d_weight_dx(j) * dots[j];
      d_m += sample.weight(j) * dots[j];
    }
    const index_t n = s.n0 + d.i, p = s.p0 + d.q;
    const index_t gk = d.g * s.taps + d.k, GK = s.offset_groups * s.taps;
    if (grad_offset != nullptr) {
      const T m = mask_of<T>(s, mask, d);
      scalar_t* out = grad_offset + (n * 2 * GK + 2 * gk) * s.positions + p;
      out[0] = static_cast<scalar_t>(m * d_y);
      out[s.positions] = static_cast<scalar_t>(m * d_x);
    }
    if (grad_mask != nullptr) {
      grad_mask[(n * GK + gk) * s.positions + p] = static_cast<scalar_t>(d_m);
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Launchers, over raw pointers: each launches on `stream` and checks the launch. The caller owns
// the memory, the device guard and the stream.

inline void check_launch(const char* kernel) {
  const cudaError_t error = cudaGetLastError();
  WORKBOOK_CHECK(error == cudaSuccess, std::string("deform_conv2d: the CUDA kernel ") + kernel +
                                           " failed: " + cudaGetErrorString(error));
}

inline bool fits_32bit(std::initializer_list<int64_t> sizes) {
  return std::all_of(sizes.begin(), sizes.end(),
                     [](int64_t n) { return n <= std::numeric_limits<int32_t>::max(); });
}

template <typename index_t>
Shape<index_t> shape_of(const Geometry& g, const Chunk& ch) {
  const auto i = [](int64_t v) { return static_cast<index_t>(v); };
  Shape<index_t> s{};
  s.channels = i(g.in_channels);
  s.plane = i(g.height * g.width);
  s.offset_groups = i(g.offset_groups);
  s.group_channels = i(g.channels_per_offset_group());
  s.taps = i(g.taps());
  s.kernel_w = i(g.kernel_w);
  s.positions = i(g.positions());
  s.out_w = i(g.out_w);
  s.height = g.height;
  s.width = g.width;
  s.stride_h = g.stride_h;
  s.stride_w = g.stride_w;
  s.pad_h = g.pad_h;
  s.pad_w = g.pad_w;
  s.dilation_h = g.dilation_h;
  s.dilation_w = g.dilation_w;
  s.n0 = i(ch.n0);
  s.images = i(ch.images);
  s.p0 = i(ch.p0);
  s.chunk_positions = i(ch.positions);
  s.columns = i(ch.images * ch.positions);
  s.samples = i(ch.images * g.offset_groups * g.taps() * ch.positions);
  return s;
}

inline dim3 grid_for(int64_t count, int64_t slices = 1) {
  return dim3(static_cast<unsigned int>(std::min(ceil_div<int64_t>(count, kThreads), kMaxBlocks)),
              static_cast<unsigned int>(slices));
}

// How many slices a sample's channels are cut into, and how many channels a slice takes.
inline std::pair<int64_t, int64_t> channel_slices(int64_t samples, int64_t channels) {
  const int64_t most =
      std::clamp<int64_t>(ceil_div(channels, kMinChannelsPerThread), 1, kMaxSlices);
  const int64_t wanted = std::clamp<int64_t>(ceil_div(kTargetThreads, samples), 1, most);
  const int64_t per_slice = ceil_div(channels, wanted);
  return {ceil_div(channels, per_slice), per_slice};  // no empty slice
}

// Blocks for a grid-stride loop whose length only the device knows: enough to fill the GPU.
inline unsigned int filling_blocks(int64_t most_items) {
  // Cheap attribute queries, not stream operations: fine under graph capture.
  int device = 0, sms = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error == cudaSuccess) {
    error = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  WORKBOOK_CHECK(error == cudaSuccess,
                 std::string("deform_conv2d: reading the device's multiprocessor count failed: ") +
                     cudaGetErrorString(error));
  const int64_t fill = int64_t{8} * sms;
  return static_cast<unsigned int>(
      std::clamp<int64_t>(ceil_div<int64_t>(most_items, kThreads), 1, fill));
}

// im2col of one chunk into columns [C K, images Pc].
template <typename scalar_t, typename index_t>
void sample_columns(const Shape<index_t>& s, const scalar_t* input, const scalar_t* offset,
                    const scalar_t* mask, scalar_t* columns, cudaStream_t stream) {
  const auto [slices, per_slice] = channel_slices(s.samples, s.group_channels);
  sample_columns_kernel<scalar_t, index_t><<<grid_for(s.samples, slices), kThreads, 0, stream>>>(
      s, input, offset, mask, columns, static_cast<index_t>(per_slice));
  check_launch("sample_columns");
}

// grad_input (in the opmath type) += the chunk's grad columns, scattered through its samples by
// atomics: the default backward.
template <typename scalar_t, typename index_t>
void scatter_columns_atomic(const Shape<index_t>& s, const scalar_t* offset, const scalar_t* mask,
                            const scalar_t* grad_columns, opmath_t<scalar_t>* grad_input,
                            cudaStream_t stream) {
  const auto [slices, per_slice] = channel_slices(s.samples, s.group_channels);
  scatter_columns_atomic_kernel<scalar_t, opmath_t<scalar_t>, index_t>
      <<<grid_for(s.samples, slices), kThreads, 0, stream>>>(
          s, offset, mask, grad_columns, grad_input, static_cast<index_t>(per_slice));
  check_launch("scatter_columns_atomic");
}

// The number of bits a key up to max_key takes (at least 1): the radix sort sorts no more.
inline int key_bits(uint64_t max_key) {
  int bits = 1;
  while (max_key >>= 1) ++bits;
  return bits;
}

// The deterministic backward's buffers for up to `entries` corner entries, carved out of one
// allocation of SortBuffers::bytes(entries) bytes that the caller makes on the device (so it
// comes from the caller's allocator, on its stream), CUB's scratch space included.
template <typename T, typename index_t>
struct SortBuffers {
  int64_t *keys, *sorted_keys;
  int32_t *entries, *order;
  T *weights, *sorted_weights;
  index_t* sorted_columns;
  int32_t *heads, *runs, *starts;
  void* scratch;
  size_t scratch_bytes;

  static constexpr size_t kAlign = 256;
  static size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

  // CUB's scratch space for a sort and a scan of n items (an upper bound: the sort's for all 64
  // bits of a key). Asks CUB, which then launches nothing.
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
                   std::string("deform_conv2d: sizing CUB's scratch space failed: ") +
                       cudaGetErrorString(error));
    return std::max(sort_bytes, scan_bytes);
  }

  static size_t bytes(int64_t entries) {
    const size_t n = static_cast<size_t>(entries);
    return 2 * aligned(n * sizeof(int64_t)) + 5 * aligned(n * sizeof(int32_t)) +
           aligned((n + 1) * sizeof(int32_t)) + 2 * aligned(n * sizeof(T)) +
           aligned(n * sizeof(index_t)) + aligned(cub_bytes(entries));
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
    b.weights = reinterpret_cast<T*>(take(n * sizeof(T)));
    b.sorted_weights = reinterpret_cast<T*>(take(n * sizeof(T)));
    b.sorted_columns = reinterpret_cast<index_t*>(take(n * sizeof(index_t)));
    b.scratch_bytes = cub_bytes(entries);
    b.scratch = take(b.scratch_bytes);
    return b;
  }
};

inline void check_cub(cudaError_t error, const char* what) {
  WORKBOOK_CHECK(error == cudaSuccess, std::string("deform_conv2d: CUB's ") + what +
                                           " failed: " + cudaGetErrorString(error));
}

// grad_input (in the opmath type) += the chunk's grad columns, reproducibly: the five steps
// above, in the buffers `b` (sized for at least this chunk's 4 x samples entries).
template <typename scalar_t, typename index_t>
void scatter_columns_sorted(const Shape<index_t>& s, const scalar_t* offset, const scalar_t* mask,
                            const scalar_t* grad_columns, opmath_t<scalar_t>* grad_input,
                            const SortBuffers<opmath_t<scalar_t>, index_t>& b,
                            cudaStream_t stream) {
  using T = opmath_t<scalar_t>;
  const int64_t count = 4 * static_cast<int64_t>(s.samples);
  const int64_t none = static_cast<int64_t>(s.images) * s.offset_groups * s.plane;
  corner_keys_kernel<scalar_t, index_t>
      <<<grid_for(s.samples), kThreads, 0, stream>>>(s, offset, mask, b.keys, b.entries, b.weights);
  check_launch("corner_keys");
  // An LSD radix sort is stable. Only the bits a key can have are sorted: at the main
  // configuration 14 of them, two passes instead of the eight a full int64 would take.
  size_t scratch = b.scratch_bytes;
  check_cub(
      cub::DeviceRadixSort::SortPairs(b.scratch, scratch, b.keys, b.sorted_keys, b.entries, b.order,
                                      count, /*begin_bit=*/0, key_bits(none), stream),
      "radix sort");
  sorted_entries_kernel<T, index_t><<<grid_for(count), kThreads, 0, stream>>>(
      s, count, b.sorted_keys, b.order, b.weights, b.sorted_weights, b.sorted_columns, b.heads);
  check_launch("sorted_entries");
  scratch = b.scratch_bytes;  // integers: the scan is exact
  check_cub(cub::DeviceScan::InclusiveSum(b.scratch, scratch, b.heads, b.runs, count, stream),
            "inclusive scan");
  run_starts_kernel<index_t><<<grid_for(count), kThreads, 0, stream>>>(s, count, b.sorted_keys,
                                                                       b.heads, b.runs, b.starts);
  check_launch("run_starts");
  const int64_t most_runs = std::min(count, none);
  gather_runs_kernel<scalar_t, T, index_t>
      <<<filling_blocks(most_runs * s.group_channels), kThreads, 0, stream>>>(
          s, grad_columns, b.sorted_keys, b.sorted_weights, b.sorted_columns, b.runs + (count - 1),
          b.starts, grad_input);
  check_launch("gather_runs");
}

// grad_offset and grad_mask (either may be null: not wanted) of one chunk's samples.
template <typename scalar_t, typename index_t>
void offset_mask_gradients(const Shape<index_t>& s, const scalar_t* input, const scalar_t* offset,
                           const scalar_t* mask, const scalar_t* grad_columns,
                           scalar_t* grad_offset, scalar_t* grad_mask, cudaStream_t stream) {
  offset_mask_gradients_kernel<scalar_t, index_t><<<grid_for(s.samples), kThreads, 0, stream>>>(
      s, input, offset, mask, grad_columns, grad_offset, grad_mask);
  check_launch("offset_mask_gradients");
}

}  // namespace deform_conv2d_cuda_kernels
