"""The emulated CUDA device (workbook.build.emulate): its source pass, CUDA's launch limits, the
order blocks run in, and that it catches a bug planted in a stage's own kernel.

The source pass is checked on text (no build). The rest compiles small kernels of its own, or a
mutated copy of stage 07's, for the emulated device (about a minute each on 2 cores, once), and
runs them in a fresh interpreter where the copy must not meet the stage's own kernels.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from workbook import testing
from workbook.build import builder, emulate, stages

pytest_plugins = ["pytester"]


def mutated_stage() -> stages.Stage:
    """The stage whose CUDA kernels the mutation tests copy and change: the first with the
    deformable convolution's CUDA glue (stage 07)."""
    return next(s for s in stages.all_stages() if "deform_conv2d" in s.ops and s.cuda
                and any(p.name == "deform_conv2d_cuda.cu" for p in emulate.plan(s).sources))


# What this file's tests run of the stages: the mutated stage's build (and what it compiles), and
# one test reads every CUDA stage's plan. Its kept results (workbook.testing.pytest_results)
# stand while those are unchanged.
pytestmark = pytest.mark.reaches(mutated_stage().folder)

# -- the source pass, on text ---------------------------------------------------------------------


def test_a_launch_becomes_a_call_and_keeps_its_lines():
    source = textwrap.dedent("""\
        // kernel<<<1, 2>>>(x) in a comment stays as it is
        void go(float* x, int n) {
          scale_kernel<float, int>
              <<<blocks(n), 256, 0, stream>>>(x, n);
          other<<<dim3(4, 2), dim3(32, 8)>>>(x);
        }
        """)
    out = emulate.rewrite(source, "k.cu")
    body = out.split("\n", 2)[2]  # after the include and the #line directive
    assert body.count("\n") == source.count("\n"), "the pass moved lines"
    assert "kernel<<<1, 2>>>(x) in a comment" in body
    assert ('::workbook::emulate::launch({"scale_kernel", false}, scale_kernel<float, int>\n'
            "      ,blocks(n), 256, 0, stream)(x, n);") in body
    assert ('::workbook::emulate::launch({"other", false}, other,dim3(4, 2), dim3(32, 8))(x);'
            in body)
    assert out.splitlines()[1] == '#line 1 "k.cu"'


def test_cuda_as_a_place_to_run_becomes_the_emulated_device():
    out = emulate.rewrite(textwrap.dedent("""\
        TORCH_LIBRARY_IMPL(extops, CUDA, m) { m.impl("f", &f); }
        check(x, c10::DeviceType::CUDA); bool b = x.is_cuda(); auto k = at::kCUDA;
        """))
    assert "TORCH_LIBRARY_IMPL(extops, PrivateUse1, m)" in out
    assert "c10::DeviceType::PrivateUse1" in out and ".is_privateuseone()" in out
    assert "c10::kPrivateUse1" in out and "CUDA" not in out.split("\n", 2)[2]


COOPERATING = textwrap.dedent("""\
    namespace k {
    __device__ float warp_sum(float v) {  // __syncthreads in a comment does not count
      for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
      return v;
    }
    template <typename T>
    __global__ void __launch_bounds__(256) sum_kernel(const T* x, T* out) {
      __shared__ float partial[8][
          33];
      extern __shared__ __align__(16) unsigned char scratch[];
      partial[0][threadIdx.x] = warp_sum(x[threadIdx.x]);
    }
    __global__ void scale_kernel(float* x) { x[threadIdx.x] *= 2; }
    void go(float* x) { sum_kernel<float><<<1, 256, 64>>>(x, x); scale_kernel<<<1, 2>>>(x); }
    }  // namespace k
    """)


