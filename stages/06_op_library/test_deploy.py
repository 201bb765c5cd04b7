"""The library where models are trained and shipped: every path torchvision's deform_conv2d
works on, extops' works on too (DESIGN.md, principle 10; the README's Deploy section).

* TorchScript (legacy): the functional forms and the modules script, save, load and run forward
  and backward equal to eager; a bad input is refused by name in a scripted call too;
* the errors torchvision's callers catch: every bad input of the descriptors is also caught by
  `except RuntimeError`, with the precise class and the message kept;
* checkpoints: a torchvision.ops.DeformConv2d state dict loads into extops.DeformConv2d as it is;
  an mmcv ModulatedDeformConv2dPack state dict into extops.DCNv2(mask_activation="sigmoid"),
  giving mmcv's formula (written here in plain PyTorch, over the float64 reference);
* ONNX: models with extops' deformable convolutions exported to ONNX DeformConv (opset 19),
  run in ONNX Runtime against eager, with and without mask and bias, groups, offset groups and
  a dynamic batch; the LLTM refused by name;
* guards of what already worked: torch.export (dynamic batch, save and load), AOTInductor (a
  package compiled here, loaded in a fresh process), DistributedDataParallel (two CPU processes
  over gloo, against one process on the whole batch).

The slow ones (AOTInductor compiles C++ for a minute or so, DDP starts two processes) use one
small model each.
"""

import io
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

from workbook import ops, testing
from workbook.build import stages
from workbook.build.loader import import_stage
from workbook.ops.deform_conv2d import reference
from workbook.teaching.notebook import pythonpath_with_common

STAGE = stages.here(__file__)
DEFORM = ops.get("deform_conv2d")
LLTM_SPEC = ops.get("lltm")


def torchvision_ops():
    """torchvision.ops, or a skip of the one test that loads its module's state dict."""
    return pytest.importorskip("torchvision.ops",
                               reason="torchvision is the comparison baseline of this test: "
                                      "pip install torchvision")


def package():
    return import_stage(STAGE)


def script(obj):
    """torch.jit.script without its deprecation warning (torch 2.13 on warns on every call)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        return torch.jit.script(obj)


def save_and_load(scripted):
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    buffer.seek(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        return torch.jit.load(buffer)


def child_env():
    return dict(os.environ, PYTHONPATH=pythonpath_with_common())


def run_child(code: str, *args: str, timeout: int = 600) -> str:
    """Run `code` in a fresh Python process that loads this stage's extops; its stdout."""
    prelude = (f"import sys, torch\nfrom workbook.build.loader import import_stage\n"
               f"extops = import_stage({STAGE.number})\n")
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code), *args],
                          env=child_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"child failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc.stdout


def small_model(extops, *, mask_activation="2sigmoid", offset_groups=1, groups=1, bias=True):
    """conv -> DCNv2 -> ReLU -> pool: the offsets learnt by a block, as in a backbone. The DCNv2's
    offset-and-mask convolution is given random weights so that offsets and mask are far from
    their zero start (non-integer sampling points, some outside the image)."""
    torch.manual_seed(0)
    block = extops.DCNv2(4, 6, 3, padding=1, groups=groups, offset_groups=offset_groups,
                         bias=bias, mask_activation=mask_activation)
    with torch.no_grad():
        block.offset_mask.weight.normal_(0, 0.3)
        block.offset_mask.bias.normal_(0, 0.5)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), block, torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(2)).eval()


# -- TorchScript ----------------------------------------------------------------------------------


def grads_of(fn, tensors):
    out = fn(*tensors)
    outs = out if isinstance(out, tuple) else (out,)
    torch.manual_seed(1)
    weights = [torch.randn_like(o) for o in outs]
    loss = sum((o * w).sum() for o, w in zip(outs, weights))
    return outs, torch.autograd.grad(loss, [t for t in tensors if t.requires_grad])


