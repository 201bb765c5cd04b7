// Kernels whose threads cooperate, for tests/test_cooperation.py: each one of CUDA's ways for the
// threads of a block to share work (shared memory and barriers, warp shuffles and votes,
// cooperative groups, atomics on shared memory), written as a CUDA course would, with a
// launcher the test calls through ctypes (raw pointers to CPU memory, which is the emulated
// device's memory). The test compares each result with the CPU's, under every order the
// emulated device runs blocks and threads in, and under make racecheck's ThreadSanitizer.
#include <cuda_runtime.h>

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kTile = 32;

// The sum of each block's kThreads elements, by halving in shared memory: at each step the lower
// half adds the upper half, and a barrier keeps a step's reads after the previous step's writes.
__global__ void block_sum_shared(const float* x, float* sums, int n) {
  __shared__ float partial[kThreads];
  const unsigned t = threadIdx.x;
  const int i = blockIdx.x * blockDim.x + static_cast<int>(t);
  partial[t] = i < n ? x[i] : 0.0f;
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (t < stride) partial[t] += partial[t + stride];
    __syncthreads();
  }
  if (t == 0) sums[blockIdx.x] = partial[0];
}

// The same sums by warp shuffles: each warp halves in registers (no shared memory, no barrier),
// its lane 0 leaves the warp's sum in dynamic shared memory, and the first warp adds those.
__device__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

__global__ void block_sum_shuffle(const float* x, float* sums, int n) {
  extern __shared__ float warp_sums[];
  const unsigned t = threadIdx.x, lane = t % 32, warp = t / 32;
  const int i = blockIdx.x * blockDim.x + static_cast<int>(t);
  const float v = warp_sum(i < n ? x[i] : 0.0f);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const float s = warp_sum(lane < blockDim.x / 32 ? warp_sums[lane] : 0.0f);
    if (lane == 0) sums[blockIdx.x] = s;
  }
}

// out = in^T for a rows x cols matrix, through a kTile x kTile tile in shared memory: a block of
// kTile x 8 threads reads the tile in rows (coalesced), waits, and writes it in rows of the
// transpose. The tile has one column more than it needs, so that a column of it lies in 32
// different banks.
__global__ void transpose_tiled(const float* in, float* out, int rows, int cols) {
  __shared__ float tile[kTile][kTile + 1];
  const int x = blockIdx.x * kTile + threadIdx.x;
  for (int dy = threadIdx.y; dy < kTile; dy += blockDim.y) {
    const int y = blockIdx.y * kTile + dy;
    if (x < cols && y < rows) tile[dy][threadIdx.x] = in[y * cols + x];
  }
  __syncthreads();
  const int tx = blockIdx.y * kTile + threadIdx.x;  // a column of out is a row of in
  for (int dy = threadIdx.y; dy < kTile; dy += blockDim.y) {
    const int ty = blockIdx.x * kTile + dy;
    if (tx < rows && ty < cols) out[ty * rows + tx] = tile[threadIdx.x][dy];
  }
}

// Votes: per warp the ballot, any and all of x > 0; per block the count, and and or of it.
__global__ void votes(const float* x, unsigned* ballots, int* any_all, int* block_votes) {
  const unsigned t = threadIdx.x, warp = blockIdx.x * (blockDim.x / 32) + t / 32;
  const int positive = x[blockIdx.x * blockDim.x + t] > 0.0f;
  const unsigned ballot = __ballot_sync(0xffffffffu, positive);
  const int any = __any_sync(0xffffffffu, positive), all = __all_sync(0xffffffffu, positive);
  if (t % 32 == 0) {
    ballots[warp] = ballot;
    any_all[2 * warp] = any;
    any_all[2 * warp + 1] = all;
  }
  const int count = __syncthreads_count(positive);
  const int every = __syncthreads_and(positive);
  const int some = __syncthreads_or(positive);
  if (t == 0) {
    block_votes[3 * blockIdx.x] = count;
    block_votes[3 * blockIdx.x + 1] = every;
    block_votes[3 * blockIdx.x + 2] = some;
  }
}

