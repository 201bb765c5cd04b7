"""Test results kept while nothing a test can read has changed: a test that passed is not run
again until a file it can reach, or the environment it ran in, is different.

    WORKBOOK_RESULTS=~/.cache/workbook/results make test      keep results there (CI sets it)

Nothing is kept, and every test runs, unless WORKBOOK_RESULTS names a folder. Loaded by the
repository's conftest.py. The idea is a build system's (Bazel's cached test results): a test's
verdict is a function of its inputs, so a second run on the same inputs proves nothing the first
did not; only what was proven on exactly these inputs is reused.

**A test's inputs, named by a key.** The key is a hash of the files the test can reach, each by
its path in the repository and its content (the working tree's: tracked files and those git does
not ignore), and of the environment below. What a test can reach is read from where it lives:

* a stage's test (``stages/NN_name/test_*.py``): that stage's folder, and the folders of the
  stages it names in any of its files (the stages it compiles sources from, imports or loads:
  ``sources_from``, a folder name, ``stages.get(N)``), and theirs in turn; and every file outside
  ``stages/`` but ``tests/``, ``notebooks/``, ``bench/`` and the prose (common/, conftest.py,
  the requirements, the Makefile, scripts/);
* a test elsewhere (tests/) with a stage among its parameters (a ``Stage``, or an object with a
  ``stage``, as an op's implementation has), or marked ``reaches("NN_name", ...)``: those stages'
  folders, as above, and every file outside ``stages/`` but the prose; a test marked
  ``reads("stages/*/x", "README.md", ...)`` also (or only) the files of ``stages/`` and the prose
  that match those patterns; one marked ``reaches()``, naming no stage, only the files outside
  ``stages/`` but the prose;
* any other test: every file.

The prose is the Markdown outside ``stages/`` (README.md, bench/README.md, the measurements under
bench/results/): a test that reads it says so, with a ``reads`` mark or by marking nothing, so
that a change of wording reruns the tests that check wording, not every test of every stage. A
stage's own Markdown is in its folder, in its tests' reach.

The environment: the interpreter and every installed distribution's version, the system's
packages (dpkg's list), nvcc's version, the CPU's flags, the GPUs visible, and the variables that
change what a test runs on (WORKBOOK_*, the sanitizers' and OpenMP's settings, LD_PRELOAD, ...),
the clone's own path replaced by a placeholder, so that a clone elsewhere finds the same keys.

**What is kept, and reused.** A row of one SQLite database in that folder (`Store`), for each test
whose setup, call and teardown all passed (not one skipped, failed or expected to fail). At
collection, a test whose key has a row is taken out of the run and counted: the summary line says
``N reused``, a closing line says how long those tests took when they ran, and the run log
(workbook.measure.runlog) records it. A failed test is never kept, so it runs every time until it
passes. ``--collect-only`` lists every test.

**What a test leaves for later steps.** A test marked ``keeps(path, ...)`` writes those files for
a later step to read (the notebook test's executed copies, which the book shows). They are kept
with its result (<folder>/outputs/<key>/) and put back, as new files, when the result is reused;
where one is missing from the store, the test runs.

**Nested runs start afresh.** A test that runs pytest itself (a copy of the repository, a carved
exercise, a check into an empty build folder) must prove it now: this process drops
WORKBOOK_RESULTS from its environment, so nothing it starts reuses a result. Under pytest-xdist
the controller hands the folder to its workers, which collect and keep; the controller adds up
what they reused.

What it cannot see: a file outside the repository and the environment above (say, an extension
installed into the venv from a local folder under an unchanged version). `WORKBOOK_RESULTS=` (or
a new folder) runs everything.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import hashlib
import json
import os
import platform
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

from workbook.build import stages
from workbook.measure import runlog

ENV = "WORKBOOK_RESULTS"
REPO = stages.REPO
_WORKER_INPUT = "workbook_results"
_WORKER_OUTPUT = "workbook_results_reused"

# Top folders a stage's tests do not read (the repository's own tests, the notebooks, the
# benchmarks and their results).
NOT_FOR_STAGES = ("tests/", "notebooks/", "bench/")
PROSE = ".md"  # outside stages/, read only by the tests that say so (see the module docstring)
# The variables that change what a test runs, or on what; of WORKBOOK_*, all but those that only
# say where to log, how to print or how many to run at once.
_VARIABLES = re.compile(r"(WORKBOOK_|TORCH|CUDA|NVIDIA_|OMP_|MKL_|KMP_|ASAN_|UBSAN_|TSAN_|LSAN_|"
                        r"MALLOC_|GLIBC_TUNABLES$|LD_PRELOAD$|LD_LIBRARY_PATH$|PYTHONHASHSEED$|"
                        r"HYPOTHESIS|CC$|CXX$|CFLAGS$|CXXFLAGS$|LDFLAGS$|NVCC)")
_NOT_VARIABLES = {ENV, runlog.ENV, "WORKBOOK_CI_STEP", "WORKBOOK_TEST_JOBS",
                  "WORKBOOK_VERBOSE_BUILD", "WORKBOOK_EMULATE_QUIET"}
_STAGE_FOLDER = re.compile(r"\b(\d{2}_[a-z0-9_]+)")
_STAGE_NUMBER = re.compile(r"\b(?:stages\.get|import_stage)\(\s*(\d+)\s*[,)]")


def folders_named(text: str, folders) -> set[str]:
    """The stage folders among `folders` that `text` names: by folder name ("09_ms_deform_attn"),
    or by number as ``stages.get(9)`` and a notebook's ``import_stage(9)`` take it."""
    folders = set(folders)
    by_number = {int(f[:2]): f for f in folders}
    named = {m for m in _STAGE_FOLDER.findall(text) if m in folders}
    return named | {by_number[int(n)] for n in _STAGE_NUMBER.findall(text) if int(n) in by_number}


