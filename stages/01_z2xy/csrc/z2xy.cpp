// Stage 01: z = 2x + y, the smallest complete PyTorch C++ extension.
//
// Build and test:  make stage 1
// What it shows:   an ATen forward and backward and the input checks every op starts with (this
//                  file); the pybind11 module that exposes them (bindings.cpp, through z2xy.h);
//                  the autograd.Function that ties them together (z2xy/__init__.py).
//
// Sections: includes, checks, forward, backward.
//
// Includes: only what this file uses, so that an edit here recompiles in seconds. at::Tensor and
// its methods come with ATen/core/Tensor.h, operators such as `grad_z * 2` with
// ATen/TensorOperators.h, and each free function with a header of its own, ATen/ops/<name>.h
// (at::add: ATen/ops/add.h). Calling another one, include its header. Not here: <ATen/ATen.h>,
// every op at once (twice as long to parse), and <torch/extension.h>, pybind11 and all of libtorch
// (four times as long), which bindings.cpp includes for this file.
//
// The two defines are the ones PyTorch compiles its own sources with. TORCH_ASSERT_ONLY_METHOD_
// OPERATORS says that this file uses Tensor methods and per-operator headers only, and
// AT_PER_OPERATOR_HEADERS makes torch's headers hold it to that: TensorOperators.h then includes
// the one op it needs instead of all of them, and <ATen/ATen.h> or <torch/extension.h> included
// here stops the build with an #error that says so.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#define AT_PER_OPERATOR_HEADERS
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>

#include <vector>

#include "workbook/checks.h"
#include "z2xy.h"

namespace {

using workbook::Arg;

constexpr const char* kOp = "z2xy";

// x and y: dense, floating point, the same dtype, shape and device. Any shape works, any strides
// too: ATen's element-wise ops handle them, so non-contiguous inputs need no special case. A
// sparse input is refused by name (ATen would run the sparse forward, then fail in the backward).
void check_inputs(const at::Tensor& x, const at::Tensor& y) {
  const Arg x_arg{kOp, "x"}, y_arg{kOp, "y"};
  workbook::check_strided(x, x_arg);
  workbook::check_strided(y, y_arg);
  workbook::check_floating(x, x_arg);
  workbook::check_dtype(y, y_arg, x, x_arg);
  workbook::check_device_type(x, x_arg, c10::DeviceType::CPU);
  workbook::check_same_device(y, y_arg, x, x_arg);
  workbook::check_same_shape(y, y_arg, x, x_arg);
}

}  // namespace

// z = 2x + y. at::add(y, x, alpha) computes y + alpha * x in one pass.
at::Tensor z2xy_forward(const at::Tensor& x, const at::Tensor& y) {
  check_inputs(x, y);
  return at::add(y, x, /*alpha=*/2);
}

// dz/dx = 2 and dz/dy = 1, so the incoming gradient is scaled for x and passed through for y.
std::vector<at::Tensor> z2xy_backward(const at::Tensor& grad_z) {
  workbook::check_floating(grad_z, Arg{kOp, "grad_z"});
  // EXERCISE z2xy-backward: return the gradients {grad_x, grad_y} = {2 grad_z, grad_z}
  // checked by: test_z2xy.py::test_against_reference, ::test_gradcheck, ::test_requires_grad_of_one
  return {grad_z * 2, grad_z};
  // END EXERCISE z2xy-backward
}
