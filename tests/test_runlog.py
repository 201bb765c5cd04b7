"""The run log (workbook.measure.runlog), which CI's closing tables read: what the builds and the
tests write to it, and the report's sums, its slowest tests and its cache hit rate."""

import json
import os
import shutil
import subprocess
import sys

from workbook.build import builder, stages
from workbook.measure import runlog


def test_nothing_is_logged_without_a_log(monkeypatch, tmp_path):
    monkeypatch.delenv(runlog.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    runlog.record("test", "t", 1.0)
    assert list(tmp_path.iterdir()) == []


def test_records_carry_the_step_and_append(monkeypatch, tmp_path):
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv(runlog.ENV, str(log))
    monkeypatch.setenv("WORKBOOK_CI_STEP", "sanitize")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_x.py::test_y[a b] (call)")
    runlog.record("build", "stage 6", 12.5, stage="06", flavour="asan")
    runlog.record("test", "a::b", 0.25, stage="06", flavour="asan")
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    runlog.record("build", "stage 7", 3.0, stage="07", flavour="asan")
    rows = runlog.read(log)
    assert [r["kind"] for r in rows] == ["build", "test", "build"]
    assert all(r["step"] == "sanitize" for r in rows)
    assert rows[0]["s"] == 12.5 and rows[0]["flavour"] == "asan"
    # A build names the test that ran it; a test's own line, or a build outside pytest, none.
    assert rows[0]["during"] == "tests/test_x.py::test_y[a b]"
    assert "during" not in rows[1] and "during" not in rows[2]


def test_stage_of_a_path_or_node_id():
    node = "stages/08_cooperating_threads/test_lltm_cooperating.py::test_y[a]"
    assert runlog.stage_of(node) == "08"
    assert runlog.stage_of("/tmp/x/exercises/09_ms_deform_attn/test_x.py") == "09"
    assert runlog.stage_of("/work/repo/tests/test_suite.py") == "tests/"
    assert runlog.stage_of("/somewhere/else.py") == "-"


def test_the_checks_flavour(monkeypatch):
    monkeypatch.delenv("WORKBOOK_RACECHECK", raising=False)
    monkeypatch.delenv("WORKBOOK_SANITIZE", raising=False)
    assert runlog.checks_flavour() is None
    monkeypatch.setenv("WORKBOOK_SANITIZE", "1")
    assert runlog.checks_flavour() == "asan"
    monkeypatch.setenv("WORKBOOK_RACECHECK", "1")
    assert runlog.checks_flavour() == "tsan"


def test_the_report_sums_steps_stages_and_names_the_slowest():
    rows = [
        {"kind": "step", "step": "test", "s": 100, "ccache_hits": 30, "ccache_misses": 10},
        {"kind": "step", "step": "sanitize", "s": 50, "ccache_hits": 10, "ccache_misses": 0},
        {"kind": "build", "step": "test", "stage": "05", "flavour": "nvcc", "what": "", "s": 40},
        {"kind": "build", "step": "sanitize", "stage": "05", "flavour": "asan", "what": "s5",
         "s": 7, "during": "tests/t.py::test_builds"},
        {"kind": "test", "step": "test", "stage": "05", "flavour": "host", "what": "fast", "s": 1},
        {"kind": "test", "step": "test", "stage": "08", "flavour": "emulated", "what": "slow",
         "s": 55},
        {"kind": "test", "step": "sanitize", "stage": "05", "flavour": "asan", "what": "mid",
         "s": 20},
        {"kind": "reused", "step": "test", "stage": "09", "flavour": "-", "what": "3 tests",
         "s": 12, "tests": 3},
    ]
    text = runlog.report(rows, slowest=2)
    steps = text.split("\n\n")[0].splitlines()
    assert steps[3].split() == ["test", "100", "40", "56", "30/10", "3"]
    assert steps[4].split() == ["sanitize", "50", "7", "20", "10/0", "0"]
    assert steps[5].split() == ["total", "150", "47", "76", "3"]
    assert "(3 tests reused, passed before on the same inputs: 12 s when they ran" in steps[6]
    per_stage = [line.split() for line in text.split("\n\n")[1].splitlines()[3:]]
    assert ["05", "asan", "7", "20", "1"] in per_stage
    assert ["08", "emulated", "0", "55", "1"] in per_stage
    slowest = text.split("slowest tests")[1].splitlines()
    assert "slow" in slowest[3] and "mid" in slowest[4] and "fast" not in text.split(
        "slowest tests")[1]
    builds = text.split("slowest builds")[1].splitlines()
    assert builds[3].split() == ["40.0", "test", "nvcc"]
    assert builds[4].split() == ["7.0", "sanitize", "asan", "s5", "tests/t.py::test_builds"]
    assert "40 hits, 10 misses (80% hits)" in text


def test_a_test_run_logs_each_test_with_its_stage(tmp_path):
    log = tmp_path / "log.jsonl"
    env = {**os.environ, runlog.ENV: str(log), "WORKBOOK_CI_STEP": "probe"}
    target = f"{stages.REPO / 'tests' / 'test_runlog.py'}::test_stage_of_a_path_or_node_id"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          target], env=env, capture_output=True, text=True, cwd=stages.REPO)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 1
    assert rows[0]["kind"] == "test" and rows[0]["step"] == "probe"
    assert rows[0]["stage"] == "tests/" and rows[0]["what"].endswith("node_id")


def test_a_build_is_logged_with_its_flavour(monkeypatch, tmp_path):
    monkeypatch.delenv("WORKBOOK_RACECHECK", raising=False)
    monkeypatch.delenv("WORKBOOK_SANITIZE", raising=False)
    assert builder._flavour(stages.get(1)) == "host"
    assert builder._flavour(stages.get(5).cpu_only_build()) == "cpu-only"
    copy = tmp_path / stages.get(1).folder  # a carved copy sits outside stages/
    shutil.copytree(stages.get(1).source_dir, copy)
    assert builder._flavour(stages.read(copy)) == "exercise"
    monkeypatch.setenv("WORKBOOK_SANITIZE", "1")
    assert builder._flavour(stages.get(1)) == "asan"
