"""The shared test base: the checks every op's tests run, and the parameters they run over.

A stage's test file says what it tests with plain ``pytest.mark.parametrize``, so a reader sees
every case, device, dtype and layout in the file itself; each test body is one call into this
module, against the op's descriptor (workbook.ops):

    SPEC = ops.get("lltm")
    STAGE = stages.here(__file__)

    def lltm(*args, **kwargs):                 # the implementation under test
        return import_stage(STAGE).lltm(*args, **kwargs)

    @pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], [torch.float32]), ids=str)
    def test_against_reference(p):
        testing.assert_against_reference(lltm, SPEC, p.sample(SPEC))

What the checks check:

* assert_against_reference: outputs, and the gradient of every input that requires grad, against
  the float64 reference with the same incoming gradients, within the dtype's tolerances;
* assert_gradcheck: torch.autograd.gradcheck in float64 with the op's options (nondet_tol, ...);
  a mismatch in fast mode fails at once (torch's own rewording would rerun it in slow mode);
* assert_layout: the same values stored strided, permuted, expanded (stride 0) or channels_last
  give the same answer, or, for a kernel that refuses them, a clear error;
* assert_requires_grad_of_one: only one input (or none) requires grad; the others get none;
* assert_bad_input: a bad input raises the expected exception, naming the argument;
* assert_opcheck: torch.library.opcheck (schema, fake kernel, autograd registration, AOT
  dispatch) on a registered op;
* assert_compiled: torch.compile(fullgraph=True), static or dynamic shapes, against eager;
* on CUDA: assert_cuda_matches_cpu; on a real GPU: assert_graph_capture,
  assert_runs_on_inputs_device.

The CUDA tests run on `CUDA`: "cuda" where a GPU is visible, else the emulated CUDA device
(workbook.build.emulate: the stage's own kernels compiled for the CPU, "emulated_cuda" in test ids),
unless WORKBOOK_CUDA=off. Tests marked `requires_cuda`, and parameters on `CUDA`, carry the pytest
mark `cuda`, which the repository's conftest.py counts: each run says how many tests ran emulated.
What only a GPU can show (graph capture, streams, a second device, memory past 2^31 elements) is
marked `requires_gpu(what)` and skipped without one, with the reason. Devices that are not here
are skipped with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import pytest
import torch

from workbook.build import emulate
from workbook.build.loader import import_stage
from workbook.spec import BadInput, Case, OpSpec, Sample, as_tuple, compare, dtype_name, relayout

# ----------------------------------------------------------------------------------------------
# Parameters


def no_device_reason(device: str) -> str | None:
    """Why `device` cannot run here, or None when it can."""
    if emulate.is_emulated(device):
        return None if emulate.active() else "the emulated CUDA device is off (WORKBOOK_CUDA=off)"
    kind = torch.device(device).type
    if kind == "cuda":
        if not torch.version.cuda:
            return f"this torch ({torch.__version__}) is a CPU-only build"
        if not torch.cuda.is_available():
            return "no CUDA device visible (torch.cuda.is_available() is False)"
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            return f"needs {index + 1} CUDA devices, {torch.cuda.device_count()} visible"
    return None


# The device the CUDA tests run on, and how the C++ checks name its type in their messages.
CUDA = emulate.cuda_device()
EMULATED = emulate.is_emulated(CUDA)
CUDA_TYPE_NAME = emulate.DEVICE if EMULATED else "cuda"  # as torch.device spells it
NO_CUDA = no_device_reason(CUDA)
NO_GPU = no_device_reason("cuda")


def requires_cuda(test):
    """A test of CUDA kernels: it runs on `CUDA` (a GPU, or the emulated device)."""
    test = pytest.mark.cuda(test)
    return pytest.mark.skipif(NO_CUDA is not None, reason=NO_CUDA or "")(test)


def requires_gpu(what: str):
    """A test of what only a real GPU has (`what`: say, "CUDA graph capture"): skipped without
    one, the emulated device included, which has no streams, graphs or device memory."""
    reason = f"{what} needs a real GPU ({NO_GPU}); the emulated CUDA device cannot show it"
    return pytest.mark.skipif(NO_GPU is not None, reason=reason)


requires_two_gpus = pytest.mark.skipif(no_device_reason("cuda:1") is not None,
                                       reason=no_device_reason("cuda:1") or "")


def _marks(device: str) -> list:
    reason = no_device_reason(device)
    marks = [pytest.mark.skip(reason=reason)] if reason else []
    if emulate.is_emulated(device) or torch.device(device).type == "cuda":
        marks.append(pytest.mark.cuda)
    return marks


@dataclasses.dataclass(frozen=True)
class Params:
    """What one parametrized test runs on: a case of the op, a device and a dtype."""

    case: Case
    device: str
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{self.device}-{dtype_name(self.dtype)}-{self.case.name}"

    def sample(self, spec: OpSpec, requires_grad: bool = True) -> Sample:
        return spec.make(self.case, device=self.device, dtype=self.dtype,
                         requires_grad=requires_grad)


def params(spec: OpSpec, devices: Sequence[str], dtypes: Sequence[torch.dtype] | None = None,
           cases: Iterable[Case] | None = None, *, batch0: bool = True) -> list:
    """pytest params over cases x devices x dtypes (the op's own cases and dtypes by default),
    plus a batch-0 case; a device that is not here is skipped with the reason.

    A case marked `sized` (its size is the point: grids past a launch limit, loops of many
    turns) runs on the emulated CUDA device in float32 alone (or the first dtype, without it):
    the other dtypes run the same kernel templates, with the same accumulators, in the cases
    beside it, and each of its emulated runs takes tens of seconds. On the CPU and on a GPU it
    runs in every dtype."""
    cases = list(spec.cases if cases is None else cases)
    if batch0:
        cases.append(spec.batch0())
    found = []
    for device in devices:
        marks = _marks(device)
        chosen = list(dtypes or spec.dtypes)
        one = torch.float32 if torch.float32 in chosen else chosen[0]
        for dtype in chosen:
            for case in cases:
                if case.sized and dtype != one and emulate.is_emulated(device):
                    continue
                p = Params(case, device, dtype)
                found.append(pytest.param(p, marks=marks, id=str(p)))
    return found


def device_params(devices: Sequence[str]) -> list:
    """pytest params for devices, skipped with the reason where a device is not here."""
    return [pytest.param(device, marks=_marks(device), id=device) for device in devices]


def bad_input_params(spec: OpSpec, devices: Sequence[str]) -> list:
    """pytest params (device, BadInput) for every bad input of the op on every device."""
    out = []
    for device in devices:
        reason = no_device_reason(device)
        marks = _marks(device)
        # The bad inputs of a device that is not here cannot even be listed; one skipped stand-in.
        bad = spec.bad_inputs(device) if not reason else \
            [BadInput("any", lambda d: None, Exception, "")]
        out += [pytest.param(device, b, marks=marks, id=f"{device}-{b.name}") for b in bad]
    return out


# ----------------------------------------------------------------------------------------------
# The checks


def assert_against_reference(fn: Callable, spec: OpSpec, sample: Sample) -> None:
    """Outputs and input gradients of fn against the float64 reference."""
    compare(fn, spec, sample).assert_ok()


def assert_forward(fn: Callable, spec: OpSpec, sample: Sample) -> None:
    """Outputs only, with no input requiring grad: nothing may be recorded for autograd."""
    sample = sample.detached(requires_grad=False)
    compare(fn, spec, sample, gradients=False).assert_ok()
    for k, out in enumerate(as_tuple(sample.call(fn))):
        assert out.grad_fn is None and not out.requires_grad, (
            f"output {k} requires grad although no input does")


def assert_gradcheck(fn: Callable, spec: OpSpec, sample: Sample, **options) -> None:
    """torch.autograd.gradcheck in float64: the analytical gradients against finite differences
    (fast mode, random projections, for cases marked full_gradcheck=False). A mismatch fails with
    torch's fast-mode numbers and the input's name, at once (_fast_mode_verdict says why)."""
    assert sample.dtype == torch.float64, "gradcheck needs float64"
    call, tensors = sample.bind(fn)
    assert tensors, "gradcheck needs an input that requires grad"
    if emulate.is_emulated(sample.device):
        # Every ATen op around the kernels takes a round trip through the CPU there: the
        # slow mode's column-by-column Jacobian takes minutes, the fast mode's projections
        # seconds (the CPU kernels' tests run the slow mode on the same cases).
        options["fast_mode"] = True
    names = [name for name, _ in sample.differentiable()]
    with _fast_mode_verdict(names):
        assert torch.autograd.gradcheck(call, tensors, **{**spec.gradcheck, **options})


# What torch's fast-mode gradcheck says on a mismatch, without its slow-mode recomputation
# (torch/autograd/gradcheck.py, the same in torch 2.13 and 2.14): when the projections v^T J u of
# the analytical and the numerical Jacobian differ, _check_analytical_numerical_equal calls
# _run_slow_mode_and_get_error, which computes both whole Jacobians column by column only to print
# them under the verdict. That is the slow mode that fast mode was chosen to avoid: on the emulated
# device, with a one-line fault in stage 09's forward kernel, one gradcheck (detr_small_b2_q20)
# still ran after 15 minutes; its verdict alone takes 2 s. While assert_gradcheck runs, that
# function is replaced by a note naming the input; the verdict and the fast-mode numbers in its
# message stay torch's. A torch without the function, or with another signature, keeps its own
# behaviour.
_SLOW_MODE_ERROR = "_run_slow_mode_and_get_error"
_SLOW_MODE_PARAMETERS = ("func", "tupled_inputs", "outputs", "input_idx", "output_idx", "rtol",
                         "atol", "eps", "is_forward_ad")


@contextlib.contextmanager
def _fast_mode_verdict(names: Sequence[str]):
    """Within it, a fast-mode gradcheck mismatch raises at once: torch's message (the output and
    input, the analytical and numerical v^T J u) and a note naming the input (`names`: the inputs
    that require grad, in gradcheck's order), without the slow-mode Jacobians."""
    import importlib
    import inspect

    try:
        module = importlib.import_module("torch.autograd.gradcheck")
        slow = getattr(module, _SLOW_MODE_ERROR)
        known = tuple(inspect.signature(slow).parameters) == _SLOW_MODE_PARAMETERS
    except (ImportError, AttributeError, TypeError, ValueError):  # not there, or not as known
        known = False
    if not known:
        yield
        return

    def note(func, tupled_inputs, outputs, input_idx, output_idx, rtol, atol, eps,
             is_forward_ad):
        name = names[input_idx] if 0 <= input_idx < len(names) else f"input {input_idx}"
        projection = "J u for a random unit vector u" if is_forward_ad else \
            "v^T J u for random unit vectors u and v"
        return (f"\n(input {input_idx} is `{name}`. Fast mode: the numbers above are {projection}, "
                f"one projection of each Jacobian, not elements; "
                f"torch's recomputation of the whole Jacobians in slow mode for this message is "
                f"skipped, see workbook.testing._fast_mode_verdict. To see them, run "
                f"gradcheck(fast_mode=False) on a small case on the CPU.)\n")

    setattr(module, _SLOW_MODE_ERROR, note)
    try:
        yield
    finally:
        setattr(module, _SLOW_MODE_ERROR, slow)


def assert_layout(fn: Callable, spec: OpSpec, sample: Sample, layout: str,
                 refused: str | None = None) -> None:
    """The sample's values stored in `layout` give the reference's answer, or, when `refused`
    (a regex) is given, raise a RuntimeError matching it."""
    moved = relayout(sample, layout)
    if refused is not None:
        with pytest.raises(RuntimeError, match=refused):
            moved.call(fn)
        return
    changed = [name for (name, a), (_, b) in zip(sample.tensors(), moved.tensors())
               if a.dim() > 1 and a.numel() > 1 and a.stride() != b.stride()]
    assert changed, f"layout {layout} left every tensor as it was"
    compare(fn, spec, moved).assert_ok()


def assert_requires_grad_of_one(fn: Callable, spec: OpSpec, sample: Sample,
                               name: str | None) -> None:
    """Only the input `name` requires grad (None: no input does): its gradient is right and the
    call records nothing else."""
    chosen = sample.detached(requires_grad=[name] if name else False)
    compare(fn, spec, chosen).assert_ok()
    if name is None:
        assert all(o.grad_fn is None for o in as_tuple(chosen.call(fn)))


def assert_bad_input(fn: Callable, bad: BadInput, device: str) -> None:
    sample = bad.make(device)
    with pytest.raises(bad.error, match=bad.match):
        sample.call(fn)


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")


def assert_opcheck(op, sample: Sample, test_utils: Sequence[str] = OPCHECK_TESTS) -> None:
    """torch.library.opcheck of the registered op on the sample's arguments. (On the emulated
    device without test_autograd_registration, which knows CPU, CUDA and XPU alone: the op's
    autograd registration is one for every device, checked by the CPU tests.)"""
    if any(emulate.is_emulated(t.device) for _, t in sample.tensors()):
        test_utils = [t for t in test_utils if t != "test_autograd_registration"]
    torch.library.opcheck(op, sample.args, dict(sample.kwargs), test_utils=tuple(test_utils))


def assert_compiled(fn: Callable, sample: Sample, *, dynamic: bool | None = False, calls: int = 1,
                   **compile_kwargs) -> None:
    """torch.compile(fn, fullgraph=True): outputs and input gradients equal eager's (the last of
    `calls` compiled calls: a CUDA-graph mode records first and replays after)."""
    torch._dynamo.reset()
    if emulate.is_emulated(sample.device) and "backend" not in compile_kwargs:
        # Inductor generates code for the CPU and real GPUs only; on the emulated device the
        # graph is captured (dynamo, the fake kernels, AOT autograd) and run eagerly.
        compile_kwargs["backend"] = "aot_eager"
    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic, **compile_kwargs)
    wanted = [t for _, t in sample.differentiable()]

    def run(f):
        outputs = as_tuple(sample.call(f))
        grads = torch.autograd.grad(outputs, wanted, [torch.ones_like(o) for o in outputs],
                                    allow_unused=True) if wanted else ()
        return outputs, grads

    results = [None, run(fn)]
    for _ in range(calls):
        results[0] = run(compiled)
    for a, b in zip(results[0][0] + results[0][1], results[1][0] + results[1][1]):
        torch.testing.assert_close(a, b)


