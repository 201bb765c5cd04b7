"""make check: build and test what the working tree's changes can break, in minutes.

    python -m workbook.testing.check                   the changes against HEAD: staged, unstaged
                                                       and untracked (git-ignored files aside)
    python -m workbook.testing.check --base main       against another commit: a branch's changes
    python -m workbook.testing.check --dry-run         only print the plan, and why
    python -m workbook.testing.check FILE ...          as if those files alone had changed

What a changed file can break is read from the tree, as `make` finds the stages: nothing here
lists a stage, a test or a notebook. The rules, in the order `plan` applies them:

* ``stages/NN_name/...``: stage NN, and the stages whose stage.toml ``sources_from`` names it,
  directly or through another (they compile its files). A stage's test_*.py: that stage alone.
* ``common/include/...``: the stages whose C++ or CUDA includes it, directly or through another
  header (a plain scan of the #include lines).
* ``common/emulate/...`` (the emulated CUDA device): every CUDA stage, whose CUDA tests run on it
  where no GPU is visible; and the tests/ files that import workbook.build.emulate.
* ``common/workbook/ops/<op>/...``: the stages whose stage.toml lists <op>, and the tests/ files
  that import workbook.ops, which finds every op's folder on disk (so they may run every op).
* any other Python of common/workbook, and conftest.py: the stages, tests/ files and notebooks
  that import it, directly or through other modules of the workbook (the plan shows the chain);
  conftest.py's pytest_plugins count as imported by every test.
* ``tests/test_*.py``: itself. ``notebooks/*.ipynb``: that notebook, executed.
* anything else (scripts, bench, the Makefile, docs, tests/kernels): the tests/ files that name
  it (its file name); none: nothing, which the plan says.

A stage whose package or kernels change brings its notebook (notebooks/NN_*.ipynb), executed
after the tests (a stage chosen by its tests alone does not; nor one chosen by an import, where
the notebooks' own imports decide), and any notebook brings tests/test_notebooks.py's checks that
execute nothing. A kernel change (C++ or CUDA) also runs the stages it reaches under the
sanitizers (those `make sanitize` checks: its why_not), their CPU tests only where it reaches no
CUDA kernel, and, where it reaches a stage's CUDA kernels (the files the emulated build compiles,
or what they include), under the race checker (`make racecheck`) and, where the stage is built
CPU-only here (no GPU visible: workbook.build.emulate.choose_builds), with nvcc (`make
nvcc-check`).

Then it runs them: ``python -m workbook.build`` the stages, their tests and the tests/ files chosen
(each stage in a pytest process of its own, as workbook.testing.suite runs them), the notebooks
(scripts/run_notebooks.py), then workbook.net.sanitize, workbook.net.racecheck and
workbook.build.nvcc_check; a summary, and
exit status 1 on any failure. What it leaves to `make test`, which stays the whole proof: the
tools that reach every stage through workbook.ops at run time (the matrices, fuzzing, the
concurrency test, the benchmark's), chosen here by a change to what they import, not by a change
to a stage they run.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from workbook.build import emulate, stages
from workbook.build.stages import Stage
from workbook.testing import suite

REPO = stages.REPO
COMMON = REPO / "common"
COMMON_INCLUDE = COMMON / "include"
EMULATE_DIR = COMMON / "emulate"
WORKBOOK = COMMON / "workbook"
OPS_DIR = WORKBOOK / "ops"
TESTS_DIR = REPO / "tests"
NOTEBOOKS_DIR = REPO / "notebooks"
CONFTEST = REPO / "conftest.py"
NOTEBOOKS_TEST = suite.NOTEBOOKS_TEST.relative_to(REPO).as_posix()
# tests/test_notebooks.py's test that executes every notebook: `make check` executes those it
# chose itself, in a step of its own (scripts/run_notebooks.py).
NOTEBOOKS_EXECUTE = "test_notebooks_execute"
CXX = {".c", ".cc", ".cpp", ".cu", ".h", ".hpp", ".cuh"}
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


# -- what changed ---------------------------------------------------------------------------------


def changed_files(base: str = "HEAD") -> list[str]:
    """The files changed against `base` (staged and unstaged), and the untracked ones git does
    not ignore, relative to the repository."""
    def git(*args: str) -> list[str]:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"[check] git {' '.join(args)} failed: {out.stderr.strip()}")
        return [line for line in out.stdout.splitlines() if line]

    return sorted(set(git("diff", "--name-only", base)) |
                  set(git("ls-files", "--others", "--exclude-standard")))


# -- C++: who includes what -----------------------------------------------------------------------


@functools.cache
def _includes(path: Path) -> tuple[str, ...]:
    return tuple(INCLUDE.findall(path.read_text(errors="replace"))) if path.is_file() else ()


def cxx_files(s: Stage) -> list[Path]:
    """The C++ and CUDA files of stage s: its folder's and those of the stages it compiles."""
    return sorted(p.resolve() for folder in s.source_dirs for p in folder.rglob("*")
                  if p.suffix in CXX)


