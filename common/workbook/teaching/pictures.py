"""The notebooks' pictures: one function per picture, drawn with matplotlib from real tensors.

Each function takes the tensors the notebook just computed, checks that what it is about to draw
agrees with them (an offset read back from the tensor, a blend recomputed and compared with the
op's output), and returns the figure; in Jupyter the figure shows below the cell.

* `autograd_graph`: the graph autograd recorded for a loss, and the gradient on every edge
  (notebook 01);
* `lltm_gate_layout`: the LLTM's weights [3S, S + F] and gates [B, 3S], and where a thread's three
  gates lie in memory (notebook 02);
* `lltm_thread_map`: which CUDA block and thread computes each (batch, state) element, for stage
  04's flat launch and stage 05's 2-D one (notebooks 04 and 05);
* `accessor_strides`: how `accessor[i][j]` of a view (a chunk, a transpose) finds its element in
  the storage, from the view's sizes, strides and storage offset (notebook 05);
* `deform_sampling`: a deformable convolution's taps at one output position: the regular grid,
  the offsets, the bilinear corners of every sample, one sample's blend (notebook 06);
* `deterministic_scatter`: the backward's scatter into the input gradient: which samples write
  which pixel, and the sort by destination that gives each pixel one owner (notebook 07);
* `tiled_matmul_loads`: which elements of A and B one block of the tiled matrix product loads
  into shared memory at one step of its K loop, and the band it walks (notebook 08);
* `block_reduction_steps`: a block reduction's partial sums step by step: halving in shared
  memory with a barrier after each step, then shuffles within a warp (notebook 08);
* `msda_sampling_points`: one query's sampling points of one head on each level of a feature
  pyramid, coloured by attention weight, with the value rows they read (notebook 09);
* `symbol_mismatch`: the symbol an extension built with the other C++11 ABI asks for, next to
  the one torch exports, mangled and demangled, the difference marked (appendix A1).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

GATE_NAMES = ("input gate", "output gate", "candidate")
GATE_COLORS = ("tab:blue", "tab:orange", "tab:green")


def _plt():
    import matplotlib.pyplot as plt

    return plt


def _rgba(color, alpha: float = 1.0) -> tuple[float, float, float, float]:
    from matplotlib.colors import to_rgba

    r, g, b, _ = to_rgba(color)
    # Blend with white rather than using transparency, so that imshow draws it as shown.
    return (1 - alpha + alpha * r, 1 - alpha + alpha * g, 1 - alpha + alpha * b, 1.0)


def _cell_grid(ax, rows: int, cols: int, color: str = "white", width: float = 0.8) -> None:
    """Lines between the cells of an imshow of rows x cols cells."""
    ax.set_xticks([c - 0.5 for c in range(cols + 1)], minor=True)
    ax.set_yticks([r - 0.5 for r in range(rows + 1)], minor=True)
    ax.grid(which="minor", color=color, linewidth=width)
    ax.tick_params(which="minor", length=0)


def _short(t: torch.Tensor | None) -> str:
    """A gradient as a label: its values when there are few, else its shape."""
    if t is None:
        return "None"
    if t.numel() <= 4:
        values = ", ".join(f"{v:g}" for v in t.detach().flatten().tolist())
        return values if t.dim() == 0 else f"[{values}]"
    return f"{tuple(t.shape)} tensor"


# ----------------------------------------------------------------------------------------------
# Notebook 01


def autograd_graph(loss: torch.Tensor, leaves: Mapping[str, torch.Tensor], *,
                   outputs: Mapping[str, str] | None = None, ax=None,
                   title: str = "") -> dict[str, torch.Tensor]:
    """Draw the graph autograd recorded for the scalar `loss` and run one backward through it.

    Leaves (`leaves`: name -> tensor with requires_grad) sit on the left, the loss L on the right;
    a box is a node of the backward graph (its `grad_fn` name), a grey arrow the forward data
    flow into it. The backward runs with a hook on every node, and each edge is labelled in red
    with the gradient that actually flowed along it (the node's `grad_inputs`), dL/d(the tensor
    it is the gradient of): a leaf, or the forward output of a node (`outputs`: node name, such
    as "MulBackward0", -> the name of the tensor its forward op produced). Returns the
    leaves' gradients, as `torch.autograd.grad(loss, leaves)` gives them.
    """
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 2.8))
    if loss.grad_fn is None:
        raise ValueError("loss has no grad_fn: compute it from tensors that require grad")

    # Nodes, each at its longest distance from the root (a small DAG: plain recursion will do).
    depth: dict = {}

    def visit(node, d):
        if node is None or depth.get(node, -1) >= d:
            return
        depth[node] = d
        for child, _ in node.next_functions:
            visit(child, d + 1)

    visit(loss.grad_fn, 0)
    deepest = max(depth.values())
    names = {}
    for node in depth:
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if variable is not None:
            names[node] = next((n for n, t in leaves.items() if t is variable), None)
            if names[node] is None:
                raise ValueError(f"the loss depends on a tensor of shape {tuple(variable.shape)} "
                                 f"that requires grad and is not in `leaves`: name it there")
            depth[node] = deepest  # every leaf in the leftmost column

    # The gradient each node passes to each of its inputs, recorded while the backward runs.
    flowed, handles = {}, []
    for node in depth:
        if node not in names:
            handles.append(node.register_hook(
                lambda grad_inputs, grad_outputs, node=node: flowed.__setitem__(node,
                                                                                 grad_inputs)))
    try:
        grads = torch.autograd.grad(loss, list(leaves.values()))
    finally:
        for handle in handles:
            handle.remove()

    # Positions: x by column (leaves left), y of a leaf by its order in `leaves`, of a node by
    # the mean of its inputs.
    pos = {}
    order = list(leaves)
    for node, name in names.items():
        pos[node] = (0.0, float(len(order) - 1 - order.index(name)))
    for col in range(1, deepest + 1):
        for node, d in depth.items():
            if deepest - d == col:
                ys = [pos[c][1] for c, _ in node.next_functions if c in pos]
                pos[node] = (float(col), sum(ys) / len(ys) if ys else 0.0)

    step = 2.4  # data units between columns: room for a label on every edge
    boxes = {}
    for node, (x, y) in pos.items():
        if node in names:
            boxes[node] = ax.text(x * step, y, names[node], ha="center", va="center", fontsize=12,
                                  bbox={"boxstyle": "circle", "facecolor": "white",
                                        "edgecolor": "k"})
        else:
            boxes[node] = ax.text(x * step, y, node.name(), ha="center", va="center", fontsize=9,
                                  family="monospace", bbox={"boxstyle": "round",
                                                            "facecolor": "0.92",
                                                            "edgecolor": "0.4"})
    root_x, root_y = pos[loss.grad_fn]
    boxes[None] = ax.text((root_x + 0.8) * step, root_y, "L", ha="center", va="center",
                          fontsize=12, bbox={"boxstyle": "round", "facecolor": "white",
                                             "edgecolor": "none"})
    edges = [(loss.grad_fn, None, "dL/dL = 1")]
    for node, grads_in in flowed.items():
        for (child, _), grad in zip(node.next_functions, grads_in):
            if child is not None:
                named = names.get(child) or (outputs or {}).get(child.name())
                if named and not named.isidentifier():
                    named = f"({named})"  # dL/d(2x)
                edges.append((child, node, (f"dL/d{named} = " if named else "")
                              + _short(grad)))
    ax.set(xlim=(-0.5 * step, (deepest + 1.2) * step), ylim=(-0.5, len(order) - 0.5),
           xticks=[], yticks=[])
    if title:
        ax.set_title(title, fontsize=10)
    # Where each box ends left and right, in data units, to put a label in the middle of the
    # visible part of its edge (the boxes differ in width); measured at the scale the figure
    # will be shown at, or close to it.
    ax.figure.tight_layout()
    renderer = ax.figure.canvas.get_renderer()
    to_data = ax.transData.inverted()
    ends = {}
    for node, box in boxes.items():
        extent = box.get_window_extent(renderer)
        (left, _), (right, _) = to_data.transform([(extent.x0, 0), (extent.x1, 0)])
        ends[node] = (left, right)
    for child, parent, label in edges:
        (cx, cy), (px, py) = pos[child], pos[parent] if parent else (root_x + 0.8, root_y)
        ax.annotate("", (px * step, py), (cx * step, cy),
                    arrowprops={"arrowstyle": "->", "color": "0.55", "shrinkA": 0, "shrinkB": 0,
                                "patchA": boxes[child].get_bbox_patch(),
                                "patchB": boxes[parent].get_bbox_patch()})
        # The label at the middle of the visible edge: above it, or below for an edge that rises.
        mx = (ends[child][1] + ends[parent][0]) / 2
        my = cy + (py - cy) * (mx - cx * step) / ((px - cx) * step)
        below = cy < py
        ax.text(mx, my + (-0.06 if below else 0.06), label, ha="center",
                va="top" if below else "bottom", fontsize=8, color="tab:red")
    for spine in ax.spines.values():
        spine.set_visible(False)
    return dict(zip(leaves, grads))


# ----------------------------------------------------------------------------------------------
# Notebooks 02 and 03 (and 04: the three reads of one thread)


def gate_offsets(gates: torch.Tensor, b: int, s: int) -> list[int]:
    """Where gates[b][k S + s], k = 0, 1, 2, lies in the storage: offset + b stride0 + col stride1,
    read from the tensor itself."""
    state = gates.shape[1] // 3
    return [gates.storage_offset() + b * gates.stride(0) + (k * state + s) * gates.stride(1)
            for k in range(3)]


def lltm_gate_layout(weights: torch.Tensor, gates: torch.Tensor, *, b: int = 1, s: int = 2):
    """The LLTM's weights [3S, S + F], its gates G = [h, x] W^T + b [B, 3S], and the gates in
    memory, row after row, with the three values that element (b, s) of the state needs.

    Row block k of the weights (S rows) produces column block k of the gates: input gate,
    output gate, candidate. Column block h (the first S columns) of the weights multiplies the
    old hidden state, block x (F columns) the input, because X = [h, x]. The offsets drawn are
    computed from the tensor's own strides (`gate_offsets`).
    """
    plt = _plt()
    rows3, width = weights.shape
    state = rows3 // 3
    features = width - state
    batch = gates.shape[0]
    if tuple(gates.shape) != (batch, 3 * state):
        raise ValueError(f"gates {tuple(gates.shape)} do not match weights {tuple(weights.shape)}")

    fig = plt.figure(figsize=(12, 5.6))
    spec = fig.add_gridspec(2, 2, width_ratios=[width, 3 * state + 8], height_ratios=[3, 1])

    ax = fig.add_subplot(spec[0, 0])
    image = [[_rgba(GATE_COLORS[r // state], 0.85 if c < state else 0.4) for c in range(width)]
             for r in range(rows3)]
    ax.imshow(image)
    _cell_grid(ax, rows3, width)
    ax.axvline(state - 0.5, color="k", linewidth=1.5)
    for k in range(3):
        ax.text(width + 0.3, k * state + (state - 1) / 2, GATE_NAMES[k], va="center",
                fontsize=9, color=GATE_COLORS[k])
    ax.set_xticks([(state - 1) / 2, state + (features - 1) / 2],
                  [f"h\n0-{state - 1}", f"x\n{state}-{width - 1}"])
    ax.set_yticks([k * state for k in range(3)] + [rows3 - 1])
    ax.set_title(f"weights W [3S, S + F] = [{rows3}, {width}]", fontsize=10)

    ax = fig.add_subplot(spec[0, 1])
    image = [[_rgba(GATE_COLORS[c // state], 0.6) for c in range(3 * state)]
             for _ in range(batch)]
    ax.imshow(image)
    _cell_grid(ax, batch, 3 * state)
    for k in range(3):
        ax.add_patch(plt.Rectangle((k * state + s - 0.5, b - 0.5), 1, 1, fill=False,
                                   edgecolor="k", linewidth=2))
    ax.set_xticks([k * state + (state - 1) / 2 for k in range(3)],
                  [f"G{k}: {GATE_NAMES[k]}\ncolumns {k * state}-{(k + 1) * state - 1}"
                   for k in range(3)])
    ax.set_yticks(range(batch))
    ax.set_ylabel("batch row b")
    ax.set_title(f"gates G = [h, x] W^T + b  [B, 3S] = [{batch}, {3 * state}]: row block k of W "
                 f"gives column block k\n(framed: the three gates of state element (b, s) = "
                 f"({b}, {s}))", fontsize=10)

    ax = fig.add_subplot(spec[1, :])
    flat = gates.numel()
    strip = [[_rgba(GATE_COLORS[(n % (3 * state)) // state], 0.6) for n in range(flat)]]
    ax.imshow(strip, aspect="auto")
    ax.set_xticks([n - 0.5 for n in range(flat + 1)], minor=True)
    ax.grid(which="minor", axis="x", color="white", linewidth=0.6)
    ax.tick_params(which="minor", length=0)
    for row in range(1, batch):
        ax.axvline(row * 3 * state - 0.5, color="k", linewidth=1.5)
    offsets = gate_offsets(gates, b, s)
    for k, offset in enumerate(offsets):
        assert gates.flatten()[offset] == gates[b, k * state + s]  # the element drawn is G[b][kS+s]
        ax.add_patch(plt.Rectangle((offset - 0.5, -0.5), 1, 1, fill=False, edgecolor="k",
                                   linewidth=2))
        ax.text(offset, 0, str(offset), ha="center", va="center", fontsize=8, rotation=90,
                fontweight="bold")
    ax.set_yticks([])
    ax.xaxis.tick_top()
    ax.set_xticks([row * 3 * state for row in range(batch)],
                  [f"row {row} starts at {row * 3 * state}" for row in range(batch)], fontsize=8)
    ax.set_xlabel(f"the gates in memory (contiguous, strides {tuple(gates.stride())}): element "
                  f"(b, s) reads b 3S + s, b 3S + S + s, b 3S + 2S + s = "
                  f"{', '.join(map(str, offsets))} (framed)", fontsize=10)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------
# Notebooks 04 and 05


def lltm_launch(batch: int, state: int, *, threads: int = 256, layout: str = "flat",
                warp: int = 32, max_grid_y: int = 65535):
    """(grid, block) of the LLTM kernels, as the launchers compute them: "flat" is stage 04's
    blocks_for (1-D, `threads` per block), "2d" stage 05's block_for/grid_for."""
    ceil = lambda a, b: (a + b - 1) // b
    if layout == "flat":
        return (ceil(batch * state, threads), 1), (threads, 1)
    if layout == "2d":
        x = min(ceil(state, warp) * warp, threads)
        block = (x, threads // x)
        return (ceil(state, block[0]), min(ceil(batch, block[1]), max_grid_y)), block
    raise ValueError(f"layout must be 'flat' or '2d', got {layout!r}")


def lltm_thread_owners(batch: int, state: int, **launch) -> dict[str, torch.Tensor]:
    """For each (b, s) of the B x S state: the block (blockIdx.x, blockIdx.y) and thread
    (threadIdx.x, threadIdx.y) that computes it, following the kernels' index arithmetic
    (stage 04: n = blockIdx.x blockDim.x + threadIdx.x, b = n / S, s = n % S; stage 05:
    s = blockIdx.x blockDim.x + threadIdx.x, b = blockIdx.y blockDim.y + threadIdx.y, then b
    steps by gridDim.y blockDim.y). Also `idle`: the threads of the grid that compute nothing."""
    (gx, gy), (bx, by) = lltm_launch(batch, state, **launch)
    owners = {k: torch.full((batch, state), -1, dtype=torch.long)
              for k in ("block_x", "block_y", "thread_x", "thread_y")}
    idle = 0
    for block_x in range(gx):
        for block_y in range(gy):
            for thread_x in range(bx):
                for thread_y in range(by):
                    if launch.get("layout", "flat") == "flat":
                        n = block_x * bx + thread_x
                        cells = [(n // state, n % state)] if n < batch * state else []
                    else:
                        s = block_x * bx + thread_x
                        rows = range(block_y * by + thread_y, batch, gy * by)
                        cells = [(b, s) for b in rows] if s < state else []
                    idle += not cells
                    for b, s in cells:
                        assert owners["block_x"][b, s] < 0, f"({b}, {s}) written twice"
                        for key, v in zip(owners, (block_x, block_y, thread_x, thread_y)):
                            owners[key][b, s] = v
    assert (owners["block_x"] >= 0).all(), "an element no thread computes"
    owners["idle"] = torch.tensor(idle)
    return owners


def lltm_thread_map(batch: int, state: int, *, threads: int = 256, layout: str = "flat",
                    show: tuple[int, int] | None = None):
    """Every thread of the LLTM kernels' launch, drawn where it works: each (b, s) of the B x S
    state in the colour of the CUDA block that computes it, the grid's idle threads in pale
    colours outside the dashed B x S frame, and one thread (`show`: its (b, s)) followed through
    the index arithmetic.

    layout "flat" (stage 04): blocks of `threads` consecutive elements of the flattened state,
    drawn row after row as the kernel numbers them (n = b S + s), so a block may start in the
    middle of a row and the threads past B S sit on extra rows. layout "2d" (stage 05): blocks
    of blockDim.x columns by blockDim.y rows, the columns past S idle. The owners are those of
    `lltm_thread_owners`, which follows the kernels' arithmetic.
    """
    plt = _plt()
    (gx, gy), (bx, by) = lltm_launch(batch, state, threads=threads, layout=layout)
    owners = lltm_thread_owners(batch, state, threads=threads, layout=layout)
    palette = ["#6baed6", "#fd8d3c", "#74c476", "#9e9ac8", "#fb6a4a", "#969696"]
    if layout == "flat":
        rows, cols = max(batch, -(-gx * bx // state)), state
        block_of = lambda r, c: ((r * state + c) // bx, 0) if r * state + c < gx * bx else None
        busy = lambda r, c: r * state + c < batch * state
    else:
        rows, cols = max(batch, gy * by), gx * bx
        block_of = lambda r, c: (c // bx, (r // by) % gy)
        busy = lambda r, c: r < batch and c < state
    canvas = torch.ones(rows, cols, 4)
    for r in range(rows):
        for c in range(cols):
            block = block_of(r, c)
            if block is None:
                continue
            if busy(r, c):  # the owner the kernel's arithmetic gives, drawn in full colour
                assert (int(owners["block_x"][r, c]), int(owners["block_y"][r, c])) == block
            color = palette[(block[0] + gx * block[1]) % len(palette)]
            canvas[r, c] = torch.tensor(_rgba(color, 1.0 if busy(r, c) else 0.25))
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.3 * rows))
    ax.imshow(canvas, aspect="auto")
    _cell_grid(ax, rows, cols, width=0.3)
    ax.add_patch(plt.Rectangle((-0.5, -0.5), state, batch, fill=False, edgecolor="k",
                               linestyle="--", linewidth=1.2))
    for bxi in range(gx):
        for byi in range(gy):
            cells = [(r, c) for r in range(rows) for c in range(cols)
                     if block_of(r, c) == (bxi, byi)]
            if cells:
                r, c = cells[0]
                ax.text(c + 0.5, r, f"block {bxi}" + (f", {byi}" if layout == "2d" else ""),
                        va="center", fontsize=8)
    if show is not None:
        b, s = show
        ax.add_patch(plt.Rectangle((s - 0.5, b - 0.5), 1, 1, fill=False, edgecolor="k",
                                   linewidth=2))
        bxi, byi, txi, tyi = (int(owners[k][b, s]) for k in
                              ("block_x", "block_y", "thread_x", "thread_y"))
        if layout == "flat":
            n = bxi * bx + txi
            words = (f"blockIdx.x {bxi}, threadIdx.x {txi}: n = {bxi} x {bx} + {txi} = {n}, "
                     f"b = n / S = {n // state}, s = n - b S = {n % state}")
        else:
            words = (f"blockIdx ({bxi}, {byi}), threadIdx ({txi}, {tyi}): s = {bxi} x {bx} + "
                     f"{txi} = {bxi * bx + txi}, b = {byi} x {by} + {tyi} = {byi * by + tyi}")
        ax.set_xlabel(f"state s (framed: {words})", fontsize=9)
    else:
        ax.set_xlabel("state s")
    idle = int(owners["idle"])
    kind = (f"{gx} blocks of {bx} threads" if layout == "flat"
            else f"grid ({gx}, {gy}) of blocks ({bx}, {by})")
    ax.set_title(f"B x S = {batch} x {state} (dashed): {kind}, {gx * gy * bx * by} threads, "
                 f"{idle} of them idle (pale)", fontsize=10)
    ax.set_ylabel("batch b")
    ax.set_yticks(range(rows))
    fig.tight_layout()
    return fig


def accessor_strides(base: torch.Tensor, views: Mapping[str, torch.Tensor], *, row: int = 1):
    """How a 2-D packed accessor of each view finds element [i][j]: its data pointer is the
    view's first element (storage offset o), and [i][j] is o + i stride0 + j stride1 in the
    storage. The storage is `base`'s (a contiguous tensor of distinct values, say an arange);
    each view is drawn as its grid of cells, each labelled with the storage offset it reads, and
    the elements of its row `row` (what threads j = 0, 1, ... of one row read together) are
    marked in the storage. Every offset drawn is checked against the view's own values first.
    """
    plt = _plt()
    storage = base.flatten()
    if not base.is_contiguous():
        raise ValueError("base must be contiguous: its flat order is the storage order")
    offsets = {}
    for name, view in views.items():
        if view.dim() != 2 or view.untyped_storage().data_ptr() != \
                base.untyped_storage().data_ptr():
            raise ValueError(f"{name}: a 2-D view of base expected")
        i, j = torch.meshgrid(torch.arange(view.shape[0]), torch.arange(view.shape[1]),
                              indexing="ij")
        where = view.storage_offset() + i * view.stride(0) + j * view.stride(1)
        assert torch.equal(storage[where], view), f"{name}: the offsets do not match its values"
        offsets[name] = where

    tallest = max(v.shape[0] for v in views.values())
    fig = plt.figure(figsize=(12, 3.0 + 0.45 * tallest))
    spec = fig.add_gridspec(2, len(views), height_ratios=[2.0, 0.5 * tallest + 1.0])
    colors = plt.get_cmap("tab10")
    ax = fig.add_subplot(spec[0, :])
    n = storage.numel()
    ax.imshow([[_rgba("0.88")] * n], aspect="auto", extent=(-0.5, n - 0.5, 0.5, -0.5))
    ax.set_xticks(range(n), [str(k) for k in range(n)], fontsize=7)
    ax.set_xticks([k - 0.5 for k in range(n + 1)], minor=True)
    ax.grid(which="minor", axis="x", color="white", linewidth=1)
    ax.tick_params(which="minor", length=0)
    ax.set_yticks([])
    ax.set_ylim(0.5, -0.5 - 0.45 * len(views))
    for v, where in enumerate(offsets.values()):
        ks = where[row].tolist()
        level = -0.55 - 0.45 * v
        ax.plot(ks, [level] * len(ks), "-", color=colors(v), linewidth=0.8, alpha=0.6)
        for j, k in enumerate(ks):
            ax.text(k, level, f"j{j}", ha="center", va="center", fontsize=7, color="white",
                    bbox={"boxstyle": "round,pad=0.15", "facecolor": colors(v),
                          "edgecolor": "none"})
            ax.plot([k, k], [level + 0.15, 0.45], ":", color=colors(v), linewidth=0.8)
    ax.set_title(f"the storage: {n} elements of a contiguous {tuple(base.shape)} tensor; above "
                 f"it, where [{row}][j] of each view lies, j = 0, 1, ...", fontsize=10)
    for v, (name, view) in enumerate(views.items()):
        ax = fig.add_subplot(spec[1, v])
        rows, cols = view.shape
        image = [[_rgba(colors(v), 0.55 if i == row else 0.2)] * cols for i in range(rows)]
        ax.imshow(image)
        _cell_grid(ax, rows, cols)
        for i in range(rows):
            for j in range(cols):
                ax.text(j, i, str(int(offsets[name][i, j])), ha="center", va="center",
                        fontsize=9)
        ax.set_xticks(range(cols))
        ax.set_yticks(range(rows))
        ax.set(xlabel="j", ylabel="i")
        o, (s0, s1) = view.storage_offset(), view.stride()
        ax.set_title(f"{name}\nsizes {tuple(view.shape)}, strides ({s0}, {s1}), offset {o}:\n"
                     f"[i][j] is storage[{o} + {s0} i + {s1} j]", fontsize=9, color=colors(v))
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------
# Notebook 06


def bilinear_corners(y: float, x: float, height: int, width: int):
    """The four corners of (y, x), as workbook/bilinear.h weighs them: (row, column, weight,
    inside), the weight being the area of the rectangle opposite the corner."""
    import math

    y0, x0 = math.floor(y), math.floor(x)
    ly, lx = y - y0, x - x0
    corners = []
    for dy, dx, w in ((0, 0, (1 - ly) * (1 - lx)), (0, 1, (1 - ly) * lx), (1, 0, ly * (1 - lx)),
                      (1, 1, ly * lx)):
        r, c = y0 + dy, x0 + dx
        corners.append((r, c, w, 0 <= r < height and 0 <= c < width))
    return corners


def deform_sampling(image: torch.Tensor, regular: torch.Tensor, moved: torch.Tensor,
                    samples: torch.Tensor, regular_samples: torch.Tensor, *,
                    zoom: int | None = None, title: str = ""):
    """One output position of a deformable convolution: the regular taps (hollow), the offsets
    (arrows), the sampling points (filled) with their four bilinear corners (lines whose width
    is the corner's weight), and, zoomed, the blend of tap `zoom` (by default the tap whose
    corners differ most).

    image [H, W]; regular, moved [K, 2]: (y, x) of each tap without and with its offset;
    samples, regular_samples [K]: what the op read at `moved` and at `regular`. The blends are
    recomputed here from the corners and must equal `samples` (so the picture shows what the op
    computed); the 3 x 3 panels show both sets of samples.
    """
    plt = _plt()
    height, width = image.shape
    corners = [bilinear_corners(y, x, height, width) for y, x in moved.tolist()]
    blends = torch.tensor([sum(w * float(image[r, c]) for r, c, w, inside in cs if inside)
                           for cs in corners], dtype=samples.dtype)
    torch.testing.assert_close(blends, samples, rtol=1e-5, atol=1e-6)
    if zoom is None:
        spread = [max(vs) - min(vs) for vs in
                  ([float(image[r, c]) if inside else 0.0 for r, c, _, inside in cs]
                   for cs in corners)]
        zoom = max(range(len(spread)), key=spread.__getitem__)

    fig = plt.figure(figsize=(13, 5.2))
    spec = fig.add_gridspec(2, 3, width_ratios=[2.1, 1.2, 0.9])
    ax = fig.add_subplot(spec[:, 0])
    ax.imshow(image, cmap="gray", vmin=0, vmax=1.3)
    for (gy, gx), (my, mx) in zip(regular.tolist(), moved.tolist()):
        ax.annotate("", (mx, my), (gx, gy),
                    arrowprops={"arrowstyle": "->", "color": "tab:orange"})
    for k, ((my, mx), cs) in enumerate(zip(moved.tolist(), corners)):
        for r, c, w, inside in cs:
            if inside and w > 0:
                ax.plot([mx, c], [my, r], color="tab:red" if k == zoom else "tab:pink",
                        linewidth=0.5 + 3 * w)
    ax.scatter(regular[:, 1], regular[:, 0], s=60, facecolors="none", edgecolors="tab:cyan",
               linewidths=2, label="regular taps")
    ax.scatter(moved[:, 1], moved[:, 0], s=40, color="tab:orange", zorder=3,
               label="taps + offsets")
    ax.plot([], [], color="tab:pink", linewidth=2, label="to the 4 corners (width: weight)")
    ax.text(moved[zoom, 1] + 0.5, moved[zoom, 0] - 0.5, f"tap {zoom}", color="tab:red",
            fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title, fontsize=10)

    # The zoom: the 2 x 2 pixels around tap `zoom`, their values and weights, and the blend.
    ax = fig.add_subplot(spec[:, 1])
    y, x = moved[zoom].tolist()
    r0, c0 = corners[zoom][0][:2]
    patch = torch.zeros(2, 2)
    for r, c, _, inside in corners[zoom]:
        if inside:
            patch[r - r0, c - c0] = image[r, c]
    ax.imshow(patch, cmap="gray", vmin=0, vmax=1.3, extent=(c0 - 0.5, c0 + 1.5, r0 + 1.5,
                                                            r0 - 0.5))
    terms = []
    for r, c, w, inside in corners[zoom]:
        v = float(image[r, c]) if inside else 0.0
        ax.plot([x, c], [y, r], color="tab:red", linewidth=0.5 + 3 * w)
        ax.text(c, r + (0.22 if r > y else -0.22), f"({r}, {c})\nvalue {v:.2f}\nweight {w:.2f}",
                ha="center", va="center", fontsize=8, color="tab:red",
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
        terms.append(f"{w:.2f} x {v:.2f}")
    ax.plot(x, y, "o", color="tab:orange", markersize=9)
    ax.set_xticks([c0, c0 + 1])
    ax.set_yticks([r0, r0 + 1])
    ax.set_title(f"tap {zoom} at (y, x) = ({y:.2f}, {x:.2f}):\n" + " + ".join(terms[:2])
                 + " +\n" + " + ".join(terms[2:]) + f" = {float(samples[zoom]):.3f}", fontsize=9)

    for row, (values, what) in enumerate(((regular_samples, "what the regular taps read"),
                                          (samples, "what the deformed taps read"))):
        ax = fig.add_subplot(spec[row, 2])
        ax.imshow(values.reshape(3, 3), cmap="gray", vmin=0, vmax=1.3)
        for k, v in enumerate(values.tolist()):
            ax.text(k % 3, k // 3, f"{v:.2f}", ha="center", va="center", color="tab:red",
                    fontsize=8)
        ax.set_title(f"{what}\n(sum {float(values.sum()):.2f})", fontsize=9)
        ax.set(xticks=[], yticks=[])
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------
# Notebook 07


def corner_entries(y: torch.Tensor, x: torch.Tensor, height: int, width: int):
    """Steps 1 to 4 of stage 07's deterministic backward for one image and offset group, in
    PyTorch: entry e = 4 t + j for corner j of sample t, keyed by the pixel it writes (row W +
    column) or `none` = H W when the corner is outside; a stable sort of the keys; the runs of
    equal keys. Returns (keys, order, run_starts, run_keys): order[i] is the entry at sorted
    place i; run r covers sorted places run_starts[r] to run_starts[r + 1] - 1."""
    y0, x0 = y.floor().long(), x.floor().long()
    keys = []
    for dy, dx in ((0, 0), (0, 1), (1, 0), (1, 1)):  # j = 0..3, the order bilinear.h numbers them
        r, c = y0 + dy, x0 + dx
        inside = (r >= 0) & (r < height) & (c >= 0) & (c < width)
        keys.append(torch.where(inside, r * width + c, height * width))
    keys = torch.stack(keys, dim=1).flatten()  # [samples * 4], e = 4 t + j
    sorted_keys, order = torch.sort(keys, stable=True)
    live = sorted_keys < height * width
    heads = live & torch.cat([torch.tensor([True]), sorted_keys[1:] != sorted_keys[:-1]])
    run_starts = heads.nonzero().flatten()
    run_starts = torch.cat([run_starts, live.sum().reshape(1)])
    return keys, order, run_starts, sorted_keys[run_starts[:-1]]


def deterministic_scatter(y: torch.Tensor, x: torch.Tensor, height: int, width: int):
    """The input-gradient scatter of a deformable convolution, for a few samples t at (y[t],
    x[t]) on an H x W plane. Left: each sample's thread adds into its four corners; the number
    in a pixel is how many adds it receives, which the atomic backward makes in whatever order
    the threads arrive. Right: the deterministic backward: the corner entries in the order they
    are made (e = 4 t + j), the same entries stably sorted by the pixel they write, and the runs
    of equal pixels, each summed by one thread in that fixed order (`corner_entries`)."""
    plt = _plt()
    keys, order, run_starts, run_keys = corner_entries(y, x, height, width)
    none = height * width
    writers = torch.bincount(keys[keys < none], minlength=none).reshape(height, width)
    colors = plt.get_cmap("tab10")

    fig = plt.figure(figsize=(13, 0.5 + 0.28 * len(keys)))
    spec = fig.add_gridspec(1, 2, width_ratios=[1, 1.5])
    ax = fig.add_subplot(spec[0, 0])
    ax.imshow(writers, cmap="Reds", vmin=0, vmax=max(int(writers.max()), 1) * 1.6,
              extent=(-0.5, width - 0.5, height - 0.5, -0.5))
    _cell_grid(ax, height, width, color="0.7")
    for r in range(height):
        for c in range(width):
            adds = int(writers[r, c])
            ax.text(c - 0.45, r - 0.45, f"pixel {r * width + c}\n{adds} add{'s' * (adds != 1)}",
                    ha="left", va="top", fontsize=7)
    for t, (ty, tx) in enumerate(zip(y.tolist(), x.tolist())):
        for r, c, w, inside in bilinear_corners(ty, tx, height, width):
            ax.plot([tx, c], [ty, r], color=colors(t), linewidth=0.5 + 2.5 * w,
                    linestyle="-" if inside else ":")
        ax.plot(tx, ty, "o", color=colors(t), markersize=8)
        ax.text(tx + 0.08, ty + 0.08, f"t{t}", color=colors(t), fontsize=10, fontweight="bold")
    rows, cols = zip(*((r, c) for ty, tx in zip(y.tolist(), x.tolist())
                       for r, c, _, _ in bilinear_corners(ty, tx, height, width)))
    ax.set(xlim=(min(-0.5, *cols) - 0.2, max(width - 0.5, *cols) + 0.2),
           ylim=(max(height - 0.5, *rows) + 0.2, min(-0.5, *rows) - 0.2))
    ax.set_title("atomics: sample t's thread adds into its 4 corners (dotted: outside,\n"
                 "skipped); the adds into one pixel arrive in any order", fontsize=9)

    ax = fig.add_subplot(spec[0, 1])
    count = len(keys)

    def entry(col, place, e):
        t, j = divmod(int(e), 4)
        key = int(keys[e])
        where = "none" if key == none else f"pixel {key}"
        ax.text(col, place, f"e{e}: t{t} corner {j} -> {where}", ha="center", va="center",
                fontsize=7, color=colors(t),
                bbox={"facecolor": "white", "edgecolor": colors(t), "pad": 1.5})

    for e in range(count):
        entry(0, e, e)
    for place, e in enumerate(order.tolist()):
        entry(2.2, place, e)
        ax.plot([0.68, 1.52], [e, place], color=colors(int(e) // 4), linewidth=0.6, alpha=0.6)
    for r in range(len(run_keys)):
        first, last = int(run_starts[r]), int(run_starts[r + 1]) - 1
        ax.plot([3.0, 3.1, 3.1, 3.0], [first - 0.3, first - 0.3, last + 0.3, last + 0.3],
                color="k", linewidth=1)
        adds = last - first + 1
        ax.text(3.2, (first + last) / 2, f"run {r}: pixel {int(run_keys[r])}, {adds} "
                f"add{'s' * (adds > 1)}", va="center", fontsize=7)
    if int(run_starts[-1]) < count:
        ax.text(3.2, (int(run_starts[-1]) + count - 1) / 2, "outside: sorted last, skipped",
                va="center", fontsize=7, color="0.4")
    ax.set(xlim=(-0.8, 4.6), ylim=(count - 0.4, -1.4), xticks=[], yticks=[])
    ax.text(0, -1.1, "entries as made (e = 4 t + j)", ha="center", fontsize=9)
    ax.text(2.2, -1.1, "stably sorted by pixel", ha="center", fontsize=9)
    ax.text(3.0, -1.1, "runs: one thread each (per channel)", ha="left", fontsize=9)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title("deterministic: sort by destination, then one owner per pixel", fontsize=9)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------
# Appendix A1


def tiled_matmul_loads(m: int, n: int, k: int, *, tile: int = 4, block: tuple[int, int] = (1, 1),
                       step: int = 1):
    """C [m, n] = A [m, k] B [k, n] in tiles of `tile` x `tile`: the block `block` (blockIdx.x,
    blockIdx.y) computes C's tile in column block x, row block y. At step `step` of its K loop
    (k0 = step x tile) each thread (tx, ty) loads A[row0 + ty][k0 + tx] and B[k0 + ty][col0 + tx]
    into the shared tiles, as matmul_tiled_kernel does; the picture marks those elements (dark),
    the band of A's rows and B's columns the block walks over all steps (light), and the tile of
    C it writes. The marks are computed from the kernel's index arithmetic, thread by thread,
    and checked against the rectangles they should fill."""
    plt = _plt()
    bx, by = block
    row0, col0, k0 = by * tile, bx * tile, step * tile
    loads_a, loads_b = torch.zeros(m, k, dtype=torch.bool), torch.zeros(k, n, dtype=torch.bool)
    for ty in range(tile):
        for tx in range(tile):  # the kernel's loads, out of range ones loading zeros instead
            if row0 + ty < m and k0 + tx < k:
                loads_a[row0 + ty, k0 + tx] = True
            if k0 + ty < k and col0 + tx < n:
                loads_b[k0 + ty, col0 + tx] = True
    rows, cols, ks = (slice(row0, min(row0 + tile, m)), slice(col0, min(col0 + tile, n)),
                      slice(k0, min(k0 + tile, k)))
    assert loads_a.sum() == loads_a[rows, ks].numel() and loads_a[rows, ks].all()
    assert loads_b.sum() == loads_b[ks, cols].numel() and loads_b[ks, cols].all()

    def canvas(height, width, band, now, color):
        image = torch.ones(height, width, 4)
        image[band] = torch.tensor(_rgba(color, 0.25))
        image[now] = torch.tensor(_rgba(color, 1.0))
        return image

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6),
                             gridspec_kw={"width_ratios": [k, n, n]})
    pictures = [
        ("A", canvas(m, k, (rows, slice(None)), loads_a, "tab:blue"), m, k),
        ("B", canvas(k, n, (slice(None), cols), loads_b, "tab:orange"), k, n),
        ("C", canvas(m, n, (rows, cols), (rows, cols), "tab:green"), m, n),
    ]
    for ax, (name, image, height, width) in zip(axes, pictures):
        ax.imshow(image, aspect="equal")
        _cell_grid(ax, height, width, color="#dddddd", width=0.5)
        for edge in range(0, max(height, width) + 1, tile):  # the tile boundaries
            if edge <= width:
                ax.axvline(edge - 0.5, color="k", linewidth=0.8)
            if edge <= height:
                ax.axhline(edge - 0.5, color="k", linewidth=0.8)
        ax.set_title(f"{name} [{height}, {width}]", fontsize=10)
        ax.set_xticks([])
        ax.set_yticks([])
    steps = -(-k // tile)
    fig.suptitle(f"block ({bx}, {by}): {tile} x {tile} threads; step {step} of {steps} of its K "
                 f"loop (k0 = {k0}) loads the dark tiles of A and B into shared memory, one "
                 f"element a thread; over all steps, the light bands; it writes C's green tile",
                 fontsize=9, wrap=True)
    fig.tight_layout()
    return fig


def block_reduction_steps(values: torch.Tensor, *, warp: int = 4):
    """The partial sums of a block reduction over len(values) threads (a power of 2), as
    column_sums_kernel computes them scaled down: a row per step, a column per thread. First the
    block halves in shared memory (thread t adds slot t + half; a barrier after each step) until
    `warp` sums remain, then the first warp adds those with shuffles (lane t adds lane
    t + offset's register, no barrier). The arrows are the additions; the last sum is checked
    against values.sum()."""
    plt = _plt()
    threads = values.numel()
    assert threads & (threads - 1) == 0 and warp <= threads, "a power of 2 threads, warp <= it"
    rows = [("registers, then shared memory", values.double().clone(), None)]
    partial = values.double().clone()
    half = threads // 2
    while half >= warp:
        before = partial.clone()
        partial[:half] += before[half:2 * half]
        rows.append((f"shared: t < {half} adds t + {half}; __syncthreads()", partial.clone(), half))
        half //= 2
    lanes = partial[:warp].clone()
    offset = warp // 2
    while offset > 0:
        moved = torch.cat([lanes[offset:], lanes[-offset:]])  # past the end: its own value
        lanes = lanes + moved
        shown = partial.clone() * float("nan")
        shown[:warp] = lanes
        rows.append((f"warp: lane t adds __shfl_down_sync(..., {offset})", shown, -offset))
        offset //= 2
    assert torch.isclose(lanes[0], values.double().sum()), "the tree lost a value"
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(rows) + 1))
    for r, (label, row, step) in enumerate(rows):
        for t in range(threads):
            value = row[t].item()
            active = value == value  # not NaN
            ax.add_patch(plt.Rectangle((t - 0.45, -r - 0.35), 0.9, 0.7,
                                       facecolor=_rgba("tab:green" if step is not None and step < 0
                                                       else "tab:blue", 0.6 if active else 0.05),
                                       edgecolor="k" if active else "#dddddd", linewidth=0.5))
            if active:
                ax.text(t, -r, f"{value:.0f}", ha="center", va="center", fontsize=7)
        ax.text(-0.8, -r, label, ha="right", va="center", fontsize=8)
        if step is not None and r > 0:
            span = step if step > 0 else -step
            width = span if step > 0 else warp - span
            for t in range(width):  # the additions of this step: from t + span into t
                ax.annotate("", xy=(t, -r + 0.35), xytext=(t + span, -r + 0.65),
                            arrowprops={"arrowstyle": "->", "color": "0.35", "linewidth": 0.6})
        if step is not None and step > 0:
            ax.axhline(-r - 0.5, color="tab:red", linewidth=1, linestyle="--")
    ax.set_xlim(-12, threads)
    ax.set_ylim(-len(rows) + 0.4, 0.6)
    ax.axis("off")
    ax.set_title(f"{threads} threads, a warp of {warp} lanes: sum {lanes[0].item():.0f} in "
                 f"thread 0 (dashed red: the barriers; green: shuffles, no barrier)", fontsize=10)
    fig.tight_layout()
    return fig


def msda_sampling_points(spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
                         locations: torch.Tensor, weights: torch.Tensor, *, head: int = 0):
    """Multi-scale deformable attention, one query and one head: a panel per level (its H x W
    pixel grid), the head's P points on it at (x W - 0.5, y H - 0.5) in pixels, each a dot
    coloured and sized by its attention weight, and the 4 pixels it blends outlined. Below each
    panel, the rows of value those pixels are (level_start_index + row W + column).

    locations [L, P, 2] and weights [L, P] are the query's, for `head` already chosen (or
    [M, L, P, ...]: `head` picks one). The rows listed are recomputed from the same formula the
    kernels use (workbook/ms_deform_attn.h) and checked to lie inside the level."""
    plt = _plt()
    if locations.dim() == 4:
        locations, weights = locations[head], weights[head]
    shapes = [tuple(int(v) for v in hw) for hw in spatial_shapes.tolist()]
    starts = [int(v) for v in level_start_index.tolist()]
    levels = len(shapes)
    fig, axes = plt.subplots(1, levels, figsize=(3.2 * levels, 3.6), squeeze=False)
    cmap = plt.get_cmap("viridis")
    top = float(weights.max()) if weights.numel() else 1.0
    for level, ((h, w), start, ax) in enumerate(zip(shapes, starts, axes[0])):
        ax.set_xlim(-1, w)
        ax.set_ylim(h, -1)
        ax.set_aspect("equal")
        for r in range(h + 1):
            ax.plot([-0.5, w - 0.5], [r - 0.5, r - 0.5], color="#dddddd", linewidth=0.5)
        for c in range(w + 1):
            ax.plot([c - 0.5, c - 0.5], [-0.5, h - 0.5], color="#dddddd", linewidth=0.5)
        rows = []
        for p in range(locations.shape[1]):
            lx, ly = (float(v) for v in locations[level, p])
            x, y = lx * w - 0.5, ly * h - 0.5
            a = float(weights[level, p])
            if not (-1 < y < h and -1 < x < w):
                ax.plot(x, y, "x", color="tab:red", markersize=6)
                continue
            y0, x0 = int(y // 1), int(x // 1)
            for r, c in ((y0, x0), (y0, x0 + 1), (y0 + 1, x0), (y0 + 1, x0 + 1)):
                if 0 <= r < h and 0 <= c < w:
                    ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False,
                                               edgecolor=cmap(a / top), linewidth=1.2))
                    row = start + r * w + c
                    assert start <= row < start + h * w
                    rows.append(row)
            ax.scatter([x], [y], s=30 + 170 * a / top, color=cmap(a / top), edgecolor="k",
                       zorder=3)
        ax.set_title(f"level {level}: {h} x {w}, rows {start}..{start + h * w - 1}", fontsize=9)
        shown = ", ".join(str(r) for r in sorted(set(rows))[:8])
        ax.set_xlabel(f"reads rows {shown}{', ...' if len(set(rows)) > 8 else ''}", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"one query, head {head}: its points on every level, colour and size = "
                 f"attention weight (x: outside the level)", fontsize=10)
    fig.tight_layout()
    return fig


def _difference(a: str, b: str) -> tuple[str, str, str, str]:
    """(common prefix, a's middle, b's middle, common suffix) of two strings."""
    start = 0
    while start < min(len(a), len(b)) and a[start] == b[start]:
        start += 1
    end = 0
    while end < min(len(a), len(b)) - start and a[len(a) - 1 - end] == b[len(b) - 1 - end]:
        end += 1
    return a[:start], a[start:len(a) - end], b[start:len(b) - end], a[len(a) - end:]


def symbol_mismatch(wanted: str, exported: str, demangled: Mapping[str, str] | None = None):
    """The symbol an extension asks the dynamic linker for (`wanted`) above the nearest one the
    library exports (`exported`), their common part in black and the difference in colour; with
    `demangled` (mangled name -> its c++filt form), the C++ signatures below them, marked alike.
    """
    plt = _plt()
    rows = [("the extension asks for", wanted, "tab:red"),
            ("libc10.so exports", exported, "tab:green")]
    if demangled:
        rows += [("which is", demangled[wanted], "tab:red"),
                 ("which is", demangled[exported], "tab:green")]
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.42 * len(rows)))
    ax.set_axis_off()
    for k, (label, text, color) in enumerate(rows):
        other = rows[k + 1 if k % 2 == 0 else k - 1][1]
        prefix, middle, _, suffix = _difference(text, other)
        y = 1 - (k + 0.5) / len(rows)
        ax.text(0.0, y, label, ha="left", va="center", fontsize=9, color="0.35",
                transform=ax.transAxes)
        # Three pieces, each starting where the previous one ends (in display coordinates).
        piece = ax.text(0.17, y, prefix, ha="left", va="center", fontsize=9,
                        family="monospace", transform=ax.transAxes)
        for part, style in ((middle, {"color": color, "fontweight": "bold"}), (suffix, {})):
            piece = ax.annotate(part, xy=(1, 0.5), xycoords=piece, ha="left", va="center",
                                fontsize=9, family="monospace", **style)
    ax.set_title("undefined symbol: the same function, its std::string argument spelt the other "
                 "way", fontsize=10, loc="left")
    fig.tight_layout()
    return fig
