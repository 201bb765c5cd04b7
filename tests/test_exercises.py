"""The exercises carved from the stages (workbook.teaching.exercises): the markers, carving and
putting the solutions back, the check's report; and, marked `exercises` (make test-exercises,
minutes), every stage carved for real: the copy builds, and fails the tests of its exercises.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbook import testing
from workbook.build import stages, toolkit
from workbook.teaching import exercises, pytest_gate
from workbook.teaching.notebook import pythonpath_with_common

REPO = stages.REPO
STAGES = stages.all_stages()

# The exercise names the notebooks refer to, per stage folder.
NAMES = {
    "01_z2xy": ["z2xy-backward"],
    "02_lltm_cpp": ["lltm-forward", "lltm-backward"],
    "03_jit": ["jit-load"],
    "04_cuda_raw": ["cuda-forward-kernel", "cuda-backward-kernel", "cuda-launch"],
    "05_cuda_accessors": ["cpu-fused-kernel", "accessor-kernel", "library-registration"],
    "06_op_library": ["bilinear-sample", "bilinear-gradient"],
    "07_cuda_library": ["deform-cuda-sampling"],
    "08_cooperating_threads": ["tile-loop", "block-tree", "warp-shuffle"],
    "09_ms_deform_attn": ["msda-corner-blend", "msda-warp-sum"],
}


def stage_ids(s):
    return s.folder


# ----------------------------------------------------------------------------------------------
# The markers


@pytest.mark.parametrize("s", STAGES, ids=stage_ids)
def test_every_stage_marks_exercises(s):
    found = exercises.find(s)  # raises on unbalanced, nested or misspelt markers
    assert found, f"{s.label} marks no exercise: put `// EXERCISE <name>: <task>` ... " \
                  f"`// END EXERCISE <name>` around the code a learner should write"
    if s.folder in NAMES:
        assert [e.name for e in found] == NAMES[s.folder]


def test_exercise_names_are_unique_across_the_workbook():
    seen = {}
    for s in STAGES:
        for e in exercises.find(s):
            assert e.name not in seen, f"{e.name} is an exercise of {seen[e.name]} and {s.label}"
            seen[e.name] = s.label


@pytest.mark.parametrize("s", STAGES, ids=stage_ids)
def test_the_tests_named_for_each_exercise_exist(s):
    for e in exercises.find(s):
        for test in e.checked_by:
            file, _, function = test.partition("::")
            path = s.source_dir / file
            assert path.is_file(), f"{e.name}: checked by {test}, but {path} is missing"
            if function:
                assert f"def {function}(" in path.read_text(), (
                    f"{e.name}: checked by {test}, but {file} has no {function}")


@pytest.mark.parametrize("s", STAGES, ids=stage_ids)
def test_exercise_files_leave_torch_extension_h_to_the_bindings(s):
    # `make verify N` after an edit recompiles the edited file alone. torch/extension.h (pybind11
    # and all of libtorch, over half a minute to compile on 2 cores) belongs in a file of its own
    # that the learner does not edit, as in stage 01 (csrc/bindings.cpp).
    for path in sorted({e.path for e in exercises.find(s) if e.comment == "//"}):
        assert "#include <torch/extension.h>" not in path.read_text(), (
            f"{path.relative_to(REPO)} holds an exercise and includes torch/extension.h: every "
            f"edit of it recompiles that header; move the bindings to a file of their own")


def parse_error(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(exercises.ExerciseError) as error:
        exercises.parse(text, path)
    return str(error.value)


def test_unreadable_markers_are_refused_saying_where(tmp_path):
    body = "  int x = 1;\n"
    assert ":2: `END EXERCISE a` without" in parse_error(
        tmp_path, "a.cpp", "int f() {\n  // END EXERCISE a\n}\n")
    assert ":1: exercise 'a' has no `END EXERCISE a`" in parse_error(
        tmp_path, "b.cpp", "// EXERCISE a: do it\n" + body)
    assert "starts inside exercise 'a'" in parse_error(
        tmp_path, "c.cpp", "// EXERCISE a: x\n// EXERCISE b: y\n" + body)
    assert "closes exercise 'a'" in parse_error(
        tmp_path, "d.cpp", "// EXERCISE a: x\n" + body + "// END EXERCISE b\n")
    assert "marks exercises with `//`, got `#`" in parse_error(
        tmp_path, "e.cpp", "# EXERCISE a: x\n" + body + "# END EXERCISE a\n")
    assert "a marker must read" in parse_error(tmp_path, "f.py", "# EXERCISE a\nx = 1\n")
    assert "is empty" in parse_error(tmp_path, "g.py", "# EXERCISE a: x\n# END EXERCISE a\n")
    assert "marked 2 times" in parse_error(
        tmp_path, "h.py", "# EXERCISE a: x\nx = 1\n# END EXERCISE a\n" * 2)
    assert "indented like" in parse_error(
        tmp_path, "i.py", "    # EXERCISE a: x\n    x = 1\n# END EXERCISE a\n")


# ----------------------------------------------------------------------------------------------
# Carving and putting back


def files_of(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not exercises._skipped(p.relative_to(folder))}


def solution_lines(e, *others):
    """The lines of e's solution found nowhere else in its file, nor in `others` (texts): code a
    lesson that shows them gives away."""
    lines = e.path.read_text().splitlines()
    rest = [*lines[:e.body], *lines[e.end:], *(ln for t in others for ln in t.splitlines())]
    rest = {ln.strip() for ln in rest}
    return [ln.strip() for ln in lines[e.body:e.end]
            if len(ln.strip()) > 8 and not ln.strip().startswith(("//", "#"))
            and ln.strip() not in rest]


def lines_of(text, margin=0):
    """Each line stripped, `margin` characters (a diff's +, - or space) cut first."""
    return {line[margin:].strip() for line in text.splitlines()}


WITH_EXERCISES = [s for s in STAGES if exercises.find(s)]


@pytest.mark.parametrize("s", WITH_EXERCISES, ids=stage_ids)
def test_the_lesson_shows_each_task_and_folds_its_solution(s):
    from workbook.teaching import notebook

    pairs = {s.source_dir.parent / after: s.source_dir.parent / before
             for before, after in s.lesson}
    diff = stages.lesson_diff(s)
    for e in exercises.find(s):
        shown = notebook.excerpt(e.path).text  # what show_source shows of the whole file
        hidden = solution_lines(e)
        assert hidden, f"{e.name}: no line of its solution to look for"
        for line in hidden:
            assert line not in lines_of(shown), f"{e.name}: show_source gives away {line!r}"
        assert f"REVEAL={e.name}`" in shown and e.task in shown
        if e.path in pairs:  # the book's lesson diff and `make diff N`
            for line in solution_lines(e, pairs[e.path].read_text()):
                assert line not in lines_of(diff, 1), f"{e.name}: make diff {s.number} gives " \
                                                      f"away {line!r}"
            assert f"REVEAL={e.name}`" in diff
    in_lesson = [e for e in exercises.find(s) if e.path in pairs]
    if in_lesson:  # SOLUTIONS=1 shows them
        unfolded = stages.lesson_diff(s, solutions=True)
        assert any(line in lines_of(unfolded, 1) for e in in_lesson for line in solution_lines(e))


@pytest.mark.parametrize("s", STAGES, ids=stage_ids)
def test_carving_then_restoring_gives_the_stage_back_byte_for_byte(s, tmp_path):
    work = exercises.carve(s, tmp_path / s.folder, quiet=True)
    original, carved = files_of(s.source_dir), files_of(work)
    assert carved.keys() == original.keys()
    found = exercises.find(s)
    changed = {e.relpath for e in found}
    for name, data in original.items():
        if name not in changed:
            assert carved[name] == data, f"{name} holds no exercise but was changed"
            continue
        text = carved[name].decode()
        assert text != data.decode()
        for e in found:
            if e.relpath == name:
                body = exercises.region_body(text, work / name, e.name)
                assert f"TODO(exercise {e.name})" in body
                assert exercises.region_body(data.decode(), s.source_dir / name, e.name) not in (
                    body, "")
        # Un-carving with the stage's text, file by file ...
        restored = exercises.restore_text(text, data.decode(), work / name)
        assert restored.encode() == data
    # ... and `reveal`, one exercise at a time, on the copy itself.
    for e in found:
        assert exercises.reveal(s, [e.name], work=work) == [e.name]
    assert files_of(work) == original


def test_the_todo_fails_the_way_the_code_runs():
    """Host code raises naming the exercise, Python raises NotImplementedError, a CUDA kernel's
    body is left empty on a GPU (a kernel cannot raise) and raises on the emulated CUDA device
    (host code); a host function keeps no unreachable return."""
    kinds = {}
    for s in STAGES:
        for e in exercises.find(s):
            lines = "".join(exercises.stub(e))
            if e.comment == "#":
                kinds[e.name] = "python"
                assert "raise NotImplementedError(" in lines
            else:
                kinds[e.name] = exercises.context(e)
            assert f"TODO(exercise {e.name})" in lines
    assert kinds["z2xy-backward"] == ("host", True)
    assert kinds["cuda-launch"] == ("host", True)
    assert kinds["cuda-forward-kernel"] == ("device", False)
    assert kinds["accessor-kernel"] == ("device", False)
    assert kinds["deform-cuda-sampling"] == ("device", False)
    assert kinds["cpu-fused-kernel"] == ("host", False)
    assert kinds["bilinear-sample"] == ("host", False)  # a lambda inside cpu::parallel_for
    assert kinds["library-registration"] == "python"
    for name in ("cuda-forward-kernel", "deform-cuda-sampling"):
        e = next(e for s in STAGES for e in exercises.find(s) if e.name == name)
        stub = "".join(exercises.stub(e))
        assert "#if defined(WORKBOOK_EMULATED_CUDA)\n" in stub and "TORCH_CHECK(false," in stub


def fake_stage(tmp_path, files):
    folder = tmp_path / "09_fake"
    folder.mkdir()
    (folder / "stage.toml").write_text('title = "t"\npackage = "fake"\nops = []\nbuild = "setup"\n')
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return stages.read(folder)


def test_host_device_code_raises_on_the_host_and_returns_on_the_device(tmp_path):
    header = ("#pragma once\nnamespace w {\ntemplate <typename T>\nstruct S {\n  T ly;\n"
              "  WORKBOOK_HOST_DEVICE T weight(int c) const {\n"
              "    // EXERCISE weight: the weight of corner c\n"
              "    return c ? ly : T(1) - ly;\n    // END EXERCISE weight\n  }\n};\n}\n")
    kernel = ("namespace {\ntemplate <typename T>\n__global__ void __launch_bounds__(256)\n"
              "    k(T* out) {\n  for (int i = 0; i < 4; ++i) {\n"
              "    // EXERCISE k-body: out[i]\n    out[i] = T(i);\n    // END EXERCISE k-body\n"
              "  }\n}\n}  // namespace\n")
    outside = "// EXERCISE loose: not in a function\nint x = 1;\n// END EXERCISE loose\n"
    s = fake_stage(tmp_path, {"csrc/s.h": header, "csrc/k.cu": kernel})
    weight, body = sorted(exercises.find(s), key=lambda e: e.name, reverse=True)
    assert exercises.context(weight) == ("host_device", True)
    stub = "".join(exercises.stub(weight))
    assert "#if !defined(__CUDA_ARCH__)\n" in stub and "TORCH_CHECK(false," in stub
    assert stub.endswith("#endif\n    return {};\n")
    assert exercises.context(body) == ("device", False)
    stub = "".join(exercises.stub(body))
    assert body.gpu_only and stub.startswith("    // TODO(exercise k-body)")
    assert "#if defined(WORKBOOK_EMULATED_CUDA)\n" in stub and stub.endswith("#endif\n")
    (s.source_dir / "csrc" / "loose.cpp").write_text(outside)
    loose = exercises.get(s, "loose")
    with pytest.raises(exercises.ExerciseError, match=r"loose.cpp:1: exercise 'loose' is not "
                                                      r"inside a function body"):
        exercises.context(loose)


def test_a_new_stage_marks_its_kernel_as_an_exercise(tmp_path):
    template = REPO / "scripts" / "new_stage" / "csrc" / "cpu" / "op_cpu.cpp.tmpl"
    text = template.read_text().replace("{{op}}", "scale_add").replace("{{NN}}", "09")
    s = fake_stage(tmp_path, {"csrc/cpu/scale_add_cpu.cpp": text})
    (e,) = exercises.find(s)
    assert e.name == "scale_add-cpu-kernel" and exercises.context(e) == ("host", False)


def test_carve_refuses_to_replace_a_copy_unless_reset(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORKBOOK_BUILD_DIR", str(tmp_path / "build"))
    s = stages.get(1)
    work = exercises.carve(s, tmp_path / "work", quiet=True)
    mine = work / "csrc" / "z2xy.cpp"
    mine.write_text(mine.read_text() + "// my work\n")
    with pytest.raises(FileExistsError, match=r"exists already \(your work\).*make exercise 1 "
                                              r"RESET=1"):
        exercises.carve(s, work, quiet=True)
    exercises.carve(s, work, reset=True)
    assert "// my work" not in mine.read_text()
    kept = tmp_path / "build" / "exercises" / s.folder / "previous" / "csrc" / "z2xy.cpp"
    assert kept.read_text().endswith("// my work\n")
    out = capsys.readouterr().out
    assert "previous copy is kept in" in out and f"diff -ru stages/{s.folder}" in out


def test_sync_writes_only_what_changed(tmp_path):
    source, target = tmp_path / "a", tmp_path / "b"
    (source / "csrc").mkdir(parents=True)
    (source / "csrc" / "x.cpp").write_text("one")
    (source / "y.py").write_text("two")
    (source / "__pycache__").mkdir()
    (source / "__pycache__" / "y.pyc").write_text("junk")
    exercises._sync(source, target)
    assert files_of(target) == {"csrc/x.cpp": b"one", "y.py": b"two"}
    assert not (target / "__pycache__").exists()
    old = time.time() - 1000
    os.utime(target / "y.py", (old, old))
    (source / "csrc" / "x.cpp").write_text("three")
    (source / "y.py").unlink()
    (source / "z.h").write_text("four")
    exercises._sync(source, target)
    assert files_of(target) == {"csrc/x.cpp": b"three", "z.h": b"four"}
    (source / "z.h").write_text("four")
    os.utime(target / "z.h", (old, old))
    exercises._sync(source, target)  # same bytes: left alone, mtime and all
    assert (target / "z.h").stat().st_mtime == pytest.approx(old)


def junit(tmp_path, cases, file="test_lltm_cpp.py"):
    rows = []
    for name, outcome, message in cases:
        child = {"failed": f'<failure message="{message}">trace</failure>',
                 "skipped": f'<skipped message="{message}"/>', "passed": ""}[outcome]
        rows.append(f'<testcase classname="{file[:-3]}" name="{name}" file="{file}" line="1">'
                    f'{child}</testcase>')
    path = tmp_path / "report.xml"
    path.write_text(f'<testsuites><testsuite name="pytest">{"".join(rows)}</testsuite>'
                    f'</testsuites>')
    return exercises._read_junit(path)


def test_the_summary_names_what_fails(tmp_path, capsys):
    s = stages.get(2)
    work = exercises.carve(s, tmp_path / s.folder, quiet=True)
    exercises.reveal(s, ["lltm-forward"], work=work)
    todo = "RuntimeError: exercise lltm-backward is not done yet: the 5 gradients"
    results = [
        ("test_against_reference[cpu-float32-b1]", "passed", ""),
        ("test_against_reference[cpu-float32-b2]", "failed", todo),
        ("test_gradcheck[cpu-float64-b1]", "failed", todo),
        ("test_forward_records_nothing_without_grad[cpu]", "passed", ""),
        ("test_layouts[strided]", "passed", ""),
        ("test_bad_input[cpu-x]", "failed", "AssertionError: wrong message"),
    ]
    report = exercises.Report(s, True, junit(tmp_path, results))
    exercises._summarise(report, exercises.find(s), work, 1.0)
    out = capsys.readouterr().out
    # The forward's tests fail only at the backward's TODO: nothing against the forward yet.
    assert report.status == {"lltm-forward": "waiting", "lltm-backward": "TODO"}
    assert report.exit_code == 1
    assert "3 failed, 3 passed, 0 skipped" in out
    assert "stop at the TODO of lltm-backward" in out
    assert "test_gradcheck (1 of 1 failed): gradients against finite differences" in out
    assert f"e.g. test_gradcheck[cpu-float64-b1]: {todo}" in out
    assert "failing beyond the exercises' own tests: test_bad_input" in out
    assert "NOT DONE: lltm-backward (lltm-forward: no failure of its own so far)" in out

    results[4] = ("test_layouts[strided]", "failed", "AssertionError: output 0 differs")
    report = exercises.Report(s, True, junit(tmp_path, results))
    exercises._summarise(report, exercises.find(s), work, 1.0)
    assert report.status["lltm-forward"] == "FAILS"
    assert "NOT DONE: lltm-forward, lltm-backward." in capsys.readouterr().out

    exercises.reveal(s, work=work)
    report = exercises.Report(s, True, junit(tmp_path, [
        ("test_against_reference[cpu]", "passed", ""), ("test_gradcheck[cpu]", "passed", ""),
        ("test_layouts[strided]", "passed", "")]))
    exercises._summarise(report, exercises.find(s), work, 1.0)
    assert report.status == {"lltm-forward": "ok", "lltm-backward": "ok"}
    assert report.exit_code == 0 and "DONE: every exercise" in capsys.readouterr().out


def test_the_summary_shows_the_detail_a_heading_introduces(tmp_path, capsys):
    """The first line of a check's message may end at a colon; the line after it says what is
    wrong (which output, how far, against what tolerance)."""
    s = stages.get(2)
    work = exercises.carve(s, tmp_path / s.folder, quiet=True)
    detail = "output new_h: max |error| 0.19 (0.341 of its largest value) exceeds rtol=1e-05"
    message = "AssertionError: against the float64 reference:&#10;" + detail + "&#10;more"
    report = exercises.Report(s, True, junit(tmp_path, [
        ("test_against_reference[cpu-float32-b1]", "failed", message)]))
    exercises._summarise(report, exercises.find(s), work, 1.0)
    assert (f"e.g. test_against_reference[cpu-float32-b1]: AssertionError: against the float64 "
            f"reference: {detail}\n") in capsys.readouterr().out


def test_an_error_larger_than_the_value_is_told_in_times():
    """The detail tells an error as a share of the largest expected value, and as a multiple
    where it outgrows it: "17 times its largest value", not "17 of" it."""
    import torch

    from workbook import spec

    def told(share: float) -> str:
        difference = spec.Difference("output new_h", 0.116, share, ok=False)
        return spec.Comparison((difference,), (1e-7, 1e-7), torch.float64).failures()[0]

    assert "max |error| 0.116 (0.341 of its largest value) exceeds" in told(0.341)
    assert "max |error| 0.116 (17 times its largest value) exceeds" in told(17.0)


def test_verify_only_one_exercise_runs_the_tests_that_check_it(tmp_path, monkeypatch, capsys):
    """`make verify N ONLY=name`: the pytest run is given that exercise's tests alone, and the
    summary speaks of it alone (no build or test run here: the commands are recorded)."""
    s = stages.get(2)
    work = exercises.carve(s, tmp_path / s.folder, quiet=True)
    commands = []

    class Ended:  # the pytest process, as _start returns it, already done
        def poll(self):
            return 0

    monkeypatch.setattr(exercises, "_stream", lambda cmd, *a, **k: commands.append(cmd) or 0)
    monkeypatch.setattr(exercises, "_start", lambda cmd, *a, **k: commands.append(cmd) or Ended())
    monkeypatch.setattr(exercises, "_follow", lambda proc, *a, **k: 0)
    monkeypatch.setattr(exercises, "_read_junit", lambda path: [])
    chosen = next(e for e in exercises.find(s) if e.name == "lltm-forward")
    exercises.verify(s, work, base=tmp_path / "base", only="lltm-forward")
    out = capsys.readouterr().out
    pytest_cmd = next(c for c in commands if "pytest" in c)
    targets = [a for a in pytest_cmd if a.startswith(str(tmp_path / "base")) and "::" in a]
    assert targets and len(targets) == len(set(chosen.checked_by))
    assert all(any(t.endswith(c) for c in chosen.checked_by) for t in targets)
    assert "only lltm-forward" in out and "lltm-backward" not in out.split("only lltm")[1]
    with pytest.raises(exercises.ExerciseError, match=r"no exercise 'lltm-sideways'; its "
                                                      r"exercises: lltm-forward, lltm-backward"):
        exercises.verify(s, work, base=tmp_path / "base", only="lltm-sideways")


def cooperating_stage():
    """The stage whose exercises are kernels that cooperate (barriers, shared memory)."""
    return next(s for s in STAGES if any(e.name == "tile-loop" for e in exercises.find(s)))


def test_a_race_in_an_exercise_marks_it_and_waits_the_others(tmp_path, capsys):
    """A race racecheck found in an exercise's lines: that exercise is RACE, whatever its tests
    said, and the others, whose tests run through its kernel, wait for it."""
    from workbook.net.racecheck import Race

    s = cooperating_stage()
    work = exercises.carve(s, tmp_path / s.folder, quiet=True)
    exercises.reveal(s, work=work)
    tile = exercises.get(s, "tile-loop")
    path = f"exercises/{s.folder}/{tile.relpath}"
    race = Race("matmul_tiled_kernel", [("read", path, tile.start + 6),
                                        ("previous write", path, tile.start + 3)], "the report")
    report = exercises.Report(s, True, junit(tmp_path, [
        ("test_against_reference[emulated_cuda-float32-b1]", "passed", ""),
        ("test_tiles_that_do_not_fill[emulated_cuda-float32-b17]", "passed", ""),
        ("test_bias_gradient_sums_every_row", "failed", "AssertionError: not close")],
        file="test_lltm_cooperating.py"), races=[race])
    exercises._summarise(report, exercises.find(s), work, 1.0)
    out = capsys.readouterr().out
    assert report.status == {"tile-loop": "RACE", "block-tree": "waiting",
                             "warp-shuffle": "waiting"}
    assert report.exit_code == 1
    assert (f"racecheck: a data race in `matmul_tiled_kernel`: read at {path}:{tile.start + 6} "
            f"and previous write at {path}:{tile.start + 3}, no barrier between them") in out
    assert "its tests may fail through the race in tile-loop: fix that first" in out
    assert "NOT DONE: tile-loop" in out


def test_a_failure_is_pinned_on_an_exercise_only_by_a_test_of_its_own(tmp_path, capsys):
    """Stage 04's three kernels share test_against_reference. A fault in the forward fails it,
    and the forward's own test_matches_the_cpu_extension_of_stage_02: the forward FAILS, and the
    backward and the launch, whose failing tests the forward shares, wait for it. A failure of a
    shared test alone marks each exercise that shares it, saying so."""
    s = stages.get(4)
    work = exercises.carve(s, tmp_path / s.folder, quiet=True)
    exercises.reveal(s, work=work)
    wrong = "AssertionError: against the float64 reference:&#10;output new_h: max |error| 0.4"

    def summarise(failing):
        tests = ["test_against_reference", "test_matches_the_cpu_extension_of_stage_02",
                 "test_edge_cases", "test_gradcheck"]
        report = exercises.Report(s, True, junit(tmp_path, [
            (f"{t}[emulated_cuda-float32-b1]", "failed" if t in failing else "passed",
             wrong if t in failing else "") for t in tests], file="test_lltm_cuda_raw.py"))
        exercises._summarise(report, exercises.find(s), work, 1.0)
        return report, capsys.readouterr().out

    forward, backward, launch = (e.name for e in exercises.find(s))
    report, out = summarise({"test_against_reference", "test_matches_the_cpu_extension_of_stage_02",
                             "test_edge_cases"})
    assert report.status == {forward: "FAILS", backward: "waiting", launch: "waiting"}
    assert "its tests passing: test_against_reference 0/1, test_gradcheck 1/1" in out
    assert f"(its failing tests check {forward} too, which fails a test of its own: fix that " \
           f"first)" in out
    assert report.exit_code == 1 and f"NOT DONE: {forward} ({backward}, {launch}: no " in out

    report, out = summarise({"test_against_reference"})
    assert set(report.status.values()) == {"FAILS"}
    assert f"(its failing tests check {backward}, {launch} too: any of them may be wrong)" in out

    report, out = summarise({"test_gradcheck"})
    assert report.status == {forward: "ok", backward: "FAILS", launch: "ok"}
    assert "may be wrong" not in out


def test_a_gpu_exercise_not_run_here_is_said_so(tmp_path, capsys):
    s = stages.get(4)
    work = exercises.carve(s, tmp_path / s.folder, quiet=True)
    exercises.reveal(s, work=work)
    report = exercises.Report(s, True, junit(tmp_path, [
        ("test_against_reference[cuda]", "skipped", "no CUDA device visible"),
        ("test_edge_cases[cuda]", "skipped", "no CUDA device visible"),
        ("test_gradcheck[cuda]", "skipped", "no CUDA device visible")],
        file="test_lltm_cuda_raw.py"))
    exercises._summarise(report, exercises.find(s), work, 1.0)
    out = capsys.readouterr().out
    assert set(report.status.values()) == {"not run here"} and report.exit_code == 0
    assert "(skipped: no CUDA device visible)" in out and "could not be run here" in out


# ----------------------------------------------------------------------------------------------
# The command line and the Makefile


def run(*args, **kwargs):
    return subprocess.run(list(args), cwd=REPO, capture_output=True, text=True, timeout=120,
                          **kwargs)


def test_the_command_line_lists_and_refuses_clearly(tmp_path):
    listed = run(sys.executable, "-m", "workbook.teaching.exercises", "list", "2")
    assert listed.returncode == 0 and "lltm-forward" in listed.stdout, listed.stderr
    assert "checked by test_lltm_cpp.py: test_against_reference" in listed.stdout
    unknown = run(sys.executable, "-m", "workbook.teaching.exercises", "carve", "42")
    assert unknown.returncode == 2 and "unknown stage '42'" in unknown.stderr
    env = dict(os.environ, WORKBOOK_BUILD_DIR=str(tmp_path))
    if not exercises.work_copy(stages.get(7)).exists():
        missing = run(sys.executable, "-m", "workbook.teaching.exercises", "verify", "7", env=env)
        assert missing.returncode == 2 and "`make exercise 7` makes one" in missing.stderr


def test_make_help_lists_the_exercise_targets():
    out = run("make", "-s", "help").stdout
    for target in ("make exercise N", "make verify N", "make test-exercises"):
        assert target in out, f"make help does not mention {target}"


def test_make_test_leaves_the_exercise_tests_to_make_test_exercises():
    from workbook.testing import suite

    options = suite.parts_for(["all"])[-1].options
    assert "not exercises" in " ".join(options) and "not template" in " ".join(options)


# ----------------------------------------------------------------------------------------------
# Every stage carved for real (make test-exercises)


@pytest.mark.exercises
@pytest.mark.parametrize("s", STAGES, ids=stage_ids)
def test_a_carved_stage_builds_and_fails_its_exercises_tests(s, tmp_path):
    """Carve the stage, build the copy as `make verify` does and run the tests of every exercise
    this machine can run: each must fail (the TODOs really remove the work). Exercises carved
    together may fail through one another (the LLTM backward needs its forward): each must fail,
    whatever the cause, and some failure must name an exercise.

    Without a GPU the exercises in CUDA files run on the emulated CUDA device (the copy's .cu
    compiled for the CPU; the copy itself is built CPU-only, as `make verify` does then). With
    WORKBOOK_CUDA=off and no GPU they cannot run: the build compiles them, or, where no exercise
    runs here at all, the carved CUDA files are compiled alone (the stage's other files are its
    own, which `make test` builds); then the test is skipped, naming the missing GPU. A stage
    whose exercises are all on the CPU builds CPU-only."""
    work = exercises.carve(s, tmp_path / "exercises" / s.folder, quiet=True)
    found = exercises.find(s)
    runnable = [e for e in found if not e.gpu_only or testing.NO_CUDA is None]
    not_here = [e for e in found if e not in runnable]
    nvcc = toolkit.find() is not None
    if runnable:
        cpu_only = s.cuda and s.cpu_fallback and testing.NO_CUDA is not None and not not_here
        base = stages.empty_build_folder("test-exercises", s.folder)
        report = exercises.verify(s, work, base=base,
                                 tests=[t for e in runnable for t in e.checked_by],
                                 env={"WORKBOOK_NO_CUDA": "1"} if cpu_only else None)
        assert report.built, f"the carved copy of {s.label} does not build"
        assert report.exit_code == 1
        named = [r for r in report.failed() if "is not done yet" in r.message]
        assert named, f"no failure of {s.label}'s carved copy names an exercise"
        for e in runnable:
            assert report.status[e.name] == "TODO"
            failed = [r for r in report.failed() if r.function in e.checked_by]
            assert failed, f"{e.name}: carved out, yet none of its tests fails"
    elif not_here and nvcc:
        started = time.perf_counter()
        compiled = exercises.compile_carved(work, s, tmp_path / "compiled")
        # a kernel header's exercises compile through the .cu beside it, which includes it
        assert {p.name for p in compiled} == {Path(e.relpath).with_suffix(".cu").name
                                              for e in not_here}
        print(f"[test] {s.label}: compiled {', '.join(p.name for p in compiled)} alone "
              f"in {time.perf_counter() - started:.0f} s")
    if not_here:
        done = "compiled" if nvcc else f"not even compiled ({toolkit.reason()})"
        pytest.skip(f"{', '.join(e.name for e in not_here)} {done} but not run: the tests of "
                    f"CUDA code need a GPU ({testing.NO_CUDA})")


def test_a_signal_is_told_with_what_it_means_for_a_kernel():
    assert exercises._signal_of(-6) == exercises._signal_of(134) == "SIGABRT"
    assert exercises._signal_of(-11) == "SIGSEGV"
    assert all(exercises._signal_of(code) is None for code in (0, 1, 2, 5, 128))
    s = stages.get(4)
    words = exercises._crash_words(s, -11, "test_x.py::test_y[cuda-b1]", sanitized=False)
    assert "died of SIGSEGV (a read or write of memory the process does not have) while " \
           "running test_x.py::test_y[cuda-b1]." in words
    assert "index out of bounds" in words
    assert "`make verify 4 SANITIZE=1 TEST='test_x.py::test_y[cuda-b1]'`" in words
    assert "before any test started" in exercises._crash_words(s, -6, None, sanitized=False)


@pytest.mark.reaches()
@pytest.mark.parametrize("word", [pytest_gate.GO, "not run: the copy did not build"])
def test_the_tests_wait_at_the_gate_until_the_build_says(tmp_path, word):
    """make verify starts pytest before the copy is built (workbook.teaching.pytest_gate): nothing
    is collected until the gate says `go`; any other word ends the run with no test run."""
    collected = tmp_path / "collected"  # written when pytest imports the test file
    (tmp_path / "test_one.py").write_text(f"open({str(collected)!r}, 'w').close()\n\n\n"
                                          "def test_one():\n    pass\n")
    gate = tmp_path / "gate"
    env = dict(os.environ, **{pytest_gate.ENV: str(gate)})
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-p", "workbook.teaching.pytest_gate", "--rootdir", str(tmp_path),
                             str(tmp_path / "test_one.py")], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=8)  # torch loads, then the process waits at the gate
        assert not collected.exists()
        pytest_gate.open_gate(gate, word)
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    if word == pytest_gate.GO:
        assert proc.returncode == 0 and "1 passed" in out, out
    else:
        assert proc.returncode == 3 and word in out and "passed" not in out, out


