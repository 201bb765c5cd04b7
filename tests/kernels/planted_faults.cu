// Kernels with a fault planted, for tests/test_cooperation.py: each breaks one of CUDA's rules for
// threads that cooperate, and the emulated device must say so. synccheck (every run) finds the
// barriers and warp collectives that some threads never reach; racecheck (make racecheck's
// ThreadSanitizer) finds the races. Each fault's line is marked, for the test to find.
#include <cuda_runtime.h>

constexpr int kThreads = 256;

// cooperating.cu's block_sum_shared without its first barrier: a thread may read a neighbour's
// slot before the neighbour has written it.
__global__ void racy_block_sum(const float* x, float* sums) {
  __shared__ float partial[kThreads];
  const unsigned t = threadIdx.x;
  partial[t] = x[blockIdx.x * blockDim.x + t];  // FAULT: racy store
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (t < stride) partial[t] += partial[t + stride];  // FAULT: racy load
    __syncthreads();
  }
  if (t == 0) sums[blockIdx.x] = partial[0];
}

// A tiled sum without its second barrier: a thread that has used this step's tile stores the
// next step's while a slower one still reads this one. The inputs are all ones, so the sums come
// out right on the emulated device's schedule: only the race check sees it.
__global__ void racy_tiles(const float* a, float* sums, int k) {
  __shared__ float tile[8][8];
  float sum = 0.0f;
  for (int k0 = 0; k0 < k; k0 += 8) {
    tile[threadIdx.y][threadIdx.x] = a[threadIdx.y * k + k0 + threadIdx.x];  // FAULT: tile store
    __syncthreads();
    for (int j = 0; j < 8; ++j) sum += tile[threadIdx.y][j];  // FAULT: tile load
  }
  sums[threadIdx.y * 8 + threadIdx.x] = sum;
}

// Every thread stores to one element, no atomic: a race on global memory.
__global__ void racy_store(int* out) {
  out[0] = static_cast<int>(threadIdx.x);  // FAULT: global store
}

// Half the block waits at a barrier the other half never reaches.
__global__ void divergent_barrier(float* out) {
  if (threadIdx.x < 16) {
    __syncthreads();  // FAULT: divergent barrier
  }
  out[threadIdx.x] = 1.0f;
}

// Odd and even threads wait at two different barriers.
__global__ void two_barriers(float* out) {
  if (threadIdx.x % 2 == 0) {
    __syncthreads();  // FAULT: even barrier
  } else {
    __syncthreads();  // FAULT: odd barrier
  }
  out[threadIdx.x] = 1.0f;
}

// The upper half of the warp returns; the lower half shuffles with a mask that names it.
__global__ void shuffle_without_lanes(float* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, 1.0f, 1);  // FAULT: missing lanes
}

// 52 KB of __shared__ variables: past CUDA's 48 KB.
__global__ void too_much_shared(float* out) {
  __shared__ float big[13312];  // FAULT: too much shared
  big[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = big[(threadIdx.x + 1) % blockDim.x];
}

extern "C" {

int run_racy_block_sum(const float* x, float* sums, int blocks) {
  racy_block_sum<<<blocks, kThreads>>>(x, sums);
  return cudaGetLastError();
}

int run_racy_tiles(const float* a, float* sums, int k) {
  racy_tiles<<<1, dim3(8, 8)>>>(a, sums, k);
  return cudaGetLastError();
}

int run_racy_store(int* out) {
  racy_store<<<1, 64>>>(out);
  return cudaGetLastError();
}

int run_divergent_barrier(float* out) {
  divergent_barrier<<<2, 32>>>(out);
  return cudaGetLastError();
}

int run_two_barriers(float* out) {
  two_barriers<<<1, 32>>>(out);
  return cudaGetLastError();
}

int run_shuffle_without_lanes(float* out) {
  shuffle_without_lanes<<<1, 32>>>(out);
  return cudaGetLastError();
}

int run_too_much_shared(float* out) {
  too_much_shared<<<1, 64>>>(out);
  return cudaGetLastError();
}

}  // extern "C"