def test_a_kernel_that_calls_a_cooperating_function_cooperates():
    names = emulate.cooperating([COOPERATING])
    assert {"warp_sum", "sum_kernel"} <= names and "scale_kernel" not in names
    out = emulate.rewrite(COOPERATING, "k.cu")
    assert '::workbook::emulate::launch({"sum_kernel", true}, sum_kernel<float>,1, 256, 64)' in out
    assert '::workbook::emulate::launch({"scale_kernel", false}, scale_kernel,1, 2)' in out
    # Found over every file of a build: a kernel in one file, the function it calls in another.
    calls = "__global__ void outer(float* x) { x[0] = warp_sum(x[1]); }\n"
    assert "outer" in emulate.cooperating([COOPERATING, calls])
    assert "outer" not in emulate.cooperating([calls])


def test_shared_declarations_become_the_blocks_memory_and_keep_their_lines():
    out = emulate.rewrite(COOPERATING, "k.cu")
    body = out.split("\n", 2)[2]
    assert body.count("\n") == COOPERATING.count("\n"), "the pass moved lines"
    assert ("float (&partial)[8][33] = ::workbook::emulate::shared_variable<float[8][33]>([] {});"
            in body)
    assert "unsigned char* const scratch = ::workbook::emulate::dynamic_shared<unsigned char>();" \
        in body
    lines = body.splitlines()
    assert "partial[0][threadIdx.x]" in lines[10], "the statement after it moved"


@pytest.mark.parametrize("declaration", ["__shared__ float a[4], b[4];",
                                         "__shared__ int count = 0;",
                                         "extern __shared__ float buffer[64];"])
def test_shared_declarations_cuda_would_not_take_are_refused_with_the_line(declaration):
    source = f"__global__ void k(float* x) {{\n  // a comment\n  {declaration}\n}}\n"
    with pytest.raises(emulate.EmulationRefused, match=r"k\.cu:3: "):
        emulate.rewrite(source, "k.cu")


def test_the_setting_is_read_and_checked(monkeypatch):
    monkeypatch.setenv("WORKBOOK_CUDA", "emulate")
    assert emulate.active() and emulate.cuda_device() == emulate.DEVICE
    monkeypatch.setenv("WORKBOOK_CUDA", "off")
    assert not emulate.active() and emulate.cuda_device() == "cuda"
    monkeypatch.setenv("WORKBOOK_CUDA", "gpu-please")
    with pytest.raises(ValueError, match="WORKBOOK_CUDA must be unset, 'emulate' or 'off'"):
        emulate.setting()


@pytest.mark.reaches(*(s.folder for s in stages.all_stages() if s.cuda))
def test_every_cuda_stage_has_a_plan_for_its_kernels():
    cuda = [s for s in stages.all_stages() if s.cuda]
    assert cuda, "no CUDA stage found"
    for s in cuda:
        plan = emulate.plan(s)
        assert any(p.suffix == ".cu" for p in plan.sources), s.label
        # A stage whose kernels are launchers behind a C++ front is built whole.
        assert plan.whole == any(p.suffix == ".cpp" for p in plan.sources), s.label


# -- kernels of its own, run in a fresh interpreter -----------------------------------------------