@pytest.mark.reaches(stages.get(1).folder)
def test_make_verify_itself_loads_no_torch():
    """make verify's own process starts the build and the tests without importing torch (seconds
    before either could start): its tests' process loads torch beside the compiler, and the
    race checker, which needs it, loads only for a copy whose kernels cooperate."""
    code = ("import sys\n"
            "from workbook.build import stages\n"
            "from workbook.teaching import exercises\n"
            "s = stages.get(1)\n"
            "assert exercises._racecheck(s, s.source_dir, [], {}, {}) == []\n"
            "print(sorted(m for m in sys.modules if m.partition('.')[0] == 'torch')[:3])\n")
    env = dict(os.environ, PYTHONPATH=pythonpath_with_common())
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"make verify's process imports {result.stdout}"


@pytest.mark.exercises
@pytest.mark.reaches(stages.get(1).folder)
def test_a_test_process_that_dies_is_named_with_its_test(tmp_path, capsys):
    """A test that kills its process (here by abort(), as glibc does on a corrupted heap): the
    summary names that test, says what the signal means and how to find the line."""
    s = stages.get(1)
    work = exercises.carve(s, tmp_path / "exercises" / s.folder, quiet=True)
    exercises.reveal(s, work=work)
    (work / "test_dies.py").write_text("import os\n\n\ndef test_passes():\n    pass\n\n\n"
                                       "def test_dies():\n    os.abort()\n")
    base = stages.empty_build_folder("test-exercises", f"{s.folder}-dies")
    report = exercises.verify(s, work, base=base, tests=["test_dies.py"])
    out = capsys.readouterr().out
    assert report.exit_code not in (0, 1), report.exit_code
    assert "died of SIGABRT" in out and "while running test_dies.py::test_dies." in out, out[-3000:]
    assert "`make verify 1 SANITIZE=1 TEST='test_dies.py::test_dies'`" in out


