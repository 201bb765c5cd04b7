"""The stages of the workbook, found on disk: nothing else keeps a list of them.

A stage is a folder ``stages/NN_name/`` holding a ``stage.toml``:

    title = "the one idea this stage adds"     # shown by `make help` and in the README's table
    package = "lltm"                           # the Python package the stage builds, and the
                                               # namespace of its ops: torch.ops.lltm.*
    ops = ["lltm"]                             # its ops: descriptors in common/workbook/ops/
    build = "setup"                            # "setup": setup.py, ahead of time; "jit": on import
    cuda = true                                # has CUDA sources (built where nvcc is found)
    cpu_fallback = true                        # with cuda: CPU-only build, not a skip, without nvcc
    production = true                          # `make install` installs the last such stage
    sources_from = ["06_op_library"]           # other stage folders it compiles sources of
                                               # (a change there rebuilds this stage too)
    lesson = [["04_cuda_raw/csrc/lltm_cuda.cu", "05_cuda_accessors/csrc/lltm_cuda.cu"]]
                                               # `make diff N`: file pairs (under stages/) whose
                                               # diff is the stage's lesson

The number is the folder's two-digit prefix. The stage's tests are the ``test_*.py`` files in its
folder; they find their own stage with ``stages.here(__file__)``, so a folder copied under a new
number is a new stage, built by ``make stage N`` and tested by ``make test``, with no other edit.

    python -m workbook.build.stages               the stages, one line each (what `make help`
                                                  prints)
    python -m workbook.build.stages --readme-table    the README's stage table, as it must read
    python -m workbook.build.stages --diff 5      stage 5's lesson: the diff of its `lesson` pairs
                                                  (--solutions: the exercises' solutions unfolded)
    python -m workbook.build.stages --production  the folder `make install` installs
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shutil
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
STAGES_DIR = REPO / "stages"
FOLDER_NAME = re.compile(r"^(\d{2})_[a-z0-9_]+$")

# The keys of stage.toml: name -> (type, required).
_KEYS = {"title": (str, True), "package": (str, True), "ops": (list, True),
         "build": (str, True), "cuda": (bool, False), "cpu_fallback": (bool, False),
         "production": (bool, False), "lesson": (list, False), "sources_from": (list, False)}


class StageError(ValueError):
    """A stage folder whose stage.toml is missing, unreadable or incomplete; says which and why."""


def build_root() -> Path:
    """The one folder every build output and JIT cache lives under (git-ignored)."""
    return Path(os.environ.get("WORKBOOK_BUILD_DIR", REPO / "build")).resolve()


def empty_build_folder(*parts: str) -> Path:
    """build_root()/parts, emptied: a test's sources and builds at the same place every run. The
    compiler cache takes paths relative to the clone, so a second run finds in it every file the
    first compiled (a temporary folder is another place each time)."""
    folder = build_root().joinpath(*parts)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


@dataclasses.dataclass(frozen=True)
class Stage:
    number: int
    folder: str  # folder name under stages/, e.g. "05_cuda_accessors"
    title: str
    package: str  # the importable Python package the stage provides; its ops' namespace too
    ops: tuple[str, ...]  # names of the ops it implements (common/workbook/ops/<name>/)
    kind: str  # "setup" (built ahead of time with setup.py), "jit" (built when imported)
    cuda: bool = False  # has CUDA sources, compiled when a CUDA toolkit is found
    cpu_fallback: bool = False  # with cuda: builds CPU-only (instead of being skipped) without one
    production: bool = False  # a library to install (`make install` takes the last such stage)
    lesson: tuple[tuple[str, str], ...] = ()  # (before, after) file pairs, relative to stages/
    sources_from: tuple[str, ...] = ()  # other stage folders whose sources it compiles
    source_dir: Path = dataclasses.field(default=STAGES_DIR, compare=False)
    # A CUDA stage built without its CUDA kernels (WORKBOOK_NO_CUDA=1, WORKBOOK_NVCC=0 for one
    # with a CPU fallback, or `cpu_only_build()`):
    # a library of its own, in a folder of its own, so neither build replaces the other.
    cpu_only: bool = dataclasses.field(default=False, compare=False)

    @property
    def source_dirs(self) -> list[Path]:
        """Its own folder and the folders it compiles sources from."""
        return [self.source_dir, *(self.source_dir.parent / f for f in self.sources_from)]

    @property
    def build_dir(self) -> Path:
        """build/stages/<folder>; build/stages-cpu/<folder> for a CUDA stage built CPU-only."""
        return build_root() / ("stages-cpu" if self.cpu_only else "stages") / self.folder

    def cpu_only_build(self) -> Stage:
        """This stage built without CUDA kernels (itself, for a stage without CUDA sources).

        `make demo` on a machine without a GPU builds these: CUDA kernels that cannot run there
        are not compiled. Without a CUDA toolkit the ordinary build is CPU-only already (in
        build/stages/), and that is the one to use.
        """
        return dataclasses.replace(self, cpu_only=True) if self.cuda else self

    @property
    def lib_dir(self) -> Path:
        """Where `setup.py build` puts the importable package (Python files and the .so)."""
        return self.build_dir / "lib"

    @property
    def devices(self) -> tuple[str, ...]:
        """Where the stage's kernels run: CUDA-only stages on the GPU, the others on the CPU too."""
        if self.cuda:
            return ("cpu", "cuda") if self.cpu_fallback else ("cuda",)
        return ("cpu",)

    @property
    def own_cpu_kernels(self) -> bool:
        """Whether its own folder holds C++ for the CPU. A CUDA stage may take all of its CPU
        code from the stages it compiles sources of (stage 07's is stage 06's, stage 08's stage
        05's): on the CPU it is those stages again, which the tools that run every CPU
        implementation once (the demo, the matrix, the fuzzing, the benchmark) leave out."""
        return any((self.source_dir / "csrc").rglob("*.cpp"))

    @property
    def registers_ops(self) -> bool:
        """Whether its C++ defines dispatcher ops (TORCH_LIBRARY or TORCH_LIBRARY_FRAGMENT, with
        fake kernels beside them) rather than pybind11 functions: read from its sources."""
        return any("TORCH_LIBRARY(" in text or "TORCH_LIBRARY_FRAGMENT(" in text
                   for folder in self.source_dirs
                   for path in (folder / "csrc").rglob("*.cpp")
                   for text in (path.read_text(errors="replace"),))

    @property
    def torch_target_version(self) -> str | None:
        """The TORCH_TARGET_VERSION its setup.py builds with (`TORCH_TARGET = "0x..."`: stage
        10), or None: an ATen stage."""
        setup = self.source_dir / "setup.py"
        found = re.search(r'^TORCH_TARGET\s*=\s*"(0x[0-9a-fA-F]+)"', setup.read_text(), re.M) \
            if setup.is_file() else None
        return found.group(1) if found else None

    @property
    def stable_abi(self) -> bool:
        """Whether its library is built on PyTorch's stable ABI (its setup.py sets
        TORCH_TARGET_VERSION: stage 10), where a C++ check can raise only RuntimeError."""
        return self.torch_target_version is not None

    @property
    def label(self) -> str:
        return f"stage {self.number} ({self.folder})"

    def test_files(self) -> list[Path]:
        return sorted(self.source_dir.glob("test_*.py"))


