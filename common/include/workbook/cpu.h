// workbook/cpu.h: what a CPU kernel needs from torch, on either ABI: a parallel loop, the type a
// dtype computes in, and (on ATen's side only) SIMD vectors.
//
// The kernels of stage 05 (the LLTM) are written once, over raw pointers, and compiled into two
// libraries: the ATen ones (stages 05 to 07, which link libtorch's C++ API) and the stable-ABI
// one (stage 10, compiled with TORCH_TARGET_VERSION, which may include only torch/csrc/stable
// and torch/headeronly: c10's and ATen's headers refuse to compile there). This header is where
// the two differ, so the kernels need not:
//
//   workbook::cpu::parallel_for   at::parallel_for, or torch::stable::parallel_for (a C shim
//                                 since torch 2.10 that runs libtorch's own at::parallel_for:
//                                 the same threads, the same grain rule)
//   workbook::cpu::opmath_t<T>    the type T computes in: float for float16 and bfloat16, as
//                                 at::opmath_type says (c10::Half and c10::BFloat16 are
//                                 header-only types, the same on both sides)
//   workbook::cpu::kVectorized    whether workbook::cpu::Vec<T> is at::vec::Vectorized<T>.
//                                 at::vec is c10 headers (and SLEEF for exp and tanh, symbols of
//                                 libtorch_cpu), so on the stable ABI there is no Vec: kernels
//                                 run their scalar loop instead, marked WORKBOOK_SIMD_LOOP.
//   WORKBOOK_SIMD_LOOP            on the stable ABI, `#pragma omp simd` (with -fopenmp-simd):
//                                 the compiler vectorises the scalar loop, exp and tanh included,
//                                 calling glibc's vector math library (libmvec: expf 4 lanes at
//                                 a time with SSE, as _ZGVbN4v_expf) for the functions declared
//                                 below as having vector versions. What is left against at::vec
//                                 (16 lanes with AVX-512) is measured in stage 10's README. On
//                                 ATen's side the scalar loop is a tail, and the macro is empty.
//   WORKBOOK_SIMD_SUM(a, b)       the same for a loop that sums into a and b: `#pragma omp simd
//                                 reduction(+ : a, b)`, which lets the compiler keep one partial
//                                 sum per lane and add the lanes at the end, an order fixed at
//                                 compile time (the deformable convolution's offset gradient).
//   WORKBOOK_CPU_CLONES           on the stable ABI (gcc, x86-64 Linux), a function compiled
//                                 three times, for AVX-512 (x86-64-v4), AVX2 with FMA (v3) and
//                                 the SSE2 baseline, the one to run picked once, when the library
//                                 loads, from the CPU it finds (gcc's target_clones: an ifunc).
//                                 So one wheel runs on any x86-64 and still uses the vectors the
//                                 ATen build gets from its build machine, where the machine has
//                                 them: in the deformable convolution's task loops, and in the
//                                 LLTM's row loop (inlined into the clone, exp and tanh included:
//                                 glibc has AVX2 and AVX-512 versions of both). On ATen's side,
//                                 empty: the build is for the build machine's CPU already.
#pragma once

#include <cstdint>
#include <type_traits>

#ifdef TORCH_TARGET_VERSION
#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cmath>

// glibc's math functions that have vector versions in libmvec (exp since glibc 2.22, tanh since
// 2.35), declared so: <math.h> declares them so only under -ffast-math, which would also let the
// compiler drop NaN and inf handling. The library links libmvec (stage 10's setup.py).
extern "C" {
__attribute__((simd("notinbranch"))) float expf(float) noexcept;
__attribute__((simd("notinbranch"))) double exp(double) noexcept;
__attribute__((simd("notinbranch"))) float tanhf(float) noexcept;
__attribute__((simd("notinbranch"))) double tanh(double) noexcept;
}
#define WORKBOOK_SIMD_LOOP _Pragma("omp simd")
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define WORKBOOK_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define WORKBOOK_CPU_CLONES
#endif
#define WORKBOOK_SIMD_SUM(...) WORKBOOK_PRAGMA_(omp simd reduction(+ : __VA_ARGS__))
#define WORKBOOK_PRAGMA_(...) _Pragma(#__VA_ARGS__)
#else
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#define WORKBOOK_SIMD_LOOP
#define WORKBOOK_SIMD_SUM(...)
#define WORKBOOK_CPU_CLONES
#endif

namespace workbook::cpu {

// f(begin, end) over pieces of [begin, end), on torch's intra-op threads; run inline when the
// range is below `grain` elements.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
#ifdef TORCH_TARGET_VERSION
  torch::stable::parallel_for(begin, end, grain, f);
#else
  at::parallel_for(begin, end, grain, f);
#endif
}

#ifdef TORCH_TARGET_VERSION
template <typename T>
using opmath_t =
    std::conditional_t<std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>, float, T>;

inline constexpr bool kVectorized = false;
template <typename T>
struct Vec;  // none: see above
#else
template <typename T>
using opmath_t = at::opmath_type<T>;

inline constexpr bool kVectorized = true;
template <typename T>
using Vec = at::vec::Vectorized<T>;
#endif

}  // namespace workbook::cpu
