"""The dispatch keys stage 06 fills in C++ and the stable ABI cannot: Autograd and Autocast.

A stable-ABI library registers kernels through libtorch's C shims, for a backend's dispatch key
(CPU, CUDA). Stage 06 registers two more layers of its ops in C++: autograd on the Autograd key
(csrc/lltm/autograd/, a torch::autograd::Function) and the autocast rule on AutocastCPU and
AutocastCUDA (csrc/lltm/autocast/, with c10's dispatch-key guard; stage 09's
csrc/ms_deform_attn/autocast/ the same for its op). Both are C++ classes of
libtorch, outside the stable ABI, so this library registers the same two layers from Python:

* autograd with torch.library.register_autograd, the formula stage 05 registers for its own ops:
  the backward op's inputs saved in the forward, `gates` not differentiable, and no double
  backward. It costs more per call than stage 06's C++ layer: bench/ measures it (`make bench
  OP=lltm`), and stage 10's README says by how much;
* autocast as a Python kernel on the Autocast keys, for each op's forward: every floating
  input on the region's device cast to the region's dtype (torch.get_autocast_dtype), then the
  op called again below the autocast layer. This is workbook/autocast.h's rule, written with
  torch's Python binding of the same guard. (torch.library.register_autocast casts to one dtype
  fixed when it is registered; the rule here follows the region's.)
"""

from __future__ import annotations

import torch

# ----------------------------------------------------------------------------------------------
# Autograd


def _setup_context(ctx, inputs, output):
    input, weights, _bias, old_h, _old_cell = inputs
    _new_h, new_cell, gates = output
    # The backward rebuilds the gate activations from the pre-activation gates.
    ctx.save_for_backward(new_cell, gates, input, old_h, weights)
    ctx.mark_non_differentiable(gates)  # an intermediate: no gradient flows into it
    ctx.set_materialize_grads(False)  # None, not zeros, for the outputs a loss does not use


def _backward(ctx, grad_h, grad_cell, _grad_gates):
    new_cell = ctx.saved_tensors[0]
    grad_h = torch.zeros_like(new_cell) if grad_h is None else grad_h
    grad_cell = torch.zeros_like(new_cell) if grad_cell is None else grad_cell
    # In the inputs' order: input, weights, bias, old_h, old_cell.
    return torch.ops.extops.lltm_backward(grad_h, grad_cell, *ctx.saved_tensors)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "lltm: double backward is not supported (the lltm backward op has no derivative); for "
        "second derivatives use a plain PyTorch LLTM")


torch.library.register_autograd("extops::lltm_forward", _backward, setup_context=_setup_context)
torch.library.register_autograd("extops::lltm_backward", _no_double_backward)


# ----------------------------------------------------------------------------------------------
# Autocast

_LIBRARY = torch.library.Library("extops", "IMPL")  # kept alive: the registrations live with it


def _autocast_kernel(op, device_type: str, key: torch._C.DispatchKey):
    below = torch._C.DispatchKeySet(key)

    def cast(a):
        return (a.to(torch.get_autocast_dtype(device_type))
                if isinstance(a, torch.Tensor) and a.is_floating_point()
                and a.device.type == device_type else a)

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(below):
            return op(*map(cast, args), **{name: cast(a) for name, a in kwargs.items()})

    return kernel


# The forwards only: the backwards run on saved tensors of one dtype. The rule is the same for
# every op (stage 06's and 09's csrc/<op>/autocast/ files): an LLTM cell is GEMMs, a deformable
# convolution a convolution, and autocast runs both in the region's dtype; multi-scale deformable
# attention takes its value and its locations in one dtype (its index tensors, int64, as they are).
for _op in ("lltm_forward", "deform_conv2d", "ms_deform_attn"):
    for _device_type, _key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
        _LIBRARY.impl(_op,
                      _autocast_kernel(getattr(torch.ops.extops, _op).default, _device_type,
                                       getattr(torch._C.DispatchKey, _key)), _key)
