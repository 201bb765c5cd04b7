"""The LLTM benchmark: every stage's cell against plain PyTorch and torch.compile, CPU and GPU.

Run card
  make bench OP=lltm         or   python bench/run.py --op lltm [--smoke] [--device cpu|cuda]
  writes bench/results/lltm/<machine>.{json,md,png}: cpu-2threads, nvidia-h200

What it measures (the harness, common/workbook/measure/harness.py, validates, times and reports):
  configurations  the tutorial's (batch 16, features 32, state 128), a large one, a sweep over state
  implementations plain PyTorch (reference.lltm, "eager"), torch.compile of it, and every
                  stage whose stage.toml lists `lltm` and runs on the device (02, 03, 05, 06 on the
                  CPU; 04, 05, 06 on a GPU)
  phases          forward (autograd recording) and backward (the graph replayed), as the tutorial's
                  `Forward: X us | Backward: Y us`
  reference lines the cell's GEMMs alone: the floor under every implementation; and each fused
                  stage's ops called without autograd: its kernels alone, so that the op's time
                  over them is what its autograd layer and the engine cost
  GPU             the fused pointwise kernels' bandwidth against a device-to-device copy
  targets         the fused stages (05, Python autograd; the library's newest build, C++ autograd)
                  at the tutorial size: forward >= 2x eager, backward >= 1.5x eager, forward +
                  backward >= 1.3x torch.compile and within 1.25x of its ops alone; at the
                  large size not slower than eager or compile either way; across the state
                  sweep, forward + backward never slower than eager
"""

from __future__ import annotations

import torch

from workbook import ops
from workbook.build import stages
from workbook.build.loader import import_stage
from workbook.measure import harness
from workbook.measure.harness import Config, Impl, Plan, Target
from workbook.ops.lltm import reference
from workbook.spec import Case

SPEC = ops.get("lltm")

# ----------------------------------------------------------------------------------------------
# Configurations


def lltm_config(name: str, batch: int, features: int, state: int, sweep: bool = False) -> Config:
    return Config(name, {"batch": batch, "features": features, "state": state},
                  sweep="state" if sweep else None)


# The sizes the PyTorch C++ extension tutorial times.
TUTORIAL = lltm_config("tutorial", 16, 32, 128)


def plan(device: str, smoke: bool) -> Plan:
    """The tutorial's configuration, a large one and a sweep over the state size."""
    if smoke:  # two distinct shapes (the sweep repeats them): torch.compile compiles twice
        large_state = 256 if device == "cpu" else 1024
        large = lltm_config("large", 16, 32, large_state)
        sweep = [lltm_config(f"sweep-s{s}", 16, 32, s, sweep=True) for s in (128, large_state)]
        return Plan((TUTORIAL, large, *sweep), min_run_time=0.02, profile_iters=3)
    if device == "cpu":
        # Large: a GEMM of 256 x 2560 x 6144 (8 GFLOP forward) against 0.5M pointwise elements.
        large = lltm_config("large", 256, 512, 2048)
        sweep = [lltm_config(f"sweep-s{s}", 16, 32, s, sweep=True)
                 for s in (32, 64, 128, 256, 512, 1024, 2048)]
        return Plan((TUTORIAL, large, *sweep), min_run_time=0.4, profile_iters=20, rounds=3)
    # GPU large: B x S = 16.8M elements, so the fused kernels move 400 MB forward, 670 MB backward,
    # far past the 60 MB L2: their time is HBM time, comparable with a copy's.
    large = lltm_config("large", 4096, 512, 4096)
    sweep = [lltm_config(f"sweep-s{s}", 1024, 32, s, sweep=True)
             for s in (128, 256, 512, 1024, 2048, 4096, 8192)]
    return Plan((TUTORIAL, large, *sweep), min_run_time=0.3, profile_iters=20)


def sample(config: Config, device: str, dtype: torch.dtype):
    """The descriptor's inputs: weights and bias in the module's +-1/sqrt(S) range."""
    return SPEC.make(Case(config.name, config.sizes), device=device, dtype=dtype, seed=0)


# ----------------------------------------------------------------------------------------------
# Baselines and the floor


