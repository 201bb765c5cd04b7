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
// Sections: reference, kernels, launchers (the ops), registration. The input checks are
// workbook/deform_conv2d.h and the bilinear arithmetic workbook/bilinear.h, shared with
// the CPU kernels of stage 06 (../06_op_library/csrc/deform_conv2d/cpu/deform_conv2d_cpu.h), so
// the CPU suite tests the arithmetic these kernels run. The schemas are in
// ../06_op_library/csrc/deform_conv2d/deform_conv2d.cpp.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/cub.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/safe_numerics.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "workbook/bilinear.h"
#include "workbook/deform_conv2d.h"
#include "workbook/host_device.h"

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
// The float64 PyTorch version the tests compare against is common/workbook/reference.py.

namespace {

using workbook::ceil_div;
using workbook::bilinear::Point;
using workbook::deform_conv2d::Chunk;
using workbook::deform_conv2d::ChunkPlan;
using workbook::deform_conv2d::for_each_chunk;
using workbook::deform_conv2d::Geometry;
using workbook::deform_conv2d::kNoLimit;
using workbook::deform_conv2d::plan_chunks;

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
  using T = at::opmath_type<scalar_t>;
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
  using T = at::opmath_type<scalar_t>;
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
                       int32_t* __restrict__ entries,
                       at::opmath_type<scalar_t>* __restrict__ weights) {
  using T = at::opmath_type<scalar_t>;
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
  using T = at::opmath_type<scalar_t>;
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
  using T = at::opmath_type<scalar_t>;
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
// Launchers: the ops' CUDA implementations.
//
// Each checks every tensor (device included: all on the input's device, a CUDA one) before
// anything is allocated or launched, runs under a guard for the input's device, launches on the
// current stream and checks each launch. The GEMMs are ATen's (cuBLAS), on the same stream.
// Half and bfloat16 are stored as such (columns, GEMM operands); the kernels compute in float,
// cuBLAS accumulates in float, and the sums over the batch (grad_input, grad_weight) are kept in
// float until the end.

bool fits_32bit(std::initializer_list<int64_t> sizes) {
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

dim3 grid_for(int64_t count, int64_t slices = 1) {
  return dim3(static_cast<unsigned int>(std::min(ceil_div<int64_t>(count, kThreads), kMaxBlocks)),
              static_cast<unsigned int>(slices));
}

// How many slices a sample's channels are cut into, and how many channels a slice takes.
std::pair<int64_t, int64_t> channel_slices(int64_t samples, int64_t channels) {
  const int64_t most =
      std::clamp<int64_t>(ceil_div(channels, kMinChannelsPerThread), 1, kMaxSlices);
  const int64_t wanted = std::clamp<int64_t>(ceil_div(kTargetThreads, samples), 1, most);
  const int64_t per_slice = ceil_div(channels, wanted);
  return {ceil_div(channels, per_slice), per_slice};  // no empty slice
}

template <typename scalar_t>
const scalar_t* data_or_null(const std::optional<at::Tensor>& t) {
  return t ? t->const_data_ptr<scalar_t>() : nullptr;
}

std::optional<at::Tensor> defined_or_null(const std::optional<at::Tensor>& t) {
  return (t.has_value() && t->defined()) ? t : std::nullopt;
}

// im2col of one chunk into columns [C K, images Pc].
template <typename scalar_t, typename index_t>
void sample_columns(const Shape<index_t>& s, const at::Tensor& input, const at::Tensor& offset,
                    const std::optional<at::Tensor>& mask, at::Tensor& columns) {
  const auto [slices, per_slice] = channel_slices(s.samples, s.group_channels);
  sample_columns_kernel<scalar_t, index_t>
      <<<grid_for(s.samples, slices), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          s, input.const_data_ptr<scalar_t>(), offset.const_data_ptr<scalar_t>(),
          data_or_null<scalar_t>(mask), columns.mutable_data_ptr<scalar_t>(),
          static_cast<index_t>(per_slice));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The deterministic backward's buffers, sized for the largest chunk.
struct SortBuffers {
  at::Tensor keys, sorted_keys, entries, order, weights, sorted_weights, sorted_columns;
  at::Tensor heads, runs, starts;
};

// Blocks for a grid-stride loop whose length only the device knows: enough to fill the GPU.
unsigned int filling_blocks(int64_t most_items) {
  int sms = 0;  // a cheap attribute query, not a stream operation: fine under graph capture
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  const int64_t fill = int64_t{8} * sms;
  return static_cast<unsigned int>(
      std::clamp<int64_t>(ceil_div<int64_t>(most_items, kThreads), 1, fill));
}

// grad_input (in the opmath type) += the chunk's grad columns, scattered through its samples.
template <typename scalar_t, typename index_t>
void scatter_columns(const Shape<index_t>& s, const at::Tensor& offset,
                     const std::optional<at::Tensor>& mask, const at::Tensor& grad_columns,
                     at::Tensor& grad_input, SortBuffers* sort) {
  using T = at::opmath_type<scalar_t>;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (sort == nullptr) {
    const auto [slices, per_slice] = channel_slices(s.samples, s.group_channels);
    scatter_columns_atomic_kernel<scalar_t, T, index_t>
        <<<grid_for(s.samples, slices), kThreads, 0, stream>>>(
            s, offset.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(mask),
            grad_columns.const_data_ptr<scalar_t>(), grad_input.mutable_data_ptr<T>(),
            static_cast<index_t>(per_slice));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  // Deterministic: the five steps above.
  const int64_t count = 4 * static_cast<int64_t>(s.samples);
  const int64_t none = static_cast<int64_t>(s.images) * s.offset_groups * s.plane;
  corner_keys_kernel<scalar_t, index_t><<<grid_for(s.samples), kThreads, 0, stream>>>(
      s, offset.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(mask),
      sort->keys.mutable_data_ptr<int64_t>(), sort->entries.mutable_data_ptr<int32_t>(),
      sort->weights.mutable_data_ptr<T>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // An LSD radix sort is stable. Only the bits a key can have are sorted: at the main
  // configuration 14 of them, two passes instead of the eight a full int64 would take. CUB's
  // scratch space comes from ATen's caching allocator, on the current stream.
  at::cuda::cub::radix_sort_pairs<int64_t, int32_t>(
      sort->keys.const_data_ptr<int64_t>(), sort->sorted_keys.mutable_data_ptr<int64_t>(),
      sort->entries.const_data_ptr<int32_t>(), sort->order.mutable_data_ptr<int32_t>(), count,
      /*descending=*/false, /*begin_bit=*/0, at::cuda::cub::get_num_bits(none));
  sorted_entries_kernel<T, index_t><<<grid_for(count), kThreads, 0, stream>>>(
      s, count, sort->sorted_keys.const_data_ptr<int64_t>(), sort->order.const_data_ptr<int32_t>(),
      sort->weights.const_data_ptr<T>(), sort->sorted_weights.mutable_data_ptr<T>(),
      sort->sorted_columns.mutable_data_ptr<index_t>(), sort->heads.mutable_data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor runs = sort->runs.narrow(0, 0, count);
  at::cumsum_out(runs, sort->heads.narrow(0, 0, count), /*dim=*/0, at::kInt);  // integer: exact
  run_starts_kernel<index_t><<<grid_for(count), kThreads, 0, stream>>>(
      s, count, sort->sorted_keys.const_data_ptr<int64_t>(), sort->heads.const_data_ptr<int32_t>(),
      runs.const_data_ptr<int32_t>(), sort->starts.mutable_data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t most_runs = std::min(count, none);
  gather_runs_kernel<scalar_t, T, index_t>
      <<<filling_blocks(most_runs * s.group_channels), kThreads, 0, stream>>>(
          s, grad_columns.const_data_ptr<scalar_t>(), sort->sorted_keys.const_data_ptr<int64_t>(),
          sort->sorted_weights.const_data_ptr<T>(), sort->sorted_columns.const_data_ptr<index_t>(),
          runs.const_data_ptr<int32_t>() + (count - 1), sort->starts.const_data_ptr<int32_t>(),
          grad_input.mutable_data_ptr<T>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename index_t>
void offset_mask_gradients(const Shape<index_t>& s, const at::Tensor& input,
                           const at::Tensor& offset, const std::optional<at::Tensor>& mask,
                           const at::Tensor& grad_columns, at::Tensor* grad_offset,
                           at::Tensor* grad_mask) {
  offset_mask_gradients_kernel<scalar_t, index_t>
      <<<grid_for(s.samples), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          s, input.const_data_ptr<scalar_t>(), offset.const_data_ptr<scalar_t>(),
          data_or_null<scalar_t>(mask), grad_columns.const_data_ptr<scalar_t>(),
          grad_offset ? grad_offset->mutable_data_ptr<scalar_t>() : nullptr,
          grad_mask ? grad_mask->mutable_data_ptr<scalar_t>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "deform_conv2d_cuda", [&] {
        for_each_chunk(g, plan, [&](const Chunk& ch) {
          const int64_t cols = ch.images * ch.positions;
          auto columns2 = columns.narrow(0, 0, width * cols).view({width, cols});
          if (small) {
            sample_columns<scalar_t>(shape_of<int32_t>(g, ch), input_c, offset_c, mask_c, columns2);
          } else {
            sample_columns<scalar_t>(shape_of<int64_t>(g, ch), input_c, offset_c, mask_c, columns2);
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
  std::optional<SortBuffers> sort;  // the deterministic backward's
};

template <typename scalar_t, typename index_t>
void backward_chunks(const Geometry& g, const ChunkPlan& plan, BackwardIO& io) {
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
      sample_columns<scalar_t>(s, io.input, io.offset, io.mask, columns2);
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
      scatter_columns<scalar_t>(s, io.offset, io.mask, grad_columns2, io.grad_input_acc,
                                io.sort ? &*io.sort : nullptr);
    }
    if (io.grad_offset.defined() || io.grad_mask.defined()) {
      offset_mask_gradients<scalar_t>(s, io.input, io.offset, io.mask, grad_columns2,
                                      io.grad_offset.defined() ? &io.grad_offset : nullptr,
                                      io.grad_mask.defined() ? &io.grad_mask : nullptr);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> deform_conv2d_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& weight, const std::optional<at::Tensor>& mask_in, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, std::array<bool, 5> output_mask) {
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
    const bool deterministic = want_input && at::globalContext().deterministicAlgorithms();

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
    if (deterministic) {
      const auto longs = options.dtype(at::kLong), ints = options.dtype(at::kInt);
      SortBuffers sort;
      sort.keys = at::empty({entries}, longs);
      sort.sorted_keys = at::empty({entries}, longs);
      sort.entries = at::empty({entries}, ints);
      sort.order = at::empty({entries}, ints);
      sort.weights = at::empty({entries}, acc_options);
      sort.sorted_weights = at::empty({entries}, acc_options);
      sort.sorted_columns = at::empty({entries}, small ? ints : longs);
      sort.heads = at::empty({entries}, ints);
      sort.runs = at::empty({entries}, ints);
      sort.starts = at::empty({entries + 1}, ints);
      io.sort = std::move(sort);
    }

    const auto type = input.scalar_type();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, type, "deform_conv2d_backward", [&] {
      if (small) {
        backward_chunks<scalar_t, int32_t>(g, plan, io);
      } else {
        backward_chunks<scalar_t, int64_t>(g, plan, io);
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
