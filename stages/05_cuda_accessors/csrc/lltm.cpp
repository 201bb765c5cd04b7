// Stage 05: the lltm library's schemas and its Python module.
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
// The kernels of both backends check their inputs with workbook/lltm_checks.h, as every LLTM
// stage does, so a bad input gets the same message whichever backend it was sent to.
//
// Sections: schemas, Python module.
#include <Python.h>
#include <torch/library.h>

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
                               "Loads the lltm library: torch.ops.lltm.forward and .backward", -1,
                               nullptr};
  return PyModule_Create(&module);
}