LIMITS_KERNEL = r"""
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

// out[i] = i over a 2-D grid: x covers the elements, y repeats them (each row writes the same).
__global__ void iota_kernel(float* out, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = static_cast<float>(i) + 0.0f * blockIdx.y;
}

// Each thread adds its global index into one cell: the same sum in any order.
__global__ void sum_kernel(double* total, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) atomicAdd(total, static_cast<double>(i));
}

// Each thread writes the order it ran in: what the order of blocks and threads is.
__global__ void order_kernel(int64_t* seen, int64_t* counter, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) seen[i] = atomicAdd(reinterpret_cast<unsigned long long*>(counter), 1ull);
}

at::Tensor iota(const at::Tensor& like, int64_t block, int64_t grid_y, int64_t shared) {
  auto out = at::zeros_like(like);
  const int64_t n = out.numel();
  iota_kernel<<<dim3((n + block - 1) / block, grid_y), block, shared,
                c10::cuda::getCurrentCUDAStream()>>>(out.mutable_data_ptr<float>(), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor total(const at::Tensor& like) {
  auto out = at::zeros({1}, like.options().dtype(at::kDouble));
  const int64_t n = like.numel();
  sum_kernel<<<(n + 127) / 128, 128>>>(out.mutable_data_ptr<double>(), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor order(const at::Tensor& like) {
  auto seen = at::empty(like.sizes(), like.options().dtype(at::kLong));
  auto counter = at::zeros({1}, like.options().dtype(at::kLong));
  const int64_t n = like.numel();
  order_kernel<<<(n + 63) / 64, 64>>>(seen.mutable_data_ptr<int64_t>(),
                                      counter.mutable_data_ptr<int64_t>(), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return seen;
}

TORCH_LIBRARY(emulate_test, m) {
  m.def("iota(Tensor like, int block, int grid_y, int shared) -> Tensor");
  m.def("total(Tensor like) -> Tensor");
  m.def("order(Tensor like) -> Tensor");
}
TORCH_LIBRARY_IMPL(emulate_test, CUDA, m) {
  m.impl("iota", &iota);
  m.impl("total", &total);
  m.impl("order", &order);
}
"""

LIMITS_CHECKS = r"""
import os, pytest, torch
from workbook.build import emulate
emulate.build_kernels("emulate_limits_test", [SOURCE], BUILD)
x = torch.empty(1000, device=emulate.DEVICE)
iota = torch.ops.emulate_test.iota
assert torch.equal(iota(x, 256, 3, 0).cpu(), torch.arange(1000.0)), "every thread of every block"
assert torch.equal(iota(x, 1024, 65535, 0).cpu(), torch.arange(1000.0))
refused = {
    (1025, 1, 0): "block.x = 1025 is past CUDA's limit of 1024",
    (256, 65536, 0): "grid.y = 65536 is past CUDA's limit of 65535",
    (256, 0, 0): "grid.y is 0",
    (256, 1, 232449): "232449 bytes of dynamic shared memory are past the H200's 232448",
}
for (block, grid_y, shared), detail in refused.items():
    error = "invalid argument" if shared else "invalid configuration argument"
    with pytest.raises(RuntimeError, match=f"CUDA error: {error} \\(emulated: {detail}\\)"):
        iota(x, block, grid_y, shared)
    assert torch.equal(iota(x, 128, 1, 0).cpu(), torch.arange(1000.0)), "the error was not reset"
runs = {}
for order in ("in-order", "shuffle", ""):  # "": unset, blocks shared out among CPU threads
    os.environ["WORKBOOK_EMULATE_ORDER"] = order
    runs[order] = torch.ops.emulate_test.order(x).cpu()
    assert torch.ops.emulate_test.total(x).item() == 999 * 1000 / 2
assert torch.equal(runs["in-order"], torch.arange(1000)), "in order: block by block, each in order"
assert torch.equal(runs["shuffle"].sort().values, torch.arange(1000))
assert not torch.equal(runs["shuffle"], torch.arange(1000)), "shuffle ran in order"
assert torch.equal(runs[""].sort().values, torch.arange(1000)), "shared out: each thread once"
big = torch.empty(1 << 20, device=emulate.DEVICE)  # 8192 blocks: runs of them on every CPU thread
assert torch.equal(torch.ops.emulate_test.order(big).cpu().sort().values, torch.arange(1 << 20))
assert torch.ops.emulate_test.total(big).item() == (1 << 20) * ((1 << 20) - 1) / 2, "atomics"
print("limits ok")
"""


def run_fresh(code: str, timeout: int = 900, env: dict | None = None
              ) -> subprocess.CompletedProcess:
    """`code` in a new interpreter, its output unbuffered and a fatal signal answered with the
    Python stack of every thread (faulthandler): a child that dies says where."""
    return subprocess.run([sys.executable, "-u", "-X", "faulthandler", "-c", code],
                          capture_output=True, text=True, timeout=timeout, env=env)


