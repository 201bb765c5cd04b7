// What cooperation costs on the emulated device: `python -m workbook.build.emulate fibers` builds
// this file once for each fiber mechanism and prints what it measures.
//
//   barrier_ns(threads, barriers)   one block of `threads` threads that meet at `barriers`
//                                   barriers: the time per thread and barrier, which is one
//                                   switch out of the thread's fiber and one back in, with the
//                                   scheduler's bookkeeping between
//   sum_threads_per_s(n)            a block reduction in shared memory over n floats (256
//                                   threads a block, 8 barriers each): emulated threads a second
//   copy_threads_per_s(n)           a copy of n floats, whose threads never wait (the fast path,
//                                   one body after another): emulated threads a second
#include <cuda_runtime.h>

#include <chrono>
#include <vector>

__global__ void barriers_kernel(int barriers, int* out) {
  int v = static_cast<int>(threadIdx.x);
  for (int b = 0; b < barriers; ++b) __syncthreads();
  if (v < 0) out[0] = v;  // keeps the loop
}

__global__ void sum_kernel(const float* x, float* sums) {
  __shared__ float partial[256];
  const unsigned t = threadIdx.x;
  partial[t] = x[blockIdx.x * 256 + t];
  __syncthreads();
  for (unsigned stride = 128; stride > 0; stride /= 2) {
    if (t < stride) partial[t] += partial[t + stride];
    __syncthreads();
  }
  if (t == 0) sums[blockIdx.x] = partial[0];
}

__global__ void copy_kernel(const float* x, float* y) {
  const unsigned i = blockIdx.x * 256 + threadIdx.x;
  y[i] = x[i];
}

namespace {
template <typename Launch>
double seconds(Launch launch) {
  launch();  // warm: stacks and shared memory allocated
  const auto start = std::chrono::steady_clock::now();
  launch();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
}  // namespace

extern "C" {

double barrier_ns(int threads, int barriers) {
  int out = 0;
  const double s = seconds([&] { barriers_kernel<<<1, threads>>>(barriers, &out); });
  return s * 1e9 / (static_cast<double>(threads) * barriers);
}

double sum_threads_per_s(int n) {
  std::vector<float> x(n, 1.0f), sums(n / 256);
  const double s = seconds([&] { sum_kernel<<<n / 256, 256>>>(x.data(), sums.data()); });
  return n / s;
}

double copy_threads_per_s(int n) {
  std::vector<float> x(n, 1.0f), y(n);
  const double s = seconds([&] { copy_kernel<<<n / 256, 256>>>(x.data(), y.data()); });
  return n / s;
}

}  // extern "C"
