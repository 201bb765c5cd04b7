// Stage 06: the extops library's Python module.
//
// The library is one shared object, extops/_C.so, built from every source under csrc/: one
// folder per op, holding the op's schemas (<op>.cpp) and a folder per backend with its kernels
// (cpu/, cuda/). Each file registers itself when the library is loaded (TORCH_LIBRARY_FRAGMENT,
// TORCH_LIBRARY_IMPL), so this file knows none of them: adding an op is adding its folder.
//
//   csrc/extops.cpp                         this file: `import extops._C` loads the library and
//                                           hands the checks' messages to Python
//   csrc/lltm/lltm.cpp                      schemas of extops::lltm_forward, ::lltm_backward
//   ../05_cuda_accessors/csrc/lltm_cpu.cpp  their CPU kernels: stage 05's file, compiled in here
//   ../05_cuda_accessors/csrc/lltm_cuda.cu  their CUDA kernels (where nvcc is found), likewise
//   csrc/lltm/autograd/, csrc/lltm/autocast/   their autograd (C++) and autocast rule
//   csrc/deform_conv2d/deform_conv2d.cpp    schemas of extops::deform_conv2d, ::..._backward
//   csrc/deform_conv2d/cpu/...              their CPU kernels
#include <Python.h>

#include "workbook/checks.h"

// `import extops._C` needs a module init function. Importing it loads this shared library, which
// runs every registration in it. The module holds one thing: the checks' messages
// (workbook/checks.h), as MESSAGES, a dict of name -> text, which extops/errors.py fills in for
// the fake kernels: they say what the kernels say because they read the same table.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C",
                               "Loads the extops library: the ops under torch.ops.extops", -1,
                               nullptr};
  PyObject* m = PyModule_Create(&module);
  PyObject* messages = m == nullptr ? nullptr : PyDict_New();
  if (messages == nullptr) {
    Py_XDECREF(m);
    return nullptr;
  }
  for (const workbook::Message& message : workbook::kMessages) {
    PyObject* text = PyUnicode_FromString(message.text);
    if (text == nullptr || PyDict_SetItemString(messages, message.name, text) != 0) {
      Py_XDECREF(text);
      Py_DECREF(messages);
      Py_DECREF(m);
      return nullptr;
    }
    Py_DECREF(text);
  }
  if (PyModule_AddObject(m, "MESSAGES", messages) != 0) {  // steals `messages` on success
    Py_DECREF(messages);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
