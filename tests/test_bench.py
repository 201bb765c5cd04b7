"""The LLTM benchmark keeps working: its smoke mode runs end to end, and its validator refuses a
wrong implementation before timing it. (Speed targets are reported by the benchmark, never
asserted here.)"""

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import uuid

import pytest
import torch
from lltm_base import lltm_inputs

from workbook import build, reference

BENCH = build.REPO / "bench" / "lltm_bench.py"


@functools.cache
def bench():
    spec = importlib.util.spec_from_file_location("lltm_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def expected_implementations(device):
    """The implementation keys the benchmark must validate on `device`, found independently of
    it: the baselines and every LLTM stage that runs there and builds here."""
    keys = {"eager", "compile"}
    for s in build.STAGES.values():
        if not s.source_dir.is_dir() or device not in bench().runs_on(s):
            continue
        try:
            module = build.import_stage(s.number)
        except build.StageSkipped:
            continue
        if hasattr(module, "lltm"):
            keys.add(f"stage{s.number:02d}")
    return keys


@pytest.fixture(scope="module")
def smoke_run():
    """One smoke run into a fresh folder under build/; (output folder, completed process)."""
    out = build.build_root() / "test_bench" / uuid.uuid4().hex[:8]
    # One intra-op thread: on a small machine that others are compiling on, two OpenMP threads
    # wait on each other for milliseconds per op; the smoke run checks function, not speed.
    cmd = [sys.executable, str(BENCH), "--smoke", "--threads", "1", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(build.REPO / "common"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=build.REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    return out, proc


def devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_smoke_run_writes_json_md_png(smoke_run):
    out, proc = smoke_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for device in devices():
        slug = "cpu-1threads" if device == "cpu" else None
        jsons = [p for p in out.glob("*.json")
                 if json.loads(p.read_text())["machine"]["device"] == device]
        assert len(jsons) == 1, f"one {device} report expected in {out}, found {jsons}"
        if slug:
            assert jsons[0].stem == slug
        for ext in ("md", "png"):
            assert jsons[0].with_suffix(f".{ext}").stat().st_size > 0
        assert jsons[0].with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("device", devices())
def test_smoke_run_validates_every_implementation(smoke_run, device):
    out, _ = smoke_run
    report = next(r for r in (json.loads(p.read_text()) for p in out.glob("*.json"))
                  if r["machine"]["device"] == device)
    assert report["smoke"] is True
    assert report["machine"]["threads"] == 1
    assert not report["refused"], report["refused"]
    configs = {r["config"] for r in report["results"]}
    assert {"tutorial", "large"} <= configs and any(c.startswith("sweep-") for c in configs)
    for key in expected_implementations(device):
        entries = [r for r in report["results"] if r["impl"] == key]
        assert {r["config"] for r in entries} == configs, f"{key} not measured everywhere"
        for r in entries:
            assert r["validated"] is True
            assert r["max_relative_error"] <= bench().TOLERANCE[torch.float32]
            assert r["forward"]["median_us"] > 0 and r["backward"]["median_us"] > 0
    assert {t["status"] for t in report["targets"]} <= {"met", "missed", "not evaluated"}
    md = (out / f"{report['machine']['slug']}.md").read_text()
    assert "## Targets" in md and "Forward: " in md
    if device == "cuda":
        assert report["bandwidth"]["copy"]["GBps"] > 0


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


def validate(fn, config_sizes=(5, 17, 33)):
    b = bench()
    config = b.Config("test", *config_sizes)
    inputs = lltm_inputs(*config_sizes)
    grad_outputs = b.make_grad_outputs(config, "cpu")
    return b.validate(fn, inputs, grad_outputs, b.float64_reference(inputs, grad_outputs))


def test_validator_accepts_the_reference():
    check = validate(reference.lltm)
    assert check.ok, check.reason
    assert set(check.errors) == {"new_h", "new_cell", "grad input", "grad weights", "grad bias",
                                 "grad old_h", "grad old_cell"}


@pytest.mark.parametrize("fn, reason", [
    (wrong_output, r"new_cell: relative error"),
    (wrong_gradient, r"grad old_cell: relative error"),
    (returns_nan, r"new_h: relative error nan"),
    (raises, r"raised RuntimeError: kernel exploded"),
])
def test_validator_refuses_a_wrong_implementation(fn, reason):
    check = validate(fn)
    assert not check.ok
    assert re.search(reason, check.reason), check.reason


def test_a_refused_implementation_is_reported_not_timed():
    b = bench()
    plan = b.Plan(b.Config("tutorial", 2, 3, 4), b.Config("large", 3, 5, 8), 2, 3, (4,),
                  min_run_time=0.01, profile_iters=1)
    impls = [b.Impl("eager", "plain PyTorch (eager)", reference.lltm),
             b.Impl("wrong", "deliberately wrong", wrong_output)]
    section = b.run_device("cpu", plan, impls, log=lambda *a: None)
    assert {(r["impl"], r["config"]) for r in section["refused"]} == {
        ("wrong", "tutorial"), ("wrong", "large"), ("wrong", "sweep-s4")}
    assert all(r["impl"] == "eager" for r in section["results"])
    assert {r["config"] for r in section["results"]} == {"tutorial", "large", "sweep-s4"}