def read(folder: Path) -> Stage:
    """The Stage described by folder/stage.toml; StageError says what is wrong with it."""
    match = FOLDER_NAME.match(folder.name)
    if not match:
        raise StageError(f"{folder}: a stage folder is named NN_name (two digits, then lowercase "
                         f"letters, digits and _), e.g. 06_my_op")
    path = folder / "stage.toml"
    if not path.is_file():
        raise StageError(f"{path} is missing: every stage folder describes itself there "
                         f"(see common/workbook/build/stages.py)")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise StageError(f"{path}: not valid TOML: {error}") from None
    for key, (kind, required) in _KEYS.items():
        if key not in data:
            if required:
                raise StageError(f"{path}: `{key}` is missing")
        elif not isinstance(data[key], kind):
            raise StageError(f"{path}: `{key}` must be a {kind.__name__}, "
                             f"got {type(data[key]).__name__}")
    unknown = set(data) - set(_KEYS)
    if unknown:
        raise StageError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(_KEYS)}")
    if data["build"] not in ("setup", "jit"):
        raise StageError(f"{path}: `build` must be \"setup\" or \"jit\", got {data['build']!r}")
    lesson = data.get("lesson", [])
    if not all(isinstance(pair, list) and len(pair) == 2 for pair in lesson):
        raise StageError(f"{path}: `lesson` must be a list of [before, after] file pairs")
    return Stage(int(match.group(1)), folder.name, data["title"], data["package"],
                 tuple(data["ops"]), data["build"], data.get("cuda", False),
                 data.get("cpu_fallback", False), data.get("production", False),
                 tuple(tuple(pair) for pair in lesson), tuple(data.get("sources_from", [])),
                 folder, cpu_only=data.get("cuda", False) and (
                     cuda_disabled() or (data.get("cpu_fallback", False) and not nvcc_wanted())))


def cuda_disabled() -> bool:
    """WORKBOOK_NO_CUDA=1: every CUDA stage builds CPU-only (workbook.build.toolkit finds no
    toolkit).

    The stages read in such a process are their CPU-only builds; the build of a CPU-only stage
    passes the variable on to its setup.py, so both sides agree on the folder.
    """
    return os.environ.get("WORKBOOK_NO_CUDA", "0") not in ("", "0")


# WORKBOOK_NVCC=0: the CUDA stages that have a CPU fallback are built CPU-only, though a toolkit
# is found (a stage that is CUDA-only is still built with nvcc). `make test`, `make stage N` and
# `make check` set it where no GPU is visible and the CUDA tests run on the emulated device
# (workbook.build.emulate.choose_builds says why); `make nvcc-check` sets it to 1.
NVCC = "WORKBOOK_NVCC"


def nvcc_wanted() -> bool:
    """Whether a CUDA stage with a CPU fallback is built with nvcc where a toolkit is found: yes
    unless WORKBOOK_NVCC=0."""
    return os.environ.get(NVCC, "1").strip() != "0"


