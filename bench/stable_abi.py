"""What the stable ABI costs: stage 10's extops against the newest ATen build's, interleaved.

Run card
  make bench-abi                               (make bench runs it too, after bench/run.py)
  python bench/stable_abi.py [--rounds 7] [--smoke] [--out DIR]
  writes bench/results/stable_abi/cpu-2threads.{json,md}

Both stages build a package named `extops` whose library registers the same ops, so one process
can load only one of them. The two are timed in two worker processes, one per stage, started
afresh every round (a process can stay slower than another for its whole life, by where its
memory and threads landed: measured here, up to 1.3x on the same library): this process asks them
for a measurement in turn, one measurement of every case per round, who goes first alternating,
so both see the same machine at nearly the same moment.
Each measurement is the median of a few calls after warm-up calls; the report gives, per case,
each stage's median over the rounds and the ratio ATen / stable (above 1: stage 10 is faster)
with its spread over the rounds (lowest and highest round's ratio), which is the noise.

Before timing, both workers compute every case on the same inputs (seeded) and this process
compares the results: stage 10 must agree with the ATen build (float32, the descriptor's tolerance
against float64 is far looser than what is asked here: 1e-4 relative).

The cases, CPU, float32:
  deform_conv2d  the benchmark's `main` configuration (N 4, C 64 -> 64, 56 x 56, 3 x 3, pad 1,
                 mask, bias): forward, and forward + backward (every gradient), at 1 and 2 threads
  lltm           the tutorial's batch 16 (features 32, state 128) and batch 4096: forward, and
                 forward + backward. The ATen build runs the LLTM's autograd in C++ (a
                 torch::autograd::Function), stage 10 from Python (torch.library.register_autograd):
                 at batch 16 the difference is mostly that per-call cost.
  ms_deform_attn the descriptor's demo geometry, Deformable DETR's encoder on a 128 x 128 image
                 (levels 32 x 32 to 4 x 4, 1360 queries, 8 heads of 32 channels, 4 points), batch
                 2: forward, and forward + backward (value, locations and weights), at 1 and 2
                 threads. Both stages run its autograd from Python (stage 09's module).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def compared() -> tuple[int, int]:
    """(the ATen library's stage, the stable one's): the stage on the stable ABI, and the newest
    other stage that builds its package (found on disk, as make finds stages)."""
    from workbook.build import stages

    stable = next(s for s in stages.all_stages() if s.stable_abi)
    aten = max((s for s in stages.all_stages() if s.package == stable.package and not s.stable_abi),
               key=lambda s: s.number)
    return aten.number, stable.number


STAGES = compared()  # (the ATen library, the stable one)
ATEN, STABLE = (f"{n:02d}" for n in STAGES)


def cases(smoke: bool) -> list[dict]:
    dcn = ({"batch": 1, "channels": 8, "size": 10} if smoke
           else {"batch": 4, "channels": 64, "size": 56})
    out = []
    for threads in (1, 2):
        for phase in ("forward", "forward+backward"):
            out.append({"op": "deform_conv2d", "config": "main", **dcn, "phase": phase,
                        "threads": threads})
    for batch in ((16,) if smoke else (16, 4096)):
        for phase in ("forward", "forward+backward"):
            out.append({"op": "lltm", "config": f"batch {batch}", "batch": batch, "features": 32,
                        "state": 128, "phase": phase, "threads": 2})
    msda = ({"batch": 1, "queries": 20, "heads": 2, "channels": 8, "points": 2,
             "levels": [[4, 4], [2, 2]]} if smoke else
            {"batch": 2, "queries": 1360, "heads": 8, "channels": 32, "points": 4,
             "levels": [[32, 32], [16, 16], [8, 8], [4, 4]]})
    for threads in (1, 2):
        for phase in ("forward", "forward+backward"):
            out.append({"op": "ms_deform_attn", "config": "detr levels", **msda, "phase": phase,
                        "threads": threads})
    return out


def label(case: dict) -> str:
    return f"{case['op']} {case['config']} {case['phase']}, {case['threads']} thread" + \
        ("s" if case["threads"] > 1 else "")


# ----------------------------------------------------------------------------------------------
# The worker: one stage's extops, measuring on request


def make_inputs(case: dict):
    import torch

    g = torch.Generator().manual_seed(0)
    if case["op"] == "deform_conv2d":
        n, c, s = case["batch"], case["channels"], case["size"]
        x = torch.randn(n, c, s, s, generator=g)
        offset = (torch.rand(n, 18, s, s, generator=g) - 0.5) * 5  # +-2.5 px
        mask = torch.rand(n, 9, s, s, generator=g)
        weight = torch.randn(c, c, 3, 3, generator=g) / (3 * c ** 0.5)
        bias = torch.randn(c, generator=g)
        return [x, offset, weight, bias, mask]
    if case["op"] == "ms_deform_attn":
        n, q, m, d, p = (case[k] for k in ("batch", "queries", "heads", "channels", "points"))
        shapes = torch.tensor(case["levels"], dtype=torch.int64)
        starts = torch.cat([shapes.new_zeros(1), shapes.prod(1).cumsum(0)[:-1]])
        value = torch.randn(n, int(shapes.prod(1).sum()), m, d, generator=g)
        locations = torch.rand(n, q, m, len(shapes), p, 2, generator=g)
        weights = torch.rand(n, q, m, len(shapes), p, generator=g)
        return [value, shapes, starts, locations, weights / weights.sum((-2, -1), keepdim=True)]
    b, f, s = case["batch"], case["features"], case["state"]
    return [torch.randn(b, f, generator=g), torch.randn(3 * s, f + s, generator=g) * 0.1,
            torch.randn(3 * s, generator=g) * 0.1, torch.randn(b, s, generator=g),
            torch.randn(b, s, generator=g)]


def make_call(extops, case: dict):
    """The measured call for `case` and the tensors whose grads it fills (for the comparison)."""
    tensors = make_inputs(case)
    backward = case["phase"] == "forward+backward"
    for t in tensors:
        t.requires_grad_(backward and t.is_floating_point())  # not the level table
    if case["op"] == "deform_conv2d":
        x, offset, weight, bias, mask = tensors

        def forward():
            return extops.deform_conv2d(x, offset, weight, bias, padding=1, mask=mask)
    elif case["op"] == "ms_deform_attn":
        def forward():
            return extops.ms_deform_attn(*tensors)
    else:
        def forward():
            new_h, new_cell = extops.lltm(*tensors)
            return new_h + new_cell

    def call():
        for t in tensors:
            t.grad = None
        out = forward()
        if backward:
            out.sum().backward()
        return out

    return call, tensors


def worker(stage: int) -> int:
    import torch

    from workbook.build.loader import import_stage

    extops = import_stage(stage)
    calls = {}
    for line in sys.stdin:
        request = json.loads(line)
        case = request["case"]
        torch.set_num_threads(case["threads"])
        key = label(case)
        if key not in calls:
            calls[key] = make_call(extops, case)
        call, tensors = calls[key]
        if request["what"] == "result":
            out = call()
            values = [out.detach()] + [t.grad for t in tensors if t.grad is not None]
            reply = {"values": [v.flatten().tolist() for v in values]}
        else:
            for _ in range(request["warmup"]):
                call()
            times = []
            for _ in range(request["calls"]):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            reply = {"seconds": statistics.median(times)}
        print(json.dumps(reply), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------
# The driver


class Worker:
    def __init__(self, stage: int):
        env = {**os.environ, "PYTHONPATH": str(REPO / "common") + os.pathsep +
               os.environ.get("PYTHONPATH", "")}
        self.stage = stage
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(stage)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=REPO)

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"[bench-abi] stage {self.stage}'s worker exited "
                             f"({self.proc.wait()}): see its error above")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def agree(a: list, b: list, rtol: float = 1e-4) -> float:
    """The largest difference between two results, relative to the largest magnitude."""
    import torch

    worst = 0.0
    for x, y in zip(a, b, strict=True):
        x, y = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
        scale = max(x.abs().max().item(), 1e-30)
        worst = max(worst, (x - y).abs().max().item() / scale)
    if worst > rtol:
        raise SystemExit(f"[bench-abi] stage {STABLE} disagrees with stage {ATEN}: relative "
                         f"difference "
                         f"{worst:.2e} > {rtol:.0e}")
    return worst


def render(report: dict) -> str:
    lines = [f"# What the stable ABI costs: stage {STABLE} against stage {ATEN}", "",
             f"{report['machine']}, torch {report['torch']}, commit {report['commit']}, "
             f"{report['rounds']} rounds, float32, CPU. Produced by `make bench-abi` "
             f"(bench/stable_abi.py: two worker processes, one per stage, timed in turn).", "",
             f"Ratio = stage {ATEN}'s time / stage {STABLE}'s (above 1: the stable build is "
             "faster); noise = the lowest and highest ratio of a single round.", "",
             f"| case | stage {ATEN} (ATen) | stage {STABLE} (stable) | ratio {ATEN}/{STABLE} | "
             "noise |",
             "|---|--:|--:|--:|--:|"]
    for row in report["cases"]:
        lines.append(f"| {row['case']} | {row['ms'][0]:.3f} ms | {row['ms'][1]:.3f} ms | "
                     f"{row['ratio']:.3f} | {row['ratio_low']:.2f}-{row['ratio_high']:.2f} |")
    lines += ["", f"Results agree: largest relative difference {report['agreement']:.1e} "
              f"(outputs and gradients, every case)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 rounds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker(args.worker)

    import torch

    rounds = 2 if args.smoke else args.rounds
    out = args.out or (REPO / ("build/bench-smoke" if args.smoke else "bench/results") /
                       "stable_abi")
    all_cases = cases(args.smoke)
    workers = [Worker(s) for s in STAGES]
    try:
        worst = 0.0
        for case in all_cases:
            results = [w.ask(what="result", case=case)["values"] for w in workers]
            worst = max(worst, agree(*results))
    finally:
        for w in workers:
            w.close()
    print(f"[bench-abi] stages {ATEN} and {STABLE} agree on every case (largest relative "
          f"difference {worst:.1e}); timing {len(all_cases)} cases x {rounds} rounds, a fresh "
          f"pair of worker processes each round ...", flush=True)
    times = {label(c): ([], []) for c in all_cases}
    for r in range(rounds):
        # Fresh processes every round: one process can stay slower than another for its whole
        # life (where its memory and its threads landed), which timing within it cannot see.
        workers = [Worker(s) for s in STAGES]
        try:
            for case in all_cases:
                big = case["op"] != "lltm" or case["batch"] > 1000
                calls, warmup = (10, 2) if big else (50, 10)
                if args.smoke:
                    calls, warmup = 2, 1
                order = workers if r % 2 == 0 else workers[::-1]  # who goes first alternates
                for w in order:
                    seconds = w.ask(what="time", case=case, calls=calls, warmup=warmup)["seconds"]
                    times[label(case)][STAGES.index(w.stage)].append(seconds)
        finally:
            for w in workers:
                w.close()
        print(f"[bench-abi] round {r + 1}/{rounds} done", flush=True)

    rows = []
    for key, (aten, stable) in times.items():
        ratios = [a / s for a, s in zip(aten, stable, strict=True)]
        rows.append({"case": key, "ms": [statistics.median(aten) * 1e3,
                                         statistics.median(stable) * 1e3],
                     "ratio": statistics.median(aten) / statistics.median(stable),
                     "ratio_low": min(ratios), "ratio_high": max(ratios),
                     "seconds": {ATEN: aten, STABLE: stable}})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    report = {"machine": f"{platform.processor() or platform.machine()}, "
                         f"{os.cpu_count()} cores", "torch": torch.__version__,
              "commit": commit, "rounds": rounds, "agreement": worst, "cases": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu-2threads.json").write_text(json.dumps(report, indent=1) + "\n")
    text = render(report)
    (out / "cpu-2threads.md").write_text(text)
    print(text)
    print(f"[bench-abi] written to {out}/cpu-2threads.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
