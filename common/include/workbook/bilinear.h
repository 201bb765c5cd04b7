// workbook/bilinear.h: bilinear sampling of an H x W plane at a fractional point, and its
// derivatives, for host and device code alike.
//
// Deformable convolution reads its input between pixels. The value at (y, x) blends the four
// pixels around the point, each weighted by the area of the rectangle opposite it:
//
//              x0            x0 + 1
//      y0      c0 ---------- c1            y0 = floor(y), ly = y - y0     (in [0, 1))
//               |      :     |             x0 = floor(x), lx = x - x0
//               |  ly  :     |
//               |......*     |  * = (y, x)   weight(c0) = (1 - ly)(1 - lx)
//               |  lx        |               weight(c1) = (1 - ly) lx
//      y0 + 1  c2 ---------- c3              weight(c2) = ly (1 - lx)
//                                            weight(c3) = ly lx
//
//   value  = sum_c weight(c) v(c),    v(c) = the pixel at corner c, 0 where c is outside the plane
//   d/dy   = sum_c d_weight_dy(c) v(c)   (d_weight_dy: -(1 - lx), -lx, 1 - lx, lx)
//   d/dx   = sum_c d_weight_dx(c) v(c)   (d_weight_dx: -(1 - ly), 1 - ly, -ly, ly)
//
// Conventions: torchvision's deform_conv2d, which are grid_sample's with padding_mode="zeros":
//
// * the plane is surrounded by zeros: a corner outside it contributes nothing, so a point with
//   y <= -1, y >= H, x <= -1 or x >= W has value 0 (at exactly y = -1 the only corners inside
//   have weight ly = 0);
// * at an exact integer coordinate the derivative is that of the cell [floor(y), floor(y) + 1),
//   the derivative from the right. In particular at exactly y = -1 (x inside) d/dy is v(c2, c3)
//   blended over x, not 0: torchvision gives that offset gradient, and so do we;
// * no float is converted to an integer before the range check: an offset of +-inf or 1e30 is a
//   point outside the plane (value 0, derivatives 0, all finite), never an undefined cast;
// * a NaN coordinate makes ly and lx NaN, hence the value and both derivatives NaN: the error
//   shows in the output and the offset and mask gradients. All its corners are invalid, so a
//   kernel that scatters into the input's gradient skips it (it has no place to go).
//
// Use: Point<T> s = locate(y, x, height, width), then s.valid(c) and s.index(c) for the corners
// (64-bit plane indices, 0 for an invalid corner so a load stays in bounds), s.weight(c),
// s.d_weight_dy(c), s.d_weight_dx(c); interpolate(plane, s) gathers the value. T is the compute
// type: float for float, half and bfloat16 data, double for double.
#pragma once

#include <cmath>
#include <cstdint>

#include "workbook/host_device.h"

namespace workbook::bilinear {

template <typename T>
struct Point {
  int64_t height, width;  // of the plane
  int64_t y0, x0;         // corner c0 (row, column); 0 when !in_range
  T ly, lx;               // fractional parts: in [0, 1) in range, 0 outside, NaN for NaN input
  bool in_range;          // -1 <= y < height and -1 <= x < width: some corner may be inside

  // Corner c in 0..3 is c0, c1, c2, c3 of the picture: bit 1 of c steps down, bit 0 right.
  WORKBOOK_HOST_DEVICE int64_t row(int c) const { return y0 + (c >> 1); }
  WORKBOOK_HOST_DEVICE int64_t col(int c) const { return x0 + (c & 1); }

  WORKBOOK_HOST_DEVICE bool valid(int c) const {
    const int64_t r = row(c), q = col(c);
    return in_range && r >= 0 && r < height && q >= 0 && q < width;
  }

  // Row-major index of corner c in the plane; 0 for an invalid corner (a safe address whose
  // value the caller must not use: multiply by valid(c), or skip).
  WORKBOOK_HOST_DEVICE int64_t index(int c) const { return valid(c) ? row(c) * width + col(c) : 0; }

  WORKBOOK_HOST_DEVICE T weight(int c) const {
    return ((c & 2) ? ly : T(1) - ly) * ((c & 1) ? lx : T(1) - lx);
  }
  WORKBOOK_HOST_DEVICE T d_weight_dy(int c) const {
    return ((c & 2) ? T(1) : T(-1)) * ((c & 1) ? lx : T(1) - lx);
  }
  WORKBOOK_HOST_DEVICE T d_weight_dx(int c) const {
    return ((c & 2) ? ly : T(1) - ly) * ((c & 1) ? T(1) : T(-1));
  }
};

// Where (y, x), in pixels of a height x width plane, falls: see the conventions above.
template <typename T>
WORKBOOK_HOST_DEVICE inline Point<T> locate(T y, T x, int64_t height, int64_t width) {
  Point<T> s{height, width, 0, 0, T(0), T(0), false};
  // Comparisons first, in floating point: false for NaN, and +-inf or 1e30 never reach a cast.
  s.in_range = y >= T(-1) && y < static_cast<T>(height) && x >= T(-1) && x < static_cast<T>(width);
  if (s.in_range) {
    const T fy = std::floor(y), fx = std::floor(x);
    s.y0 = static_cast<int64_t>(fy);
    s.x0 = static_cast<int64_t>(fx);
    s.ly = y - fy;
    s.lx = x - fx;
  } else if (y != y || x != x) {  // NaN: carry it into every weight
    s.ly = s.lx = (y != y) ? y : x;
  }
  return s;
}

// The bilinear value at s from a row-major plane (any element type convertible to T). Invalid
// corners read as 0 but still multiply their weight, so a NaN weight makes the value NaN.
template <typename T, typename scalar_t>
WORKBOOK_HOST_DEVICE inline T interpolate(const scalar_t* plane, const Point<T>& s) {
  T value = T(0);
  for (int c = 0; c < 4; ++c) {
    const T v = s.valid(c) ? static_cast<T>(plane[s.index(c)]) : T(0);
    value += s.weight(c) * v;
  }
  return value;
}

}  // namespace workbook::bilinear