# -- the files ------------------------------------------------------------------------------------


def tree(repo: Path = REPO) -> dict[str, str] | None:
    """Every file of the working tree that git tracks or does not ignore, by its path relative
    to `repo`, with the hash of its content; None outside a git work tree."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=repo, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    files = {}
    for name in sorted(set(out.decode().split("\0")) - {""}):
        try:
            files[name] = hashlib.sha256((repo / name).read_bytes()).hexdigest()
        except (IsADirectoryError, FileNotFoundError):  # a submodule; a file deleted, not staged
            continue
    return files


def _digest(files: dict[str, str], names) -> str:
    h = hashlib.sha256()
    for name in sorted(names):
        h.update(f"{name}\0{files[name]}\n".encode())
    return h.hexdigest()


def stage_of_path(name: str) -> str | None:
    """The stage folder a path relative to the repository lies in ("09_ms_deform_attn"), if any."""
    parts = name.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "stages" else None


class Inputs:
    """The digests that keys are made of, for one working tree."""

    def __init__(self, files: dict[str, str], repo: Path = REPO):
        self.files = files
        by_stage: dict[str, list[str]] = {}
        for name in files:
            folder = stage_of_path(name)
            if folder is not None:
                by_stage.setdefault(folder, []).append(name)
        self.stage_digest = {f: _digest(files, names) for f, names in by_stage.items()}
        names: dict[str, set[str]] = {}
        for folder, members in by_stage.items():
            text = "\n".join((repo / n).read_text(errors="replace") for n in members)
            names[folder] = folders_named(text, by_stage) - {folder}
        self._names = names
        self._reach: dict[str, frozenset[str]] = {}
        outside = [n for n in files if stage_of_path(n) is None and not n.endswith(PROSE)]
        self.prose = [n for n in files if stage_of_path(n) is None and n.endswith(PROSE)]
        self.outside_stages = _digest(files, outside)
        self.for_stages = _digest(files, [n for n in outside if not n.startswith(NOT_FOR_STAGES)])
        self.whole = _digest(files, files)

    def reach(self, folder: str) -> frozenset[str]:
        """The stage folders `folder`'s tests can reach: itself, those it names, and theirs."""
        if folder not in self._reach:
            found, todo = {folder}, [folder]
            while todo:
                for other in self._names.get(todo.pop(), ()):
                    if other not in found:
                        found.add(other)
                        todo.append(other)
            self._reach[folder] = frozenset(found)
        return self._reach[folder]

    def scope(self, path: str, stages_named: set[str], reads=None) -> tuple[str, str]:
        """What a test in `path` (relative to the repository) can reach, as (a description, a
        digest of it); `stages_named`: the stage folders among its parameters and marks;
        `reads`: patterns of the files in stages/ and of the prose it reads besides (its `reads`
        marks), or None where it says nothing of what it reads (no `reads` or `reaches` mark)."""
        own = stage_of_path(path)
        if own is not None:
            folders = self._union({own, *stages_named})
            return f"stages {', '.join(sorted(folders))}", self._with(folders, self.for_stages)
        if stages_named or reads is not None:
            folders = self._union(stages_named)
            base = self.outside_stages
            described = [f"stages {', '.join(sorted(folders))}"] if folders else []
            if reads:
                readable = [n for n in self.files if stage_of_path(n) is not None] + self.prose
                matching = [n for n in readable if any(fnmatch.fnmatchcase(n, p) for p in reads)]
                base = hashlib.sha256(f"{base}\n{_digest(self.files, matching)}".encode()) \
                    .hexdigest()
                described.append(f"the files {', '.join(sorted(reads))}")
            return ("".join(f"{d}, " for d in described[:-1]) +
                    (f"{described[-1]} and " if described else "") +
                    "every file outside stages/ but the prose",
                    self._with(folders, base))
        return "every file", self.whole

    def _union(self, folders: set[str]) -> frozenset[str]:
        return frozenset().union(*(self.reach(f) for f in folders if f in self.stage_digest))

    def _with(self, folders, base: str) -> str:
        return hashlib.sha256("\n".join([base, *(f"{f} {self.stage_digest[f]}"
                                                 for f in sorted(folders))]).encode()).hexdigest()


