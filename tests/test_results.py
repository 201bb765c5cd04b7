"""Kept test results (workbook/testing/pytest_results.py): what a test's key covers, what is kept,
and a run that reuses them, alone and under pytest-xdist."""

import hashlib
import os
import subprocess
import sys
import time
import types

import pytest

from workbook import ops
from workbook.build import stages
from workbook.measure import runlog
from workbook.testing import pytest_results as results

REPO = stages.REPO


def at(*parts):
    """A path in the throwaway repositories these tests make (not this one's), from its parts."""
    return "/".join(parts)


TEST_T = at("tests", "test_t.py")  # a tests/ file of the throwaway repositories


def make_tree(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def scope_digests(root, files):
    """For each kind of test, the digest of what it can reach."""
    make_tree(root, files)
    inputs = results.Inputs(results.tree(root), root)
    return {"stage b": inputs.scope(at("stages", "02_b", "test_b.py"), set())[1],
            "tests/ on c": inputs.scope(TEST_T, {"03_c"})[1],
            "tests/ reading tomls": inputs.scope(TEST_T, set(),
                                                 ("stages/*/stage.toml",))[1],
            "tests/ reading the README": inputs.scope(TEST_T, set(), ("README.md",))[1],
            "tests/ on no stage": inputs.scope(TEST_T, set(), ())[1],
            "tests/": inputs.scope(TEST_T, set())[1]}


TREE = {
    ".gitignore": "/build/\n",
    at("stages", "01_a", "a.cpp"): "int a;\n",
    at("stages", "02_b", "test_b.py"): "# compiles 01_a's kernel\n",
    at("stages", "03_c", "c.cpp"): "int c;\n",
    at("stages", "03_c", "stage.toml"): "title = 'c'\n",
    at("common", "w.py"): "w = 1\n",
    TEST_T: "t = 1\n",
    at("notebooks", "n.ipynb"): "{}\n",
    "README.md": "# r\n",
    at("stages", "03_c", "README.md"): "# c\n",
}


def test_a_key_covers_what_the_test_can_reach(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    before = scope_digests(tmp_path, TREE)
    inputs = results.Inputs(results.tree(tmp_path), tmp_path)
    assert inputs.reach("02_b") == {"01_a", "02_b"}
    assert inputs.reach("01_a") == {"01_a"}

    def changed(name, text):
        after = scope_digests(tmp_path, {**TREE, name: text})
        if name not in TREE:
            (tmp_path / name).unlink()
        make_tree(tmp_path, TREE)
        return {kind for kind in before if after[kind] != before[kind]}

    outside = {"tests/ on c", "tests/ reading tomls", "tests/ reading the README",
               "tests/ on no stage", "tests/"}
    assert changed(at("stages", "01_a", "a.cpp"), "int a2;\n") == {"stage b", "tests/"}
    assert changed(at("stages", "03_c", "c.cpp"), "int c2;\n") == {"tests/ on c", "tests/"}
    assert changed(at("stages", "03_c", "stage.toml"), "title = 'C'\n") == \
        {"tests/ on c", "tests/ reading tomls", "tests/"}
    assert changed(at("stages", "01_a", "stage.toml"), "") == \
        {"stage b", "tests/ reading tomls", "tests/"}
    assert changed(at("common", "w.py"), "w = 2\n") == {"stage b", *outside}
    assert changed(TEST_T, "t = 2\n") == outside
    assert changed(at("notebooks", "n.ipynb"), "[]\n") == outside
    # Prose outside stages/ reaches the tests that read it, and those that say nothing; a
    # stage's own prose is in its folder.
    assert changed("README.md", "# R\n") == {"tests/ reading the README", "tests/"}
    assert changed(at("bench", "results", "r.md"), "") == {"tests/"}
    assert changed(at("stages", "03_c", "README.md"), "# C\n") == {"tests/ on c", "tests/"}
    assert changed(at("common", "new.py"), "") == {"stage b", *outside}  # untracked
    assert changed("build/out.so", "") == set()  # ignored by git


def test_a_stage_named_by_number_is_reached(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    make_tree(tmp_path, {at("stages", "01_a", "a.py"): "",
                         at("stages", "02_b", "t.py"): "stages.get(1)\n"})
    assert results.Inputs(results.tree(tmp_path), tmp_path).reach("02_b") == {"01_a", "02_b"}


def test_the_stages_a_text_names():
    folders = {"01_a", "02_b", "03_c", "04_d", "05_e"}
    text = "see 01_a; import_stage(2).f()\nstages.get( 3 )\nimport_stage(4, quiet=False)\n06_f"
    assert results.folders_named(text, folders) == {"01_a", "02_b", "03_c", "04_d"}
    assert results.folders_named("stage(5), get(5), 5_e", folders) == set()


def test_the_stages_a_test_names():
    def item(params, marks=()):
        return types.SimpleNamespace(
            callspec=types.SimpleNamespace(params=params),
            iter_markers=lambda name: [m for m in marks if m.name == name])

    s = stages.get(9)
    implementation = next(i for i in ops.implementations() if i.stage.number == 5)
    assert results.stages_named(item({"s": s, "n": 3})) == {s.folder}
    assert results.stages_named(item({"target": implementation})) == {"05_cuda_accessors"}
    assert results.stages_named(item({"op": "lltm"})) == set()
    assert results.stages_named(item({}, [pytest.mark.reaches("01_z2xy").mark])) == {"01_z2xy"}
    # What it reads of stages/ besides: nothing said (None: any file), nothing, or some files.
    assert results.files_read(item({"s": s})) is None
    assert results.files_read(item({}, [pytest.mark.reaches().mark])) == ()
    assert results.files_read(item({}, [pytest.mark.reads("stages/*/x", "y").mark])) == \
        ("stages/*/x", "y")


def test_the_environment_has_the_variables_that_matter_without_the_clones_path(monkeypatch):
    monkeypatch.setenv("WORKBOOK_EMULATE_SEED", "3")
    monkeypatch.setenv("WORKBOOK_BUILD_DIR", str(REPO / "build"))
    monkeypatch.setenv("WORKBOOK_CI_STEP", "test")
    variables = results.environment()["variables"]
    assert '"WORKBOOK_EMULATE_SEED": "3"' in variables
    assert '"WORKBOOK_BUILD_DIR": "<repo>/build"' in variables
    assert "WORKBOOK_CI_STEP" not in variables and str(REPO) not in variables
    first = results.environment()
    monkeypatch.setenv("WORKBOOK_EMULATE_SEED", "4")
    assert results.environment() != first


def report(nodeid, when, outcome, **extra):
    return types.SimpleNamespace(nodeid=nodeid, when=when, duration=0.5,
                                 passed=outcome == "passed", **extra)


def test_only_a_test_that_passed_whole_is_kept(tmp_path):
    config = types.SimpleNamespace(option=types.SimpleNamespace())
    plugin = results.Results(config, tmp_path)
    runs = {
        "passed": ["passed", "passed", "passed"],
        "failed": ["passed", "failed", "passed"],
        "skipped": ["skipped", None, "passed"],
        "teardown failed": ["passed", "passed", "failed"],
        "expected to fail": ["passed", "xfail", "passed"],
    }
    for name, outcomes in runs.items():
        plugin.keys[name] = hashlib.sha256(name.encode()).hexdigest()
        for when, outcome in zip(("setup", "call", "teardown"), outcomes):
            if outcome == "xfail":
                plugin.pytest_runtest_logreport(report(name, when, "skipped", wasxfail=""))
            elif outcome is not None:
                plugin.pytest_runtest_logreport(report(name, when, outcome))
    kept = {name for name in runs if plugin.store.get(hashlib.sha256(name.encode()).hexdigest())}
    assert kept == {"passed"}
    record = plugin.store.get(hashlib.sha256(b"passed").hexdigest())
    assert record["nodeid"] == "passed" and record["s"] == 1.5


def test_a_kept_result_keeps_what_its_test_leaves_for_a_later_step(tmp_path):
    config = types.SimpleNamespace(option=types.SimpleNamespace())
    plugin = results.Results(config, tmp_path / "store")
    left = tmp_path / "build" / "n.ipynb"
    left.parent.mkdir()
    left.write_text("executed")
    missing = tmp_path / "build" / "never-written.ipynb"
    keys = {name: hashlib.sha256(name.encode()).hexdigest() for name in ("left", "left nothing")}
    for name, outputs in (("left", [left]), ("left nothing", [left, missing])):
        plugin.keys[name], plugin.outputs[name] = keys[name], outputs
        for when in ("setup", "call", "teardown"):
            plugin.pytest_runtest_logreport(report(name, when, "passed"))
    # A test that did not leave what it says it leaves is not kept: it runs again next time.
    assert plugin.store.get(keys["left"]) and not plugin.store.get(keys["left nothing"])
    left.unlink()
    before = time.time()
    assert plugin.store.restore_outputs(keys["left"], [left])
    assert left.read_text() == "executed" and left.stat().st_mtime >= before - 1
    assert not plugin.store.restore_outputs(keys["left"], [left, missing])
    assert not plugin.store.restore_outputs(keys["left nothing"], [left])


# One process's turns at the store, as a collection and a run use it: read first (nothing to write
# yet, the old rows dropped: a read before a write, which failed at once as "database is locked"
# when another process committed in between), then rows kept and flushed.
WRITER = """
import sys
from pathlib import Path
from workbook.testing.pytest_results import Store
for turn in range(30):
    store = Store(Path(sys.argv[1]))
    keys = [f"{sys.argv[2]}-{turn}-{n}" for n in range(20)]
    store.get_many(keys)
    for key in keys:
        store.put(key, key, 0.1, "")
    found = store.get_many(keys)
    store.flush()
    assert not store.error, store.error
    assert set(found) == set(keys), len(found)
"""


def test_processes_side_by_side_keep_their_results(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO / "common"))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), f"p{n}"], env=env,
                              stderr=subprocess.PIPE, text=True) for n in range(6)]
    failed = [err for proc in procs for err in [proc.communicate()[1]] if proc.returncode]
    assert not failed, failed[0][-2000:]
    keys = [f"p{n}-{turn}-{k}" for n in range(6) for turn in range(30) for k in range(20)]
    assert len(results.Store(tmp_path).get_many(keys)) == len(keys)


