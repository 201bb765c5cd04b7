// Stage 05: the LLTM ops on the CPU: the same fusion as the CUDA kernels, as one parallel loop.
//
// Run card
//   build + test:  make stage 5            (this file builds everywhere, with or without nvcc)
//   v1 (stage 02): about fifteen ATen ops between the GEMMs, each a full pass over B x S memory
//   v2 (here):     one pass over the gates each way, split over threads with at::parallel_for,
//                  a SIMD vector at a time with at::vec: 16 floats with AVX-512, 8 with AVX2,
//                  the width ATen itself runs on the build machine (build.cpu_simd_flags())
//
// Sections: kernels, launchers (the ops), registration. The checks are in workbook/lltm_checks.h
// and the math (sigmoid, elu and their derivatives) in workbook/lltm_math.h, shared with the GPU.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "workbook/lltm_checks.h"
#include "workbook/lltm_math.h"

namespace {

// ----------------------------------------------------------------------------------------------
// Kernels
//
// Every tensor is contiguous (the ops below make sure), so element (b, s) of a B x S tensor is at
// b * S + s, and its three gates at b * 3S + s, + S, + 2S. Half and bfloat16 compute in opmath_t
// (float), as on the GPU.

// An element costs a few exp and a tanh, a few ns with SIMD: below ~8k elements (tens of us) a
// second thread is not worth waking (at::parallel_for then runs the loop inline).
constexpr int64_t kGrainElements = 8192;

// Calls fn(b, s_begin, s_end) on row pieces that together cover the B x S elements once, split
// across at::parallel_for's threads in flat chunks: a single long row (batch 1) is shared out as
// well as many short ones.
template <typename Fn>
void parallel_over_rows(int64_t batch, int64_t state, const Fn& fn) {
  at::parallel_for(0, batch * state, kGrainElements, [&](int64_t begin, int64_t end) {
    while (begin < end) {
      const int64_t b = begin / state, s = begin % state;
      const int64_t s_end = std::min(state, s + (end - begin));
      fn(b, s, s_end);
      begin += s_end - s;
    }
  });
}

// SIMD versions of workbook/lltm_math.h, on at::vec::Vectorized<T>: 16 floats or 8 doubles at a
// time with AVX-512 (8 and 4 with AVX2), exp and tanh from SLEEF as in ATen's own kernels.
// build.cpu_simd_flags() selects the instruction set ATen runs on the build machine; where it
// finds none, Vectorized is a plain loop and this still works.
template <typename T>
using Vec = at::vec::Vectorized<T>;

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
constexpr bool kSimd = std::is_same_v<scalar_t, at::opmath_type<scalar_t>>;

// Bytes per element: reads gates (3) + old_cell (1), writes new_h + new_cell (2): 6 values, 24 B
// in float32. About 30 FLOPs with three exp and a tanh, which cost more than the bytes here: even
// with SIMD the loop is compute-bound on a CPU, unlike on a GPU.
template <typename scalar_t>
void lltm_forward_kernel(const scalar_t* gates, const scalar_t* old_cell, scalar_t* new_h,
                         scalar_t* new_cell, int64_t batch, int64_t state) {
  // EXERCISE cpu-fused-kernel: new_cell, new_h of every (b, s) in one pass, via parallel_over_rows
  // checked by: test_lltm.py::test_against_reference, ::test_forward_records_nothing_without_grad,
  //   ::test_layouts, ::test_edge_cases
  using opmath_t = at::opmath_type<scalar_t>;
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
    for (; s < s_end; ++s) {
      const opmath_t input_gate = workbook::sigmoid(static_cast<opmath_t>(input_gates[s]));
      const opmath_t output_gate = workbook::sigmoid(static_cast<opmath_t>(output_gates[s]));
      const opmath_t candidate = workbook::elu(static_cast<opmath_t>(candidates[s]));
      const opmath_t cell = static_cast<opmath_t>(cell_in[s]) + candidate * input_gate;
      cell_out[s] = static_cast<scalar_t>(cell);
      h_out[s] = static_cast<scalar_t>(std::tanh(cell) * output_gate);
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
  using opmath_t = at::opmath_type<scalar_t>;
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
    for (; s < s_end; ++s) {
      const opmath_t g_input = static_cast<opmath_t>(g[s]);
      const opmath_t g_output = static_cast<opmath_t>(g[state + s]);
      const opmath_t g_candidate = static_cast<opmath_t>(g[2 * state + s]);
      const opmath_t cell = static_cast<opmath_t>(cell_in[s]);
      const opmath_t dh = static_cast<opmath_t>(dh_in[s]);

      // c' reaches the loss directly (grad_cell) and through h' = tanh(c') o.
      const opmath_t d_cell = static_cast<opmath_t>(dc_in[s]) +
                              dh * workbook::sigmoid(g_output) * workbook::d_tanh(cell);
      dc_out[s] = static_cast<scalar_t>(d_cell);
      d_g[s] =
          static_cast<scalar_t>(d_cell * workbook::elu(g_candidate) * workbook::d_sigmoid(g_input));
      d_g[state + s] = static_cast<scalar_t>(dh * std::tanh(cell) * workbook::d_sigmoid(g_output));
      d_g[2 * state + s] =
          static_cast<scalar_t>(d_cell * workbook::sigmoid(g_input) * workbook::d_elu(g_candidate));
    }
  });
}

