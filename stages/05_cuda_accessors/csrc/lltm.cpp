// Stage 05: the lltm library's schemas and its Python module.
//
// Build and test:  make stage 5
// Install:         pip install --no-build-isolation ./stages/05_cuda_accessors   then `import lltm`
// What it shows:   the registration split of production op libraries. This file declares *what*
//                  the ops are (TORCH_LIBRARY: names and schemas); lltm_cpu.cpp and lltm_cuda.cu
//                  each register *how* one backend runs them (TORCH_LIBRARY_IMPL); lltm/ops.py
//                  adds the fake kernels (shapes only, for torch.compile and meta tensors) and
//                  autograd. No pybind11: the ops are reached as torch.ops.lltm.lltm_forward
//                  and .lltm_backward, from Python, C++ or a compiled graph alike. (The op names
//                  carry the op's name, as they must in stage 06's library of several ops, where
//                  these kernels register the same names under the namespace `extops`.) The
//                  library's name is OPS_NAMESPACE, which setup.py defines: `lltm` here, and
//                  `lltm_coop` when stage 08 builds its library from this file.
//
// The kernels of both backends check their inputs with workbook/lltm_checks.h, as every LLTM
// stage does, so a bad input gets the same message whichever backend it was sent to.
//
// Sections: schemas, autocast, Python module.
#include <ATen/core/dispatch/Dispatcher.h>
#include <Python.h>
#include <torch/library.h>

#include <tuple>

#include "workbook/autocast.h"

// ----------------------------------------------------------------------------------------------
// Schemas
//
// The names and signatures every backend implements. The library is named here (OPS_NAMESPACE:
// `lltm`): TORCH_LIBRARY may appear once per namespace in a whole process. lltm_forward returns the
// pre-activation gates as a third output: the backward rebuilds the activations from them.
// `gates` is internal: it is not differentiable (autograd marks it so: a loss through it gets no
// gradient from it), and the public functional form lltm.lltm returns only (new_h, new_cell).
// pt2_compliant_tag says the ops (with the fake kernels of lltm/ops.py) are safe to trace with
// torch.compile.

TORCH_LIBRARY(OPS_NAMESPACE, m) {
  m.def(
      "lltm_forward(Tensor input, Tensor weights, Tensor bias, Tensor old_h, Tensor old_cell)"
      " -> (Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "lltm_backward(Tensor grad_h, Tensor grad_cell, Tensor new_cell, Tensor gates, Tensor input,"
      " Tensor old_h, Tensor weights) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
}

// ----------------------------------------------------------------------------------------------
// Autocast
//
// Inside a torch.autocast region the dispatcher calls an op's Autocast kernel first. The cell is
// matrix products and an element-wise loop, so it follows autocast's rule for matrix products:
// its inputs are cast to the region's dtype, outputs come in that dtype (workbook/autocast.h).
// Without it, a region that casts `old_h` (a matmul's output) and not `weights` hands the op a
// dtype mix it refuses. The forward only: the backward runs on saved tensors of one dtype.

namespace {

// "lltm::lltm_forward", in the library OPS_NAMESPACE names.
#define LLTM_QUOTE(name) #name
#define LLTM_OP_NAME(library, op) LLTM_QUOTE(library) "::" op

template <c10::DeviceType device>
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_autocast(const at::Tensor& input,
                                                                const at::Tensor& weights,
                                                                const at::Tensor& bias,
                                                                const at::Tensor& old_h,
                                                                const at::Tensor& old_cell) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow(LLTM_OP_NAME(OPS_NAMESPACE, "lltm_forward"), "")
                             .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&)>();
  workbook::BelowAutocast<device> below;
  using workbook::autocast_input;
  return op.call(autocast_input<device>(input), autocast_input<device>(weights),
                 autocast_input<device>(bias), autocast_input<device>(old_h),
                 autocast_input<device>(old_cell));
}

}  // namespace

TORCH_LIBRARY_IMPL(OPS_NAMESPACE, AutocastCPU, m) {
  m.impl("lltm_forward", &forward_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(OPS_NAMESPACE, AutocastCUDA, m) {
  m.impl("lltm_forward", &forward_autocast<c10::DeviceType::CUDA>);
}

// ----------------------------------------------------------------------------------------------
// Python module
//
// `import lltm._C` needs a module init function; the module itself is empty. Importing it loads
// this shared library, which runs the TORCH_LIBRARY and TORCH_LIBRARY_IMPL registrations above
// and in the kernel files.

PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {
      PyModuleDef_HEAD_INIT, "_C",
      "Loads the library: torch.ops.<OPS_NAMESPACE>.lltm_forward, .lltm_backward", -1, nullptr};
  return PyModule_Create(&module);
}
