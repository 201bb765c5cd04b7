// Stage 05: the LLTM's fused CPU kernels, over raw pointers: one pass over the gates each way.
//
// Two kinds of library compile them: the ATen ones (lltm_cpu.cpp here, which stages 06 and 07
// compile into extops too) and stage 10's, on the stable ABI (its csrc/lltm/cpu/lltm_cpu.cpp).
// So this file includes nothing of ATen's: the parallel loop, the compute type and the SIMD
// vectors come from workbook/cpu.h, which picks them for the ABI being compiled. What differs
// between the two libraries is the glue around these kernels (tensors, dtype dispatch,
// registration): `make diff 10` shows it.
//
// The math (sigmoid, elu and their derivatives) is in workbook/lltm_math.h, shared with the GPU.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "workbook/cpu.h"
#include "workbook/lltm_math.h"

namespace lltm_kernels {

// ----------------------------------------------------------------------------------------------
// Kernels
//
// Every tensor is contiguous (the ops below make sure), so element (b, s) of a B x S tensor is at
// b * S + s, and its three gates at b * 3S + s, + S, + 2S. Half and bfloat16 compute in opmath_t
// (float), as on the GPU.

// An element costs a few exp and a tanh, a few ns with SIMD: below ~8k elements (tens of us) a
// second thread is not worth waking (at::parallel_for then runs the loop inline).
constexpr int64_t kGrainElements = 8192;

// Calls fn(b, s_begin, s_end) on the row pieces of the flat elements [begin, end). Built on the
// stable ABI it is compiled for AVX2 as well as the baseline, picked when the library loads
// (WORKBOOK_CPU_CLONES, workbook/cpu.h), and fn, inlined here, with it: the kernels' loops
// below then run 8 floats a step, exp and tanh included (glibc's AVX2 versions), where the CPU
// has AVX2.
template <typename Fn>
WORKBOOK_CPU_CLONES void for_row_pieces(int64_t begin, int64_t end, int64_t state, const Fn& fn) {
  while (begin < end) {
    const int64_t b = begin / state, s = begin % state;
    const int64_t s_end = std::min(state, s + (end - begin));
    fn(b, s, s_end);
    begin += s_end - s;
  }
}

// Calls fn(b, s_begin, s_end) on row pieces that together cover the B x S elements once, split
// across at::parallel_for's threads in flat chunks: a single long row (batch 1) is shared out as
// well as many short ones.
template <typename Fn>
void parallel_over_rows(int64_t batch, int64_t state, const Fn& fn) {
  workbook::cpu::parallel_for(0, batch * state, kGrainElements, [&](int64_t begin, int64_t end) {
    for_row_pieces(begin, end, state, fn);
  });
}

// SIMD versions of workbook/lltm_math.h, on at::vec::Vectorized<T>: 16 floats or 8 doubles at a
// time with AVX-512 (8 and 4 with AVX2), exp and tanh from SLEEF as in ATen's own kernels.
// build.cpu_simd_flags() selects the instruction set ATen runs on the build machine; where it
// finds none, Vectorized is a plain loop and this still works. (Built for the stable ABI there
// is no at::vec, and the compiler vectorises the loop below instead: workbook/cpu.h.)
template <typename T>
using Vec = workbook::cpu::Vec<T>;

template <typename T>
Vec<T> sigmoid(const Vec<T>& z) {
  return Vec<T>(1) / (Vec<T>(1) + z.neg().exp());
}

template <typename T>
Vec<T> d_sigmoid(const Vec<T>& z) {
  const Vec<T> s = sigmoid(z);
  return (Vec<T>(1) - s) * s;
}

template <typename T>
Vec<T> d_tanh(const Vec<T>& z) {
  const Vec<T> t = z.tanh();
  return Vec<T>(1) - t * t;
}

template <typename T>
Vec<T> elu(const Vec<T>& z) {  // blendv(a, b, mask): b where mask is set, else a
  return Vec<T>::blendv(z.exp() - Vec<T>(1), z, z > Vec<T>(0));
}

template <typename T>
Vec<T> d_elu(const Vec<T>& z) {
  return Vec<T>::blendv(z.exp(), Vec<T>(1), z > Vec<T>(0));
}

// float and double compute in their own type and take the SIMD path; half and bfloat16 compute
// in float, one element at a time (the scalar loop also does the SIMD path's tail).
template <typename scalar_t>
constexpr bool kSimd =
    workbook::cpu::kVectorized && std::is_same_v<scalar_t, workbook::cpu::opmath_t<scalar_t>>;

// Bytes per element: reads gates (3) + old_cell (1), writes new_h + new_cell (2): 6 values, 24 B
// in float32. About 30 FLOPs with three exp and a tanh, which cost more than the bytes here: even
// with SIMD the loop is compute-bound on a CPU, unlike on a GPU.
template <typename scalar_t>
void lltm_forward_kernel(const scalar_t* gates, const scalar_t* old_cell, scalar_t* new_h,
                         scalar_t* new_cell, int64_t batch, int64_t state) {
  // EXERCISE cpu-fused-kernel: new_cell, new_h of every (b, s) in one pass, via parallel_over_rows
  // checked by: test_lltm.py::test_against_reference, ::test_forward_records_nothing_without_grad,
  //   ::test_layouts, ::test_edge_cases
  using opmath_t = workbook::cpu::opmath_t<scalar_t>;
  parallel_over_rows(batch, state, [&](int64_t b, int64_t s_begin, int64_t s_end) {
    const scalar_t* input_gates = gates + b * 3 * state;
    const scalar_t* output_gates = input_gates + state;
    const scalar_t* candidates = input_gates + 2 * state;
    const scalar_t* cell_in = old_cell + b * state;
    scalar_t* h_out = new_h + b * state;
    scalar_t* cell_out = new_cell + b * state;
    int64_t s = s_begin;
    if constexpr (kSimd<scalar_t>) {
      using V = Vec<scalar_t>;
      for (; s + V::size() <= s_end; s += V::size()) {
        const V input_gate = sigmoid(V::loadu(input_gates + s));
        const V output_gate = sigmoid(V::loadu(output_gates + s));
        const V candidate = elu(V::loadu(candidates + s));
        const V cell = V::loadu(cell_in + s) + candidate * input_gate;
        cell.store(cell_out + s);
        (cell.tanh() * output_gate).store(h_out + s);
      }
    }
    // On the stable ABI the only loop, vectorised by the compiler there (workbook/cpu.h).
    WORKBOOK_SIMD_LOOP for (int64_t i = s; i < s_end; ++i) {
      const opmath_t input_gate = workbook::sigmoid(static_cast<opmath_t>(input_gates[i]));
      const opmath_t output_gate = workbook::sigmoid(static_cast<opmath_t>(output_gates[i]));
      const opmath_t candidate = workbook::elu(static_cast<opmath_t>(candidates[i]));
      const opmath_t cell = static_cast<opmath_t>(cell_in[i]) + candidate * input_gate;
      cell_out[i] = static_cast<scalar_t>(cell);
      h_out[i] = static_cast<scalar_t>(std::tanh(cell) * output_gate);
    }
  });
  // END EXERCISE cpu-fused-kernel
}

// Bytes per element: reads grad_h, grad_cell, new_cell, gates (3): 6 values; writes d_gates (3)
// and d_old_cell (1): 4 values. 10 values, 40 B in float32.
template <typename scalar_t>
void lltm_backward_kernel(const scalar_t* grad_h, const scalar_t* grad_cell,
                          const scalar_t* new_cell, const scalar_t* gates, scalar_t* d_gates,
                          scalar_t* d_old_cell, int64_t batch, int64_t state) {
  using opmath_t = workbook::cpu::opmath_t<scalar_t>;
  parallel_over_rows(batch, state, [&](int64_t b, int64_t s_begin, int64_t s_end) {
    const scalar_t* g = gates + b * 3 * state;  // G0 | G1 | G2 of row b
    scalar_t* d_g = d_gates + b * 3 * state;
    const scalar_t* dh_in = grad_h + b * state;
    const scalar_t* dc_in = grad_cell + b * state;
    const scalar_t* cell_in = new_cell + b * state;
    scalar_t* dc_out = d_old_cell + b * state;
    int64_t s = s_begin;
    if constexpr (kSimd<scalar_t>) {
      using V = Vec<scalar_t>;
      for (; s + V::size() <= s_end; s += V::size()) {
        const V g_input = V::loadu(g + s), g_output = V::loadu(g + state + s),
                g_candidate = V::loadu(g + 2 * state + s);
        const V cell = V::loadu(cell_in + s), dh = V::loadu(dh_in + s);

        const V d_cell = V::loadu(dc_in + s) + dh * sigmoid(g_output) * d_tanh(cell);
        d_cell.store(dc_out + s);
        (d_cell * elu(g_candidate) * d_sigmoid(g_input)).store(d_g + s);
        (dh * cell.tanh() * d_sigmoid(g_output)).store(d_g + state + s);
        (d_cell * sigmoid(g_input) * d_elu(g_candidate)).store(d_g + 2 * state + s);
      }
    }
    // On the stable ABI the only loop, vectorised by the compiler there (workbook/cpu.h).
    WORKBOOK_SIMD_LOOP for (int64_t i = s; i < s_end; ++i) {
      const opmath_t g_input = static_cast<opmath_t>(g[i]);
      const opmath_t g_output = static_cast<opmath_t>(g[state + i]);
      const opmath_t g_candidate = static_cast<opmath_t>(g[2 * state + i]);
      const opmath_t cell = static_cast<opmath_t>(cell_in[i]);
      const opmath_t dh = static_cast<opmath_t>(dh_in[i]);

      // c' reaches the loss directly (grad_cell) and through h' = tanh(c') o.
      const opmath_t d_cell = static_cast<opmath_t>(dc_in[i]) +
                              dh * workbook::sigmoid(g_output) * workbook::d_tanh(cell);
      dc_out[i] = static_cast<scalar_t>(d_cell);
      d_g[i] =
          static_cast<scalar_t>(d_cell * workbook::elu(g_candidate) * workbook::d_sigmoid(g_input));
      d_g[state + i] = static_cast<scalar_t>(dh * std::tanh(cell) * workbook::d_sigmoid(g_output));
      d_g[2 * state + i] =
          static_cast<scalar_t>(d_cell * workbook::sigmoid(g_input) * workbook::d_elu(g_candidate));
    }
  });
}

}  // namespace lltm_kernels
