"""Small helpers the notebooks share, so that each notebook reads as a lesson, not as plumbing.

* `show_source(path, name)` shows a named C++/CUDA function (with the comment above it) or a
  Python function/class, read from the stage's file, so the notebook never drifts from the code
  (an exercise's solution folded: workbook.teaching.exercises.fold);
  `show_source(path, lines=(a, b))` shows a line range;
* `run(cmd)` runs a command in a subprocess and shows what it printed and how it exited (the ABI
  lesson needs a fresh process: a failed import cannot be retried in the kernel);
* `has_gpu()` / `no_gpu_reason()` decide whether the CUDA cells run, and say why not;
* `show_against_reference(fn, "lltm", inputs)` compares an op with its float64 reference (the
  op's descriptor in workbook.ops, the comparison the tests assert) and shows a table;
  `sweep(...)` and `plot_sweep(...)` time several implementations over a range of sizes and plot
  them.

Everything here runs outside Jupyter too (then output is printed instead of displayed).
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from workbook import ops
from workbook.build import stages
from workbook.spec import OpSpec, Sample, compare, dtype_name

REPO = stages.REPO

LANGUAGES = {".cpp": "cpp", ".h": "cpp", ".cu": "cpp", ".cuh": "cpp", ".py": "python",
             ".sh": "bash"}


def _display(obj) -> None:
    """IPython's display() inside a kernel, print() elsewhere."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        print(obj)
        return
    if get_ipython() is None:
        print(obj)
    else:
        display(obj)


def relative(path: Path | str) -> str:
    """A path as the reader knows it: relative to the repository root when it is inside it.
    Symbolic links are kept (a venv's bin/python stays .venv/bin/python)."""
    path = Path(os.path.abspath(path))
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


# ----------------------------------------------------------------------------------------------
# Source excerpts


class Excerpt:
    """Lines of a source file; shown as a highlighted code block in Jupyter, as text elsewhere."""

    def __init__(self, path: Path, first: int, last: int, text: str):
        self.path, self.first, self.last, self.text = path, first, last, text

    @property
    def title(self) -> str:
        return f"{relative(self.path)}, lines {self.first}-{self.last}"

    def _repr_markdown_(self) -> str:
        language = LANGUAGES.get(self.path.suffix, "")
        return f"`{self.title}`\n\n```{language}\n{self.text}\n```"

    def __repr__(self) -> str:
        return f"# {self.title}\n{self.text}"

    __str__ = __repr__


def _code_only(line: str) -> str:
    """A C++ line with string and char literals blanked and any // comment cut off (for counting
    braces)."""
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])*'", "''", line)
    return line.split("//", 1)[0]


def _cpp_definition(lines: list[str], name: str) -> tuple[int, int]:
    """(first, last) 0-based line indices of the definition of `name` in C++/CUDA source.

    The definition is the first occurrence of `name(` (or `name (`) whose next `{` comes before any
    `;`: declarations and calls end in `;` first. It starts at its signature, or at the
    `template <...>` line above it, and extends up over the comment block directly above; it ends
    at the line of the matching closing brace.
    """
    pattern = re.compile(rf"(?<![\w.]){re.escape(name)}\s*\(")
    code = [_code_only(ln) for ln in lines]
    for start, text in enumerate(code):
        match = pattern.search(text)
        if not match:
            continue
        # Find the opening brace of the body, or a `;` that makes this a declaration or a call.
        row, col, depth, opened = start, match.end() - 1, 0, None
        while row < len(code) and opened is None:
            for c in range(col, len(code[row])):
                ch = code[row][c]
                depth += ch == "("
                depth -= ch == ")"
                if depth == 0 and ch == ";":
                    break
                if depth == 0 and ch == "{":
                    opened = (row, c)
                    break
            else:
                row, col = row + 1, 0
                continue
            break
        if opened is None:
            continue
        # Walk to the matching closing brace.
        row, col, braces, end = opened[0], opened[1], 0, None
        while row < len(code) and end is None:
            for c in range(col, len(code[row])):
                braces += code[row][c] == "{"
                braces -= code[row][c] == "}"
                if braces == 0:
                    end = row
                    break
            row, col = row + 1, 0
        if end is None:
            break
        first = start
        # Up over what belongs to the declaration: template <...>, __global__ and the like.
        while first > 0 and lines[first - 1].lstrip().startswith(
                ("template", "__global__", "__device__", "static", "inline", "[[")):
            first -= 1
        while first > 0 and lines[first - 1].lstrip().startswith("//"):
            first -= 1
        return first, end
    raise LookupError(f"no definition of `{name}` (a `{name}(` followed by a body) found")


