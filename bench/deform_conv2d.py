"""The deformable convolution benchmark: the stages' op against torchvision and plain PyTorch.

Run card
  make bench OP=deform_conv2d   or   python bench/run.py --op deform_conv2d [--smoke] [--device cpu]
  writes bench/results/deform_conv2d/<machine>.{json,md,png}: cpu-2threads, nvidia-h200

What it measures (the harness, bench/harness.py, validates, times and reports):
  configurations  main: N 4, C 64 -> 64, 56 x 56, 3 x 3, pad 1, with mask (a ResNet stage-2 layer);
                  small: N 8, C 32 -> 32, 28 x 28; torchvision: torchvision's test configuration at
                  batch 33 (groups, offset groups, strides, dilations all off 1); on a GPU also
                  large: N 16, C 256 -> 256, 64 x 64
  inputs          the descriptor's (workbook/ops/deform_conv2d.py): offsets in +-2.5 px (at the
                  border samples land outside), their fractional parts in [0.1, 0.9] so that no
                  sample sits on a pixel line, where float32 and float64 may disagree on which
                  side it is (its make() says why); mask uniform in [0, 1), bias present
  implementations every stage whose stage.toml lists `deform_conv2d` and runs on the device,
                  torchvision.ops.deform_conv2d, and the same op on F.grid_sample
                  (workbook.reference.deform_conv2d_grid_sample); all validated in float32 against
                  the float64 reference at the descriptor's tolerance
  reference line  F.conv2d of the same shape: the dense convolution's arithmetic, the floor
  phases          forward, and forward + backward (the gradients of input, offset, mask, weight,
                  bias), each at 1 and 2 intra-op threads, interleaved in the same rounds
  memory          peak memory growth of one forward + backward (see bench/harness.py MEMORY_METHOD)
  targets         at `main`: forward + backward >= 10x torchvision, forward >= 5x torchvision,
                  forward within 3x of F.conv2d, forward + backward >= 2x the grid_sample version,
                  2 threads >= 1.7x 1 thread, peak memory within 1.5x of torchvision's
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench import harness
from bench.harness import Config, Impl, Plan, Target
from workbook import ops, opspec, reference, stages
from workbook.ops.deform_conv2d import TORCHVISION as TORCHVISION_SIZES
from workbook.opspec import Case, Sample

SPEC = ops.get("deform_conv2d")

# ----------------------------------------------------------------------------------------------
# Configurations


def square_3x3(batch: int, channels: int, size: int) -> dict[str, int]:
    """A 3 x 3 deformable convolution with padding 1 (output size = input size), with mask."""
    return {"batch": batch, "in_channels": channels, "out_channels": channels,
            "offset_groups": 1, "height": size, "width": size, "kernel_h": 3, "kernel_w": 3,
            "pad_h": 1, "pad_w": 1}


def describe(sizes: dict[str, int]) -> str:
    def pair(name: str, default: int) -> str:
        return f"{sizes.get(name + '_h', default)}x{sizes.get(name + '_w', default)}"

    return (f"N {sizes['batch']}, C {sizes['in_channels']} -> {sizes['out_channels']}, "
            f"{sizes['height']}x{sizes['width']}, kernel {sizes['kernel_h']}x{sizes['kernel_w']}, "
            f"stride {pair('stride', 1)}, pad {pair('pad', 0)}, dilation {pair('dilation', 1)}, "
            f"groups {sizes.get('groups', 1)}, offset groups {sizes['offset_groups']}, "
            f"{'with' if sizes.get('mask', 1) else 'without'} mask")


def config(name: str, sizes: dict[str, int]) -> Config:
    return Config(name, sizes, describe(sizes))


# torchvision's own test configuration (TestDeformConv), at its batch of 33.
TORCHVISION = config("torchvision", {**TORCHVISION_SIZES, "batch": 33})


def thread_counts() -> tuple[int, ...]:
    """1 and 2 threads (how well the op shares its work), capped by --threads."""
    return tuple(sorted({1, min(2, torch.get_num_threads())}))


def plan(device: str, smoke: bool) -> Plan:
    if smoke:
        main = config("main", square_3x3(2, 8, 10))
        return Plan((main, TORCHVISION), min_run_time=0.02, profile_iters=2,
                    threads=thread_counts() if device == "cpu" else (), memory=("main",))
    main, small = config("main", square_3x3(4, 64, 56)), config("small", square_3x3(8, 32, 28))
    if device == "cpu":
        # torchvision's CPU forward + backward at `main` takes about a second: min_blocks keeps
        # three calls per measurement so that its median has an IQR.
        return Plan((main, small, TORCHVISION), min_run_time=0.5, profile_iters=5, rounds=3,
                    threads=thread_counts(), min_blocks=3, memory=("main", "small", "torchvision"),
                    memory_repeats=2)
    large = config("large", square_3x3(16, 256, 64))
    return Plan((main, small, TORCHVISION, large), min_run_time=0.3, profile_iters=10, rounds=2,
                memory=("main", "large"), memory_repeats=2)


def sample(config: Config, device: str, dtype: torch.dtype) -> Sample:
    """The descriptor's inputs (its make() keeps every sampling point between pixels)."""
    return SPEC.make(Case(config.name, config.sizes), device=device, dtype=dtype, seed=0)




