// Stage 02: the pybind11 module that makes csrc/lltm.cpp's functions lltm_cpp._C.forward and
// lltm_cpp._C.backward (and, built by stage 03, lltm_jit.forward and lltm_jit.backward).
//
// torch/extension.h in a file of its own, as in stage 01 (its bindings.cpp says why): an edit of
// lltm.cpp recompiles lltm.cpp alone.
#include <torch/extension.h>

#include "lltm.h"

// TORCH_EXTENSION_NAME is `_C` from setup.py (lltm_cpp._C) and `lltm_jit` in stage 03.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "LLTM cell: forward and backward in ATen C++ (CPU)";
  m.def("forward", &lltm_forward, "LLTM forward: [new_h, new_cell, gates]", py::arg("input"),
        py::arg("weights"), py::arg("bias"), py::arg("old_h"), py::arg("old_cell"));
  m.def("backward", &lltm_backward,
        "LLTM backward: [d_input, d_weights, d_bias, d_old_h, d_old_cell]", py::arg("grad_h"),
        py::arg("grad_cell"), py::arg("new_cell"), py::arg("gates"), py::arg("input"),
        py::arg("old_h"), py::arg("weights"));
}