def test_a_store_that_fails_says_so_and_runs_every_test(tmp_path):
    (tmp_path / "results.sqlite3").write_text("not a database")
    store = results.Store(tmp_path)
    assert store.get_many(["k"]) == {} and "every test runs" in store.error


def test_a_test_sees_no_results_folder():
    # Run with WORKBOOK_RESULTS set (the test below): the plugin took it from the environment,
    # so that nothing a test starts reuses a result.
    assert results.ENV not in os.environ


def test_a_second_run_reuses_and_a_changed_variable_runs_again(tmp_path):
    nodes = [f"{REPO / 'tests' / 'test_results.py'}::test_a_test_sees_no_results_folder",
             f"{REPO / 'tests' / 'test_runlog.py'}::test_stage_of_a_path_or_node_id"]

    def run(*options, **variables):
        env = {**os.environ, results.ENV: str(tmp_path / "kept"), **variables}
        env.pop(runlog.ENV, None)  # this run's counts are not the suite's
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", *options, *nodes], env=env,
                              capture_output=True, text=True, cwd=REPO)
        return done.returncode, done.stdout.strip().splitlines()[-1], done.stdout

    code, last, out = run()
    assert code == 0 and last.startswith("2 passed"), out
    code, last, out = run()
    assert code == 0 and last.startswith("2 reused"), out
    assert "[results] 2 tests reused" in out
    code, last, out = run(WORKBOOK_EMULATE_SEED="12345")
    assert code == 0 and last.startswith("2 passed"), out
    code, last, out = run("-n", "2")  # pytest-xdist: the workers reuse, the controller counts
    assert code == 0 and last.startswith("2 reused"), out
