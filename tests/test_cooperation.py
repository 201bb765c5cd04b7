"""Threads that cooperate, on the emulated CUDA device: the proofs that it runs them as CUDA does
and checks what it claims to (workbook.build.emulate, common/emulate/include/emulated_cuda/).

tests/kernels/cooperating.cu holds one kernel for each way a block's threads share work (a tree
reduction in shared memory, its warp-shuffle version, a tiled transpose, votes, shuffles with a
width, cooperative groups' tiles, atomics on shared memory, __syncwarp); each must give the CPU's
result under every order the device runs blocks and threads in. tests/kernels/planted_faults.cu
breaks the rules one way each: synccheck must name a barrier or collective that not every thread
reaches, with the threads and lines, and racecheck (ThreadSanitizer) must report the races with
both lines while finding none in the correct kernels.

The kernels are compiled once per build folder (about half a minute each: the emulated build,
the ThreadSanitizer build, and one with the ucontext fibers) and called through ctypes on CPU
memory, which is the emulated device's.
"""

import ctypes
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from workbook.build import emulate, stages

# Its kernels are its own (tests/kernels/): it runs no stage (workbook.testing.pytest_results
# keeps its results while the files outside stages/ are unchanged).
pytestmark = pytest.mark.reaches()
KERNELS = Path(__file__).parent / "kernels"
SOURCES = [KERNELS / "cooperating.cu", KERNELS / "planted_faults.cu"]
# The orders a correct kernel must not notice: blocks shared out among CPU threads (unset), in
# order on one thread, and shuffled (blocks, and the fibers within each block) from three seeds.
ORDERS = [("", None), ("in-order", None), ("shuffle", "0"), ("shuffle", "1"), ("shuffle", "7")]


def library(build_dir: Path) -> ctypes.CDLL:
    """The two kernel files, built for the emulated device into build_dir and opened."""
    emulate.build_kernels("cooperating_test_kernels", SOURCES, build_dir)
    return ctypes.CDLL(str(build_dir / "objects" / "cooperating_test_kernels.so"))


@pytest.fixture(scope="module")
def kernels() -> ctypes.CDLL:
    return library(emulate.emulated_root() / "tests" / "cooperating")


def pointer(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def launch(lib: ctypes.CDLL, name: str, *args) -> None:
    """lib's run_<name>(args), which must report no launch error."""
    code = getattr(lib, f"run_{name}")(*[pointer(a) if isinstance(a, torch.Tensor) else a
                                         for a in args])
    lib.error_text.restype = ctypes.c_char_p
    assert code == 0, lib.error_text(code).decode()


def failure(lib: ctypes.CDLL, name: str, *args) -> str:
    """The error text of lib's run_<name>(args), which must fail."""
    code = getattr(lib, f"run_{name}")(*[pointer(a) if isinstance(a, torch.Tensor) else a
                                         for a in args])
    lib.error_text.restype = ctypes.c_char_p
    assert code != 0, f"{name} was expected to fail"
    return lib.error_text(code).decode()


def line_of(source: Path, marker: str) -> int:
    """The line of `source` whose comment says FAULT: <marker>."""
    lines = source.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if f"FAULT: {marker}" in text)


# -- the CPU's results -----------------------------------------------------------------------------

