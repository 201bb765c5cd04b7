// Stage 01: what csrc/z2xy.cpp defines and csrc/bindings.cpp exposes to Python.
//
// Declarations only, so that each of the two files includes just what it needs: the op the
// ATen headers of the calls it makes, the bindings torch/extension.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

// z = 2x + y, after checking x and y (dense, floating point, one dtype, shape and device; CPU).
at::Tensor z2xy_forward(const at::Tensor& x, const at::Tensor& y);

// The gradients {grad_x, grad_y} of z = 2x + y, given grad_z.
std::vector<at::Tensor> z2xy_backward(const at::Tensor& grad_z);
