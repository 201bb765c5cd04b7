"""Exercises carved from the stages' own sources, checked by the stages' own tests.

A stage marks the code a learner should write with two comment lines around it, in the source
file itself (`#` instead of `//` in Python):

    // EXERCISE z2xy-backward: return the gradients {grad_x, grad_y} = {2 grad_z, grad_z}
    return {grad_z * 2, grad_z};
    // END EXERCISE z2xy-backward

so the solution is the stage and nothing is written twice. `carve` copies stage N to
exercises/NN_name/ (git-ignored) with every marked region replaced by a TODO that says what to
compute and which tests check it, plus one line that keeps the copy compiling and makes it fail
at run time with a message naming the exercise: TORCH_CHECK(false, ...) in C++ (STD_TORCH_CHECK
on the stable ABI), raise NotImplementedError(...) in Python; a CUDA kernel's body is left empty
(its outputs are then whatever memory held, which the tests catch on a GPU). `check` builds
that copy under its own build folder and runs stage N's tests against it, then says which
exercises and which properties (forward, gradients, gradcheck, bad inputs, opcheck, ...) fail.

    python -m workbook.teaching.exercises list [N]        the exercises (of stage N): where,
                                                          what, tests
    python -m workbook.teaching.exercises carve N [--reset]   exercises/NN_name with TODOs
                                                          (make exercise N)
    python -m workbook.teaching.exercises verify N [-- OPTIONS]    build it, run the tests
                                                          (make verify N)
    python -m workbook.teaching.exercises reveal N [NAME ...] put solutions into it (make exercise
                                                          N REVEAL=NAME; REVEAL=all: every one)

`diff -ru stages/NN_name exercises/NN_name` shows the solution of every exercise you have not
written yet. The markers stay in the copy: they tell `check` and `reveal` where each exercise is.

How `check` builds the copy: a stage may compile sources of another (stage 03 builds stage 02's
C++, stage 07 stage 06's), which it finds next door in stages/. So the copy is synced into
build/exercises/NN_name/stages/ beside the real stages, and built and tested there with its own
build folder (build/exercises/NN_name/build/, JIT cache included): the real stage's build is never
touched. Paths in the output are shown as exercises/NN_name/... again.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterable, Sequence
from pathlib import Path

from workbook.build import stages
from workbook.build.stages import REPO, Stage, build_root
from workbook.teaching import pytest_gate, pytest_running

WORK_DIR = REPO / "exercises"

# Files that may hold exercise regions, and their comment marker.
COMMENT = {".cpp": "//", ".cc": "//", ".h": "//", ".hpp": "//", ".cu": "//", ".cuh": "//",
           ".py": "#"}
GPU_SUFFIXES = (".cu", ".cuh")
_NAME = r"[a-z0-9][a-z0-9_-]*"
_START = re.compile(rf"^(?P<indent>\s*)(?P<mark>//|#)\s*EXERCISE\s+(?P<name>{_NAME})\s*:\s*"
                    rf"(?P<task>\S.*?)\s*$")
_END = re.compile(rf"^(?P<indent>\s*)(?P<mark>//|#)\s*END\s+EXERCISE\s+(?P<name>{_NAME})\s*$")
# Anything that looks like a marker, to catch a misspelt one.
_LOOSE = re.compile(r"^\s*(//|#)\s*(END\s+)?EXERCISE\b")
# Copied with the stage folder: everything but what a build or an editor leaves behind.
_LEFTOVERS = ("__pycache__", "*.egg-info", "*.so", "*.o", "build", ".ipynb_checkpoints",
              ".pytest_cache")
_IGNORED = shutil.ignore_patterns(*_LEFTOVERS)

# Which tests check an exercise is said under its EXERCISE line, in the source itself:
#
#     // EXERCISE z2xy-backward: return the gradients {grad_x, grad_y} = {2 grad_z, grad_z}
#     // checked by: test_z2xy.py::test_against_reference, ::test_gradcheck,
#     //   ::test_requires_grad_of_one
#
# ("::name" is a test of the file named before it). Those lines belong to the marker: carving
# keeps them, and the TODO names the tests. An exercise that names none is checked by all of its
# stage's tests.
_CHECKED = re.compile(r"^\s*(?P<mark>//|#)\s*checked by:\s*(?P<ids>.*?)\s*$")
_MORE_IDS = re.compile(r"^\s*(?P<mark>//|#)\s+(?P<ids>[\w.]*::\w+(?:\s*,\s*[\w.]*::\w+)*,?)\s*$")
_TEST_ID = re.compile(r"^(?P<file>[\w.]*)::(?P<test>\w+)$")


# What a test checks, by the start of its name: the summary's "properties".
PROPERTIES = (
    ("test_against_reference", "outputs and gradients against the float64 reference"),
    ("test_gradcheck", "gradients against finite differences (gradcheck)"),
    ("test_forward_records_nothing", "a forward without gradients records no graph"),
    ("test_requires_grad_of_one", "the gradient when only one input requires it"),
    ("test_layouts", "strided, permuted and expanded inputs"),
    ("test_bad_input", "bad inputs refused, naming the argument"),
    ("test_opcheck", "torch.library.opcheck: schema, fake kernel, autograd registration"),
    ("test_meta", "meta tensors (the fake kernel)"),
    ("test_compile", "torch.compile(fullgraph=True) against eager"),
    ("test_edge_cases", "empty tensors, state 0 and 1, batches past the grid's rows"),
    ("test_matches", "agreement with another implementation"),
    ("test_cuda_matches_cpu", "CUDA against the CPU kernel"),
)


class ExerciseError(ValueError):
    """Markers that cannot be read (unbalanced, nested, misspelt, duplicated); says where."""


@dataclasses.dataclass(frozen=True)
class Exercise:
    """One marked region: lines start..end (0-based, the marker lines included) of `path`."""

    stage: Stage
    name: str
    task: str
    path: Path  # the file, inside stage.source_dir
    start: int  # the EXERCISE line
    end: int  # the END EXERCISE line
    indent: str
    tests: tuple[str, ...] = ()  # its `checked by:` lines, as "test_file.py::test_function"
    body: int = 0  # the first line of the solution (after the EXERCISE and `checked by:` lines)

    @property
    def relpath(self) -> str:
        """The file, relative to the stage folder (where it also is in the work copy)."""
        return self.path.relative_to(self.stage.source_dir).as_posix()

    @property
    def where(self) -> str:
        return f"{self.relpath}:{self.start + 1}"

    @property
    def comment(self) -> str:
        return COMMENT[self.path.suffix]

    @property
    def gpu_only(self) -> bool:
        """Code that only a GPU runs: its tests cannot fail (or pass) on a CPU-only machine."""
        return self.path.suffix in GPU_SUFFIXES

    @property
    def checked_by(self) -> tuple[str, ...]:
        """The tests that check it, as "test_file.py::test_function": its `checked by:` lines,
        or every test file of its stage."""
        return self.tests or tuple(p.name for p in self.stage.test_files())


@dataclasses.dataclass(frozen=True)
class _Region:
    name: str
    task: str
    start: int
    end: int
    indent: str
    tests: tuple[str, ...]
    body: int


def _checked_by(lines: list[str], start: int, path: Path) -> tuple[tuple[str, ...], int]:
    """The tests named by the `checked by:` lines under the EXERCISE line at `start`, and the
    first line after them."""
    k = start + 1
    found = _CHECKED.match(lines[k]) if k < len(lines) else None
    if found is None:
        return (), k
    written = [found["ids"]]
    k += 1
    while k < len(lines) and (more := _MORE_IDS.match(lines[k])):
        written.append(more["ids"])
        k += 1
    tests, file = [], ""
    for item in ", ".join(written).split(","):
        item = item.strip()
        if not item:
            continue
        test = _TEST_ID.match(item)
        if test is None or not (test["file"] or file):
            raise ExerciseError(f"{path}:{start + 2}: `checked by:` names tests as "
                                f"test_file.py::test_name (or ::test_name, of the file before "
                                f"it), got {item!r}")
        file = test["file"] or file
        tests.append(f"{file}::{test['test']}")
    return tuple(tests), k


# ----------------------------------------------------------------------------------------------
# Reading the markers


def parse(text: str, path: Path | str) -> list[_Region]:
    """The regions marked in one file's text, in order; ExerciseError says what is wrong and
    where (file:line)."""
    path = Path(path)
    mark = COMMENT.get(path.suffix)
    regions: list[_Region] = []
    open_at: int | None = None
    opened: re.Match | None = None
    all_lines = text.splitlines()
    for i, line in enumerate(all_lines):
        start, end = _START.match(line), _END.match(line)
        if not (start or end):
            if _LOOSE.match(line):
                c = mark or "//"
                raise ExerciseError(f"{path}:{i + 1}: a marker must read `{c} EXERCISE <name>: "
                                    f"<task>` or `{c} END EXERCISE <name>` (name: lowercase "
                                    f"letters, digits, - and _), got {line.strip()!r}")
            continue
        found = start or end
        if mark is None:
            raise ExerciseError(f"{path}:{i + 1}: exercise markers go in source files "
                                f"({', '.join(sorted(COMMENT))}), not in a "
                                f"{path.suffix or 'plain'} file")
        if found["mark"] != mark:
            raise ExerciseError(f"{path}:{i + 1}: a {path.suffix} file marks exercises with "
                                f"`{mark}`, got `{found['mark']}`")
        if start:
            if opened is not None:
                raise ExerciseError(f"{path}:{i + 1}: exercise {start['name']!r} starts inside "
                                    f"exercise {opened['name']!r} (opened at line {open_at + 1}); "
                                    f"regions do not nest")
            open_at, opened = i, start
            continue
        if opened is None:
            raise ExerciseError(f"{path}:{i + 1}: `END EXERCISE {end['name']}` without an "
                                f"`EXERCISE {end['name']}: ...` line before it")
        if end["name"] != opened["name"]:
            raise ExerciseError(f"{path}:{i + 1}: `END EXERCISE {end['name']}` closes exercise "
                                f"{opened['name']!r} (opened at line {open_at + 1}); the names "
                                f"must match")
        if end["indent"] != opened["indent"]:
            raise ExerciseError(f"{path}:{i + 1}: `END EXERCISE {end['name']}` must be indented "
                                f"like its EXERCISE line {open_at + 1}")
        tests, body = _checked_by(all_lines, open_at, path)
        if i == body:
            raise ExerciseError(f"{path}:{open_at + 1}: exercise {opened['name']!r} is empty: the "
                                f"solution goes between its two marker lines")
        regions.append(_Region(opened["name"], opened["task"], open_at, i, opened["indent"],
                               tests, body))
        opened = None
    if opened is not None:
        raise ExerciseError(f"{path}:{open_at + 1}: exercise {opened['name']!r} has no "
                            f"`END EXERCISE {opened['name']}` line")
    names = [r.name for r in regions]
    for name in names:
        if names.count(name) > 1:
            raise ExerciseError(f"{path}: exercise {name!r} is marked {names.count(name)} times; "
                                f"names are unique")
    return regions


def source_files(folder: Path) -> list[Path]:
    """The files of a stage folder that may hold exercises (test files are the checkers)."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in COMMENT
                  and not p.name.startswith("test_") and "__pycache__" not in p.parts)