def test_scripted_function_equals_eager_forward_and_backward():
    extops = package()
    sample = DEFORM.make(DEFORM.case("torchvision_b1"), dtype=torch.float64)
    x, offset, weight, bias = sample.args
    kw = sample.kwargs

    def eager(x_, offset_, weight_, bias_, mask_):
        return extops.deform_conv2d(x_, offset_, weight_, bias_, kw["stride"], kw["padding"],
                                    kw["dilation"], mask_)

    scripted = script(extops.deform_conv2d)
    stride, padding, dilation = (tuple(kw[k]) if isinstance(kw[k], (tuple, list)) else kw[k]
                                 for k in ("stride", "padding", "dilation"))

    def in_script(x_, offset_, weight_, bias_, mask_):
        return scripted(x_, offset_, weight_, bias_, stride, padding, dilation, mask_)

    tensors = (x, offset, weight, bias, kw["mask"])
    want, want_grads = grads_of(eager, tensors)
    got, got_grads = grads_of(in_script, tensors)
    for a, b in zip(want + want_grads, got + got_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # An int for a pair, and no mask (DCNv1).
    x, offset, weight, bias = DEFORM.make(DEFORM.case("b2_c4_o5_k3_pad1"), dtype=torch.float64,
                                          requires_grad=False).args
    torch.testing.assert_close(scripted(x, offset, weight, bias, 1, 1, 1, None),
                               extops.deform_conv2d(x, offset, weight, bias, padding=1),
                               rtol=0, atol=0)


def test_scripted_call_refuses_bad_input_by_name():
    extops = package()
    scripted = script(extops.deform_conv2d)
    sample = DEFORM.make(DEFORM.case("torchvision_b1"), requires_grad=False)
    x, offset, weight, bias = sample.args
    with pytest.raises((RuntimeError, ValueError), match="`offset`"):
        scripted(x, offset[:, :2], weight, bias, [2, 1], [1, 0], [2, 1], None)


@pytest.mark.parametrize("which", ["DeformConv2d", "DCNv2", "DCNv2-sigmoid", "LLTM"])
def test_scripted_module_saved_loaded_equals_eager(which):
    extops = package()
    torch.manual_seed(0)
    if which == "LLTM":
        module = extops.LLTM(5, 7).double()
        inputs = (torch.randn(3, 5, dtype=torch.float64, requires_grad=True),
                  (torch.randn(3, 7, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)))
    elif which == "DeformConv2d":
        module = extops.DeformConv2d(6, 2, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1),
                                     groups=2).double()
        sample = DEFORM.make(DEFORM.case("torchvision_b1"), dtype=torch.float64)
        inputs = (sample.args[0], sample.args[1], sample.kwargs["mask"])
    else:
        activation = "sigmoid" if which.endswith("sigmoid") else "2sigmoid"
        module = small_model(extops, mask_activation=activation)[1].double()
        inputs = (torch.randn(2, 4, 5, 6, dtype=torch.float64, requires_grad=True),)
    loaded = save_and_load(script(module))

    def run(m):
        out = m(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum(o.square().sum() for o in outs)
        leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        return outs + torch.autograd.grad(loss, leaves + list(m.parameters()))

    for a, b in zip(run(module), run(loaded)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fx_symbolic_trace_records_the_op_as_one_node():
    extops = package()
    model = small_model(extops)
    traced = torch.fx.symbolic_trace(model)
    calls = [n.target for n in traced.graph.nodes if n.op == "call_function"]
    assert extops.deform_conv2d in calls
    x = torch.randn(2, 3, 6, 5)
    with torch.no_grad():
        torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)


# -- errors: what `except RuntimeError` catches ----------------------------------------------------


def _bad_params():
    return ([pytest.param("deform_conv2d", *p.values, id=f"deform_conv2d-{p.id}")
             for p in testing.bad_input_params(DEFORM, ["cpu", "meta"])]
            + [pytest.param("lltm", *p.values, id=f"lltm-{p.id}")
               for p in testing.bad_input_params(LLTM_SPEC, ["cpu", "meta"])])


@pytest.mark.parametrize(("op", "device", "bad"), _bad_params())
def test_every_bad_input_is_also_a_runtime_error(op, device, bad):
    fn = getattr(package(), op)
    with pytest.raises(RuntimeError, match=bad.match) as caught:
        bad.make(device).call(fn)
    assert isinstance(caught.value, bad.error), f"{type(caught.value).__name__} is not {bad.error}"


@pytest.mark.parametrize(("make", "kind", "name"), [
    (lambda e: e.DeformConv2d(0, 2, 3), ValueError, "in_channels"),
    (lambda e: e.DeformConv2d(4, 2, 3, stride=(1, 2, 3)), ValueError, "stride"),
    (lambda e: e.DeformConv2d(4, 2, "3"), TypeError, "kernel_size"),
    (lambda e: e.DCNv2(4, 2, 3, groups=3), ValueError, "groups"),
    (lambda e: e.DCNv2(4, 2, 3, mask_activation="relu"), ValueError, "mask_activation"),
    (lambda e: e.DCNv2(4, 2, 3, bias=1), TypeError, "bias"),
    (lambda e: e.LLTM(0, 4), ValueError, "input_features"),
    (lambda e: e.LLTM(4, 4, dtype=torch.int64), TypeError, "dtype"),
    (lambda e: e.LLTM(3, 4)(torch.randn(2, 3), torch.randn(2, 4)), TypeError, "state"),
    (lambda e: e.deform_conv2d(torch.randn(1, 1, 3, 3), torch.zeros(1, 2, 3, 3),
                               torch.randn(1, 1, 1, 1), stride=1.5), TypeError, "stride"),
], ids=["in_channels", "stride-length", "kernel_size-type", "groups", "mask_activation",
        "bias-type", "input_features", "dtype", "state", "stride-float"])
def test_module_and_argument_errors_are_runtime_errors(make, kind, name):
    extops = package()
    with pytest.raises(RuntimeError, match=f"`{name}`") as caught:
        make(extops)
    assert isinstance(caught.value, kind)
    assert isinstance(caught.value, (extops.ExtopsValueError, extops.ExtopsTypeError))


def test_direct_op_calls_keep_the_cpp_types():
    sample = DEFORM.make(DEFORM.case("torchvision_b1"), requires_grad=False)
    x, offset, weight, bias = sample.args
    package()
    # Built on the stable ABI (stage 10), a check can throw only a std::exception, which arrives
    # as RuntimeError with the class it means first in the message (workbook/checks.h).
    kind, prefix = (RuntimeError, r"\[ValueError\] ") if STAGE.stable_abi else (ValueError, "")
    with pytest.raises(kind, match=f"^{prefix}deform_conv2d: `offset`") as caught:
        torch.ops.extops.deform_conv2d(x, offset[:, :2], weight, bias, [2, 1], [1, 0], [2, 1],
                                       None)
    assert type(caught.value) is kind


# -- checkpoints ----------------------------------------------------------------------------------


def test_torchvision_deform_conv2d_state_dict_loads_as_it_is():
    extops = package()
    torch.manual_seed(0)
    theirs = torchvision_ops().DeformConv2d(6, 2, (3, 2), stride=(2, 1), padding=(1, 0),
                                          dilation=(2, 1), groups=2).double()
    ours = extops.DeformConv2d(6, 2, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1),
                               groups=2).double()
    ours.load_state_dict(theirs.state_dict())  # strict: the same keys and shapes
    sample = DEFORM.make(DEFORM.case("torchvision_b1"), dtype=torch.float64, requires_grad=False)
    x, offset, mask = sample.args[0], sample.args[1], sample.kwargs["mask"]
    torch.testing.assert_close(ours(x, offset, mask), theirs(x, offset, mask))
    torch.testing.assert_close(ours(x, offset), theirs(x, offset))


