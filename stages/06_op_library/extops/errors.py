"""Bad input: what every op of the library checks in Python, and the exceptions it raises.

The checks are workbook/checks.h's, in Python, in the same order, and their messages are the
same text: the C++ library hands its table of messages (workbook/checks.h) to Python
(extops._C.MESSAGES), and `say` fills one in as the C++ checks do. The fake kernels
(extops/lltm.py, extops/deform_conv2d.py) run these checks on meta tensors and while
torch.compile traces, and the functional forms run check_dense and check_reverse_mode_only before
the dispatcher, so a bad input fails with one message on CPU tensors, on meta tensors and under
torch.compile, by construction.

The exceptions: torchvision's ops raise RuntimeError for a wrong size or type, so code written for
them (and torchvision's and detectron2's own tests) catches `except RuntimeError`. extops says
more precisely what is wrong (ValueError for a wrong value or size, TypeError for a wrong type),
so its errors are of classes that derive from both:

    ExtopsValueError(ValueError, RuntimeError)
    ExtopsTypeError(TypeError, RuntimeError)

`except ValueError`, `except TypeError` and `except RuntimeError` all catch them; the messages are
the checks' own, unchanged. NotImplementedError (forward-mode AD, torch.func) already derives
from RuntimeError. What the functional forms (extops.deform_conv2d, extops.lltm) and the modules
raise is converted; a direct call of torch.ops.extops.* keeps the C++ checks' types (c10's
ValueError and TypeError become Python's ValueError and TypeError), and so does an error raised
while torch.compile traces (torch reports it in a TorchRuntimeError, a RuntimeError too).
"""

from __future__ import annotations

import torch

from . import _C

# The checks' messages, each written once, in C++ (workbook/checks.h): name -> text with
# {slots}. `say` fills one in.
MESSAGES: dict[str, str] = dict(_C.MESSAGES)


def say(name: str, **slots) -> str:
    return MESSAGES[name].format(**slots)


# The dtypes the kernels compute in: an allow-list (float8 is floating point too, and refused).
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class ExtopsValueError(ValueError, RuntimeError):
    """A bad value or size (also a RuntimeError, as torchvision raises)."""


class ExtopsTypeError(TypeError, RuntimeError):
    """A bad type, dtype or layout (also a RuntimeError, as torchvision raises)."""


# Built on the stable ABI (stage 10), the C++ checks cannot raise c10's ValueError and TypeError
# (C++ classes of libtorch): they raise RuntimeError, the class they mean first in the message,
# "[ValueError] lltm: ..." (workbook/checks.h). `call` raises those as the class they name.
_NAMED_CLASSES = {"[TypeError] ": TypeError, "[ValueError] ": ValueError}


def as_runtime_error(error: Exception) -> Exception:
    """`error` as the extops class of its kind, same message; other errors as they are."""
    if isinstance(error, RuntimeError):
        message = str(error)
        for prefix, kind in _NAMED_CLASSES.items():
            if message.startswith(prefix):
                return as_runtime_error(kind(message[len(prefix):]))
        return error
    kind = ExtopsValueError if isinstance(error, ValueError) else ExtopsTypeError
    converted = kind(*error.args)
    converted.__traceback__ = error.__traceback__
    return converted


def call(fn, *args, **kwargs):
    """fn(*args, **kwargs), its ValueError and TypeError (and a stable-ABI check's RuntimeError
    that names one of them) re-raised as ExtopsValueError and ExtopsTypeError. While
    torch.compile traces, a plain call: torch wraps what tracing raises in exceptions of its own,
    and Dynamo need not trace the try."""
    if torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError, RuntimeError) as error:
        converted = as_runtime_error(error)
        if converted is error:
            raise
        raise converted from None


# ----------------------------------------------------------------------------------------------
# The checks of workbook/checks.h, check for check


def check_dense(op: str, named) -> None:
    """Every (name, tensor) in `named` (None entries skipped) is dense (torch.strided): a sparse
    tensor would find no kernel, and the dispatcher's message names no argument."""
    # A plain `if`, not torch._check_type: torch.compile traces this function, and the layout of a
    # traced tensor is known, so the branch folds away (a message closure over a tensor would not).
    for name, t in named:
        if t is not None and t.layout != torch.strided:
            raise TypeError(say("dense", op=op, arg=name, got=t.layout))


def check_inputs(op: str, named) -> None:
    """What every op checks of all its tensors together, in checks.h's order: dense, the first
    one floating point, all of its dtype and on its device. `named`: (name, tensor) in the
    schema's order."""
    check_dense(op, named)
    first_name, first = named[0]
    torch._check_type(first.dtype in DTYPES,
                      lambda: say("floating", op=op, arg=first_name, got=first.dtype))
    for name, t in named:
        torch._check_type(t.dtype == first.dtype,
                          lambda: say("dtype", op=op, arg=name, expected=first.dtype,
                                      first=first_name, got=t.dtype))
    for name, t in named:
        torch._check(t.device == first.device,
                     lambda: say("device", op=op, arg=name, first=first_name,
                                 expected=first.device, got=t.device))


def check_dim(op: str, name: str, t, ndim: int, what: str) -> None:
    """`what` names the dimensions for the reader, e.g. "(batch, state)"."""
    torch._check_value(t.dim() == ndim,
                       lambda: say("dim", op=op, arg=name, ndim=ndim,
                                   dimensions="dimension" if ndim == 1 else "dimensions",
                                   what=what, got=t.dim(), sizes=list(t.shape)))


def check_size(op: str, name: str, t, dim: int, expected, why: str) -> None:
    """Size of dimension `dim` must be `expected`; `why` says where the expectation comes from."""
    torch._check_value(t.shape[dim] == expected,
                       lambda: say("size", op=op, arg=name, expected=expected, dim=dim, why=why,
                                   sizes=list(t.shape)))


def check_same_shape(op: str, name: str, t, other_name: str, other) -> None:
    torch._check_value(t.shape == other.shape,
                       lambda: say("shape", op=op, arg=name, other=other_name,
                                   expected=list(other.shape), got=list(t.shape)))


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


__all__ = ["ExtopsTypeError", "ExtopsValueError"]
