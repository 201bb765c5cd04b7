"""The Python half of the lltm ops: fake kernels, autograd, and the functional form.

The C++ library (lltm._C) defines torch.ops.lltm.lltm_forward and .lltm_backward and their CPU
and CUDA kernels. What torch needs besides, registered here with torch.library:

* a fake kernel per op: output shapes, dtypes and devices from the inputs' alone, which is how
  torch.compile traces the ops and how they run on meta tensors. It checks what the C++ checks,
  so a bad input fails at trace time, not only when the kernel runs;
* the autograd formula of forward: save what backward needs, call the backward op. The backward
  op itself has no derivative: taking a gradient through it raises a clear error.
"""

from __future__ import annotations

import torch

# The library the ops live in: csrc/lltm.cpp names it by OPS_NAMESPACE, which setup.py sets to
# this package's name (`lltm`; stage 08 builds these files as `lltm_coop`).
LIBRARY = __package__

_FORWARD_NAMES = ("input", "weights", "bias", "old_h", "old_cell")
_BACKWARD_NAMES = ("grad_h", "grad_cell", "new_cell", "gates", "input", "old_h", "weights")

# The dtypes the kernels compute in (float8 is floating point too, and refused).
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


# Messages in the words of the C++ checks (workbook/checks.h): dtypes, layouts and devices as
# str() prints them in Python ("torch.int64", "torch.sparse_coo", "cuda:0"), so that a bad input
# gets the same message from the fake kernel as from the kernels.
def _check_same_dtype_and_device(op: str, names, tensors) -> None:
    for name, t in zip(names, tensors):
        torch._check_type(t.layout == torch.strided,
                          lambda: f"{op}: `{name}` must be a dense tensor (layout torch.strided), "
                                  f"got layout {t.layout}")
    first_name, first = names[0], tensors[0]
    torch._check_type(first.dtype in _DTYPES,
                      lambda: f"{op}: `{first_name}` must be a float64, float32, float16 or "
                              f"bfloat16 tensor, got {first.dtype}")
    for name, t in zip(names, tensors):
        torch._check_type(t.dtype == first.dtype,
                          lambda: f"{op}: `{name}` must have dtype {first.dtype} (the dtype of "
                                  f"`{first_name}`), got {t.dtype}")
    for name, t in zip(names, tensors):
        torch._check(t.device == first.device,
                     lambda: f"{op}: `{name}` must be on the same device as `{first_name}` "
                             f"({first.device}), got {t.device}")


def _check_dim(op: str, name: str, t, ndim: int, what: str) -> None:
    torch._check_value(t.dim() == ndim,
                       lambda: f"{op}: `{name}` must have {ndim} dimension{'s' * (ndim != 1)} "
                               f"{what}, got {t.dim()} with sizes {list(t.shape)}")


def _check_size(op: str, name: str, t, dim: int, expected, why: str) -> None:
    torch._check_value(t.shape[dim] == expected,
                       lambda: f"{op}: `{name}` must have size {expected} in dimension {dim} "
                               f"({why}), got sizes {list(t.shape)}")


@torch.library.register_fake(f"{LIBRARY}::lltm_forward")
def _forward_fake(input, weights, bias, old_h, old_cell):
    # EXERCISE library-registration: the fake kernel: the C++ checks, then the empty outputs
    # checked by: test_lltm.py::test_opcheck_forward, ::test_meta_inputs_run_the_fake_kernels,
    #   ::test_bad_input, ::test_compile_fullgraph_matches_eager
    op = "lltm"
    _check_same_dtype_and_device(op, _FORWARD_NAMES, (input, weights, bias, old_h, old_cell))
    _check_dim(op, "input", input, 2, "(batch, features)")
    _check_dim(op, "old_h", old_h, 2, "(batch, state)")
    _check_dim(op, "old_cell", old_cell, 2, "(batch, state)")
    _check_dim(op, "weights", weights, 2, "(3 * state, state + features)")
    _check_dim(op, "bias", bias, 1, "(3 * state)")
    (batch, features), state = input.shape, old_h.shape[1]
    _check_size(op, "old_h", old_h, 0, batch, "batch size of `input`")
    torch._check_value(old_cell.shape == old_h.shape,
                       lambda: f"{op}: `old_cell` must have the shape of `old_h` "
                               f"{list(old_h.shape)}, got {list(old_cell.shape)}")
    _check_size(op, "weights", weights, 0, 3 * state, "3 * state size of `old_h`")
    _check_size(op, "weights", weights, 1, state + features,
                "state size of `old_h` + features of `input`")
    _check_size(op, "bias", bias, 0, 3 * state, "3 * state size of `old_h`")
    return (input.new_empty(batch, state), input.new_empty(batch, state),
            input.new_empty(batch, 3 * state))
    # END EXERCISE library-registration


