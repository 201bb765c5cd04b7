"""The benchmark keeps working: a smoke run of every op module writes its JSON, Markdown and PNG
and times every implementation it found, validated; the validator refuses a wrong
implementation, which is then reported and never timed; a run cut short leaves what it measured;
the report says whether the machine was busy while timing (or, for older reports, that it was not
measured); `--render` of the committed LLTM report gives the committed Markdown. (Speed targets
are reported by the benchmark, never asserted here.)"""

import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import uuid

import pytest
import torch

from workbook import ops
from workbook.build import builder, loader, stages
from workbook.build.loader import import_stage
from workbook.measure import harness
from workbook.ops.lltm import reference
from workbook.spec import Case

RUN = stages.REPO / "bench" / "run.py"
OPS = ops.having("bench")
LLTM = ops.get("lltm")


def devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def scratch_dir():
    return stages.build_root() / "test_bench" / uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def smoke_run():
    """One smoke run of every op into a fresh folder under build/: (folder, completed process)."""
    out = scratch_dir()
    cmd = [sys.executable, str(RUN), "--smoke", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(stages.REPO / "common"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=stages.REPO, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    return out, proc


def reports(out, op):
    return {r["machine"]["device"]: r for r in
            (json.loads(p.read_text()) for p in (out / op).glob("*.json"))}


def test_the_op_modules_are_found():
    assert {"lltm", "deform_conv2d"} <= set(OPS)


@pytest.mark.parametrize("op", OPS)
def test_smoke_run_writes_json_md_png(smoke_run, op):
    out, proc = smoke_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert set(reports(out, op)) == set(devices())
    for report in reports(out, op).values():
        stem = out / op / report["machine"]["slug"]
        for ext in ("md", "png"):
            assert stem.with_suffix(f".{ext}").stat().st_size > 0
        assert stem.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
        assert "## Targets" in stem.with_suffix(".md").read_text()


def expected_implementations(op, device):
    """The keys the benchmark must time on `device`, found apart from it: the op module's
    baselines and reference lines, and every stage of the op that runs there and builds here
    (of the stages building one package, the one a process loads: stages.fullest, the stage with
    the most ops; the others conflict with it)."""
    keys = {i.key for i in harness.load_op(op).implementations(device)}
    here = [s for s in stages.all_stages() if device in s.devices]
    loaded = stages.fullest(here)
    for s in sorted(stages.providing(op), key=lambda s: (loaded.get(s.package) != s, -s.number)):
        if device not in s.devices:
            continue
        try:
            package = import_stage(s)
        except (builder.StageSkipped, loader.StageConflict):
            continue
        if hasattr(package, op):
            keys.add(harness.stage_key(s))
    return keys


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("op", OPS)
def test_smoke_run_validates_and_times_every_implementation(smoke_run, op, device):
    report = reports(smoke_run[0], op)[device]
    assert report["smoke"] is True and report["op"] == op
    assert not report["refused"], report["refused"]
    configs, counts = set(report["configs"]), report["plan_threads"]
    for key in expected_implementations(op, device) - set(report["skipped"]):
        rows = [r for r in report["results"] if r["impl"] == key]
        assert {(r["config"], r["threads"]) for r in rows} == {
            (c, n) for c in configs for n in counts}, f"{key} not measured everywhere"
        for r in rows:
            assert r["validated"] is not r["reference_line"]
            if r["validated"]:
                assert r["max_relative_error"] < 1e-3
            assert all(r[p]["median_us"] > 0 for p in report["phases"])
    assert {t["status"] for t in report["targets"]} <= {"met", "missed", "not evaluated"}


def test_smoke_run_measures_deform_conv2d_memory_and_both_thread_counts(smoke_run):
    report = reports(smoke_run[0], "deform_conv2d")["cpu"]
    if torch.get_num_threads() >= 2:
        assert report["plan_threads"] == [1, 2]
    timed = {r["impl"] for r in report["results"]}
    # At smoke sizes every tensor is under glibc's 64 KiB mmap threshold and may fit in heap
    # already resident: a growth of 0 MB is a measurement, a missing one is not.
    measured = {m["impl"] for m in report["memory"]["results"] if m.get("peak_MB", -1) >= 0}
    assert measured == timed, report["memory"]["results"]


# ----------------------------------------------------------------------------------------------
# The validator


def wrong_output(input, weights, bias, old_h, old_cell):
    """Off by 0.1% in new_cell: small, but far past float32 rounding."""
    new_h, new_cell = reference.lltm(input, weights, bias, old_h, old_cell)
    return new_h, new_cell * 1.001


class _WrongGradient(torch.autograd.Function):
    """Right forward, backward that drops old_cell's gradient (returns zeros)."""

    @staticmethod
    def forward(ctx, input, weights, bias, old_h, old_cell):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (input, weights, bias, old_h, old_cell)]
            outputs = reference.lltm(*leaves)
        ctx.leaves, ctx.outputs = leaves, outputs
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx, grad_h, grad_cell):
        grads = torch.autograd.grad(ctx.outputs, ctx.leaves, (grad_h, grad_cell))
        return (*grads[:4], torch.zeros_like(grads[4]))