def mmcv_state_dict(in_channels, out_channels, k, deform_groups, seed=0):
    """What mmcv's ModulatedDeformConv2dPack(in, out, k, padding=1, deform_groups=G) saves after
    some training: its keys, their shapes, non-zero offset weights."""
    g = torch.Generator().manual_seed(seed)
    taps = deform_groups * k * k
    f64 = torch.float64
    return {"weight": torch.randn(out_channels, in_channels, k, k, generator=g, dtype=f64),
            "bias": torch.randn(out_channels, generator=g, dtype=f64),
            "conv_offset.weight": 0.3 * torch.randn(3 * taps, in_channels, k, k, generator=g,
                                                    dtype=torch.float64),
            "conv_offset.bias": 0.5 * torch.randn(3 * taps, generator=g, dtype=torch.float64)}


def mmcv_forward(state, x, padding, deform_groups):
    """mmcv's ModulatedDeformConv2dPack.forward in plain PyTorch: conv_offset, chunk in three,
    the first two thirds the offsets ((dy, dx) per tap and group, as torchvision's), the last the
    mask through sigmoid; then the modulated deformable convolution (the float64 reference)."""
    out = F.conv2d(x, state["conv_offset.weight"], state["conv_offset.bias"], padding=padding)
    o1, o2, logits = torch.chunk(out, 3, dim=1)
    offset = torch.cat((o1, o2), dim=1)
    return reference.deform_conv2d(x, offset, state["weight"], state["bias"], padding=padding,
                                   mask=torch.sigmoid(logits))