@torch.library.register_fake(f"{LIBRARY}::lltm_backward")
def _backward_fake(grad_h, grad_cell, new_cell, gates, input, old_h, weights):
    op = "lltm_backward"
    tensors = (grad_h, grad_cell, new_cell, gates, input, old_h, weights)
    _check_same_dtype_and_device(op, _BACKWARD_NAMES, tensors)
    _check_dim(op, "new_cell", new_cell, 2, "(batch, state)")
    _check_dim(op, "gates", gates, 2, "(batch, 3 * state)")
    _check_dim(op, "input", input, 2, "(batch, features)")
    _check_dim(op, "weights", weights, 2, "(3 * state, state + features)")
    for name, t in (("grad_h", grad_h), ("grad_cell", grad_cell), ("old_h", old_h)):
        torch._check_value(t.shape == new_cell.shape,
                           lambda: f"{op}: `{name}` must have the shape of `new_cell` "
                                   f"{list(new_cell.shape)}, got {list(t.shape)}")
    (batch, state), features = new_cell.shape, input.shape[1]
    _check_size(op, "gates", gates, 0, batch, "batch size of `new_cell`")
    _check_size(op, "gates", gates, 1, 3 * state, "3 * state size of `new_cell`")
    _check_size(op, "input", input, 0, batch, "batch size of `new_cell`")
    _check_size(op, "weights", weights, 0, 3 * state, "3 * state size of `new_cell`")
    _check_size(op, "weights", weights, 1, state + features,
                "state size of `new_cell` + features of `input`")
    return (input.new_empty(batch, features), weights.new_empty(3 * state, state + features),
            weights.new_empty(3 * state), input.new_empty(batch, state),
            input.new_empty(batch, state))


def _setup_context(ctx, inputs, output):
    input, weights, _bias, old_h, _old_cell = inputs
    _new_h, new_cell, gates = output
    # The backward rebuilds the gate activations from the pre-activation gates.
    ctx.save_for_backward(new_cell, gates, input, old_h, weights)
    # gates is an intermediate, returned for the backward's sake: no gradient flows into it.
    ctx.mark_non_differentiable(gates)
    # Unused outputs get None rather than a zero-filled gradient: for gates (B x 3S) that is
    # always the case, so nothing is allocated and filled for it on every backward.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_h, grad_cell, _grad_gates):
    new_cell = ctx.saved_tensors[0]
    grad_h = torch.zeros_like(new_cell) if grad_h is None else grad_h
    grad_cell = torch.zeros_like(new_cell) if grad_cell is None else grad_cell
    # Gradients in the inputs' order: input, weights, bias, old_h, old_cell.
    return getattr(torch.ops, LIBRARY).lltm_backward(grad_h, grad_cell, *ctx.saved_tensors)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "lltm: double backward is not supported (the lltm backward op has no derivative); "
        "for second derivatives use a plain PyTorch LLTM"
    )


torch.library.register_autograd(f"{LIBRARY}::lltm_forward", _backward,
                                setup_context=_setup_context)
torch.library.register_autograd(f"{LIBRARY}::lltm_backward", _no_double_backward)


def check_reverse_mode_only(op: str, tensors) -> None:
    """Refuse, naming the op, the differentiation modes it has no formula for.

    The op's autograd is reverse mode only (a backward formula). Without this check, forward-mode
    AD (torch.autograd.forward_ad, torch.func.jvp, jacfwd) would run the kernel on the primal
    values and return no tangent, which reads as a derivative of zero; and torch.func's grad,
    vjp and jacrev would refuse with a message about autograd.Function internals. torch.vmap
    works (it runs the op once per batch entry) and so does ordinary reverse mode. Skipped while
    torch.compile traces: a compiled graph has no functorch wrappers or dual tensors.
    """
    if torch.compiler.is_compiling():
        return
    if torch._C._are_functorch_transforms_active():
        for t in tensors:
            if torch._C._functorch.is_gradtrackingtensor(t):
                raise NotImplementedError(
                    f"{op}: torch.func.grad, vjp, jacrev, jvp and jacfwd are not supported (the "
                    f"op's autograd is a backward formula registered with torch.library); use "
                    f"torch.autograd.grad or Tensor.backward() for gradients, torch.vmap for "
                    f"batching")
    for t in tensors:
        if torch.autograd.forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                f"{op}: forward-mode AD (torch.autograd.forward_ad, torch.func.jvp, jacfwd) is "
                f"not supported: the op has a reverse-mode gradient only; use torch.autograd.grad "
                f"or Tensor.backward()")


def lltm(input, weights, bias, old_h, old_cell):
    """One LLTM step: (new_h, new_cell), differentiable (reverse mode) in every input.

    input [B, F], weights [3S, S + F], bias [3S], old_h and old_cell [B, S]; dense tensors of one
    dtype, float64, float32, float16 or bfloat16 (half and bfloat16 compute in float), on the CPU
    or a CUDA device. Inside a torch.autocast region the inputs are cast to the region's dtype.
    Forward-mode AD and torch.func's gradient transforms are refused (check_reverse_mode_only).

    The op itself, torch.ops.lltm.lltm_forward, returns a third output, the pre-activation gates: an
    intermediate for its backward, not differentiable, and not part of this form.
    """
    tensors = (input, weights, bias, old_h, old_cell)
    for name, value in zip(_FORWARD_NAMES, tensors):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"lltm: `{name}` must be a tensor, got {type(value).__name__}")
    for name, t in zip(_FORWARD_NAMES, tensors):
        # A sparse tensor would find no kernel, and the dispatcher's message names no argument.
        # (A plain `if`: torch.compile folds it, a torch._check message closure it cannot trace.)
        if t.layout != torch.strided:
            raise TypeError(f"lltm: `{name}` must be a dense tensor (layout torch.strided), got "
                            f"layout {t.layout}")
    check_reverse_mode_only("lltm", tensors)
    forward = getattr(torch.ops, LIBRARY).lltm_forward
    new_h, new_cell, _gates = forward(input, weights, bias, old_h, old_cell)
    return new_h, new_cell