# Differentiation modes and autocast: what an op with a reverse-mode formula only must do with
# forward-mode AD and torch.func (refuse, naming the op), with torch.vmap (work) and inside a
# torch.autocast region (compute in the region's dtype, whatever mix of dtypes it is given).


def _first_tensor_function(fn: Callable, sample: Sample):
    """fn as a function of the sample's first tensor argument alone, returning its first output;
    and that argument (detached)."""
    k = next(i for i, a in enumerate(sample.args) if isinstance(a, torch.Tensor))
    x = sample.args[k].detach()

    def of_x(value):
        args = list(sample.args)
        args[k] = value
        return as_tuple(fn(*args, **sample.kwargs))[0]

    return of_x, x


def assert_reverse_mode_only(fn: Callable, sample: Sample, op_name: str) -> None:
    """Forward-mode AD and torch.func's gradient transforms raise NotImplementedError naming the
    op (never a silent zero tangent); torch.vmap gives what a loop gives."""
    import torch.autograd.forward_ad as fw_ad

    sample = sample.detached(requires_grad=False)
    f, x = _first_tensor_function(fn, sample)
    with (pytest.raises(NotImplementedError, match=rf"^{op_name}: forward-mode AD"),
          fw_ad.dual_level()):
        f(fw_ad.make_dual(x, torch.ones_like(x)))
    transforms = {
        "jvp": lambda: torch.func.jvp(f, (x,), (torch.ones_like(x),)),
        "jacfwd": lambda: torch.func.jacfwd(f)(x),
        "grad": lambda: torch.func.grad(lambda v: f(v).sum())(x),
        "vjp": lambda: torch.func.vjp(f, x),
        "jacrev": lambda: torch.func.jacrev(f)(x),
    }
    for name, transform in transforms.items():
        with pytest.raises(NotImplementedError, match=rf"^{op_name}: torch.func"):
            transform()
            pytest.fail(f"torch.func.{name} was not refused")
    batch = torch.stack([x, 0.5 * x])
    batched = torch.vmap(f)(batch)
    torch.testing.assert_close(batched, torch.stack([f(batch[0]), f(batch[1])]))