@pytest.mark.parametrize("deform_groups", [1, 2])
def test_mmcv_modulated_deform_conv2d_pack_state_dict(deform_groups):
    extops = package()
    state = mmcv_state_dict(4, 6, 3, deform_groups)
    block = extops.DCNv2(4, 6, 3, padding=1, offset_groups=deform_groups,
                         mask_activation="sigmoid").double()
    block.load_state_dict(state)
    x = torch.randn(2, 4, 7, 5, dtype=torch.float64)
    torch.testing.assert_close(block(x), mmcv_forward(state, x, 1, deform_groups))
    # Inside a bigger model too (the keys carry the block's prefix).
    model = torch.nn.Sequential(torch.nn.Identity(), block)
    model.load_state_dict({f"1.{k}": v for k, v in state.items()})


def test_mmcv_keys_into_a_2sigmoid_block_are_refused_by_name():
    extops = package()
    block = extops.DCNv2(4, 6, 3, padding=1).double()
    with pytest.raises(RuntimeError, match='mask_activation="sigmoid"'):
        block.load_state_dict(mmcv_state_dict(4, 6, 3, 1))


# -- ONNX -----------------------------------------------------------------------------------------

ONNX_CASES = {  # name: (groups, offset_groups, bias, mask)
    "mask_bias": (1, 1, True, True),
    "no_bias_groups2": (2, 1, False, True),
    "offset_groups2_no_mask": (1, 2, True, False),
    "groups2_offset_groups2": (2, 2, True, True),
}


class DeformModel(torch.nn.Module):
    """Offsets (and mask) from a conv, then extops.DeformConv2d: every argument combination of
    the op (mask or not, bias or not) in one exportable model."""

    def __init__(self, extops, groups, offset_groups, bias, mask):
        super().__init__()
        torch.manual_seed(0)
        taps = offset_groups * 9
        self.use_mask = mask
        self.predict = torch.nn.Conv2d(4, 3 * taps if mask else 2 * taps, 3, padding=1)
        with torch.no_grad():
            self.predict.weight.normal_(0, 0.3)
        self.deform = extops.DeformConv2d(4, 6, 3, padding=1, groups=groups, bias=bias)
        self.taps = taps

    def forward(self, x):
        out = self.predict(x)
        if self.use_mask:
            return self.deform(x, out[:, : 2 * self.taps], torch.sigmoid(out[:, 2 * self.taps:]))
        return self.deform(x, out)


def onnx_session(path):
    import onnxruntime

    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("case", list(ONNX_CASES))
def test_onnx_export_runs_in_onnxruntime_like_eager(case, tmp_path):
    extops = package()
    model = DeformModel(extops, *ONNX_CASES[case]).eval()
    path = tmp_path / "model.onnx"
    extops.onnx.export(model, (torch.randn(2, 4, 9, 7),), path, input_names=["x"])
    import onnx

    graph = onnx.load(str(path)).graph
    assert [n.op_type for n in graph.node].count("DeformConv") == 1
    session = onnx_session(path)
    for batch in (1, 3):  # exported at batch 2: the batch is dynamic
        x = torch.randn(batch, 4, 9, 7)
        with torch.no_grad():
            want = model(x)
        (got,) = session.run(None, {"x": x.numpy()})
        error = (torch.from_numpy(got) - want).abs().max().item()
        assert error <= 2e-5 * max(1.0, want.abs().max().item()), f"max abs error {error:.2e}"


