"""Hostile-input matrices: per op, a table of inputs and what the op must do with each, every case
run in a child process, so that a crash (a segfault, an abort, a hang) fails that case and not
the test run.

A row (workbook.spec.Row) says how to build the inputs on a device, and either the exception
class and the argument its message must name (a bad input), or None (an input the op must accept:
a view, a subclass, NaN, an empty batch), with what is checked then. Each row runs in up to three
modes:

* eager:   the inputs on the CPU, the op's functional form called directly (its C++ checks);
* meta:    the inputs on the meta device (the op's fake kernel: what torch.compile and export see);
* compile: the CPU inputs through torch.compile(fullgraph=True) (the fake kernel while tracing,
           then the compiled graph).

The table of an op is the generic rows every op gets from its valid sample (see `generic`: wrong
dtypes, layouts, devices and non-tensors for each tensor argument; views, subclasses, NaN and inf,
an empty batch), its descriptor's bad inputs (OpSpec.bad_inputs), and the rows of its own
(ops/<op>/matrix.py: shapes, sizes and integers of that op). A table runs for every stage that
implements the op on the CPU (workbook.ops.implementations): `lltm@5` is the LLTM of stage 05.

    python -m workbook.net.matrix                 # run every table here, print a summary
    python -m workbook.net.matrix lltm@5 --list   # the rows of one table

tests/test_matrix.py runs the tables in `make test`, one pytest test per row and mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from workbook import ops
from workbook.spec import (
    MATRIX_MODES,
    OpSpec,
    Row,
    Sample,
    as_tuple,
    compare,
    other_device,
    relayout,
)

MODES = MATRIX_MODES
PREFIX = "@@matrix "
CASE_TIMEOUT_S = 300  # a row that prints nothing for this long is a hang


def modes_of(implementation: ops.Implementation) -> tuple[str, ...]:
    """The modes an implementation runs in at all: a pybind11 function (stages 01-04) has no fake
    kernel, so no meta mode, and is a graph break under torch.compile (run with
    fullgraph=False)."""
    return MODES if implementation.traceable else ("eager", "compile")


def targets() -> list[ops.Implementation]:
    """The tables to run: every op, wherever a stage implements it on the CPU."""
    return ops.implementations()


# ----------------------------------------------------------------------------------------------
# The rows


class _Subclass(torch.Tensor):
    """A trivial torch.Tensor subclass, as libraries define (no __torch_function__ override)."""


def _views(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "storage_offset":
        flat = t.new_zeros(t.numel() + 3)
        view = flat[3:].view(t.shape)
        with torch.no_grad():
            view.copy_(t)
        return view
    return relayout(Sample("x", (t,)), how).args[0]


def generic(spec: OpSpec, valid: Callable[[str], Sample],
            optional: Iterable[str] = ()) -> list[Row]:
    """The rows every op gets from its valid sample `valid(device)` (float32, no grad).

    For each tensor argument: int64 (float32 for an integer argument), bool, float8 and complex
    dtypes, a sparse layout and a Python list or None in its place are refused naming it, and so
    is the argument on another device (the first argument excepted: it sets the device). For all
    arguments together: transposed, sliced, expanded (stride 0) and offset storage, nn.Parameter
    and Tensor-subclass inputs, an empty batch, NaN and inf in the first argument are accepted.
    """
    optional = set(optional)
    tensors = dict(valid("cpu").tensors())
    names = list(tensors)
    first = names[0]
    rows = []

    def with_arg(name, build):
        return lambda on: valid(on).replaced(name, build(valid(on), on))

    for name in names:
        def cast(dtype, name=name):
            return lambda s, on: dict(s.named())[name].detach().to(dtype)

        # An index argument (int64, as multi-scale deformable attention's level table) is
        # refused as a float instead.
        wrong = (("int64", torch.int64) if tensors[name].is_floating_point() else
                 ("float32", torch.float32))
        for label, dtype in (wrong, ("bool", torch.bool), ("float8_e5m2", torch.float8_e5m2),
                             ("complex64", torch.complex64)):
            rows.append(Row(f"{name}_{label}", "dtype", with_arg(name, cast(dtype)), TypeError,
                              name))
        # Eager only: meta tensors have no sparse form, and torch.compile refuses a sparse input
        # itself ("Attempted to wrap sparse Tensor") before any code of the op runs.
        rows.append(Row(f"{name}_sparse", "layout",
                          with_arg(name, lambda s, on, name=name:
                                   dict(s.named())[name].detach().to_sparse()),
                          TypeError, name, modes=("eager",)))
        rows.append(Row(f"{name}_list", "non-tensor",
                          with_arg(name, lambda s, on, name=name:
                                   torch.zeros(dict(s.named())[name].shape).tolist()),
                          TypeError, name))
        if name not in optional:
            rows.append(Row(f"{name}_none", "non-tensor", with_arg(name, lambda s, on: None),
                              TypeError, name))
        if name != first:
            rows.append(Row(f"{name}_on_another_device", "device",
                              with_arg(name, lambda s, on, name=name: torch.zeros(
                                  dict(s.named())[name].shape, device=other_device(on))),
                              RuntimeError, name))

    def all_tensors(fn, label, kind, check="reference", modes=MODES) -> Row:
        return Row(label, kind, lambda on: valid(on).map(lambda n, t: fn(t)), check=check,
                     modes=modes)

    for how in ("permuted", "strided", "expanded", "storage_offset"):
        rows.append(all_tensors(lambda t, how=how: _views(t, how), f"all_{how}", "view"))
    rows.append(all_tensors(lambda t: torch.nn.Parameter(t, requires_grad=False),
                            "all_parameters", "subclass"))
    rows.append(all_tensors(lambda t: t.as_subclass(_Subclass), "all_subclass", "subclass",
                            modes=("eager", "meta")))
    for label, value in (("nan", float("nan")), ("inf", float("inf"))):
        def poison(s, on, value=value):
            t = dict(s.named())[first].detach().clone()
            t.view(-1)[:1] = value
            return t

        rows.append(Row(f"{first}_{label}", "non-finite", with_arg(first, poison), check="runs"))
    batch0 = spec.batch0()
    rows.append(Row("batch_0", "empty", lambda on: spec.make(batch0, device=on,
                                                              requires_grad=False)))
    return rows


def from_bad_inputs(spec: OpSpec) -> list[Row]:
    """The descriptor's bad inputs as rows: the argument is the first `name` their message
    pattern quotes."""
    rows = []
    for bad in spec.bad_inputs("cpu"):
        quoted = re.search(r"`(\w+)`", bad.match)
        error = bad.error if isinstance(bad.error, type) else bad.error[0]
        rows.append(Row(bad.name, "descriptor", lambda on, bad=bad: bad.make(on), error,
                          quoted.group(1) if quoted else None))
    return rows


def table(op: str) -> list[Row]:
    """Every row of op's matrix: generic, the descriptor's bad inputs, and the op's own rows
    (ops/<op>/matrix.py: `valid(device)`, the sample the generic rows start from; `rows()`;
    `OPTIONAL`, the arguments None is valid for). An op without that file gets the generic rows
    from its smallest case, and its bad inputs."""
    spec, own = ops.get(op), ops.part(op, "matrix")
    smallest = min(spec.cases, key=lambda c: math.prod(c.sizes.values()))
    valid = own.valid if own is not None else (
        lambda on: spec.make(smallest, device=on, requires_grad=False))
    specific = [*from_bad_inputs(spec), *(own.rows() if own is not None else [])]
    named = {row.name for row in specific}  # a generic row the op also has: its own wins
    rows = [row for row in generic(spec, valid, getattr(own, "OPTIONAL", ()))
            if row.name not in named] + specific
    seen = set()
    for row in rows:
        assert row.name not in seen, f"{op}: two matrix rows named {row.name}"
        seen.add(row.name)
    return rows


# ----------------------------------------------------------------------------------------------
# One row, in the child process


def _names_argument(message: str, arg: str | None) -> bool:
    return arg is None or f"`{arg}`" in message


def run_row(fn: Callable, spec: OpSpec, row: Row, mode: str,
            fullgraph: bool = True) -> tuple[bool, str]:
    """(passed, what happened) for one row in one mode."""
    device = "meta" if mode == "meta" else "cpu"
    sample = row.make(device)
    call = fn
    if mode == "compile":
        torch._dynamo.reset()
        call = torch.compile(fn, fullgraph=fullgraph)
    if row.error is not None:
        try:
            sample.call(call)
        except Exception as caught:  # noqa: BLE001  (which class it is, is what is checked)
            message = str(caught)
            # torch.compile reports an error raised while tracing in an exception of its own
            # (TorchRuntimeError from a fake kernel, Unsupported from Python code of the op's)
            # that quotes the original: its class name and message.
            wrapped = (mode == "compile" and isinstance(
                caught, (torch._dynamo.exc.TorchRuntimeError, torch._dynamo.exc.Unsupported)))
            kind_ok = isinstance(caught, row.error) or (wrapped and row.error.__name__ in message)
            ok = kind_ok and _names_argument(message, row.arg)
            first_line = message.strip().splitlines()[0] if message.strip() else ""
            return ok, f"{type(caught).__name__}: {first_line[:300]}"
        return False, "no error raised"
    try:
        out = as_tuple(sample.call(call))
    except Exception as caught:  # noqa: BLE001
        return False, f"refused a valid input: {type(caught).__name__}: {str(caught)[:300]}"
    if mode == "meta":
        shapes = [tuple(o.shape) for o in out]
        if row.shapes is not None:
            wanted = [tuple(s) for s in row.shapes]
        else:
            # The reference on CPU zeros of the same shapes; integer tensors (an index table,
            # whose values a meta tensor does not hold) as the row makes them on the CPU.
            on_cpu = row.make("cpu").map(lambda n, t: torch.zeros(t.shape, dtype=torch.float64)
                                         if t.is_floating_point() else t)
            wanted = [tuple(e.shape) for e in as_tuple(on_cpu.call(spec.reference))]
        return shapes == wanted, f"output shapes {shapes}, expected {wanted}"
    if row.check == "runs":
        reference = as_tuple(sample.float64().call(spec.reference))
        shapes = [tuple(o.shape) for o in out]
        wanted = [tuple(e.shape) for e in reference]
        return shapes == wanted, f"ran; output shapes {shapes}, reference {wanted}"
    plain = sample.map(lambda n, t: t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor
                       and not isinstance(t, torch.nn.Parameter) else t)
    comparison = compare(lambda *a, **k: call(*a, **k), spec, plain, gradients=False)
    return comparison.ok, "matches the reference" if comparison.ok else str(comparison)[:600]


def child(key: str, modes: Sequence[str], skip: int) -> None:
    """Run the rows of a table from index `skip` on, printing a line before and after each."""
    implementation = next(i for i in targets() if i.key == key)
    fn = implementation.function()
    spec = implementation.spec
    for index, row in enumerate(table(implementation.op)):
        if index < skip:
            continue
        for mode in modes:
            if mode not in row.modes or mode not in modes_of(implementation):
                continue
            print(PREFIX + json.dumps({"start": index, "mode": mode}), flush=True)
            if os.environ.get("WORKBOOK_MATRIX_CRASH") == f"{row.name}:{mode}":
                # The harness's own test: this row takes the process down, as a segfault would.
                os.abort()
            began = time.perf_counter()
            try:
                ok, detail = run_row(fn, spec, row, mode, implementation.traceable)
            except Exception as caught:  # noqa: BLE001  (building the row itself failed)
                ok, detail = False, f"the row could not run: {type(caught).__name__}: {caught}"
            print(PREFIX + json.dumps({"index": index, "row": row.name, "mode": mode, "ok": ok,
                                       "detail": detail,
                                       "seconds": round(time.perf_counter() - began, 2)}),
                  flush=True)


# ----------------------------------------------------------------------------------------------
# The parent: children, restarted after a crash


@dataclasses.dataclass
class Result:
    row: str
    mode: str
    ok: bool
    detail: str
    seconds: float = 0.0


def run_target(target: ops.Implementation, modes: Sequence[str] = MODES,
               env: dict | None = None,
               log: Callable[[str], None] = print) -> dict[tuple[str, str], Result]:
    """Every row of target's table in every mode, in child processes: a child that dies (or
    stays silent for CASE_TIMEOUT_S) fails the row it was running, and a new child goes on
    with the next row."""
    rows = table(target.op)
    modes = [m for m in modes if m in modes_of(target)]
    results: dict[tuple[str, str], Result] = {}
    skip = 0
    began = time.perf_counter()
    while skip < len(rows):
        command = [sys.executable, "-m", "workbook.net.matrix", target.key, "--child",
                   "--modes", ",".join(modes), "--skip", str(skip)]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
        stderr_tail: list[str] = []
        drain = threading.Thread(target=lambda: stderr_tail.extend(proc.stderr), daemon=True)
        drain.start()
        last_line = [time.monotonic()]
        watchdog_stop = threading.Event()

        def watchdog(proc=proc, last_line=last_line, stop=watchdog_stop):
            while not stop.wait(5):
                if time.monotonic() - last_line[0] > CASE_TIMEOUT_S:
                    proc.kill()
                    return

        threading.Thread(target=watchdog, daemon=True).start()
        running = None
        for line in proc.stdout:
            last_line[0] = time.monotonic()
            if not line.startswith(PREFIX):
                continue
            record = json.loads(line[len(PREFIX):])
            if "start" in record:
                running = (record["start"], record["mode"])
                continue
            running = None
            results[(record["row"], record["mode"])] = Result(
                record["row"], record["mode"], record["ok"], record["detail"], record["seconds"])
        code = proc.wait()
        watchdog_stop.set()
        drain.join(timeout=10)
        if running is None:
            if code != 0:  # died outside a row: importing the stage, say
                tail = "".join(stderr_tail[-20:])
                for row in rows[skip:]:
                    for mode in modes:
                        if mode in row.modes:
                            results.setdefault((row.name, mode), Result(
                                row.name, mode, False, f"the child exited with {code}: {tail}"))
            break
        index, mode = running
        how = (f"hung (killed after {CASE_TIMEOUT_S} s of silence)" if code == -9
               else f"crashed the process (exit status {code})")
        tail = "".join(stderr_tail[-12:])
        results[(rows[index].name, mode)] = Result(rows[index].name, mode, False,
                                                   f"{how}: {tail}")
        log(f"[matrix] {target.key}: row {rows[index].name} ({mode}) {how}; going on")
        skip = index + 1
    passed = sum(r.ok for r in results.values())
    log(f"[matrix] {target.key}: {len(rows)} rows, {len(results)} runs, {passed} passed, "
        f"in {time.perf_counter() - began:.0f} s")
    return results


def run_all(tables: Sequence[ops.Implementation] | None = None, workers: int = 2,
            log: Callable[[str], None] = print) -> dict[str, dict[tuple[str, str], Result]]:
    """Every table (`tables`: by default, targets()), `workers` children at a time (one per
    table)."""
    env = dict(os.environ)
    with ThreadPoolExecutor(workers) as pool:
        futures = {t.key: pool.submit(run_target, t, MODES, env, log)
                   for t in (targets() if tables is None else tables)}
        return {key: f.result() for key, f in futures.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", nargs="?", help="op@stage, e.g. lltm@5 (default: all)")
    parser.add_argument("--list", action="store_true", help="print the rows, run nothing")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--skip", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    chosen = [t for t in targets() if args.target in (None, t.key)]
    if not chosen:
        parser.error(f"no table {args.target!r}; tables: {[t.key for t in targets()]}")
    if args.child:
        child(args.target, args.modes.split(","), args.skip)
        return 0
    if args.list:
        for target in chosen:
            rows = table(target.op)
            print(f"{target.key}: {len(rows)} rows")
            for row in rows:
                modes = ",".join(m for m in row.modes if m in modes_of(target))
                print(f"  {row.name:36} {row.kind:12} {row.expects():40} {modes}")
        return 0
    failed = 0
    for key, results in run_all(chosen).items():
        for result in results.values():
            if not result.ok:
                failed += 1
                print(f"FAIL {key} {result.row} [{result.mode}]: {result.detail}")
    print(f"[matrix] {'all passed' if not failed else f'{failed} failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