def solved_copy_with(tmp_path, s, exercise: str, old: str, new: str):
    """A carved and solved copy of stage s with a planted fault: `old` made `new` on the first
    line of `exercise` that has it. Returns the copy, the exercise and that line's index."""
    work = exercises.carve(s, tmp_path / "exercises" / s.folder, quiet=True)
    exercises.reveal(s, work=work)
    e = exercises.get(s, exercise)
    path = work / e.relpath
    lines = path.read_text().splitlines(keepends=True)
    k = next(k for k in range(e.start, len(lines)) if old in lines[k])
    lines[k] = lines[k].replace(old, new, 1)
    path.write_text("".join(lines))
    return work, e, k


@pytest.mark.exercises
@pytest.mark.reaches(stages.get(4).folder)
def test_an_out_of_bounds_write_is_found_by_make_verify_sanitize(tmp_path, capsys):
    """Stage 04's forward kernel with its guard one element short (`n > numel`): its last thread
    writes past the outputs. `make verify 4 SANITIZE=1` names the kernel and a line of it in the
    learner's copy: the write."""
    from workbook.build import emulate

    s = stages.get(4)
    if not emulate.active():
        pytest.skip("a GPU is visible: make verify runs the CUDA tests there, where "
                    "AddressSanitizer does not see device code (WORKBOOK_CUDA=emulate forces the "
                    "emulated device)")
    work, e, guard = solved_copy_with(tmp_path, s, "cuda-forward-kernel", "n >= numel",
                                      "n > numel")
    base = stages.empty_build_folder("test-exercises", f"{s.folder}-sanitize")
    report = exercises.verify(s, work, base=base, sanitize=True,
                              tests=["test_lltm_cuda_raw.py::test_against_reference"])
    out = capsys.readouterr().out
    assert report.exit_code != 0
    first = next((ln for ln in out.splitlines() if "SANITIZE=1: 1 sanitizer report" in ln), "")
    line = re.search(re.escape(e.relpath) + r":(\d+)", first)
    assert "heap-buffer-overflow" in first and "in your code:" in first, out[-4000:]
    assert "lltm_forward_kernel" in first and line, out[-4000:]
    assert guard < int(line.group(1)) <= e.end + 1, (first, guard, e.end)