# -- the environment ------------------------------------------------------------------------------


def _output(*command: str) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _nvcc() -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    for candidate in (shutil.which("nvcc"), os.path.join(home, "bin", "nvcc")):
        if candidate and os.path.exists(candidate):
            return _output(candidate, "--version")
    return "no nvcc"


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def environment(repo: Path = REPO) -> dict[str, str]:
    """What a test's verdict may depend on outside the repository's files (the module docstring
    lists it), the clone's path replaced by "<repo>"."""
    variables = {k: v.replace(str(repo), "<repo>") for k, v in sorted(os.environ.items())
                 if _VARIABLES.match(k) and k not in _NOT_VARIABLES}
    distributions = sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions())
    return {
        "python": sys.version,
        "platform": platform.platform(),
        "distributions": hashlib.sha256("\n".join(distributions).encode()).hexdigest(),
        "system packages": hashlib.sha256(
            _output("dpkg-query", "-W", "-f=${Package} ${Version}\n").encode()).hexdigest(),
        "compiler": _output(os.environ.get("CXX", "c++"), "--version").split("\n")[0],
        "nvcc": (_nvcc().strip().splitlines() or [""])[-1],
        "cpu": hashlib.sha256(_cpu_flags().encode()).hexdigest(),
        "gpus": str(len(glob.glob("/dev/nvidia[0-9]*"))),
        "variables": json.dumps(variables, sort_keys=True),
    }


# -- the keys and the store -----------------------------------------------------------------------


def stages_named(item) -> set[str]:
    """The stage folders among a test's parameters (a Stage, or an object with a `stage`) and
    its `reaches` marks."""
    found = set()
    for value in getattr(getattr(item, "callspec", None), "params", {}).values():
        stage = value if isinstance(value, stages.Stage) else getattr(value, "stage", None)
        if isinstance(stage, stages.Stage):
            found.add(stage.folder)
    for mark in item.iter_markers("reaches"):
        found.update(mark.args)
    return found


def files_read(item) -> tuple[str, ...] | None:
    """The patterns of a test's `reads` marks: files of stages/ it reads beyond the stages it
    reaches, and the prose it reads; None where it has neither a `reads` nor a `reaches` mark
    (nothing said: it may read any file)."""
    marks = [*item.iter_markers("reads")]
    if not marks and next(iter(item.iter_markers("reaches")), None) is None:
        return None
    return tuple(p for mark in marks for p in mark.args)


def files_kept(item) -> list[Path]:
    """The files a test's `keeps` marks name, in order: what it leaves for a later step."""
    return [Path(p) for mark in item.iter_markers("keeps") for p in mark.args]


