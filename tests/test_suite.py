"""The test suite's runner (workbook.testing.suite): which parts run side by side, in what order,
with how many threads, and what a failing part reports. Real pytest processes on tiny test files."""

import json
import subprocess
import sys

import pytest

from workbook.testing import suite


def part(label, alone=False):
    return suite.Part(label, [], alone=alone)


def test_the_longest_part_starts_first_and_a_part_to_run_alone_ends_the_run():
    parts = [part("stage 1"), part("stage 2"), part("tests/"), part("notebooks", alone=True)]
    last = {"stage 1": 5.0, "stage 2": 100.0, "tests/": 40.0, "notebooks": 900.0}
    assert [p.label for p in suite.schedule(parts, last)] == \
        ["stage 2", "tests/", "stage 1", "notebooks"]
    # Not timed yet: later parts first (tests/, then the stages newest first), before timed ones.
    assert [p.label for p in suite.schedule(parts, {"stage 2": 100.0})] == \
        ["tests/", "stage 1", "stage 2", "notebooks"]


def test_make_test_runs_the_timed_notebooks_alone_with_the_same_markers_as_tests():
    parts = suite.parts_for(["all"])
    alone = [p for p in parts if p.alone]
    assert [p.paths for p in alone] == [[suite.NOTEBOOKS_TEST]]
    # The untimed notebooks run in a part of their own, beside the others; not again alone.
    beside = [p for p in parts if not p.alone and p.paths == [suite.NOTEBOOKS_TEST]]
    assert beside[0].options[-2:] == ["-k", suite.UNTIMED_NOTEBOOKS]
    assert alone[0].options[-2:] == ["-k", f"not ({suite.UNTIMED_NOTEBOOKS})"]
    tests = [p for p in parts if suite.REPO / "tests" in p.paths]
    assert len(tests) == 1 and str(suite.NOTEBOOKS_TEST) in tests[0].options
    for p in parts[-3:]:
        assert " ".join(suite.TESTS_OPTIONS) in " ".join(p.options)


@pytest.mark.parametrize(("value", "cores", "jobs"), [("", 2, 2), ("", 1, 1), ("", 16, 3),
                                                      ("1", 2, 1), ("4", 2, 4)])
def test_the_parts_at_a_time(monkeypatch, value, cores, jobs):
    monkeypatch.setenv("WORKBOOK_TEST_JOBS", value)
    assert suite.parts_at_a_time(cores) == jobs


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_number_of_parts_at_a_time_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("WORKBOOK_TEST_JOBS", value)
    with pytest.raises(ValueError, match="WORKBOOK_TEST_JOBS must be a whole number"):
        suite.parts_at_a_time(2)


TIMED = """
import os, time
from pathlib import Path

def test_{name}():
    start = time.time()
    time.sleep({sleep})
    Path(r"{log}").with_suffix(".{name}").write_text(
        f"{{start}} {{time.time()}} {{os.environ.get('OMP_NUM_THREADS')}}")
    assert {passes}
"""


def test_parts_run_side_by_side_and_each_reports_its_own_outcome(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORKBOOK_BUILD_DIR", str(tmp_path / "build"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    log = tmp_path / "times"
    files = {}
    for name, sleep, passes in [("a", 2, True), ("b", 2, False), ("alone", 0, True)]:
        files[name] = tmp_path / f"test_{name}.py"
        files[name].write_text(TIMED.format(name=name, sleep=sleep, log=log, passes=passes))
    parts = [suite.Part("a", [files["a"]]), suite.Part("b", [files["b"]]),
             suite.Part("alone", [files["alone"]], alone=True)]
    suite.run_side_by_side(parts, ["-p", "no:cacheprovider"], jobs=2, cores=2)
    a, b, alone = parts
    assert a.ok and not b.ok and alone.ok
    assert "1 passed" in a.summary and "1 failed" in b.summary
    printed = capsys.readouterr().out
    # Each part's output whole, under its own header: b's failure is in b's block.
    block_b = printed.split("===== b:")[1].split("[test] =====")[0]
    assert "assert False" in block_b
    times = {n: log.with_suffix(f".{n}").read_text().split() for n in ("a", "b", "alone")}
    a_start, a_end, a_threads = times["a"]
    b_start, b_end, _ = times["b"]
    assert float(a_start) < float(b_end) and float(b_start) < float(a_end), "not side by side"
    assert float(times["alone"][0]) >= max(float(a_end), float(b_end)), "alone ran beside others"
    assert a_threads == "1"  # 2 cores shared by 2 parts
    assert times["alone"][2] == "None"  # alone, torch's own count: every core
    suite._save_times(parts)
    assert set(json.loads((tmp_path / "build" / suite.TIMES).read_text())) == {"a", "b", "alone"}


def test_the_test_processes_keep_freed_memory_unless_told_otherwise():
    env = suite.env_for_pytest({"PATH": "/bin"})
    assert env["MALLOC_MMAP_MAX_"] == "0" and env["PYTHONUNBUFFERED"] == "1"
    assert int(env["MALLOC_TRIM_THRESHOLD_"]) >= 1 << 30
    for own in ({"MALLOC_ARENA_MAX": "2"}, {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}):
        env = suite.env_for_pytest({"PATH": "/bin", **own})
        assert "MALLOC_MMAP_MAX_" not in env and own.items() <= env.items()


def test_the_alone_part_does_not_run_the_untimed_notebooks_again():
    # pytest itself says which tests each part's options select: the -k expressions must match.
    def collected(part):
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                               *map(str, part.paths), *part.options], cwd=suite.REPO,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    parts = [p for p in suite.parts_for(["all"]) if p.paths == [suite.NOTEBOOKS_TEST]]
    alone, beside = collected(parts[1]), collected(parts[0])
    assert parts[1].alone and not parts[0].alone
    assert "test_notebooks_execute[timed-01_z2xy]" in alone
    assert "test_notebooks_execute[untimed-" not in alone
    assert "test_notebooks_execute[untimed-" in beside
    assert "test_notebooks_execute[timed-" not in beside