def wrong_gradient(*inputs):
    return _WrongGradient.apply(*inputs)


def raises(*inputs):
    raise RuntimeError("kernel exploded")


def returns_nan(*inputs):
    new_h, new_cell = reference.lltm(*inputs)
    return new_h * float("nan"), new_cell


def validate(fn):
    sample = LLTM.make(Case("odd", {"batch": 5, "features": 17, "state": 33}))
    return harness.validate(fn, LLTM, sample, harness.incoming_gradients(LLTM, sample))


def test_validator_accepts_the_reference():
    check = validate(reference.lltm)
    assert check.ok, check.reason
    assert set(check.errors) == {"output new_h", "output new_cell"} | {
        f"gradient of {name}" for name in LLTM.arg_names}


@pytest.mark.parametrize("fn, reason", [
    (wrong_output, r"output new_cell: max \|error\|"),
    (wrong_gradient, r"gradient of old_cell: max \|error\|"),
    (returns_nan, r"output new_h: max \|error\| inf"),
    (raises, r"raised RuntimeError: kernel exploded"),
])
def test_validator_refuses_a_wrong_implementation(fn, reason):
    check = validate(fn)
    assert not check.ok
    assert re.search(reason, check.reason), check.reason


# ----------------------------------------------------------------------------------------------
# Runs on a small plan, in this process


def tiny_lltm(implementations, prepare=lambda config: None, dtype="float32"):
    """The LLTM benchmark on two tiny configurations with the given implementations."""
    configs = (harness.Config("tutorial", {"batch": 2, "features": 3, "state": 4}),
               harness.Config("second", {"batch": 3, "features": 5, "state": 8}))
    bench = harness.load_op("lltm")
    plan = harness.Plan(configs, min_run_time=0.01, profile_iters=1, threads=(1,), dtype=dtype)
    bench = dataclasses.replace(bench, plan=lambda device, smoke: plan, targets=lambda device: [],
                                measure_extra=None)
    impls = [harness.Impl("eager", "plain PyTorch (eager)", reference.lltm, prepare)]
    impls += implementations
    return harness.DeviceRun(bench, "cpu", plan, impls, {}, scratch_dir(), smoke=True,
                             log=lambda *args: None)


def test_a_refused_implementation_is_reported_not_timed():
    run = tiny_lltm([harness.Impl("wrong", "deliberately wrong", wrong_output)])
    report = run.run()
    assert {(r["impl"], r["config"]) for r in report["refused"]} == {
        ("wrong", "tutorial"), ("wrong", "second")}
    assert {r["impl"] for r in report["results"]} == {"eager"}
    written = json.loads((run.out_dir / "cpu-1threads.json").read_text())
    assert written["refused"] == report["refused"]
    assert "deliberately wrong at tutorial: output new_cell" in (
        run.out_dir / "cpu-1threads.md").read_text()


def test_a_run_in_another_dtype_is_validated_at_its_tolerance_and_reported_apart():
    def far_off(*args):  # wrong past bfloat16's tolerance too
        new_h, new_cell = reference.lltm(*args)
        return new_h, new_cell + 0.5

    run = tiny_lltm([harness.Impl("wrong", "deliberately wrong", far_off)], dtype="bfloat16")
    report = run.run()
    assert report["dtype"] == "torch.bfloat16"
    rtol, atol = harness.load_op("lltm").spec.tolerance(torch.bfloat16)
    assert report["tolerance"] == {"rtol": rtol, "atol": atol} and rtol > 1e-3
    assert {r["impl"] for r in report["results"]} == {"eager"}
    assert {r["impl"] for r in report["refused"]} == {"wrong"}
    assert sorted(p.name for p in run.out_dir.glob("*.json")) == ["cpu-1threads-bfloat16.json"]
    assert "- bfloat16; " in (run.out_dir / "cpu-1threads-bfloat16.md").read_text()


