"""Multi-scale deformable attention (stage 09): the descriptor.

    ms_deform_attn(value [N, S, M, D], spatial_shapes [L, 2] int64, level_start_index [L] int64,
                   sampling_locations [N, Lq, M, L, P, 2], attention_weights [N, Lq, M, L, P])
        -> [N, Lq, M D]

Deformable DETR's op (models/ops, MSDeformAttnFunction) and its conventions: locations (x, y) in
[0, 1] of each level, sampled as grid_sample(align_corners=False, padding_mode="zeros") would.
A case's sizes: batch, queries, heads, channels, points, levels, and h<l>, w<l> for each level.
"""

from __future__ import annotations

import zlib

import torch

from workbook.ops.ms_deform_attn import reference
from workbook.spec import BadInput, Case, OpSpec, Sample, other_device

ARG_NAMES = ("value", "spatial_shapes", "level_start_index", "sampling_locations",
             "attention_weights")


def level_shapes(case: Case) -> list[tuple[int, int]]:
    return [(case[f"h{level}"], case[f"w{level}"]) for level in range(case["levels"])]


def level_table(shapes, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """spatial_shapes [L, 2] and level_start_index [L] (int64) of a list of (height, width)."""
    spatial_shapes = torch.tensor(shapes, dtype=torch.int64).reshape(-1, 2)
    areas = spatial_shapes.prod(1)
    starts = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])
    return spatial_shapes.to(device), starts.to(device)


def make(case: Case, *, device="cpu", dtype=torch.float32, requires_grad=True,
         seed=None) -> Sample:
    """value uniform in +-1, attention weights uniform in [0, 1), sampling locations from a pixel
    grid a pixel wider than each level on every side (so some points fall outside, some at the
    border), each point's fractional pixel coordinates in [0.1, 0.9].

    Why that margin: the location gradient jumps where a point crosses a pixel row or column (the
    bilinear weights switch to the next pair of pixels), and a float32 kernel that rounds a point
    across the line from the float64 reference's would differ there by the jump, not by rounding.
    """
    s = case.sizes
    gen = torch.Generator().manual_seed(
        zlib.crc32(repr(sorted(s.items())).encode()) if seed is None else seed)
    n, q, m, d, p = s["batch"], s["queries"], s["heads"], s["channels"], s["points"]
    shapes = level_shapes(case)
    spatial_shapes, level_start_index = level_table(shapes, device)
    values = sum(h * w for h, w in shapes)

    def grad(t):
        return t.to(device=device, dtype=dtype).requires_grad_(requires_grad)

    value = torch.rand(n, values, m, d, generator=gen, dtype=torch.float64) * 2 - 1
    size = torch.tensor([[w, h] for h, w in shapes], dtype=torch.float64)  # (W, H) per level
    pixel = torch.rand(n, q, m, len(shapes), p, 2, generator=gen, dtype=torch.float64)
    pixel = pixel * (size[:, None, :] + 2) - 1.5  # in [-1.5, size + 0.5)
    pixel = pixel.floor() + 0.1 + 0.8 * (pixel - pixel.floor())
    locations = (pixel + 0.5) / size[:, None, :].clamp(min=1)
    weights = torch.rand(n, q, m, len(shapes), p, generator=gen, dtype=torch.float64)
    return Sample(case.name, (grad(value), spatial_shapes, level_start_index, grad(locations),
                              grad(weights)), arg_names=ARG_NAMES)


def case(name: str, batch: int, queries: int, heads: int, channels: int, points: int,
         shapes: list[tuple[int, int]], **options) -> Case:
    sizes = {"batch": batch, "queries": queries, "heads": heads, "channels": channels,
             "points": points, "levels": len(shapes)}
    for level, (h, w) in enumerate(shapes):
        sizes.update({f"h{level}": h, f"w{level}": w})
    return Case(name, sizes, **options)


# Deformable DETR's configuration (8 heads of 32 channels, 4 levels of 4 points), small: the
# case threads call at once (tests/test_concurrency.py).
DETR_SMALL = case("detr_small_b2_q20", 2, 20, 8, 32, 4, [(8, 10), (4, 5), (2, 3), (1, 2)],
                  full_gradcheck=False)


