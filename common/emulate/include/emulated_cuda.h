// emulated_cuda.h: the emulated CUDA device, what a stage's .cu file needs from CUDA, for the
// host compiler.
//
// How a .cu file runs on the CPU (workbook/emulate.py drives it):
//   1. a source pass rewrites each launch `kernel<<<grid, block, shmem, stream>>>(args)` into
//      `::workbook::emulate::launch(kernel, grid, block, shmem, stream)(args)`, and names the
//      emulated device where the file names CUDA (`TORCH_LIBRARY_IMPL(ns, CUDA, m)`,
//      c10::DeviceType::CUDA); nothing else of the file changes, and its line numbers stay;
//   2. g++ compiles the result with common/emulate/include first on the include path, so the
//      CUDA headers the file includes (c10/cuda/CUDAGuard.h, ATen/cuda/cub.h, ...) are the small
//      ones beside this header, which include this header;
//   3. the library is loaded beside the stage's own, with common/emulate/runtime's device: a
//      PyTorch device, `emulated_cuda` (PrivateUse1), whose memory is host memory.
//
// What a launch does here: it refuses what CUDA refuses (a block past 1024 threads, grid y or z
// past 65535, x past 2^31 - 1, a zero dimension, dynamic shared memory past the H200's 227 KB),
// with CUDA's error, reported by the next cudaGetLastError() as on a GPU; otherwise every block
// of the grid and every thread of each block runs the kernel body once, with its own blockIdx,
// threadIdx, blockDim and gridDim. By default the blocks are shared out among torch's intra-op
// threads (at::parallel_for), as a GPU runs blocks at the same time: each CPU thread takes a run
// of consecutive blocks and runs them, and their threads, in order. With
// WORKBOOK_EMULATE_ORDER=in-order one CPU thread runs every block in order (the same order on
// every run); with WORKBOOK_EMULATE_ORDER=shuffle, one CPU thread in an order shuffled from
// WORKBOOK_EMULATE_SEED (a kernel whose result depends on who runs first then shows it).
//
// What it cannot emulate, and so refuses when the source pass sees it (naming the construct):
// __syncthreads and __shared__ memory, warp shuffles and votes, cooperative groups. A kernel
// body runs to its end before the next thread starts, so threads that wait for each other could
// never meet. It proves a kernel's arithmetic, indexing, launch configuration and memory safety
// (under make sanitize, ASan sees every load and store); it says nothing of speed, the memory
// model or real concurrency.
#pragma once

// Both ABIs: a kernel file of stage 08 is compiled with TORCH_TARGET_VERSION, which refuses
// every header of c10 and ATen; there the blocks are shared out by torch::stable::parallel_for
// (libtorch's own at::parallel_for, through a C shim).
#ifdef TORCH_TARGET_VERSION
#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>
#else
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#define WORKBOOK_EMULATED_CUDA 1
// The device's name (workbook.build.emulate.DEVICE), for code that cannot ask c10 for the name of
// the PrivateUse1 backend: workbook/checks.h on the stable ABI.
#define WORKBOOK_EMULATED_DEVICE_NAME "emulated_cuda"

// The execution-space and optimisation keywords mean nothing to the host compiler. (`__restrict__`
// is g++'s own keyword already; `#pragma unroll` is an unknown pragma, ignored.)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)

// ----------------------------------------------------------------------------------------------
// Built-in variables and types

struct uint3 {
  unsigned int x, y, z;
};

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
};

// Each CPU thread that runs kernel bodies has its own: the launch sets them before each call.
inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim{1, 1, 1};
inline thread_local dim3 gridDim{1, 1, 1};
constexpr int warpSize = 32;

// ATen defines the accessors' restrict-qualified pointer traits for nvcc alone.
namespace at {
template <typename T>
struct RestrictPtrTraits {
  typedef T* __restrict__ PtrType;
};
}  // namespace at

// ----------------------------------------------------------------------------------------------
// Errors, as the CUDA runtime reports them (the codes are CUDA's)

enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorLaunchOutOfResources = 701,
};

