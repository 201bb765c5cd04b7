"""How hypothesis draws the LLTM's calls (workbook.net.fuzz).

    EXAMPLES     how many examples per implementation: in `make test`, and in `make fuzz`
    cases()      the hypothesis strategy of its sizes
"""

from __future__ import annotations

from hypothesis import strategies as st

from workbook.spec import Case

EXAMPLES = {"ci": 400, "long": 5000}

# The LLTM CPU kernels split B x S elements over threads in chunks of at least this many
# (kGrainElements in stage 05's lltm_cpu.h): below it, a second thread never takes part.
GRAIN = 8192


@st.composite
def cases(draw) -> Case:
    """Batch, features and state 0 to 12; one case in sixteen just past the CPU kernels' grain
    (B x S over 8192, where two threads share the rows), with state 42 to 128 (the weights are
    3S x (S + F): a larger state costs the reference more than it tests)."""
    if draw(st.integers(0, 15)) < 15:  # shrinks towards the small sizes
        batch, state = draw(st.integers(0, 12)), draw(st.integers(0, 12))
    else:
        state = draw(st.integers(42, 128))
        least = -(-(GRAIN + 1) // state)
        batch = draw(st.integers(least, least + 8))
    features = draw(st.integers(0, 12))
    return Case(f"b{batch}_f{features}_s{state}",
                {"batch": batch, "features": features, "state": state})