def bad_inputs(device: str) -> list[BadInput]:
    """Inputs refused with a message naming the argument, from their metadata alone (so the fake
    kernel refuses them too). The valid ones: batch 2, 3 queries, 2 heads of 4 channels, levels
    3 x 4 and 2 x 2 (S 16), 2 points, on the device make() is given, one argument replaced."""
    valid = case("valid", 2, 3, 2, 4, 2, [(3, 4), (2, 2)])

    def good(**changes):
        def build(on):
            named = dict(zip(ARG_NAMES, make(valid, device=on, requires_grad=False).args))
            named.update({k: v(on) if callable(v) else v for k, v in changes.items()})
            return Sample("bad", tuple(named[k] for k in ARG_NAMES), arg_names=ARG_NAMES)
        return build

    def t(*shape, dtype=torch.float32, elsewhere=False):
        return lambda on: torch.zeros(*shape, dtype=dtype,
                                      device=other_device(on) if elsewhere else on)

    op = r"ms_deform_attn: "
    return [
        BadInput("int64_value", good(value=t(2, 16, 2, 4, dtype=torch.int64)), TypeError,
                 op + r"`value` must be a float64, float32, float16 or bfloat16 tensor"),
        BadInput("float64_locations", good(sampling_locations=t(2, 3, 2, 2, 2, 2,
                                                                dtype=torch.float64)),
                 TypeError, op + r"`sampling_locations` must have dtype torch.float32 \(the "
                                 r"dtype of `value`\)"),
        BadInput("half_weights", good(attention_weights=t(2, 3, 2, 2, 2, dtype=torch.float16)),
                 TypeError, op + r"`attention_weights` must have dtype torch.float32"),
        # The op takes int64 level tables; its functional form converts int32 ones (mmcv's) and
        # says so when it refuses another dtype.
        BadInput("int16_spatial_shapes", good(spatial_shapes=t(2, 2, dtype=torch.int16)),
                 TypeError, op + r"`spatial_shapes` must be a torch.int64 (or torch.int32 )?"
                                 r"tensor, got torch.int16"),
        BadInput("float_level_start_index", good(level_start_index=t(2)), TypeError,
                 op + r"`level_start_index` must be a torch.int64 (or torch.int32 )?tensor, got "
                      r"torch.float32"),
        BadInput("weights_on_another_device",
                 good(attention_weights=t(2, 3, 2, 2, 2, elsewhere=True)), RuntimeError,
                 op + r"`attention_weights` must be on the same device as `value`"),
        BadInput("level_start_index_on_another_device",
                 good(level_start_index=t(2, dtype=torch.int64, elsewhere=True)), RuntimeError,
                 op + r"`level_start_index` must be on the same device as `value`"),
        BadInput("value_3d", good(value=t(2, 16, 8)), ValueError,
                 op + r"`value` must have 4 dimensions \(batch, values, heads, channels\)"),
        BadInput("spatial_shapes_1d", good(spatial_shapes=t(4, dtype=torch.int64)), ValueError,
                 op + r"`spatial_shapes` must have 2 dimensions \(levels, 2\)"),
        BadInput("level_start_index_2d", good(level_start_index=t(2, 1, dtype=torch.int64)),
                 ValueError, op + r"`level_start_index` must have 1 dimension \(levels\)"),
        BadInput("locations_5d", good(sampling_locations=t(2, 3, 2, 2, 4)), ValueError,
                 op + r"`sampling_locations` must have 6 dimensions"),
        BadInput("weights_6d", good(attention_weights=t(2, 3, 2, 2, 2, 1)), ValueError,
                 op + r"`attention_weights` must have 5 dimensions"),
        BadInput("no_level", good(spatial_shapes=t(0, 2, dtype=torch.int64),
                                  level_start_index=t(0, dtype=torch.int64)), ValueError,
                 op + r"`spatial_shapes` must have at least 1 level"),
        BadInput("spatial_shapes_triples", good(spatial_shapes=t(2, 3, dtype=torch.int64)),
                 ValueError, op + r"`spatial_shapes` must have size 2 in dimension 1"),
        BadInput("level_start_index_length", good(level_start_index=t(3, dtype=torch.int64)),
                 ValueError, op + r"`level_start_index` must have size 2 in dimension 0 "
                                  r"\(levels of `spatial_shapes`\)"),
        BadInput("locations_batch", good(sampling_locations=t(1, 3, 2, 2, 2, 2)), ValueError,
                 op + r"`sampling_locations` must have size 2 in dimension 0 \(batch size of "
                      r"`value`\)"),
        BadInput("locations_heads", good(sampling_locations=t(2, 3, 1, 2, 2, 2)), ValueError,
                 op + r"`sampling_locations` must have size 2 in dimension 2 \(heads"),
        BadInput("locations_levels", good(sampling_locations=t(2, 3, 2, 3, 2, 2)), ValueError,
                 op + r"`sampling_locations` must have size 2 in dimension 3 \(levels"),
        BadInput("locations_not_pairs", good(sampling_locations=t(2, 3, 2, 2, 2, 3)), ValueError,
                 op + r"`sampling_locations` must have size 2 in dimension 5"),
        BadInput("weights_queries", good(attention_weights=t(2, 4, 2, 2, 2)), ValueError,
                 op + r"`attention_weights` must have size 3 in dimension 1 \(queries"),
        BadInput("weights_points", good(attention_weights=t(2, 3, 2, 2, 3)), ValueError,
                 op + r"`attention_weights` must have size 2 in dimension 4 \(points"),
    ]