class CompiledReference:
    """torch.compile of the plain PyTorch cell, compiled afresh for every configuration.

    Static shapes (dynamic=False) and fullgraph=True: the best case for torch.compile, what a user
    with fixed sizes gets. `torch._dynamo.reset()` per configuration keeps the sweep from running
    into the recompile limit; inductor's on-disk cache (under build/) makes a second run fast.
    Donated buffers are off: they forbid the retain_graph=True replay the backward timing uses
    (and save memory, not time).
    """

    settings = "torch.compile(reference.lltm, dynamic=False, fullgraph=True), default mode"

    def __init__(self) -> None:
        import torch._functorch.config as functorch_config

        if hasattr(functorch_config, "donated_buffer"):
            functorch_config.donated_buffer = False
        self.compiled = None

    def prepare(self, config: Config) -> None:
        torch._dynamo.reset()
        self.compiled = torch.compile(reference.lltm, dynamic=False, fullgraph=True)

    def __call__(self, *inputs):
        return self.compiled(*inputs)


def gemm_floor(config: Config, device: str, phases) -> harness.Runners:
    """The cell's GEMMs alone: G = X W^T + b forward (addmm; X = [h, x]); dX = dG W and
    dW = dG^T X backward (two mm). Every implementation runs these same BLAS calls (torch.compile
    too, as extern kernels), so its time minus this is what the rest of the cell costs."""
    b, f, s = config.sizes["batch"], config.sizes["features"], config.sizes["state"]
    gen = torch.Generator(device=device).manual_seed(2)

    def rand(*shape):
        return torch.rand(shape, generator=gen, device=device)

    x, w, bias, dg = rand(b, f + s), rand(3 * s, f + s), rand(3 * s), rand(b, 3 * s)
    calls = {"forward": lambda: torch.addmm(bias, x, w.t()),
             "backward": lambda: (dg.mm(w), dg.t().mm(x)),
             "forward_backward": lambda: (torch.addmm(bias, x, w.t()), dg.mm(w), dg.t().mm(x))}
    return {p: calls[p] for p in phases}


def kernels_alone(s: stages.Stage):
    """A fused stage's forward and backward ops called directly, without autograd: its kernels
    (the GEMMs and the fused loop) and nothing else, the floor the op can reach. The op's time
    over this is what its autograd layer and the engine cost."""
    def runners(config: Config, device: str, phases) -> harness.Runners:
        import_stage(s)
        library = getattr(torch.ops, s.package)  # a library's ops are torch.ops.<its package>
        forward, backward = library.lltm_forward, library.lltm_backward
        x, w, b, h, c = (t.detach() for t in sample(config, device, torch.float32).args)
        _, new_cell, gates = forward(x, w, b, h, c)
        grad_h, grad_cell = torch.rand_like(new_cell), torch.rand_like(new_cell)
        calls = {"forward": lambda: forward(x, w, b, h, c),
                 "backward": lambda: backward(grad_h, grad_cell, new_cell, gates, x, h, w)}
        calls["forward_backward"] = lambda: (calls["forward"](), calls["backward"]())
        return {p: calls[p] for p in phases}
    return runners


def implementations(device: str) -> list[Impl]:
    compiled = CompiledReference()
    impls = [
        Impl("eager", "plain PyTorch (eager)", reference.lltm),
        Impl("compile", "plain PyTorch + torch.compile", compiled, compiled.prepare,
             note=compiled.settings),
        Impl("gemm_floor", "GEMMs alone (the floor; not an implementation)", runners=gemm_floor),
    ]
    for s in fused_stages(device):
        impls.append(Impl(f"{harness.stage_key(s)}_kernels",
                          f"stage {s.number:02d}'s ops alone, no autograd (its floor)",
                          runners=kernels_alone(s)))
    return impls


# ----------------------------------------------------------------------------------------------
# GPU: bandwidth of the fused pointwise kernels against a copy

# Bytes per (batch, state) element of the fused pointwise kernels, restated from the comments next
# to the kernels (stages/04_*/csrc/lltm_cuda.cu, 05_*/csrc/lltm_cuda.cuh, which stages 06 to 10
# compile):
#   forward:  reads gates (3 values) + old_cell (1); writes new_h + new_cell (2): 6 values
#   backward: reads grad_h, grad_cell, new_cell, gates (3): 6; writes d_gates (3), d_old_cell (1): 4
# times the element size (4 B in float32): 24 B forward, 40 B backward.
VALUES_PER_ELEMENT = {"forward": 6, "backward": 10}


