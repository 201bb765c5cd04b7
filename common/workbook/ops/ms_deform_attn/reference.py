"""Multi-scale deformable attention in plain PyTorch, two ways: the definition as loops
(ms_deform_attn_loops) and the reference (ms_deform_attn, one grid_sample per level).

The reference is what HF transformers and mmcv run where their CUDA kernel is not available: each
level of value sampled by grid_sample at every query's points, the samples weighted and summed.
Called on float64 copies of a sample's inputs it is what every kernel is compared with; in the
working dtype it is the baseline the benchmark times the kernels against.

    out[n, q, m D + d] = sum_{l, p} attention_weights[n, q, m, l, p] level_l[n, m, d](y, x)
    x = sampling_locations[n, q, m, l, p, 0] W_l - 0.5,   y = ... 1] H_l - 0.5

level_l being the H_l x W_l plane of value's rows [start_l, start_l + H_l W_l), bilinear with
zeros outside (grid_sample's align_corners=False, padding_mode="zeros").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def ms_deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                   attention_weights, im2col_step=None):
    """The op as one grid_sample per level: [N, Lq, M D]. Differentiable in value, locations and
    weights; level_start_index is implied by spatial_shapes (each level's rows follow the
    last's), as in the decomposition everyone runs."""
    batch, _, heads, channels = value.shape
    _, queries, _, levels, points, _ = sampling_locations.shape
    areas = [int(h) * int(w) for h, w in spatial_shapes.tolist()]
    per_level = value.split(areas, dim=1)
    grids = 2 * sampling_locations - 1  # [0, 1] -> grid_sample's [-1, 1]
    samples = []
    for level, ((height, width), rows) in enumerate(zip(spatial_shapes.tolist(), per_level)):
        # [N, H W, M, D] -> [N M, D, H, W]
        plane = rows.permute(0, 2, 3, 1).reshape(batch * heads, channels, height, width)
        # [N, Lq, M, P, 2] -> [N M, Lq, P, 2]
        grid = grids[:, :, :, level].transpose(1, 2).flatten(0, 1)
        if plane.numel() == 0 or grid.numel() == 0:
            # grid_sample refuses an empty plane: a level of no pixel samples zeros. Kept in
            # the graph (times 0), so every input still gets a gradient, of zeros.
            zero = 0 * (plane.sum() + grid.sum())
            samples.append(zero + plane.new_zeros(batch * heads, channels, queries, points))
            continue
        samples.append(F.grid_sample(plane, grid, mode="bilinear", padding_mode="zeros",
                                     align_corners=False))  # [N M, D, Lq, P]
    # [N, Lq, M, L, P] -> [N M, 1, Lq, L P]
    weights = attention_weights.transpose(1, 2).reshape(batch * heads, 1, queries,
                                                        levels * points)
    out = (torch.stack(samples, dim=-2).flatten(-2) * weights).sum(-1)  # [N M, D, Lq]
    return out.view(batch, heads * channels, queries).transpose(1, 2).contiguous()


def ms_deform_attn_loops(value, spatial_shapes, level_start_index, sampling_locations,
                         attention_weights):
    """The forward from the definition, one sample at a time, in Python floats (float64). For
    tiny sizes only; not differentiable. Reads level_start_index, as the kernels do."""
    batch, _, heads, channels = value.shape
    _, queries, _, levels, points, _ = sampling_locations.shape
    v = value.detach().double().tolist()
    loc = sampling_locations.detach().double().tolist()
    att = attention_weights.detach().double().tolist()
    shapes, starts = spatial_shapes.tolist(), level_start_index.tolist()
    out = [[[0.0] * (heads * channels) for _ in range(queries)] for _ in range(batch)]
    for n in range(batch):
        for q in range(queries):
            for m in range(heads):
                for l_, ((height, width), start) in enumerate(zip(shapes, starts)):
                    for p in range(points):
                        lx, ly = loc[n][q][m][l_][p]
                        x, y = lx * width - 0.5, ly * height - 0.5
                        if not (-1 < y < height and -1 < x < width):  # NaN too
                            continue
                        y0, x0 = math.floor(y), math.floor(x)
                        fy, fx = y - y0, x - x0
                        a = att[n][q][m][l_][p]
                        for r, c, w in ((y0, x0, (1 - fy) * (1 - fx)), (y0, x0 + 1, (1 - fy) * fx),
                                        (y0 + 1, x0, fy * (1 - fx)), (y0 + 1, x0 + 1, fy * fx)):
                            if 0 <= r < height and 0 <= c < width:
                                row = v[n][start + r * width + c][m]
                                for d in range(channels):
                                    out[n][q][m * channels + d] += a * w * row[d]
    return torch.tensor(out, dtype=torch.float64).reshape(batch, queries, heads * channels)
