// workbook/lltm_math.h: the scalar math of the LLTM cell, for host and device code alike.
//
// Each function is a template on the scalar type, marked __host__ __device__ when compiled by
// nvcc, so one definition serves the fused CPU loop and the CUDA kernels. Reduced-precision types
// (half, bfloat16) are not meant to be passed in directly: kernels convert to their compute type
// (at::opmath_type<scalar_t>, float for both) first, as ATen's own kernels do.
//
// Derivatives are written in terms of the pre-activation value z, as the backward pass sees it.
#pragma once

#include <cmath>

#include "workbook/host_device.h"

namespace workbook {

template <typename T>
WORKBOOK_HOST_DEVICE inline T sigmoid(T z) {
  return T(1) / (T(1) + std::exp(-z));
}

// d/dz sigmoid(z) = s (1 - s) with s = sigmoid(z).
template <typename T>
WORKBOOK_HOST_DEVICE inline T d_sigmoid(T z) {
  const T s = sigmoid(z);
  return (T(1) - s) * s;
}

// d/dz tanh(z) = 1 - tanh(z)^2.
template <typename T>
WORKBOOK_HOST_DEVICE inline T d_tanh(T z) {
  const T t = std::tanh(z);
  return T(1) - t * t;
}

// Exponential linear unit: z for z > 0, alpha (e^z - 1) otherwise. The LLTM uses alpha = 1.
// elu and d_elu compute exp(z) for every z and then choose, rather than branch around it: the
// same values (exp of a large z is computed and discarded), and a choice, unlike a branch around
// a call, lets a compiler vectorise a loop over them (stage 10's kernels: workbook/cpu.h).
template <typename T>
WORKBOOK_HOST_DEVICE inline T elu(T z, T alpha = T(1)) {
  const T below = alpha * (std::exp(z) - T(1));
  return z > T(0) ? z : below;
}

template <typename T>
WORKBOOK_HOST_DEVICE inline T d_elu(T z, T alpha = T(1)) {
  const T below = alpha * std::exp(z);
  return z > T(0) ? T(1) : below;
}

}  // namespace workbook