def assert_autocast(fn: Callable, spec: OpSpec, sample: Sample) -> None:
    """`sample` in bfloat16. Inside torch.autocast(bfloat16) on the sample's device the op is
    given its first tensor in float32 (what a layer before it may produce in such a region) and
    the rest in bfloat16: it computes in bfloat16, returns bfloat16, and matches the reference,
    gradients included, within bfloat16's tolerances."""
    assert sample.dtype == torch.bfloat16, "assert_autocast needs a bfloat16 sample"
    k = next(i for i, a in enumerate(sample.args) if isinstance(a, torch.Tensor))

    def in_region(*args, **kwargs):
        args = list(args)
        args[k] = args[k].float()
        with torch.autocast(sample.device.type, dtype=torch.bfloat16):
            out = fn(*args, **kwargs)
        dtypes = [o.dtype for o in as_tuple(out)]
        assert all(d == torch.bfloat16 for d in dtypes), f"outputs in {dtypes} under autocast"
        return out

    compare(in_region, spec, sample).assert_ok()


def assert_imports_alone(stage, snippet: str, cwd) -> str:
    """Run `snippet` in a fresh interpreter that sees the stage's built package and nothing of the
    workbook (what `pip install` ships: the package and torch); returns what it printed."""
    import os
    import subprocess
    import sys

    import_stage(stage)
    env = dict(os.environ, PYTHONPATH=str(stage.lib_dir))
    check = (f"import sys\n{snippet}\n"
             f"assert 'workbook' not in sys.modules, 'imported the workbook'\n")
    result = subprocess.run([sys.executable, "-c", check], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def run_tests_of(path: str, namespace: dict) -> None:
    """Define another stage's tests in the calling test module: the file `path` (relative to the
    stages folder) is executed in `namespace`, the caller's globals(), so its
    ``stages.here(__file__)`` is the calling stage and every test it defines runs on the calling
    stage's package. How a stage that compiles an earlier stage's kernels as they are runs that
    stage's tests too, without a copy of them (stage 06: stage 05's test_lltm.py).

    The asserts are rewritten as pytest rewrites a test module's, so a failing one shows its
    values; the caller's docstring is kept."""
    import ast

    here = Path(namespace["__file__"]).resolve()
    source = here.parent.parent / path
    if not source.is_file():
        raise FileNotFoundError(f"{here.name}: no test file {path} beside this stage ({source})")
    text = source.read_text()
    tree = ast.parse(text, str(source))
    try:  # pytest's own assertion rewriting, as for any test module it imports
        from _pytest.assertion.rewrite import rewrite_asserts

        rewrite_asserts(tree, text.encode(), source)
    except ImportError:  # an older or newer pytest without it: plain asserts still check
        pass
    doc = namespace.get("__doc__")
    exec(compile(tree, str(source), "exec"), namespace)
    namespace["__doc__"] = doc


# ----------------------------------------------------------------------------------------------
# On a GPU


def assert_cuda_matches_cpu(fn: Callable, spec: OpSpec, case: Case, cpu_fn: Callable | None = None,
                           rtol: float = 1e-5, atol: float = 1e-4) -> None:
    """fn on CUDA (`CUDA`: a GPU or the emulated device) against cpu_fn (fn itself by default)
    on the CPU, on the same float32 values: outputs and every input gradient."""
    cpu = spec.make(case, device="cpu", dtype=torch.float32)
    cuda = cpu.map(lambda _, t: t.detach().to(CUDA).requires_grad_(t.requires_grad))
    results = []
    for f, s in ((cpu_fn or fn, cpu), (fn, cuda)):
        outputs = as_tuple(s.call(f))
        grads = torch.autograd.grad(outputs, [t for _, t in s.differentiable()],
                                    [torch.ones_like(o) for o in outputs])
        results.append(outputs + grads)
    for a, b in zip(*results):
        torch.testing.assert_close(b.cpu(), a, rtol=rtol, atol=atol)


def assert_graph_capture(fn: Callable, spec: OpSpec, case: Case) -> None:
    """Capture forward + backward in a CUDA graph, replay it on new input values, compare with
    eager. A kernel launched on any stream but the current one (the capture's) fails capture."""
    sample = spec.make(case, device="cuda", dtype=torch.float32)
    inputs = [t for _, t in sample.differentiable()]

    def step():
        outputs = as_tuple(sample.call(fn))
        return outputs, torch.autograd.grad(sum(o.sum() for o in outputs), inputs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the graph, as capture requires
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs, grads = step()

    fresh = spec.make(case, device="cuda", dtype=torch.float32, seed=7)
    with torch.no_grad():
        for (_, static), (_, new) in zip(sample.tensors(), fresh.tensors()):
            static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    eager = as_tuple(fresh.call(fn))
    eager_grads = torch.autograd.grad(sum(o.sum() for o in eager),
                                      [t for _, t in fresh.differentiable()])
    for a, b in zip(outputs + grads, eager + eager_grads):
        torch.testing.assert_close(a, b)


def assert_runs_on_inputs_device(fn: Callable, spec: OpSpec, case: Case) -> None:
    """With cuda:0 current and the inputs on cuda:1, the kernels run (and write) on cuda:1."""
    sample = spec.make(case, device="cuda:1", requires_grad=False)
    with torch.cuda.device(0):
        out = as_tuple(sample.call(fn))
    expected = as_tuple(sample.map(lambda _, t: t.to("cuda:0")).call(fn))
    for a, b in zip(out, expected):
        assert a.device == torch.device("cuda:1")
        torch.testing.assert_close(a.to("cuda:0"), b)


def assert_bad_input_compiled(fn: Callable, bad: BadInput, device: str) -> None:
    """The bad input refused under torch.compile(fullgraph=True) too, while tracing (the fake
    kernel's checks run on fake tensors). Dynamo wraps what the fake kernel raises in a
    TorchRuntimeError that quotes its message, and a check of the Python functional form (one
    that raises before the op) in an Unsupported error ("Observed exception") that quotes it, so
    the message is what is checked."""
    torch._dynamo.reset()
    sample = bad.make(device)
    compiled = torch.compile(fn, fullgraph=True)
    traced = (torch._dynamo.exc.TorchRuntimeError, torch._dynamo.exc.Unsupported)
    with pytest.raises((bad.error, *traced), match=bad.match):
        sample.call(compiled)


def assert_same_error_everywhere(fn: Callable, bad: BadInput, devices: Sequence[str]) -> None:
    """The bad input raises the same exception with the same message on every device: the C++
    checks of each backend and the fake kernel (meta) word every error alike. Device names, which
    differ by construction, are masked before comparing."""
    seen = {}
    for device in devices:
        with pytest.raises(bad.error) as caught:
            bad.make(device).call(fn)
        text = str(caught.value)
        for name in devices:
            text = text.replace(str(torch.device(name)), "<device>").replace(name, "<device>")
        seen[device] = (type(caught.value).__name__, text.replace("<device>:0", "<device>"))
    first = devices[0]
    for device, error in seen.items():
        assert error == seen[first], f"{first} says {seen[first]}, {device} says {error}"


def working_copy(destination):
    """The repository's files (tracked, and untracked ones git does not ignore) copied to
    `destination` (a Path): a checkout to change, build and test without touching this one.
    Run the workbook there with PYTHONPATH=<copy>/common, so its own common/ is the one used."""
    import shutil
    import subprocess

    from workbook.build.stages import REPO

    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def working_copy_in_build(name: str) -> tuple[Path, dict]:
    """A working copy (above) at build/working-copies/<name>/repo/, emptied first, and the
    environment that runs the workbook there: the copy's common/ on PYTHONPATH, its builds in
    build/working-copies/<name>/build/. Inside this clone and at the same place every run, so the
    compiler cache finds its compiles again from any clone: the copy keeps this clone's
    CCACHE_BASEDIR (workbook.build.compiler), under which the venv's headers lie too."""
    import os

    from workbook.build import compiler, stages

    folder = stages.empty_build_folder("working-copies", name)
    compiler.compiler_cache()
    copy = working_copy(folder / "repo")
    env = dict(os.environ, PYTHONPATH=str(copy / "common"),
               WORKBOOK_BUILD_DIR=str(folder / "build"))
    return copy, env


# ----------------------------------------------------------------------------------------------
# Past 2^31 elements: opt-in (WORKBOOK_HUGE_TESTS=1), on a GPU with the memory; the outputs are
# compared a chunk at a time (workbook.spec.assert_rows_close).


def huge_reason(gigabytes: float) -> str | None:
    """Why the opt-in test past 2^31 elements does not run here, or None when it does."""
    how = (f"opt-in: WORKBOOK_HUGE_TESTS=1 runs it (tensors past 2^31 elements, on a GPU with at "
           f"least {gigabytes} GB of memory)")
    import os

    if os.environ.get("WORKBOOK_HUGE_TESTS") != "1":
        return how
    if NO_GPU is not None:
        return f"{NO_GPU}; {how}"
    total = torch.cuda.get_device_properties(0).total_memory / 1e9
    return f"this GPU has {total:.0f} GB; {how}" if total < gigabytes else None