def cases():
    """Each correct kernel's launch and what the CPU computes for it: (name, run, expected)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g)  # 4 blocks of 256, the last one short
    blocks = (x.numel() + 255) // 256
    padded = torch.zeros(blocks * 256)
    padded[:x.numel()] = x

    def block_sums(kernel):
        def run(lib):
            sums = torch.zeros(blocks)
            launch(lib, kernel, x, sums, x.numel())
            return [sums]
        return run

    matrix = torch.randn(45, 70, generator=g)  # tiles that do not fill: 2 x 3 of 32

    def transpose(lib):
        out = torch.empty(70, 45)
        launch(lib, "transpose_tiled", matrix, out, 45, 70)
        return [out]

    signs = torch.randn(3 * 128, generator=g)
    signs[128:256] = signs[128:256].abs()  # block 1: all positive

    def votes(lib):
        ballots, any_all = torch.zeros(12, dtype=torch.int32), torch.zeros(24, dtype=torch.int32)
        block_votes = torch.zeros(9, dtype=torch.int32)
        launch(lib, "votes", signs, 3, ballots, any_all, block_votes)
        return [ballots, any_all, block_votes]

    positive = (signs > 0).view(12, 32)
    bits = (positive.long() << torch.arange(32)).sum(1)
    ballots = torch.where(bits < 2**31, bits, bits - 2**32).int()  # the unsigned bits, as int32
    any_all = torch.stack([positive.any(1), positive.all(1)], 1).flatten().int()
    per_block = (signs > 0).view(3, 128)
    block_votes = torch.stack([per_block.sum(1), per_block.all(1), per_block.any(1)], 1)

    def shuffles(lib):
        out = torch.zeros(2 * 64 * 4)
        launch(lib, "shuffles", out, 2)
        return [out]

    lane = torch.arange(128)
    base8 = lane // 8 * 8
    up = torch.where(lane % 16 >= 1, lane - 1, lane)
    down = torch.where(lane % 16 + 2 < 16, lane + 2, lane)
    xor = lane // 32 * 32 + (lane % 32 ^ 5)
    shuffled = torch.stack([base8 + 3, up, down, xor], 1).flatten().float()

    tiles = torch.randn(2 * 96, generator=g)

    def tile_sums(lib):
        sums, tile_ballots = torch.zeros(12), torch.zeros(12, dtype=torch.int32)
        launch(lib, "tile_sums", tiles, 2, sums, tile_ballots)
        return [sums, tile_ballots]

    tile_bits = ((tiles > 0).view(12, 16).long() << torch.arange(16)).sum(1).int()

    data = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=g)

    def histogram(lib):
        bins = torch.zeros(64, dtype=torch.int32)
        launch(lib, "histogram", data, data.numel(), bins)
        return [bins]

    def reverse(lib):
        out = torch.empty(512)
        launch(lib, "warp_reverse", padded[:512], out, 2)
        return [out]

    sums = [padded.view(blocks, 256).sum(1)]
    return [
        ("block_sum_shared", block_sums("block_sum_shared"), sums),
        ("block_sum_shuffle", block_sums("block_sum_shuffle"), sums),
        ("transpose_tiled", transpose, [matrix.T]),
        ("votes", votes, [ballots, any_all, block_votes.flatten().int()]),
        ("shuffles", shuffles, [shuffled]),
        ("tile_sums", tile_sums, [tiles.view(12, 16).sum(1), tile_bits]),
        ("histogram", histogram, [torch.bincount(data.long() % 64, minlength=64).int()]),
        ("warp_reverse", reverse, [padded[:512].view(16, 32).flip(1).flatten()]),
    ]


CASES = cases()


@pytest.mark.parametrize(("name", "run", "expected"), CASES, ids=[c[0] for c in CASES])
def test_cooperating_kernels_give_the_cpus_results_in_every_order(kernels, monkeypatch, name,
                                                                 run, expected):
    results = []
    for order, seed in ORDERS:
        monkeypatch.setenv("WORKBOOK_EMULATE_ORDER", order)
        if seed is not None:
            monkeypatch.setenv("WORKBOOK_EMULATE_SEED", seed)
        results.append(run(kernels))
    for got, want_one in zip(results[0], expected):
        close = torch.equal(got, want_one) if not got.is_floating_point() else torch.allclose(
            got, want_one.to(got.dtype), rtol=1e-5, atol=1e-5)
        assert close, f"{name}: {got} != {want_one}"
    for (order, seed), result in zip(ORDERS[1:], results[1:]):
        for got, first in zip(result, results[0]):
            assert torch.equal(got, first), f"{name} differs in order {order or 'parallel'} " \
                                            f"(seed {seed}) from the first run"


# -- synccheck -------------------------------------------------------------------------------------

PLANTED = KERNELS / "planted_faults.cu"
# How the emulated device's reports name it: relative to the clone, as a stage's files.
PLANTED_NAME = PLANTED.relative_to(stages.REPO)


def test_a_barrier_half_the_block_skips_is_an_error_naming_threads_and_line(kernels):
    text = failure(kernels, "divergent_barrier", torch.zeros(64))
    line = line_of(PLANTED, "divergent barrier")
    assert "unspecified launch failure" in text and "kernel `divergent_barrier`" in text
    assert "block (0, 0, 0) of a grid of (2, 1, 1)" in text
    assert "a barrier that not every thread of the block reaches" in text
    assert f"threads 0..15: wait at `__syncthreads` ({PLANTED_NAME}:{line})" in text
    assert "threads 16..31: returned" in text


def test_threads_at_two_barriers_are_an_error_naming_both(kernels):
    text = failure(kernels, "two_barriers", torch.zeros(32))
    even, odd = line_of(PLANTED, "even barrier"), line_of(PLANTED, "odd barrier")
    assert "its threads wait at different barriers" in text
    assert re.search(rf"threads 0, 2, 4, .*: wait at `__syncthreads` \(.*:{even}\)", text), text
    assert re.search(rf"threads 1, 3, 5, .*: wait at `__syncthreads` \(.*:{odd}\)", text), text


def test_a_shuffle_whose_mask_names_returned_lanes_is_an_error(kernels):
    text = failure(kernels, "shuffle_without_lanes", torch.zeros(32))
    line = line_of(PLANTED, "missing lanes")
    assert "a warp collective whose lanes do not all arrive" in text
    assert (f"threads 0..15: wait at `__shfl_down_sync` ({PLANTED_NAME}:{line}) with mask "
            f"0xffffffff, for lanes 16..31 of warp 0, which are not there") in text
    assert "threads 16..31: returned" in text


def test_shared_memory_past_cudas_limit_is_an_error(kernels):
    text = failure(kernels, "too_much_shared", torch.zeros(64))
    line = line_of(PLANTED, "too much shared")
    assert f"`__shared__` ({PLANTED_NAME}:{line})" in text
    assert "the block's __shared__ variables come to 53248 bytes, past CUDA's limit of 49152" \
        in text


def test_a_failed_launch_leaves_the_next_one_working(kernels):
    failure(kernels, "divergent_barrier", torch.zeros(64))
    sums = torch.zeros(4)
    launch(kernels, "block_sum_shared", torch.ones(1000), sums, 1000)
    assert sums.tolist() == [256.0, 256.0, 256.0, 232.0]


# -- racecheck -------------------------------------------------------------------------------------

RACECHECK = textwrap.dedent("""\
    import ctypes, sys, torch
    sys.path.insert(0, {tests!r})
    import test_cooperation as t
    from pathlib import Path
    lib = t.library(Path({build!r}))
    def section(name):
        print(f"=== {{name}}", file=sys.stderr, flush=True)
    section("correct kernels")
    for name, run, _ in t.CASES:
        run(lib)
    section("racy_block_sum")
    t.launch(lib, "racy_block_sum", torch.ones(512), torch.zeros(2), 2)
    section("racy_tiles")
    tiled = torch.zeros(64)
    t.launch(lib, "racy_tiles", torch.ones(8 * 32), tiled, 32)
    print(f"tiled sums: {{tiled.unique().tolist()}}", file=sys.stderr, flush=True)
    section("racy_store")
    t.launch(lib, "racy_store", torch.zeros(1, dtype=torch.int32))
    section("end")
    """)


def tsan_runtime() -> str:
    out = subprocess.run([os.environ.get("CXX", "g++"), "-print-file-name=libtsan.so"],
                         capture_output=True, text=True).stdout.strip()
    return str(Path(out).resolve())


@pytest.fixture(scope="module")
def racecheck_run() -> dict[str, str]:
    """The kernels built and run under ThreadSanitizer in a fresh interpreter: its stderr, by
    section (what ran before each `=== name` line)."""
    runtime = tsan_runtime()
    if not Path(runtime).is_file():
        pytest.skip("g++ has no ThreadSanitizer runtime (libtsan.so): install gcc's libtsan")
    # One sanitizer at a time: under make sanitize this run drops AddressSanitizer's runtime and
    # flags for ThreadSanitizer's.
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORKBOOK_SANITIZE", "ASAN_OPTIONS", "UBSAN_OPTIONS")}
    env.update(WORKBOOK_RACECHECK="1", LD_PRELOAD=runtime, OMP_NUM_THREADS="1",
               TSAN_OPTIONS="report_signal_unsafe=0", WORKBOOK_EMULATE_QUIET="1")
    build = emulate.build_root() / "racecheck" / "tests" / "cooperating"
    code = RACECHECK.format(tests=str(Path(__file__).parent), build=str(build))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=900, env=env)
    sections = dict(re.findall(r"=== (\w[\w ]*)\n(.*?)(?==== |\Z)", result.stderr, re.S))
    assert "end" in sections, f"the racecheck run stopped: {result.stderr[-4000:]}"
    return sections


def reports(text: str) -> list[str]:
    return re.findall(r"WARNING: ThreadSanitizer: (.*?)SUMMARY", text, re.S)


def test_racecheck_finds_no_race_in_the_correct_kernels(racecheck_run):
    assert reports(racecheck_run["correct kernels"]) == [], racecheck_run["correct kernels"][-4000:]


def test_racecheck_reports_a_missing_barrier_with_both_lines(racecheck_run):
    found = reports(racecheck_run["racy_block_sum"])
    assert found, "the race went unreported"
    store, load = line_of(PLANTED, "racy store"), line_of(PLANTED, "racy load")
    first = found[0]
    assert "data race" in first and "racy_block_sum" in first
    assert f"planted_faults.cu:{store}" in first and f"planted_faults.cu:{load}" in first, first


def test_racecheck_reports_a_missing_barrier_even_when_the_numbers_are_right(racecheck_run):
    """The tile loop without its second barrier: on the emulated device's schedule the sums are
    right (the inputs are ones), and the race is reported all the same, with both lines."""
    text = racecheck_run["racy_tiles"]
    assert "tiled sums: [32.0]" in text, text[-2000:]
    found = reports(text)
    store, load = line_of(PLANTED, "tile store"), line_of(PLANTED, "tile load")
    assert found and "racy_tiles" in found[0], text[-3000:]
    assert f"planted_faults.cu:{store}" in found[0] and f"planted_faults.cu:{load}" in found[0]


def test_racecheck_reports_two_threads_storing_to_one_element(racecheck_run):
    found = reports(racecheck_run["racy_store"])
    line = line_of(PLANTED, "global store")
    assert found and "racy_store" in found[0], racecheck_run["racy_store"][-3000:]
    assert found[0].count(f"planted_faults.cu:{line}") == 2, found[0]


# -- the other fiber mechanism ---------------------------------------------------------------------

def test_the_ucontext_fibers_give_the_same_results(monkeypatch, tmp_path):
    """Where Boost.Context is missing, the fibers switch with ucontext: the same kernels, built
    that way in a fresh interpreter, give the same sums."""
    code = textwrap.dedent(f"""\
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import test_cooperation as t
        from pathlib import Path
        lib = t.library(Path({str(emulate.emulated_root() / "tests" / "ucontext")!r}))
        for name, run, expected in t.CASES:
            got = run(lib)
            assert all(torch.allclose(a.double(), b.double(), atol=1e-5)
                       for a, b in zip(got, expected)), name
        print("ucontext ok")
        """)
    env = dict(os.environ, WORKBOOK_EMULATE_FIBERS="ucontext", WORKBOOK_EMULATE_QUIET="1")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=900, env=env)
    assert "ucontext ok" in result.stdout, result.stderr[-3000:]