def find(number_or_stage: int | str | Stage) -> list[Exercise]:
    """Every exercise of a stage, in file order; ExerciseError on unreadable markers or a name
    used twice."""
    s = stages.get(number_or_stage)
    found: list[Exercise] = []
    for path in source_files(s.source_dir):
        text = path.read_text()
        if "EXERCISE" not in text:
            continue
        found += [Exercise(s, r.name, r.task, path, r.start, r.end, r.indent, r.tests, r.body)
                  for r in parse(text, path)]
    seen: dict[str, Exercise] = {}
    for e in found:
        if e.name in seen:
            raise ExerciseError(f"{s.label}: exercise {e.name!r} is marked twice: at "
                                f"{seen[e.name].where} and {e.where}")
        seen[e.name] = e
    return found


def get(number_or_stage: int | str | Stage, name: str) -> Exercise:
    found = find(number_or_stage)
    for e in found:
        if e.name == name:
            return e
    raise ValueError(f"stage {stages.get(number_or_stage).number} has no exercise {name!r}; its "
                     f"exercises: {', '.join(e.name for e in found) or 'none'}")


# ----------------------------------------------------------------------------------------------
# What replaces a region: a TODO, and a line that compiles and fails clearly


def _code_only(text: str) -> str:
    """C/C++ text with comments and string and character literals blanked (same length), so
    that braces can be counted."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        two = text[i:i + 2]
        if two == "//":
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif two == "/*":
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif text[i] in "\"'":
            quote, j = text[i], i + 1
            while j < n and text[j] != quote and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
        else:
            i += 1
            continue
        for k in range(i, j):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


_CONTROL = re.compile(r"^(if|for|while|switch|else|do|try|catch)\b")
_SCOPE = re.compile(r"(^|\s)(namespace|struct|class|union|enum|extern)\b")


def _strip_balanced(text: str, opener: str, closer: str, start: int) -> str:
    """text without the balanced opener..closer group that starts at `start`."""
    depth = 0
    for k in range(start, len(text)):
        depth += (text[k] == opener) - (text[k] == closer)
        if depth == 0:
            return text[:start] + text[k + 1:]
    return text[:start]


def context(e: Exercise, text: str | None = None) -> tuple[str, bool]:
    """Where a C++/CUDA region sits: ("host" | "device" | "host_device", returns_a_value) of the
    function whose body holds it. ExerciseError when it is not inside a function body (a TODO
    that fails at run time needs one)."""
    text = e.path.read_text() if text is None else text
    offset = sum(len(line) for line in text.splitlines(keepends=True)[: e.start])
    code = _code_only(text[:offset])
    open_braces: list[int] = []
    for k, ch in enumerate(code):
        if ch == "{":
            open_braces.append(k)
        elif ch == "}" and open_braces:
            open_braces.pop()
    functions = []
    for brace in reversed(open_braces):
        before = max(code.rfind(c, 0, brace) for c in ";{}")
        header = " ".join(code[before + 1:brace].split())
        if _SCOPE.search(header) and "(" not in header:
            break
        if "(" in header and not _CONTROL.match(header):
            functions.append(header)
    if not functions:
        raise ExerciseError(f"{e.stage.source_dir / e.where}: exercise {e.name!r} is not inside a "
                            f"function body; a C++ region must be, so that its TODO can fail at "
                            f"run time")
    every = " ".join(functions)
    if "WORKBOOK_HOST_DEVICE" in every or re.search(r"__host__\s+__device__|__device__\s+__host__",
                                                     every):
        where = "host_device"
    elif "__global__" in every or "__device__" in every:
        where = "device"
    else:
        where = "host"
    inner = functions[0]
    if re.search(r"\]\s*\(", inner):  # a lambda: void unless it names its return type
        returns = "->" in inner.split("](")[-1]
    else:
        head = inner
        if head.startswith("template"):
            head = _strip_balanced(head, "<", ">", head.index("<"))
        head = re.sub(r"__launch_bounds__\s*\([^)]*\)", "", head)
        returns = not re.search(r"\bvoid\b", head.split("(")[0])
    return where, returns


def _literal_lines(text: str, width: int, quote) -> list[str]:
    """text as adjacent string literals (quote(piece) each), each piece at most `width` long."""
    pieces = textwrap.wrap(text, width=width, drop_whitespace=False, break_on_hyphens=False)
    return [quote(piece) for piece in pieces] or [quote("")]


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def todo_message(e: Exercise) -> str:
    """The run-time message of a region not done yet: names the exercise, the task, the file."""
    return (f"exercise {e.name} is not done yet: {e.task} (in {e.relpath}; "
            f"make verify {e.stage.number})")


def _tests_line(e: Exercise) -> str:
    by_file: dict[str, list[str]] = {}
    for test in e.checked_by:
        file, _, function = test.partition("::")
        by_file.setdefault(file, []).append(function)
    return "; ".join(f"{file}: {', '.join(fs)}" if fs[0] else file for file, fs in by_file.items())


def stub(e: Exercise, text: str | None = None) -> list[str]:
    """The lines that replace the region's solution in a carved copy (newline-terminated): a
    TODO, then code that compiles and fails at run time naming the exercise (a kernel's body
    stays empty: device code cannot raise)."""
    c, pad = e.comment, e.indent
    todo = (f"TODO(exercise {e.name}): {e.task}. Checked by {_tests_line(e)} "
            f"(make verify {e.stage.number}).")
    if e.gpu_only:
        todo += (" Its tests run on a GPU, or without one on the emulated CUDA device "
                 "(workbook/build/emulate.py).")
    message = todo_message(e)
    inner = pad + " " * 4
    if c == "#":
        literals = _literal_lines(message, 96 - len(inner), repr)
        code = [f"{pad}raise NotImplementedError(", *(inner + s for s in literals), f"{pad})"]
    else:
        where, returns = context(e, text)
        literals = _literal_lines(message, 96 - len(inner), _c_string)
        # A file on the stable ABI (stage 10) has no TORCH_CHECK, which is c10's: its own is
        # STD_TORCH_CHECK (torch/headeronly), which throws std::runtime_error.
        stable = "torch/csrc/stable/" in (text if text is not None else e.path.read_text())
        check = [f"{pad}{'STD_TORCH_CHECK' if stable else 'TORCH_CHECK'}(false,",
                 *(inner + s for s in literals[:-1]),
                 f"{inner}{literals[-1]});"]
        if where == "host":
            code = check
        elif where == "device":
            # A GPU's kernel cannot raise: until then it does nothing, and its outputs hold
            # whatever memory held. On the emulated CUDA device, host code, it can and does.
            todo += (" Until then this code does nothing on a GPU: its outputs hold whatever "
                     "memory held.")
            code = ["#if defined(WORKBOOK_EMULATED_CUDA)", *check, "#endif"]
            code += [f"{pad}return {{}};"] if returns else []
        else:
            code = ["#if !defined(__CUDA_ARCH__)", *check, "#endif"]
            code += [f"{pad}return {{}};"] if returns else []
    lines = textwrap.wrap(todo, width=100, initial_indent=f"{pad}{c} ",
                          subsequent_indent=f"{pad}{c}   ", break_on_hyphens=False,
                          break_long_words=False)
    return [line + "\n" for line in lines + code]


def carve_text(text: str, exercises: Sequence[Exercise]) -> str:
    """One file's text with the given exercises' solutions replaced by their stubs."""
    lines = text.splitlines(keepends=True)
    for e in sorted(exercises, key=lambda e: e.start, reverse=True):
        lines[e.body:e.end] = stub(e, text)
    return "".join(lines)


def restore_text(carved: str, solved: str, path: Path | str,
                 names: Iterable[str] | None = None) -> str:
    """`carved` with the named regions (all: None) holding the solution from `solved` again:
    the stage's text when every region is restored."""
    wanted = set(names) if names is not None else None
    solution = {r.name: r for r in parse(solved, path)}
    lines = carved.splitlines(keepends=True)
    solved_lines = solved.splitlines(keepends=True)
    for r in reversed(parse(carved, path)):
        if (wanted is not None and r.name not in wanted) or r.name not in solution:
            continue
        s = solution[r.name]
        lines[r.body:r.end] = solved_lines[s.body:s.end]
    return "".join(lines)


