"""The multi-scale deformable attention benchmark: extops against the grid_sample decomposition.

Run card
  make bench OP=ms_deform_attn   or   python bench/run.py --op ms_deform_attn [--smoke]
  writes bench/results/ms_deform_attn/<machine>.{json,md,png}

What it measures (the harness, common/workbook/measure/harness.py, validates, times and reports):
  configurations  Deformable DETR at an 800 x 1333 input: its encoder (levels 100 x 167, 50 x 84,
                  25 x 42, 13 x 21: S = Lq = 22,223) at batch 1 and 2, and its decoder (300 and
                  900 queries over the same levels) at batch 2; 8 heads of 32 channels, 4 points
  implementations every stage whose stage.toml lists `ms_deform_attn`, and the grid_sample
                  decomposition HF transformers and mmcv run without their CUDA kernel
                  (reference.ms_deform_attn, in float32)
  phases          forward, forward + backward
  targets         on the CPU, 1 thread: forward >= 20x and forward + backward >= 10x the
                  decomposition at every size; 2 threads >= 1.8x faster than 1; peak memory of
                  forward + backward no more than the decomposition's

Napkin floor of the encoder at batch 1, per pass: 22,223 queries x 8 heads x 16 samples = 2.8M
samples, each 4 corners x 32 channels: 0.36 G multiply-adds (0.73 GFLOP) over a 23 MB value
tensor. At 16 float32 FMAs a cycle (one AVX-512 unit) and 3 GHz that is 7.6 ms of arithmetic; the
gathers (4 rows of 128 bytes per sample, 1.5 GB of cache lines if none hit) bound it from below
too. The backward does twice the arithmetic (a dot product and a scatter per corner).
"""

from __future__ import annotations

import torch

from workbook import ops
from workbook.measure import harness
from workbook.measure.harness import Config, Impl, OpBench, Plan, Target
from workbook.ops.ms_deform_attn import case, reference
from workbook.spec import Case, Sample

SPEC = ops.get("ms_deform_attn")
LEVELS = ((100, 167), (50, 84), (25, 42), (13, 21))  # Deformable DETR's pyramid at 800 x 1333
PIXELS = sum(h * w for h, w in LEVELS)  # 22,223


def config(name: str, batch: int, queries: int, levels=LEVELS, heads: int = 8,
           channels: int = 32, points: int = 4) -> Config:
    sizes = dict(case(name, batch, queries, heads, channels, points, list(levels)).sizes)
    shown = " ".join(f"{h}x{w}" for h, w in levels)
    return Config(name, sizes, f"batch {batch}, {queries} queries, levels {shown}, {heads} heads "
                               f"of {channels}, {points} points")


def plan(device: str, smoke: bool) -> Plan:
    threads = tuple(sorted({1, min(2, torch.get_num_threads())})) if device == "cpu" else ()
    if smoke:
        tiny = ((8, 10), (4, 5), (2, 3), (1, 2))
        main = config("encoder_b1", 1, sum(h * w for h, w in tiny), tiny)
        return Plan((main, config("decoder_b2_q300", 2, 30, tiny)), min_run_time=0.02,
                    profile_iters=2, threads=threads, memory=("encoder_b1",))
    configs = (config("encoder_b1", 1, PIXELS), config("encoder_b2", 2, PIXELS),
               config("decoder_b2_q300", 2, 300), config("decoder_b2_q900", 2, 900))
    # The decomposition's encoder forward + backward takes seconds on the CPU: min_blocks keeps
    # three calls per measurement, so its median has an IQR.
    return Plan(configs, min_run_time=0.5, profile_iters=3, rounds=3, threads=threads,
                min_blocks=3, memory=("encoder_b1", "decoder_b2_q900"))


def sample(config: Config, device: str, dtype: torch.dtype) -> Sample:
    return SPEC.make(Case(config.name, config.sizes), device=device, dtype=dtype, seed=0)


def implementations(device: str) -> list[Impl]:
    return [Impl("decomposition", "grid_sample decomposition (HF transformers, mmcv)",
                 reference.ms_deform_attn)]


def targets(device: str) -> list[Target]:
    out = []
    for i in ops.implementations("ms_deform_attn", device):
        key, name = harness.stage_key(i.stage), f"stage {i.stage.number:02d}"
        for c in ("encoder_b1", "encoder_b2", "decoder_b2_q300", "decoder_b2_q900"):
            if device == "cpu":  # issue 46's targets are for one thread
                out += [Target(f"{name} forward >= 20x the decomposition, 1 thread, {c}", c, key,
                               "decomposition", "forward", 20.0, threads=1),
                        Target(f"{name} forward + backward >= 10x the decomposition, 1 thread, "
                               f"{c}", c, key, "decomposition", "forward_backward", 10.0,
                               threads=1)]
        if device == "cpu":
            out.append(Target(f"{name} forward + backward, 2 threads >= 1.8x faster than 1",
                              "encoder_b1", key, "1 thread", "forward_backward", 1.8,
                              kind="threads"))
        out.append(Target(f"{name} forward + backward memory within 1x of the decomposition's",
                          "encoder_b1", key, "decomposition", "forward_backward", 1.0,
                          kind="memory"))
    return out


BENCH = OpBench(
    op="ms_deform_attn",
    title="Multi-scale deformable attention benchmark",
    spec=SPEC,
    phases=("forward", "forward_backward"),
    baselines=("decomposition",),
    plan=plan,
    sample=sample,
    implementations=implementations,
    targets=targets,
)
