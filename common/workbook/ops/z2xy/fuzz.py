"""How hypothesis draws z2xy's calls (workbook.net.fuzz): any shape, since the op is
elementwise.

    EXAMPLES     how many examples per implementation: in `make test`, and in `make fuzz`
    cases()      the hypothesis strategy of its sizes
    spec(OP)     the descriptor the examples are made and checked with
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from workbook.spec import Case, OpSpec, Sample

EXAMPLES = {"ci": 300, "long": 2000}


@st.composite
def cases(draw) -> Case:
    """0 to 4 dimensions of 0 to 40 elements (the leading ones 0 to 4), held as dim0, dim1, ...
    beside the rows x cols the descriptor's maker reads."""
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    if draw(st.booleans()):
        shape.append(draw(st.integers(0, 40)))
    rows = 1
    for size in shape[:-1]:
        rows *= size
    name = "x".join(map(str, shape)) or "scalar"
    return Case(name, {"rows": rows, "cols": shape[-1] if shape else 1, "ndim": len(shape),
                       **{f"dim{k}": size for k, size in enumerate(shape)}})


def spec(op: OpSpec) -> OpSpec:
    """The descriptor with a maker for the shapes of `cases`: its own rows x cols inputs, viewed
    as the case's shape. Reference and tolerances are unchanged."""
    def make(case: Case, **kwargs) -> Sample:
        shape = tuple(case[f"dim{k}"] for k in range(case["ndim"]))
        made = op.make(case, **kwargs)
        return made.map(lambda _, t: t.detach().reshape(shape).requires_grad_(t.requires_grad))

    return dataclasses.replace(op, make=make)