def include_closure(roots: list[Path], stage_files: list[Path]) -> dict[Path, Path | None]:
    """Every file `roots` include, directly or not, each with the file that includes it (None
    for a root). An include resolves as the compiler finds it: beside the including file, in
    common/include, in the emulated device's headers, or in the stage's folders (its -I flags)."""
    def resolve(name: str, including: Path) -> Path | None:
        for candidate in (including.parent / name, COMMON_INCLUDE / name,
                          emulate.EMULATE_INCLUDE / name):
            if candidate.is_file():
                return candidate.resolve()
        return next((p for p in stage_files if p.as_posix().endswith("/" + name)), None)

    found: dict[Path, Path | None] = dict.fromkeys(roots)
    todo = list(roots)
    while todo:
        including = todo.pop()
        for name in _includes(including):
            target = resolve(name, including)
            if target is not None and target not in found:
                found[target] = including
                todo.append(target)
    return found


@functools.cache
def stage_includes(number: int) -> dict[Path, Path | None]:
    """What stage `number`'s C++ and CUDA sources include, directly or not."""
    files = cxx_files(stages.get(number))
    return include_closure(files, files)


@functools.cache
def kernel_includes(number: int) -> dict[Path, Path | None]:
    """What the emulated build of stage `number` compiles (its .cu files, or its whole C++ for a
    stage built whole), with what they include: the files a race can come from."""
    s = stages.get(number)
    try:
        roots = [p.resolve() for p in emulate.plan(s).sources]
    except ValueError:  # no .cu files
        return {}
    return include_closure(roots, cxx_files(s))


def include_chain(closure: dict[Path, Path | None], target: Path) -> str:
    """How a file of the closure is reached: "#include'd by a.h, by b.cpp"."""
    steps, here = [], closure[target]
    while here is not None:
        steps.append(rel(here))
        here = closure[here]
    return "#include'd by " + ", by ".join(steps) if steps else "compiled"


# -- Python: who imports what ---------------------------------------------------------------------


def module_name(path: Path) -> str | None:
    """The module a file of common/workbook is (workbook.build.stages), or conftest."""
    if path == CONFTEST:
        return "conftest"
    if not (path.suffix == ".py" and path.is_relative_to(WORKBOOK)):
        return None
    parts = path.relative_to(COMMON).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def workbook_modules() -> dict[str, Path]:
    found = {module_name(p): p for p in WORKBOOK.rglob("*.py")}
    return {**found, "conftest": CONFTEST}


def imports_in(source: str, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that Python source imports: `from a import b` imports a.b where
    that is a module, else a; importing a.b.c runs a and a.b too. conftest.py's pytest_plugins
    are imported by pytest."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.List | ast.Tuple)
              and any(isinstance(t, ast.Name) and t.id == "pytest_plugins" for t in node.targets)):
            names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
    found = set()
    for name in names:
        parts = name.split(".")
        found.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
    return found & known.keys()


