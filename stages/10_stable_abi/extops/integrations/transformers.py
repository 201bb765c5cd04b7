"""HF transformers' DETR-family models on extops' multi-scale deformable attention, in one call.

    from extops.integrations.transformers import use_extops

    model = DeformableDetrModel(config)     # or from_pretrained; RT-DETR, Grounding DINO, ...
    use_extops(model)                        # every MultiScaleDeformableAttention now runs extops

transformers (5.x) computes multi-scale deformable attention with one grid_sample per level on
every device, in a module of its own, MultiScaleDeformableAttention, which each model's attention
layer holds as `attn`. That module has no parameters, and one forward across the DETR family:

    (value, value_spatial_shapes, value_spatial_shapes_list, level_start_index,
     sampling_locations, attention_weights, im2col_step) -> [N, Lq, M D]

Two routes put extops' kernels there; the model's parameters and state dict stay as they were:

* use_extops(model): replaces each such submodule by MultiScaleDeformableAttention below. Any
  device extops has kernels for: the CPU, and CUDA. Needs nothing but extops.
* transformers' `kernels` package: kernel_mapping() maps transformers' layer name to the layer
  below for "cpu" and "cuda", for kernels.use_kernel_mapping and kernels.kernelize, which swap
  the forward of each instance. transformers' own mapping names CUDA only, and its
  KernelConfig refuses the CPU; kernels' mapping does not. On CUDA, kernels picks a layer by
  the device's compute capability, so that route needs a GPU visible to torch.
"""

from __future__ import annotations

from torch import Tensor, nn

from ..ms_deform_attn import ms_deform_attn

LAYER_NAME = "MultiScaleDeformableAttention"  # transformers' class, and its kernels layer name


class MultiScaleDeformableAttention(nn.Module):
    """transformers' MultiScaleDeformableAttention (same forward) on extops.ms_deform_attn.

    Stateless, with no constructor and no member but forward: what kernels demands of a layer
    that replaces another's forward. value_spatial_shapes_list (the shapes as Python ints,
    which transformers' grid_sample path splits value by) is not needed: the op reads the
    tensor table."""

    can_torch_compile = True  # kernels asks: the op traces whole under torch.compile(fullgraph)

    def forward(self, value: Tensor, value_spatial_shapes: Tensor,
                value_spatial_shapes_list: list[tuple[int, int]], level_start_index: Tensor,
                sampling_locations: Tensor, attention_weights: Tensor,
                im2col_step: int) -> Tensor:
        return ms_deform_attn(value, value_spatial_shapes, level_start_index,
                              sampling_locations, attention_weights, im2col_step)


def use_extops(model: nn.Module) -> int:
    """Replace every transformers MultiScaleDeformableAttention in `model` by extops' and return
    how many were replaced. A model without one raises ValueError (nothing to replace is
    likely a mistake: another model, or a transformers that computes it elsewhere)."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child).__name__ == LAYER_NAME
                    and type(child).__module__.startswith("transformers.")):
                setattr(parent, name, MultiScaleDeformableAttention())
                swapped += 1
    if not swapped:
        raise ValueError(f"use_extops: {type(model).__name__} holds no transformers "
                         f"{LAYER_NAME} module to replace")
    return swapped


class _LayerRepository:
    """The repository `kernels` maps a layer name to: load() gives the layer class. Here the
    class ships in extops, so there is nothing to download or build."""

    layer_name = LAYER_NAME

    def load(self) -> type[nn.Module]:
        return MultiScaleDeformableAttention

    def __str__(self) -> str:
        return f"extops.integrations.transformers (layer `{LAYER_NAME}`)"


def kernel_mapping() -> dict:
    """{layer name: {device: repository}} for kernels.use_kernel_mapping, CPU and CUDA:

        with kernels.use_kernel_mapping(kernel_mapping()):
            model = kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu")
    """
    repository = _LayerRepository()
    return {LAYER_NAME: {"cpu": repository, "cuda": repository}}


__all__ = ["MultiScaleDeformableAttention", "kernel_mapping", "use_extops"]