def bad_level_tables(device: str) -> list[BadInput]:
    """Level tables refused by the kernels, which read their values (a fake kernel cannot): the
    valid sample of bad_inputs with spatial_shapes or level_start_index replaced."""
    valid = case("valid", 2, 3, 2, 4, 2, [(3, 4), (2, 2)])

    def good(shapes=None, starts=None):
        def build(on):
            named = dict(zip(ARG_NAMES, make(valid, device=on, requires_grad=False).args))
            if shapes is not None:
                named["spatial_shapes"] = torch.tensor(shapes, dtype=torch.int64, device=on)
            if starts is not None:
                named["level_start_index"] = torch.tensor(starts, dtype=torch.int64, device=on)
            return Sample("bad", tuple(named[k] for k in ARG_NAMES), arg_names=ARG_NAMES)
        return build

    op = r"ms_deform_attn: "
    return [
        BadInput("shapes_cover_fewer_rows", good([[3, 4], [1, 2]], [0, 12]), ValueError,
                 op + r"`spatial_shapes` must tile the 16 rows of `value` \(dimension 1\): its "
                      r"levels' areas \(height \* width\) sum to 14"),
        BadInput("shapes_cover_more_rows", good([[3, 4], [3, 3]], [0, 12]), ValueError,
                 op + r"`spatial_shapes` must tile the 16 rows of `value` .* levels 0..1 already "
                      r"cover more"),
        BadInput("negative_height", good([[-3, 4], [2, 2]], [0, 12]), ValueError,
                 op + r"`spatial_shapes` must hold non-negative \(height, width\) pairs, got "
                      r"\(-3, 4\) at level 0"),
        BadInput("start_not_running_sum", good(starts=[0, 11]), ValueError,
                 op + r"`level_start_index` must be the running sum .* level 1 starts at row 12, "
                      r"got 11"),
        BadInput("start_not_zero", good(starts=[1, 13]), ValueError,
                 op + r"`level_start_index` .* level 0 starts at row 0, got 1"),
        BadInput("area_overflows", good([[2**32, 2**32], [2, 2]], [0, 0]), ValueError,
                 op + r"`spatial_shapes` must tile the 16 rows of `value` .* levels 0..0 already "
                      r"cover more \(level 0: 4294967296 x 4294967296\)"),
    ]


def baselines():
    """What the demo times extops.ms_deform_attn against: the grid_sample decomposition HF
    transformers and mmcv run without their CUDA kernel."""
    return {"grid_sample decomposition": reference.ms_deform_attn}


OP = OpSpec(
    name="ms_deform_attn",
    arg_names=ARG_NAMES,
    output_names=("out",),
    reference=reference.ms_deform_attn,
    make=make,
    cases=(
        case("b1_q5_m1_d8_l1_p1", 1, 5, 1, 8, 1, [(4, 6)]),
        case("b2_q7_m2_d30_l2_p3", 2, 7, 2, 30, 3, [(5, 3), (2, 4)]),
        case("b3_q4_m3_d5_l4_p2", 3, 4, 3, 5, 2, [(6, 5), (3, 3), (2, 1), (1, 1)]),
        case("b1_q3_m2_d71_l2_p2", 1, 3, 2, 71, 2, [(3, 3), (2, 2)], full_gradcheck=False),
        # A level of no pixel: its points sample zeros.
        case("b2_q3_m2_d4_empty_level", 2, 3, 2, 4, 2, [(3, 2), (0, 4), (2, 2)]),
        case("b1_q2_m1_d1030_l2_p2", 1, 2, 1, 1030, 2, [(2, 3), (1, 2)], full_gradcheck=False),
        DETR_SMALL,
    ),
    batch_key="batch",
    demo_case=case("demo_detr_levels_32", 1, 1360, 8, 32, 4, [(32, 32), (16, 16), (8, 8), (4, 4)]),
    # L P samples of 4 corners each per output: float32's rounding is small next to it; half's
    # 11 and bfloat16's 8 bits dominate.
    tolerances={torch.float64: (1e-7, 1e-7), torch.float32: (1e-5, 2e-5),
                torch.float16: (2e-2, 2e-2), torch.bfloat16: (8e-2, 8e-2)},
    bad_inputs=bad_inputs,
    concurrency_case=DETR_SMALL,
    baselines=baselines,
)