def notebook_cells(path: Path) -> list[str]:
    """A notebook's code cells, each as Python source: Jupyter's magics and shell lines left
    out."""
    cells = json.loads(path.read_text())["cells"]
    return ["\n".join(line for line in "".join(c["source"]).splitlines()
                      if not line.lstrip().startswith(("%", "!")))
            for c in cells if c["cell_type"] == "code"]


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Each module of the workbook (and conftest) -> the modules of the workbook it imports."""
    known = workbook_modules()
    return {name: imports_in(path.read_text(), known) - {name} for name, path in known.items()
            if path.is_file()}


def import_chain(start: set[str], target: str) -> list[str] | None:
    """The shortest chain of imports from the modules `start` to `target`, or None."""
    graph, parent = import_graph(), dict.fromkeys(start, "")
    todo = sorted(start)
    while todo:
        here = todo.pop(0)
        if here == target:
            chain = [here]
            while parent[chain[-1]]:
                chain.append(parent[chain[-1]])
            return chain[::-1]
        for nxt in sorted(graph.get(here, ())):
            if nxt not in parent:
                parent[nxt] = here
                todo.append(nxt)
    return None


@functools.cache
def consumers() -> dict[str, tuple[str, frozenset[str]]]:
    """What runs the workbook's Python, each with the modules it imports: the tests/ files, the
    stages (their tests and packages, conftest.py too: pytest loads it) and the notebooks. Keys:
    "tests/test_<name>.py", "stage 9", "notebooks/<name>.ipynb"; values: (kind, modules)."""
    known = workbook_modules()
    found: dict[str, tuple[str, frozenset[str]]] = {}
    for path in sorted(TESTS_DIR.glob("test_*.py")):
        found[rel(path)] = ("tests", frozenset(imports_in(path.read_text(), known) | {"conftest"}))
    for s in stages.all_stages():
        used = {m for folder in s.source_dirs for p in folder.rglob("*.py")
                for m in imports_in(p.read_text(), known)}
        found[f"stage {s.number}"] = ("stage", frozenset(used | {"conftest"}))
    for path in sorted(NOTEBOOKS_DIR.glob("*.ipynb")):
        used = {m for cell in notebook_cells(path) for m in imports_in(cell, known)}
        found[rel(path)] = ("notebook", frozenset(used))
    return found


# -- the plan -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    """What to run, each item with why: the changed files that chose it and how."""

    stages: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    tests: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # tests/ files
    notebooks: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    sanitize: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    racecheck: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    nvcc: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # make nvcc-check's
    sanitize_options: list[str] = dataclasses.field(default_factory=list)  # pytest's, after --
    notes: list[str] = dataclasses.field(default_factory=list)  # what chose nothing, and why

    def empty(self) -> bool:
        return not (self.stages or self.tests or self.notebooks)


def _add(table: dict, key, why: str) -> None:
    reasons = table.setdefault(key, [])
    if why not in reasons:
        reasons.append(why)


def _select_test(plan: Plan, key: str, why: str, whole: bool = False) -> None:
    """Choose a tests/ file. tests/test_notebooks.py runs here without its execution test: the
    notebooks chosen run in a step of their own. Where it, or a file it names (its runner),
    changed (`whole`), that step executes every notebook, as its test would."""
    _add(plan.tests, key, why)
    if key == NOTEBOOKS_TEST and whole:
        for nb in sorted(NOTEBOOKS_DIR.glob("*.ipynb")):
            _add(plan.notebooks, rel(nb), f"{why}; {NOTEBOOKS_TEST} executes every notebook")


def dependents(folder: str) -> list[Stage]:
    """The stages that compile stage `folder`'s files (sources_from), directly or through
    another stage."""
    found: list[Stage] = []
    reached = {folder}
    while more := [s for s in stages.all_stages()
                   if s not in found and reached & set(s.sources_from)]:
        found += more
        reached |= {s.folder for s in more}
    return sorted(found, key=lambda s: s.number)


def _python_users(plan: Plan, name: str, module: str, kinds: set[str]) -> None:
    """Add the consumers of `kinds` whose imports reach `module`, with the chain."""
    for key, (kind, used) in consumers().items():
        chain = import_chain(set(used), module) if kind in kinds else None
        if chain is None:
            continue
        how = f"{name}: imports {' -> '.join(chain)}"
        if kind == "tests":
            _select_test(plan, key, how)
        elif kind == "stage":
            _add(plan.stages, int(key.split()[1]), how)
        else:
            _add(plan.notebooks, key, how)


def _named_by_tests(plan: Plan, name: str) -> None:
    """The fallback: the tests/ files that name the file (its file name, or its path where the
    name has no extension: `run` would be found everywhere)."""
    said = Path(name).name if Path(name).suffix else name
    word = re.compile(rf"(?<![\w.-]){re.escape(said)}(?![\w-])")
    naming = [p for p in sorted(TESTS_DIR.glob("test_*.py")) if word.search(p.read_text())]
    for path in naming:
        _select_test(plan, rel(path), f"{name}: named there", whole=True)
    if not naming:
        plan.notes.append(f"{name}: no rule and no tests/ file names it; nothing to run "
                          f"(make test checks the whole)")


def plan(paths: list[str]) -> Plan:
    """What the changed files (relative to the repository) can break, each item with why."""
    result = Plan()
    by_folder = {s.folder: s for s in stages.all_stages()}
    cxx_changed: list[tuple[str, Path]] = []  # (name, path) of the C++ and CUDA changed
    with_notebook: set[int] = set()  # the stages whose package or kernels change

    def stage(s: Stage, why: str, notebook: bool = True) -> None:
        _add(result.stages, s.number, why)
        if notebook:
            with_notebook.add(s.number)

    for name in paths:
        path = (REPO / name).resolve()
        top = Path(name).parts
        if top[0] == "stages" and len(top) > 2 and top[1] in by_folder and path.suffix != ".md":
            s, a_test = by_folder[top[1]], path.name.startswith("test_")
            stage(s, f"{name}: in its folder", notebook=not a_test)
            for d in [] if a_test else dependents(s.folder):
                stage(d, f"{name}: its stage.toml's sources_from reaches {s.folder}")
            if path.suffix in CXX:
                cxx_changed.append((name, path))
        elif path.is_relative_to(COMMON_INCLUDE):
            for s in stages.all_stages():
                closure = stage_includes(s.number)
                if path in closure:
                    stage(s, f"{name}: {include_chain(closure, path)}")
            if not any(path in stage_includes(s.number) for s in stages.all_stages()):
                result.notes.append(f"{name}: no stage includes it")
            cxx_changed.append((name, path))
        elif path.is_relative_to(EMULATE_DIR):
            for s in stages.all_stages():
                if s.cuda:
                    stage(s, f"{name}: its CUDA tests run on the emulated device")
            _python_users(result, name, "workbook.build.emulate", {"tests"})
            cxx_changed.append((name, path))
        elif path.is_relative_to(OPS_DIR) and len(path.relative_to(OPS_DIR).parts) > 1:
            op = path.relative_to(OPS_DIR).parts[0]
            for s in stages.all_stages():
                if op in s.ops:
                    stage(s, f"{name}: its stage.toml lists ops {op}")
            _python_users(result, name, "workbook.ops", {"tests"})
        elif module_name(path):
            _python_users(result, name, module_name(path), {"tests", "stage", "notebook"})
        elif top[0] == "tests" and path.name.startswith("test_") and path.suffix == ".py":
            if path.is_file():
                _select_test(result, name, f"{name}: changed", whole=True)
            else:
                result.notes.append(f"{name}: deleted, nothing to run")
        elif top[0] == "notebooks" and path.suffix == ".ipynb":
            if path.is_file():
                _add(result.notebooks, name, f"{name}: changed")
            else:
                result.notes.append(f"{name}: deleted, nothing to run")
        else:
            _named_by_tests(result, name)
            if path.suffix == ".md":
                result.notes.append(f"{name}: the book's links are make book-check's (not run: "
                                    f"it builds the book)")
    result.stages = dict(sorted(result.stages.items()))
    for number in sorted(with_notebook):
        for nb in sorted(NOTEBOOKS_DIR.glob(f"{number:02d}_*.ipynb")):
            _add(result.notebooks, rel(nb), f"stage {number}'s notebook")
    if result.notebooks:
        _select_test(result, NOTEBOOKS_TEST, "the notebooks' checks that execute nothing (the "
                                             "notebooks chosen are executed below)")
    _kernel_checks(result, cxx_changed)
    result.tests = dict(sorted(result.tests.items()))
    result.notebooks = dict(sorted(result.notebooks.items()))
    return result


def _kernel_checks(result: Plan, cxx_changed: list[tuple[str, Path]]) -> None:
    """The sanitizer and race-checker passes a C++/CUDA change asks for, on the stages chosen.
    A change that reaches no CUDA kernel of the stages sanitized runs their CPU tests only there
    (-m "not cuda"): the emulated kernels are built from other files, so no case of theirs can
    fail on it (DESIGN.md, 14: a build flavour takes the cases it can fail on)."""
    from workbook.net import racecheck, sanitize

    covered: set[Path] = set()  # the .cu files a stage checked before covers (racecheck's rule)
    kernels_reached = False  # by a change, in a stage sanitized
    for number in result.stages:
        s, kernels = stages.get(number), kernel_includes(number)
        here = [(n, p) for n, p in cxx_changed if p in stage_includes(number) or
                p.is_relative_to(EMULATE_DIR) or p.is_relative_to(s.source_dir)]
        reaching = [(n, p) for n, p in here if p in kernels or p.is_relative_to(EMULATE_DIR)]
        if not here:
            continue
        reason = sanitize.why_not(s, full=False)
        if reason is None:
            kernels_reached |= bool(reaching)
            for n, _ in here:
                _add(result.sanitize, number, f"{n}: C++ the stage compiles")
        else:
            result.notes.append(f"sanitize: {s.label} left out, as make sanitize leaves it: "
                                f"{reason}")
        if not s.cuda:
            continue
        if s.cpu_only and s.cpu_fallback and not stages.nvcc_wanted():
            # built CPU-only here (no GPU: emulate.choose_builds), so nvcc has not seen the change
            for n, p in reaching:
                if p in kernels:
                    _add(result.nvcc, number, f"{n}: in its CUDA files, which the stage's build "
                                              f"here leaves to the emulated device")
        files = racecheck.kernel_files(s)
        if not reaching:
            result.notes.append(f"racecheck: {s.label} left out: the change does not reach its "
                                f"CUDA kernels")
        elif files and files <= covered:
            result.notes.append(f"racecheck: {s.label} left out: its kernel files are checked "
                                f"with an earlier stage's")
        else:
            covered |= files
            for n, p in reaching:
                how = include_chain(kernels, p) if p in kernels else "the emulated device"
                _add(result.racecheck, number, f"{n}: in its CUDA kernels ({how})")
    if result.sanitize and not kernels_reached:
        result.sanitize_options = ["-m", "not cuda"]
        result.notes.append("sanitize: the CPU tests only (-m 'not cuda'): the change reaches no "
                            "CUDA kernel of the stages sanitized")


def describe(p: Plan, most: int = 3) -> str:
    """The plan as the check prints it first: each item, then why (the first `most` reasons)."""
    lines = []

    def item(what: str, reasons: list[str]) -> None:
        lines.append(f"  {what}")
        lines.extend(f"      <- {why}" for why in reasons[:most])
        if len(reasons) > most:
            lines.append(f"      <- ... and {len(reasons) - most} more")

    for number, why in p.stages.items():
        item(f"build and test {stages.get(number).label}", why)
    for name, why in p.tests.items():
        item(f"test {name}" + (f" (all but {NOTEBOOKS_EXECUTE})" if name == NOTEBOOKS_TEST
                               else ""), why)
    for name, why in p.notebooks.items():
        item(f"execute {name}", why)
    for number, why in p.sanitize.items():
        item(f"sanitize {stages.get(number).label}: ASan+UBSan", why)
    for number, why in p.racecheck.items():
        item(f"racecheck {stages.get(number).label}: ThreadSanitizer on its emulated kernels",
             why)
    for number, why in p.nvcc.items():
        item(f"nvcc-check {stages.get(number).label}: built with nvcc, loaded with its CUDA "
             f"kernels", why)
    lines.extend(f"  note: {note}" for note in p.notes)
    return "\n".join(lines)


# -- running it -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Step:
    label: str
    ok: bool
    seconds: float
    note: str = ""


def _command(label: str, cmd: list[str]) -> Step:
    print(f"\n[check] ===== {label}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    code = subprocess.run(cmd, cwd=REPO).returncode
    return Step(label, code == 0, time.perf_counter() - start, f"exit {code}" if code else "")


def _tests(p: Plan) -> list[Step]:
    """The stages' tests and the tests/ files, as workbook.testing.suite runs its parts."""
    parts = [suite.Part(stages.get(n).label, [stages.get(n).source_dir]) for n in p.stages]
    if p.tests:  # in one process, as make test runs tests/
        parts.append(suite.Part(f"tests/ ({', '.join(Path(t).name for t in p.tests)})",
                                [REPO / t for t in p.tests],
                                [*suite.TESTS_OPTIONS, "-k", f"not {NOTEBOOKS_EXECUTE}"]))
    if not parts:
        return []
    jobs = min(suite.parts_at_a_time(), len(parts))
    if jobs > 1:
        from workbook.measure.timing import usable_cpus

        suite.run_side_by_side(parts, [], jobs, len(usable_cpus()))
    else:
        for part in parts:
            suite.run_part(part, [])
    steps = []
    for part in parts:
        # tests/ files whose every test is marked for a target of its own (make test-template,
        # test-exercises, book-check) collect nothing here: that is not a failure.
        nothing = part.exit_code == 5 and part.label.startswith("tests/")
        steps.append(Step(f"tests of {part.label}", part.ok or nothing, part.seconds,
                          "nothing outside the marked tests" if nothing else part.summary))
    return steps


