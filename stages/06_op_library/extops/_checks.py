"""Checks every op of the library makes in its functional form, before the dispatcher.

They refuse, by name, what the dispatcher and autograd would otherwise get wrong or explain
badly: a sparse (or other non-dense) tensor, for which no kernel is registered, so the dispatcher
would say "Could not run ... with arguments from the 'SparseCPU' backend", naming no argument;
and differentiation modes the ops have no formula for (see check_reverse_mode_only).
"""

from __future__ import annotations

import torch

# Layouts by the names C++ prints them with (c10::Layout), as the C++ checks do.
LAYOUT_NAMES = {torch.strided: "Strided", torch.sparse_coo: "Sparse", torch.sparse_csr: "SparseCsr",
                torch.sparse_csc: "SparseCsc", torch.sparse_bsr: "SparseBsr",
                torch.sparse_bsc: "SparseBsc", torch._mkldnn: "Mkldnn"}


def check_dense(op: str, named) -> None:
    """Every (name, tensor) in `named` (None entries skipped) is dense (torch.strided)."""
    # A plain `if`, not torch._check_type: torch.compile traces this function, and the layout of a
    # traced tensor is known, so the branch folds away (a message closure over a tensor would not).
    for name, t in named:
        if t is not None and t.layout != torch.strided:
            raise TypeError(f"{op}: `{name}` must be a dense tensor (layout Strided), got layout "
                            f"{LAYOUT_NAMES.get(t.layout, t.layout)}")


def check_reverse_mode_only(op: str, tensors) -> None:
    """Refuse, naming the op, the differentiation modes it has no formula for.

    The ops' autograd is reverse mode only (a backward formula). Without this check, forward-mode
    AD (torch.autograd.forward_ad, torch.func.jvp, jacfwd) through an op whose autograd is
    registered from Python would run the kernel on the primal values and return no tangent,
    which reads as a derivative of zero; and torch.func's grad, vjp and jacrev would refuse with
    a message about autograd.Function internals. torch.vmap works (the op runs once per batch
    entry), and so does ordinary reverse mode. Skipped while torch.compile traces: a compiled
    graph has no functorch wrappers or dual tensors.
    """
    if torch.compiler.is_compiling():
        return
    tensors = [t for t in tensors if t is not None]
    if torch._C._are_functorch_transforms_active():
        for t in tensors:
            if torch._C._functorch.is_gradtrackingtensor(t):
                raise NotImplementedError(
                    f"{op}: torch.func.grad, vjp, jacrev, jvp and jacfwd are not supported (the "
                    f"op has a backward formula only, which torch.func cannot transform); use "
                    f"torch.autograd.grad or Tensor.backward() for gradients, torch.vmap for "
                    f"batching")
    for t in tensors:
        if torch.autograd.forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                f"{op}: forward-mode AD (torch.autograd.forward_ad, torch.func.jvp, jacfwd) is "
                f"not supported: the op has a reverse-mode gradient only; use torch.autograd.grad "
                f"or Tensor.backward()")