def region_body(text: str, path: Path | str, name: str) -> str | None:
    """The lines between the markers of exercise `name` in `text` (None: not marked there)."""
    lines = text.splitlines(keepends=True)
    for r in parse(text, path):
        if r.name == name:
            return "".join(lines[r.body:r.end])
    return None


_STAGE_NUMBER = re.compile(r"(?:^|/)(\d{2})_[a-z0-9_]+/")


def fold(lines: Sequence[str], path: Path | str, first: int = 0,
         last: int | None = None) -> list[str]:
    """Lines first..last (0-based, inclusive; by default all) of a file's `lines`, each exercise's
    solution in them folded to one line that says how to see it: what a lesson shows, so that it
    teaches the exercise without giving it away (its EXERCISE line, with the task, and its
    `checked by:` lines stay). A file without exercises, or whose markers do not read, comes back
    as it is."""
    path = Path(path)
    last = len(lines) - 1 if last is None else last
    try:
        regions = parse("\n".join(line.rstrip("\n") for line in lines), path)
    except ExerciseError:
        regions = []
    number = _STAGE_NUMBER.search(path.as_posix())
    where = f"make exercise {int(number.group(1))}" if number else "make exercise N"
    out, k = [], first
    for r in regions:
        low, high = max(r.body, first), min(r.end - 1, last)
        if low > high:
            continue
        newline = "\n" if lines[low].endswith("\n") else ""
        out += lines[k:low]
        out.append(f"{r.indent}{COMMENT[path.suffix]} ... yours to write (the solution: "
                   f"`{where} REVEAL={r.name}`){newline}")
        k = high + 1
    return out + list(lines[k:last + 1])


