"""The timing guards of make demo and make bench (workbook/measure/timing.py): the load monitor sees
a CPU hog beside it and does not take this process's own work for someone else's; the verdict calls
a busy machine busy and the demo's lines then mark their ratios unreliable; the thread chooser stays
within 1 and the cores there are; the interleaved comparison gives one result per implementation,
with a noise and ratios that agree with its medians.

Other people's compilers may be running while these tests do: every assertion holds on a loaded
machine (the hog is seen at least, never "nothing else"). No assertion is on speed.
"""

import contextlib
import importlib.util
import os
import subprocess
import sys
import time

import pytest

from workbook.build import stages
from workbook.measure import timing

linux_only = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc/stat")


@contextlib.contextmanager
def cpu_hog():
    """A process spinning on one core (the last this process may run on, where it can be pinned),
    given a moment to start spinning; killed after the block."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(hog.pid, {max(timing.usable_cpus())})
        time.sleep(0.3)  # the interpreter starting is not yet a spin
        yield hog
    finally:
        hog.kill()
        hog.wait()


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@linux_only
def test_the_monitor_sees_a_cpu_hog_beside_it():
    with cpu_hog(), timing.LoadMonitor() as watch:
        time.sleep(0.6)  # the watch ends before the hog does: a child not yet waited for
    load = watch.load
    assert load.cores == len(timing.usable_cpus())
    assert load.others >= 0.5, load
    assert load.busy_machine


@linux_only
def test_the_monitor_counts_our_own_work_as_ours():
    with timing.LoadMonitor() as asleep:
        time.sleep(0.5)
    assert asleep.load.own < 0.2, asleep.load
    with timing.LoadMonitor() as spinning:
        spin(0.5)
    # Spinning is ours, however little of a core a loaded machine leaves it: others' use is
    # everything busy but ours, never below 0, never above the cores there are.
    assert spinning.load.own > asleep.load.own
    assert 0.0 <= spinning.load.others <= spinning.load.cores


@linux_only
def test_so_far_reads_without_ending_the_watch_and_loads_add_up():
    with timing.LoadMonitor() as watch:
        time.sleep(0.1)
        first = watch.so_far()
        time.sleep(0.1)
    assert 0 < first.seconds < watch.load.seconds
    both = first + watch.load
    assert both.seconds == pytest.approx(first.seconds + watch.load.seconds)
    low, high = sorted((first.others, watch.load.others))
    assert low - 1e-9 <= both.others <= high + 1e-9


def test_without_proc_stat_the_load_is_unknown_and_nothing_breaks():
    load = timing.Load(0.3, 2)
    assert load.others is None and not load.busy_machine
    assert "unknown" in load.describe()
    assert timing.choose_threads(load) == 2
    assert timing.Verdict.judge(load, {"a": 0.01}).reliable


@pytest.mark.parametrize("others", [0.0, 0.2, 0.49, 0.5, 1.0, 1.6, 3.0, 100.0])
@pytest.mark.parametrize("cores", [1, 2, 16])
def test_the_thread_chooser_stays_within_one_and_the_cores(cores, others):
    load = timing.Load(0.3, cores, busy=others, own=0.0)
    for most in (None, 1, cores, cores + 4):
        threads = timing.choose_threads(load, most=most)
        assert 1 <= threads <= cores
        if most is not None:
            assert threads <= max(1, most)
    # a core is taken from half a core of other work on, the verdict's busy line
    assert timing.choose_threads(load) == max(1, cores - int(others + 0.5))


@linux_only
def test_the_thread_chooser_leaves_the_hogs_core():
    with cpu_hog():
        load = timing.probe(0.5)
    assert timing.choose_threads(load) <= load.cores - 1 or load.cores == 1


def test_interleaved_rounds_give_one_result_each_with_noise_and_consistent_ratios():
    runs = {"short": lambda: sum(range(50)), "long": lambda: sum(range(2000)),
            ("a", "tuple key"): lambda: None}
    found = timing.interleaved(runs, rounds=3, min_run_time=0.005, num_threads=1)
    assert set(found) == set(runs)
    for result in found.values():
        assert len(result.rounds_us) == 3 and result.calls_per_round >= 1
        assert result.num_threads == 1
        assert result.noise >= 0 and result.median_us > 0
    ratio, noise = timing.ratio(found["short"], found["long"])
    assert ratio == pytest.approx(found["short"].median_us / found["long"].median_us)
    assert noise == max(found["short"].noise, found["long"].noise)


def test_spread_is_iqr_over_median():
    assert timing.spread([5.0]) == 0.0
    # quantiles of 1..5 with linear interpolation: 2 and 4, median 3
    assert timing.spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2 / 3)
    assert timing.spread([3.0, 1.0, 5.0, 4.0, 2.0]) == pytest.approx(2 / 3)


QUIET = timing.Load(1.0, 2, busy=0.05, own=0.0)
BUSY = timing.Load(1.0, 2, busy=1.0, own=0.0)


def test_the_verdict():
    quiet = timing.Verdict.judge(QUIET, {"a fwd": 0.02, "a bwd": 0.05})
    assert quiet.reliable and not quiet.busy and quiet.summary().startswith("quiet")
    busy = timing.Verdict.judge(BUSY, {"a fwd": 0.02})
    assert busy.busy and not busy.reliable
    assert "BUSY" in busy.summary() and "UNRELIABLE" in busy.summary()
    assert busy.unreliable(0.0)  # steady numbers from a busy machine are still made up
    noisy = timing.Verdict.judge(QUIET, {"a fwd": 0.02, "b bwd": 0.25})
    assert not noisy.busy and not noisy.reliable and dict(noisy.noisy) == {"b bwd": 0.25}
    assert "NOISY" in noisy.summary() and "b bwd 25%" in noisy.summary()
    assert noisy.unreliable(0.25) and not noisy.unreliable(0.02)
    again = timing.Verdict.from_dict(noisy.as_dict())
    assert again.summary() == noisy.summary()


def demo_module():
    spec = importlib.util.spec_from_file_location("demo", stages.REPO / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_marks_ratios_unreliable_on_a_busy_machine():
    demo = demo_module()
    steady = timing.Repeated((100.0, 101.0, 99.0), 10, 2)
    fast = timing.Repeated((50.0, 50.5, 49.5), 10, 2)
    base = (steady, steady)
    for load, marked in ((QUIET, False), (BUSY, True)):
        verdict = timing.Verdict.judge(load, {"x": steady.noise, "y": fast.noise})
        line = demo.line_text("07 extops.lltm (cpu)", (fast, fast), base, verdict)
        assert "(2.00x +-" in line
        assert ("UNRELIABLE" in line) == marked, line
        assert "UNRELIABLE" not in demo.line_text("plain PyTorch (cpu)", base, None, verdict)
    jumpy = timing.Repeated((50.0, 80.0, 40.0), 10, 2)  # noisy on a quiet machine
    verdict = timing.Verdict.judge(QUIET, {"y": jumpy.noise})
    assert "UNRELIABLE" in demo.line_text("jumpy", (fast, jumpy), base, verdict)
