"""The compiler cache (workbook.build.compiler.compiler_cache): set up so that a clone in another
folder compiles nothing its twin compiled, and shown to, with ccache itself, on a small file laid
out as a stage's build lays out its objects (no torch: it compiles in a fraction of a second)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from workbook.build import compiler

SOURCE = "#include \"workbook_probe.h\"\nint probe(int x) { return twice(x) + 1; }\n"
HEADER = "inline int twice(int x) { return 2 * x; }\n"


def test_the_base_dir_is_this_clone_unless_it_holds_it(monkeypatch, tmp_path):
    monkeypatch.setattr(compiler.shutil, "which", lambda name: "/usr/bin/ccache"
                        if name == "ccache" else None)
    monkeypatch.delenv("CCACHE_DISABLE", raising=False)
    monkeypatch.delenv("CCACHE_BASEDIR", raising=False)
    compiler.compiler_cache()
    assert os.environ["CCACHE_BASEDIR"] == str(compiler.REPO)
    assert os.environ["CCACHE_NOHASHDIR"] == "1"
    # One a process of another clone set (make test-template's copies inherit it): replaced.
    monkeypatch.setenv("CCACHE_BASEDIR", str(tmp_path / "another_clone"))
    compiler.compiler_cache()
    assert os.environ["CCACHE_BASEDIR"] == str(compiler.REPO)
    # One set for a folder that holds this clone, by the user: kept.
    monkeypatch.setenv("CCACHE_BASEDIR", str(compiler.REPO.parent))
    compiler.compiler_cache()
    assert os.environ["CCACHE_BASEDIR"] == str(compiler.REPO.parent)


def _build(clone: Path, cache: Path) -> dict[str, int]:
    """Compile probe.cpp in a stage folder of the clone from its build folder, as ninja
    does for a stage, through ccache set up as compiler_cache() sets it; the cache's counters."""
    source = clone / "stages" / "01_x" / "csrc" / "probe.cpp"
    source.parent.mkdir(parents=True)
    source.write_text(SOURCE)
    (clone / "common" / "include").mkdir(parents=True)
    (clone / "common" / "include" / "workbook_probe.h").write_text(HEADER)
    work = clone / "build" / "stages" / "01_x" / "temp"
    work.mkdir(parents=True)
    env = dict(os.environ, CCACHE_DIR=str(cache), CCACHE_BASEDIR=str(clone),
               CCACHE_NOHASHDIR="1")
    env.pop("CCACHE_DISABLE", None)
    subprocess.run(["ccache", "g++", "-O2", "-g0", "-I", str(clone / "common" / "include"),
                    "-c", str(source), "-o", str(work / "probe.o")], cwd=work, env=env,
                   check=True)
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