def told(result: subprocess.CompletedProcess) -> str:
    """What a child said, the ends of both streams, for a failed assertion."""
    return (f"exit {result.returncode}\nstdout: ...{result.stdout[-2000:]}\n"
            f"stderr: ...{result.stderr[-3000:]}")


@pytest.mark.cuda
def test_launches_past_cudas_limits_are_refused_with_cudas_error():
    folder = stages.empty_build_folder("test-emulate", "limits")
    source = folder / "limits.cu"
    source.write_text(LIMITS_KERNEL)
    code = f"SOURCE = {str(source)!r}\nfrom pathlib import Path\nSOURCE = Path(SOURCE)\n" \
           f"BUILD = Path({str(folder / 'build')!r})\n" + LIMITS_CHECKS
    result = run_fresh(code)
    assert result.returncode == 0 and "limits ok" in result.stdout, told(result)


# The bug planted: two corner weights swapped in stage 07's sampling kernel (forward only).
SWAPPED = ("*out = static_cast<scalar_t>(w[0] * v[0] + w[1] * v[1] + w[2] * v[2] + w[3] * v[3]);",
           "*out = static_cast<scalar_t>(w[1] * v[0] + w[0] * v[1] + w[2] * v[2] + w[3] * v[3]);")

MUTANT_CHECKS = r"""
import sys, torch
from workbook import ops
from workbook.build import emulate
from workbook.spec import compare
import extops  # the stage's own build (PYTHONPATH: mutant_env), with its CPU and CUDA kernels
emulate.build_kernels("emulate_mutant_test", SOURCES, BUILD)   # instead of the stage's own
print("mutant loaded")  # (a child that dies after this line died in the check or at exit)
spec = ops.get("deform_conv2d")
sample = spec.make(spec.case("b2_c4_o5_k3_pad1"), device=emulate.DEVICE, dtype=torch.float64)
result = compare(extops.deform_conv2d, spec, sample)
print("MUTANT", "PASSED" if result.ok else "CAUGHT", result)
"""


def mutant_script(folder, mutation: tuple[str, str], build_dir) -> str:
    """MUTANT_CHECKS, run on a copy of stage 07's CUDA glue and kernel header with `mutation`
    (old, new) applied once to the kernels, built into build_dir beside the stage's own
    (ordinary) library."""
    stage = mutated_stage()
    glue = next(p for p in emulate.plan(stage).sources if p.name == "deform_conv2d_cuda.cu")
    kernels = glue.with_suffix(".cuh")
    text = kernels.read_text()
    assert text.count(mutation[0]) == 1, "the code to mutate moved: update the mutation"
    (folder / glue.name).write_text(glue.read_text())
    (folder / kernels.name).write_text(text.replace(*mutation))
    builder.build_stage(stage, quiet=True)
    sources = [str(folder / glue.name), str(folder / kernels.name)]
    return (f"from pathlib import Path\nSOURCES = [Path(p) for p in {sources!r}]\n"
            f"BUILD = Path({str(build_dir)!r})\n" + MUTANT_CHECKS)


def mutant_env(env: dict | None = None) -> dict:
    """`env` (this process's by default) with stage 07's ordinary build first on PYTHONPATH, where
    MUTANT_CHECKS imports extops from."""
    stage = mutated_stage()
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(stage.lib_dir),
                                                      env.get("PYTHONPATH", "")]))
    return env


@pytest.mark.cuda
def test_a_mutation_of_a_stage_kernel_fails_against_the_reference():
    folder = stages.empty_build_folder("test-emulate", "swapped-weights")
    code = mutant_script(folder, SWAPPED, folder / "build")
    result = run_fresh(code, env=mutant_env())
    assert result.returncode == 0 and "MUTANT CAUGHT" in result.stdout, told(result)


