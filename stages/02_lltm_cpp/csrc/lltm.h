// Stage 02: what csrc/lltm.cpp defines and csrc/bindings.cpp exposes to Python.
//
// Declarations only, so that each of the two files includes just what it needs (stage 01's
// z2xy.h says why).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

// One LLTM step on the CPU, after checking every input: [new_h, new_cell, gates].
std::vector<at::Tensor> lltm_forward(const at::Tensor& input, const at::Tensor& weights,
                                     const at::Tensor& bias, const at::Tensor& old_h,
                                     const at::Tensor& old_cell);

// Given dL/dh' and dL/dc' and what the forward returned:
// [d_input, d_weights, d_bias, d_old_h, d_old_cell].
std::vector<at::Tensor> lltm_backward(const at::Tensor& grad_h, const at::Tensor& grad_cell,
                                      const at::Tensor& new_cell, const at::Tensor& gates,
                                      const at::Tensor& input, const at::Tensor& old_h,
                                      const at::Tensor& weights);
