"""Where a run's time goes: every build and every test appends one line to a log, and the
report reads it back as tables (CI prints them at its end).

    WORKBOOK_RUNLOG=build/runlog.jsonl make test      log a run (.ci/run sets it for each step)
    python -m workbook.measure.runlog report build/runlog.jsonl      the tables

Nothing is logged unless WORKBOOK_RUNLOG names a file. Each line is a JSON object:

    {"kind": "build", "step": "test", "stage": "09", "flavour": "nvcc", "what": ..., "s": 41.2}
    {"kind": "test",  "step": "test", "stage": "08", "flavour": "emulated", "what": node id, ...}
    {"kind": "step",  "step": "sanitize", "s": 512.0, "ccache_hits": 10, "ccache_misses": 2}
    {"kind": "reused", "step": "test", "stage": "09", "what": "296 tests", "s": 35.1, "tests": 296}

`kind` build: a stage's setup.py build (builder.build_stage) or an emulated device's library
(emulate._load), only when something was compiled or linked, with `during`, the test that ran it
(pytest's PYTEST_CURRENT_TEST, which a test's child processes inherit; a notebook's kernel too),
where one did; test: one test, its setup, call and
teardown (workbook.testing.pytest_timings); step: one step of .ci/run, its wall time and the
compiler cache's hits and misses over it; reused: the tests of one pytest process whose results
were kept (workbook.testing.pytest_results), how many and how long they took when they ran.
`step` is WORKBOOK_CI_STEP (unset: "-"). `flavour` is what the build is for: "host" (a stage's
C++ alone), "nvcc" (with its CUDA files), "cpu-only" (a CUDA stage without them), "emulated" (CUDA
files compiled for the CPU), and for the checks' builds "asan" (make sanitize), "tsan" (make
racecheck's emulated kernels) and "exercise" (a carved copy).
Processes append side by side: each line is written whole, with one write, to a file opened for
appending.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from pathlib import Path

ENV = "WORKBOOK_RUNLOG"
_STAGE_IN_PATH = re.compile(r"(?:^|/)(\d{2})_[a-z0-9_]+/")


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def checks_flavour() -> str | None:
    """The check this process builds or tests for, from the variables the checks set."""
    if os.environ.get("WORKBOOK_RACECHECK", "").strip() not in ("", "0"):
        return "tsan"
    if os.environ.get("WORKBOOK_SANITIZE", "").strip() not in ("", "0"):
        return "asan"
    return None


def stage_of(path: str) -> str:
    """The stage number a path or test node id belongs to ("08"), or "tests/" for the
    repository's own tests, "-" for anything else."""
    match = _STAGE_IN_PATH.search(path.replace(os.sep, "/"))
    if match:
        return match.group(1)
    return "tests/" if "tests/" in path else "-"


def record(kind: str, what: str, seconds: float, *, stage: str = "-", flavour: str = "-",
           **extra) -> None:
    """Append one line to the log, when there is one."""
    path = os.environ.get(ENV)
    if not path:
        return
    row = {"kind": kind, "step": os.environ.get("WORKBOOK_CI_STEP", "-"), "stage": stage,
           "flavour": flavour, "what": what, "s": round(seconds, 3), **extra}
    current = os.environ.get("PYTEST_CURRENT_TEST")  # "<node id> (setup|call|teardown)"
    if kind == "build" and current:
        row["during"] = current.rsplit(" (", 1)[0]
    line = json.dumps(row) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------
# The report


