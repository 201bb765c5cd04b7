// Stage 06: the extops library's Python module.
//
// The library is one shared object, extops/_C.so, built from every source under csrc/: one
// folder per op, holding the op's schemas (<op>.cpp) and a folder per backend with its kernels
// (cpu/, cuda/). Each file registers itself when the library is loaded (TORCH_LIBRARY_FRAGMENT,
// TORCH_LIBRARY_IMPL), so this file knows none of them: adding an op is adding its folder.
//
//   csrc/extops.cpp                         this file: `import extops._C` loads the library
//   csrc/lltm/lltm.cpp                      schemas of extops::lltm_forward, ::lltm_backward
//   ../05_cuda_accessors/csrc/lltm_cpu.cpp  their CPU kernels: stage 05's file, compiled in here
//   ../05_cuda_accessors/csrc/lltm_cuda.cu  their CUDA kernels (where nvcc is found), likewise
//   csrc/lltm/autograd/, csrc/lltm/autocast/   their autograd (C++) and autocast rule
//   csrc/deform_conv2d/deform_conv2d.cpp    schemas of extops::deform_conv2d, ::..._backward
//   csrc/deform_conv2d/cpu/...              their CPU kernels
#include <Python.h>

// `import extops._C` needs a module init function; the module itself is empty. Importing it loads
// this shared library, which runs every registration in it.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C",
                               "Loads the extops library: the ops under torch.ops.extops", -1,
                               nullptr};
  return PyModule_Create(&module);
}