def test_the_test_base_runs_cuda_tests_where_it_says():
    if testing.NO_GPU is None and emulate.setting() != "emulate":
        assert testing.CUDA == "cuda"
    elif emulate.setting() != "off":
        assert testing.CUDA == emulate.DEVICE and testing.EMULATED
        assert testing.no_device_reason(testing.CUDA) is None


# A stage's CUDA tests as the race checker collects them: a case in three dtypes, gradients in
# float64 alone, a CPU test.
RACECHECK_CASES = """
import pytest

@pytest.mark.cuda
@pytest.mark.parametrize("case", ["small", "large"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("device", ["emulated_cuda"])
def test_kernel(device, dtype, case):
    pass

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float64"])
def test_gradients(dtype):
    pass

@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_cpu(dtype):
    pass
"""


def test_the_race_checker_runs_each_cuda_case_in_float32_alone(pytester, monkeypatch):
    pytester.makepyfile(test_cases=RACECHECK_CASES)
    pytester.makeini("[pytest]\nmarkers =\n    cuda: a CUDA test\n")
    plugin = ("-p", "workbook.testing.pytest_emulated")
    monkeypatch.delenv("WORKBOOK_RACECHECK", raising=False)
    everything, _ = pytester.inline_genitems(*plugin)
    assert len(everything) == 9
    monkeypatch.setenv("WORKBOOK_RACECHECK", "1")
    collected, recorder = pytester.inline_genitems(*plugin)
    deselected = {item.name for call in recorder.getcalls("pytest_deselected")
                  for item in call.items}
    assert sorted(item.name for item in collected if item.name not in deselected) == [
        "test_cpu[float32]", "test_cpu[float64]", "test_gradients[float64]",
        "test_kernel[emulated_cuda-float32-large]", "test_kernel[emulated_cuda-float32-small]"]
    assert len(deselected) == 4


# -- under the sanitizers: a planted out-of-bounds access is reported ------------------------------

# The bug planted: the grid-stride loop of stage 07's sampling kernel one item too far, so the
# last thread decodes a sample past the end and loads its offsets from beyond the buffer.
_SAMPLING = "::test_zero_offsets_and_unit_mask_are_a_convolution\n"  # the marker's last line
OFF_BY_ONE = (_SAMPLING + "  for (int64_t t = first_item(); t < s.samples; t += item_stride()) {",
              _SAMPLING + "  for (int64_t t = first_item(); t <= s.samples; t += item_stride()) {")


@pytest.mark.cuda
def test_an_off_by_one_in_a_kernel_is_reported_by_asan():
    from workbook.net import sanitize

    folder = stages.empty_build_folder("test-emulate", "off-by-one")
    base = folder / "sanitize"
    # The stage's own library, built ordinarily, is not instrumented: the mutant's kernels are.
    code = mutant_script(folder, OFF_BY_ONE, base / "mutant")
    env = sanitize.with_runtimes(mutant_env(sanitize.environment(base)), sanitize.runtimes())
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=1200, env=env)
    reports = sanitize.Reports()
    for line in (result.stdout + result.stderr).splitlines(keepends=True):
        reports(line)
    found = reports.texts()
    assert result.returncode != 0 and found, (result.stdout + result.stderr)[-3000:]
    assert "AddressSanitizer" in found[0] and "sample_columns_kernel" in found[0], found[0][-3000:]


def test_the_benchmark_never_times_the_emulated_device(monkeypatch):
    """Even with WORKBOOK_CUDA=emulate, the benchmark's devices are the CPU and a real GPU."""
    import importlib.util

    # bench/run.py is a script, not a module of a package: loaded from its path.
    spec = importlib.util.spec_from_file_location("bench_run", stages.REPO / "bench" / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    monkeypatch.setenv("WORKBOOK_CUDA", "emulate")
    devices = run.devices_to_run("all")
    assert emulate.DEVICE not in devices and "cpu" in devices
    assert ("cuda" in devices) == (testing.NO_GPU is None)
