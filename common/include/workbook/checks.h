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
// The exception class follows what went wrong: WORKBOOK_CHECK_TYPE (TypeError) for dtypes and
// layouts, WORKBOOK_CHECK_VALUE (ValueError) for shapes, WORKBOOK_CHECK (RuntimeError) for
// devices: ATen's TORCH_CHECK_TYPE, _VALUE and TORCH_CHECK (on the stable ABI, see below).
// Every check is cheap (metadata only): call them at the top of an op, before dispatching a kernel.
//
// Only metadata is read, so at::Tensor (ATen/core/Tensor.h) is all this header includes, not
// <ATen/ATen.h> (every op: twice as long to parse): a file that keeps to per-operator headers, as
// stage 01's z2xy.cpp does, stays quick to compile with the checks in it.
//
// Two ABIs, one header. Compiled for the stable ABI (TORCH_TARGET_VERSION defined: stage 10),
// the same checks read a torch::stable::Tensor, which answers the same questions (dim, sizes,
// scalar_type, layout, device) through libtorch's C shims. What the stable ABI lacks is typed
// exceptions: c10::TypeError and c10::ValueError are C++ classes of libtorch, and only a
// std::exception crosses into it safely. So there a failed check throws std::runtime_error (a
// RuntimeError in Python) whose message starts with the class it would have had,
// "[ValueError] lltm: `old_h` must ...", and the library's Python side raises it as that class
// (stage 06's extops/errors.py, `call`), with the message that follows.
#pragma once

#include <cctype>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#ifdef TORCH_TARGET_VERSION
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/DeviceType.h>
#include <torch/headeronly/core/Layout.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <stdexcept>

namespace workbook {
using Tensor = torch::stable::Tensor;
using Device = torch::stable::Device;
using IntList = torch::headeronly::IntHeaderOnlyArrayRef;  // what an int[] argument arrives as

// The dtype of t, any dtype. Tensor::scalar_type() converts the shim's dtype through a table of
// the dtypes the stable ABI supports and throws on the others ("Not yet supported ScalarType 46"
// for torch.uint6, the bits types, ...), so a check could not name them. The shim's value is
// c10::ScalarType's number (AOTInductor's shims define every dtype so), taken here as it is.
inline c10::ScalarType dtype_of(const Tensor& t) {
  int32_t dtype = 0;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(t.get(), &dtype));
  return static_cast<c10::ScalarType>(dtype);
}
}  // namespace workbook
#define WORKBOOK_CHECK_TYPE(cond, message) \
  WORKBOOK_THROW_UNLESS_(cond, std::string("[TypeError] ") + (message))
#define WORKBOOK_CHECK_VALUE(cond, message) \
  WORKBOOK_THROW_UNLESS_(cond, std::string("[ValueError] ") + (message))
#define WORKBOOK_CHECK(cond, message) WORKBOOK_THROW_UNLESS_(cond, message)
#define WORKBOOK_THROW_UNLESS_(cond, message)       \
  do {                                              \
    if (!(cond)) throw std::runtime_error(message); \
  } while (false)
#else
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

namespace workbook {
using Tensor = at::Tensor;
using Device = c10::Device;
using IntList = c10::IntArrayRef;

inline c10::ScalarType dtype_of(const Tensor& t) { return t.scalar_type(); }
}  // namespace workbook
// A failed check raises TypeError (_TYPE), ValueError (_VALUE) or RuntimeError (plain).
#define WORKBOOK_CHECK_TYPE(cond, message) TORCH_CHECK_TYPE(cond, message)
#define WORKBOOK_CHECK_VALUE(cond, message) TORCH_CHECK_VALUE(cond, message)
#define WORKBOOK_CHECK(cond, message) TORCH_CHECK(cond, message)
#endif

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
inline std::string dtype_name(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Double:
      return "torch.float64";
    case c10::ScalarType::Float:
      return "torch.float32";
    case c10::ScalarType::Half:
      return "torch.float16";
    case c10::ScalarType::BFloat16:
      return "torch.bfloat16";
    case c10::ScalarType::ComplexDouble:
      return "torch.complex128";
    case c10::ScalarType::ComplexFloat:
      return "torch.complex64";
    case c10::ScalarType::ComplexHalf:
      return "torch.complex32";
    case c10::ScalarType::Long:
      return "torch.int64";
    case c10::ScalarType::Int:
      return "torch.int32";
    case c10::ScalarType::Short:
      return "torch.int16";
    case c10::ScalarType::Char:
      return "torch.int8";
    case c10::ScalarType::Byte:
      return "torch.uint8";
    case c10::ScalarType::Bool:
      return "torch.bool";
    default: {
      std::string name = c10::toString(type);
      for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      return "torch." + name;
    }
  }
}

