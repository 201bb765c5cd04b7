"""The compiler cache (workbook.build.compiler.compiler_cache): set up so that a clone in another
folder compiles nothing its twin compiled, and shown to, with ccache itself, on a small file laid
out as a stage's build lays out its objects (no torch: it compiles in a fraction of a second);
and the order `make test` builds the stages in, so that a stage finds in the cache what another
compiled (workbook.build.side_by_side). Last, what a build needs of torch itself, kept between
processes so that a build process need not load torch (workbook.build.compiler.torch_facts)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workbook.build import compiler, side_by_side, stages

SOURCE = "#include \"workbook_probe.h\"\nint probe(int x) { return twice(x) + 1; }\n"
HEADER = ("inline int twice(int x) { return 2 * x; }\n"
          "inline const char* where() { return __FILE__; }\n")


def test_the_base_dir_is_this_clone_unless_it_holds_it(monkeypatch, tmp_path):
    monkeypatch.setattr(compiler.shutil, "which", lambda name: "/usr/bin/ccache"
                        if name == "ccache" else None)
    monkeypatch.delenv("CCACHE_DISABLE", raising=False)
    monkeypatch.delenv("CCACHE_BASEDIR", raising=False)
    compiler.compiler_cache()
    assert os.environ["CCACHE_BASEDIR"] == str(compiler.REPO)
    assert os.environ["CCACHE_NOHASHDIR"] == "1"
    # One a process of another clone set, inherited: replaced.
    monkeypatch.setenv("CCACHE_BASEDIR", str(tmp_path / "another_clone"))
    compiler.compiler_cache()
    assert os.environ["CCACHE_BASEDIR"] == str(compiler.REPO)
    # One set for a folder that holds this clone, by the user: kept.
    monkeypatch.setenv("CCACHE_BASEDIR", str(compiler.REPO.parent))
    compiler.compiler_cache()
    assert os.environ["CCACHE_BASEDIR"] == str(compiler.REPO.parent)


def _build(clone: Path, cache: Path, include: tuple[str, ...] | list[str] = ("-I",),
           work: Path = Path("build/stages/01_x/temp"), **settings: str) -> dict[str, int]:
    """Compile probe.cpp in a stage folder of the clone from its build folder (`work`, relative
    to the clone), as ninja does for a stage, through ccache set up as compiler_cache() sets it
    (and `settings`), its header's folder passed with `include` (the option, then any flags);
    the cache's counters."""
    source = clone / "stages" / "01_x" / "csrc" / "probe.cpp"
    source.parent.mkdir(parents=True)
    source.write_text(SOURCE)
    (clone / "common" / "include").mkdir(parents=True)
    (clone / "common" / "include" / "workbook_probe.h").write_text(HEADER)
    work = clone / work
    work.mkdir(parents=True)
    env = dict(os.environ, CCACHE_DIR=str(cache), CCACHE_BASEDIR=str(clone),
               CCACHE_NOHASHDIR="1", **settings)
    env.pop("CCACHE_DISABLE", None)
    subprocess.run(["ccache", "g++", "-O2", "-g0", *include[1:], include[0],
                    str(clone / "common" / "include"), "-c", str(source), "-o",
                    str(work / "probe.o")], cwd=work, env=env, check=True)
    stats = subprocess.run(["ccache", "--print-stats"], env=env, capture_output=True,
                           text=True, check=True).stdout
    counts = dict(line.split("\t") for line in stats.splitlines() if "\t" in line)
    return {"hits": int(counts["direct_cache_hit"]) + int(counts["preprocessed_cache_hit"]),
            "misses": int(counts["cache_miss"])}


@pytest.mark.skipif(shutil.which("ccache") is None or shutil.which("g++") is None,
                    reason="no ccache or g++ on PATH (apt install ccache)")
def test_a_clone_in_another_folder_hits_the_cache(tmp_path):
    cache = tmp_path / "cache"
    assert _build(tmp_path / "first" / "clone", cache) == {"hits": 0, "misses": 1}
    assert _build(tmp_path / "second" / "deeper" / "clone", cache) == {"hits": 1, "misses": 1}


@pytest.mark.skipif(shutil.which("ccache") is None or not compiler.cache_flags(),
                    reason="no ccache on PATH, or the host compiler is not GCC")
