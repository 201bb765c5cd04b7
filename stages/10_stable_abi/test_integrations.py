"""Stage 10: multi-scale deformable attention where other projects call it (extops/integrations/).

* HF transformers: a tiny DeformableDetrModel built from a config (random weights, nothing
  downloaded), its MultiScaleDeformableAttention modules put on extops both ways (use_extops, and
  transformers' `kernels` package with kernel_mapping()), against the model's own grid_sample
  path: every output and every parameter's gradient, float32 and float64; bf16 autocast; and the
  model's attention layer's state dict loaded into extops.MSDeformAttn.
* Deformable DETR and mmcv: their function calls, positional and by keyword, int32 level tables,
  their PyTorch versions' call, and mmcv's layer (its arguments, sequence-first forward, the
  residual, value_proj_ratio, its state-dict keys).

transformers is pinned in requirements.txt; its models are built on the CPU, where extops' CPU
kernels run (the emulated CUDA device is not a device transformers' code can be given).
"""

import copy
import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from workbook import testing
from workbook.build import stages
from workbook.build.loader import import_stage
from workbook.ops import ms_deform_attn as msda_op
from workbook.ops.ms_deform_attn import reference

STAGE = stages.here(__file__)


def integration(name):
    """extops.integrations.<name> of this stage's build."""
    package = import_stage(STAGE)
    return importlib.import_module(f"{package.__name__}.integrations.{name}")


class OpsCalled(TorchDispatchMode):
    """Counts the ops dispatched inside it, by name (e.g. "extops.ms_deform_attn.default")."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def sample(dtype=torch.float64, requires_grad=True):
    return msda_op.make(msda_op.case("s", 2, 5, 2, 6, 3, [(4, 5), (2, 3), (1, 2)]), dtype=dtype,
                        requires_grad=requires_grad)


def outputs_and_grads(fn, args):
    out = fn(*args)
    wanted = [t for t in args if t.requires_grad]
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    return [out.detach(), *torch.autograd.grad(out, wanted, weights)]


def assert_all_equal(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


# -- Deformable DETR and mmcv: the function calls -----------------------------------------------


@pytest.mark.parametrize("project", ["deformable_detr", "mmcv"])
def test_function_apply_positional_and_keyword(project):
    module = integration(project)
    function = {"deformable_detr": "MSDeformAttnFunction",
                "mmcv": "MultiScaleDeformableAttnFunction"}[project]
    apply = getattr(module, function).apply
    value, shapes, starts, locations, weights = sample().args
    expected = outputs_and_grads(import_stage(STAGE).ms_deform_attn,
                                 (value, shapes, starts, locations, weights))
    assert_all_equal(outputs_and_grads(
        lambda *a: apply(*a, 64), (value, shapes, starts, locations, weights)), expected)

    def by_keyword(value, shapes, starts, locations, weights):
        return apply(value=value, value_spatial_shapes=shapes, value_level_start_index=starts,
                     sampling_locations=locations, attention_weights=weights, im2col_step=2)

    assert_all_equal(outputs_and_grads(by_keyword, (value, shapes, starts, locations, weights)),
                     expected)
    # int32 level tables, as some of mmcv's are
    assert_all_equal(outputs_and_grads(
        lambda v, loc, w: apply(v, shapes.int(), starts.int(), loc, w, 64), (value, locations,
                                                                          weights)), expected)


@pytest.mark.parametrize(("project", "name"), [
    ("deformable_detr", "ms_deform_attn_core_pytorch"),
    ("mmcv", "multi_scale_deformable_attn_pytorch")])
def test_pytorch_versions_call_without_a_start_index(project, name):
    fn = getattr(integration(project), name)
    value, shapes, starts, locations, weights = sample().args
    expected = outputs_and_grads(import_stage(STAGE).ms_deform_attn,
                                 (value, shapes, starts, locations, weights))
    for table in (shapes, shapes.int()):
        assert_all_equal(outputs_and_grads(lambda v, loc, w: fn(v, table, loc, w),
                                           (value, locations, weights)), expected)


def test_deformable_detrs_module_is_extops():
    module = integration("deformable_detr")
    attn = module.MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=2)
    assert isinstance(attn, import_stage(STAGE).MSDeformAttn) and attn.im2col_step == 64
    attn._reset_parameters()


# -- mmcv's layer ------------------------------------------------------------------------------


def mmcv_keys(embed_dims, num_heads, num_levels, num_points, value_dims):
    """An mmcv MultiScaleDeformableAttention's state-dict keys and shapes (mmcv 2.x)."""
    samples = num_heads * num_levels * num_points
    return {"sampling_offsets.weight": (samples * 2, embed_dims),
            "sampling_offsets.bias": (samples * 2,),
            "attention_weights.weight": (samples, embed_dims),
            "attention_weights.bias": (samples,),
            "value_proj.weight": (value_dims, embed_dims), "value_proj.bias": (value_dims,),
            "output_proj.weight": (embed_dims, value_dims), "output_proj.bias": (embed_dims,)}


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_mmcv_layer_state_dict_is_mmcvs(ratio):
    layer = integration("mmcv").MultiScaleDeformableAttention(embed_dims=256, num_heads=8,
                                                               value_proj_ratio=ratio)
    state = layer.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == mmcv_keys(256, 8, 4, 4,
                                                                      int(256 * ratio))
    checkpoint = {k: torch.randn(v.shape) for k, v in state.items()}  # as mmcv would save
    layer.load_state_dict(checkpoint, strict=True)
    assert torch.equal(layer.value_proj.weight, checkpoint["value_proj.weight"])