class Store:
    """The kept results: one SQLite database, <folder>/results.sqlite3, a row per key. A process
    writes its rows in batches (every BATCH tests, and at its end): a process that dies loses
    only rows it had not written, whose tests then run again. Rows older than KEEP_DAYS go."""

    BATCH = 200
    KEEP_DAYS = 30

    def __init__(self, folder: Path):
        self.folder = folder
        self.path = folder / "results.sqlite3"
        self._pending: list[tuple] = []
        self._pruned = False
        self.error = ""  # what went wrong with the database, if anything: said at the end

    def _connect(self) -> sqlite3.Connection:
        self.folder.mkdir(parents=True, exist_ok=True)
        # Processes side by side take turns (timeout); transactions are flush's own.
        db = sqlite3.connect(self.path, timeout=120, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE IF NOT EXISTS kept (key TEXT PRIMARY KEY, nodeid TEXT, "
                   "seconds REAL, scope TEXT, at REAL)")
        return db

    def get_many(self, keys: list[str]) -> dict[str, dict]:
        """The kept rows of `keys`, by key."""
        self.flush()
        found = {}
        try:
            with contextlib.closing(self._connect()) as db:
                for k in range(0, len(keys), 500):
                    chunk = keys[k:k + 500]
                    rows = db.execute(f"SELECT key, nodeid, seconds, scope, at FROM kept WHERE "
                                      f"key IN ({','.join('?' * len(chunk))})", chunk)
                    for key, nodeid, seconds, scope, at in rows:
                        found[key] = {"nodeid": nodeid, "s": seconds, "scope": scope, "at": at}
        except sqlite3.Error as error:  # nothing reused: every test runs
            self.error = f"no result read, every test runs: {error}"
            return {}
        return found

    def get(self, key: str) -> dict | None:
        return self.get_many([key]).get(key)

    def put(self, key: str, nodeid: str, seconds: float, scope: str) -> None:
        self._pending.append((key, nodeid, round(seconds, 3), scope, time.time()))
        if len(self._pending) >= self.BATCH:
            self.flush()

    def flush(self) -> None:
        if not self._pending and self._pruned:
            return
        old, gone = (time.time() - self.KEEP_DAYS * 86400,), []
        try:
            with contextlib.closing(self._connect()) as db:
                # The write lock first: BEGIN IMMEDIATE waits for it (up to the timeout). A
                # transaction that reads before it writes fails at once instead ("database is
                # locked") when another process commits in between, as parts side by side do.
                db.execute("BEGIN IMMEDIATE")
                try:
                    db.executemany("INSERT OR REPLACE INTO kept VALUES (?, ?, ?, ?, ?)",
                                   self._pending)
                    if not self._pruned:
                        gone = [k for (k,) in db.execute("SELECT key FROM kept WHERE at < ?",
                                                         old)]
                        db.execute("DELETE FROM kept WHERE at < ?", old)
                    db.execute("COMMIT")
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
        except sqlite3.Error as error:  # the tests' verdicts stand; only their keeping is lost
            self.error = f"{len(self._pending)} results not kept: {error}"
        for key in gone:
            shutil.rmtree(self._outputs(key), ignore_errors=True)
        self._pending, self._pruned = [], True

    # A kept test's outputs: <folder>/outputs/<key>/<n>-<name>, n its place among them.

    def _outputs(self, key: str) -> Path:
        return self.folder / "outputs" / key

    def keep_outputs(self, key: str, paths: list[Path]) -> bool:
        """Copies `paths` into the store beside `key`'s row; False (nothing kept) where one is
        not a file."""
        if not all(p.is_file() for p in paths):
            return False
        folder = self._outputs(key)
        folder.mkdir(parents=True, exist_ok=True)
        for n, path in enumerate(paths):
            part = folder / f".{n}-{path.name}.{os.getpid()}"
            shutil.copyfile(path, part)
            os.replace(part, folder / f"{n}-{path.name}")
        return True

    def restore_outputs(self, key: str, paths: list[Path]) -> bool:
        """Puts `key`'s kept outputs back at `paths`, as new files (their time now: a tool that
        compares times with the sources sees them current); False where one is missing."""
        kept = [self._outputs(key) / f"{n}-{path.name}" for n, path in enumerate(paths)]
        if not all(k.is_file() for k in kept):
            return False
        for source, path in zip(kept, paths):
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, path)
        return True