@pytest.mark.parametrize("flags", [[], compiler.cache_flags()], ids=["gcc's default", "ours"])
def test_a_system_header_deep_below_the_build_folder_keeps_its_relative_name(flags, tmp_path):
    # torch's just-in-time builder passes its headers with -isystem. From a build folder deep
    # enough that the relative path to the header is longer than its absolute one, GCC names it
    # by the absolute one, clone and all (__FILE__ in the header): a miss in any other clone,
    # unless compiler.cache_flags() keeps the name. The emulated device's builds are looked up
    # by their preprocessed text alone (their #line names a stage's file, relative to the clone,
    # which ccache cannot find from the build folder, so it turns its direct mode off): so here.
    cache, work = tmp_path / "cache", Path("build", *["e"] * 40)
    assert _build(tmp_path / "a" / "clone", cache, ["-isystem", *flags], work,
                  CCACHE_NODIRECT="1") == {"hits": 0, "misses": 1}
    second = _build(tmp_path / "b" / "clone", cache, ["-isystem", *flags], work,
                    CCACHE_NODIRECT="1")
    assert second == ({"hits": 1, "misses": 1} if flags else {"hits": 0, "misses": 2})


# -- the order of builds side by side: a build after the one that compiles its files and more ----


def test_a_stage_builds_after_the_stage_that_compiles_all_its_files():
    tasks = side_by_side._tasks(stages.all_stages(), force=True, require_cuda=False,
                                emulated=True)
    waits = {t.label: {w.label for w in side_by_side._after(t, tasks)} for t in tasks}
    label = {s.folder[:2]: s.label for s in stages.all_stages()}
    # 06, 07 and 09 build one library (extops, the same flags), each with the files of the one
    # before it: 09 first, then 07 finds 06's and its own files compiled, then 06.
    assert waits[label["07"]] == {label["09"]}
    assert waits[label["06"]] == {label["07"], label["09"]}
    assert waits[label["09"]] == set()
    # Others that compile some of those files with other flags do not wait: stage 08 (its own
    # package, so its own namespace), stage 10 (the stable ABI), stage 05 (the files' owner).
    for s in ("05", "08", "10", "01", "02"):
        assert waits[label[s]] == set(), s
    # The emulated kernels follow the same rule among themselves.
    assert waits[f"{label['07']}, emulated"] == {f"{label['09']}, emulated"}


def test_the_builds_start_in_that_order(monkeypatch, tmp_path):
    def task(name, units, weight):
        script = f"import time; open({str(tmp_path / name)!r}, 'w').write(str(time.time()))"
        return side_by_side._Task(name, [sys.executable, "-c", f"{script}; time.sleep(0.5)"],
                                  weight, flags=("setup", "extops"),
                                  units=frozenset(Path(u) for u in units))

    # The heaviest is the one whose files the others have: it starts first anyway; "small" is
    # heavier than "big" but waits for it.
    tasks = [task("small", ["a"], 9), task("big", ["a", "b"], 5), task("other", ["c"], 1)]
    monkeypatch.setattr(side_by_side, "_tasks", lambda *a, **k: tasks)
    monkeypatch.setattr(side_by_side, "compiler_cache", lambda: "ccache (probe)")
    monkeypatch.setenv("MAX_JOBS", "2")
    assert side_by_side.build_side_by_side([]) == 0
    started = {name: float((tmp_path / name).read_text()) for name in ("small", "big", "other")}
    assert started["other"] < started["small"] and started["big"] < started["small"]
    # Without a compiler cache there is nothing to find: the two longest first, side by side.
    monkeypatch.setattr(side_by_side, "compiler_cache", lambda: "none")
    assert side_by_side.build_side_by_side([]) == 0
    started = {name: float((tmp_path / name).read_text()) for name in ("small", "big", "other")}
    assert started["small"] < started["other"] and started["big"] < started["other"]


def test_what_a_build_needs_of_torch_is_kept_and_asked_again_for_another_setting(tmp_path):
    import torch

    from workbook.teaching.notebook import pythonpath_with_common

    env = dict(os.environ, WORKBOOK_BUILD_DIR=str(tmp_path), PYTHONPATH=pythonpath_with_common())
    env.pop("ATEN_CPU_CAPABILITY", None)
    code = ("import json, sys\nfrom workbook.build import compiler\n"
            "facts = compiler.torch_facts()\n"
            "print(json.dumps([facts, 'torch' in sys.modules]))\n")

    def ask(**extra) -> tuple[dict, bool]:
        result = subprocess.run([sys.executable, "-c", code], env=dict(env, **extra),
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return tuple(json.loads(result.stdout))

    first, loaded = ask()
    assert loaded  # nothing kept yet: torch answers
    assert first == {"version": torch.__version__,
                     "cxx11_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
                     "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                     "openmp": "OpenMP" in torch.__config__.parallel_info()}
    assert ask() == (first, False)  # kept: torch is not loaded
    other, loaded = ask(ATEN_CPU_CAPABILITY="default")
    assert loaded and other["cpu_capability"] == "DEFAULT"
