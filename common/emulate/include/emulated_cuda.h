// emulated_cuda.h: the emulated CUDA device, what a stage's .cu file needs from CUDA, for the
// host compiler.
//
// How a .cu file runs on the CPU (workbook/emulate.py drives it):
//   1. a source pass rewrites each launch `kernel<<<grid, block, shmem, stream>>>(args)` into
//      `::workbook::emulate::launch({"kernel", cooperates}, kernel, grid, block, shmem,
//      stream)(args)`, each `__shared__` declaration into a reference to the block's shared
//      memory, and names the emulated device where the file names CUDA
//      (`TORCH_LIBRARY_IMPL(ns, CUDA, m)`, c10::DeviceType::CUDA); nothing else of the file
//      changes, and its line numbers stay;
//   2. g++ compiles the result with common/emulate/include first on the include path, so the
//      CUDA headers the file includes (c10/cuda/CUDAGuard.h, ATen/cuda/cub.h,
//      cooperative_groups.h, ...) are the small ones beside this header, which include it;
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
// Two ways to run a block's threads, chosen for each kernel by the source pass:
//   * one at a time, each body to its end before the next starts: a kernel whose threads never
//     wait for each other (the fast path);
//   * as fibers that meet (emulated_cuda/block.h): a kernel that uses __syncthreads (and its
//     _count, _and, _or), __syncwarp, __shared__ memory, warp shuffles and votes or cooperative
//     groups, itself or in a function it calls. Each thread runs until it waits, and a barrier
//     or warp collective lets its threads go once all it names have arrived; one that some never
//     reach is an error that names the kernel, the block, the threads and the lines
//     (synccheck), never a hang.
// Under make racecheck (ThreadSanitizer) every kernel runs the second way, on one CPU thread,
// each emulated thread a ThreadSanitizer fiber: a race between two emulated threads, on shared or
// global memory, is reported with both lines.
//
// What it proves: a kernel's arithmetic, indexing, launch configuration, barriers and warp
// collectives, memory safety (under make sanitize, ASan sees every load and store) and races
// between its threads (under make racecheck). What it cannot: speed, the GPU's weak memory
// ordering (a thread here sees every earlier store at once; __threadfence is a fence of the CPU
// and ThreadSanitizer does not model fences), and real concurrency (the threads of a block take
// turns, so code that spins waiting for another thread's store never sees it).
#pragma once

// Both ABIs: a kernel file of stage 10 is compiled with TORCH_TARGET_VERSION, which refuses
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
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
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
  cudaErrorLaunchFailure = 719,
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
// and what the emulation adds to CUDA's words for the error it last set: which limit the launch
// broke, or what synccheck found.
inline thread_local cudaError_t last_error = cudaSuccess;
inline thread_local cudaError_t detailed_error = cudaSuccess;
inline thread_local std::string last_error_detail;

inline void set_error(cudaError_t error, std::string detail) {
  last_error = detailed_error = error;
  last_error_detail = std::move(detail);
}

}  // namespace workbook::emulate

inline const char* cuda_error_words(cudaError_t error) {
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
    case cudaErrorLaunchFailure:
      return "unspecified launch failure";
  }
  return "unknown error";
}