// ----------------------------------------------------------------------------------------------
// Launchers: the ops' CPU implementations. GEMMs in ATen (MKL or OpenBLAS), pointwise fused.

std::tuple<at::Tensor, at::Tensor, at::Tensor> lltm_forward_cpu(const at::Tensor& input,
                                                                const at::Tensor& weights,
                                                                const at::Tensor& bias,
                                                                const at::Tensor& old_h,
                                                                const at::Tensor& old_cell) {
  workbook::lltm::check_forward_inputs(input, weights, bias, old_h, old_cell, c10::DeviceType::CPU);
  const int64_t batch = old_h.size(0), state = old_h.size(1);

  const auto X = at::cat({old_h, input}, /*dim=*/1);
  const auto gates = at::addmm(bias, X, weights.t()).contiguous();  // b + X W^T
  const auto cell = old_cell.contiguous();  // strided inputs are accepted: one copy here
  auto new_h = at::empty({batch, state}, cell.options());
  auto new_cell = at::empty({batch, state}, cell.options());

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "lltm_forward_cpu", [&] {
        lltm_forward_kernel<scalar_t>(gates.const_data_ptr<scalar_t>(),
                                      cell.const_data_ptr<scalar_t>(),
                                      new_h.mutable_data_ptr<scalar_t>(),
                                      new_cell.mutable_data_ptr<scalar_t>(), batch, state);
      });
  return {new_h, new_cell, gates};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lltm_backward_cpu(
    const at::Tensor& grad_h, const at::Tensor& grad_cell, const at::Tensor& new_cell,
    const at::Tensor& gates, const at::Tensor& input, const at::Tensor& old_h,
    const at::Tensor& weights) {
  workbook::lltm::check_backward_inputs(grad_h, grad_cell, new_cell, gates, input, old_h, weights,
                                        c10::DeviceType::CPU);
  const int64_t batch = new_cell.size(0), state = new_cell.size(1);
  const auto grad_h_ = grad_h.contiguous(), grad_cell_ = grad_cell.contiguous(),
             new_cell_ = new_cell.contiguous(), gates_ = gates.contiguous();
  auto d_gates = at::empty({batch, 3 * state}, gates.options());
  auto d_old_cell = at::empty({batch, state}, gates.options());

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, gates.scalar_type(), "lltm_backward_cpu", [&] {
        lltm_backward_kernel<scalar_t>(
            grad_h_.const_data_ptr<scalar_t>(), grad_cell_.const_data_ptr<scalar_t>(),
            new_cell_.const_data_ptr<scalar_t>(), gates_.const_data_ptr<scalar_t>(),
            d_gates.mutable_data_ptr<scalar_t>(), d_old_cell.mutable_data_ptr<scalar_t>(), batch,
            state);
      });

  // Back through G = X W^T + b: one GEMM for d_X = [d_old_h, d_input] against the dense W, then
  // each half copied out, since an op's outputs must not alias one another. Against two GEMMs on
  // strided slices of W: 25.5 vs 26.4 ms at B 256, F 512, S 2048 on 2 threads; even at B 16.
  const auto X = at::cat({old_h, input}, /*dim=*/1);
  const auto d_X = d_gates.mm(weights);
  // clone, not contiguous(): with batch 1 a slice is already contiguous and would stay a view.
  return {d_X.slice(/*dim=*/1, state).clone(at::MemoryFormat::Contiguous), d_gates.t().mm(X),
          d_gates.sum(/*dim=*/0),
          d_X.slice(/*dim=*/1, 0, state).clone(at::MemoryFormat::Contiguous), d_old_cell};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Registration: these kernels run the library's LLTM ops for CPU tensors.
//
// Which library: OPS_NAMESPACE, which setup.py defines as the package it builds. Here that is
// `lltm` (torch.ops.lltm.lltm_forward); stage 06 compiles this same file into `extops`
// (torch.ops.extops.lltm_forward). A kernel file does not need to know which library it ends up
// in; the file that defines the library (lltm.cpp, TORCH_LIBRARY) does.

TORCH_LIBRARY_IMPL(OPS_NAMESPACE, CPU, m) {
  m.impl("lltm_forward", &lltm_forward_cpu);
  m.impl("lltm_backward", &lltm_backward_cpu);
}
