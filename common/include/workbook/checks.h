// workbook/checks.h: input checks shared by every stage.
//
// Every entry point of every extension checks its inputs before touching them. A failed check
// raises a Python exception whose message names the argument, says what was expected and what was
// got, e.g.
//
//   TypeError: lltm: `input` must be a floating-point tensor (Double, Float, Half or BFloat16),
//              got Long
//   ValueError: lltm: `old_h` must have 2 dimensions (batch, state), got 3 with sizes [2, 3, 4]
//
// The exception class follows what went wrong: TORCH_CHECK_TYPE (TypeError) for dtypes,
// TORCH_CHECK_VALUE (ValueError) for shapes, TORCH_CHECK (RuntimeError) for devices and layout.
// Every check is cheap (metadata only): call them at the top of an op, before dispatching a kernel.
//
// Only metadata is read, so at::Tensor (ATen/core/Tensor.h) is all this header includes, not
// <ATen/ATen.h> (every op: twice as long to parse): a file that keeps to per-operator headers, as
// stage 01's z2xy.cpp does, stays quick to compile with the checks in it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

namespace workbook {

// The name of an input, with the op it belongs to, for messages: "lltm: `weights`".
struct Arg {
  const char* op;
  const char* name;
};

inline std::string describe(const Arg& arg) { return std::string(arg.op) + ": `" + arg.name + "`"; }

inline void check_defined(const at::Tensor& t, const Arg& arg) {
  TORCH_CHECK_VALUE(t.defined(), describe(arg),
                    " must be a tensor, got an undefined tensor (None)");
}

// The dtypes the kernels compute in: an allow-list, not at::isFloatingType, which also admits the
// float8 types (no kernel here computes in float8: refused by name, not failed inside a kernel).
inline bool supported_floating(at::ScalarType type) {
  return type == at::kDouble || type == at::kFloat || type == at::kHalf || type == at::kBFloat16;
}

// Dense (strided) tensors only: a sparse, mkldnn or nested tensor is refused by name here rather
// than failing later inside ATen with a message that names no argument.
inline void check_strided(const at::Tensor& t, const Arg& arg) {
  check_defined(t, arg);
  TORCH_CHECK_TYPE(t.layout() == at::kStrided, describe(arg),
                   " must be a dense tensor (layout Strided), got layout ", t.layout());
}

inline void check_floating(const at::Tensor& t, const Arg& arg) {
  check_strided(t, arg);
  TORCH_CHECK_TYPE(supported_floating(t.scalar_type()), describe(arg),
                   " must be a floating-point tensor (Double, Float, Half or BFloat16), got ",
                   t.scalar_type());
}

inline void check_dtype(const at::Tensor& t, const Arg& arg, at::ScalarType expected) {
  check_defined(t, arg);
  TORCH_CHECK_TYPE(t.scalar_type() == expected, describe(arg), " must have dtype ", expected,
                   " (the dtype of the first input), got ", t.scalar_type());
}

inline void check_device_type(const at::Tensor& t, const Arg& arg, c10::DeviceType expected) {
  check_defined(t, arg);
  TORCH_CHECK(t.device().type() == expected, describe(arg), " must be a ",
              c10::DeviceTypeName(expected), " tensor, got a tensor on ", t.device());
}

inline void check_contiguous(const at::Tensor& t, const Arg& arg) {
  check_defined(t, arg);
  TORCH_CHECK(t.is_contiguous(), describe(arg), " must be contiguous, got sizes ", t.sizes(),
              " with strides ", t.strides(), " (call .contiguous() first)");
}

inline void check_same_device(const at::Tensor& t, const Arg& arg, const at::Tensor& other,
                              const Arg& other_arg) {
  TORCH_CHECK(t.device() == other.device(), describe(arg), " must be on the same device as `",
              other_arg.name, "` (", other.device(), "), got ", t.device());
}

// `what` names the dimensions for the reader, e.g. "(batch, state)".
inline void check_dim(const at::Tensor& t, const Arg& arg, int64_t ndim, const char* what) {
  check_defined(t, arg);
  TORCH_CHECK_VALUE(t.dim() == ndim, describe(arg), " must have ", ndim, " dimension",
                    ndim == 1 ? "" : "s", " ", what, ", got ", t.dim(), " with sizes ", t.sizes());
}

// Size of dimension `dim` must be `expected`; `why` says where the expectation comes from.
inline void check_size(const at::Tensor& t, const Arg& arg, int64_t dim, int64_t expected,
                       const std::string& why) {
  TORCH_CHECK_VALUE(t.size(dim) == expected, describe(arg), " must have size ", expected,
                    " in dimension ", dim, " (", why, "), got sizes ", t.sizes());
}

inline void check_same_shape(const at::Tensor& t, const Arg& arg, const at::Tensor& other,
                             const Arg& other_arg) {
  TORCH_CHECK_VALUE(t.sizes() == other.sizes(), describe(arg), " must have the shape of `",
                    other_arg.name, "` ", other.sizes(), ", got ", t.sizes());
}

// What every op checks of all its tensor inputs together: one floating dtype (the first input's),
// one device (the first input's, of type `device`) and, for kernels that index raw memory, a dense
// layout. `args` lists the inputs in order, so the first offender is the one named. Devices are
// compared with the first input before the device type is checked, so an input left on another
// device gets the same message from every backend and from the fake kernel, whichever kernel the
// dispatcher picked for the mix: "`weights` must be on the same device as `input` (cpu), got meta".
using NamedTensor = std::pair<const at::Tensor&, Arg>;

enum class Layout { kAny, kContiguous };

inline void check_inputs(std::initializer_list<NamedTensor> args, c10::DeviceType device,
                         Layout layout = Layout::kAny) {
  const auto& [first, first_arg] = *args.begin();
  for (const auto& [t, arg] : args) check_strided(t, arg);
  check_floating(first, first_arg);
  for (const auto& [t, arg] : args) check_dtype(t, arg, first.scalar_type());
  for (const auto& [t, arg] : args) check_same_device(t, arg, first, first_arg);
  check_device_type(first, first_arg, device);
  if (layout == Layout::kContiguous) {
    for (const auto& [t, arg] : args) check_contiguous(t, arg);
  }
}

}  // namespace workbook
