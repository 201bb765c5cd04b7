"""The deformable convolution benchmark: the stages' op against torchvision and plain PyTorch.

Run card
  make bench OP=deform_conv2d   or   python bench/run.py --op deform_conv2d [--smoke] [--device cpu]
  writes bench/results/deform_conv2d/<machine>.{json,md,png}: cpu-2threads, nvidia-h200

What it measures (the harness, common/workbook/measure/harness.py, validates, times and reports):
  configurations  main: N 4, C 64 -> 64, 56 x 56, 3 x 3, pad 1, with mask (a ResNet stage-2 layer);
                  small: N 8, C 32 -> 32, 28 x 28; torchvision: torchvision's test configuration at
                  batch 33 (groups, offset groups, strides, dilations all off 1); on a GPU also
                  large: N 16, C 256 -> 256, 64 x 64
  inputs          the descriptor's (workbook/ops/deform_conv2d/): offsets in +-2.5 px (at the
                  border samples land outside), their fractional parts in [0.1, 0.9] so that no
                  sample sits on a pixel line, where float32 and float64 may disagree on which
                  side it is (its make() says why); mask uniform in [0, 1), bias present
  implementations every stage whose stage.toml lists `deform_conv2d` and runs on the device,
                  torchvision.ops.deform_conv2d, and the same op on F.grid_sample
                  (reference.deform_conv2d_grid_sample); all validated in float32 against
                  the float64 reference at the descriptor's tolerance
  reference line  F.conv2d of the same shape: the dense convolution's arithmetic, the floor
  phases          forward, and forward + backward (the gradients of input, offset, mask, weight,
                  bias), each at 1 and 2 intra-op threads, interleaved in the same rounds
  memory          peak memory growth of one forward + backward (see
  common/workbook/measure/harness.py MEMORY_METHOD) targets         at `main`: forward + backward >=
  10x torchvision, forward >= 5x torchvision,
                  forward within 3x of F.conv2d, forward + backward >= 2x the grid_sample version,
                  2 threads >= 1.7x 1 thread, peak memory within 1.5x of torchvision's
  a real backbone torchvision's resnet50 (random init, no download) with the 3x3 convolutions of
                  its last two stages (layer3, layer4) as DCNv2 blocks, as the DCNv2 paper modifies
                  ResNet-50: extops.DCNv2, the same block on torchvision's op, and the plain
                  network; a training step (forward, cross-entropy, backward, SGD) at 1 and 2
                  threads, peak memory of a step, the first step's gradients of the two deformable
                  versions from one init, and their loss curves (the section "A real backbone";
                  smoke: resnet18 at 64 x 64)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from workbook import ops
from workbook.build import stages
from workbook.build.loader import import_stage
from workbook.measure import harness
from workbook.measure.harness import Config, Impl, Plan, Target
from workbook.ops.deform_conv2d import TORCHVISION as TORCHVISION_SIZES
from workbook.ops.deform_conv2d import reference
from workbook.spec import Case, Sample, as_tuple, random_like

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


def measured_stages(device: str) -> list[stages.Stage]:
    """The stages this benchmark measures on `device`: of the stages building one package (06, 07
    and 10 build `extops`), the one a process loads there (ops.implementations, as the harness
    takes them): on the CPU stage 10, whose CPU kernels are stage 06's compiled on the stable
    ABI, on a GPU stage 07. bench/stable_abi.py times 10 against 07 on the CPU, which one process
    cannot load together."""
    return [i.stage for i in ops.implementations("deform_conv2d", device)]


def deterministic_runners(s: stages.Stage):
    """A stage's op with torch.use_deterministic_algorithms(True) around each call, forward and
    backward: the cost of the reproducible backward. A reference line: the tests check its
    results (bitwise over three runs, and against the CPU)."""
    def runners(config: Config, device: str, phases) -> harness.Runners:
        made = sample(config, device, torch.float32)
        with torch.no_grad():
            outputs = as_tuple(made.call(import_stage(s).deform_conv2d))
        plain = harness.phase_runners(import_stage(s).deform_conv2d, made, random_like(outputs),
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
        for s in measured_stages(device):
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
    for s in measured_stages(device):
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
    for s in measured_stages(run.device):
        if "cuda" not in s.devices:
            continue
        fn = import_stage(s).deform_conv2d
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


# ----------------------------------------------------------------------------------------------
# A real backbone: resnet50 with DCNv2 blocks in its last two stages, trained a few steps

BACKBONE = {"arch": "resnet50", "batch": 4, "size": 96, "classes": 10, "steps": 5, "rounds": 3,
            "curve_steps": 40, "curve_batches": 4, "lr": 0.01, "memory_repeats": 2}
# Smoke: small, but not so small that batch norm over a 1 x 1 layer4 output of two images makes
# the gradient comparison ill-conditioned (at 32 x 32 it differs by 1e-4 to 3e-2 between any two
# float32 summation orders; at 64 x 64 by ~1e-5).
# The smoke run checks that every piece works, in seconds: one thread count, and the memory of
# one network (the probe is the same for each).
BACKBONE_SMOKE = {"arch": "resnet18", "batch": 2, "size": 64, "classes": 10, "steps": 1,
                  "rounds": 1, "curve_steps": 2, "curve_batches": 2, "lr": 0.01,
                  "memory_repeats": 1, "threads": 1, "memory_of": ["extops"]}
NETWORKS = {"extops": "extops.DCNv2", "torchvision": "DCNv2 on torchvision.ops.deform_conv2d",
            "plain": "plain 3x3 convolutions"}


class TorchvisionDCNv2(torch.nn.Module):
    """extops.DCNv2's block on torchvision's op: the same zero-initialised offset-and-mask conv,
    mask 2 sigmoid(logit), the same parameter names, so one state dict serves both."""

    def __init__(self, conv: torch.nn.Conv2d):
        super().__init__()
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self.taps = conv.kernel_size[0] * conv.kernel_size[1]
        self.weight = torch.nn.Parameter(conv.weight.detach().clone())
        self.bias = None if conv.bias is None else torch.nn.Parameter(conv.bias.detach().clone())
        self.offset_mask = torch.nn.Conv2d(conv.in_channels, 3 * self.taps, conv.kernel_size,
                                           conv.stride, conv.padding, conv.dilation)
        torch.nn.init.zeros_(self.offset_mask.weight)
        torch.nn.init.zeros_(self.offset_mask.bias)

    def forward(self, x):
        import torchvision.ops

        offset, logits = self.offset_mask(x).split([2 * self.taps, self.taps], dim=1)
        return torchvision.ops.deform_conv2d(x, offset.contiguous(), self.weight, self.bias,
                                             self.stride, self.padding, self.dilation,
                                             2 * torch.sigmoid(logits))


def _extops_block(extops, conv: torch.nn.Conv2d) -> torch.nn.Module:
    block = extops.DCNv2(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                         conv.padding, conv.dilation, conv.groups, bias=conv.bias is not None)
    with torch.no_grad():
        block.weight.copy_(conv.weight)
        if conv.bias is not None:
            block.bias.copy_(conv.bias)
    return block


def backbone(network: str, arch: str, classes: int, seed: int = 0, extops=None):
    """torchvision.models.<arch> from `seed` (random init: nothing is downloaded); for "extops"
    and "torchvision" the 3x3 convolutions of layer3 and layer4 become DCNv2 blocks holding the
    same weights (the offsets start at 0 and the mask at 1: the same network at init)."""
    import torchvision

    torch.manual_seed(seed)
    model = getattr(torchvision.models, arch)(weights=None, num_classes=classes)
    if network == "plain":
        return model
    for stage in (model.layer3, model.layer4):
        for name, module in list(stage.named_modules()):
            if isinstance(module, torch.nn.Conv2d) and module.kernel_size == (3, 3):
                parent_name, _, leaf = name.rpartition(".")
                parent = stage.get_submodule(parent_name) if parent_name else stage
                block = (_extops_block(extops, module) if network == "extops"
                         else TorchvisionDCNv2(module))
                setattr(parent, leaf, block)
    return model


def _batches(sizes: dict, count: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(sizes["batch"], 3, sizes["size"], sizes["size"], generator=g),
             torch.randint(0, sizes["classes"], (sizes["batch"],), generator=g))
            for _ in range(count)]


def _train_step(model, optimizer, x, y) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def _trainer(network: str, sizes: dict, extops, device: str):
    model = backbone(network, sizes["arch"], sizes["classes"], extops=extops).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=sizes["lr"], momentum=0.9)
    x, y = (t.to(device) for t in _batches(sizes, 1)[0])

    def step():
        _train_step(model, optimizer, x, y)
        if device == "cuda":
            torch.cuda.synchronize()
    return step


def first_step_gradients(sizes: dict, extops) -> dict:
    """One step's gradients of the two deformable networks from one init and one batch: the
    worst relative difference (max |a - b| / max |b| per parameter) and where."""
    x, y = _batches(sizes, 1)[0]
    grads = {}
    for network in ("extops", "torchvision"):
        model = backbone(network, sizes["arch"], sizes["classes"], extops=extops)
        F.cross_entropy(model(x), y).backward()
        grads[network] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    worst, where = 0.0, None
    for name, theirs in grads["torchvision"].items():
        scale = theirs.abs().max().item()
        diff = (grads["extops"][name] - theirs).abs().max().item()
        rel = diff / scale if scale > 0 else diff
        if rel > worst:
            worst, where = rel, name
    return {"worst_relative": worst, "parameter": where,
            "parameters": len(grads["torchvision"])}


def loss_curves(sizes: dict, extops) -> dict[str, list[float]]:
    """Each network trained `curve_steps` SGD steps from one init over `curve_batches` batches:
    {network: [loss of each step]}."""
    curves = {}
    data = _batches(sizes, sizes["curve_batches"], seed=2)
    for network in NETWORKS:
        model = backbone(network, sizes["arch"], sizes["classes"], extops=extops)
        optimizer = torch.optim.SGD(model.parameters(), lr=sizes["lr"], momentum=0.9)
        curves[network] = [_train_step(model, optimizer, *data[k % len(data)])
                           for k in range(sizes["curve_steps"])]
    return curves


def backbone_memory_probe(request: dict) -> dict:
    """In a fresh process: peak memory growth of one training step of `request["network"]`
    (harness.peak_growth_bytes, after a warm-up step)."""
    torch.set_num_threads(request["threads"])
    extops = import_stage(measured_stages(request["device"])[-1])
    step = _trainer(request["network"], request["sizes"], extops, request["device"])
    step()
    return {"samples_MB": [harness.peak_growth_bytes(step, request["device"]) / 2**20
                           for _ in range(request["repeats"])]}


def _memory(network: str, sizes: dict, device: str, threads: int) -> dict:
    request = {"network": network, "sizes": sizes, "device": device, "threads": threads,
               "repeats": sizes["memory_repeats"]}
    code = ("import json, sys\nfrom workbook.ops.deform_conv2d import bench as d\n"
            "print(json.dumps(d.backbone_memory_probe(json.loads(sys.argv[1]))))")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=os.pathsep.join(
        [str(harness.REPO), str(harness.REPO / "common"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(request)], cwd=harness.REPO,
                          env=env, capture_output=True, text=True, timeout=1800, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"the measuring process failed (exit {proc.returncode}): {why}"}
    samples = json.loads(lines[-1])["samples_MB"]
    return {"peak_MB": statistics.median(samples), "samples_MB": samples}


def backbone_run(run: harness.DeviceRun) -> None:
    """The section's measurements, into run.report["backbone"]; its plot of the loss curves."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        run.report["backbone"] = {"skipped": "torchvision is not installed"}
        return
    sizes = BACKBONE_SMOKE if run.report.get("smoke") else BACKBONE
    extops = import_stage(measured_stages(run.device)[-1])
    threads_list = run.plan.thread_counts() if run.device == "cpu" else (None,)
    if run.device == "cpu" and "threads" in sizes:
        threads_list = (sizes["threads"],)
    run.log(f"\n[bench] backbone: {sizes['arch']} with DCNv2 in layer3 and layer4, batch "
            f"{sizes['batch']}, {sizes['size']} x {sizes['size']}, training steps (threads "
            f"{', '.join(str(t) for t in threads_list)})")
    before = torch.get_num_threads()
    out = {"sizes": sizes, "networks": NETWORKS, "steps": {}, "memory": {}}
    rounds = {}
    try:
        for _ in range(sizes["rounds"]):  # interleaved: a burst of other work spoils one round
            for threads in threads_list:
                if threads is not None:
                    torch.set_num_threads(threads)
                for network in NETWORKS:
                    step = _trainer(network, sizes, extops, run.device)
                    step()  # warm-up
                    times = []
                    for _ in range(sizes["steps"]):
                        start = time.perf_counter()
                        step()
                        times.append(time.perf_counter() - start)
                    rounds.setdefault((network, threads), []).append(times)
        for (network, threads), per_round in rounds.items():
            best = min(per_round, key=statistics.median)
            median = statistics.median(best)
            q = statistics.quantiles(best, n=4) if len(best) > 1 else [median, median, median]
            out["steps"].setdefault(network, {})[str(threads)] = {
                "median_ms": median * 1e3, "noise": (q[2] - q[0]) / median,
                "round_medians_ms": [statistics.median(r) * 1e3 for r in per_round]}
        top = max(t for t in threads_list if t is not None) if run.device == "cpu" else None
        if top is not None:
            torch.set_num_threads(top)
        out["first_step_gradients"] = first_step_gradients(sizes, extops)
        out["loss_curves"] = loss_curves(sizes, extops)
    finally:
        torch.set_num_threads(before)
    for network in sizes.get("memory_of", NETWORKS):
        out["memory"][network] = _memory(network, sizes, run.device,
                                         top if run.device == "cpu" else 1)
    run.report["backbone"] = out
    for network, by_threads in out["steps"].items():
        for threads, t in by_threads.items():
            run.log(f"  {NETWORKS[network]:<40} threads {threads}: {t['median_ms']:8.1f} ms a "
                    f"step (noise {t['noise']:.0%})")
    grads = out["first_step_gradients"]
    run.log(f"  first step's gradients, extops against torchvision's op: worst relative "
            f"difference {grads['worst_relative']:.1e} ({grads['parameter']})")
    _plot_loss_curves(out, run.out_dir / f"{run.report['machine']['slug']}-backbone.png",
                      run.report)


