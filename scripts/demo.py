"""make demo: build what this machine can build, check each stage, time it against PyTorch.

For every stage: build it (or reuse the build), check its output and gradients against the
float64 reference, then print the LLTM tutorial's line, `Forward: X us | Backward: Y us`, for
each LLTM implementation next to plain PyTorch, at batch 16, features 32, state 128 (float32).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))

import torch  # noqa: E402

from workbook import build, reference, timing  # noqa: E402

BATCH, FEATURES, STATE = 16, 32, 128

# What each LLTM stage is, for the tables.
TITLES = {
    2: "02 ATen C++ (setup.py)",
    3: "03 ATen C++ (JIT)",
    4: "04 CUDA, raw pointers",
    5: "05 lltm, fused (torch.library)",
}


def lltm_inputs(device, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    bound = STATE ** -0.5

    def make(*shape, scale=1.0):
        t = (torch.rand(shape, generator=gen) * 2 - 1) * scale
        return t.to(device=device, dtype=dtype).requires_grad_()

    return (make(BATCH, FEATURES), make(3 * STATE, FEATURES + STATE, scale=bound),
            make(3 * STATE, scale=bound), make(BATCH, STATE), make(BATCH, STATE))


def max_errors(fn, ref_fn, inputs):
    """Largest absolute error of the outputs and of the input gradients against float64."""
    def run(f, xs):
        outs = f(*xs)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        grads = torch.autograd.grad(outs, xs, [torch.ones_like(o) for o in outs])
        return outs, grads

    outs, grads = run(fn, inputs)
    ref_outs, ref_grads = run(ref_fn, reference.in_float64(*inputs))
    err_out = max((o.double() - r).abs().max().item() for o, r in zip(outs, ref_outs))
    err_grad = max((g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads))
    return err_out, err_grad


def check(label, fn, ref_fn, inputs, tol=1e-4):
    err_out, err_grad = max_errors(fn, ref_fn, inputs)
    ok = err_out < tol and err_grad < tol
    print(f"  {label:<40} max |error| vs float64: output {err_out:.1e}, gradients {err_grad:.1e}"
          f"  {'OK' if ok else 'MISMATCH'}")
    return ok


def runs_on(s: build.Stage) -> tuple[str, ...]:
    """Where a stage's kernels run: CUDA-only stages on the GPU, the others on the CPU too."""
    if s.cuda:
        return ("cpu", "cuda") if s.cpu_fallback else ("cuda",)
    return ("cpu",)


def main() -> int:
    print("[demo] building and importing the stages (first time: a minute or two each) ...")
    modules, skipped = {}, {}
    for s in build.STAGES.values():
        try:
            modules[s.number] = build.import_stage(s.number, quiet=False)
        except build.StageSkipped as reason:
            skipped[s.number] = str(reason)

    ok = True
    print("\n[demo] checking every stage against its float64 reference (float32, CPU):")
    x, y = (torch.randn(BATCH, STATE, requires_grad=True) for _ in range(2))
    ok &= check("01 z2xy", modules[1].z2xy, reference.z2xy, (x, y))

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    impls = [("plain PyTorch", None, reference.lltm)]
    for number, module in modules.items():
        if number >= 2:
            impls.append((TITLES.get(number, build.stage(number).folder), number, module.lltm))
    for device in devices:
        inputs = lltm_inputs(device)
        runnable = [(label, n, fn) for label, n, fn in impls
                    if n is None or device in runs_on(build.stage(n))]
        for label, n, fn in runnable[1:]:
            ok &= check(f"{label} ({device})", fn, reference.lltm, inputs)
        print(f"\n[demo] LLTM step, batch {BATCH}, features {FEATURES}, state {STATE}, float32, "
              f"on {timing.describe_machine(device)}:")
        base = None
        for label, n, fn in runnable:
            fwd, bwd = (t.median_us for t in timing.forward_backward(fn, inputs))
            base = base or (fwd, bwd)
            ratio = "" if n is None else f"   ({base[0] / fwd:.2f}x | {base[1] / bwd:.2f}x vs eager)"
            print(f"  {label + ' (' + device + ')':<40} Forward: {fwd:8.1f} us | "
                  f"Backward: {bwd:8.1f} us{ratio}")
    for number, reason in skipped.items():
        print(f"\n[demo] stage {number} ({build.stage(number).folder}) not run: {reason}")
    if not torch.cuda.is_available():
        print("\n[demo] no GPU here: CUDA kernels are built and imported but not timed.")
    print("\n[demo] all stages match the reference." if ok else "\n[demo] MISMATCH: see above.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
