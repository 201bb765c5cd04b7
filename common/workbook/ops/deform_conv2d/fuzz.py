"""How hypothesis draws the deformable convolution's calls (workbook.net.fuzz).

    EXAMPLES     how many examples per implementation: in `make test`, and in `make fuzz`
    cases()      the hypothesis strategy of its sizes
"""

from __future__ import annotations

from hypothesis import strategies as st

from workbook.spec import Case

EXAMPLES = {"ci": 250, "long": 2500}


@st.composite
def cases(draw) -> Case:
    """Every configuration the op accepts, small: groups and offset groups dividing the channels,
    kernel 1 to 3, stride and dilation 1 to 3, padding 0 to 2, images from the smallest that
    leaves one output position up to 6 pixels larger, with and without mask and bias."""
    groups = draw(st.integers(1, 3))
    in_channels = groups * draw(st.integers(1, 3))
    out_channels = groups * draw(st.integers(1, 3))
    offset_groups = draw(st.sampled_from([d for d in range(1, 5) if in_channels % d == 0]))
    sizes = {"batch": draw(st.integers(0, 3)), "in_channels": in_channels,
             "out_channels": out_channels, "groups": groups, "offset_groups": offset_groups,
             "mask": int(draw(st.booleans())), "bias": int(draw(st.booleans())),
             "offset_scale": draw(st.sampled_from([1, 3, 6]))}
    for axis, image in (("h", "height"), ("w", "width")):
        kernel, stride = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        pad, dilation = draw(st.integers(0, 2)), draw(st.integers(1, 3))
        smallest = max(1, dilation * (kernel - 1) + 1 - 2 * pad)  # one output position
        sizes.update({f"kernel_{axis}": kernel, f"stride_{axis}": stride, f"pad_{axis}": pad,
                      f"dilation_{axis}": dilation,
                      image: draw(st.integers(smallest, smallest + 6))})
    name = "_".join(f"{k}{v}" for k, v in sizes.items())
    return Case(name, sizes)