enum cudaDeviceAttr : int {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxBlockDimX = 2,
  cudaDevAttrMaxBlockDimY = 3,
  cudaDevAttrMaxBlockDimZ = 4,
  cudaDevAttrMaxGridDimX = 5,
  cudaDevAttrMaxGridDimY = 6,
  cudaDevAttrMaxGridDimZ = 7,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace workbook::emulate {

// The device the emulation stands for: an H200 (compute capability 9.0), as the GPU check's.
struct DeviceLimits {
  static constexpr unsigned int max_threads_per_block = 1024;
  static constexpr unsigned int max_block[3] = {1024, 1024, 64};
  static constexpr unsigned int max_grid[3] = {2147483647u, 65535, 65535};
  static constexpr std::size_t max_dynamic_shared_memory = 232448;  // 227 KB, opted in
  static constexpr int multiprocessors = 132;
};

// The error the next cudaGetLastError() returns (sticky until read, per host thread, as CUDA's),
// and what the emulation adds to CUDA's words: which limit the launch broke.
inline thread_local cudaError_t last_error = cudaSuccess;
inline thread_local std::string last_error_detail;

inline void set_error(cudaError_t error, std::string detail) {
  last_error = error;
  last_error_detail = std::move(detail);
}

}  // namespace workbook::emulate

inline const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorLaunchOutOfResources:
      return "too many resources requested for launch";
  }
  return "unknown error";
}

inline cudaError_t cudaPeekAtLastError() { return workbook::emulate::last_error; }

inline cudaError_t cudaGetLastError() {
  const cudaError_t error = workbook::emulate::last_error;
  workbook::emulate::last_error = cudaSuccess;
  return error;
}