# ----------------------------------------------------------------------------------------------
# Baselines and the floor


def conv2d_sample(config: Config, device: str) -> Sample:
    """The deformable convolution's input, weight and bias, for a dense convolution of the same
    shape (same output size: the offsets only move where the taps read), in float32 like the
    plans."""
    s = sample(config, device, torch.float32)
    x, _, weight, bias = s.args
    return Sample("conv2d", (x, weight, bias),
                  {"stride": s.kwargs["stride"], "padding": s.kwargs["padding"],
                   "dilation": s.kwargs["dilation"], "groups": x.shape[1] // weight.shape[1]},
                  arg_names=("input", "weight", "bias"))


def measured_stages() -> list[stages.Stage]:
    """The stages this benchmark measures: of the stages building one package (06 and 07 both
    build `extops`), the last, which is the one a process can load (stage 07 compiles stage 06's
    CPU kernel unchanged, so on the CPU its numbers are stage 06's)."""
    providers = stages.providing("deform_conv2d")
    return [s for k, s in enumerate(providers)
            if not any(later.package == s.package for later in providers[k + 1:])]


def deterministic_runners(s: stages.Stage):
    """A stage's op with torch.use_deterministic_algorithms(True) around each call, forward and
    backward: the cost of the reproducible backward. A reference line: the tests check its
    results (bitwise over three runs, and against the CPU)."""
    def runners(config: Config, device: str, phases) -> harness.Runners:
        made = sample(config, device, torch.float32)
        with torch.no_grad():
            outputs = opspec.as_tuple(made.call(s.load().deform_conv2d))
        plain = harness.phase_runners(s.load().deform_conv2d, made, opspec.random_like(outputs),
                                      phases)

        def deterministic(run):
            def call():
                torch.use_deterministic_algorithms(True)
                try:
                    return run()
                finally:
                    torch.use_deterministic_algorithms(False)
            return call

        return {phase: deterministic(run) for phase, run in plain.items()}
    return runners


def implementations(device: str) -> list[Impl]:
    impls = []
    if device == "cuda":
        for s in measured_stages():
            if "cuda" in s.devices:
                impls.append(Impl(f"{harness.stage_key(s)}_deterministic",
                                  f"stage {s.folder}, deterministic backward",
                                  runners=deterministic_runners(s)))
    try:
        import torchvision.ops

        impls.append(Impl("torchvision", "torchvision.ops.deform_conv2d",
                          torchvision.ops.deform_conv2d))
    except ImportError:  # reported by its targets, "not evaluated"
        pass
    return impls + [
        Impl("grid_sample", "plain PyTorch on F.grid_sample", reference.deform_conv2d_grid_sample),
        Impl("conv2d", "F.conv2d, same shape (the floor)",
             runners=harness.sample_runners(F.conv2d, conv2d_sample)),
    ]


# ----------------------------------------------------------------------------------------------
# Targets


def targets(device: str) -> list[Target]:
    out = []
    for s in measured_stages():
        key, name = harness.stage_key(s), f"stage {s.number:02d}"
        out += [
            Target(f"{name} forward + backward >= 10x torchvision", "main", key, "torchvision",
                   "forward_backward", 10.0),
            Target(f"{name} forward >= 5x torchvision", "main", key, "torchvision", "forward", 5.0),
            Target(f"{name} forward within 3x of F.conv2d", "main", key, "conv2d", "forward", 3.0,
                   kind="within"),
            Target(f"{name} forward + backward >= 2x the grid_sample version", "main", key,
                   "grid_sample", "forward_backward", 2.0),
            Target(f"{name} forward + backward memory within 1.5x of torchvision's", "main", key,
                   "torchvision", "forward_backward", 1.5, kind="memory"),
        ]
        if device == "cpu":
            out.append(Target(f"{name} forward + backward, 2 threads >= 1.7x faster than 1",
                              "main", key, "1 thread", "forward_backward", 1.7, kind="threads"))
    return out


# ----------------------------------------------------------------------------------------------
# GPU: the sampling kernel's bandwidth against a copy


def sampling_bandwidth(run: harness.DeviceRun) -> None:
    """GB/s of the forward's sampling kernel (im2col) at the large configuration, against a
    device-to-device copy of the same bytes, both from torch.profiler kernel times.

    Bytes: the columns it writes (C kh kw x N Ho Wo values) plus what it must read at least once:
    the input, the offsets and the mask. Its four gathers per value mostly hit L2 (neighbouring
    positions share corners), so the columns' store dominates: near a copy's rate is its ceiling.
    """
    if run.device != "cuda":
        return
    config = next((c for c in run.plan.configs if c.name == "large"), None)
    if config is None:
        return
    made = sample(config, run.device, run.dtype)
    x, offset, weight = made.args[:3]
    itemsize = x.element_size()
    values = (weight.shape[1] * (x.shape[1] // weight.shape[1]) * weight.shape[2] * weight.shape[3]
              * offset.shape[0] * offset.shape[2] * offset.shape[3])
    mask = made.kwargs.get("mask")
    moved = itemsize * (values + x.numel() + offset.numel() + (mask.numel() if mask is not None
                                                                   else 0))
    out = {"config": config.name, "bytes": moved,
           "copy": harness.copy_bandwidth(run, moved // (2 * itemsize)), "kernels": {}}
    for s in measured_stages():
        if "cuda" not in s.devices:
            continue
        fn = s.load().deform_conv2d
        rows = harness.profile_rows(lambda: made.call(fn), run.device, run.plan.profile_iters)
        sampling = [r for r in rows if r["kind"] == "kernel" and "sample_columns" in r["name"]]
        us = sum(r["us_per_call"] for r in sampling)
        gbps = moved / us / 1e3 if us else None
        copy = out["copy"]["GBps"]
        out["kernels"][harness.stage_key(s)] = {
            "label": f"stage {s.folder}", "kernel_us": us, "GBps": gbps,
            "fraction_of_copy": gbps / copy if gbps and copy else None,
            "kernels": [harness.short_name(r["name"]) for r in sampling]}
        run.log(f"  sampling kernel of {s.folder}: {us:.1f} us, {gbps or 0:.0f} GB/s against a "
                f"copy's {copy or 0:.0f} GB/s")
    run.report["sampling_bandwidth"] = out


def sampling_bandwidth_section(report: dict) -> list[str]:
    bw = report.get("sampling_bandwidth")
    if not bw:
        return []
    copy = bw["copy"]
    lines = [f"## The sampling kernel's bandwidth ({bw['config']} configuration)", "",
             f"Bytes: the columns written plus the input, offsets and mask read once: "
             f"{bw['bytes'] / 1e6:.1f} MB. A device-to-device copy of as many bytes: "
             f"{copy['kernel_us']:.1f} us, **{copy['GBps'] or 0:.0f} GB/s**.", "",
             "| implementation | kernel | time | GB/s | of copy |", "|---|---|--:|--:|--:|"]
    for entry in bw["kernels"].values():
        frac = entry.get("fraction_of_copy")
        lines.append(f"| {entry['label']} | {', '.join(entry['kernels']) or '-'} | "
                     f"{entry['kernel_us']:.1f} us | {entry['GBps'] or 0:.0f} | "
                     f"{f'{frac:.0%}' if frac else '-'} |")
    return lines + [""]


BENCH = harness.OpBench(
    op="deform_conv2d",
    title="Deformable convolution benchmark",
    spec=SPEC,
    phases=("forward", "forward_backward"),
    baselines=("torchvision", "grid_sample"),
    plan=plan,
    sample=sample,
    implementations=implementations,
    targets=targets,
    floor="conv2d",
    floor_phrase="F.conv2d of the same shape",
    measure_extra=sampling_bandwidth,
    markdown_extra=sampling_bandwidth_section,
)
