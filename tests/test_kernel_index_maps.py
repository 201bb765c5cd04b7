"""What the emulated CUDA device cannot check of the kernels' launches and index maps, replayed.

The CUDA tests run every kernel's own source on the emulated device where no GPU is visible
(workbook/build/emulate.py): every block and thread of the real launch, against the float64
reference, with ASan under `make sanitize`. That retired the replays of this file that mirrored a
launch at its real limits (each output element written once at the cases the CUDA tests run: stage
04's flat map, stage 05's grid, stage 07's chunks at the real column budget and kMaxBlocks). What is
left is what the emulation cannot reach at a size a CPU runs in seconds, because it lives behind
a constant or a size the tests cannot change:

* the LLTM's row loop with gridDim.y capped low (the real cap, 65535 blocks, is reached only
  past 65535 x 8 rows: the CUDA edge cases reach it, once; here it loops many times);
* the 64-bit index path and the row loop of the case past 2^31 elements (no CPU holds it);
* the deformable convolution's chunk plans with a column budget of 16 KiB and of 1 byte (the
  real budget, 256 MiB, cuts only inputs far past test sizes into rows) and its grid-stride loops
  at 2 blocks instead of kMaxBlocks (2^20 blocks: a loop iterates only past 2^28 samples);
* the deterministic backward's runs on random keys, with 1 multiprocessor's filling grid;
* that the LLTM edge cases do reach the row loop and the early returns they are there for;
* that every kernel calls the host+device math its CPU kernel calls (lltm_math.h, bilinear.h),
  so the CPU suite tests the arithmetic the GPU runs.

Each replay names the C++ it mirrors and quotes its key lines in MIRRORED;
test_replays_quote_the_kernels finds every quoted line in the .cu file, so a kernel that changes
fails here until its replay changes with it. The replays run on torch tensors (CPU); an index is
an int64 there, and where a kernel computes in int32 the replay checks the values stay below 2^31.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from workbook import ops
from workbook.build.stages import STAGES_DIR
from workbook.ops import deform_conv2d as deform_op
from workbook.ops import lltm as lltm_op
from workbook.spec import Case

STAGE_04 = STAGES_DIR / "04_cuda_raw" / "csrc" / "lltm_cuda.cu"
STAGE_05 = STAGES_DIR / "05_cuda_accessors" / "csrc" / "lltm_cuda.cu"
STAGE_07 = STAGES_DIR / "07_cuda_library" / "csrc" / "deform_conv2d" / "cuda" / \
    "deform_conv2d_cuda.cu"
DEFORM_HEADER = STAGES_DIR.parent / "common" / "include" / "workbook" / "deform_conv2d.h"
INT32_MAX = 2**31 - 1
MAX_GRID_Y = 65535  # CUDA's limits on a launch
MAX_GRID_X = 2**31 - 1
MAX_BLOCK = 1024


NOTHING = torch.zeros(0, dtype=torch.long)


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


@dataclasses.dataclass(frozen=True)
class Launch:
    grid: tuple[int, int]  # gridDim.x, gridDim.y (z is 1 everywhere)
    block: tuple[int, int]  # blockDim.x, blockDim.y

    def __post_init__(self):  # what the CUDA runtime refuses as an invalid launch
        (gx, gy), (bx, by) = self.grid, self.block
        assert 1 <= gx <= MAX_GRID_X and 1 <= gy <= MAX_GRID_Y, f"invalid grid {self.grid}"
        assert bx >= 1 and by >= 1 and bx * by <= MAX_BLOCK, f"invalid block {self.block}"


def count_once(indices: torch.Tensor, size: int, what: str) -> None:
    """Every index in [0, size) appears exactly once in `indices`, and nothing else does."""
    assert indices.numel() == 0 or (indices.min() >= 0 and indices.max() < size), (
        f"{what}: writes outside [0, {size}): {indices.min().item()} .. {indices.max().item()}")
    counts = torch.bincount(indices, minlength=size)
    assert (counts == 1).all(), (f"{what}: {int((counts == 0).sum())} elements never written, "
                                 f"{int((counts > 1).sum())} written more than once")


# ------------------------------------------------------------------------------------------------
# LLTM, stage 04: one thread per element of the flat B x S state


def lltm_04_launch(batch: int, state: int) -> Launch | None:
    """lltm_cuda_forward / lltm_cuda_backward (launchers) and blocks_for: no launch for an empty
    state; else ceil(B S / 256) blocks of 256 threads in x."""
    numel = batch * state
    if numel == 0:  # if (old_cell.numel() == 0) return ...
        return None
    blocks = ceil_div(numel, 256)
    assert blocks <= INT32_MAX  # TORCH_CHECK(blocks <= INT32_MAX, ...)
    return Launch((blocks, 1), (256, 1))


# ------------------------------------------------------------------------------------------------
# LLTM, stages 05 and 06: a 2-D grid, x over the state, y over rows, a row loop over gridDim.y


def lltm_05_block(state: int) -> tuple[int, int]:
    """block_for: x the state rounded up to whole warps, at most 256; y = 256 / x rows."""
    x = min(ceil_div(state, 32) * 32, 256)
    return (x, 256 // x)


def lltm_05_launch(batch: int, state: int, max_grid_y: int = MAX_GRID_Y) -> Launch | None:
    """lltm_forward_cuda / lltm_backward_cuda and grid_for: no launch for an empty state; else
    ceil(S / block.x) blocks in x and ceil(B / block.y), at most kMaxGridY = 65535, in y.
    (max_grid_y: the same launch with a smaller cap, to run the row loop at a size a CPU
    enumerates.)"""
    if batch * state == 0:  # if (new_h.numel() == 0) return ...
        return None
    block = lltm_05_block(state)
    return Launch((ceil_div(state, block[0]), min(ceil_div(batch, block[1]), max_grid_y)), block)


def lltm_05_writes(batch: int, state: int, max_grid_y: int = MAX_GRID_Y) -> dict:
    """lltm_forward_kernel and lltm_backward_kernel: s = blockIdx.x blockDim.x + threadIdx.x
    (threads with s >= S return), then the row loop
        for (b = blockIdx.y blockDim.y + threadIdx.y; b < batch; b += gridDim.y blockDim.y)
    writing (b, s) of new_h, new_cell and d_old_cell, and (b, s), (b, S + s), (b, 2S + s) of
    d_gates. s depends on x alone and b on y alone, so the elements written are every column a
    live x thread takes, times every row a y thread takes: both are enumerated, thread by
    thread, and each must come out exactly once."""
    launch = lltm_05_launch(batch, state, max_grid_y)
    if launch is None:
        return {"columns": NOTHING, "rows": NOTHING, "launch": None}
    (gx, gy), (bx, by) = launch.grid, launch.block
    s = (torch.arange(gx)[:, None] * bx + torch.arange(bx)[None, :]).flatten()
    s = s[s < state]  # if (s >= state) return;
    first = (torch.arange(gy)[:, None] * by + torch.arange(by)[None, :]).flatten()
    stride = gy * by
    rows = torch.cat([first + k * stride for k in range(ceil_div(batch, stride))])
    rows = rows[rows < batch]
    if 3 * batch * state <= INT32_MAX:  # int32_t: the last b + stride tried must not wrap
        assert batch + stride <= INT32_MAX
    return {"columns": s, "rows": rows, "launch": launch}


def check_lltm_05(batch: int, state: int, max_grid_y: int = MAX_GRID_Y) -> None:
    found = lltm_05_writes(batch, state, max_grid_y)
    if batch * state == 0:
        assert found["launch"] is None
        return
    count_once(found["columns"], state, f"B {batch}, S {state}: columns of the state")
    count_once(found["rows"], batch, f"B {batch}, S {state}: rows")
    # d_gates: the three gate columns of s, each once per row, and so every one of the 3S.
    gate_columns = torch.cat([found["columns"] + k * state for k in range(3)])
    count_once(gate_columns, 3 * state, f"B {batch}, S {state}: columns of d_gates")


# ------------------------------------------------------------------------------------------------
# LLTM: the tests


@pytest.mark.parametrize(("batch", "state", "max_grid_y"),
                         [(20, 3, 2), (17, 3, 1), (9, 40, 2), (5, 257, 3), (70, 128, 4)], ids=str)
def test_lltm_stage_05_row_loop_at_a_small_cap(batch, state, max_grid_y):
    # The row loop with gridDim.y capped low, so that it runs several times at a small size.
    launch = lltm_05_launch(batch, state, max_grid_y)
    assert launch.grid[1] * launch.block[1] < batch  # the loop does run
    check_lltm_05(batch, state, max_grid_y)


def test_lltm_edge_cases_reach_the_row_loop_and_the_early_returns():
    """The CUDA edge cases the GPU tests run cover what they are there for: an empty launch,
    and a batch past 65535 blocks in y at state 3 (block 32 x 8) and at state 257 (256 x 1)."""
    looped, empty = set(), set()
    for case in lltm_op.CUDA_EDGE_CASES:
        launch = lltm_05_launch(case["batch"], case["state"])
        if launch is None:
            empty.add((case["batch"] == 0, case["state"] == 0))
        elif launch.grid[1] * launch.block[1] < case["batch"]:
            looped.add(case["state"])
    assert empty == {(True, False), (False, True), (True, True)}
    assert looped == {3, 257}
    assert lltm_05_block(128) == (128, 2) and lltm_05_block(3) == (32, 8)  # no idle half-blocks


def test_lltm_huge_case_takes_the_64_bit_path():
    case = lltm_op.HUGE_CASE
    batch, state = case["batch"], case["state"]
    assert batch * state > INT32_MAX and 3 * batch * state > INT32_MAX  # fits_32bit is false
    assert lltm_04_launch(batch, state).grid[0] <= INT32_MAX
    launch = lltm_05_launch(batch, state)
    assert launch.grid[1] * launch.block[1] < batch  # and the row loop runs too


# ------------------------------------------------------------------------------------------------
# The deformable convolution, stage 07


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The sizes the launchers read (workbook/deform_conv2d.h's Geometry)."""

    batch: int
    channels: int
    out_channels: int
    offset_groups: int
    height: int
    width: int
    taps: int
    out_h: int
    out_w: int

    @property
    def positions(self) -> int:
        return self.out_h * self.out_w

    @property
    def group_channels(self) -> int:
        return self.channels // self.offset_groups


