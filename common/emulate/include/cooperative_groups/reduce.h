// The emulated device's stand-in for cooperative_groups/reduce.h: cg::reduce over a tile, by
// shuffles (every rank gets the result), with the operators CUDA's header names.
#pragma once

#include "../cooperative_groups.h"

namespace cooperative_groups {

template <typename T>
struct plus {
  T operator()(const T& a, const T& b) const { return a + b; }
};
template <typename T>
struct less {
  T operator()(const T& a, const T& b) const { return b < a ? b : a; }
};
template <typename T>
struct greater {
  T operator()(const T& a, const T& b) const { return a < b ? b : a; }
};

// A butterfly: after the step at distance d each rank holds the reduction of its 2d neighbours;
// a commutative op gives every rank the same value.
template <typename Tile, typename T, typename Op>
T reduce(const Tile& tile, T value, Op op, WORKBOOK_EMULATE_CALLER) {
  for (unsigned distance = static_cast<unsigned>(tile.size()) / 2; distance > 0; distance /= 2) {
    value = op(value, tile.shfl_xor(value, distance, file, line));
  }
  return value;
}

}  // namespace cooperative_groups
