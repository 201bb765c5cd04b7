// workbook/checks.h: input checks shared by every stage.
//
// Every entry point of every extension checks its inputs before touching them. A failed check
// raises a Python exception whose message names the argument, says what was expected and what was
// got, e.g.
//
//   TypeError: lltm: `input` must be a float64, float32, float16 or bfloat16 tensor, got
//              torch.int64
//   ValueError: lltm: `old_h` must have 2 dimensions (batch, state), got 3 with sizes [2, 3, 4]
//
// One vocabulary, the one the user types: dtypes and layouts by their Python names (torch.int64,
// torch.sparse_coo), device types as torch.device spells them (cpu, cuda), devices as they print
// (cuda:0), sizes as lists ([2, 3]). The messages are written once (below), and a library's fake
// kernels read the same table and run these checks in the same order (extops/errors.py).
//
// The exception class follows what went wrong: TORCH_CHECK_TYPE (TypeError) for dtypes and
// layouts, TORCH_CHECK_VALUE (ValueError) for shapes, TORCH_CHECK (RuntimeError) for devices.
// Every check is cheap (metadata only): call them at the top of an op, before dispatching a kernel.
//
// Only metadata is read, so at::Tensor (ATen/core/Tensor.h) is all this header includes, not
// <ATen/ATen.h> (every op: twice as long to parse): a file that keeps to per-operator headers, as
// stage 01's z2xy.cpp does, stays quick to compile with the checks in it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

#include <cctype>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>

namespace workbook {

// The name of an input, with the op it belongs to, for messages: "lltm: `weights`".
struct Arg {
  const char* op;
  const char* name;
};

inline std::string describe(const Arg& arg) { return std::string(arg.op) + ": `" + arg.name + "`"; }

// ----------------------------------------------------------------------------------------------
// Messages
//
// Each check's message, written once. The checks below fill them in with `say`; a library hands
// the same table to its Python side (stage 06's csrc/extops.cpp puts it in its module:
// extops._C.MESSAGES), whose fake kernels fill them in with str.format (extops/errors.py), so a
// bad input gets one message from the CPU kernel, the CUDA kernel, and the fake kernel on meta
// tensors and under torch.compile, by construction rather than by two copies kept in step.
// A {slot} is filled in by name.

struct Message {
  const char* name;
  const char* text;
};

inline constexpr Message kMessages[] = {
    {"undefined", "{op}: `{arg}` must be a tensor, got an undefined tensor (None)"},
    {"dense", "{op}: `{arg}` must be a dense tensor (layout torch.strided), got layout {got}"},
    {"floating", "{op}: `{arg}` must be a float64, float32, float16 or bfloat16 tensor, got {got}"},
    {"dtype", "{op}: `{arg}` must have dtype {expected} (the dtype of `{first}`), got {got}"},
    {"device", "{op}: `{arg}` must be on the same device as `{first}` ({expected}), got {got}"},
    {"device_type", "{op}: `{arg}` must be a {expected} tensor, got a tensor on {got}"},
    {"contiguous",
     "{op}: `{arg}` must be contiguous, got sizes {sizes} with strides {strides} (call "
     ".contiguous() first)"},
    {"dim", "{op}: `{arg}` must have {ndim} {dimensions} {what}, got {got} with sizes {sizes}"},
    {"size",
     "{op}: `{arg}` must have size {expected} in dimension {dim} ({why}), got sizes {sizes}"},
    {"shape", "{op}: `{arg}` must have the shape of `{other}` {expected}, got {got}"},
};

// The message `name` with each {slot} replaced by its value.
inline std::string say(std::string_view name,
                       std::initializer_list<std::pair<const char*, std::string>> values) {
  std::string text;
  for (const Message& m : kMessages) {
    if (name == m.name) text = m.text;
  }
  for (const auto& [slot, value] : values) {
    const std::string marker = std::string("{") + slot + "}";
    for (std::size_t at = text.find(marker); at != std::string::npos;
         at = text.find(marker, at + value.size())) {
      text.replace(at, marker.size(), value);
    }
  }
  return text;
}

// ----------------------------------------------------------------------------------------------
// Names, as Python prints them

// A dtype as str(dtype) prints it ("torch.float32"). The types with a legacy C++ name are spelled
// out; the others' Python names are their C++ names in lower case (Float8_e4m3fn ->
// float8_e4m3fn, UInt16 -> uint16). tests/test_tools.py holds this against str() of every dtype.
inline std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kDouble:
      return "torch.float64";
    case at::kFloat:
      return "torch.float32";
    case at::kHalf:
      return "torch.float16";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kComplexDouble:
      return "torch.complex128";
    case at::kComplexFloat:
      return "torch.complex64";
    case at::kComplexHalf:
      return "torch.complex32";
    case at::kLong:
      return "torch.int64";
    case at::kInt:
      return "torch.int32";
    case at::kShort:
      return "torch.int16";
    case at::kChar:
      return "torch.int8";
    case at::kByte:
      return "torch.uint8";
    case at::kBool:
      return "torch.bool";
    default: {
      std::string name = c10::toString(type);
      for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      return "torch." + name;
    }
  }
}

// A layout as str(layout) prints it ("torch.sparse_coo").
inline std::string layout_name(at::Layout layout) {
  switch (layout) {
    case at::kStrided:
      return "torch.strided";
    case at::kSparse:
      return "torch.sparse_coo";
    case at::kSparseCsr:
      return "torch.sparse_csr";
    case at::kSparseCsc:
      return "torch.sparse_csc";
    case at::kSparseBsr:
      return "torch.sparse_bsr";
    case at::kSparseBsc:
      return "torch.sparse_bsc";
    case at::kMkldnn:
      return "torch._mkldnn";
    case at::kJagged:
      return "torch.jagged";
    default:
      return "layout " + std::to_string(static_cast<int>(layout));
  }
}