def bandwidth(run: harness.DeviceRun) -> None:
    """GB/s of the stages' fused kernels at the large configuration, against a device-to-device
    copy of the forward's traffic, both from torch.profiler kernel times: the profiler isolates
    the pointwise kernels from the GEMMs, the cat and the launches, and times the copy alike."""
    if run.device != "cuda":
        return
    config = run.plan.config("large")
    elements = config.sizes["batch"] * config.sizes["state"]
    itemsize = torch.tensor([], dtype=run.dtype).element_size()
    out = {"config": config.name, "elements": elements, "element_size_B": itemsize,
           "bytes_per_element": {p: v * itemsize for p, v in VALUES_PER_ELEMENT.items()},
           "copy": harness.copy_bandwidth(run, elements * VALUES_PER_ELEMENT["forward"] // 2),
           "kernels": {}}
    run.log(f"\n[bench] cuda bandwidth at {config.describe()}: device-to-device copy of "
            f"{out['copy']['bytes'] / 1e6:.0f} MB: {out['copy']['kernel_us']:.1f} us, "
            f"{out['copy']['GBps'] or 0:.0f} GB/s")
    inputs = sample(config, run.device, run.dtype)
    grads = harness.incoming_gradients(SPEC, inputs)
    for impl in run.impls:
        if impl.key.startswith("stage"):
            out["kernels"][impl.key] = fused_kernels(run, impl, config, inputs, grads, out)
    run.report["bandwidth"] = out


def fused_kernels(run, impl, config, inputs, grads, out) -> dict:
    entry = {"label": impl.label}
    runners = harness.runners_for(impl, config, run.device, inputs, grads, ("forward", "backward"))
    for phase in ("forward", "backward"):
        rows = harness.profile_rows(runners[phase], run.device, run.plan.profile_iters)
        fused = [r for r in rows if r["kind"] == "kernel" and "lltm" in r["name"].lower()]
        us = sum(r["us_per_call"] for r in fused)
        moved = out["bytes_per_element"][phase] * out["elements"]
        gbps = moved / us / 1e3 if us else None
        copy = out["copy"]["GBps"]
        entry[phase] = {
            "kernels": [harness.short_name(r["name"]) for r in fused], "kernel_us": us,
            "bytes": moved, "GBps": gbps,
            "fraction_of_copy": gbps / copy if gbps and copy else None,
            "all_kernels": [{"name": harness.short_name(r["name"]), "us_per_call": r["us_per_call"]}
                            for r in rows if r["kind"] == "kernel"][:8],
        }
        run.log(f"  {impl.label:<34} {phase:<8} " + (
            f"fused kernel {us:8.1f} us, {gbps:6.0f} GB/s = {entry[phase]['fraction_of_copy']:.0%} "
            f"of copy" if us else "no kernel named *lltm* in the profile"))
    return entry


def bandwidth_section(report: dict) -> list[str]:
    bw = report.get("bandwidth")
    if not bw:
        return []
    copy = bw["copy"]
    lines = [f"## Bandwidth of the fused pointwise kernels ({bw['config']} configuration)", "",
             (f"Bytes per (batch, state) element, float32: forward 6 values = "
              f"{bw['bytes_per_element']['forward']} B (reads gates x3, old_cell; writes new_h, "
              f"new_cell), backward 10 values = {bw['bytes_per_element']['backward']} B (reads "
              f"grad_h, grad_cell, new_cell, gates x3; writes d_gates x3, d_old_cell); "
              f"{bw['elements']:,} elements. Kernel times from torch.profiler, as for the copy."),
             "",
             (f"Device-to-device copy of {copy['bytes'] / 1e6:.1f} MB (read + write): "
              f"{copy['kernel_us']:.1f} us, **{copy['GBps'] or 0:.0f} GB/s**."), "",
             "| implementation | phase | fused kernel | time | GB/s | of copy |",
             "|---|---|---|--:|--:|--:|"]
    for entry in bw["kernels"].values():
        for phase in ("forward", "backward"):
            k = entry.get(phase, {})
            frac = k.get("fraction_of_copy")
            lines.append(f"| {entry['label']} | {phase} | {', '.join(k.get('kernels', [])) or '-'} "
                         f"| {k.get('kernel_us', 0):.1f} us | {k.get('GBps') or 0:.0f} | "
                         f"{f'{frac:.0%}' if frac else '-'} |")
    return lines + [""]


def bandwidth_fraction(target: Target, report: dict) -> tuple[float | None, None, str]:
    kernel = report.get("bandwidth", {}).get("kernels", {}).get(target.impl, {})
    value = (kernel.get(target.phase) or {}).get("fraction_of_copy")
    missing = "no bandwidth measurement of the stage's kernel"
    return value, None, "" if value is not None else missing


# ----------------------------------------------------------------------------------------------
# CPU: where an LLTM step's microseconds go at the tutorial size


def layer_costs(run: harness.DeviceRun) -> None:
    """At the tutorial size, the pieces the result rows do not separate: the gates' GEMM with
    `cat` (one addmm over [h, x]) against two GEMMs into one output (no cat, the weight's column
    blocks as views), and the autograd engine's fixed cost (torch.autograd.grad through a graph of
    one node). Timed like everything else (medians of torch.utils.benchmark blocks, interleaved)."""
    if run.device != "cpu":
        return
    sizes = TUTORIAL.sizes
    x, w, b, h, _ = (t.detach() for t in sample(TUTORIAL, "cpu", run.dtype).args)
    state = sizes["state"]
    w_h, w_x = w[:, :state], w[:, state:]
    leaf = torch.rand(sizes["batch"], state, requires_grad=True)
    node = leaf * 2
    incoming = torch.rand_like(node)
    calls = {
        "gates: addmm over cat([h, x])": lambda: torch.addmm(b, torch.cat([h, x], 1), w.t()),
        "gates: two GEMMs into one output": lambda: torch.addmm(b, h, w_h.t()).addmm_(x, w_x.t()),
        "autograd.grad through one node": lambda: torch.autograd.grad(node, leaf, incoming,
                                                                      retain_graph=True),
    }
    threads = run.top_threads
    best: dict[str, float] = {}
    for _ in range(max(run.plan.rounds, 1)):
        for label, call in calls.items():
            t = harness.time_call(call, min_run_time=run.plan.min_run_time, threads=threads,
                                  min_blocks=1)
            best[label] = min(best.get(label, float("inf")), t.median_us)
    run.report["layer_costs"] = {"config": TUTORIAL.name, "threads": threads, "us": best}
    for label, us in best.items():
        run.log(f"  {label:<40} {us:8.1f} us")


def layer_costs_section(report: dict) -> list[str]:
    costs = report.get("layer_costs")
    rows = {r["impl"]: r for r in report["results"]
            if r["config"] == "tutorial" and r.get("threads") == report["machine"]["threads"]}
    if not costs or not rows:
        return []
    lines = ["## Where an LLTM step's microseconds go (tutorial size)", "",
             "From the rows above: each fused stage's ops called without autograd (its kernels), "
             "then through autograd (stage 05 registers it in Python, the library in C++); and "
             "two pieces timed apart in the same run.", "",
             "| what | forward | backward |", "|---|--:|--:|"]
    for key, label in (("gemm_floor", "the GEMMs alone"),
                       *((f"{s}_kernels", f"{rows[s]['label']}: its ops alone, no autograd")
                         for s in rows if f"{s}_kernels" in rows),
                       *((s, f"{rows[s]['label']}: through autograd")
                         for s in rows if f"{s}_kernels" in rows),
                       ("eager", "plain PyTorch (eager)"), ("compile", "torch.compile")):
        if key in rows:
            r = rows[key]
            lines.append(f"| {label} | {r['forward']['median_us']:.1f} us | "
                         f"{r['backward']['median_us']:.1f} us |")
    lines += ["", "| piece, timed apart | time |", "|---|--:|"]
    lines += [f"| {label} | {us:.1f} us |" for label, us in costs["us"].items()]
    return lines + [""]


def measure_extra(run: harness.DeviceRun) -> None:
    bandwidth(run)
    layer_costs(run)


def markdown_extra(report: dict) -> list[str]:
    return layer_costs_section(report) + bandwidth_section(report)


# ----------------------------------------------------------------------------------------------
# Targets


def fused_stages(device: str) -> list[stages.Stage]:
    """From stage 05 on the cell is one fused op (torch.library); 02-04 are the tutorial's steps
    toward it and carry no targets. Of the stages that build one package (06, 07, 09 and 10 build
    `extops`), the one a process loads where `device` runs (ops.implementations: the one with
    the most ops, stage 09's ATen build). Stages 05 and 10 register their autograd in Python, 06,
    07 and 09 in C++: on a GPU the pair 05/09 measures what that layer costs; bench/stable_abi.py
    measures 10 against the newest ATen build on the CPU, which one process cannot load
    together."""
    return [i.stage for i in ops.implementations("lltm", device) if i.stage.number >= 5]


def targets(device: str) -> list[Target]:
    out = []
    for s in fused_stages(device):
        key, name = harness.stage_key(s), f"stage {s.number:02d}"
        out += [Target(f"{name} forward >= 2.0x eager", "tutorial", key, "eager", "forward", 2.0),
                Target(f"{name} backward >= 1.5x eager", "tutorial", key, "eager", "backward", 1.5),
                Target(f"{name} forward + backward >= 1.3x torch.compile", "tutorial", key,
                       "compile", "step", 1.3),
                Target(f"{name} forward + backward within 1.25x of its ops alone", "tutorial",
                       key, f"{key}_kernels", "step", 1.25, kind="within")]
        out += [Target(f"{name} {phase} not slower than {base}", "large", key, base, phase, 1.0)
                for base in ("eager", "compile") for phase in ("forward", "backward")]
        out += [Target(f"{name} forward + backward not slower than eager", f"sweep-s{state}", key,
                       "eager", "step", 1.0) for state in (32, 64, 128, 256, 512, 1024, 2048)
                if device == "cpu"]
        if device == "cuda":
            out += [Target(f"{name} {phase} kernel >= 80% of copy bandwidth", "large", key,
                           "copy", phase, 0.8, kind="custom") for phase in ("forward", "backward")]
    return out


# ----------------------------------------------------------------------------------------------
# Report


def ratio_text(row: dict, base: str) -> str:
    r = row.get(f"vs_{base}")
    return f"{r['forward']:.2f}x | {r['backward']:.2f}x" if r else "-"


def tutorial_line(row: dict) -> str:
    """A result as the tutorial prints it: `Forward: X us | Backward: Y us`."""
    return (f"{row['label']:<34} Forward: {row['forward']['median_us']:9.1f} us | "
            f"Backward: {row['backward']['median_us']:9.1f} us   "
            f"vs eager {ratio_text(row, 'eager'):<15}  vs compile {ratio_text(row, 'compile')}")


def upgrade(report: dict) -> dict:
    """A report written before the harness split (bench/results/lltm/cpu-2threads.json) in today's
    layout: the GEMM floor from `gemm_floor` into result rows, torch.compile's settings and first
    calls into `notes` and `first_call_s`, configurations and thread counts from the rows, and the
    validation criterion of the time (max |error| / max |reference| <= 1e-4)."""
    if "phases" in report:
        return report
    r = dict(report)
    threads = r["machine"]["threads"]
    r.update(op="lltm", title="LLTM benchmark", phases=["forward", "backward"],
             baselines=["eager", "compile"], plan_threads=[threads],
             tolerance={"max_relative_error": 1e-4},
             notes={"compile": r.pop("compile_settings")},
             first_call_s={"compile": r.pop("compile_first_call_s")})
    sizes = {row["config"]: {k: row[k] for k in ("batch", "features", "state")}
             for row in r["results"]}
    r["configs"] = {name: {"sizes": s, "description": harness.describe_sizes(s),
                           "sweep": "state" if name.startswith("sweep-") else None}
                    for name, s in sizes.items()}
    floor = [{"impl": "gemm_floor", "label": "GEMMs alone (the floor; not an implementation)",
              "config": name, **sizes[name], "reference_line": True, "validated": False, **phases}
             for name, phases in r.pop("gemm_floor").items()]
    r["results"] = [dict(row, threads=threads, reference_line=False)
                    for row in r["results"]] + [dict(row, threads=threads) for row in floor]
    r["targets"] = [dict(t, kind="custom" if t["base"] == "copy" else "speedup")
                    for t in r["targets"]]
    return r


BENCH = harness.OpBench(
    op="lltm",
    title="LLTM benchmark",
    spec=SPEC,
    phases=("forward", "backward"),
    baselines=("eager", "compile"),
    plan=plan,
    sample=sample,
    implementations=implementations,
    targets=targets,
    floor="gemm_floor",
    floor_phrase="the GEMMs",
    step=True,
    summary_line=tutorial_line,
    measure_extra=measure_extra,
    markdown_extra=markdown_extra,
    evaluate_custom=bandwidth_fraction,
    upgrade=upgrade,
)
