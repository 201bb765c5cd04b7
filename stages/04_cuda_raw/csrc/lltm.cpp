// Stage 04: the LLTM cell with fused CUDA kernels; this is the C++ front, lltm_cuda.cu the back.
//
// Build and test:  make stage 4   (compiles wherever nvcc is found; the kernels need a GPU to run)
// What it shows:   how a CUDA extension is split. The host compiler builds this file: input checks
//                  and the Python bindings. nvcc builds lltm_cuda.cu: kernels and their launchers.
//                  Keeping torch/extension.h (pybind11) out of nvcc's way is faster and avoids a
//                  class of nvcc/pybind11 template trouble.
//
// The kernels index raw pointers as if every tensor were a dense row-major block, so the checks
// here are stricter than stage 02's: CUDA tensors, contiguous, and all on one device.
//
// Sections: checks, forwarding to the launchers, bindings.
#include <torch/extension.h>

#include <vector>

#include "workbook/checks.h"

// Launchers, defined in lltm_cuda.cu. They assume the checks below have passed.
std::vector<at::Tensor> lltm_cuda_forward(const at::Tensor& input, const at::Tensor& weights,
                                          const at::Tensor& bias, const at::Tensor& old_h,
                                          const at::Tensor& old_cell);
std::vector<at::Tensor> lltm_cuda_backward(const at::Tensor& grad_h, const at::Tensor& grad_cell,
                                           const at::Tensor& new_cell, const at::Tensor& gates,
                                           const at::Tensor& input, const at::Tensor& old_h,
                                           const at::Tensor& weights);

namespace {

using workbook::Arg;

// Dtype, device and layout of every input: one floating dtype (the first input's), all CUDA
// tensors on the first input's device, all contiguous. `args` lists the inputs in order.
void check_cuda_inputs(std::initializer_list<std::pair<const at::Tensor&, Arg>> args) {
  const auto& [first, first_arg] = *args.begin();
  workbook::check_floating(first, first_arg);
  for (const auto& [t, arg] : args) workbook::check_dtype(t, arg, first.scalar_type());
  for (const auto& [t, arg] : args) {
    workbook::check_device_type(t, arg, c10::DeviceType::CUDA);
    workbook::check_same_device(t, arg, first, first_arg);
    workbook::check_contiguous(t, arg);
  }
}

void check_forward_inputs(const at::Tensor& input, const at::Tensor& weights,
                          const at::Tensor& bias, const at::Tensor& old_h,
                          const at::Tensor& old_cell) {
  constexpr const char* op = "lltm";
  const Arg input_arg{op, "input"}, weights_arg{op, "weights"}, bias_arg{op, "bias"},
      h_arg{op, "old_h"}, c_arg{op, "old_cell"};
  check_cuda_inputs({{input, input_arg}, {weights, weights_arg}, {bias, bias_arg},
                     {old_h, h_arg}, {old_cell, c_arg}});
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

// The backward is called by the autograd.Function with what the forward saved, so the shapes
// agree by construction; the checks guard direct calls and the kernels' layout assumptions.
void check_backward_inputs(const at::Tensor& grad_h, const at::Tensor& grad_cell,
                           const at::Tensor& new_cell, const at::Tensor& gates,
                           const at::Tensor& input, const at::Tensor& old_h,
                           const at::Tensor& weights) {
  constexpr const char* op = "lltm_backward";
  const Arg grad_h_arg{op, "grad_h"}, grad_cell_arg{op, "grad_cell"}, cell_arg{op, "new_cell"},
      gates_arg{op, "gates"}, input_arg{op, "input"}, h_arg{op, "old_h"},
      weights_arg{op, "weights"};
  check_cuda_inputs({{grad_h, grad_h_arg}, {grad_cell, grad_cell_arg}, {new_cell, cell_arg},
                     {gates, gates_arg}, {input, input_arg}, {old_h, h_arg},
                     {weights, weights_arg}});
  workbook::check_dim(new_cell, cell_arg, 2, "(batch, state)");
  workbook::check_dim(gates, gates_arg, 2, "(batch, 3 * state)");
  workbook::check_dim(input, input_arg, 2, "(batch, features)");
  workbook::check_same_shape(grad_h, grad_h_arg, new_cell, cell_arg);
  workbook::check_same_shape(grad_cell, grad_cell_arg, new_cell, cell_arg);
  workbook::check_same_shape(old_h, h_arg, new_cell, cell_arg);
  const int64_t batch = new_cell.size(0), state = new_cell.size(1);
  workbook::check_size(gates, gates_arg, 0, batch, "batch size of `new_cell`");
  workbook::check_size(gates, gates_arg, 1, 3 * state, "3 * state size of `new_cell`");
  workbook::check_size(input, input_arg, 0, batch, "batch size of `new_cell`");
  workbook::check_dim(weights, weights_arg, 2, "(3 * state, state + features)");
  workbook::check_size(weights, weights_arg, 0, 3 * state, "3 * state size of `new_cell`");
  workbook::check_size(weights, weights_arg, 1, state + input.size(1),
                       "state size of `new_cell` + features of `input`");
}

std::vector<at::Tensor> lltm_forward(const at::Tensor& input, const at::Tensor& weights,
                                     const at::Tensor& bias, const at::Tensor& old_h,
                                     const at::Tensor& old_cell) {
  check_forward_inputs(input, weights, bias, old_h, old_cell);
  return lltm_cuda_forward(input, weights, bias, old_h, old_cell);
}

std::vector<at::Tensor> lltm_backward(const at::Tensor& grad_h, const at::Tensor& grad_cell,
                                      const at::Tensor& new_cell, const at::Tensor& gates,
                                      const at::Tensor& input, const at::Tensor& old_h,
                                      const at::Tensor& weights) {
  check_backward_inputs(grad_h, grad_cell, new_cell, gates, input, old_h, weights);
  return lltm_cuda_backward(grad_h, grad_cell, new_cell, gates, input, old_h, weights);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "LLTM cell: fused CUDA kernels on raw pointers (GEMMs in ATen)";
  m.def("forward", &lltm_forward, "LLTM forward: [new_h, new_cell, gates]", py::arg("input"),
        py::arg("weights"), py::arg("bias"), py::arg("old_h"), py::arg("old_cell"));
  m.def("backward", &lltm_backward,
        "LLTM backward: [d_input, d_weights, d_bias, d_old_h, d_old_cell]", py::arg("grad_h"),
        py::arg("grad_cell"), py::arg("new_cell"), py::arg("gates"), py::arg("input"),
        py::arg("old_h"), py::arg("weights"));
}
