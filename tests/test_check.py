"""make check's choice of what to run (workbook.testing.check.plan), for made-up changes: no
git, no build, no test run. The expectations are read from the tree (stage.toml, the #include
lines), as the plan's are, so a new stage or header needs no edit here."""

import re

from workbook.build import stages
from workbook.net import sanitize
from workbook.testing import check
from workbook.testing.check import NOTEBOOKS_TEST, plan

REPO = stages.REPO
STAGES = stages.all_stages()


def rel(path):
    return path.relative_to(REPO).as_posix()


def stage_with_sources_from():
    """A stage that others compile the sources of (06 today), with a C++ file of its own."""
    used = {folder for s in STAGES for folder in s.sources_from}
    return next(s for s in STAGES if s.folder in used and list((s.source_dir / "csrc").rglob(
        "*.cpp")))


def compiling(folder):
    """The stages whose stage.toml's sources_from reaches `folder`, directly or through another."""
    found, names = set(), {folder}
    while True:
        more = {s.number for s in STAGES if names & set(s.sources_from)} - found
        if not more:
            return found
        found |= more
        names |= {s.folder for s in STAGES if s.number in more}


def test_a_stage_source_chooses_the_stage_and_those_compiling_its_sources():
    s = stage_with_sources_from()
    source = rel(next((s.source_dir / "csrc").rglob("*.cpp")))
    chosen = plan([source])
    assert set(chosen.stages) == {s.number} | compiling(s.folder)
    assert all(any(source in why for why in reasons) for reasons in chosen.stages.values())
    # their notebooks run after their tests
    for number in chosen.stages:
        assert any(n.startswith(f"notebooks/{number:02d}_") for n in chosen.notebooks)


def test_a_stage_test_file_chooses_that_stage_alone():
    s = stage_with_sources_from()
    chosen = plan([rel(s.test_files()[0])])
    assert set(chosen.stages) == {s.number}
    assert not chosen.notebooks and not chosen.sanitize and not chosen.racecheck


def includers(header):
    """The stages whose C++/CUDA names `workbook/<header>` in an #include line."""
    line = re.compile(rf'#\s*include\s*[<"]workbook/{re.escape(header)}[>"]')
    return {s.number for s in STAGES for folder in s.source_dirs for p in folder.rglob("*")
            if p.suffix in check.CXX and line.search(p.read_text(errors="replace"))}


def test_a_common_header_chooses_exactly_the_stages_that_include_it():
    headers = sorted((REPO / "common" / "include" / "workbook").glob("*.h"))
    included = {h.name: [o for o in headers if f'#include "workbook/{h.name}"' in o.read_text()]
                for h in headers}
    # Headers no other common header includes: their includers are the stages' own files.
    leaves = [h for h in headers if not included[h.name]]
    assert leaves
    for header in leaves:
        assert set(plan([rel(header)]).stages) == includers(header.name), header.name
    # A header another one includes reaches the stages of both.
    for header in headers:
        for other in included[header.name]:
            assert includers(other.name) <= set(plan([rel(header)]).stages), header.name


def test_a_notebook_chooses_only_itself():
    notebook = sorted((REPO / "notebooks").glob("*.ipynb"))[0]
    chosen = plan([rel(notebook)])
    assert list(chosen.notebooks) == [rel(notebook)]
    assert list(chosen.tests) == [NOTEBOOKS_TEST]  # its checks that execute nothing
    assert not chosen.stages and not chosen.sanitize and not chosen.racecheck


def test_a_tests_file_chooses_itself():
    chosen = plan(["tests/test_suite.py"])
    assert list(chosen.tests) == ["tests/test_suite.py"]
    assert not chosen.stages and not chosen.notebooks


def test_this_module_is_checked_when_check_py_changes():
    assert "tests/test_check.py" in plan(["common/workbook/testing/check.py"]).tests


def test_docs_choose_nothing_heavy():
    for doc in ["README.md", rel(STAGES[-1].source_dir / "README.md"), "bench/README.md"]:
        chosen = plan([doc])
        assert not (chosen.stages or chosen.notebooks or chosen.sanitize or chosen.racecheck), doc
        assert any("book-check" in note for note in chosen.notes)


def test_an_op_folder_chooses_the_stages_listing_the_op():
    op = "ms_deform_attn" if any("ms_deform_attn" in s.ops for s in STAGES) else STAGES[-1].ops[0]
    chosen = plan([f"common/workbook/ops/{op}/reference.py"])
    assert set(chosen.stages) == {s.number for s in STAGES if op in s.ops}


def test_the_test_base_chooses_every_stage_and_says_through_what():
    chosen = plan(["common/workbook/spec.py"])
    assert set(chosen.stages) == {s.number for s in STAGES}
    assert all(" -> workbook.spec" in why or "imports workbook.spec" in why
               for reasons in chosen.stages.values() for why in reasons)


def kernel_stage():
    """A CUDA stage with CPU C++ of its own that no .cu or .cuh includes, and .cu files: 09."""
    for s in reversed(STAGES):
        cuda = [p for p in (s.source_dir / "csrc").rglob("*") if p.suffix in (".cu", ".cuh")]
        text = "\n".join(p.read_text() for p in cuda)
        cpu = [p for p in (s.source_dir / "csrc").rglob("*_cpu.h") if p.name not in text]
        if s.cuda and cuda and cpu and sanitize.why_not(s, full=False) is None:
            return s, cpu[0], next(p for p in cuda if p.suffix == ".cu")
    raise AssertionError("no CUDA stage with a CPU kernel header of its own")


def test_a_cpu_kernel_is_sanitized_and_not_race_checked():
    s, cpu, _ = kernel_stage()
    chosen = plan([rel(cpu)])
    assert s.number in chosen.sanitize
    assert s.number not in chosen.racecheck
    assert any("racecheck" in note and s.label in note for note in chosen.notes)


def test_a_cuda_kernel_is_race_checked():
    s, _, cuda = kernel_stage()
    chosen = plan([rel(cuda)])
    assert s.number in chosen.racecheck and s.number in chosen.sanitize


def test_the_emulated_device_chooses_every_cuda_stage():
    header = next((REPO / "common" / "emulate" / "include").rglob("*.h"))
    chosen = plan([rel(header)])
    assert set(chosen.stages) == {s.number for s in STAGES if s.cuda}
    assert chosen.racecheck


def test_a_file_no_rule_knows_is_said():
    chosen = plan([f"no_such_folder/{'nothing'}_{'here'}.txt"])  # named nowhere, even here
    assert chosen.empty() and chosen.notes