// Sizes or strides as a list prints them ("[2, 3]").
template <typename Ints>
std::string list_string(const Ints& values) {
  std::string text = "[";
  for (std::size_t i = 0; i < values.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(values[i]);
  }
  return text + "]";
}

// A message from its parts, as TORCH_CHECK joins its arguments: text, integers, and lists of
// integers (sizes, an IntList) as list_string writes them.
template <typename... Parts>
std::string text(const Parts&... parts) {
  const auto piece = [](const auto& part) -> std::string {
    using Part = std::decay_t<decltype(part)>;
    if constexpr (std::is_convertible_v<const Part&, std::string_view>) {
      return std::string(std::string_view(part));
    } else if constexpr (std::is_integral_v<Part>) {
      return std::to_string(part);
    } else {
      return list_string(part);
    }
  };
  return (std::string() + ... + piece(parts));
}

// a * b and a + b into *out, or true where the exact result does not fit in int64 (c10's
// safe_numerics, which the stable ABI cannot include; the builtins of gcc, clang and nvcc).
inline bool mul_overflows(int64_t a, int64_t b, int64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}
inline bool add_overflows(int64_t a, int64_t b, int64_t* out) {
  return __builtin_add_overflow(a, b, out);
}

// A device type as torch.device spells it ("cuda"), and a device as it prints ("cuda:0").
inline std::string device_type_name(c10::DeviceType type) {
#ifdef TORCH_TARGET_VERSION
  switch (type) {  // the types a stable-ABI kernel can be registered for
    case c10::DeviceType::CPU:
      return "cpu";
    case c10::DeviceType::CUDA:
      return "cuda";
    case c10::DeviceType::Meta:
      return "meta";
#ifdef WORKBOOK_EMULATED_DEVICE_NAME
    case c10::DeviceType::PrivateUse1:  // the emulated CUDA device (common/emulate)
      return WORKBOOK_EMULATED_DEVICE_NAME;
#endif
    default:
      return "device type " + std::to_string(static_cast<int>(type));
  }
#else
  return c10::DeviceTypeName(type, /*lower_case=*/true);  // the emulated device's own name too
#endif
}

inline std::string device_name(const Device& device) {
  const std::string type = device_type_name(device.type());
  return device.index() < 0 ? type : type + ":" + std::to_string(device.index());
}

// A layout as str(layout) prints it ("torch.sparse_coo").
inline std::string layout_name(c10::Layout layout) {
  switch (layout) {
    case c10::kStrided:
      return "torch.strided";
    case c10::kSparse:
      return "torch.sparse_coo";
    case c10::kSparseCsr:
      return "torch.sparse_csr";
    case c10::kSparseCsc:
      return "torch.sparse_csc";
    case c10::kSparseBsr:
      return "torch.sparse_bsr";
    case c10::kSparseBsc:
      return "torch.sparse_bsc";
    case c10::kMkldnn:
      return "torch._mkldnn";
    case c10::kJagged:
      return "torch.jagged";
    default:
      return "layout " + std::to_string(static_cast<int>(layout));
  }
}

// ----------------------------------------------------------------------------------------------
// Checks

inline void check_defined(const Tensor& t, const Arg& arg) {
  WORKBOOK_CHECK_VALUE(t.defined(), say("undefined", {{"op", arg.op}, {"arg", arg.name}}));
}

// The dtypes the kernels compute in: an allow-list, not at::isFloatingType, which also admits the
// float8 types (no kernel here computes in float8: refused by name, not failed inside a kernel).
inline bool supported_floating(c10::ScalarType type) {
  return type == c10::ScalarType::Double || type == c10::ScalarType::Float ||
         type == c10::ScalarType::Half || type == c10::ScalarType::BFloat16;
}

// Dense (strided) tensors only: a sparse, mkldnn or nested tensor is refused by name here rather
// than failing later inside ATen with a message that names no argument.
inline void check_strided(const Tensor& t, const Arg& arg) {
  check_defined(t, arg);
  WORKBOOK_CHECK_TYPE(
      t.layout() == c10::kStrided,
      say("dense", {{"op", arg.op}, {"arg", arg.name}, {"got", layout_name(t.layout())}}));
}