def discover(root: Path = STAGES_DIR) -> dict[int, Stage]:
    """Every stage under root, by number. Two folders with one number are an error."""
    found: dict[int, Stage] = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        if not FOLDER_NAME.match(folder.name):
            continue
        s = read(folder)
        if s.number in found:
            raise StageError(f"two stages are numbered {s.number}: {found[s.number].folder} and "
                             f"{s.folder}; renumber one")
        found[s.number] = s
    return found


def all_stages() -> list[Stage]:
    return list(discover().values())


def get(number_or_folder: int | str | Stage) -> Stage:
    """A stage by number (5, "5", "05"), folder name, or folder path."""
    if isinstance(number_or_folder, Stage):
        return number_or_folder
    key = str(number_or_folder)
    path = Path(key)
    if path.is_dir() and (path / "stage.toml").is_file():
        return read(path.resolve())
    stages = discover()
    for s in stages.values():
        if key in (str(s.number), f"{s.number:02d}", s.folder):
            return s
    known = ", ".join(f"{s.number} ({s.folder})" for s in stages.values())
    raise ValueError(f"unknown stage {number_or_folder!r}; the stages found are: {known}")


def here(file: str | Path) -> Stage:
    """The stage whose folder holds `file`: how a stage's test file finds its stage."""
    folder = Path(file).resolve().parent
    while not (folder / "stage.toml").is_file():
        if folder.parent == folder:
            raise StageError(f"{file} is not inside a stage folder (none above it has stage.toml)")
        folder = folder.parent
    return read(folder)


def providing(op: str) -> list[Stage]:
    """The stages that implement `op`, in order."""
    return [s for s in all_stages() if op in s.ops]


def fullest(candidates: list[Stage] | None = None) -> dict[str, Stage]:
    """Per package, the stage a tool loads when it can load one per process: the one that
    provides the most ops, the newest of those. Stages 06, 07, 09 and 10 all build `extops`: that
    is 10, the stable-ABI library, which holds all three ops as 09 does (callers pass the stages
    that run on their device)."""
    chosen: dict[str, Stage] = {}
    for s in candidates if candidates is not None else all_stages():
        best = chosen.get(s.package)
        if best is None or (len(s.ops), s.number) > (len(best.ops), best.number):
            chosen[s.package] = s
    return chosen


def production() -> Stage:
    """The stage `make install` installs: the last one marked production = true."""
    marked = [s for s in all_stages() if s.production]
    if not marked:
        raise StageError("no stage.toml says `production = true`: nothing to install")
    return marked[-1]


def lesson_diff(s: Stage, solutions: bool = False) -> str:
    """The unified diff of each of the stage's lesson pairs, one after the other; each
    exercise's solution folded (workbook.teaching.exercises.fold), unless `solutions`."""
    from workbook.teaching import exercises  # which reads the stages: imported when used

    def text(path: Path) -> list[str]:
        lines = path.read_text().splitlines(keepends=True)
        return lines if solutions else exercises.fold(lines, path)

    if not s.lesson:
        return f"{s.label} names no lesson pairs in its stage.toml (`lesson = [[before, after]]`)"
    chunks = []
    root = s.source_dir.parent
    for before, after in s.lesson:
        a, b = root / before, root / after
        missing = [str(p) for p in (a, b) if not p.is_file()]
        if missing:
            raise StageError(f"{s.source_dir / 'stage.toml'}: `lesson` names missing files: "
                             f"{', '.join(missing)}")
        chunks.append("".join(difflib.unified_diff(
            text(a), text(b), f"stages/{before}", f"stages/{after}"))
            or f"(stages/{before} and stages/{after} are the same)\n")
    return "\n".join(chunks)


def readme_table(stages: list[Stage] | None = None) -> str:
    """The stage table of README.md, generated from the stage folders."""
    rows = ["| stage | folder | what it adds | build and test |", "| --- | --- | --- | --- |"]
    for s in stages if stages is not None else all_stages():
        rows.append(f"| {s.number} | `stages/{s.folder}` | {s.title} | `make stage {s.number}` |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="The workbook's stages, found on disk.")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--readme-table", action="store_true", help="print README.md's stage table")
    group.add_argument("--numbers", action="store_true", help="print the stage numbers")
    group.add_argument("--diff", metavar="N", help="print stage N's lesson as a diff")
    group.add_argument("--production", action="store_true",
                       help="print the folder of the production library")
    parser.add_argument("--solutions", action="store_true",
                        help="with --diff: the exercises' solutions too (folded otherwise)")
    args = parser.parse_args(argv)
    try:
        stages = all_stages()
        if args.diff:
            print(lesson_diff(get(args.diff), args.solutions), end="")
            return 0
        if args.production:
            print(production().source_dir)
            return 0
    except (StageError, ValueError) as error:
        print(f"[stages] {error}", file=sys.stderr)
        return 1
    if args.readme_table:
        print(readme_table(stages))
    elif args.numbers:
        print(" ".join(str(s.number) for s in stages))
    else:
        for s in stages:
            print(f"  {s.number:>2}  {s.folder:<22} {s.title}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
