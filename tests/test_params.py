"""The test base's parameters (workbook.testing.params): a case whose size is the point runs in
one dtype on the emulated CUDA device and in every dtype elsewhere."""

import pytest
import torch

from workbook import ops, testing
from workbook.ops import lltm as lltm_op

SPEC = ops.get("lltm")
SIZED = [c for c in (*lltm_op.CUDA_CASES, *lltm_op.CUDA_EDGE_CASES) if c.sized]


def ids(params) -> list[str]:
    return [p.id for p in params]


def test_a_sized_case_runs_in_float32_alone_on_the_emulated_device():
    if not testing.EMULATED:
        pytest.skip(f"the CUDA tests run on {testing.CUDA}, not on the emulated device")
    cases = lltm_op.CUDA_EDGE_CASES
    found = ids(testing.params(SPEC, [testing.CUDA], cases=cases, batch0=False))
    for case in cases:
        mine = [i for i in found if i.endswith(f"-{case.name}")]
        if case.sized:
            assert mine == [f"{testing.CUDA}-float32-{case.name}"]
        else:
            assert len(mine) == len(SPEC.dtypes)
    only = ids(testing.params(SPEC, [testing.CUDA], [torch.float64, torch.float16],
                              cases=SIZED[:1], batch0=False))
    assert only == [f"{testing.CUDA}-float64-{SIZED[0].name}"]  # no float32: the first dtype


def test_a_sized_case_runs_in_every_dtype_on_the_cpu():
    found = ids(testing.params(SPEC, ["cpu"], cases=SIZED, batch0=False))
    assert len(found) == len(SIZED) * len(SPEC.dtypes)

