"""Stages are found, not listed: the README, `make help`, `make diff`, the build and the test
suite all read the stage folders, and a folder copied under a new number is a stage."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workbook import testing
from workbook.build import stages

REPO = stages.REPO
README = REPO / "README.md"


def test_readme_stage_table_matches_the_stage_folders():
    table = stages.readme_table()
    assert table in README.read_text(), (
        "README.md's stage table does not match the stage folders; it should read:\n\n"
        f"{table}\n\n(python -m workbook.build.stages --readme-table prints it)")


def test_every_stage_has_tests_a_readme_and_a_notebook():
    for s in stages.all_stages():
        assert s.test_files(), f"{s.label} has no test_*.py"
        assert (s.source_dir / "README.md").is_file(), f"{s.label} has no README.md"
        assert list((REPO / "notebooks").glob(f"{s.number:02d}_*.ipynb")), (
            f"{s.label} has no notebook notebooks/{s.number:02d}_*.ipynb")


def test_every_op_of_every_stage_has_a_descriptor():
    from workbook import ops

    for s in stages.all_stages():
        for name in s.ops:
            assert ops.get(name).name == name


def test_make_help_lists_the_stages_it_finds():
    out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, BOOTSTRAP_PYTHON=sys.executable), timeout=60)
    assert out.returncode == 0, out.stderr
    for s in stages.all_stages():
        assert s.folder in out.stdout, f"make help does not list {s.folder}:\n{out.stdout}"


@pytest.mark.parametrize("stage", [s for s in stages.all_stages() if s.lesson], ids=str)
def test_make_diff_shows_each_lesson(stage):
    diff = stages.lesson_diff(stage)
    for _, after in stage.lesson:
        assert f"stages/{after}" in diff
    assert "\n+" in diff and "\n-" in diff


def test_without_a_gpu_the_stages_with_a_cpu_fallback_build_cpu_only(monkeypatch):
    """Where no GPU is visible and the CUDA tests run on the emulated device, make test chooses
    CPU-only builds for the CUDA stages that have a CPU fallback (WORKBOOK_NVCC=0); a CUDA-only
    stage is still built with nvcc, and a choice already made, a GPU, or WORKBOOK_CUDA=off
    leaves the builds as they are."""
    from workbook.build import emulate

    monkeypatch.delenv("WORKBOOK_NO_CUDA", raising=False)
    cuda_only = next(s for s in stages.all_stages() if s.cuda and not s.cpu_fallback)
    with_fallback = [s for s in stages.all_stages() if s.cuda and s.cpu_fallback]
    assert with_fallback and cuda_only
    for gpu, setting, chosen in [(False, "", True), (True, "", False), (False, "off", False)]:
        monkeypatch.delenv(stages.NVCC, raising=False)
        monkeypatch.setenv("WORKBOOK_CUDA", setting)
        monkeypatch.setattr(emulate, "gpu_visible", lambda gpu=gpu: gpu)
        line = emulate.choose_builds()
        assert (line is not None) == chosen and (os.environ.get(stages.NVCC) == "0") == chosen
        assert all(stages.get(s.number).cpu_only == chosen for s in with_fallback)
        assert not stages.get(cuda_only.number).cpu_only
        assert stages.get(cuda_only.number).build_dir.parent.name == "stages"
    monkeypatch.setenv(stages.NVCC, "1")  # make nvcc-check's
    monkeypatch.setenv("WORKBOOK_CUDA", "")
    monkeypatch.setattr(emulate, "gpu_visible", lambda: False)
    assert emulate.choose_builds() is None
    assert not any(stages.get(s.number).cpu_only for s in with_fallback)


def test_a_folder_without_stage_toml_is_an_error(tmp_path):
    (tmp_path / "07_broken").mkdir()
    with pytest.raises(stages.StageError, match=r"stage.toml is missing"):
        stages.discover(tmp_path)


def test_two_stages_with_one_number_are_an_error(tmp_path):
    for name in ("07_one", "07_two"):
        shutil.copytree(REPO / "stages" / "01_z2xy", tmp_path / name)
    with pytest.raises(stages.StageError, match=r"two stages are numbered 7"):
        stages.discover(tmp_path)


def test_stage_toml_is_checked(tmp_path):
    folder = tmp_path / "08_bad"
    folder.mkdir()
    (folder / "stage.toml").write_text('title = "x"\npackage = "x"\nops = "x"\nbuild = "setup"\n')
    with pytest.raises(stages.StageError, match=r"`ops` must be a list"):
        stages.read(folder)


@pytest.mark.template
@pytest.mark.reaches("01_z2xy")  # the stage it copies; of the others, what describes them
@pytest.mark.reads("stages/*/stage.toml", "stages/*/README.md", "README.md")
def test_a_copied_stage_is_built_and_tested_with_no_other_edit():
    """The acceptance check of the template: copy a stage folder under a new number, and the
    build and the test suite take it up; the README table test fails until its row is added."""
    copy, env = testing.working_copy_in_build("copied-stage")
    shutil.copytree(copy / "stages" / "01_z2xy", copy / "stages" / "42_z2xy_again")

    def run(*args, timeout=900):
        return subprocess.run([sys.executable, *args], cwd=copy, env=env, capture_output=True,
                              text=True, timeout=timeout)

    listed = run("-m", "workbook.build.stages", "--numbers")
    assert listed.returncode == 0 and "42" in listed.stdout.split(), listed.stdout + listed.stderr
    built = run("-m", "workbook.build", "42")
    assert built.returncode == 0, built.stdout + built.stderr
    assert (Path(env["WORKBOOK_BUILD_DIR"]) / "stages" / "42_z2xy_again" / "lib" / "z2xy").is_dir()
    tested = run("-m", "workbook.testing.suite", "42")
    assert tested.returncode == 0, tested.stdout[-3000:]
    assert "stage 42 (42_z2xy_again)" in tested.stdout and " passed" in tested.stdout
    table = run("-m", "pytest", "-q", "tests/test_stages.py::"
                "test_readme_stage_table_matches_the_stage_folders")
    assert table.returncode == 1 and "42_z2xy_again" in table.stdout, table.stdout[-2000:]


# Without a GPU the CUDA kernels run on the emulated device and the same tests judge them: what
# learners read tells that one story (issue 37). Phrases of the story before the emulated device:
STALE_GPU_PHRASES = ("Without one they skip", "GPU only)", "runs on a GPU only",
                     "shows at most that your kernel compiles")


def test_no_stale_phrase_about_the_gpu_where_learners_read():
    places = [README, *REPO.glob("stages/*/README.md"), *REPO.glob("notebooks/*.ipynb"),
              *REPO.glob("stages/*/test_*.py"), *REPO.glob("common/workbook/teaching/*.py")]
    assert len(places) > 20, "the places learners read were not found"
    stale = [f"{p.relative_to(REPO)}: {phrase!r}" for p in places
             for phrase in STALE_GPU_PHRASES if phrase in p.read_text()]
    assert not stale, "the GPU's old story, where learners read:\n" + "\n".join(stale)
