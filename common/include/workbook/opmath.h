// workbook/opmath.h: the type a kernel computes in, on both ABIs.
//
// workbook::opmath_t<T> is float for c10::Half and c10::BFloat16 (loaded and stored as 16 bits,
// blended in float), T itself for float and double: what ATen's at::opmath_type says, for kernel
// headers that include nothing of ATen's (stage 05's lltm_cuda.cuh, stage 07's
// deform_conv2d_cuda.cuh), so that stage 10 compiles them on the stable ABI. The two 16-bit types
// are header-only there (torch/headeronly/util), the same classes ATen's c10/util headers give.
#pragma once

#include <type_traits>

#ifdef TORCH_TARGET_VERSION
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>
#else
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#endif

namespace workbook {

template <typename T>
using opmath_t =
    std::conditional_t<std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>, float, T>;

}  // namespace workbook