def read(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line cut short by a process killed mid-write
            continue
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    """Columns of numbers to the right, of words to the left (a column is numbers when every
    cell below the header reads as one, or is empty)."""
    columns = list(zip(header, *rows))
    widths = [max(len(str(c)) for c in column) for column in columns]
    numeric = [all(_is_number(c) for c in column[1:]) for column in columns]
    lines = ["  ".join((str(c).rjust(w) if num else str(c).ljust(w)).rstrip() if k == len(r) - 1
                       else (str(c).rjust(w) if num else str(c).ljust(w))
                       for k, (c, w, num) in enumerate(zip(r, widths, numeric)))
             for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join("  " + line for line in lines)


def _is_number(cell: str) -> bool:
    return not cell or re.fullmatch(r"[\d./]+", cell) is not None


def _short(node_id: str, width: int = 120) -> str:
    return node_id if len(node_id) <= width else node_id[:width - 3] + "..."


def report(rows: list[dict], slowest: int = 20) -> str:
    """The tables: each step's wall time with its builds and tests summed; build and test
    seconds per stage and flavour; the slowest tests; the slowest builds, with the test that
    ran each; the compiler cache's hits and misses.
    Sums are of the processes' own times: parts that run side by side add up to more than the
    wall time they took."""
    steps = [r for r in rows if r["kind"] == "step"]
    sums: dict[tuple, float] = collections.defaultdict(float)
    counts: dict[tuple, int] = collections.defaultdict(int)
    reused: dict[str, int] = collections.defaultdict(int)
    reused_seconds = 0.0
    for r in rows:
        if r["kind"] == "reused":
            reused[r["step"]] += int(r.get("tests", 0))
            reused_seconds += r["s"]
        if r["kind"] in ("build", "test"):
            sums[(r["step"], r["kind"])] += r["s"]
            sums[(r["stage"], r["flavour"], r["kind"])] += r["s"]
            counts[(r["stage"], r["flavour"], r["kind"])] += 1
    out = []
    timed = [s["step"] for s in steps]
    order = timed + sorted({r["step"] for r in rows} - set(timed))
    table = []
    for step in order:
        wall = next((s["s"] for s in steps if s["step"] == step), None)
        cache = next((s for s in steps if s["step"] == step and "ccache_hits" in s), None)
        table.append([step, f"{wall:.0f}" if wall is not None else "",
                      f"{sums[(step, 'build')]:.0f}", f"{sums[(step, 'test')]:.0f}",
                      f"{cache['ccache_hits']}/{cache['ccache_misses']}" if cache else "",
                      str(reused[step])])
    built = sum(v for k, v in sums.items() if len(k) == 2 and k[1] == "build")
    tested = sum(v for k, v in sums.items() if len(k) == 2 and k[1] == "test")
    table.append(["total", f"{sum(s['s'] for s in steps):.0f}", f"{built:.0f}", f"{tested:.0f}",
                  "", str(sum(reused.values()))])
    out.append("Steps: wall seconds; builds and tests summed over their processes "
               "(parts side by side sum past the wall); ccache hits/misses; tests whose "
               "results were reused")
    out.append(_table(["step", "wall s", "build s", "test s", "ccache", "reused"], table))
    if reused_seconds:
        out.append(f"  ({sum(reused.values())} tests reused, passed before on the same inputs: "
                   f"{reused_seconds:.0f} s when they ran; workbook.testing.pytest_results)")

    keys = sorted({(k[0], k[1]) for k in sums if len(k) == 3})
    out.append("\nPer stage and flavour: seconds summed over every step (tests: how many)")
    out.append(_table(["stage", "flavour", "build s", "test s", "tests"],
                      [[stage, flavour, f"{sums[(stage, flavour, 'build')]:.0f}",
                        f"{sums[(stage, flavour, 'test')]:.0f}",
                        str(counts[(stage, flavour, 'test')])] for stage, flavour in keys]))

    tests = sorted((r for r in rows if r["kind"] == "test"), key=lambda r: -r["s"])[:slowest]
    out.append(f"\nThe {len(tests)} slowest tests")
    out.append(_table(["s", "step", "flavour", "test"],
                      [[f"{r['s']:.1f}", r["step"], r["flavour"], _short(r["what"])]
                       for r in tests]))

    builds = sorted((r for r in rows if r["kind"] == "build"), key=lambda r: -r["s"])[:slowest]
    out.append(f"\nThe {len(builds)} slowest builds, and the test that ran each (none: the step's "
               f"own build)")
    out.append(_table(["s", "step", "flavour", "built", "during"],
                      [[f"{r['s']:.1f}", r["step"], r["flavour"], r["what"],
                        _short(r.get("during", ""), 90)] for r in builds]))

    hits = sum(s.get("ccache_hits", 0) for s in steps)
    misses = sum(s.get("ccache_misses", 0) for s in steps)
    if hits + misses:
        out.append(f"\nCompiler cache: {hits} hits, {misses} misses "
                   f"({100 * hits / (hits + misses):.0f}% hits)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["report"])
    parser.add_argument("log", type=Path)
    parser.add_argument("--slowest", type=int, default=20)
    args = parser.parse_args(argv)
    if not args.log.is_file():
        print(f"[runlog] no log at {args.log}", file=sys.stderr)
        return 2
    print(report(read(args.log), args.slowest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