def geometry(case: Case) -> Geometry:
    s = case.sizes
    out_h, out_w = deform_op.out_size(case)
    return Geometry(s["batch"], s["in_channels"], s["out_channels"], s["offset_groups"],
                    s["height"], s["width"], s["kernel_h"] * s["kernel_w"], out_h, out_w)


COLUMN_BUDGET = 256 << 20  # kColumnBudgetBytes
ENTRY_BYTES = 80  # kEntryBytes


def plan_chunks(g: Geometry, per_position: int, max_positions: int,
                budget: int = COLUMN_BUDGET) -> tuple[int, int]:
    """plan_chunks (workbook/deform_conv2d.h): (images, rows) of a chunk: whole images
    while one fits the budget, else blocks of output rows of one image. (budget: the same plan
    for a smaller budget, to cut small inputs into chunks.)"""
    assert g.out_w <= max_positions  # the CUDA backward's TORCH_CHECK before it plans
    positions = max(g.positions, 1)
    image_bytes = per_position * positions
    if image_bytes <= budget and positions <= max_positions:
        images = budget // max(image_bytes, 1)
        return (min(g.batch, max(1, images), max_positions // positions), g.out_h)
    row = max(g.out_w, 1)
    rows = budget // max(per_position * row, 1)
    return (1, min(g.out_h, max(1, rows), max_positions // row))


def for_each_chunk(g: Geometry, plan: tuple[int, int]) -> list[tuple[int, int, int, int]]:
    """for_each_chunk: Chunk{n0, images, p0, positions} in order."""
    images, rows = plan
    return [(n0, min(images, g.batch - n0), r0 * g.out_w, min(rows, g.out_h - r0) * g.out_w)
            for n0 in range(0, g.batch, images) for r0 in range(0, g.out_h, rows)]


def grid_for(count: int, slices: int = 1, max_blocks: int = 1 << 20) -> Launch:
    """grid_for: min(ceil(count / 256), kMaxBlocks = 2^20) blocks in x, `slices` in y.
    (max_blocks: a smaller kMaxBlocks, to run the grid-stride loops at small sizes.)"""
    return Launch((min(ceil_div(count, 256), max_blocks), slices), (256, 1))


def channel_slices(samples: int, channels: int) -> tuple[int, int]:
    """channel_slices: (slices, channels per slice) of an offset group's channels."""
    most = min(max(ceil_div(channels, 8), 1), 65535)  # kMinChannelsPerThread, kMaxSlices
    wanted = min(max(ceil_div(1 << 19, samples), 1), most)  # kTargetThreads
    per_slice = ceil_div(channels, wanted)
    return ceil_div(channels, per_slice), per_slice


def filling_blocks(most_items: int, sms: int) -> Launch:
    """filling_blocks: ceil(items / 256) blocks, at least 1, at most 8 per SM."""
    return Launch((min(max(ceil_div(most_items, 256), 1), 8 * sms), 1), (256, 1))


def visits(launch: Launch, count: int) -> torch.Tensor:
    """The items a grid-stride loop visits, one entry per visit (stage 07's kernels):
        for (int64_t t = first_item(); t < count; t += item_stride())
    first_item() = blockIdx.x blockDim.x + threadIdx.x, item_stride() = gridDim.x blockDim.x."""
    threads = launch.grid[0] * launch.block[0]
    first = torch.arange(threads)
    visited = torch.cat([first + k * threads for k in range(max(ceil_div(count, threads), 1))])
    return visited[visited < count]


def decode_sample(t: torch.Tensor, g: Geometry, chunk_positions: int):
    """decode_sample: t = ((i G + g) K + k) Pc + q -> (i, g, k, q)."""
    q = t % chunk_positions
    rest = t // chunk_positions
    k = rest % g.taps
    rest = rest // g.taps
    return rest // g.offset_groups, rest % g.offset_groups, k, q


def ragged(begin: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each k, the values begin[k] .. end[k] - 1: (owner k, value), flattened."""
    lengths = (end - begin).clamp(min=0)
    owner = torch.repeat_interleave(torch.arange(len(begin)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    return owner, begin[owner] + torch.arange(int(lengths.sum())) - starts[owner]


def sliced_channels(g: Geometry, chunk: tuple[int, int, int, int], max_blocks: int):
    """sample_columns_kernel and scatter_columns_atomic_kernel (launched by sample_columns and
    scatter_columns with grid_for(s.samples, slices)): every thread visits samples t in a
    grid-stride loop and, for each, the channels of its slice (slice_channels: blockIdx.y
    per_slice channels from the offset group's first). Returns, one entry per (sample, channel)
    a thread handles: (t, c)."""
    _, images, _, chunk_positions = chunk
    samples = images * g.offset_groups * g.taps * chunk_positions  # shape_of: s.samples
    slices, per_slice = channel_slices(samples, g.group_channels)
    launch = grid_for(samples, slices, max_blocks)
    t = visits(launch, samples)
    t = t.repeat(slices)
    y = torch.arange(slices).repeat_interleave(len(t) // slices)
    _, group, _, _ = decode_sample(t, g, chunk_positions)
    begin = group * g.group_channels + y * per_slice
    end = torch.minimum(begin + per_slice, (group + 1) * g.group_channels)
    owner, c = ragged(begin, end)
    return t[owner], c


def check_deform_chunk(g: Geometry, chunk, max_blocks: int, written: dict) -> None:
    """One chunk of the forward and backward: the kernels' writes into the chunk's buffers
    (each exactly once), and their writes into the whole outputs, collected in `written`."""
    n0, images, p0, chunk_positions = chunk
    columns = images * chunk_positions  # shape_of: s.columns
    samples = images * g.offset_groups * g.taps * chunk_positions
    width = g.channels * g.taps

    # sample_columns_kernel: columns[(c K + k) columns + i Pc + q], once each.
    t, c = sliced_channels(g, chunk, max_blocks)
    i, _, k, q = decode_sample(t, g, chunk_positions)
    count_once((c * g.taps + k) * columns + i * chunk_positions + q, width * columns,
               f"chunk {chunk}: columns")
    # scatter_columns_atomic_kernel: the same (sample, channel) pairs, so every grad column
    # value is added into grad_input once (atomically: many land on one pixel); its plane
    # ((n0 + i) C + c) lies inside grad_input.
    plane = (n0 + i) * g.channels + c
    assert plane.max() < g.batch * g.channels

    # offset_mask_gradients_kernel (grid_for(s.samples)): one thread per sample writes its two
    # offset gradients and its mask gradient.
    t = visits(grid_for(samples, 1, max_blocks), samples)
    i, group, k, q = decode_sample(t, g, chunk_positions)
    n, p = n0 + i, p0 + q
    gk, GK = group * g.taps + k, g.offset_groups * g.taps
    dy = (n * 2 * GK + 2 * gk) * g.positions + p
    written["grad_offset"].append(torch.cat([dy, dy + g.positions]))
    written["grad_mask"].append((n * GK + gk) * g.positions + p)
    written["chunks"].append((n * g.positions + p)[(k == 0) & (group == 0)])  # (n, p) once

    # corner_keys_kernel (grid_for(s.samples)): entries 4 t + j, j < 4; the sort buffers hold
    # 4 G K most entries.
    entries = (4 * t[:, None] + torch.arange(4)[None, :]).flatten()
    count_once(entries, 4 * samples, f"chunk {chunk}: corner entries")
    # sorted_entries_kernel decodes a sample's column from its entry number e in 32 bits its own
    # way; it must land where decode_sample puts it.
    e = entries
    sample = e >> 2
    rest = sample // chunk_positions
    q2 = sample - rest * chunk_positions
    k2 = rest % g.taps
    i2 = rest // g.taps // g.offset_groups
    i, _, k, q = decode_sample(sample, g, chunk_positions)
    assert torch.equal(k2 * columns + i2 * chunk_positions + q2,
                       k * columns + i * chunk_positions + q)


DEFORM_CASES = [*ops.get("deform_conv2d").cases,
                deform_op.torchvision_case("torchvision_b40", 40)]


def deform_plans(g: Geometry, budget: int) -> dict[str, tuple[int, int]]:
    """The chunk plans of the forward and of both backwards (all gradients wanted), as the
    launchers compute them for float32 (element 4)."""
    width, GK = g.channels * g.taps, g.offset_groups * g.taps
    backward = (2 * width + g.out_channels) * 4
    return {
        "forward": plan_chunks(g, (width + g.out_channels) * 4, 2**63 - 1, budget),
        "atomic": plan_chunks(g, backward, 2**63 - 1, budget),
        "deterministic": plan_chunks(g, backward + 4 * GK * ENTRY_BYTES,
                                     INT32_MAX // (4 * GK), budget),
    }


# At the real budget and kMaxBlocks the emulated device runs the kernels themselves.
@pytest.mark.parametrize("budget", [1 << 14, 1], ids=["16k", "1"])
@pytest.mark.parametrize("max_blocks", [2], ids=["2"])
@pytest.mark.parametrize("case", DEFORM_CASES, ids=lambda c: c.name)
def test_deform_conv2d_kernels_write_every_element_once(case, max_blocks, budget):
    """The chunk plans of a small budget (blocks of rows; a budget of 1 byte, one output row at
    a time), with the grid-stride loops at 2 blocks (so that each thread visits many samples)."""
    g = geometry(case)
    for mode, plan in deform_plans(g, budget).items():
        written = {"grad_offset": [], "grad_mask": [], "chunks": []}
        chunks = for_each_chunk(g, plan)
        assert chunks[0][1] * chunks[0][3] == max(ch[1] * ch[3] for ch in chunks)  # first largest
        for chunk in chunks:
            assert chunk[1] * chunk[3] <= plan[0] * plan[1] * g.out_w  # plan.most_positions
            check_deform_chunk(g, chunk, max_blocks, written)
        what = f"{case.name}, {mode} plan {plan}"
        count_once(torch.cat(written["chunks"]), g.batch * g.positions, f"{what}: chunks")
        if mode != "forward":
            GK = g.offset_groups * g.taps
            count_once(torch.cat(written["grad_offset"]), g.batch * 2 * GK * g.positions,
                       f"{what}: grad_offset")
            count_once(torch.cat(written["grad_mask"]), g.batch * GK * g.positions,
                       f"{what}: grad_mask")


def runs_of(keys: torch.Tensor, none: int):
    """sorted_entries_kernel's heads, the inclusive scan the launcher takes of them (runs), and
    run_starts_kernel's starts, each element of starts with the number of threads writing it."""
    count = len(keys)
    t = torch.arange(count)
    live = keys != none
    previous = torch.cat([keys[:1] - 1, keys[:-1]])
    heads = live & ((t == 0) | (previous != keys))  # heads[t] = live && (t == 0 || ...)
    runs = torch.cumsum(heads.long(), 0)  # at::cumsum_out(runs, heads, 0)
    number = int(runs[-1]) if count else 0
    writes = [runs[heads] - 1]  # if (heads[t]) starts[runs[t] - 1] = t
    following = torch.cat([keys[1:], keys.new_tensor([none])])
    ends = live & ((t + 1 == count) | (following == none))
    writes.append(runs[ends])  # starts[runs[t]] = t + 1
    starts = torch.full((count + 1,), -1)
    starts[runs[heads] - 1] = t[heads]
    starts[runs[ends]] = t[ends] + 1
    return heads, runs, number, torch.cat(writes), starts


@pytest.mark.parametrize("seed", range(6))
def test_deterministic_backward_runs_each_destination_once(seed):
    """The deterministic backward's steps 3-5 on sorted keys with repeats and corners outside
    the image (`none`): starts[r] is written once for every run r and once for the end; the
    gather's threads, (run, channel) pairs over filling_blocks' grid-stride loop, write each
    (destination, channel) once and sum each run's entries once per channel."""
    gen = torch.Generator().manual_seed(seed)
    images, groups, plane, group_channels = 2, 2, 6, 3
    none = images * groups * plane
    count = int(torch.randint(1, 200, (1,), generator=gen))
    keys = torch.randint(0, none + 1, (count,), generator=gen).sort().values
    heads, runs, number, writes, starts = runs_of(keys, none)
    assert number == len(torch.unique(keys[keys != none]))
    count_once(writes, number + 1 if number else 0, "starts")
    live = int((keys != none).sum())
    if number:
        assert starts[number] == live and torch.equal(starts[:number], heads.nonzero().flatten())

    # gather_runs_kernel, with items = runs x group channels over filling_blocks(most_runs x gc).
    most_runs = min(count, none)
    for sms in (1,):  # the emulated device has the H200's 132
        t = visits(filling_blocks(most_runs * group_channels, sms), number * group_channels)
        run, channel = t % max(number, 1), t // max(number, 1)
        key = keys[starts[run]] if number else keys[:0]
        pixel, image_group = key % plane, key // plane
        c = (image_group % groups) * group_channels + channel
        destination = ((image_group // groups) * groups * group_channels + c) * plane + pixel
        assert len(torch.unique(destination)) == len(destination) == number * group_channels
        # each (run, channel) sums entries starts[run] .. starts[run + 1] - 1: every live entry
        # once per channel, and only entries of its own destination.
        owner, e = ragged(starts[run], starts[run + 1])
        count_once(e * group_channels + channel[owner], live * group_channels, "gathered entries")
        assert torch.equal(keys[e], key[owner])


# ------------------------------------------------------------------------------------------------
# The replays against the kernels, and the shared math


MIRRORED = {
    STAGE_04: [
        "if (old_cell.numel() == 0) return {new_h, new_cell, gates};",
        "if (new_cell.numel() > 0) {",
        "const int64_t blocks = workbook::ceil_div<int64_t>(numel, kThreads);",
        "TORCH_CHECK(blocks <= INT32_MAX,",
        "<<<blocks_for(numel), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(",
        "return gates.numel() <= std::numeric_limits<int32_t>::max();",
        "constexpr int kThreads = 256;",
    ],
    STAGE_05: [
        "if (new_h.numel() == 0) return {new_h, new_cell, gates};",
        "if (d_old_cell.numel() > 0) {",
        "constexpr int kThreads = 256;", "constexpr int kWarp = 32;",
        "constexpr int64_t kMaxGridY = 65535;",
        "std::min<int64_t>(workbook::ceil_div<int64_t>(state, kWarp) * kWarp, kThreads);",
        "return dim3(static_cast<unsigned int>(x), static_cast<unsigned int>(kThreads / x));",
        "static_cast<unsigned int>(workbook::ceil_div<int64_t>(state, block.x)),",
        "static_cast<unsigned int>(std::min(workbook::ceil_div<int64_t>(batch, block.y), "
        "kMaxGridY)));",
        "<<<grid_for(batch, state, block), block, 0, stream>>>(",
        "const index_t s = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x;",
        "if (s >= state) return;",
        "const index_t rows_per_grid = static_cast<index_t>(gridDim.y) * blockDim.y;",
        "for (index_t b = static_cast<index_t>(blockIdx.y) * blockDim.y + threadIdx.y; b < batch; "
        "b += rows_per_grid) {",
        "new_cell[b][s] =", "new_h[b][s] =", "d_old_cell[b][s] =", "d_gates[b][s] =",
        "d_gates[b][state + s] =", "d_gates[b][2 * state + s] =",
        "return gates.numel() <= std::numeric_limits<int32_t>::max();",
    ],
    STAGE_07: [
        "constexpr int kThreads = 256;",
        "constexpr int64_t kMaxBlocks = int64_t{1} << 20;",
        "constexpr int64_t kMaxSlices = 65535;",
        "constexpr int64_t kTargetThreads = int64_t{1} << 19;",
        "constexpr int64_t kMinChannelsPerThread = 8;",
        "constexpr int64_t kColumnBudgetBytes = int64_t{256} << 20;",
        "constexpr int64_t kEntryBytes = 80;",
        "return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;",
        "return static_cast<int64_t>(gridDim.x) * blockDim.x;",
        "d.q = t % s.chunk_positions; index_t rest = t / s.chunk_positions; d.k = rest % s.taps; "
        "rest /= s.taps; d.g = rest % s.offset_groups; d.i = rest / s.offset_groups;",
        "begin = group_begin + static_cast<index_t>(blockIdx.y) * per_slice;",
        "end = min(begin + per_slice, group_begin + s.group_channels);",
        "scalar_t* out = columns + (c * s.taps + d.k) * s.columns + d.i * s.chunk_positions + d.q;",
        "for (; c < end; ++c, plane += s.plane, out += s.taps * s.columns) {",
        "acc_t* plane = grad_input + ((s.n0 + d.i) * s.channels + c) * s.plane;",
        "const int64_t e = 4 * t + j;",
        "heads[t] = live && (t == 0 || sorted_keys[t - 1] != key);",
        "const int32_t sample = e >> 2, positions = static_cast<int32_t>(s.chunk_positions);",
        "const int32_t rest = sample / positions, taps = static_cast<int32_t>(s.taps);",
        "const int32_t q = sample - rest * positions, k = rest % taps;",
        "const int32_t i = rest / taps / static_cast<int32_t>(s.offset_groups);",
        "if (heads[t]) starts[runs[t] - 1] = static_cast<int32_t>(t);",
        "if (t + 1 == count || sorted_keys[t + 1] == none) starts[runs[t]] = "
        "static_cast<int32_t>(t + 1);",
        "const int64_t items = runs * s.group_channels;",
        "const int32_t run = static_cast<int32_t>(t % runs);",
        "const index_t channel_in_group = static_cast<index_t>(t / runs);",
        "const index_t pixel = key % s.plane, image_group = key / s.plane;",
        "const index_t i = image_group / s.offset_groups, g = image_group % s.offset_groups;",
        "grad_input[((s.n0 + i) * s.channels + c) * s.plane + pixel] += sum;",
        "scalar_t* out = grad_offset + (n * 2 * GK + 2 * gk) * s.positions + p;",
        "out[s.positions] =",
        "grad_mask[(n * GK + gk) * s.positions + p] =",
        "std::min(ceil_div<int64_t>(count, kThreads), kMaxBlocks)",
        "std::clamp<int64_t>(ceil_div(channels, kMinChannelsPerThread), 1, kMaxSlices);",
        "std::clamp<int64_t>(ceil_div(kTargetThreads, samples), 1, most);",
        "const int64_t per_slice = ceil_div(channels, wanted);",
        "return {ceil_div(channels, per_slice), per_slice};",
        "const int64_t fill = int64_t{8} * sms;",
        "std::clamp<int64_t>(ceil_div<int64_t>(most_items, kThreads), 1, fill)",
        "<<<filling_blocks(most_runs * s.group_channels), kThreads, 0, stream>>>(",
        "const int64_t most_runs = std::min(count, none);",
        "s.samples = i(ch.images * g.offset_groups * g.taps() * ch.positions);",
        "s.columns = i(ch.images * ch.positions);",
        "plan_chunks(g, (width + g.out_channels) * input.element_size(), kColumnBudgetBytes);",
        "(want_weight ? width : 0) + (want_columns_grad ? width : 0) + g.out_channels;",
        "values * element + (deterministic ? 4 * GK * kEntryBytes : 0);",
        "deterministic ? std::numeric_limits<int32_t>::max() / (4 * GK) : kNoLimit;",
        "TORCH_CHECK(g.out_w <= max_positions,",
        "plan_chunks(g, per_position, kColumnBudgetBytes, max_positions);",
    ],
    DEFORM_HEADER: [
        "const int64_t positions = std::max<int64_t>(g.positions(), 1);",
        "if (image_bytes <= budget_bytes && positions <= max_positions) {",
        "const int64_t images = budget_bytes / std::max<int64_t>(image_bytes, 1);",
        "return {std::min({g.batch, std::max<int64_t>(1, images), max_positions / positions}), "
        "g.out_h};",
        "const int64_t row = std::max<int64_t>(g.out_w, 1);",
        "return {1, std::min({g.out_h, std::max<int64_t>(1, rows), max_positions / row})};",
        "for (int64_t n0 = 0; n0 < g.batch; n0 += plan.images) { "
        "for (int64_t r0 = 0; r0 < g.out_h; r0 += plan.rows) {",
        "fn(Chunk{n0, std::min(plan.images, g.batch - n0), r0 * g.out_w, "
        "std::min(plan.rows, g.out_h - r0) * g.out_w});",
    ],
}


def normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def kernel_source(path: Path) -> str:
    """A kernel file's text, with its kernel header's (x.cuh beside x.cu: stages 05 and 07 keep
    their kernels and launchers there, shared with stage 10, and their ATen glue in the .cu)."""
    header = path.with_suffix(".cuh")
    return path.read_text() + ("\n" + header.read_text() if header.is_file() else "")


@pytest.mark.parametrize("path", MIRRORED, ids=lambda p: p.parent.parent.name
                         if p.is_relative_to(STAGES_DIR) else p.name)
def test_replays_quote_the_kernels(path):
    source = normalized(kernel_source(path))
    missing = [line for line in MIRRORED[path] if normalized(line) not in source]
    assert not missing, (f"{path.name} (or its .cuh) no longer has these lines, which a replay "
                         f"here mirrors: update the replay with the kernel:\n  "
                         + "\n  ".join(missing))


LLTM_MATH = ("workbook/lltm_math.h", ["workbook::sigmoid(", "workbook::elu(", "workbook::d_elu("])
SHARED_MATH = {
    STAGE_04: LLTM_MATH,
    STAGE_05: LLTM_MATH,
    STAGE_07: ("workbook/bilinear.h", ["workbook::bilinear::locate<", ".weight(j)",
                                       ".d_weight_dy(j)", ".d_weight_dx(j)"]),
}
CPU_KERNELS = {
    "workbook/lltm_math.h": [STAGES_DIR / "05_cuda_accessors" / "csrc" / "lltm_cpu.h"],
    "workbook/bilinear.h": [STAGES_DIR / "06_op_library" / "csrc" / "deform_conv2d" / "cpu" /
                            "deform_conv2d_cpu.h"],
}


@pytest.mark.parametrize("path", SHARED_MATH, ids=lambda p: p.parent.parent.name)
def test_kernels_share_the_math_of_the_cpu_kernels(path):
    header, calls = SHARED_MATH[path]
    source = kernel_source(path)
    assert f'#include "{header}"' in source
    missing = [call for call in calls if call not in source]
    assert not missing, f"{path.name} does not call {missing} from {header}"
    for cpu in CPU_KERNELS[header]:
        assert f'#include "{header}"' in cpu.read_text(), f"{cpu.name} does not include {header}"