def _python_definition(source: str, name: str) -> tuple[int, int]:
    """(first, last) 0-based line indices of the def or class `name` (decorators included), or
    of the assignment to the variable `name` (say, a C++ source held in a string)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and node.name == name:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            return first - 1, node.end_lineno - 1
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return node.lineno - 1, node.end_lineno - 1
    raise LookupError(f"no def, class or assignment named `{name}`")


def excerpt(path: Path | str, name: str | None = None, *,
            lines: tuple[int, int] | None = None) -> Excerpt:
    """The definition of `name` in the file at `path` (relative to the repository root or
    absolute), or the 1-based inclusive line range `lines`, or with neither, the whole file."""
    path = Path(path)
    path = path if path.is_absolute() else REPO / path
    source = path.read_text()
    all_lines = source.splitlines()
    if name is not None and lines is not None:
        raise ValueError("give a name or a line range (lines=(first, last)), not both")
    try:
        if name is None and lines is None:
            first, last = 0, len(all_lines) - 1
        elif lines is not None:
            first, last = lines[0] - 1, min(lines[1], len(all_lines)) - 1
            if not 0 <= first <= last:
                raise LookupError(f"bad line range {lines} for a file of {len(all_lines)} lines")
        elif path.suffix == ".py":
            first, last = _python_definition(source, name)
        else:
            first, last = _cpp_definition(all_lines, name)
    except LookupError as err:
        raise LookupError(f"{relative(path)}: {err}") from None
    # An exercise's solution stays folded (`make exercise N REVEAL=name` shows it): the lesson
    # shows the task, the learner writes it.
    from workbook.teaching import exercises

    return Excerpt(path, first + 1, last + 1,
                   "\n".join(exercises.fold(all_lines, path, first, last)))


def show_source(path: Path | str, name: str | None = None, *,
                lines: tuple[int, int] | None = None) -> None:
    """Show a function, class or line range of a source file (see `excerpt`)."""
    _display(excerpt(path, name, lines=lines))


class Diff:
    """A unified diff of two excerpts; a highlighted diff block in Jupyter, text elsewhere."""

    def __init__(self, before: Excerpt, after: Excerpt):
        self.before, self.after = before, after
        self.text = "\n".join(difflib.unified_diff(
            before.text.splitlines(), after.text.splitlines(), before.title, after.title,
            n=max(len(before.text), len(after.text)), lineterm=""))

    def _repr_markdown_(self) -> str:
        return f"```diff\n{self.text}\n```"

    def __repr__(self) -> str:
        return self.text

    __str__ = __repr__


def show_diff(before: Excerpt, after: Excerpt) -> None:
    """Show how one excerpt became the other (say, a kernel from one stage to the next), in
    full: every line, marked - (only before), + (only after) or unmarked (both)."""
    _display(Diff(before, after))


def find_line(path: Path | str, text: str) -> int:
    """The 1-based number of the first line of a file that contains `text`."""
    path = Path(path)
    path = path if path.is_absolute() else REPO / path
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if text in line:
            return number
    raise LookupError(f"{relative(path)}: no line contains {text!r}")


# ----------------------------------------------------------------------------------------------
# Commands


def _short(text: str) -> str:
    """Paths in a command line shown relative to the repository, as the reader would type them."""
    return text.replace(str(REPO) + "/", "")


def run(cmd: Sequence[str] | str, *, env: Mapping[str, str] | None = None, cwd: Path | str = REPO,
        expect: str = "success", show: Callable[[str], bool] | None = None,
        max_lines: int = 40, timeout: float = 1800) -> subprocess.CompletedProcess:
    """Run a command in a subprocess; print it, what it printed (stdout and stderr together), how
    long it took and its exit status.

    `env` adds to (does not replace) this process's environment. `expect` is "success",
    "failure" or "any": a command that does not end as expected raises, with its output. `show`
    keeps only the lines it returns True for; `max_lines` keeps the last lines of long output.
    """
    if expect not in ("success", "failure", "any"):
        raise ValueError(f"expect must be 'success', 'failure' or 'any', got {expect!r}")
    argv = shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]
    full_env = dict(os.environ, **(env or {}))
    shown = [f"{k}={_short(v)}" for k, v in (env or {}).items()] + [_short(a) for a in argv]
    print("$ " + " ".join(shlex.quote(s) for s in shown))
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    output = _short(proc.stdout)
    kept = [ln for ln in output.splitlines() if show is None or show(ln)]
    if len(kept) > max_lines:
        print(f"    [... {len(kept) - max_lines} lines above not shown ...]")
        kept = kept[-max_lines:]
    for line in kept:
        print("    " + line)
    print(f"[exit status {proc.returncode}, {time.perf_counter() - start:.1f} s]")
    failed = proc.returncode != 0
    if (expect == "success" and failed) or (expect == "failure" and not failed):
        raise RuntimeError(f"expected {expect} of {shlex.join(argv)}, got exit status "
                           f"{proc.returncode}; output:\n{proc.stdout}")
    return proc


def pythonpath_with_common() -> str:
    """PYTHONPATH for a child interpreter that must import `workbook`: common/ first, then
    whatever this process has (a notebook opened straight from Jupyter may have none)."""
    common = str(REPO / "common")
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != common]
    return os.pathsep.join([common, *paths])


def run_python(code: str, **kwargs) -> subprocess.CompletedProcess:
    """Run a snippet of Python in a fresh interpreter (this one) with common/ on sys.path."""
    env = dict(kwargs.pop("env", None) or {})
    env.setdefault("PYTHONPATH", pythonpath_with_common())
    return run([sys.executable, "-c", code], env=env, **kwargs)


# ----------------------------------------------------------------------------------------------
# Devices


def has_gpu() -> bool:
    return torch.cuda.is_available()


def no_gpu_reason() -> str:
    """Why the CUDA cells cannot run here ("" when they can)."""
    if torch.cuda.is_available():
        return ""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU-only build"
    return (f"no CUDA device is visible: torch {torch.__version__} is built for CUDA "
            f"{torch.version.cuda}, but torch.cuda.is_available() is False")


def skip_without_gpu(what: str) -> bool:
    """True when a GPU is here; else print that `what` is skipped, and why, and return False."""
    if has_gpu():
        return True
    print(f"[skipped] {what}: {no_gpu_reason()}.")
    return False


def peak_bandwidth_gbs(device: str = "cuda") -> float | None:
    """The GPU's theoretical memory bandwidth in GB/s, from its memory clock and bus width (double
    data rate); None where torch does not report them."""
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9


def cuda_kernel_us(fn: Callable[[], object], kernel: str, *, calls: int = 20) -> float | None:
    """Mean GPU time in microseconds of the CUDA kernels whose name contains `kernel`, per call
    of fn(), from torch.profiler: the kernel alone, without launches, GEMMs or Python. None when
    no such kernel ran."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm-up, outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    found = False
    for event in prof.key_averages():
        if kernel in event.key:
            found = True
            total += getattr(event, "device_time_total", None) or event.cuda_time_total
    return total / calls if found else None


