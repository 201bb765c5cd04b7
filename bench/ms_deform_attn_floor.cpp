// The floor of multi-scale deformable attention's CPU forward: what the loads alone cost.
//
// Run card (1 thread; no torch, a second to compile)
//   g++ -O3 -march=native -Icommon/include bench/ms_deform_attn_floor.cpp -o build/msda_floor
//   build/msda_floor
//
// At Deformable DETR's encoder size (S = Lq = 22,223 over 4 levels, 8 heads of 32 channels, 4
// points) a forward reads 2.8M samples x 4 corner rows of value, each row 32 floats (128 bytes,
// two cache lines) chosen by the sampling point: 1.5 GB of lines from a 23 MB tensor, for 0.36 G
// multiply-adds. The arithmetic takes milliseconds; the loads are the floor. This probe times,
// for two kinds of sampling points, the loads with nothing else (the corner rows' offsets computed
// beforehand, the rows summed unweighted): query by query (the forward's order), head by head
// (the backward's), and head by head from a copy of value with each head's rows side by side
// ([M, S, D], the copy timed too):
//
//   random  uniform over each level, a pixel past every edge: the benchmark's points
//           (workbook.ops.ms_deform_attn.make), with no locality at all;
//   local   within 4 pixels of the query's own point on every level: a trained model's offsets.
//
// Compare the stage 09 kernel's forward (make bench OP=ms_deform_attn) with these.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "workbook/bilinear.h"

namespace {

constexpr int64_t kHeads = 8, kLevels = 4, kPoints = 4, kChannels = 32;
constexpr int64_t kShapes[kLevels][2] = {{100, 167}, {50, 84}, {25, 42}, {13, 21}};
typedef float Row __attribute__((vector_size(64)));  // 16 channels

template <typename F>
double median_ms(F f) {
  std::vector<double> times;
  for (int i = 0; i < 7; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    times.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Where each sample's corners start: the pixel of its top-left corner, relative to the head's
// first row, moved inside the level so that all four corners are (the probe reads four rows for
// every sample; the kernel skips a corner outside). Query by query, head by head, as the kernel's
// forward reads them; 4 bytes a sample, against the kernel's 12 (its point and weight).
std::vector<int32_t> corners(bool local, int64_t pixels) {
  std::mt19937 gen(0);
  std::uniform_real_distribution<float> u(0, 1);
  std::vector<int32_t> first;
  first.reserve(pixels * kHeads * kLevels * kPoints);
  for (int64_t q = 0; q < pixels; ++q) {
    const int64_t on_top = std::min<int64_t>(q, kShapes[0][0] * kShapes[0][1] - 1);
    const float qx = (on_top % kShapes[0][1] + 0.5f) / kShapes[0][1];
    const float qy = (on_top / kShapes[0][1] + 0.5f) / kShapes[0][0];
    for (int64_t m = 0; m < kHeads; ++m) {
      int64_t start = 0;
      for (int64_t l = 0; l < kLevels; ++l) {
        const int64_t h = kShapes[l][0], w = kShapes[l][1];
        for (int64_t p = 0; p < kPoints; ++p) {
          const float x = local ? qx * w - 0.5f + (u(gen) - 0.5f) * 8 : u(gen) * (w + 2) - 2;
          const float y = local ? qy * h - 0.5f + (u(gen) - 0.5f) * 8 : u(gen) * (h + 2) - 2;
          const int64_t row = std::clamp<int64_t>(static_cast<int64_t>(std::floor(y)), 0, h - 2);
          const int64_t col = std::clamp<int64_t>(static_cast<int64_t>(std::floor(x)), 0, w - 2);
          first.push_back(static_cast<int32_t>(start + row * w + col));
        }
        start += h * w;
      }
    }
  }
  return first;
}

// Sums the four corner rows of every sample of each (query, head) into out, unweighted: rows
// `stride` floats apart (M D as value lies, D in a copy with each head's rows side by side),
// heads `heads_apart` floats apart; query by query (each query's heads in turn, the forward's
// order) or, with `head_major`, head by head (each head's queries in turn, the backward's).
float gather(const std::vector<float>& value, const std::vector<int32_t>& first, int64_t stride,
             int64_t heads_apart, bool head_major, std::vector<float>& out) {
  const int64_t samples = kLevels * kPoints, queries = first.size() / samples / kHeads;
  for (int64_t k = 0; k < queries * kHeads; ++k) {
    const int64_t q = head_major ? k % queries : k / kHeads;
    const int64_t m = head_major ? k / queries : k % kHeads;
    const int64_t head = q * kHeads + m;
    const float* base = value.data() + m * heads_apart;
    Row a = {}, b = {};
    for (int64_t t = 0; t < samples; ++t) {
      const int64_t down = kShapes[t / kPoints][1];  // the level's width: the next pixel row
      const int64_t pixel = first[head * samples + t];
      for (const int64_t corner : {pixel, pixel + 1, pixel + down, pixel + down + 1}) {
        Row x, y;
        std::memcpy(&x, base + corner * stride, sizeof(x));
        std::memcpy(&y, base + corner * stride + 16, sizeof(y));
        a += x;
        b += y;
      }
    }
    std::memcpy(out.data() + head * kChannels, &a, sizeof(a));
    std::memcpy(out.data() + head * kChannels + 16, &b, sizeof(b));
  }
  return out[0];
}

}  // namespace

int main() {
  int64_t pixels = 0;
  for (const auto& shape : kShapes) pixels += shape[0] * shape[1];
  std::vector<float> value(pixels * kHeads * kChannels), by_head(value.size());
  std::vector<float> out(pixels * kHeads * kChannels);
  std::mt19937 gen(1);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto& v : value) v = u(gen);
  const double lines = 2.0 * pixels * kHeads * kLevels * kPoints * 4;
  std::printf(
      "encoder, batch 1: %lld queries x %lld heads x %lld samples, 4 corner rows of %lld "
      "floats each: %.1fM cache lines, %.2f G multiply-adds, value %.1f MB\n",
      static_cast<long long>(pixels), static_cast<long long>(kHeads),
      static_cast<long long>(kLevels * kPoints), static_cast<long long>(kChannels), lines / 1e6,
      lines / 2 * kChannels / 1e9, value.size() * 4 / 1e6);
  for (bool local : {false, true}) {
    const auto first = corners(local, pixels);
    const int64_t as_is = kHeads * kChannels;
    const double in_place = median_ms([&] { gather(value, first, as_is, kChannels, false, out); });
    const double by_heads = median_ms([&] { gather(value, first, as_is, kChannels, true, out); });
    const double copied = median_ms([&] {
      for (int64_t s = 0; s < pixels; ++s) {
        for (int64_t m = 0; m < kHeads; ++m) {
          std::memcpy(&by_head[(m * pixels + s) * kChannels], &value[(s * kHeads + m) * kChannels],
                      kChannels * sizeof(float));
        }
      }
      gather(by_head, first, kChannels, pixels * kChannels, true, out);
    });
    std::printf(
        "%s points, the loads alone: query by query %.1f ms (%.1f ns a line), head by head "
        "%.1f ms, head by head from a copy with each head's rows side by side %.1f ms "
        "(the copy included)\n",
        local ? "local " : "random", in_place, in_place * 1e6 / lines, by_heads, copied);
  }
}