def test_onnx_translation_table_with_torch_onnx_export(tmp_path):
    extops = package()
    model = small_model(extops)
    x = torch.randn(2, 3, 8, 8)
    path = tmp_path / "dcnv2.onnx"
    program = torch.onnx.export(model, (x,), dynamo=True, opset_version=19,
                                custom_translation_table=extops.onnx.translation_table())
    program.save(str(path))
    session = onnx_session(path)
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), model(x), rtol=1e-4, atol=1e-5)


def test_onnx_lltm_refused_by_name(tmp_path):
    extops = package()
    cell = extops.LLTM(3, 4)

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = cell

        def forward(self, x, h, c):
            return self.cell(x, (h, c))[0]

    args = (torch.randn(2, 3), torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(NotImplementedError, match=r"^extops.onnx: extops.lltm_forward .* has no "
                                                  r"ONNX translation"):
        extops.onnx.export(Step().eval(), args, tmp_path / "lltm.onnx")


def test_onnx_export_refuses_an_old_opset(tmp_path):
    extops = package()
    with pytest.raises(RuntimeError, match="`opset_version`"):
        extops.onnx.export(small_model(extops), (torch.randn(1, 3, 4, 4),),
                           tmp_path / "m.onnx", opset_version=18)


# -- torch.export, AOTInductor, DDP: guards of paths that work ---------------------------------


def test_torch_export_dynamic_batch_save_and_load(tmp_path):
    extops = package()
    model = small_model(extops)
    batch = torch.export.Dim("batch")
    exported = torch.export.export(model, (torch.randn(2, 3, 8, 8),),
                                   dynamic_shapes=({0: batch},))
    path = tmp_path / "model.pt2"
    torch.export.save(exported, str(path))
    loaded = torch.export.load(str(path)).module()
    for n in (1, 3):
        x = torch.randn(n, 3, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_aotinductor_package_loads_in_a_fresh_process(tmp_path):
    extops = package()
    model = small_model(extops)
    x = torch.randn(2, 3, 8, 8)
    exported = torch.export.export(model, (x,))
    path = torch._inductor.aoti_compile_and_package(exported,
                                                    package_path=str(tmp_path / "model.pt2"))
    torch.save(x, tmp_path / "x.pt")
    with torch.no_grad():
        torch.save(model(x), tmp_path / "eager.pt")
    out = run_child("""
        folder = sys.argv[1]
        runner = torch._inductor.aoti_load_package(folder + "/model.pt2")
        x, eager = torch.load(folder + "/x.pt"), torch.load(folder + "/eager.pt")
        got = runner(x)
        got = got[0] if isinstance(got, (list, tuple)) else got
        print("max abs error", (got - eager).abs().max().item())
    """, str(tmp_path))
    assert path.endswith("model.pt2")
    error = float(out.strip().rsplit(" ", 1)[-1])
    assert error <= 1e-6, out


DDP_CHILD = """
import json, os
import torch.distributed as dist
import torch.multiprocessing as mp


def model_and_batch():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1),
                                extops.DCNv2(4, 4, 3, padding=1, offset_groups=2))
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    return model, x


def loss_of(model, x):
    return model(x).square().mean()


def rank_main(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model, x = model_and_batch()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    loss_of(ddp, x.chunk(world)[rank]).backward()
    grads = [p.grad.tolist() for p in model.parameters()]
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(grads, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket
    out = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(rank_main, args=(2, port, out), nprocs=2, start_method="fork")
    torch.set_num_threads(1)
    model, x = model_and_batch()
    loss_of(model, x).backward()
    with open(f"{out}/single.json", "w") as f:
        json.dump([p.grad.tolist() for p in model.parameters()], f)
"""


def test_ddp_two_cpu_processes_gloo_equal_one_process(tmp_path):
    run_child(DDP_CHILD.replace('if __name__ == "__main__":', "if True:"), str(tmp_path))
    grads = {name: [torch.tensor(g, dtype=torch.float32) for g in
                    json.loads((tmp_path / f"{name}.json").read_text())]
             for name in ("rank0", "rank1", "single")}
    for a, b, whole in zip(grads["rank0"], grads["rank1"], grads["single"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # DDP all-reduces: ranks bitwise equal
        torch.testing.assert_close(a, whole, rtol=1e-5, atol=1e-6)
