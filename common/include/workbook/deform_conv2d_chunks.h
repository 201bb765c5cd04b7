// workbook/deform_conv2d_chunks.h: how the deformable convolution's kernels cut a batch into
// chunks, so that the column buffers of one chunk stay within a memory budget. Shared by the CPU
// kernel (stage 06) and the CUDA kernel (stage 07), which choose their own budgets (32 MiB on the
// CPU, 256 MiB on a GPU: its GEMMs want more columns to fill it).
//
// A batch is cut into chunks of whole images when one image fits the budget, else each image
// into blocks of whole output rows. The plan is made once; the chunks are then visited in order,
// the largest first, so a kernel allocates its buffers once, at that size.
#pragma once

#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "workbook/deform_conv2d_checks.h"

namespace workbook::deform_conv2d {

// One chunk of the work: images [n0, n0 + images), output positions [p0, p0 + positions) of each
// (whole rows, so p0 is a multiple of Wo).
struct Chunk {
  int64_t n0, images, p0, positions;
};

// How a batch is cut: chunks of `images` whole images, or, when one image alone exceeds the
// budget (then images == 1), blocks of `rows` output rows of each image.
struct ChunkPlan {
  int64_t images, rows;
  // The positions of the largest chunk: what the buffers are allocated for.
  int64_t most_positions(const Geometry& g) const { return images * rows * g.out_w; }
};

constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();

// a * b, or kNoLimit where the product would overflow (a size that large exceeds any budget).
inline int64_t saturating_mul(int64_t a, int64_t b) {
  int64_t out = 0;
  return c10::mul_overflows<int64_t>(a, b, &out) ? kNoLimit : out;
}

// bytes_per_position: the bytes of the buffers that grow with a chunk's positions. max_positions:
// a cap on the positions of one chunk besides the budget (the CUDA kernel's deterministic
// backward sorts fewer than 2^31 entries at once); the caller makes sure one output row is within
// it. Empty geometries (no position) plan one chunk of everything, which visits nothing.
inline ChunkPlan plan_chunks(const Geometry& g, int64_t bytes_per_position, int64_t budget_bytes,
                             int64_t max_positions = kNoLimit) {
  const int64_t positions = std::max<int64_t>(g.positions(), 1);
  const int64_t image_bytes = saturating_mul(bytes_per_position, positions);
  if (image_bytes <= budget_bytes && positions <= max_positions) {
    const int64_t images = budget_bytes / std::max<int64_t>(image_bytes, 1);
    return {std::min({g.batch, std::max<int64_t>(1, images), max_positions / positions}), g.out_h};
  }
  const int64_t row = std::max<int64_t>(g.out_w, 1);
  const int64_t rows = budget_bytes / std::max<int64_t>(saturating_mul(bytes_per_position, row), 1);
  return {1, std::min({g.out_h, std::max<int64_t>(1, rows), max_positions / row})};
}

// The chunks in order, fn(chunk) for each. The first is the largest.
template <typename Fn>
void for_each_chunk(const Geometry& g, const ChunkPlan& plan, const Fn& fn) {
  for (int64_t n0 = 0; n0 < g.batch; n0 += plan.images) {
    for (int64_t r0 = 0; r0 < g.out_h; r0 += plan.rows) {
      fn(Chunk{n0, std::min(plan.images, g.batch - n0), r0 * g.out_w,
               std::min(plan.rows, g.out_h - r0) * g.out_w});
    }
  }
}

}  // namespace workbook::deform_conv2d
