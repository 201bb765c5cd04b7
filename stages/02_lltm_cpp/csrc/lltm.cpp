// Stage 02: the LLTM cell in ATen C++ on the CPU, built ahead of time with setuptools.
//
// Build and test:  make stage 2            (stage 03 compiles the same files just in time)
// What it shows:   a real op written with ATen tensor calls: a GEMM, gate nonlinearities, and a
//                  hand-written backward that returns the gradient of every input.
//
// The cell, with x (B x F), h and c (B x S), W (3S x (F + S)) and b (3S):
//   X = [h, x]                       (B x (S + F))
//   G = X W^T + b                    (B x 3S), three S-wide chunks G0 | G1 | G2
//   i = sigmoid(G0)   o = sigmoid(G1)   c^ = elu(G2)       input gate, output gate, candidate
//   c' = c + c^ * i   h' = tanh(c') * o
//
// forward returns [h', c', G]; G, the pre-activation gates, is all the backward needs to rebuild
// i, o and c^ (the cell recomputes them rather than store three more B x S tensors).
//
// The input checks (dtype, device, ranks, and sizes that agree with each other) are shared by every
// LLTM stage: common/include/workbook/lltm_checks.h. ATen handles any strides, so this stage takes
// non-contiguous inputs as they are. The pybind11 module is bindings.cpp (declarations: lltm.h).
//
// Sections: includes, derivatives, forward, backward.
//
// Includes: only what this file uses, as in stage 01's z2xy.cpp (which says why): Tensor methods
// (z.exp(), gates.chunk(3, 1), d_gates.mm(weights)) and operators come with ATen/core/Tensor.h
// and ATen/TensorOperators.h, each at:: function with its ATen/ops/<name>.h. Calling another one
// (at::mul, say), include its header (ATen/ops/mul.h).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#define AT_PER_OPERATOR_HEADERS
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/elu.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/where.h>

#include <vector>

#include "lltm.h"
#include "workbook/lltm_checks.h"

namespace {

// Derivatives of the gate nonlinearities, on whole tensors (the fused kernels of later stages use
// the scalar versions in workbook/lltm_math.h instead).
at::Tensor d_sigmoid(const at::Tensor& z) {
  const auto s = at::sigmoid(z);
  return (1 - s) * s;
}

at::Tensor d_tanh(const at::Tensor& z) { return 1 - z.tanh().pow(2); }

at::Tensor d_elu(const at::Tensor& z, double alpha = 1.0) {
  const auto e = z.exp();
  return at::where(z > 0, at::ones_like(z), alpha * e);
}

}  // namespace

std::vector<at::Tensor> lltm_forward(const at::Tensor& input, const at::Tensor& weights,
                                     const at::Tensor& bias, const at::Tensor& old_h,
                                     const at::Tensor& old_cell) {
  workbook::lltm::check_forward_inputs(input, weights, bias, old_h, old_cell, c10::DeviceType::CPU);

  // EXERCISE lltm-forward: G = [h, x] W^T + b, then c' and h' (the cell above); return {h', c', G}
  // checked by: test_lltm_cpp.py::test_against_reference,
  //   ::test_forward_records_nothing_without_grad, ::test_layouts
  const auto X = at::cat({old_h, input}, /*dim=*/1);
  const auto gates = at::addmm(bias, X, weights.t());  // b + X W^T, one GEMM

  const auto chunks = gates.chunk(3, /*dim=*/1);
  const auto input_gate = at::sigmoid(chunks[0]);
  const auto output_gate = at::sigmoid(chunks[1]);
  const auto candidate_cell = at::elu(chunks[2], /*alpha=*/1.0);

  const auto new_cell = old_cell + candidate_cell * input_gate;
  const auto new_h = at::tanh(new_cell) * output_gate;

  return {new_h, new_cell, gates};
  // END EXERCISE lltm-forward
}

// Given dL/dh' and dL/dc', the gradients of every input, in the order
// [d_input, d_weights, d_bias, d_old_h, d_old_cell].
std::vector<at::Tensor> lltm_backward(const at::Tensor& grad_h, const at::Tensor& grad_cell,
                                      const at::Tensor& new_cell, const at::Tensor& gates,
                                      const at::Tensor& input, const at::Tensor& old_h,
                                      const at::Tensor& weights) {
  workbook::lltm::check_backward_inputs(grad_h, grad_cell, new_cell, gates, input, old_h, weights,
                                        c10::DeviceType::CPU);

  // EXERCISE lltm-backward: the 5 gradients: through c' and h' to dG, then through G = X W^T + b
  // checked by: test_lltm_cpp.py::test_against_reference, ::test_gradcheck,
  //   ::test_requires_grad_of_one
  const auto chunks = gates.chunk(3, /*dim=*/1);
  const auto input_gate = at::sigmoid(chunks[0]);
  const auto output_gate = at::sigmoid(chunks[1]);
  const auto candidate_cell = at::elu(chunks[2], /*alpha=*/1.0);

  // c' reaches the loss directly (grad_cell) and through h' = tanh(c') o.
  const auto d_new_cell = grad_cell + grad_h * output_gate * d_tanh(new_cell);
  const auto d_output_gate = grad_h * at::tanh(new_cell);
  const auto d_input_gate = d_new_cell * candidate_cell;
  const auto d_candidate_cell = d_new_cell * input_gate;

  // Back through the nonlinearities to the pre-activation gates G.
  const auto d_gates =
      at::cat({d_input_gate * d_sigmoid(chunks[0]), d_output_gate * d_sigmoid(chunks[1]),
               d_candidate_cell * d_elu(chunks[2])},
              /*dim=*/1);

  // And through G = X W^T + b.
  const auto X = at::cat({old_h, input}, /*dim=*/1);
  const auto d_weights = d_gates.t().mm(X);
  const auto d_bias = d_gates.sum(/*dim=*/0);
  const auto d_X = d_gates.mm(weights);
  const int64_t state = old_h.size(1);
  const auto d_old_h = d_X.slice(/*dim=*/1, 0, state);
  const auto d_input = d_X.slice(/*dim=*/1, state);

  return {d_input, d_weights, d_bias, d_old_h, /*d_old_cell=*/d_new_cell};
  // END EXERCISE lltm-backward
}