@pytest.mark.exercises
@pytest.mark.reaches(stages.get(4).folder)
def test_a_compile_error_in_an_emulated_kernel_stops_make_verify_before_any_test(tmp_path,
                                                                                capsys):
    """Stage 04's forward kernel calling `sigmoid` without `workbook::`: without a GPU the kernels
    are built for the emulated device as a step of their own, and the loop stops there with
    gcc's line in the learner's copy, once, and no test run (none on a library of an earlier
    build)."""
    from workbook.build import emulate

    s = stages.get(4)
    if not emulate.active():
        pytest.skip("a GPU is visible: make verify builds the kernels with nvcc there")
    work, e, call = solved_copy_with(tmp_path, s, "cuda-forward-kernel", "workbook::sigmoid(",
                                     "sigmoid(")
    base = stages.empty_build_folder("test-exercises", f"{s.folder}-compile-error")
    report = exercises.verify(s, work, base=base)
    out = capsys.readouterr().out
    where = f"{e.relpath}:{call + 1}:"
    errors = [ln for ln in out.splitlines() if where in ln and "error:" in ln]
    assert not report.built and report.exit_code != 0, out[-3000:]
    assert errors and all("sigmoid" in ln for ln in errors), out[-3000:]
    assert len(set(errors[1:])) == len(errors[1:]), out[-3000:]  # after the first, each once
    assert "does not build" in out and not report.results, out[-3000:]