inline void check_floating(const Tensor& t, const Arg& arg) {
  check_strided(t, arg);
  WORKBOOK_CHECK_TYPE(
      supported_floating(dtype_of(t)),
      say("floating", {{"op", arg.op}, {"arg", arg.name}, {"got", dtype_name(dtype_of(t))}}));
}

// `t` in the dtype of `first` (the op's first tensor, which sets it).
inline void check_dtype(const Tensor& t, const Arg& arg, const Tensor& first,
                        const Arg& first_arg) {
  check_defined(t, arg);
  WORKBOOK_CHECK_TYPE(dtype_of(t) == dtype_of(first),
                      say("dtype", {{"op", arg.op},
                                    {"arg", arg.name},
                                    {"expected", dtype_name(dtype_of(first))},
                                    {"first", first_arg.name},
                                    {"got", dtype_name(dtype_of(t))}}));
}

// The device type as torch.device spells it ("cuda"; the emulated device's own name).
inline void check_device_type(const Tensor& t, const Arg& arg, c10::DeviceType expected) {
  check_defined(t, arg);
  WORKBOOK_CHECK(t.device().type() == expected,
                 say("device_type", {{"op", arg.op},
                                     {"arg", arg.name},
                                     {"expected", device_type_name(expected)},
                                     {"got", device_name(t.device())}}));
}

inline void check_contiguous(const Tensor& t, const Arg& arg) {
  check_defined(t, arg);
  WORKBOOK_CHECK(t.is_contiguous(), say("contiguous", {{"op", arg.op},
                                                       {"arg", arg.name},
                                                       {"sizes", list_string(t.sizes())},
                                                       {"strides", list_string(t.strides())}}));
}

inline void check_same_device(const Tensor& t, const Arg& arg, const Tensor& other,
                              const Arg& other_arg) {
  WORKBOOK_CHECK(t.device() == other.device(),
                 say("device", {{"op", arg.op},
                                {"arg", arg.name},
                                {"first", other_arg.name},
                                {"expected", device_name(other.device())},
                                {"got", device_name(t.device())}}));
}

// `what` names the dimensions for the reader, e.g. "(batch, state)".
inline void check_dim(const Tensor& t, const Arg& arg, int64_t ndim, const char* what) {
  check_defined(t, arg);
  WORKBOOK_CHECK_VALUE(t.dim() == ndim,
                       say("dim", {{"op", arg.op},
                                   {"arg", arg.name},
                                   {"ndim", std::to_string(ndim)},
                                   {"dimensions", ndim == 1 ? "dimension" : "dimensions"},
                                   {"what", what},
                                   {"got", std::to_string(t.dim())},
                                   {"sizes", list_string(t.sizes())}}));
}

// Size of dimension `dim` must be `expected`; `why` says where the expectation comes from.
inline void check_size(const Tensor& t, const Arg& arg, int64_t dim, int64_t expected,
                       const std::string& why) {
  WORKBOOK_CHECK_VALUE(t.size(dim) == expected, say("size", {{"op", arg.op},
                                                             {"arg", arg.name},
                                                             {"expected", std::to_string(expected)},
                                                             {"dim", std::to_string(dim)},
                                                             {"why", why},
                                                             {"sizes", list_string(t.sizes())}}));
}

inline bool same_sizes(const Tensor& a, const Tensor& b) {
  if (a.dim() != b.dim()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != b.size(d)) return false;
  }
  return true;
}

inline void check_same_shape(const Tensor& t, const Arg& arg, const Tensor& other,
                             const Arg& other_arg) {
  WORKBOOK_CHECK_VALUE(same_sizes(t, other), say("shape", {{"op", arg.op},
                                                           {"arg", arg.name},
                                                           {"other", other_arg.name},
                                                           {"expected", list_string(other.sizes())},
                                                           {"got", list_string(t.sizes())}}));
}

// What every op checks of all its tensor inputs together: dense, one floating dtype (the first
// input's), one device (the first input's, of type `device`) and, for kernels that index raw
// memory, contiguous. `args` lists the inputs in order, so the first offender is the one named.
// Devices are compared with the first input before the device type is checked, so an input left on
// another device gets the same message from every backend and from the fake kernel, whichever
// kernel the dispatcher picked for the mix: "`weights` must be on the same device as `input` (cpu),
// got meta".
using NamedTensor = std::pair<const Tensor&, Arg>;

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