def describe_device(device: str) -> str:
    """What the timings of `sweep` ran on. On the CPU they use one thread (torch.utils.benchmark's
    default, kept by workbook.measure.timing.forward_backward_us): the notebooks compare the work
    each implementation does, and a single thread keeps that comparison steady on a small, shared
    machine, where a second thread competing for a busy core can cost milliseconds."""
    from workbook.measure import timing

    if device.startswith("cuda"):
        return timing.describe_machine(device)
    return f"CPU (1 of {torch.get_num_threads()} threads), torch {torch.__version__}"


# ----------------------------------------------------------------------------------------------
# Inputs, checks against the reference, tables

class Table:
    """Rows under headers; a Markdown table in Jupyter, aligned text elsewhere."""

    def __init__(self, headers: Sequence[str], rows: Iterable[Sequence]):
        self.headers = list(headers)
        self.rows = [[self._cell(v) for v in row] for row in rows]

    @staticmethod
    def _cell(value) -> str:
        if isinstance(value, bool):
            return "ok" if value else "MISMATCH"
        if isinstance(value, float):
            if value >= 100:
                return f"{value:,.0f}"
            return f"{value:.3g}" if value >= 0.01 or value == 0 else f"{value:.1e}"
        return str(value)

    def _repr_markdown_(self) -> str:
        lines = ["| " + " | ".join(self.headers) + " |", "|" + "---|" * len(self.headers)]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)

    def __repr__(self) -> str:
        rows = [self.headers, *self.rows]
        widths = [max(len(r[i]) for r in rows) for i in range(len(self.headers))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        return "\n".join(fmt.format(*r) for r in [self.headers, *self.rows])


def table(headers: Sequence[str], rows: Iterable[Sequence]) -> None:
    _display(Table(headers, rows))


def show_against_reference(fn: Callable, op: str | OpSpec,
                           inputs: Sample | Sequence[torch.Tensor]) -> None:
    """Show how far fn's outputs and input gradients are from the float64 reference of `op` (a
    name in workbook.ops, or its OpSpec), with the op's tolerances (workbook.spec.compare,
    the comparison the tests assert). Raises when any is outside: a notebook must not go on to
    time a wrong kernel. `inputs`: a Sample, or the op's positional tensors."""
    spec = ops.get(op) if isinstance(op, str) else op
    sample = inputs if isinstance(inputs, Sample) else Sample("inputs", tuple(inputs),
                                                              arg_names=spec.arg_names)
    result = compare(fn, spec, sample)
    rtol, atol = result.tolerance
    rows = [(d.what, d.max_abs, d.max_rel, d.problem or d.ok) for d in result.differences]
    table([f"against float64 ({dtype_name(result.dtype)}: rtol {rtol:g}, atol {atol:g})",
           "max |error|", "of its largest value", ""], rows)
    if not result.ok:
        raise AssertionError("outside tolerance against the float64 reference:\n  "
                             + "\n  ".join(result.failures()))


# ----------------------------------------------------------------------------------------------
# Timing sweeps and plots


def sweep(implementations: Mapping[str, Callable], make_inputs: Callable[[int], Sequence],
          sizes: Sequence[int], *, min_run_time: float = 0.05,
          backward: bool = True) -> dict[str, dict[str, list[float]]]:
    """Median times in microseconds: result[label]["forward" | "backward"][k] at sizes[k].

    Each size gets fresh inputs from make_inputs(size), shared by every implementation, so the
    implementations are compared on the same data in the same run.
    """
    from workbook.measure import timing

    results = {label: {"forward": [], "backward": []} for label in implementations}
    for size in sizes:
        inputs = make_inputs(size)
        for label, fn in implementations.items():
            if backward:
                fwd, bwd = timing.forward_backward_us(fn, inputs, min_run_time=min_run_time)
            else:
                fwd, bwd = timing.median_us(lambda: fn(*inputs), min_run_time=min_run_time), None
            results[label]["forward"].append(fwd)
            results[label]["backward"].append(bwd)
    return results


def sweep_table(results: Mapping[str, Mapping[str, list]], sizes: Sequence[int], *,
                size_label: str = "size", baseline: str | None = None) -> None:
    """Show the sweep as one table per phase (forward, backward): each implementation's median
    in microseconds, and its speed-up over `baseline` (the first implementation by default)."""
    labels = list(results)
    baseline = baseline or labels[0]
    for phase in ("forward", "backward"):
        if results[baseline][phase][0] is None:
            continue
        others = [label for label in labels if label != baseline]
        headers = [size_label] + [f"{label} (us)" for label in labels]
        headers += [f"{label} speed-up" for label in others]
        rows = []
        for k, size in enumerate(sizes):
            row = [size] + [results[label][phase][k] for label in labels]
            row += [f"{results[baseline][phase][k] / results[label][phase][k]:.2f}x"
                    for label in others]
            rows.append(row)
        print(f"{phase}, median time per call:")
        table(headers, rows)


def plot_sweep(results: Mapping[str, Mapping[str, list]], sizes: Sequence[int], *,
               xlabel: str, title: str, logx: bool = True):
    """Forward and backward medians against size, a line per implementation; returns the figure."""
    import matplotlib.pyplot as plt

    phases = [p for p in ("forward", "backward")
              if next(iter(results.values()))[p][0] is not None]
    fig, axes = plt.subplots(1, len(phases), figsize=(5.5 * len(phases), 3.8), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        for label, times in results.items():
            ax.plot(sizes, times[phase], marker="o", label=label)
        ax.set_xscale("log" if logx else "linear", **({"base": 2} if logx else {}))
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("median time per call (us)")
        ax.set_title(phase)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------
# Folders


def list_folder(folder: Path | str, *, pattern: str = "*", since: float | None = None) -> None:
    """Files directly in `folder` with size and age; with `since` (a time.time()), mark the
    ones written after it."""
    folder = Path(folder)
    now = time.time()
    rows = []
    for path in sorted(folder.glob(pattern)):
        if not path.is_file():
            continue
        stat = path.stat()
        row = [path.name, f"{stat.st_size / 1024:.1f} KiB", f"{now - stat.st_mtime:.0f} s ago"]
        if since is not None:
            row.append("new" if stat.st_mtime >= since else "")
        rows.append(row)
    print(f"{relative(folder)}/")
    table(["file", "size", "written"] + (["this run"] if since is not None else []), rows)
