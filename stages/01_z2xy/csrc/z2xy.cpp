// Stage 01: z = 2x + y, the smallest complete PyTorch C++ extension.
//
// Build and test:  make stage 1
// What it shows:   an ATen forward and backward, the input checks every op starts with, and a
//                  pybind11 module; the autograd.Function that ties them together lives in
//                  z2xy/__init__.py.
//
// Sections: checks, forward, backward, bindings.
#include <torch/extension.h>

#include <vector>

#include "workbook/checks.h"

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
  workbook::check_dtype(y, y_arg, x.scalar_type());
  workbook::check_device_type(x, x_arg, c10::DeviceType::CPU);
  workbook::check_same_device(y, y_arg, x, x_arg);
  workbook::check_same_shape(y, y_arg, x, x_arg);
}

// z = 2x + y. at::add(y, x, alpha) computes y + alpha * x in one pass.
at::Tensor z2xy_forward(const at::Tensor& x, const at::Tensor& y) {
  check_inputs(x, y);
  return at::add(y, x, /*alpha=*/2);
}

// dz/dx = 2 and dz/dy = 1, so the incoming gradient is scaled for x and passed through for y.
std::vector<at::Tensor> z2xy_backward(const at::Tensor& grad_z) {
  workbook::check_floating(grad_z, Arg{kOp, "grad_z"});
  // EXERCISE z2xy-backward: return the gradients {grad_x, grad_y} = {2 grad_z, grad_z}
  return {grad_z * 2, grad_z};
  // END EXERCISE z2xy-backward
}

}  // namespace

// TORCH_EXTENSION_NAME is defined by the build: `_C` from setup.py (the extension z2xy._C).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "z = 2x + y: forward and backward in ATen C++";
  m.def("forward", &z2xy_forward, "z = 2x + y", py::arg("x"), py::arg("y"));
  m.def("backward", &z2xy_backward, "gradients of z = 2x + y: [grad_x, grad_y]", py::arg("grad_z"));
}