def test_a_speed_target_is_read_at_its_own_thread_count_or_the_most():
    def row(impl, threads, us):
        timed = {"median_us": us, "iqr_us": 0.0}
        return {"config": "c", "impl": impl, "threads": threads, "forward": timed}

    report = {"plan_threads": [1, 2], "phases": ["forward"],
              "results": [row("base", 1, 100.0), row("op", 1, 10.0),
                          row("base", 2, 60.0), row("op", 2, 5.0)]}
    bench = dataclasses.replace(harness.load_op("lltm"), targets=lambda device: [
        harness.Target("one", "c", "op", "base", "forward", 11.0, threads=1),
        harness.Target("most", "c", "op", "base", "forward", 11.0),
        harness.Target("three", "c", "op", "base", "forward", 11.0, threads=3)])
    one, most, three = harness.evaluate_targets(bench, "cpu", report)
    assert (one["value"], one["status"]) == (10.0, "missed")
    assert (most["value"], most["status"]) == (12.0, "met")
    assert three["status"] == "not evaluated" and "(3 threads)" in three["why"]


def test_the_command_line_takes_the_dtypes_the_harness_knows():
    spec = importlib.util.spec_from_file_location("bench_run", RUN)
    bench_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_run)
    assert bench_run.parse([]).dtype == "float32"
    assert bench_run.parse(["--dtype", "float16"]).dtype == "float16"
    with pytest.raises(SystemExit):
        bench_run.parse(["--dtype", "int8"])
    assert all(isinstance(getattr(torch, d), torch.dtype) for d in harness.DTYPES)


class CutShort(Exception):
    pass


def test_a_run_cut_short_leaves_what_it_measured():
    def stop_at_second(config):
        if config.name == "second":
            raise CutShort

    run = tiny_lltm([], prepare=stop_at_second)
    with pytest.raises(CutShort):
        run.run()
    written = json.loads((run.out_dir / "cpu-1threads.json").read_text())
    assert {(r["impl"], r["config"]) for r in written["results"]} == {("eager", "tutorial")}
    assert math.isfinite(written["results"][0]["forward"]["median_us"])


def test_the_report_says_whether_the_machine_was_busy():
    from workbook.measure import timing

    run = tiny_lltm([])
    report = run.run()
    verdict = timing.Verdict.from_dict(report["verdict"])  # the load while timing, every timing
    assert verdict.timings == 2 * 2 and verdict.load.seconds > 0
    assert "- while timing: " in (run.out_dir / "cpu-1threads.md").read_text()
    busy = timing.Verdict.judge(timing.Load(1.0, 2, busy=1.5, own=0.2), {"eager fwd": 0.01})
    text = harness.markdown(dict(report, verdict=busy.as_dict()), run.bench, "x.png")
    assert "**The machine is BUSY: other processes used 1.3 of our 2 cores" in text
    assert "the timings are UNRELIABLE, not results.**" in text
    del report["verdict"]  # a report from before the harness watched the load
    assert "while timing: not measured" in harness.markdown(report, run.bench, "x.png")


def test_render_of_the_committed_lltm_report_gives_its_markdown():
    committed = stages.REPO / "bench" / "results" / "lltm"
    copy = scratch_dir() / "lltm"  # an older report's op is its folder's name
    copy.mkdir(parents=True)
    for name in ("cpu-2threads.json", "cpu-2threads.notes.md"):
        shutil.copy(committed / name, copy / name)
    paths = harness.render(copy / "cpu-2threads.json")
    assert paths["md"].read_text() == (committed / "cpu-2threads.md").read_text()
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


FLOOR = stages.REPO / "bench" / "ms_deform_attn_floor.cpp"


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on PATH to compile the probe")
def test_the_floor_probe_compiles_with_its_run_cards_flags():
    # The run card's own command, checked for errors only (its run takes seconds of timing).
    card = re.search(r"^//   (g\+\+ .*) -o \S+$", FLOOR.read_text(), re.M)
    assert card, f"{FLOOR.name}: no g++ command in its run card"
    cmd = [*card.group(1).split(), "-fsyntax-only", "-Wall", "-Werror"]
    proc = subprocess.run(cmd, cwd=stages.REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