// The four shuffles with a width: lane values are their global indices.
__global__ void shuffles(float* out) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  const float v = static_cast<float>(i);
  out[4 * i] = __shfl_sync(0xffffffffu, v, 3, 8);
  out[4 * i + 1] = __shfl_up_sync(0xffffffffu, v, 1, 16);
  out[4 * i + 2] = __shfl_down_sync(0xffffffffu, v, 2, 16);
  out[4 * i + 3] = __shfl_xor_sync(0xffffffffu, v, 5);
}

// Cooperative groups: the sum of each tile of 16 threads by cg::reduce, and the tile's ballot.
__global__ void tile_sums(const float* x, float* sums, unsigned* ballots) {
  const cg::thread_block block = cg::this_thread_block();
  const cg::thread_block_tile<16> tile = cg::tiled_partition<16>(block);
  const float v = x[blockIdx.x * blockDim.x + block.thread_rank()];
  const float sum = cg::reduce(tile, v, cg::plus<float>());
  const unsigned ballot = tile.ballot(v > 0.0f);
  tile.sync();
  if (tile.thread_rank() == 0) {
    const unsigned index = blockIdx.x * tile.meta_group_size() + tile.meta_group_rank();
    sums[index] = sum;
    ballots[index] = ballot;
  }
  block.sync();
}

// A histogram of n bytes into 64 bins: each block counts in shared memory with atomics (which
// order nothing: the barriers do), then adds its bins into the global ones.
__global__ void histogram(const unsigned char* bytes, int n, int* bins) {
  __shared__ int local[64];
  for (unsigned b = threadIdx.x; b < 64; b += blockDim.x) local[b] = 0;
  __syncthreads();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    atomicAdd(&local[bytes[i] % 64], 1);
  }
  __syncthreads();
  for (unsigned b = threadIdx.x; b < 64; b += blockDim.x) atomicAdd(&bins[b], local[b]);
}

// A warp reverses 32 values through shared memory: __syncwarp orders the lanes' stores before
// their loads.
__global__ void warp_reverse(const float* x, float* out) {
  __shared__ float lanes[kThreads];
  const unsigned t = threadIdx.x, base = t / 32 * 32, lane = t % 32;
  lanes[t] = x[blockIdx.x * blockDim.x + t];
  __syncwarp();
  out[blockIdx.x * blockDim.x + t] = lanes[base + 31 - lane];
}

// -- launchers: each returns the launch's error code (0: cudaSuccess)
// ------------------------------

extern "C" {

const char* error_text(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

int run_block_sum_shared(const float* x, float* sums, int n) {
  block_sum_shared<<<(n + kThreads - 1) / kThreads, kThreads>>>(x, sums, n);
  return cudaGetLastError();
}

int run_block_sum_shuffle(const float* x, float* sums, int n) {
  block_sum_shuffle<<<(n + kThreads - 1) / kThreads, kThreads, kThreads / 32 * sizeof(float)>>>(
      x, sums, n);
  return cudaGetLastError();
}

int run_transpose_tiled(const float* in, float* out, int rows, int cols) {
  const dim3 grid((cols + kTile - 1) / kTile, (rows + kTile - 1) / kTile), block(kTile, 8);
  transpose_tiled<<<grid, block>>>(in, out, rows, cols);
  return cudaGetLastError();
}

int run_votes(const float* x, int blocks, unsigned* ballots, int* any_all, int* block_votes) {
  votes<<<blocks, 128>>>(x, ballots, any_all, block_votes);
  return cudaGetLastError();
}

int run_shuffles(float* out, int blocks) {
  shuffles<<<blocks, 64>>>(out);
  return cudaGetLastError();
}

int run_tile_sums(const float* x, int blocks, float* sums, unsigned* ballots) {
  tile_sums<<<blocks, 96>>>(x, sums, ballots);
  return cudaGetLastError();
}

int run_histogram(const unsigned char* bytes, int n, int* bins) {
  histogram<<<7, 96>>>(bytes, n, bins);
  return cudaGetLastError();
}

int run_warp_reverse(const float* x, float* out, int blocks) {
  warp_reverse<<<blocks, kThreads>>>(x, out);
  return cudaGetLastError();
}

}  // extern "C"
