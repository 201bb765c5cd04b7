// Stage 01: the pybind11 module that makes csrc/z2xy.cpp's functions z2xy._C.forward and
// z2xy._C.backward.
//
// torch/extension.h is what bindings need: pybind11, and the casters that turn a torch.Tensor
// into an at::Tensor and back (with all of libtorch's C++ API around them). It is also by far
// the slowest header to compile (this file: over half a minute on two cores, z2xy.cpp: 8 s),
// which is why it has this file to itself: an edit of z2xy.cpp recompiles z2xy.cpp alone, and
// the build relinks this file's object as it is.
#include <torch/extension.h>

#include "z2xy.h"

// TORCH_EXTENSION_NAME is defined by the build: `_C` from setup.py (the extension z2xy._C).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "z = 2x + y: forward and backward in ATen C++";
  m.def("forward", &z2xy_forward, "z = 2x + y", py::arg("x"), py::arg("y"));
  m.def("backward", &z2xy_backward, "gradients of z = 2x + y: [grad_x, grad_y]", py::arg("grad_z"));
}