@pytest.mark.exercises
@pytest.mark.reaches(cooperating_stage().folder)
def test_a_missing_barrier_in_an_exercise_is_a_race_make_verify_names(tmp_path):
    """The tile loop solved, but without its second barrier: make verify's race check names the
    exercise and both lines, whether or not the numbers came out right."""
    from workbook.build import emulate

    s = cooperating_stage()
    if not emulate.active():
        pytest.skip("a GPU is visible: make verify runs the CUDA tests there, not on the "
                    "emulated device that checks races (WORKBOOK_CUDA=emulate forces it)")
    work = exercises.carve(s, tmp_path / "exercises" / s.folder, quiet=True)
    exercises.reveal(s, work=work)
    kernels = work / exercises.get(s, "tile-loop").relpath
    barrier = "      __syncthreads();  // every thread has read them before the next turn"
    text = kernels.read_text()
    assert text.count(barrier) == 1, "the second barrier of the tile loop moved: update the test"
    kernels.write_text("\n".join(line for line in text.splitlines()
                                  if not line.startswith(barrier)) + "\n")
    base = stages.empty_build_folder("test-exercises", f"{s.folder}-race")
    report = exercises.verify(s, work, base=base,
                              tests=["test_lltm_cooperating.py::test_tiles_that_do_not_fill"])
    assert report.status["tile-loop"] == "RACE", report.status
    region = exercises._region(work, exercises.get(s, "tile-loop"))
    race = report.races[0]
    assert race.kernel == "matmul_tiled_kernel"
    assert all(region[0] <= line <= region[1] for _, _, line in race.accesses), race.accesses
    assert report.exit_code == 1
