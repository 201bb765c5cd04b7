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
// Sections: checks and forwarding to the launchers, bindings.
#include <torch/extension.h>

#include <vector>

#include "workbook/lltm_checks.h"

// Launchers, defined in lltm_cuda.cu. They assume the checks below have passed.
std::vector<at::Tensor> lltm_cuda_forward(const at::Tensor& input, const at::Tensor& weights,
                                          const at::Tensor& bias, const at::Tensor& old_h,
                                          const at::Tensor& old_cell);
std::vector<at::Tensor> lltm_cuda_backward(const at::Tensor& grad_h, const at::Tensor& grad_cell,
                                           const at::Tensor& new_cell, const at::Tensor& gates,
                                           const at::Tensor& input, const at::Tensor& old_h,
                                           const at::Tensor& weights);

namespace {

// The checks are every LLTM stage's (workbook/lltm_checks.h), with the device and layout the
// kernels need: CUDA and contiguous.
std::vector<at::Tensor> lltm_forward(const at::Tensor& input, const at::Tensor& weights,
                                     const at::Tensor& bias, const at::Tensor& old_h,
                                     const at::Tensor& old_cell) {
  workbook::lltm::check_forward_inputs(input, weights, bias, old_h, old_cell, c10::DeviceType::CUDA,
                                       workbook::Memory::kContiguous);
  return lltm_cuda_forward(input, weights, bias, old_h, old_cell);
}

std::vector<at::Tensor> lltm_backward(const at::Tensor& grad_h, const at::Tensor& grad_cell,
                                      const at::Tensor& new_cell, const at::Tensor& gates,
                                      const at::Tensor& input, const at::Tensor& old_h,
                                      const at::Tensor& weights) {
  workbook::lltm::check_backward_inputs(grad_h, grad_cell, new_cell, gates, input, old_h, weights,
                                        c10::DeviceType::CUDA, workbook::Memory::kContiguous);
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
