// Stage 10: what both LLTM glues (cpu/lltm_cpu.cpp, cuda/lltm_cuda.cu) do around their kernels
// with torch::stable's ops, on any device: the GEMMs' operand [old_h, input] and the backward's
// GEMMs. Stage 05 writes these with at::cat, mm, sum and slice in each of its two files.
#pragma once

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace lltm_stable {

using torch::stable::Tensor;

// [old_h, input] along dimension 1: what at::cat does, as an empty tensor and two copies.
inline Tensor concat_columns(const Tensor& old_h, const Tensor& input) {
  const int64_t batch = old_h.size(0), state = old_h.size(1), features = input.size(1);
  Tensor X = torch::stable::empty({batch, state + features}, old_h.scalar_type(), std::nullopt,
                                  old_h.device());
  Tensor left = torch::stable::narrow(X, 1, 0, state);
  Tensor right = torch::stable::narrow(X, 1, state, features);
  torch::stable::copy_(left, old_h);
  torch::stable::copy_(right, input);
  return X;
}

// Back through G = X W^T + b from d_gates = dG: (d_input, d_weights, d_bias, d_old_h), as stage 05
// does, with one GEMM for d_X = [d_old_h, d_input], each half copied out (clone: an op's outputs
// must not alias one another).
inline std::tuple<Tensor, Tensor, Tensor, Tensor> gates_backward(const Tensor& d_gates,
                                                                 const Tensor& input,
                                                                 const Tensor& old_h,
                                                                 const Tensor& weights) {
  const int64_t state = old_h.size(1), features = input.size(1);
  const Tensor X = concat_columns(old_h, input);
  Tensor d_X = torch::stable::matmul(d_gates, weights);
  const Tensor d_weights = torch::stable::matmul(torch::stable::transpose(d_gates, 0, 1), X);
  const int64_t rows[] = {0};
  const Tensor d_bias = torch::stable::sum(d_gates, rows);
  return {torch::stable::clone(torch::stable::narrow(d_X, 1, state, features)), d_weights, d_bias,
          torch::stable::clone(torch::stable::narrow(d_X, 1, 0, state))};
}

}  // namespace lltm_stable