def run(p: Plan) -> list[Step]:
    py = sys.executable
    steps: list[Step] = []
    if p.stages:
        steps.append(_command("build", [py, "-m", "workbook.build", *map(str, p.stages)]))
        if not steps[-1].ok:
            return steps  # the tests of a stage that does not build say nothing more
    steps += _tests(p)
    if p.notebooks:
        names = [Path(n).name for n in p.notebooks]
        steps.append(_command("notebooks", [py, str(REPO / "scripts" / "run_notebooks.py"),
                                            *names]))
    if p.sanitize:
        steps.append(_command("sanitize", [py, "-m", "workbook.net.sanitize",
                                           *map(str, p.sanitize), "--", *p.sanitize_options]))
    if p.racecheck:
        steps.append(_command("racecheck", [py, "-m", "workbook.net.racecheck",
                                            *map(str, p.racecheck)]))
    if p.nvcc:
        steps.append(_command("nvcc-check", [py, "-m", "workbook.build.nvcc_check",
                                             *map(str, p.nvcc)]))
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="check these files, relative to the "
                        "repository, as if they alone had changed (instead of asking git)")
    parser.add_argument("--base", default="HEAD", help="the commit to compare the working tree "
                        "with (default HEAD: staged, unstaged and untracked changes)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan only")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    chosen = emulate.choose_builds()
    if chosen:
        print(f"[check] {chosen}")
    if args.paths:
        paths = sorted({rel(Path(p).resolve()) for p in args.paths})
        print(f"[check] {len(paths)} file(s), as if changed:")
    else:
        paths = changed_files(args.base)
        print(f"[check] {len(paths)} file(s) changed against {args.base} (staged, unstaged, "
              f"untracked):")
    print("\n".join(f"  {name}" for name in paths) or "  (none)")
    p = plan(paths)
    if p.empty():
        print(describe(p))
        print("[check] nothing to build or test for these changes")
        return 0
    print(f"[check] the plan, each item with the change(s) that chose it:\n{describe(p)}",
          flush=True)
    if args.dry_run:
        return 0
    steps = run(p)
    total = time.perf_counter() - start
    print("\n[check] ===== summary")
    for step in steps:
        print(f"  {'ok  ' if step.ok else 'FAIL'} {step.label:<56} {step.note:<40} "
              f"{step.seconds:6.0f} s")
    failed = [s.label for s in steps if not s.ok]
    if failed:
        print(f"[check] FAILED: {', '.join(failed)} ({total:.0f} s)")
        return 1
    print(f"[check] {len(steps)} step(s) passed in {total:.0f} s (make test runs the whole)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