// CUDA's words, and for the error the emulation last set, what it adds to them.
inline const char* cudaGetErrorString(cudaError_t error) {
  using workbook::emulate::last_error_detail;
  if (error != workbook::emulate::detailed_error || last_error_detail.empty()) {
    return cuda_error_words(error);
  }
  static thread_local std::string text;
  text = std::string(cuda_error_words(error)) + " (emulated: " + last_error_detail + ")";
  return text.c_str();
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
#define C10_CUDA_CHECK(EXPR)                                                 \
  do {                                                                       \
    const cudaError_t workbook_emulate_error = (EXPR);                       \
    TORCH_CHECK(workbook_emulate_error == cudaSuccess,                       \
                "CUDA error: ", cudaGetErrorString(workbook_emulate_error)); \
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
// Relaxed, as CUDA's atomics are: they order nothing else (under racecheck an atomic is no
// barrier between the plain loads and stores around it).
template <typename T>
inline T atomicAdd(T* address, T value) {
  if constexpr (std::is_arithmetic_v<T>) {
    return std::atomic_ref<T>(*address).fetch_add(value, std::memory_order_relaxed);
  } else {
    static_assert(sizeof(T) == 2, "atomicAdd: arithmetic types, c10::Half and c10::BFloat16");
    std::atomic_ref<uint16_t> bits(*reinterpret_cast<uint16_t*>(address));
    uint16_t seen = bits.load(std::memory_order_relaxed);
    T old;
    for (;;) {
      std::memcpy(&old, &seen, 2);
      const T sum = static_cast<T>(static_cast<float>(old) + static_cast<float>(value));
      uint16_t wanted;
      std::memcpy(&wanted, &sum, 2);
      if (bits.compare_exchange_weak(seen, wanted, std::memory_order_relaxed)) return old;
    }
  }
}
template <typename T>
inline T atomicExch(T* address, T value) {
  return std::atomic_ref<T>(*address).exchange(value, std::memory_order_relaxed);
}
template <typename T>
inline T atomicCAS(T* address, T compare, T value) {
  std::atomic_ref<T>(*address).compare_exchange_strong(compare, value, std::memory_order_relaxed);
  return compare;  // the old value, whether or not it was swapped
}
template <typename T>
inline T atomicMax(T* address, T value) {
  std::atomic_ref<T> slot(*address);
  T seen = slot.load(std::memory_order_relaxed);
  while (seen < value && !slot.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
  return seen;
}
template <typename T>
inline T atomicMin(T* address, T value) {
  std::atomic_ref<T> slot(*address);
  T seen = slot.load(std::memory_order_relaxed);
  while (value < seen && !slot.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
  return seen;
}

// Fences: the CPU's. (A thread here sees every store at once; ThreadSanitizer does not model a
// fence, so a protocol of flags and fences between blocks is beyond racecheck.)
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// ----------------------------------------------------------------------------------------------
// Threads that cooperate: barriers, warp collectives, shared memory
//
// Each takes its caller's file and line (__builtin_FILE and __builtin_LINE as default arguments
// are the call's), for synccheck's messages. They work in a kernel the source pass saw cooperate,
// which runs its threads as fibers; in any other the first call is recorded, and the launch fails
// saying so (the kernel's threads ran one at a time, so its barriers meant nothing).

#include "emulated_cuda/block.h"

namespace workbook::emulate {

struct Misuse {
  bool set = false;
  const char* construct = "";
  Site site{};
};
// The first such call on this CPU thread since its launch began.
inline thread_local Misuse misuse;

WORKBOOK_EMULATOR_INTERNAL inline Block* cooperating(const char* construct, Site site) {
  const Unseen unseen;
  Block* block = running_block;
  if (block != nullptr && block->cooperates()) return block;
  if (!misuse.set) misuse = Misuse{true, construct, site};
  return nullptr;
}

template <typename T>
inline T shuffle(Op op, unsigned mask, const T& value, int arg, int width, Site site) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= kMaxShuffleBytes,
                "a warp shuffle moves a trivially copyable value of at most 32 bytes");
  T out = value;
  if (Block* block = cooperating(op_name(op), site)) {
    block->collective(op, mask, &value, &out, sizeof(T), arg, width, 0, site);
  }
  return out;
}

inline unsigned vote(Op op, unsigned mask, int predicate, Site site) {
  Block* block = cooperating(op_name(op), site);
  return block != nullptr ? block->collective(op, mask, nullptr, nullptr, 0, 0, 32, predicate, site)
                          : 0u;
}

inline int block_barrier(Op op, int predicate, Site site) {
  Block* block = cooperating(op_name(op), site);
  return block != nullptr ? block->barrier(op, predicate, site) : 0;
}

// What the source pass makes of `__shared__ T name[N];`: `T (&name)[N] = shared_variable<T[N]>(
// [] {});`. The lambda's type is unique to the declaration (and to each instance of a template
// around it), so it keys the variable in the block's shared memory.
template <typename T, typename Declaration>
T& shared_variable(Declaration, const char* file = __builtin_FILE(),
                   unsigned line = __builtin_LINE()) {
  static const char key = 0;
  const Site site{file, line};
  if (Block* block = cooperating("__shared__", site)) {
    return *static_cast<T*>(block->shared_variable(&key, sizeof(T), alignof(T), site));
  }
  // The launch fails anyway; the kernel runs on into memory of its own. (On the heap: the
  // library's thread_local variables must stay small, as a library loaded with dlopen gets
  // little static TLS for the initial-exec model these are compiled with.)
  static thread_local std::unique_ptr<std::max_align_t[]> stand_in;
  if (!stand_in) {
    stand_in.reset(new std::max_align_t[(sizeof(T) + sizeof(std::max_align_t) - 1) /
                                        sizeof(std::max_align_t)]);
  }
  return *reinterpret_cast<T*>(stand_in.get());
}

// What the source pass makes of `extern __shared__ T name[];`: `T* const name =
// dynamic_shared<T>();`, the launch's dynamic shared memory (every such array starts there).
template <typename T>
T* dynamic_shared(const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
  Block* block = cooperating("extern __shared__", Site{file, line});
  return block != nullptr ? static_cast<T*>(block->dynamic_shared()) : nullptr;
}

}  // namespace workbook::emulate

// The parameters that take the caller's file and line, and the Site they make (also for the
// stand-in cooperative_groups.h).
#define WORKBOOK_EMULATE_CALLER \
  const char *file = __builtin_FILE(), unsigned line = __builtin_LINE()
#define WORKBOOK_EMULATE_SITE \
  ::workbook::emulate::Site { file, line }

inline void __syncthreads(WORKBOOK_EMULATE_CALLER) {
  ::workbook::emulate::block_barrier(::workbook::emulate::Op::syncthreads, 1,
                                     WORKBOOK_EMULATE_SITE);
}
inline int __syncthreads_count(int predicate, WORKBOOK_EMULATE_CALLER) {
  return ::workbook::emulate::block_barrier(::workbook::emulate::Op::syncthreads_count, predicate,
                                            WORKBOOK_EMULATE_SITE);
}
inline int __syncthreads_and(int predicate, WORKBOOK_EMULATE_CALLER) {
  return ::workbook::emulate::block_barrier(::workbook::emulate::Op::syncthreads_and, predicate,
                                            WORKBOOK_EMULATE_SITE);
}
inline int __syncthreads_or(int predicate, WORKBOOK_EMULATE_CALLER) {
  return ::workbook::emulate::block_barrier(::workbook::emulate::Op::syncthreads_or, predicate,
                                            WORKBOOK_EMULATE_SITE);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, WORKBOOK_EMULATE_CALLER) {
  ::workbook::emulate::vote(::workbook::emulate::Op::syncwarp, mask, 0, WORKBOOK_EMULATE_SITE);
}

template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize,
                     WORKBOOK_EMULATE_CALLER) {
  return ::workbook::emulate::shuffle(::workbook::emulate::Op::shfl, mask, var, src_lane, width,
                                      WORKBOOK_EMULATE_SITE);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                        WORKBOOK_EMULATE_CALLER) {
  return ::workbook::emulate::shuffle(::workbook::emulate::Op::shfl_up, mask, var,
                                      static_cast<int>(delta), width, WORKBOOK_EMULATE_SITE);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                          WORKBOOK_EMULATE_CALLER) {
  return ::workbook::emulate::shuffle(::workbook::emulate::Op::shfl_down, mask, var,
                                      static_cast<int>(delta), width, WORKBOOK_EMULATE_SITE);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                         WORKBOOK_EMULATE_CALLER) {
  return ::workbook::emulate::shuffle(::workbook::emulate::Op::shfl_xor, mask, var, lane_mask,
                                      width, WORKBOOK_EMULATE_SITE);
}

inline unsigned __ballot_sync(unsigned mask, int predicate, WORKBOOK_EMULATE_CALLER) {
  return ::workbook::emulate::vote(::workbook::emulate::Op::ballot, mask, predicate,
                                   WORKBOOK_EMULATE_SITE);
}
inline int __any_sync(unsigned mask, int predicate, WORKBOOK_EMULATE_CALLER) {
  return static_cast<int>(::workbook::emulate::vote(::workbook::emulate::Op::any, mask, predicate,
                                                    WORKBOOK_EMULATE_SITE));
}
inline int __all_sync(unsigned mask, int predicate, WORKBOOK_EMULATE_CALLER) {
  return static_cast<int>(::workbook::emulate::vote(::workbook::emulate::Op::all, mask, predicate,
                                                    WORKBOOK_EMULATE_SITE));
}
// The lanes of the caller's warp that have not returned (the emulation has no notion of lanes
// that diverged and run apart: every lane not yet returned counts as active).
inline unsigned __activemask(WORKBOOK_EMULATE_CALLER) {
  auto* block = ::workbook::emulate::cooperating("__activemask", WORKBOOK_EMULATE_SITE);
  return block != nullptr ? block->active_mask() : 0u;
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
// WORKBOOK_EMULATE_SEED, 0 by default; each launch draws a new order, of its blocks and of the
// threads within each), in-order (one CPU thread), or, unset, runs of blocks on torch's intra-op
// threads. Under racecheck, one CPU thread always (ThreadSanitizer cannot see how torch's
// uninstrumented thread pool hands work over).
class RunOrder {
 public:
  RunOrder() {
    const char* order = std::getenv("WORKBOOK_EMULATE_ORDER");
    shuffled_ = order != nullptr && std::string(order) == "shuffle";
#if defined(__SANITIZE_THREAD__)
    parallel_ = false;
#else
    parallel_ = order == nullptr || *order == '\0';
#endif
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
  std::mt19937_64* generator() { return shuffled_ ? &rng_ : nullptr; }

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

// Whether every kernel runs its threads as fibers: under racecheck each is a ThreadSanitizer
// identity of its own, cooperating or not.
#if defined(__SANITIZE_THREAD__)
inline constexpr bool kEveryThreadAFiber = true;
#else
inline constexpr bool kEveryThreadAFiber = false;
#endif

// The first thing a launch found wrong, from whichever CPU thread found it.
class LaunchFailure {
 public:
  bool found() const { return found_.load(std::memory_order_relaxed); }
  void record(std::string what) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (found_.load(std::memory_order_relaxed)) return;
    what_ = std::move(what);
    found_.store(true, std::memory_order_relaxed);
  }
  // An exception a kernel threw: the launch throws it again, as a loop over the threads would.
  void record(std::exception_ptr thrown) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (found_.load(std::memory_order_relaxed)) return;
    thrown_ = std::move(thrown);
    found_.store(true, std::memory_order_relaxed);
  }
  const std::string& what() const { return what_; }
  const std::exception_ptr& thrown() const { return thrown_; }

 private:
  std::atomic<bool> found_{false};
  std::mutex mutex_;
  std::string what_;
  std::exception_ptr thrown_;
};

inline std::string misuse_text(const Kernel& kernel, const Misuse& m) {
  return "synccheck: kernel `" + std::string(kernel.name) + "` calls `" + m.construct + "` (" +
         site_text(m.site) +
         "), but the emulator's source pass did not see it cooperate, so its threads ran one at "
         "a time and the call meant nothing. The pass (workbook/build/emulate.py) looks for such "
         "constructs in the kernel's definition and in the functions it calls by name, in the "
         "files it rewrites (the stage's .cu and .cuh files); launch the kernel by its own name";
}

template <typename F>
void call_body(const void* f) {
  (*static_cast<const F*>(f))();
}

// Every block of the grid, every thread of each: one at a time, or as fibers (the module comment).
inline void run_grid(const Kernel& kernel, dim3 grid, dim3 block, std::size_t shared_memory,
                     Body body) {
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  const bool fibers = kernel.cooperates || kEveryThreadAFiber;
  RunOrder order;
  LaunchFailure failure;
  // The built-in variables of the CPU thread that runs blocks: written by the emulator, which
  // ThreadSanitizer does not see (only the kernel's threads read them).
  auto set_grid = [&]() WORKBOOK_EMULATOR_INTERNAL {
    const Unseen unseen;
    gridDim = grid;
    blockDim = block;
    misuse = Misuse{};
  };
  auto set_block = [&](uint64_t b) WORKBOOK_EMULATOR_INTERNAL {
    const Unseen unseen;
    blockIdx = unflatten(b, grid);
  };
  // One block, on the calling CPU thread, whose gridDim, blockDim and blockIdx are set.
  auto run_block = [&](uint64_t b) {
    set_block(b);
    if (fibers) {
      static thread_local std::unique_ptr<Block> runner;  // (a small thread_local: see above)
      if (!runner) runner = std::make_unique<Block>();
      std::string problem = runner->run(kernel, blockIdx, grid, block, shared_memory, body,
                                        b * threads, order.generator());
      if (std::exception_ptr thrown = runner->take_exception()) {
        failure.record(std::move(thrown));
      } else if (!problem.empty()) {
        failure.record(std::move(problem));
      }
    } else if (order.shuffled()) {
      for (uint64_t t : order.of(threads)) {
        threadIdx = unflatten(t, block);
        body.call(body.self);
      }
    } else {
      for (unsigned int tz = 0; tz < block.z; ++tz)
        for (unsigned int ty = 0; ty < block.y; ++ty)
          for (unsigned int tx = 0; tx < block.x; ++tx) {
            threadIdx = {tx, ty, tz};
            body.call(body.self);
          }
    }
    if (misuse.set) failure.record(misuse_text(kernel, misuse));
  };
  auto run_blocks = [&](int64_t begin, int64_t end) {
    set_grid();
    for (int64_t b = begin; b < end && !failure.found(); ++b) run_block(static_cast<uint64_t>(b));
  };
  if (order.shuffled()) {
    set_grid();
    for (uint64_t b : order.of(blocks)) {
      if (failure.found()) break;
      run_block(b);
    }
  } else if (order.parallel()) {
    // A run of blocks worth some 16k kernel-body calls: smaller grids stay on one thread.
    const auto grain = static_cast<int64_t>(std::max<uint64_t>(1, 16384 / threads));
#ifdef TORCH_TARGET_VERSION
    torch::stable::parallel_for(0, static_cast<int64_t>(blocks), grain, run_blocks);
#else
    at::parallel_for(0, static_cast<int64_t>(blocks), grain, run_blocks);
#endif
  } else {
    run_blocks(0, static_cast<int64_t>(blocks));
  }
  acquire(&launch_end_object);
  if (failure.thrown()) std::rethrow_exception(failure.thrown());
  if (failure.found()) {
    // Said at once, too: a launch whose error nobody asks for must not pass in silence.
    std::fprintf(stderr, "[emulate] %s\n", failure.what().c_str());
    set_error(cudaErrorLaunchFailure, failure.what());
  }
}

template <typename... Params>
class Launch {
 public:
  Launch(Kernel kernel, void (*function)(Params...), dim3 grid, dim3 block,
         std::size_t shared_memory)
      : kernel_(kernel),
        function_(function),
        grid_(grid),
        block_(block),
        shared_memory_(shared_memory),
        valid_(launch_is_valid(grid, block, shared_memory)) {}

  // The kernel's own parameter types: the arguments convert as in a real launch.
  void operator()(Params... args) const {
    if (!valid_) return;  // the error waits for cudaGetLastError()
    auto body = [&] { function_(args...); };
    run_grid(kernel_, grid_, block_, shared_memory_, Body{&call_body<decltype(body)>, &body});
  }

 private:
  Kernel kernel_;
  void (*function_)(Params...);
  dim3 grid_, block_;
  std::size_t shared_memory_;
  bool valid_;
};

// What `kernel<<<grid, block, shared_memory, stream>>>` becomes, with what the source pass knows
// of the kernel. The stream is the current one (c10::cuda::getCurrentCUDAStream() here); the
// emulated device runs every launch to its end before returning, as if each were followed by a
// synchronize.
template <typename... Params>
Launch<Params...> launch(Kernel kernel, void (*function)(Params...), dim3 grid, dim3 block,
                         std::size_t shared_memory = 0, cudaStream_t /*stream*/ = nullptr) {
  return Launch<Params...>(kernel, function, grid, block, shared_memory);
}

}  // namespace workbook::emulate
