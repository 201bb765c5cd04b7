"""make demo: build what this machine can build, check each op against its reference, time it.

For every op that a stage implements (the stages' stage.toml files say which), at the op's demo
sizes (its descriptor's demo_case, float32): build and import each stage that provides it, check
its outputs and input gradients against the float64 reference, then print one line per
implementation, `Forward: X us | Backward: Y us`, next to the op's baselines (plain PyTorch; for
the deformable convolution torchvision too), with the speedup over the first baseline.
"""

from __future__ import annotations

import sys

import torch

from workbook import build, ops, stages, timing
from workbook.opspec import OpSpec, Sample, compare


def load(stage: stages.Stage, loaded: dict[str, stages.Stage]) -> tuple[object | None, str]:
    """The stage's package, or None and why not (skipped here, or its package name is taken)."""
    try:
        module = stage.load(quiet=False)
    except build.StageSkipped as skipped:
        return None, str(skipped)
    except build.StageConflict:
        other = loaded[stage.package]
        return None, (f"its package `{stage.package}` is {other.label}'s too, and one loads per "
                      f"process: `make stage {stage.number}` tests it")
    loaded.setdefault(stage.package, stage)
    return module, ""


def check(label: str, fn, spec: OpSpec, sample: Sample) -> bool:
    result = compare(fn, spec, sample)
    print(f"  {label:<44} max relative error vs float64: outputs "
          f"{result.worst('output'):.1e}, gradients {result.worst('gradient'):.1e}  "
          f"{'OK' if result.ok else 'MISMATCH'}")
    for failure in result.failures():
        print(f"      {failure}")
    return result.ok


def time_line(label: str, fn, sample: Sample,
              base: tuple[float, float] | None) -> tuple[float, float]:
    call, tensors = sample.bind(fn)
    fwd, bwd = (t.median_us for t in timing.forward_backward(call, tensors))
    ratio = f"   ({base[0] / fwd:.2f}x | {base[1] / bwd:.2f}x)" if base else ""
    print(f"  {label:<44} Forward: {fwd:9.1f} us | Backward: {bwd:9.1f} us{ratio}")
    return fwd, bwd


def demo_op(name: str, modules: dict[int, object], devices: list[str]) -> bool:
    spec = ops.get(name)
    providers = [s for s in stages.providing(name) if s.number in modules]
    ok = True
    sizes = ", ".join(f"{k} {v}" for k, v in spec.demo_case.sizes.items())
    for device in devices:
        runnable = [s for s in providers if device in s.devices]
        if not runnable:
            continue
        sample = spec.make(spec.demo_case, device=device, dtype=torch.float32)
        impls = [(f"{s.number:02d} {s.package}.{name}", getattr(modules[s.number], name))
                 for s in runnable]
        print(f"\n[demo] {name}, {sizes}, float32, on {timing.describe_machine(device)}")
        print("  checked against the float64 reference first:")
        for label, fn in impls:
            ok &= check(f"{label} ({device})", fn, spec, sample)
        print("  then timed (forward with autograd recording; backward alone); in brackets the "
              "speedup over the first line:")
        base = None
        for label, fn in [*spec.baseline_functions().items(), *impls]:
            times = time_line(f"{label} ({device})", fn, sample, base)
            base = base or times
    return ok


def main() -> int:
    print("[demo] building and importing the stages (first time: a minute or two each) ...")
    modules, not_run, loaded = {}, {}, {}
    for s in reversed(stages.all_stages()):  # newest first: it wins a package name
        module, why = load(s, loaded)
        if module is None:
            not_run[s.number] = why
        else:
            modules[s.number] = module
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    ok = True
    for name in dict.fromkeys(op for s in stages.all_stages() for op in s.ops):
        ok &= demo_op(name, modules, devices)
    for number, reason in sorted(not_run.items()):
        print(f"\n[demo] {stages.get(number).label} not run here: {reason}")
    if not torch.cuda.is_available():
        print("\n[demo] no GPU here: CUDA kernels are built and imported but not run.")
    print("\n[demo] every implementation matches its reference." if ok else
          "\n[demo] MISMATCH: see above.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
