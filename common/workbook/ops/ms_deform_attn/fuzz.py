"""How hypothesis draws multi-scale deformable attention's calls (workbook.net.fuzz).

    EXAMPLES     how many examples per implementation: in `make test`, and in `make fuzz`
    cases()      the hypothesis strategy of its sizes
"""

from __future__ import annotations

from hypothesis import strategies as st

from workbook.ops.ms_deform_attn import case

EXAMPLES = {"ci": 150, "long": 1500}


@st.composite
def cases(draw):
    """Every configuration the op accepts, small: 1 to 4 levels of 0 to 6 pixels a side (empty
    levels too), batch 0 to 3, 0 to 5 queries, 1 to 3 heads of 1 to 40 channels (past a warp),
    1 to 4 points."""
    levels = draw(st.integers(1, 4))
    shapes = [(draw(st.integers(0, 6)), draw(st.integers(0, 6))) for _ in range(levels)]
    sizes = {"batch": draw(st.integers(0, 3)), "queries": draw(st.integers(0, 5)),
             "heads": draw(st.integers(1, 3)), "channels": draw(st.integers(1, 40)),
             "points": draw(st.integers(1, 4))}
    name = "_".join(f"{k}{v}" for k, v in sizes.items()) + "_" + "_".join(
        f"{h}x{w}" for h, w in shapes)
    return case(name, shapes=shapes, **sizes)