def mmcv_inputs(batch_first):
    gen = torch.Generator().manual_seed(5)
    shapes, starts = msda_op.level_table([(5, 4), (3, 2)])
    query = torch.randn(2, 7, 16, generator=gen, dtype=torch.float64)
    value = torch.randn(2, 26, 16, generator=gen, dtype=torch.float64)
    query_pos = torch.randn(2, 7, 16, generator=gen, dtype=torch.float64)
    reference_points = torch.rand(2, 7, 2, 2, generator=gen, dtype=torch.float64)
    mask = torch.zeros(2, 26, dtype=torch.bool)
    mask[1, 20:] = True
    if not batch_first:
        query, value, query_pos = (t.transpose(0, 1) for t in (query, value, query_pos))
    return {"query": query, "value": value, "query_pos": query_pos, "key_padding_mask": mask,
            "reference_points": reference_points, "spatial_shapes": shapes,
            "level_start_index": starts}


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_mmcv_layer_is_attention_plus_the_residual_either_layout(ratio):
    mmcv = integration("mmcv")
    torch.manual_seed(0)
    seq_first = mmcv.MultiScaleDeformableAttention(embed_dims=16, num_heads=2, num_levels=2,
                                                   num_points=3, value_proj_ratio=ratio).double()
    with torch.no_grad():  # off the paper's start, so the offsets and weights matter
        for p in seq_first.parameters():
            p.add_(0.1 * torch.randn_like(p))
    seq_first.eval()  # dropout off
    batch_first = copy.deepcopy(seq_first)
    batch_first.batch_first = True
    a = mmcv_inputs(batch_first=False)
    b = mmcv_inputs(batch_first=True)
    out_a, out_b = seq_first(**a), batch_first(**b)
    torch.testing.assert_close(out_a.transpose(0, 1), out_b, rtol=0, atol=0)
    # What mmcv's forward computes, written out on the float64 reference op: the query with its
    # position, value projected and masked, the attention, the output projection, the residual.
    layer, x = batch_first, b
    n, lq, s = 2, 7, 26
    query = x["query"] + x["query_pos"]
    value = layer.value_proj(x["value"]).masked_fill(x["key_padding_mask"][..., None], 0.0)
    value = value.view(n, s, 2, -1)
    offsets = layer.sampling_offsets(query).view(n, lq, 2, 2, 3, 2)
    weights = layer.attention_weights(query).view(n, lq, 2, 6).softmax(-1).view(n, lq, 2, 2, 3)
    wh = x["spatial_shapes"].flip(-1).double()
    locations = x["reference_points"][:, :, None, :, None, :] + offsets / wh[None, None, None,
                                                                              :, None, :]
    attended = reference.ms_deform_attn(value, x["spatial_shapes"], x["level_start_index"],
                                        locations, weights)
    expected = layer.output_proj(attended) + x["query"]  # identity: the query without its position
    torch.testing.assert_close(out_b, expected)