# ----------------------------------------------------------------------------------------------
# The work copy: carve, reveal


def work_copy(s: Stage) -> Path:
    return WORK_DIR / s.folder


def _show(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def carve(number_or_stage: int | str | Stage, destination: Path | None = None, *,
          reset: bool = False, quiet: bool = False) -> Path:
    """Copy stage N to `destination` (exercises/NN_name/) with every exercise carved out.

    Refuses to replace an existing copy unless `reset`; the replaced copy is kept in
    build/exercises/NN_name/previous/ until the next reset."""
    s = stages.get(number_or_stage)
    found = find(s)
    if not found:
        raise ExerciseError(f"{s.label} marks no exercise (no `EXERCISE <name>: <task>` line in "
                            f"its sources): nothing to carve")
    target = work_copy(s) if destination is None else Path(destination)
    if target.exists():
        if not reset:
            raise FileExistsError(
                f"{_show(target)} exists already (your work): `make verify {s.number}` checks it; "
                f"`make exercise {s.number} RESET=1` replaces it with a fresh copy")
        kept = build_root() / "exercises" / s.folder / "previous"
        shutil.rmtree(kept, ignore_errors=True)
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(target), str(kept))
        if not quiet:
            print(f"[exercise] your previous copy is kept in {_show(kept)} until the next reset")
    shutil.copytree(s.source_dir, target, ignore=_IGNORED)
    by_file: dict[Path, list[Exercise]] = {}
    for e in found:
        by_file.setdefault(e.path, []).append(e)
    for path, listed in by_file.items():
        out = target / path.relative_to(s.source_dir)
        out.write_text(carve_text(path.read_text(), listed))
    if not quiet:
        print(instructions(s, found, target))
    return target


def instructions(s: Stage, found: Sequence[Exercise], target: Path) -> str:
    shown, stage_dir = _show(target), _show(s.source_dir)
    width = max(len(e.name) for e in found)
    rows = []
    for e in found:
        gpu = "  (CUDA: a GPU, or the emulated CUDA device without one)" if e.gpu_only else ""
        rows.append(f"  {e.name:<{width}}  {e.where}{gpu}\n  {'':<{width}}  {e.task}\n"
                    f"  {'':<{width}}  checked by {_tests_line(e)}")
    return "\n".join([
        f"[exercise] {s.label}: your copy is {shown}, with {len(found)} exercise"
        f"{'s' * (len(found) != 1)} to write:", *rows, "",
        "Each is a TODO between its `EXERCISE <name>` and `END EXERCISE <name>` comments: "
        "write the code there.",
        *_columns([(f"make verify {s.number}", "build your copy and run the stage's tests on it"),
                   (f"make exercise {s.number} RESET=1", "start again from a fresh copy"),
                   (f"make exercise {s.number} REVEAL={found[0].name}",
                    "put that solution into your copy"),
                   (f"diff -ru {stage_dir} {shown}", "the solutions: the stage itself")])])


def _columns(rows: Sequence[tuple[str, str]]) -> list[str]:
    width = max(len(command) for command, _ in rows)
    return [f"  {command:<{width}}   {what}" for command, what in rows]


def reveal(number_or_stage: int | str | Stage, names: Sequence[str] = (),
           work: Path | None = None) -> list[str]:
    """Put the stage's solution of the named exercises (all: none named) back into the work
    copy; returns the names revealed."""
    s = stages.get(number_or_stage)
    work = work_copy(s) if work is None else Path(work)
    if not work.is_dir():
        raise FileNotFoundError(f"no work copy {_show(work)}: `make exercise {s.number}` makes one")
    found = find(s)
    unknown = set(names) - {e.name for e in found}
    if unknown:
        raise ValueError(f"stage {s.number} has no exercise {', '.join(sorted(unknown))}; its "
                         f"exercises: {', '.join(e.name for e in found)}")
    chosen = [e for e in found if not names or e.name in names]
    revealed = []
    for path in sorted({e.path for e in chosen}):
        mine = work / path.relative_to(s.source_dir)
        if not mine.is_file():
            raise FileNotFoundError(f"{_show(mine)} is missing from your copy")
        text = mine.read_text()
        here = {r.name for r in parse(text, mine)}
        wanted = [e.name for e in chosen if e.path == path]
        lost = [n for n in wanted if n not in here]
        if lost:
            raise ExerciseError(f"{_show(mine)}: the markers of {', '.join(lost)} are gone, so "
                                f"the solution has nowhere to go; `make exercise {s.number} "
                                f"RESET=1` starts from a fresh copy")
        mine.write_text(restore_text(text, path.read_text(), path, wanted))
        revealed += wanted
    return revealed


# ----------------------------------------------------------------------------------------------
# Checking a work copy: build it beside the real stages, run the stage's tests on it


def _skipped(rel: Path) -> bool:
    """A build or editor leftover (by any part of its path), never copied."""
    return any(fnmatch.fnmatch(part, pattern) for part in rel.parts for pattern in _LEFTOVERS)


def _sync(source: Path, target: Path) -> None:
    """Make `target` hold exactly the files of `source` (leftovers aside). Only files whose bytes
    differ are written, with a fresh mtime, so that a build sees exactly what changed, even a
    file put back to an older version."""
    wanted: set[Path] = set()
    for path in source.rglob("*"):
        rel = path.relative_to(source)
        if not path.is_file() or _skipped(rel):
            continue
        wanted.add(rel)
        out = target / rel
        data = path.read_bytes()
        if not out.is_file() or out.read_bytes() != data:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
            shutil.copymode(path, out)
    if target.is_dir():
        for path in sorted(target.rglob("*"), reverse=True):
            rel = path.relative_to(target)
            if path.is_file() and rel not in wanted:
                path.unlink()
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()


@dataclasses.dataclass
class Result:
    """One test's outcome: `test` is "file::function[parameters]"."""

    test: str
    outcome: str  # passed, failed, skipped
    message: str = ""

    @property
    def function(self) -> str:
        return self.test.split("[")[0]


@dataclasses.dataclass
class Report:
    """What `check` found: the build, each test, and per exercise its status."""

    stage: Stage
    built: bool
    results: list[Result] = dataclasses.field(default_factory=list)
    # name -> TODO (not started), FAILS, ok, waiting (its tests fail at another exercise's
    # TODO only), "not run here" (its tests were skipped), ...
    status: dict[str, str] = dataclasses.field(default_factory=dict)
    races: list = dataclasses.field(default_factory=list)  # workbook.net.racecheck.Race
    exit_code: int = 1

    def failed(self) -> list[Result]:
        return [r for r in self.results if r.outcome == "failed"]


