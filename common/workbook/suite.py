"""The test suite: one pytest process per stage, then the repository's own tests (tests/).

    python -m workbook.suite all          every stage, then tests/   (make test)
    python -m workbook.suite 5            stage 5's tests alone      (make stage 5)
    python -m workbook.suite 5 -- -k opcheck -x                      (pytest options after --)

The tests marked `template` (a stage generated or copied, then built and tested, in a copy of
the repository: minutes each) are left to `make test-template`, those marked `exercises`
(every stage carved, built and tested) to `make test-exercises`, and those marked `book` (the
site `make book` built) to `make book-check`.

Why a process per stage: a stage's package, and the op namespace a torch.library stage
registers, load once per process. Stages 06 and 07 both build `extops`, and a stage copied under
a new number builds its original's package again; each is tested in a process of its own. Each
part's output streams as it runs; a summary table closes the run, and the exit status is 1 when
any part failed (or collected no tests).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from . import stages

REPO = stages.REPO
# Each part ends with its slowest tests (5 s and more, at most 8): where the suite's time goes.
PYTEST = [sys.executable, "-m", "pytest", "-q", "-rs", "--durations=8", "--durations-min=5"]
SUMMARY = re.compile(r"^=*\s*(\d+ \w+.*) in [\d.]+s")
EMULATED = re.compile(r"^\[emulated\] (\d+) CUDA tests ran on the emulated CUDA device")


@dataclasses.dataclass
class Part:
    label: str
    paths: list[Path]
    options: list[str] = dataclasses.field(default_factory=list)
    exit_code: int = -1
    summary: str = ""
    seconds: float = 0.0
    emulated: int = 0  # how many of its tests ran on the emulated CUDA device (conftest.py)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def run_part(part: Part, extra: list[str], env: dict[str, str] | None = None,
             on_line: Callable[[str], None] | None = None) -> Part:
    """Run pytest on the part's paths, streaming its output; fill in the outcome. `env`: the
    environment of the pytest process (workbook.sanitize's, say), this one's by default;
    `on_line`: called with each line of output too (workbook.sanitize looks for reports)."""
    print(f"\n[test] ===== {part.label}: pytest {' '.join(_short(p) for p in part.paths)}",
          flush=True)
    start = time.perf_counter()
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    with subprocess.Popen([*PYTEST, *map(str, part.paths), *part.options, *extra], cwd=REPO,
                          env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            print(line, end="", flush=True)
            if on_line is not None:
                on_line(line)
            match = SUMMARY.match(line.strip())
            if match:
                part.summary = match.group(1)
            match = EMULATED.match(line.strip())
            if match:
                part.emulated = int(match.group(1))
    part.exit_code = proc.returncode
    part.seconds = time.perf_counter() - start
    if part.exit_code == 5:
        part.summary = "no tests collected (a stage must have test_*.py files)"
    return part


def _short(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def parts_for(targets: list[str]) -> list[Part]:
    """'all': every stage then tests/; else the stages named (numbers or folders)."""
    if targets == ["all"]:
        chosen = stages.all_stages()
        extra = [Part("tests/ (tools, notebooks, benchmark)", [REPO / "tests"],
                      ["-m", "not template and not exercises and not book"])]
    else:
        chosen, extra = [stages.get(t) for t in targets], []
    return [Part(s.label, [s.source_dir]) for s in chosen] + extra


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    targets = (argv[: argv.index("--")] if "--" in argv else argv) or ["all"]
    try:
        parts = parts_for(targets)
    except (ValueError, stages.StageError) as error:
        print(f"[test] {error}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    for part in parts:
        run_part(part, extra)
    print("\n[test] ===== summary")
    for part in parts:
        status = "ok  " if part.ok else "FAIL"
        emulated = f" ({part.emulated} on the emulated CUDA device)" if part.emulated else ""
        outcome = (part.summary or f"exit {part.exit_code}") + emulated
        print(f"  {status} {part.label:<52} {outcome:<40} {part.seconds:6.0f} s")
    if any(p.emulated for p in parts):
        print("  (emulated: the CUDA kernels compiled for the CPU and run there, workbook.emulate; "
              "they prove arithmetic, indexing and launch limits, not GPU speed or concurrency)")
    failed = [p for p in parts if not p.ok]
    total = time.perf_counter() - start
    if failed:
        print(f"[test] FAILED: {', '.join(p.label for p in failed)} ({total:.0f} s)")
        return 1
    print(f"[test] all {len(parts)} parts passed in {total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
