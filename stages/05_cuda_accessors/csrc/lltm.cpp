// Stage 05: the lltm library's schemas, the checks its kernels share, and the Python module.
//
// Build and test:  make stage 5
// Install:         pip install --no-build-isolation ./stages/05_cuda_accessors   then `import lltm`
// What it shows:   the registration split of production op libraries. This file declares *what*
//                  the ops are (TORCH_LIBRARY: names and schemas); lltm_cpu.cpp and lltm_cuda.cu
//                  each register *how* one backend runs them (TORCH_LIBRARY_IMPL); lltm/ops.py
//                  adds the fake kernels (shapes only, for torch.compile and meta tensors) and
//                  autograd. No pybind11: the ops are reached as torch.ops.lltm.forward/backward,
//                  from Python, C++ or a compiled graph alike.
//
// Sections: checks, schemas, Python module.
#include <Python.h>
#include <torch/library.h>

#include <initializer_list>
#include <utility>

#include "lltm.h"
#include "workbook/checks.h"

namespace lltm {
namespace {

using workbook::Arg;

// One floating dtype (the first input's) and one device (the first input's, of type `device`).
void check_dtypes_and_devices(std::initializer_list<std::pair<const at::Tensor&, Arg>> args,
                              c10::DeviceType device) {
  const auto& [first, first_arg] = *args.begin();
  workbook::check_floating(first, first_arg);
  for (const auto& [t, arg] : args) workbook::check_dtype(t, arg, first.scalar_type());
  for (const auto& [t, arg] : args) {
    workbook::check_device_type(t, arg, device);
    workbook::check_same_device(t, arg, first, first_arg);
  }
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Checks

void check_forward_inputs(const at::Tensor& input, const at::Tensor& weights,
                          const at::Tensor& bias, const at::Tensor& old_h,
                          const at::Tensor& old_cell, c10::DeviceType device) {
  constexpr const char* op = "lltm";
  const Arg input_arg{op, "input"}, weights_arg{op, "weights"}, bias_arg{op, "bias"},
      h_arg{op, "old_h"}, c_arg{op, "old_cell"};
  check_dtypes_and_devices({{input, input_arg}, {weights, weights_arg}, {bias, bias_arg},
                            {old_h, h_arg}, {old_cell, c_arg}},
                           device);
  workbook::check_dim(input, input_arg, 2, "(batch, features)");
  workbook::check_dim(old_h, h_arg, 2, "(batch, state)");
  workbook::check_dim(old_cell, c_arg, 2, "(batch, state)");
  workbook::check_dim(weights, weights_arg, 2, "(3 * state, state + features)");
  workbook::check_dim(bias, bias_arg, 1, "(3 * state)");

  const int64_t batch = input.size(0), features = input.size(1), state = old_h.size(1);
  workbook::check_size(old_h, h_arg, 0, batch, "batch size of `input`");
  workbook::check_same_shape(old_cell, c_arg, old_h, h_arg);
  workbook::check_size(weights, weights_arg, 0, 3 * state, "3 * state size of `old_h`");
  workbook::check_size(weights, weights_arg, 1, state + features,
                       "state size of `old_h` + features of `input`");
  workbook::check_size(bias, bias_arg, 0, 3 * state, "3 * state size of `old_h`");
}

void check_backward_inputs(const at::Tensor& grad_h, const at::Tensor& grad_cell,
                           const at::Tensor& new_cell, const at::Tensor& gates,
                           const at::Tensor& input, const at::Tensor& old_h,
                           const at::Tensor& weights, c10::DeviceType device) {
  constexpr const char* op = "lltm_backward";
  const Arg grad_h_arg{op, "grad_h"}, grad_cell_arg{op, "grad_cell"}, cell_arg{op, "new_cell"},
      gates_arg{op, "gates"}, input_arg{op, "input"}, h_arg{op, "old_h"},
      weights_arg{op, "weights"};
  check_dtypes_and_devices({{grad_h, grad_h_arg}, {grad_cell, grad_cell_arg},
                            {new_cell, cell_arg}, {gates, gates_arg}, {input, input_arg},
                            {old_h, h_arg}, {weights, weights_arg}},
                           device);
  workbook::check_dim(new_cell, cell_arg, 2, "(batch, state)");
  workbook::check_dim(gates, gates_arg, 2, "(batch, 3 * state)");
  workbook::check_dim(input, input_arg, 2, "(batch, features)");
  workbook::check_dim(weights, weights_arg, 2, "(3 * state, state + features)");
  workbook::check_same_shape(grad_h, grad_h_arg, new_cell, cell_arg);
  workbook::check_same_shape(grad_cell, grad_cell_arg, new_cell, cell_arg);
  workbook::check_same_shape(old_h, h_arg, new_cell, cell_arg);

  const int64_t batch = new_cell.size(0), state = new_cell.size(1);
  workbook::check_size(gates, gates_arg, 0, batch, "batch size of `new_cell`");
  workbook::check_size(gates, gates_arg, 1, 3 * state, "3 * state size of `new_cell`");
  workbook::check_size(input, input_arg, 0, batch, "batch size of `new_cell`");
  workbook::check_size(weights, weights_arg, 0, 3 * state, "3 * state size of `new_cell`");
  workbook::check_size(weights, weights_arg, 1, state + input.size(1),
                       "state size of `new_cell` + features of `input`");
}

}  // namespace lltm

// ----------------------------------------------------------------------------------------------
// Schemas
//
// The names and signatures every backend implements. forward returns the pre-activation gates
// as a third output: the backward rebuilds the activations from them. pt2_compliant_tag says the
// ops (with the fake kernels of lltm/ops.py) are safe to trace with torch.compile.

TORCH_LIBRARY(lltm, m) {
  m.def(
      "forward(Tensor input, Tensor weights, Tensor bias, Tensor old_h, Tensor old_cell)"
      " -> (Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "backward(Tensor grad_h, Tensor grad_cell, Tensor new_cell, Tensor gates, Tensor input,"
      " Tensor old_h, Tensor weights) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
}

// ----------------------------------------------------------------------------------------------
// Python module
//
// `import lltm._C` needs a module init function; the module itself is empty. Importing it loads
// this shared library, which runs the TORCH_LIBRARY and TORCH_LIBRARY_IMPL registrations above
// and in the kernel files.

PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C",
                               "Loads the lltm library: torch.ops.lltm.forward and .backward",
                               -1, nullptr};
  return PyModule_Create(&module);
}