def draw_loss_curves(ax, curves: dict, sizes: dict, suffix: str = "") -> None:
    # extops' line wide and pale under torchvision's: where they agree both stay visible.
    style = {"extops": {"linewidth": 4, "alpha": 0.45}, "torchvision": {"linewidth": 1.5},
             "plain": {"linestyle": "--"}}
    for network, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=NETWORKS[network],
                **style.get(network, {}))
    ax.set_xlabel("training step (SGD, momentum 0.9)")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(f"{sizes['arch']}, DCNv2 in layer3 and layer4, batch {sizes['batch']}, "
                 f"{sizes['size']} x {sizes['size']}, from one init{suffix}", fontsize=9)
    ax.legend()


def _plot_loss_curves(out: dict, path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    draw_loss_curves(ax, out["loss_curves"], out["sizes"],
                     " (SMOKE)" if report.get("smoke") else "")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    out["plot"] = path.name


def backbone_section(report: dict) -> list[str]:
    out = report.get("backbone")
    if not out:
        return []
    if "skipped" in out:
        return ["## A real backbone", "", f"Not run: {out['skipped']}.", ""]
    sizes = out["sizes"]
    lines = [f"## A real backbone: {sizes['arch']} with DCNv2 in layer3 and layer4", "",
             f"torchvision's {sizes['arch']} (random init, {sizes['classes']} classes), its 3x3 "
             f"convolutions in layer3 and layer4 as DCNv2 blocks (offsets and mask from a "
             f"zero-initialised conv: the plain network at init), batch {sizes['batch']}, "
             f"{sizes['size']} x {sizes['size']}, float32. A training step: forward, "
             f"cross-entropy, backward, SGD (momentum 0.9); median of {sizes['steps']} steps after "
             f"a warm-up step, the lowest of {sizes['rounds']} interleaved rounds; noise = IQR / "
             f"median of those steps. Ratios: the other network's step time over this one's "
             f"(above 1: this one is faster).", "",
             "| network | threads | step | noise | vs torchvision's op | vs plain convs |",
             "|---|--:|--:|--:|--:|--:|"]
    steps = out["steps"]
    for network, by_threads in steps.items():
        for threads, t in by_threads.items():
            ratio = {other: steps[other][threads]["median_ms"] / t["median_ms"]
                     for other in ("torchvision", "plain") if other in steps}
            lines.append(f"| {NETWORKS[network]} | {threads} | {t['median_ms']:.1f} ms | "
                         f"{t['noise']:.0%} | {ratio.get('torchvision', 0):.2f}x | "
                         f"{ratio.get('plain', 0):.2f}x |")
    lines += ["", "Peak memory of one training step (growth over the resident size before it, in "
              "a fresh process per network, as the op's memory above):", "",
              "| network | peak | samples |", "|---|--:|--:|"]
    for network, m in out["memory"].items():
        if "error" in m:
            lines.append(f"| {NETWORKS[network]} | - | {m['error']} |")
        else:
            lines.append(f"| {NETWORKS[network]} | {m['peak_MB']:.0f} MB | "
                         f"{', '.join(f'{v:.0f}' for v in m['samples_MB'])} |")
    grads = out.get("first_step_gradients")
    if grads:
        lines += ["", f"First step from one init, on one batch: the gradients of the "
                  f"{grads['parameters']} parameters of the extops network against the "
                  f"torchvision one differ by at most **{grads['worst_relative']:.1e}** relative "
                  f"to the parameter's largest gradient (`{grads['parameter']}`)."]
    if out.get("plot"):
        lines += ["", f"Loss curves from that init ({sizes['curve_steps']} steps over "
                  f"{sizes['curve_batches']} batches): the two deformable networks start equal and "
                  f"drift apart slowly (at near-integer sampling points the offset gradient jumps, "
                  f"and float32 rounding decides the side, in every implementation).", "",
                  f"![loss curves]({out['plot']})"]
    return lines + [""]


def measure_extra(run: harness.DeviceRun) -> None:
    sampling_bandwidth(run)
    backbone_run(run)


def markdown_extra(report: dict) -> list[str]:
    return sampling_bandwidth_section(report) + backbone_section(report)


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
    measure_extra=measure_extra,
    markdown_extra=markdown_extra,
)