def test_mmcv_layer_arguments_are_checked():
    mmcv = integration("mmcv")
    with pytest.raises(ValueError, match=r"`init_cfg` .* pass None"):
        mmcv.MultiScaleDeformableAttention(init_cfg={"type": "Xavier"})
    with pytest.raises(ValueError, match=r"`embed_dims` \* `value_proj_ratio` \(16 \* 0.3 = 4\), "
                                         r"must be a positive multiple of `num_heads` \(8\)"):
        mmcv.MultiScaleDeformableAttention(embed_dims=16, num_heads=8, value_proj_ratio=0.3)
    layer = mmcv.MultiScaleDeformableAttention(embed_dims=16, num_heads=2, num_levels=2)
    with pytest.raises(ValueError, match=r"`reference_points` is required"):
        layer(torch.randn(3, 1, 16))


# -- HF transformers ----------------------------------------------------------------------------


def tiny_deformable_detr(dtype):
    """A DeformableDetrModel of random weights: a 4-stage ResNet of 8 to 16 channels, d_model 32,
    2 encoder and 2 decoder layers of 4 heads, 3 feature levels of 2 points; no dropout."""
    import transformers  # pinned in requirements.txt (and in make abi-check's second venv)
    backbone = transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 8, 16, 16], depths=[1, 1, 1, 1],
        hidden_act="relu", out_features=["stage2", "stage3", "stage4"])
    config = transformers.DeformableDetrConfig(
        backbone_config=backbone, use_timm_backbone=False, use_pretrained_backbone=False,
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=12,
        num_feature_levels=3, encoder_n_points=2, decoder_n_points=2, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.DeformableDetrModel(config)
    # Off the paper's start, where offsets are whole pixels: a point exactly on a pixel line has
    # a location gradient of one side or the other (the bilinear weights switch pairs there), and
    # grid_sample and the kernels may pick different sides. A trained model's points are not.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "sampling_offsets" in name:
                p.add_(0.05 * torch.randn_like(p))
    return model.to(dtype).eval()


def detr_inputs(dtype):
    gen = torch.Generator().manual_seed(2)
    pixels = torch.randn(2, 3, 64, 48, generator=gen).to(dtype)
    mask = torch.ones(2, 64, 48, dtype=torch.long)
    mask[1, :, 40:] = 0  # the second image padded on the right
    return {"pixel_values": pixels, "pixel_mask": mask}


def on_extops(model, route):
    model = copy.deepcopy(model)
    layers = integration("transformers")
    if route == "use_extops":
        assert layers.use_extops(model) == 4  # 2 encoder layers, 2 decoder layers
        return model
    import kernels  # pinned in requirements.txt: the pinned transformers requires it
    with kernels.use_kernel_mapping(layers.kernel_mapping()):
        return kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu")


def run_model(model, inputs):
    """The model's two outputs (decoder and encoder), and every parameter's gradient of a fixed
    random weighting of them."""
    out = model(**inputs)
    outputs = [out.last_hidden_state, out.encoder_last_hidden_state]
    gen = torch.Generator().manual_seed(3)
    loss = sum((o * torch.randn(o.shape, generator=gen).to(o.dtype)).sum() for o in outputs)
    params = [p for p in model.parameters() if p.requires_grad]
    return [o.detach() for o in outputs], torch.autograd.grad(loss, params)


@pytest.mark.parametrize("route", ["use_extops", "kernelize"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_transformers_model_matches_its_own_path(dtype, route):
    model = tiny_deformable_detr(dtype)
    inputs = detr_inputs(dtype)
    ours = on_extops(model, route)
    with OpsCalled() as called:
        outputs, grads = run_model(ours, inputs)
    assert called.counts.get("extops.ms_deform_attn.default") == 4
    assert called.counts.get("extops.ms_deform_attn_backward.default") == 4
    assert "aten.grid_sampler_2d.default" not in called.counts
    expected_outputs, expected_grads = run_model(model, inputs)
    # To the dtype's rounding: each output relative to its largest value; the gradients relative
    # to the largest of them all, since they share one loss (a bias before a GroupNorm has a
    # gradient of zero, computed as the rounding of terms that large).
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}[dtype]
    largest_grad = max(g.abs().max() for g in expected_grads)
    for name, got, expected, scale in [
            *((n, a, b, b.abs().max()) for n, a, b in zip(
                ("last_hidden_state", "encoder_last_hidden_state"), outputs, expected_outputs)),
            *((n, a, b, largest_grad) for (n, _), a, b in zip(
                ((n, p) for n, p in model.named_parameters() if p.requires_grad), grads,
                expected_grads))]:
        error = (got - expected).abs().max() / scale
        assert error <= tol, f"{name}: largest error {error:.3g} of the largest value"


def test_transformers_model_under_bf16_autocast():
    model = tiny_deformable_detr(torch.float32)
    inputs = detr_inputs(torch.float32)
    ours = on_extops(model, "use_extops")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with OpsCalled() as called:
            outputs, grads = run_model(ours, inputs)
        expected, _ = run_model(model, inputs)
    assert called.counts.get("extops.ms_deform_attn.default") == 4
    for got, want in zip(outputs, expected):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want.float(), rtol=0.1, atol=0.1)
    assert all(torch.isfinite(g).all() for g in grads)


def test_transformers_attention_layer_state_dict_loads_into_msdeformattn():
    """transformers' DeformableDetrMultiscaleDeformableAttention keeps Deformable DETR's parameter
    names: its state dict loads into extops.MSDeformAttn, which then gives its outputs (its
    padding mask is True for real pixels, Deformable DETR's for padding)."""
    model = tiny_deformable_detr(torch.float64)
    hf_layer = model.encoder.layers[0].self_attn
    attn = import_stage(STAGE).MSDeformAttn(d_model=32, n_levels=3, n_heads=4, n_points=2)
    attn.load_state_dict(hf_layer.state_dict(), strict=True)
    attn.double()
    gen = torch.Generator().manual_seed(4)
    shapes, starts = msda_op.level_table([(8, 6), (4, 3), (2, 2)])
    hidden = torch.randn(2, 64, 32, generator=gen, dtype=torch.float64)
    reference_points = torch.rand(2, 64, 3, 2, generator=gen, dtype=torch.float64)
    real = torch.ones(2, 64, dtype=torch.bool)
    real[1, 40:48] = False
    expected, _ = hf_layer(hidden, attention_mask=real, encoder_hidden_states=hidden,
                           reference_points=reference_points, spatial_shapes=shapes,
                           spatial_shapes_list=[(8, 6), (4, 3), (2, 2)], level_start_index=starts)
    got = attn(hidden, reference_points, hidden, shapes, starts, ~real)
    torch.testing.assert_close(got, expected)


def test_the_readme_call_runs_from_the_package_alone(tmp_path):
    """What a user installs: extops (built or from its wheel), transformers, no workbook."""
    out = testing.assert_imports_alone(
        STAGE, "import torch, transformers\n"
               "from extops.integrations.transformers import use_extops\n"
               "backbone = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 8, 16, 16],"
               " depths=[1, 1, 1, 1], out_features=['stage2', 'stage3', 'stage4'])\n"
               "config = transformers.DeformableDetrConfig(backbone_config=backbone, "
               "use_timm_backbone=False, use_pretrained_backbone=False, d_model=32, "
               "encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, "
               "decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, "
               "num_queries=5, num_feature_levels=3)\n"
               "model = transformers.DeformableDetrModel(config)\n"
               "print(use_extops(model))\n"
               "out = model(pixel_values=torch.randn(1, 3, 64, 64))\n"
               "out.last_hidden_state.sum().backward()\n"
               "print(tuple(out.last_hidden_state.shape))", tmp_path)
    assert out.split("\n")[-3:-1] == ["2", "(1, 5, 32)"]