class Results:
    """The plugin, registered by pytest_configure where WORKBOOK_RESULTS names a folder."""

    def __init__(self, config, folder: Path):
        self.config = config
        self.store = Store(folder)
        self.keys: dict[str, str] = {}
        self.scopes: dict[str, str] = {}
        self.outputs: dict[str, list[Path]] = {}  # what a test keeps for later steps
        self.reused: list[tuple[str, float]] = []
        self.seconds: dict[str, float] = {}
        self.failed: set[str] = set()  # a phase that did not pass, or an expected failure
        self.called: set[str] = set()  # a call that passed
        self.worker = hasattr(config, "workerinput")
        self.controller = not self.worker and bool(getattr(config.option, "numprocesses", None))

    # -- collection: the keys, and the results kept for them

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session, config, items):
        if self.controller or config.option.collectonly:  # --collect-only lists every test
            return
        files = tree(REPO)
        if files is None:
            return
        inputs, env = Inputs(files, REPO), environment(REPO)
        env_digest = hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()
        keys = {}
        for item in items:
            path = _relative(item)
            if path is None or path not in files:  # a copy under build/, a file outside
                continue
            described, digest = inputs.scope(path, stages_named(item), files_read(item))
            keys[item.nodeid] = hashlib.sha256(
                f"{env_digest}\n{digest}\n{item.nodeid}".encode()).hexdigest()
            self.scopes[item.nodeid] = described
        found = self.store.get_many(list(keys.values()))
        kept = []
        for item in items:
            key, outputs = keys.get(item.nodeid, ""), files_kept(item)
            record = found.get(key)
            if record is not None and record["nodeid"] == item.nodeid and \
                    self.store.restore_outputs(key, outputs):
                self.reused.append((item.nodeid, float(record["s"])))
                continue
            if item.nodeid in keys:
                self.keys[item.nodeid] = key
                self.outputs[item.nodeid] = outputs
            kept.append(item)
        items[:] = kept
        if self.worker:
            config.workeroutput[_WORKER_OUTPUT] = self.reused
        else:
            self._count()
            self._log()

    # -- the run: what passed whole

    def pytest_runtest_logreport(self, report):
        if getattr(report, "node", None) is not None:  # the controller's copy of a worker's report
            return
        nodeid = report.nodeid
        self.seconds[nodeid] = self.seconds.get(nodeid, 0.0) + report.duration
        if not report.passed or hasattr(report, "wasxfail"):
            self.failed.add(nodeid)
        elif report.when == "call":
            self.called.add(nodeid)
        if report.when != "teardown":
            return
        key, outputs = self.keys.pop(nodeid, None), self.outputs.pop(nodeid, [])
        if key is not None and nodeid in self.called and nodeid not in self.failed and \
                self.store.keep_outputs(key, outputs):
            self.store.put(key, nodeid, self.seconds[nodeid], self.scopes.get(nodeid, ""))
        for seen in (self.failed, self.called):
            seen.discard(nodeid)
        self.seconds.pop(nodeid, None)

    # -- pytest-xdist: the folder to the workers, their counts back

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node):
        node.workerinput[_WORKER_INPUT] = str(self.store.folder)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        reused = getattr(node, "workeroutput", {}).get(_WORKER_OUTPUT)
        if reused and not self.reused:  # every worker collects the same tests: count one
            self.reused = [tuple(r) for r in reused]
            self._count()
            self._log()

    # -- the end: the count, and an exit status that says they passed

    def _count(self) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None and self.reused:
            reporter.stats.setdefault("reused", []).extend(_Reused() for _ in self.reused)

    def _log(self) -> None:
        if self.reused:
            runlog.record("reused", f"{len(self.reused)} tests", sum(s for _, s in self.reused),
                          stage=runlog.stage_of(self.reused[0][0]),
                          flavour=runlog.checks_flavour() or "-", tests=len(self.reused))

    def pytest_terminal_summary(self, terminalreporter):
        if self.store.error:
            terminalreporter.write_line(f"[results] the store {self.store.path} failed: "
                                        f"{self.store.error}")
        if self.reused and not self.worker:
            took = sum(s for _, s in self.reused)
            terminalreporter.write_line(
                f"[results] {len(self.reused)} tests reused: they passed on these inputs before "
                f"({took:.0f} s then; kept in {self.store.folder}; {ENV}= runs them)")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        self.store.flush()
        # Every test reused: pytest's "no tests collected" (5) means here that all passed.
        if self.reused and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
            session.exitstatus = pytest.ExitCode.OK


class _Reused:
    """One reused test in the terminal's counts (the summary line's `N reused`)."""

    count_towards_summary = True


def _relative(item) -> str | None:
    path = Path(str(item.path)).resolve()
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else None


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "reaches(*stage_folders): the stages a test outside them runs, none where "
        "it names none (its results are kept while those stages and the files outside stages/ "
        "but the Markdown are unchanged)")
    config.addinivalue_line(
        "markers", "reads(*patterns): files of stages/, and Markdown outside them, that a test "
        "outside stages/ reads (glob patterns relative to the repository, "
        "'stages/*/stage.toml', 'README.md'), kept in its key as reaches' stages")
    config.addinivalue_line(
        "markers", "keeps(*paths): files a test writes for a later step to read, kept with its "
        "result and put back when the result is reused")
    worker_input = getattr(config, "workerinput", None)
    if worker_input is not None:
        folder = worker_input.get(_WORKER_INPUT, "")
    else:
        folder = os.environ.get(ENV, "").strip()
    # Nested runs start afresh: nothing this process starts reuses a result.
    os.environ.pop(ENV, None)
    if folder:
        config.pluginmanager.register(Results(config, Path(folder).expanduser()),
                                      "workbook-results")
