// Stage 10: the dtype dispatch of the glue that runs one kernel per floating dtype, CPU or CUDA.
//
//   dispatch_floating(type, op, fn)   AT_DISPATCH_FLOATING_TYPES_AND2(kHalf, kBFloat16, ...): a
//                                     switch that calls fn with a value of the dtype's C++ type
//   opmath_type(type)                 at::toOpMathType: the dtype a kernel sums in (float for
//                                     half and bfloat16)
//
// c10::Half and c10::BFloat16 are torch/headeronly's here, the same classes c10's headers give
// an ATen build. (The LLTM's CPU glue writes its own switch: it is an exercise of the stage.)
#pragma once

#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <stdexcept>
#include <string>

#include "workbook/checks.h"

namespace stable_dtypes {

// fn(scalar_t{}) for the dtype `type`: the ops' checks have refused every other dtype by then;
// `op` names the op in the error a dtype without a kernel would raise.
template <typename Fn>
void dispatch_floating(c10::ScalarType type, const char* op, const Fn& fn) {
  switch (type) {
    case c10::ScalarType::Double:
      return fn(double{});
    case c10::ScalarType::Float:
      return fn(float{});
    case c10::ScalarType::Half:
      return fn(c10::Half{});
    case c10::ScalarType::BFloat16:
      return fn(c10::BFloat16{});
    default:
      throw std::runtime_error(std::string(op) + ": no kernel for dtype " +
                               workbook::dtype_name(type));
  }
}

inline c10::ScalarType opmath_type(c10::ScalarType type) {
  return type == c10::ScalarType::Double ? type : c10::ScalarType::Float;
}

}  // namespace stable_dtypes