def _stream(cmd: list[str], env: dict, cwd: Path, rewrite: dict[str, str],
            on_line=None) -> int:
    """Run cmd, printing its output as it comes with the build tree's paths shown as the work
    copy's (and handing each line, so shown, to `on_line`)."""
    return _follow(_start(cmd, env, cwd), rewrite, on_line)


def _start(cmd: list[str], env: dict, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _follow(proc: subprocess.Popen, rewrite: dict[str, str], on_line=None) -> int:
    """_stream's printing, for a process started already; its exit status."""
    with proc:
        for line in proc.stdout:
            for old, new in rewrite.items():
                line = line.replace(old, new)
            print(line, end="", flush=True)
            if on_line is not None:
                on_line(line)
    return proc.returncode


# What a signal that ends a test process usually means, said for someone writing a kernel.
SIGNALS = {
    "SIGSEGV": "a read or write of memory the process does not have",
    "SIGBUS": "a read or write of memory the process does not have",
    "SIGABRT": "an abort: most often the C library finding its heap corrupted by a write past "
               "the end of a buffer, or a failed check",
    "SIGFPE": "an arithmetic fault: an integer division by zero",
    "SIGKILL": "killed from outside: most often the machine out of memory, or a time limit",
}


def _signal_of(code: int) -> str | None:
    """The signal that ended a process with exit status `code` (negative, as subprocess gives it,
    or 128 + the signal, as a shell does), or None when it exited by itself."""
    import signal

    number = -code if code < 0 else code - 128 if 128 < code < 128 + 65 else None
    if number is None:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _crash_words(s: Stage, code: int, test: str | None, sanitized: bool) -> str:
    """What `make verify` says when the tests' process died of a signal: the test it died in,
    what the signal usually means for a kernel, and how to find the line."""
    name = _signal_of(code)
    where = f"while running {test}" if test else "before any test started (at import or build)"
    lines = [f"[verify] the tests' process died of {name} ({SIGNALS.get(name, 'a signal')}) "
             f"{where}."]
    if name in ("SIGSEGV", "SIGBUS", "SIGABRT"):
        lines.append("[verify] in a kernel this is most often an index out of bounds: a guard or "
                     "a loop one element too far (`>` for `>=`, `<=` for `<`), a wrong stride or "
                     "offset, a grid that covers more than the tensor.")
    if sanitized:
        lines.append("[verify] (with SANITIZE=1 the sanitizer ends the process at the first bad "
                     "access: its report is above)")
    else:
        only, which = (f" TEST='{test}'", "that test") if test else ("", "the tests")
        lines.append(f"[verify] to find the line: `make verify {s.number} SANITIZE=1{only}` builds "
                     f"your copy with AddressSanitizer and runs {which} on it: its report names "
                     f"the kernel, the file and the line of the bad access.")
    return "\n".join(lines)


def _first_frame_in(report: str, work: Path) -> str | None:
    """The first line of a sanitizer report's stack that is in the work copy: the kernel and
    the file:line of the access."""
    shown = _show(work)
    return next((ln.strip() for ln in report.splitlines()
                 if ln.lstrip().startswith("#") and shown in ln), None)


def _read_junit(path: Path) -> list[Result]:
    if not path.is_file():
        return []
    results = []
    for case in ElementTree.parse(path).iter("testcase"):
        file = Path(case.get("file") or "").name or (case.get("classname") or "").split(".")[-1]
        test = f"{file}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", child.get("message") or (child.text or "")
            elif child.tag == "skipped":
                outcome, message = "skipped", child.get("message") or ""
        results.append(Result(test, outcome, message.strip()))
    return results


def _tally(name: str, results: Sequence[Result]) -> str:
    ran = [r for r in results if r.outcome != "skipped"]
    skipped = len(results) - len(ran)
    passed = sum(r.outcome == "passed" for r in ran)
    return f"{name} {passed}/{len(ran)}" + (f" ({skipped} skipped)" if skipped else "")


def _property(function: str) -> str:
    name = function.split("::")[-1]
    for prefix, what in PROPERTIES:
        if name.startswith(prefix):
            return what
    return name.removeprefix("test_").replace("_", " ")


def verify(number_or_stage: int | str | Stage, work: Path | None = None, *,
          base: Path | None = None, pytest_args: Sequence[str] = (),
          tests: Sequence[str] | None = None, env: dict | None = None,
          only: str | None = None, sanitize: bool = False) -> Report:
    """Build the work copy of stage N under its own build folder and run the stage's tests on it
    (only `tests`, "file::function" or node ids, when given; only the tests that check the
    exercise named `only`, when given); print a summary naming the exercises and properties that
    fail; return the Report (exit_code 0: nothing failed). A process that dies of a signal is
    named with the test it died in. `sanitize`: the copy built with AddressSanitizer and
    UndefinedBehaviorSanitizer, in a build folder of its own, and the tests run under their
    runtimes (workbook.net.sanitize): a bad access stops the run with a report naming its line."""
    s = stages.get(number_or_stage)
    work = work_copy(s) if work is None else Path(work)
    if not work.is_dir():
        raise FileNotFoundError(f"no work copy {_show(work)}: `make exercise {s.number}` makes one")
    found = find(s)
    if only is not None:
        chosen = [e for e in found if e.name == only]
        if not chosen:
            raise ExerciseError(f"{s.label} has no exercise {only!r}; its exercises: "
                                f"{', '.join(e.name for e in found)}")
        found = chosen
        tests = list(chosen[0].checked_by) if tests is None else tests
        print(f"[verify] only {only}: the tests that check it "
              f"({', '.join(t.split('::')[-1] for t in tests)})", flush=True)
    base = build_root() / "exercises" / s.folder if base is None else Path(base)
    tree = base / "stages"
    start = time.perf_counter()
    print(f"[verify] {s.label}: your copy {_show(work)}, built in {_show(base)}", flush=True)
    for folder in sorted(p for p in s.source_dir.parent.iterdir() if (p / "stage.toml").is_file()):
        _sync(work if folder.name == s.folder else folder, tree / folder.name)
    copy = tree / s.folder
    rewrite = {str(copy): _show(work)}
    if copy.is_relative_to(REPO):  # the paths an emulated build records are the repository's
        rewrite[str(copy.relative_to(REPO))] = _show(work)
    run_env = dict(os.environ, **(env or {}))
    from workbook.build import emulate

    emulated = s.cuda and emulate.active()
    if emulated and "WORKBOOK_NO_CUDA" not in run_env:
        # Without a GPU the CUDA tests run on the emulated device, which compiles the copy's .cu
        # with the host compiler: an nvcc build of the copy would never run. (make nvcc-check
        # compiles the stages' CUDA files with nvcc.)
        print("[verify] no GPU: the CUDA tests run on the emulated CUDA device (the copy's .cu "
              "compiled for the CPU); nvcc is not used", flush=True)
        run_env["WORKBOOK_NO_CUDA"] = "1"
    builds = base / ("sanitize" if sanitize else "build")
    run_env.update(WORKBOOK_BUILD_DIR=str(builds), TORCH_EXTENSIONS_DIR=str(builds / "jit"),
                   PYTHONUNBUFFERED="1")
    if sanitize:  # as the sanitizer pass builds a stage: CPU-only, CUDA kernels emulated
        run_env.update(WORKBOOK_SANITIZE="1", WORKBOOK_NO_CUDA="1", CUDA_VISIBLE_DEVICES="",
                       TORCHINDUCTOR_CACHE_DIR=str(builds / "inductor"))
        print(f"[verify] SANITIZE=1: your copy built with AddressSanitizer and "
              f"UndefinedBehaviorSanitizer into {_show(builds)}, its tests run under their "
              f"runtimes; the first bad access stops the run with a report", flush=True)
    common = str(REPO / "common")
    if common not in run_env.get("PYTHONPATH", "").split(os.pathsep):
        run_env["PYTHONPATH"] = os.pathsep.join(filter(None, [common, run_env.get("PYTHONPATH")]))

    junit = base / "report.xml"
    junit.unlink(missing_ok=True)
    running = base / "running.txt"  # the test that started last (workbook.teaching.pytest_running)
    running.unlink(missing_ok=True)
    run_env[pytest_running.ENV] = str(running)
    targets = [str(copy / t) for t in dict.fromkeys(tests)] if tests else [str(copy)]
    # The copy is outside the repository, so its conftest.py is not found: its plugin by name.
    # Hypothesis' plugin, which no stage's tests use, spends a second at the end of the session.
    cmd = [sys.executable, "-m", "pytest", "-q", "--tb=no", "-p", "no:hypothesispytest", "-c",
           str(REPO / "pyproject.toml"), "--rootdir", str(copy),
           "-p", "workbook.testing.pytest_emulated", "-p", "workbook.testing.pytest_timings",
           "-p", "workbook.teaching.pytest_running", "-p", "workbook.teaching.pytest_gate",
           f"--junitxml={junit}", "-o", "junit_family=xunit1", *targets, *pytest_args]
    reports, test_env = None, dict(run_env)
    if sanitize:
        from workbook.net import sanitize as sanitizers

        # The runtimes' reports go to the file descriptor, past pytest's capture of Python's.
        cmd.insert(cmd.index(f"--junitxml={junit}"), "--capture=sys")
        reports = sanitizers.Reports()
        test_env = sanitizers.with_runtimes(run_env, sanitizers.runtimes())
    # pytest starts now and waits at a gate (workbook.teaching.pytest_gate) while the copy builds:
    # its interpreter and torch load on one core as the compiler runs on another.
    gate = base / "gate"
    gate.unlink(missing_ok=True)
    test_env[pytest_gate.ENV] = str(gate)
    tests_proc = _start(cmd, test_env, REPO)
    try:
        if s.kind == "jit":  # built by its own import, which a carved copy may be meant to fail
            print(f"[verify] {s.label} is built just in time, when its tests import it",
                  flush=True)
            built = True
        else:
            build_cmd = [sys.executable, "-m", "workbook.build", str(copy)]
            built = _stream(build_cmd, run_env, REPO, rewrite) == 0
        if built and emulated and s.kind != "jit" and not sanitize:
            # The kernels the tests will load, built here, where a compile error stops the loop
            # before any test runs (the tests' process then finds them built). Not the
            # sanitizer's build, which loads only under its runtime: its tests build it.
            print("[verify] building your CUDA kernels for the emulated device ...", flush=True)
            emulate_cmd = [sys.executable, "-m", "workbook.build.emulate", "build", str(copy)]
            built = _stream(emulate_cmd, run_env, REPO, rewrite) == 0
        report = Report(s, built)
        if not built:
            pytest_gate.open_gate(gate, "not run: the copy did not build")
            tests_proc.communicate()
            print(f"[verify] your copy of {s.label} does not build: the first compiler errors "
                  f"are above; fix them and run `make verify {s.number}` again")
            return report
        print(f"[verify] running {s.label}'s tests on your copy: pytest "
              f"{' '.join(t.replace(str(copy), _show(work)) for t in targets)}", flush=True)
        pytest_gate.open_gate(gate)
        code = _follow(tests_proc, rewrite, on_line=reports)
    finally:
        if tests_proc.poll() is None:  # interrupted: the tests never started
            tests_proc.kill()
            tests_proc.communicate()
    report.results = _read_junit(junit)
    died = _signal_of(code) is not None
    if code not in (0, 1) and not died:
        print(f"[verify] pytest stopped with exit code {code} (see above)")
    if not sanitize:  # ThreadSanitizer and AddressSanitizer do not share a process
        report.races = _racecheck(s, copy, cmd[:cmd.index(f"--junitxml={junit}")] + targets,
                                  run_env, rewrite)
    _summarise(report, found, work, time.perf_counter() - start)
    if reports is not None:
        texts = reports.texts()
        first = _first_frame_in(texts[0], work) if texts else None
        kind = " ".join(m.group(0) for m in (re.search(r"\w*Sanitizer: [\w-]+", texts[0]),
                                             re.search(r"\b(READ|WRITE) of size \d+", texts[0]))
                        if m) if texts else ""
        print(f"[verify] SANITIZE=1: {len(texts)} sanitizer report(s)" +
              (f"; the first ({kind}), in your code: {first}" if first else
               f"; the first ({kind}) is above" if texts else ": no bad access found"),
              flush=True)
    if died:
        print(_crash_words(s, code, pytest_running.running(running), sanitize), flush=True)
    if code not in (0, 1):
        report.exit_code = code
    return report


def _racecheck(s: Stage, copy: Path, pytest: list[str], env: dict, rewrite: dict[str, str]):
    """For a copy whose CUDA kernels cooperate (barriers, shared memory, shuffles), where they
    run on the emulated device: the tests again on them built with ThreadSanitizer, the small
    cases (workbook.net.racecheck.check_copy), and the races found, their paths the work copy's.
    A missing barrier is a race whether or not the numbers came out right."""
    from workbook.build import emulate

    kernels = [p.read_text() for p in sorted(copy.rglob("*")) if p.suffix in GPU_SUFFIXES]
    if not (s.cuda and emulate.active() and emulate.cooperating(kernels)):
        return []
    from workbook.net import racecheck  # (it loads torch: only for a copy that needs it)

    print(f"[verify] racecheck: the tests again, small cases in float32, on your kernels built "
          f"with ThreadSanitizer (make racecheck {s.number} runs every case) ...", flush=True)
    started = time.perf_counter()
    _, found = racecheck.check_copy(pytest, env, REPO)
    for race in found:
        race.accesses = [(what, _rewritten(path, rewrite), line)
                         for what, path, line in race.accesses]
        race.text = _rewritten(race.text, rewrite)
    print(f"[verify] racecheck: {len(found)} race(s) in {time.perf_counter() - started:.0f} s",
          flush=True)
    return found


def _rewritten(text: str, rewrite: dict[str, str]) -> str:
    for old, new in rewrite.items():
        text = text.replace(old, new)
    return text


def _region(work: Path, e: Exercise) -> tuple[int, int] | None:
    """The lines (1-based, inclusive) of exercise e's region in the work copy, as it is now."""
    mine = work / e.relpath
    try:
        regions = parse(mine.read_text(), mine) if mine.is_file() else []
    except ExerciseError:
        return None
    return next(((r.start + 1, r.end + 1) for r in regions if r.name == e.name), None)


def _races_in(races: list, path: str, region: tuple[int, int] | None) -> list:
    """The races one of whose accesses lies in lines region (1-based, inclusive) of path."""
    if region is None:
        return []
    return [r for r in races if any(p.endswith(path) and region[0] <= line <= region[1]
                                    for _, p, line in r.accesses)]


def _own(e: Exercise, ids: Sequence[str], by_function: dict[str, list[Result]],
         report: Report) -> list[Result]:
    """The results of the tests that check `e` (`ids`), and of those that stopped at its TODO."""
    own = [r for t in ids for r in by_function.get(t, [])]
    own += [r for r in report.failed() if f"exercise {e.name} is not done" in r.message]
    own = list({r.test: r for r in own}.values())
    # A test function may run on several devices: the cases whose parameters name the other
    # device (cpu for code in a CUDA file, cuda for the rest) are not this exercise's.
    other = {"cpu"} if e.gpu_only else {"cuda", "emulated_cuda"}
    return [r for r in own if not other & set(re.split(r"[-\[\]]", r.test.partition("[")[2]))]


def _failing(e: Exercise, found: Sequence[Exercise], own: list[Result],
             raced: dict[str, list]) -> tuple[list[Result], list[str], list[str]]:
    """`e`'s failures that may be its own, the exercises whose TODO the others stop at, and the
    other exercises with a race. Failures that stop at another exercise's TODO say nothing about
    this one. Nor do any while another exercise has a race: a kernel with a race computes
    anything, and the kernels of a stage feed each other."""
    failed = [r for r in own if r.outcome == "failed"]
    blockers = sorted({o.name for r in failed for o in found
                       if o is not e and f"exercise {o.name} is not done" in r.message})
    racing = [o.name for o in found if o is not e and raced[o.name]]
    if racing:
        return [], blockers, racing
    return [r for r in failed if not any(f"exercise {name} is not done" in r.message
                                         for name in blockers)], blockers, racing


def _summarise(report: Report, found: Sequence[Exercise], work: Path, seconds: float) -> None:
    s, results = report.stage, report.results
    counts = {k: sum(r.outcome == k for r in results) for k in ("failed", "passed", "skipped")}
    print(f"\n[verify] ===== {s.label}, your copy {_show(work)}: {counts['failed']} failed, "
          f"{counts['passed']} passed, {counts['skipped']} skipped ({seconds:.0f} s)")
    by_function: dict[str, list[Result]] = {}
    for r in results:
        by_function.setdefault(r.function, []).append(r)
    width = max(len(e.name) for e in found) if found else 10
    attributed: set[str] = set()
    placed: set[int] = set()  # the races an exercise's region holds
    raced = {e.name: _races_in(report.races, e.relpath, _region(work, e)) for e in found}
    ids = {e.name: [t for t in e.checked_by if "::" in t] or list(by_function) for e in found}
    # A test that checks several exercises cannot tell which of them is wrong: an exercise FAILS
    # by a test of its own; by shared tests alone only while none of the others sharing them
    # fails one of its own (then the failure is likely theirs, and this one waits).
    sharing = {e.name: {t: [o.name for o in found if o is not e and t in ids[o.name]]
                        for t in ids[e.name]} for e in found}
    failing = {e.name: _failing(e, found, _own(e, ids[e.name], by_function, report), raced)
               for e in found}
    fails_alone = {name for name, (failed, _, _) in failing.items()
                   if any(not sharing[name].get(r.function) for r in failed)}
    for e in found:
        mine = work / e.relpath
        try:
            body = region_body(mine.read_text(), mine, e.name) if mine.is_file() else None
        except ExerciseError as error:
            print(f"  ({error})")
            body = None
        placed.update(id(r) for r in raced[e.name])
        own = _own(e, ids[e.name], by_function, report)
        attributed.update(r.test for r in own if r.outcome == "failed")
        failed = [r for r in own if r.outcome == "failed"]
        ran = [r for r in own if r.outcome != "skipped"]
        unblocked, blockers, racing = failing[e.name]
        shared = sorted({o for r in unblocked for o in sharing[e.name].get(r.function, ())})
        culprits = sorted(fails_alone & set(shared))
        if body is None:
            status = "markers gone"
        elif f"TODO(exercise {e.name})" in body:
            status = "TODO"
        elif raced[e.name]:
            status = "RACE"
        elif unblocked and (e.name in fails_alone or not culprits):
            status = "FAILS"
        elif failed:
            status = "waiting"
        elif own and not ran:
            status = "not run here"
        elif not own:
            status = "no test ran"
        else:
            status = "ok"
        report.status[e.name] = status
        tally = ", ".join(_tally(t.split("::")[-1], [r for r in own if r.function == t])
                          for t in ids[e.name] if any(r.function == t for r in own))
        print(f"  {e.name:<{width}}  {status:<12} {e.where}\n  {'':<{width}}  "
              f"{'its tests passing: ' + tally if tally else 'none of its tests ran'}")
        for race in raced[e.name]:
            print(f"  {'':<{width}}  racecheck: {race.words()}")
        if status == "not run here":
            reason = next((r.message for r in own if r.message), "skipped")
            print(f"  {'':<{width}}  (skipped: {reason})")
        elif status == "waiting" and racing:
            print(f"  {'':<{width}}  (its tests may fail through the race in "
                  f"{', '.join(racing)}: fix that first)")
        elif status == "waiting" and unblocked:
            print(f"  {'':<{width}}  (its failing tests check {', '.join(culprits)} too, which "
                  f"{'fails' if len(culprits) == 1 else 'fail'} a test of "
                  f"{'its' if len(culprits) == 1 else 'their'} own: fix that first)")
        elif status == "waiting":
            print(f"  {'':<{width}}  (its failing tests stop at the TODO of "
                  f"{', '.join(blockers)}: they need that too)")
        elif status == "FAILS" and e.name not in fails_alone and shared:
            print(f"  {'':<{width}}  (its failing tests check {', '.join(shared)} too: any of "
                  f"them may be wrong)")
    failed_functions = sorted({r.function for r in report.failed()})
    if failed_functions:
        print(f"  failing properties (a message each; `make verify {s.number} "
              f"PYTEST_ARGS=--tb=short` shows the tracebacks):")
    for function in failed_functions:
        failed = [r for r in by_function[function] if r.outcome == "failed"]
        example = next((r.message for r in failed if r.message), "").strip().splitlines()
        print(f"    {function.split('::')[-1]} ({len(failed)} of {len(by_function[function])} "
              f"failed): {_property(function)}")
        if example:
            shown = example[0].strip()
            if shown.endswith(":"):  # a heading ("against the float64 reference:"): its detail
                shown += " " + next((ln.strip() for ln in example[1:] if ln.strip()), "")
            print(f"      e.g. {failed[0].test.split('::')[-1]}: {shown[:300]}")
    others = sorted({r.function.split("::")[-1] for r in report.failed()
                     if r.test not in attributed})
    if others:
        print(f"  failing beyond the exercises' own tests: {', '.join(others)}")
    for race in report.races:
        if id(race) not in placed:
            print(f"  racecheck, outside the exercises: {race.words()}")
    if report.races:
        print(f"  the first race, as ThreadSanitizer reports it (make racecheck {s.number} on "
              f"the stage runs every case):\n" + textwrap.indent(report.races[0].text, "    "))
    pending = [n for n, st in report.status.items() if st not in ("ok", "not run here", "waiting")]
    waiting = [n for n, st in report.status.items() if st == "waiting"]
    unrun = [n for n, st in report.status.items() if st == "not run here"]
    solution = f"diff -ru {_show(s.source_dir)} {_show(work)}"
    if report.failed() or pending or waiting or report.races:
        also = (f" ({', '.join(waiting)}: no failure of {'its' if len(waiting) == 1 else 'their'} "
                f"own so far)" if waiting else "")
        print(f"[verify] NOT DONE: {', '.join(pending) or 'see the failing tests above'}{also}. "
              f"Edit {_show(work)}, then `make verify {s.number}` again; the solution: {solution}")
        report.exit_code = 1
        return
    report.exit_code = 0
    if unrun:
        print(f"[verify] your copy builds, and every test that ran passes; {', '.join(unrun)} "
              f"could not be run here (see the skip reasons above): on a GPU machine "
              f"`make verify {s.number}` runs them")
    else:
        print(f"[verify] DONE: every exercise of {s.label} passes its tests. Compare with the "
              f"stage: {solution}")


def compile_carved(work: Path, s: Stage, build_dir: Path, suffixes: Sequence[str] = GPU_SUFFIXES,
                   quiet: bool = True) -> list[Path]:
    """Compile the files of a work copy that hold exercises (CUDA files by default) with the
    workbook's flags, as an extension of those files alone (linked, never loaded): the quick
    proof that a carved copy still compiles, where building the whole stage is not needed (its
    other files are the stage's own). Returns the files compiled; RuntimeError with the
    compiler's errors when one does not compile."""
    files = [work / e.relpath for e in find(s) if Path(e.relpath).suffix in suffixes]
    # A kernel header (x.cuh) is compiled through the file beside it that includes it (x.cu).
    files = sorted({f.with_suffix(".cu") if f.suffix == ".cuh" else f for f in files})
    if not files:
        return []
    build_dir.mkdir(parents=True, exist_ok=True)
    cuda = any(f.suffix in GPU_SUFFIXES for f in files)
    script = build_dir / "compile_carved.py"
    script.write_text(textwrap.dedent(f"""\
        from setuptools import setup
        from workbook.build import compiler
        found = compiler.cuda_toolkit()
        if {cuda!r} and found is None:
            raise SystemExit("no CUDA toolkit to compile {', '.join(f.name for f in files)} with")
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
        kind = CUDAExtension if {cuda!r} else CppExtension
        flags = compiler.cxx_flags() + compiler.openmp_flags() + compiler.cpu_simd_flags()
        setup(name="carved", ext_modules=[kind("carved", {[str(f) for f in files]!r},
              include_dirs=compiler.include_dirs(),
              extra_compile_args={{"cxx": flags, "nvcc": compiler.nvcc_flags()}} if {cuda!r}
              else flags)],
              cmdclass={{"build_ext": BuildExtension}},
              script_args=["build_ext", "--build-temp", {str(build_dir / "temp")!r},
                           "--build-lib", {str(build_dir / "lib")!r}])
        """))
    log = build_dir / "compile.log"
    if not quiet:
        print(f"[verify] compiling {', '.join(_show(f) for f in files)} (log: {_show(log)}) ...",
              flush=True)
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, str(script)], cwd=build_dir, stdout=out,
                              stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode != 0:
        lines = log.read_text(errors="replace").splitlines()
        errors = [ln for ln in lines if "error" in ln.lower()][:12] or lines[-12:]
        raise RuntimeError(f"the carved {', '.join(f.name for f in files)} of {s.label} do not "
                           f"compile; full log: {log}\n" + "\n".join(errors))
    return files


