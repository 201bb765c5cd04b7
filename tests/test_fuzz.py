"""Property-based fuzzing of every op, wherever a stage implements it, against its float64
reference (hypothesis).

For each op (common/workbook/ops/<op>/fuzz.py says how its sizes are drawn) and each package that
implements it (workbook.ops.implementations: z2xy in stage 01, the LLTM in stages 02, 03, 05 and
the production library, the deformable convolution in the production library), hypothesis draws
sizes (0 and 1 included), a dtype, a memory layout per tensor (contiguous, at a storage offset,
a slice of wider rows, every other element, transposed, expanded with stride 0, channels_last),
which inputs require grad, and 1 or 2 CPU threads; every example's outputs and input gradients
must match the reference within the descriptor's tolerances for the dtype
(workbook/testing/fuzz.py says how an example is drawn and checked). The tests are made from
what is on disk: a new op or stage is fuzzed with no edit here.

`make test` runs a short pass (each op's `ci` count, about a minute in all); `make fuzz`
(WORKBOOK_FUZZ=long) the long one, with hypothesis' statistics. The examples are derandomized:
every run draws the same ones, and a failure prints an Example to pass to fuzz.check.
"""

import pytest

from workbook import ops
from workbook.net import fuzz

IMPLEMENTATIONS = [i for i in ops.implementations() if ops.part(i.op, "fuzz") is not None]

# One test per op and stage, named for both: test_lltm_at_stage_05. Each runs its stage alone (its
# kept result, workbook.testing.pytest_results, stands while that stage is unchanged).
for _implementation in IMPLEMENTATIONS:
    _test = pytest.mark.reaches(_implementation.stage.folder)(fuzz.test_of(_implementation))
    globals()[_test.__name__] = _test


def test_every_op_is_fuzzed_somewhere():
    """Each op of the workbook has a fuzz strategy and a stage to run it in: none is left out."""
    fuzzed = {i.op for i in IMPLEMENTATIONS}
    assert fuzzed == set(ops.names()), f"not fuzzed: {sorted(set(ops.names()) - fuzzed)}"


@pytest.mark.parametrize("layout", sorted(fuzz.STORES))
def test_every_layout_changes_the_storage(layout):
    """Each layout the fuzzer draws stores a tensor as its name says."""
    import torch

    t = torch.arange(24.0).reshape(2, 3, 2, 2)
    stored = fuzz.STORES[layout](t)
    assert stored.shape == t.shape
    if layout != "expanded":
        assert torch.equal(stored, t)
    expected = {"contiguous": t.is_contiguous, "offset": lambda: stored.storage_offset() == 3,
                "sliced": lambda: stored.storage_offset() == 2 and stored.stride()[-2] == 5,
                "strided": lambda: stored.stride()[-1] == 2,
                "permuted": lambda: stored.stride() == (1, 2, 6, 12),
                "expanded": lambda: stored.stride()[0] == 0,
                "channels_last": lambda: stored.is_contiguous(
                    memory_format=torch.channels_last) and not stored.is_contiguous()}
    assert expected[layout]()