// ----------------------------------------------------------------------------------------------
// Checks

inline void check_defined(const at::Tensor& t, const Arg& arg) {
  TORCH_CHECK_VALUE(t.defined(), say("undefined", {{"op", arg.op}, {"arg", arg.name}}));
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
  TORCH_CHECK_TYPE(
      t.layout() == at::kStrided,
      say("dense", {{"op", arg.op}, {"arg", arg.name}, {"got", layout_name(t.layout())}}));
}

inline void check_floating(const at::Tensor& t, const Arg& arg) {
  check_strided(t, arg);
  TORCH_CHECK_TYPE(
      supported_floating(t.scalar_type()),
      say("floating", {{"op", arg.op}, {"arg", arg.name}, {"got", dtype_name(t.scalar_type())}}));
}

// `t` in the dtype of `first` (the op's first tensor, which sets it).
inline void check_dtype(const at::Tensor& t, const Arg& arg, const at::Tensor& first,
                        const Arg& first_arg) {
  check_defined(t, arg);
  TORCH_CHECK_TYPE(t.scalar_type() == first.scalar_type(),
                   say("dtype", {{"op", arg.op},
                                 {"arg", arg.name},
                                 {"expected", dtype_name(first.scalar_type())},
                                 {"first", first_arg.name},
                                 {"got", dtype_name(t.scalar_type())}}));
}

// The device type as torch.device spells it ("cuda"; the emulated device's own name).
inline void check_device_type(const at::Tensor& t, const Arg& arg, c10::DeviceType expected) {
  check_defined(t, arg);
  TORCH_CHECK(t.device().type() == expected,
              say("device_type", {{"op", arg.op},
                                  {"arg", arg.name},
                                  {"expected", c10::DeviceTypeName(expected, /*lower_case=*/true)},
                                  {"got", c10::str(t.device())}}));
}

inline void check_contiguous(const at::Tensor& t, const Arg& arg) {
  check_defined(t, arg);
  TORCH_CHECK(t.is_contiguous(), say("contiguous", {{"op", arg.op},
                                                    {"arg", arg.name},
                                                    {"sizes", c10::str(t.sizes())},
                                                    {"strides", c10::str(t.strides())}}));
}

inline void check_same_device(const at::Tensor& t, const Arg& arg, const at::Tensor& other,
                              const Arg& other_arg) {
  TORCH_CHECK(t.device() == other.device(), say("device", {{"op", arg.op},
                                                           {"arg", arg.name},
                                                           {"first", other_arg.name},
                                                           {"expected", c10::str(other.device())},
                                                           {"got", c10::str(t.device())}}));
}

// `what` names the dimensions for the reader, e.g. "(batch, state)".
inline void check_dim(const at::Tensor& t, const Arg& arg, int64_t ndim, const char* what) {
  check_defined(t, arg);
  TORCH_CHECK_VALUE(t.dim() == ndim,
                    say("dim", {{"op", arg.op},
                                {"arg", arg.name},
                                {"ndim", std::to_string(ndim)},
                                {"dimensions", ndim == 1 ? "dimension" : "dimensions"},
                                {"what", what},
                                {"got", std::to_string(t.dim())},
                                {"sizes", c10::str(t.sizes())}}));
}

// Size of dimension `dim` must be `expected`; `why` says where the expectation comes from.
inline void check_size(const at::Tensor& t, const Arg& arg, int64_t dim, int64_t expected,
                       const std::string& why) {
  TORCH_CHECK_VALUE(t.size(dim) == expected, say("size", {{"op", arg.op},
                                                          {"arg", arg.name},
                                                          {"expected", std::to_string(expected)},
                                                          {"dim", std::to_string(dim)},
                                                          {"why", why},
                                                          {"sizes", c10::str(t.sizes())}}));
}

inline void check_same_shape(const at::Tensor& t, const Arg& arg, const at::Tensor& other,
                             const Arg& other_arg) {
  TORCH_CHECK_VALUE(t.sizes() == other.sizes(), say("shape", {{"op", arg.op},
                                                              {"arg", arg.name},
                                                              {"other", other_arg.name},
                                                              {"expected", c10::str(other.sizes())},
                                                              {"got", c10::str(t.sizes())}}));
}

// What every op checks of all its tensor inputs together: dense, one floating dtype (the first
// input's), one device (the first input's, of type `device`) and, for kernels that index raw
// memory, contiguous. `args` lists the inputs in order, so the first offender is the one named.
// Devices are compared with the first input before the device type is checked, so an input left on
// another device gets the same message from every backend and from the fake kernel, whichever
// kernel the dispatcher picked for the mix: "`weights` must be on the same device as `input` (cpu),
// got meta".
using NamedTensor = std::pair<const at::Tensor&, Arg>;

// Whether a kernel indexes its inputs' memory raw, so that they must be contiguous too (stage 04).
enum class Memory { kAnyStrides, kContiguous };

inline void check_inputs(std::initializer_list<NamedTensor> args, c10::DeviceType device,
                         Memory memory = Memory::kAnyStrides) {
  const auto& [first, first_arg] = *args.begin();
  for (const auto& [t, arg] : args) check_strided(t, arg);
  check_floating(first, first_arg);
  for (const auto& [t, arg] : args) check_dtype(t, arg, first, first_arg);
  for (const auto& [t, arg] : args) check_same_device(t, arg, first, first_arg);
  check_device_type(first, first_arg, device);
  if (memory == Memory::kContiguous) {
    for (const auto& [t, arg] : args) check_contiguous(t, arg);
  }
}

}  // namespace workbook
