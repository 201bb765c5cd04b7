// The emulated device's stand-in for ATen/cuda/cub.h: the CUB algorithms the stages call, on
// the host, with CUB's semantics. radix_sort_pairs is stable and orders keys by the bits
// [begin_bit, end_bit) alone, signed keys with their sign bit flipped, as CUB's radix sort
// does; inclusive_sum and exclusive_sum are the scans of the same names.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#include "emulated_cuda.h"

namespace at::cuda::cub {

// The number of bits a key up to max_key needs (ATen's rule: at least 1).
inline int get_num_bits(uint64_t max_key) {
  int bits = 1;
  while (max_key >>= 1) ++bits;
  return bits;
}

namespace detail {
template <typename key_t>
uint64_t radix_bits(key_t key, int begin_bit, int end_bit) {
  using unsigned_t = std::make_unsigned_t<key_t>;
  unsigned_t u = static_cast<unsigned_t>(key);
  if constexpr (std::is_signed_v<key_t>) u ^= unsigned_t{1} << (sizeof(key_t) * 8 - 1);
  const int width = end_bit - begin_bit;
  const uint64_t mask = width >= 64 ? ~uint64_t{0} : (uint64_t{1} << width) - 1;
  return (static_cast<uint64_t>(u) >> begin_bit) & mask;
}
}  // namespace detail

template <typename key_t, typename value_t, typename OffsetT>
void radix_sort_pairs(const key_t* keys_in, key_t* keys_out, const value_t* values_in,
                      value_t* values_out, OffsetT n, bool descending = false, int begin_bit = 0,
                      int end_bit = sizeof(key_t) * 8) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const uint64_t ka = detail::radix_bits(keys_in[a], begin_bit, end_bit);
    const uint64_t kb = detail::radix_bits(keys_in[b], begin_bit, end_bit);
    return descending ? kb < ka : ka < kb;
  });
  // Through a copy: CUB allows keys_out to be the input of the next call, not of this one.
  std::vector<key_t> keys(static_cast<size_t>(n));
  std::vector<value_t> values(static_cast<size_t>(n));
  for (size_t i = 0; i < order.size(); ++i) {
    keys[i] = keys_in[order[i]];
    values[i] = values_in[order[i]];
  }
  std::copy(keys.begin(), keys.end(), keys_out);
  std::copy(values.begin(), values.end(), values_out);
}

template <typename input_t, typename output_t>
void inclusive_sum(const input_t* input, output_t* output, int64_t n) {
  output_t sum{};
  for (int64_t i = 0; i < n; ++i) output[i] = sum = sum + static_cast<output_t>(input[i]);
}

template <typename input_t, typename output_t>
void exclusive_sum(const input_t* input, output_t* output, int64_t n) {
  output_t sum{};
  for (int64_t i = 0; i < n; ++i) {
    const output_t item = static_cast<output_t>(input[i]);
    output[i] = sum;
    sum = sum + item;
  }
}

}  // namespace at::cuda::cub
