"""The benchmark's entry: every op module in bench/, or one, on the CPU and the GPU.

Run card
  make bench [OP=lltm]                         (the Makefile runs this file, common/ on the path)
  python bench/run.py                          every op, every device here; bench/results/<op>/
  python bench/run.py --op deform_conv2d       one op (lltm | deform_conv2d | all)
  python bench/run.py --smoke                  tiny sizes, few iterations; build/bench-smoke/<op>/
  python bench/run.py --device cpu             one device (cpu | cuda | all)
  python bench/run.py --threads 1              torch.set_num_threads first: the most threads any
                                               measurement uses (deform_conv2d times 1 and 2)
  python bench/run.py --out DIR                results under DIR/<op>/
  python bench/run.py --min-run-time 0.2       seconds per measurement, instead of the plan's
  python bench/run.py --render bench/results/lltm/cpu-2threads.json    rebuild its .md and .png

What each op measures and how: bench/README.md; the harness: common/workbook/measure/harness.py,
each op's part: common/workbook/ops/<op>/bench.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from workbook import ops
from workbook.build.stages import REPO
from workbook.measure import harness


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Benchmark every op of the workbook against its "
                                                 "baselines, validated first.")
    parser.add_argument("--op", default="all", help=f"one of {', '.join(ops.having('bench'))}, "
                                                    f"or all (the default)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few iterations")
    parser.add_argument("--device", choices=("all", "cpu", "cuda"), default="all")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--out", type=Path, help="results go to OUT/<op>/ (default bench/results, "
                                                 "or build/bench-smoke with --smoke)")
    parser.add_argument("--min-run-time", type=float, help="seconds per measurement")
    parser.add_argument("--dtype", choices=harness.DTYPES, default="float32",
                        help="the inputs' dtype (default float32); another goes to its own "
                             "report, cpu-2threads-bfloat16.md")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="measure nothing: rewrite the .md and .png of a report's .json")
    # Internal: one peak-memory measurement, in the fresh process the harness starts for it.
    parser.add_argument("--probe-memory", metavar="REQUEST", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def devices_to_run(choice: str) -> list[str]:
    devices = ["cpu"] if choice in ("all", "cpu") else []
    if choice in ("all", "cuda"):
        if torch.cuda.is_available():
            devices.append("cuda")
        else:
            print(f"[bench] GPU section skipped: torch.cuda.is_available() is False (torch "
                  f"{torch.__version__}, built with CUDA {torch.version.cuda})")
    return devices


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.probe_memory:
        print(json.dumps(harness.probe_memory(json.loads(args.probe_memory))))
        return 0
    if args.render:
        paths = harness.render(args.render)
        print(f"[bench] wrote {paths['md']}, {paths['png']}")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    names = ops.having("bench") if args.op == "all" else [args.op]
    try:
        benches = [harness.load_op(name) for name in names]
    except LookupError as error:
        print(f"[bench] {error}", file=sys.stderr)
        return 2
    out_root = args.out or (harness.stages.build_root() / "bench-smoke" if args.smoke
                            else REPO / "bench" / "results")
    devices = devices_to_run(args.device)
    print(f"[bench] torch {torch.__version__}; CPU: {torch.get_num_threads()} intra-op threads "
          f"on {os.cpu_count()} cores; ops: {', '.join(names)}")
    harness.warn_if_busy()
    print("[bench] building and importing the stages ...", flush=True)
    loaded = harness.load_stages(names, devices)
    status = 0
    for bench in benches:
        status |= harness.run_op(bench, devices, loaded, smoke=args.smoke, out_root=out_root,
                                 min_run_time=args.min_run_time, dtype=args.dtype)
    return status


if __name__ == "__main__":
    sys.exit(main())