// One device, number 0, always current.
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
  using L = workbook::emulate::DeviceLimits;
  if (device != 0) return cudaErrorInvalidDevice;
  switch (attribute) {
    case cudaDevAttrMaxThreadsPerBlock:
      *value = L::max_threads_per_block;
      break;
    case cudaDevAttrMaxBlockDimX:
      *value = L::max_block[0];
      break;
    case cudaDevAttrMaxBlockDimY:
      *value = L::max_block[1];
      break;
    case cudaDevAttrMaxBlockDimZ:
      *value = L::max_block[2];
      break;
    case cudaDevAttrMaxGridDimX:
      *value = static_cast<int>(L::max_grid[0]);
      break;
    case cudaDevAttrMaxGridDimY:
      *value = L::max_grid[1];
      break;
    case cudaDevAttrMaxGridDimZ:
      *value = L::max_grid[2];
      break;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *value = 49152;
      break;
    case cudaDevAttrWarpSize:
      *value = warpSize;
      break;
    case cudaDevAttrMultiProcessorCount:
      *value = L::multiprocessors;
      break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = static_cast<int>(L::max_dynamic_shared_memory);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

// c10's checks, with CUDA's words and the emulation's detail after them.
#define C10_CUDA_CHECK(EXPR)                                                          \
  do {                                                                                \
    const cudaError_t workbook_emulate_error = (EXPR);                                \
    TORCH_CHECK(workbook_emulate_error == cudaSuccess,                                \
                "CUDA error: ", cudaGetErrorString(workbook_emulate_error),           \
                ::workbook::emulate::last_error_detail.empty() ? "" : " (emulated: ", \
                ::workbook::emulate::last_error_detail,                               \
                ::workbook::emulate::last_error_detail.empty() ? "" : ")");           \
  } while (0)
#define C10_CUDA_KERNEL_LAUNCH_CHECK() C10_CUDA_CHECK(cudaGetLastError())

// ----------------------------------------------------------------------------------------------
// Device functions the kernels use

template <typename T>
inline T __ldg(const T* address) {
  return *address;  // the read-only cache path: a plain load here
}

// CUDA's min and max: overloads for each arithmetic type in the global namespace, as CUDA's
// headers declare them (non-templates, so a std::min found by a using-declaration still wins
// where ATen's headers call it).
#define WORKBOOK_EMULATE_MIN_MAX(T)                \
  inline T min(T a, T b) { return b < a ? b : a; } \
  inline T max(T a, T b) { return a < b ? b : a; }
WORKBOOK_EMULATE_MIN_MAX(int)
WORKBOOK_EMULATE_MIN_MAX(unsigned int)
WORKBOOK_EMULATE_MIN_MAX(long)
WORKBOOK_EMULATE_MIN_MAX(unsigned long)
WORKBOOK_EMULATE_MIN_MAX(long long)
WORKBOOK_EMULATE_MIN_MAX(unsigned long long)
WORKBOOK_EMULATE_MIN_MAX(float)
WORKBOOK_EMULATE_MIN_MAX(double)
#undef WORKBOOK_EMULATE_MIN_MAX

// Atomics return the old value, as CUDA's do. Blocks may run on several host threads, so they
// are real atomics (std::atomic_ref); 16-bit floats add through a compare-and-swap on their bits.
template <typename T>
inline T atomicAdd(T* address, T value) {
  if constexpr (std::is_arithmetic_v<T>) {
    return std::atomic_ref<T>(*address).fetch_add(value);
  } else {
    static_assert(sizeof(T) == 2, "atomicAdd: arithmetic types, c10::Half and c10::BFloat16");
    std::atomic_ref<uint16_t> bits(*reinterpret_cast<uint16_t*>(address));
    uint16_t seen = bits.load();
    T old;
    for (;;) {
      std::memcpy(&old, &seen, 2);
      const T sum = static_cast<T>(static_cast<float>(old) + static_cast<float>(value));
      uint16_t wanted;
      std::memcpy(&wanted, &sum, 2);
      if (bits.compare_exchange_weak(seen, wanted)) return old;
    }
  }
}
template <typename T>
inline T atomicExch(T* address, T value) {
  return std::atomic_ref<T>(*address).exchange(value);
}
template <typename T>
inline T atomicCAS(T* address, T compare, T value) {
  std::atomic_ref<T>(*address).compare_exchange_strong(compare, value);
  return compare;  // the old value, whether or not it was swapped
}
template <typename T>
inline T atomicMax(T* address, T value) {
  std::atomic_ref<T> slot(*address);
  T seen = slot.load();
  while (seen < value && !slot.compare_exchange_weak(seen, value)) {
  }
  return seen;
}
template <typename T>
inline T atomicMin(T* address, T value) {
  std::atomic_ref<T> slot(*address);
  T seen = slot.load();
  while (value < seen && !slot.compare_exchange_weak(seen, value)) {
  }
  return seen;
}

// ----------------------------------------------------------------------------------------------
// Launching a kernel

namespace workbook::emulate {

// Why CUDA would refuse this launch, setting the error it would report; true when it is fine.
inline bool launch_is_valid(dim3 grid, dim3 block, std::size_t shared_memory) {
  using L = DeviceLimits;
  const unsigned int g[3] = {grid.x, grid.y, grid.z}, b[3] = {block.x, block.y, block.z};
  const char* axis[3] = {"x", "y", "z"};
  for (int i = 0; i < 3; ++i) {
    if (g[i] == 0 || b[i] == 0) {
      set_error(cudaErrorInvalidConfiguration,
                std::string(g[i] == 0 ? "grid" : "block") + "." + axis[i] + " is 0");
      return false;
    }
    if (g[i] > L::max_grid[i]) {
      set_error(cudaErrorInvalidConfiguration,
                "grid." + std::string(axis[i]) + " = " + std::to_string(g[i]) +
                    " is past CUDA's limit of " + std::to_string(L::max_grid[i]));
      return false;
    }
    if (b[i] > L::max_block[i]) {
      set_error(cudaErrorInvalidConfiguration,
                "block." + std::string(axis[i]) + " = " + std::to_string(b[i]) +
                    " is past CUDA's limit of " + std::to_string(L::max_block[i]));
      return false;
    }
  }
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads > L::max_threads_per_block) {
    set_error(cudaErrorInvalidConfiguration,
              "a block of " + std::to_string(block.x) + " x " + std::to_string(block.y) + " x " +
                  std::to_string(block.z) + " = " + std::to_string(threads) +
                  " threads is past CUDA's limit of 1024");
    return false;
  }
  if (shared_memory > L::max_dynamic_shared_memory) {
    set_error(cudaErrorInvalidValue, std::to_string(shared_memory) +
                                         " bytes of dynamic shared memory are past the H200's " +
                                         std::to_string(L::max_dynamic_shared_memory));
    return false;
  }
  return true;
}

// The order blocks and threads run in: WORKBOOK_EMULATE_ORDER=shuffle (seeded by
// WORKBOOK_EMULATE_SEED, 0 by default; each launch draws a new order), in-order (one CPU
// thread), or, unset, runs of blocks on torch's intra-op threads.
class RunOrder {
 public:
  RunOrder() {
    const char* order = std::getenv("WORKBOOK_EMULATE_ORDER");
    shuffled_ = order != nullptr && std::string(order) == "shuffle";
    parallel_ = order == nullptr || *order == '\0';
    if (shuffled_) {
      const char* seed = std::getenv("WORKBOOK_EMULATE_SEED");
      static std::atomic<uint64_t> launches{0};
      rng_.seed((seed ? std::strtoull(seed, nullptr, 10) : 0) * 1000003u + launches++);
    }
  }
  // 0 .. n-1, in the order they run.
  std::vector<uint64_t> of(uint64_t n) {
    std::vector<uint64_t> items(n);
    std::iota(items.begin(), items.end(), uint64_t{0});
    if (shuffled_) std::shuffle(items.begin(), items.end(), rng_);
    return items;
  }
  bool shuffled() const { return shuffled_; }
  bool parallel() const { return parallel_; }

 private:
  bool shuffled_ = false;
  bool parallel_ = false;
  std::mt19937_64 rng_;
};

inline uint3 unflatten(uint64_t i, dim3 extent) {
  return {static_cast<unsigned int>(i % extent.x),
          static_cast<unsigned int>(i / extent.x % extent.y),
          static_cast<unsigned int>(i / (uint64_t{extent.x} * extent.y))};
}

template <typename... Params>
class Launch {
 public:
  Launch(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_memory)
      : kernel_(kernel),
        grid_(grid),
        block_(block),
        valid_(launch_is_valid(grid, block, shared_memory)) {}

  // The kernel's own parameter types: the arguments convert as in a real launch.
  void operator()(Params... args) const {
    if (!valid_) return;  // the error waits for cudaGetLastError()
    const uint64_t blocks = uint64_t{grid_.x} * grid_.y * grid_.z;
    const uint64_t threads = uint64_t{block_.x} * block_.y * block_.z;
    RunOrder order;
    if (!order.shuffled()) {
      // Blocks [begin, end) in order, on the calling CPU thread, whose gridDim and blockDim
      // (thread_local, like the indices) are set first.
      auto run_blocks = [&](int64_t begin, int64_t end) {
        gridDim = grid_;
        blockDim = block_;
        for (int64_t b = begin; b < end; ++b) {
          blockIdx = unflatten(static_cast<uint64_t>(b), grid_);
          for (unsigned int tz = 0; tz < block_.z; ++tz)
            for (unsigned int ty = 0; ty < block_.y; ++ty)
              for (unsigned int tx = 0; tx < block_.x; ++tx) {
                threadIdx = {tx, ty, tz};
                kernel_(args...);
              }
        }
      };
      const auto count = static_cast<int64_t>(blocks);
      if (order.parallel()) {
        // A run of blocks worth some 16k kernel-body calls: smaller grids stay on one thread.
        const auto grain = static_cast<int64_t>(std::max<uint64_t>(1, 16384 / threads));
#ifdef TORCH_TARGET_VERSION
        torch::stable::parallel_for(0, count, grain, run_blocks);
#else
        at::parallel_for(0, count, grain, run_blocks);
#endif
      } else {
        run_blocks(0, count);
      }
      return;
    }
    gridDim = grid_;
    blockDim = block_;
    for (uint64_t b : order.of(blocks)) {
      blockIdx = unflatten(b, grid_);
      for (uint64_t t : order.of(threads)) {
        threadIdx = unflatten(t, block_);
        kernel_(args...);
      }
    }
  }

 private:
  void (*kernel_)(Params...);
  dim3 grid_, block_;
  bool valid_;
};

// What `kernel<<<grid, block, shared_memory, stream>>>` becomes. The stream is the current one
// (c10::cuda::getCurrentCUDAStream() here); the emulated device runs every launch to its end
// before returning, as if each were followed by a synchronize.
template <typename... Params>
Launch<Params...> launch(void (*kernel)(Params...), dim3 grid, dim3 block,
                         std::size_t shared_memory = 0, cudaStream_t /*stream*/ = nullptr) {
  return Launch<Params...>(kernel, grid, block, shared_memory);
}

}  // namespace workbook::emulate
