"""One-line mutants of the ops' kernels: is each killed by the tests of its stage?

    python scripts/mutants.py                 every mutant, each against its stage's tests
    python scripts/mutants.py m08-tile-edge   the mutants named
    python scripts/mutants.py --list          what each changes, and where

A trim of the test suite (a case moved to the build where it proves most, a check's smaller
selection) must lose nothing: every mutant killed before it is killed after. Each mutant here is
the kind of one-line fault a hurried change makes to a kernel: a bound off by one, a dropped
barrier, a stride swapped, a reduction step short. For each, the script changes that one line
in place, runs the stage's tests as `make stage N` does (pytest -x: the first failure kills it),
or its race check where the fault is a race, and puts the line back whatever happens; a mutant
that survives is a hole in the tests. The stage is built CPU-only (WORKBOOK_NO_CUDA=1) and its
CUDA kernels run on the emulated CUDA device, as `make verify` does without a GPU.

The mutated file is the working tree's: run it with nothing else building or testing from this
tree (its builds go to build/mutants/, apart from make test's). The results go to
bench/results/mutants/<label>.json (--label; default: the date), one line per
mutant: killed or survived, by which check, in how many seconds, and the first failing test.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "mutants"


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository
    before: str  # the text changed: it must occur exactly once in the file
    after: str
    stage: int  # whose tests must kill it
    check: str = "tests"  # or "racecheck": the stage's CUDA tests under ThreadSanitizer
    why: str = ""


COOP = "stages/08_cooperating_threads/csrc/lltm_cooperating.cuh"
MSDA_CPU = "stages/09_ms_deform_attn/csrc/ms_deform_attn/cpu/ms_deform_attn_cpu.h"
MSDA_CUDA = "stages/09_ms_deform_attn/csrc/ms_deform_attn/cuda/ms_deform_attn_cuda.cuh"
DEFORM_CPU = "stages/06_op_library/csrc/deform_conv2d/cpu/deform_conv2d_cpu.h"
BILINEAR = "common/include/workbook/bilinear.h"

MUTANTS = [
    Mutant("m08-tile-edge", COOP, "row < m && k0 + tx < k ?", "row < m && k0 + tx <= k ?", 8,
           why="A's tile reads one column past K"),
    Mutant("m08-tile-barrier", COOP,
           "      __syncthreads();  // every thread has read them before the next turn",
           "      // (barrier dropped)  // every thread has read them before the next turn", 8,
           check="racecheck", why="the tile loop's second barrier dropped"),
    Mutant("m08-tree-short", COOP, "half >= kWarp; half /= 2", "half > kWarp; half /= 2", 8,
           why="the block's tree stops at 64 partial sums, the warp adds 32"),
    Mutant("m08-row-loop", COOP, "row < rows; row += kSumThreads", "row < rows - 1; row += "
           "kSumThreads", 8, why="the column sums leave out the last row"),
    Mutant("m08-shuffle", COOP, "int offset = kWarp / 2; offset > 0; offset /= 2",
           "int offset = kWarp / 4; offset > 0; offset /= 2", 8,
           why="the warp's shuffles start at 8: half the lanes are never added"),
    Mutant("m09-cuda-warp-sum", MSDA_CUDA, "int offset = kWarp / 2; offset > 0; offset /= 2",
           "int offset = kWarp / 2; offset > 1; offset /= 2", 9,
           why="the warp's channel sum skips its last step"),
    Mutant("m09-cpu-plane", MSDA_CPU, "value + ((n * g.values + lv.start) * M + m) * D;",
           "value + ((n * g.values + lv.start) * M + m) * M;", 9,
           why="a level's value plane at the wrong stride (M for D)"),
    Mutant("m06-cpu-base-pixel", DEFORM_CPU, "(s.y0 + 1) * row + (s.x0 + 1)",
           "(s.y0 + 1) * row + s.x0", 6, why="the base pixel one column to the left"),
    Mutant("m06-bilinear-range", BILINEAR, "x >= T(-1) && x < static_cast<T>(width);",
           "x >= T(-1) && x <= static_cast<T>(width);", 6,
           why="a point on the right edge + 1 counts as inside"),
]


def _apply(m: Mutant) -> str:
    path = REPO / m.path
    text = path.read_text()
    found = text.count(m.before)
    if found != 1:
        raise SystemExit(f"[mutants] {m.name}: `{m.before}` occurs {found} times in {m.path} "
                         f"(must be once): update the mutant")
    path.write_text(text.replace(m.before, m.after))
    return text


def _command(m: Mutant, extra: list[str]) -> list[str]:
    if m.check == "racecheck":
        return [sys.executable, "-m", "workbook.net.racecheck", str(m.stage), "--", "-x", "-rf",
                *extra]
    return [sys.executable, "-m", "workbook.testing.suite", str(m.stage), "--", "-x", "-rf", *extra]


_FAILED = re.compile(r"^FAILED (\S+)")


def run(m: Mutant, timeout: float, extra: list[str]) -> dict:
    """The mutant applied, its check run, the file put back: the outcome as a dict."""
    build = REPO / "build" / "mutants"  # not make test's builds, which a mutant would replace
    env = dict(os.environ, WORKBOOK_NO_CUDA="1", WORKBOOK_EMULATE_QUIET="1",
               WORKBOOK_BUILD_DIR=str(build), TORCH_EXTENSIONS_DIR=str(build / "jit"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "common"),
                                                         os.environ.get("PYTHONPATH")])))
    original = _apply(m)
    start = time.perf_counter()
    try:
        proc = subprocess.run(_command(m, extra), cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=timeout)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as expired:
        code, output = None, (expired.stdout or b"").decode(errors="replace")
    finally:
        (REPO / m.path).write_text(original)
    seconds = time.perf_counter() - start
    failed = next((match.group(1) for line in output.splitlines()
                   if (match := _FAILED.match(line.strip()))), "")
    outcome = ("timeout" if code is None else "survived" if code == 0 else "killed")
    if outcome == "killed" and not failed and "race report" in output:
        failed = "a race report"
    if outcome == "killed" and not failed:
        failed = f"exit {code}: " + (output.strip().splitlines() or [""])[-1][:120]
    return {"mutant": m.name, "stage": m.stage, "check": m.check, "outcome": outcome,
            "seconds": round(seconds, 1), "first_failure": failed, "why": m.why}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--label", default=datetime.date.today().isoformat(),
                        help="the results file's name under bench/results/mutants/")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per mutant")
    args, extra = parser.parse_known_args(argv)
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        print(f"[mutants] no mutant named {', '.join(sorted(unknown))} (--list)", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.name:<20} stage {m.stage:<2} {m.check:<9} {m.path}: {m.why}\n"
                  f"{'':<20} - {m.before}\n{'':<20} + {m.after}")
        return 0
    for m in chosen:  # every mutant's line is where it says before any is run
        _apply(m)
        _apply(dataclasses.replace(m, before=m.after, after=m.before))
    results = []
    for m in chosen:
        print(f"[mutants] {m.name} (stage {m.stage}, {m.check}): {m.why} ...", flush=True)
        result = run(m, args.timeout, extra)
        results.append(result)
        print(f"[mutants]   {result['outcome']} in {result['seconds']:.0f} s"
              f"{': ' + result['first_failure'] if result['first_failure'] else ''}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.label}.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    killed = sum(r["outcome"] == "killed" for r in results)
    print(f"[mutants] {killed} of {len(results)} killed; results in "
          f"{out.relative_to(REPO)}")
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