# ----------------------------------------------------------------------------------------------
# The command line


def _list(targets: Sequence[Stage]) -> None:
    for s in targets:
        found = find(s)
        print(f"{s.label}: {len(found)} exercise{'s' * (len(found) != 1)}")
        for e in found:
            gpu = "  [GPU]" if e.gpu_only else ""
            print(f"  {e.name:<22} {e.where}{gpu}\n  {'':<22} {e.task}\n  {'':<22} checked by "
                  f"{_tests_line(e)}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="python -m workbook.teaching.exercises",
        description="Exercises carved from the stages' sources, checked by the stages' tests.")
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="the exercises of stage N (of every stage: no N)")
    listing.add_argument("stage", nargs="?", help="stage number or folder")
    carving = sub.add_parser("carve", help="copy stage N to exercises/NN_name with TODOs")
    carving.add_argument("stage", help="stage number or folder")
    carving.add_argument("--reset", action="store_true",
                         help="replace an existing copy (kept in build/exercises/NN_name/previous)")
    verifying = sub.add_parser("verify", help="build your copy of stage N and run its tests on "
                               "it (pytest options after --)")
    verifying.add_argument("stage", help="stage number or folder")
    verifying.add_argument("--only", metavar="EXERCISE",
                           help="run only the tests that check this exercise (its name)")
    verifying.add_argument("--test", action="append", metavar="ID",
                           help="run only this test (a pytest node id: file::test[case])")
    verifying.add_argument("--sanitize", action="store_true",
                           help="build the copy with ASan and UBSan and run its tests under them")
    revealing = sub.add_parser("reveal", help="put the solution of exercises back into your copy")
    revealing.add_argument("stage", help="stage number or folder")
    revealing.add_argument("names", nargs="*", help="exercise names (none: every exercise)")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            _list([stages.get(args.stage)] if args.stage else stages.all_stages())
        elif args.command == "carve":
            carve(args.stage, reset=args.reset)
        elif args.command == "verify":
            return verify(args.stage, pytest_args=extra, only=args.only, tests=args.test,
                          sanitize=args.sanitize).exit_code
        elif args.command == "reveal":
            done = reveal(args.stage, args.names)
            s = stages.get(args.stage)
            print(f"[exercise] revealed in {_show(work_copy(s))}: {', '.join(done)}; "
                  f"`make verify {s.number}` tests the copy")
    except (ExerciseError, FileExistsError, FileNotFoundError, ValueError,
            stages.StageError) as error:
        print(f"[exercise] {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
