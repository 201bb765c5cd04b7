// workbook/host_device.h: what code compiled for both the CPU and a CUDA device needs.
//
// WORKBOOK_HOST_DEVICE marks a function for both compilers: nvcc compiles it as __host__
// __device__ (callable from CPU code and from kernels), the host compiler sees a plain inline
// function. A kernel file and a CPU file that include the same header then run one definition
// of the arithmetic, so the CPU test suite tests what the GPU computes.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define WORKBOOK_HOST_DEVICE __host__ __device__
#else
#define WORKBOOK_HOST_DEVICE
#endif

namespace workbook {

// ceil(a / b) for positive integers: the number of blocks of size b that cover a elements.
template <typename T>
WORKBOOK_HOST_DEVICE constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

}  // namespace workbook
