"""Stage 10: multi-scale deformable attention where models are shipped, on this library.

Each path a model holding extops.MSDeformAttn is deployed by, as stage 06's test_deploy.py checks
them for the deformable convolution: torch.compile(fullgraph=True), forward and backward; ONNX
(extops.onnx: one GridSample per level, standard ops only) run in ONNX Runtime at two batch sizes
with a dynamic batch, and with the level tables as the graph's inputs; torch.export with a
dynamic batch, saved and loaded; an AOTInductor package loaded in a fresh process.
"""

import pytest
import torch

from workbook import testing
from workbook.build import stages
from workbook.build.loader import import_stage
from workbook.ops import ms_deform_attn as msda_op

STAGE = stages.here(__file__)
LEVELS = [(6, 5), (3, 3), (2, 1)]  # 41 rows


class Encoder(torch.nn.Module):
    """extops.MSDeformAttn over fixed levels (the level tables as buffers), off the paper's
    start so that every parameter matters: (query, reference_points, input_flatten) -> out."""

    def __init__(self, extops):
        super().__init__()
        torch.manual_seed(0)
        self.attn = extops.MSDeformAttn(d_model=32, n_levels=3, n_heads=4, n_points=2)
        with torch.no_grad():
            for p in self.attn.parameters():
                p.add_(0.1 * torch.randn_like(p))
        shapes, starts = msda_op.level_table(LEVELS)
        self.register_buffer("shapes", shapes)
        self.register_buffer("starts", starts)

    def forward(self, query, reference_points, input_flatten):
        return self.attn(query, reference_points, input_flatten, self.shapes, self.starts)


def inputs(batch, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 7, 32, generator=gen),
            torch.rand(batch, 7, 3, 2, generator=gen) * 1.2 - 0.1,  # some points outside
            torch.randn(batch, 41, 32, generator=gen))


def model():
    return Encoder(import_stage(STAGE)).eval()


def test_compile_fullgraph_forward_and_backward_match_eager():
    """The whole module, projections and op, forward and backward, as one graph (fullgraph); on
    aot_eager, the graphs run as traced: Inductor's code generation around the op is what the
    AOTInductor test below and stage 09's compile tests (run on this library) check."""
    encoder = model()
    args = [t.requires_grad_() for t in inputs(2)]
    compiled = torch.compile(encoder, fullgraph=True, backend="aot_eager")
    eager_out = encoder(*args)
    eager_grads = torch.autograd.grad(eager_out.sum(), [*args, *encoder.parameters()])
    out = compiled(*args)
    grads = torch.autograd.grad(out.sum(), [*args, *encoder.parameters()])
    torch.testing.assert_close(out, eager_out)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e)


def onnx_session(path):
    import onnxruntime

    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_onnx_export_is_standard_ops_and_runs_in_onnxruntime_like_eager(tmp_path):
    import onnx

    extops = import_stage(STAGE)
    encoder = model()
    path = tmp_path / "encoder.onnx"
    extops.onnx.export(encoder, inputs(2), path, input_names=["query", "reference", "flat"])
    kinds = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert kinds.count("GridSample") == len(LEVELS)
    assert all(n.domain in ("", "ai.onnx") for n in onnx.load(str(path)).graph.node)
    session = onnx_session(path)
    for batch in (1, 3):  # exported at batch 2: the batch is dynamic
        args = inputs(batch, seed=batch)
        with torch.no_grad():
            want = encoder(*args)
        (got,) = session.run(None, dict(zip(("query", "reference", "flat"),
                                            (t.numpy() for t in args))))
        error = (torch.from_numpy(got) - want).abs().max().item()
        assert error <= 2e-5 * max(1.0, want.abs().max().item()), f"max abs error {error:.2e}"


def test_onnx_level_tables_as_inputs_are_read_when_the_model_runs(tmp_path):
    """The tables as the graph's inputs and the rows dynamic: a model exported at one set of
    level sizes runs at another."""
    extops = import_stage(STAGE)
    attn = model().attn

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = attn

        def forward(self, query, reference_points, flat, shapes, starts):
            return self.attn(query, reference_points, flat, shapes, starts)

    module = Attention().eval()
    shapes, starts = msda_op.level_table(LEVELS)
    batch, rows = torch.export.Dim("batch"), torch.export.Dim("rows")
    names = ["query", "reference", "flat", "shapes", "starts"]
    program = torch.onnx.export(
        module, (*inputs(2), shapes, starts), dynamo=True, opset_version=extops.onnx.OPSET,
        custom_translation_table=extops.onnx.translation_table(), input_names=names,
        dynamic_shapes=({0: batch}, {0: batch}, {0: batch, 1: rows}, None, None))
    path = tmp_path / "attention.onnx"
    program.save(str(path))
    other_shapes, other_starts = msda_op.level_table([(4, 7), (2, 3), (1, 2)])  # 36 rows
    query, reference, _ = inputs(3, seed=5)
    flat = torch.randn(3, 36, 32)
    with torch.no_grad():
        want = module(query, reference, flat, other_shapes, other_starts)
    (got,) = onnx_session(path).run(None, dict(zip(names, (
        t.numpy() for t in (query, reference, flat, other_shapes, other_starts)))))
    error = (torch.from_numpy(got) - want).abs().max().item()
    assert error <= 2e-5 * max(1.0, want.abs().max().item()), f"max abs error {error:.2e}"


def test_torch_export_dynamic_batch_save_and_load(tmp_path):
    encoder = model()
    batch = torch.export.Dim("batch")
    exported = torch.export.export(encoder, inputs(2),
                                   dynamic_shapes=({0: batch}, {0: batch}, {0: batch}))
    path = tmp_path / "encoder.pt2"
    torch.export.save(exported, str(path))
    loaded = torch.export.load(str(path)).module()
    for n in (1, 3):
        args = inputs(n, seed=n)
        with torch.no_grad():
            torch.testing.assert_close(loaded(*args), encoder(*args), rtol=0, atol=0)


def test_aotinductor_package_loads_in_a_fresh_process(tmp_path):
    encoder = model()
    args = inputs(2)
    exported = torch.export.export(encoder, args)
    torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "m.pt2"))
    torch.save(args, tmp_path / "args.pt")
    with torch.no_grad():
        torch.save(encoder(*args), tmp_path / "eager.pt")
    # A fresh interpreter with the package and torch only: extops registers the op the compiled
    # model calls through the dispatcher.
    out = testing.assert_imports_alone(
        STAGE, "import torch, extops\n"
               "runner = torch._inductor.aoti_load_package('m.pt2')\n"
               "args, eager = torch.load('args.pt'), torch.load('eager.pt')\n"
               "got = runner(*args)\n"
               "got = got[0] if isinstance(got, (list, tuple)) else got\n"
               "print((got - eager).abs().max().item())", tmp_path)
    error = float(out.strip().splitlines()[-1])
    assert error <= 1e-5, out


@pytest.mark.parametrize("batch", [2])
def test_torch_jit_script_of_the_functional_form(batch):
    """TorchScript callers: the functional form scripts, int32 tables included."""
    extops = import_stage(STAGE)
    scripted = torch.jit.script(extops.ms_deform_attn)
    sample = msda_op.make(msda_op.case("s", batch, 5, 2, 6, 2, LEVELS), requires_grad=False)
    value, shapes, starts, locations, weights = sample.args
    want = extops.ms_deform_attn(*sample.args)
    torch.testing.assert_close(scripted(value, shapes, starts, locations, weights), want,
                               rtol=0, atol=0)
    torch.testing.assert_close(scripted(value, shapes.int(), starts.int(), locations, weights),
                               want, rtol=0, atol=0)
