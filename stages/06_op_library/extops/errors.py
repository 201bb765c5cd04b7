"""The exceptions extops' Python API raises for bad input, catchable as torchvision's are.

torchvision's ops raise RuntimeError for a wrong size or type, so code written for them (and
torchvision's and detectron2's own tests) catches `except RuntimeError`. extops says more
precisely what is wrong (ValueError for a wrong value or size, TypeError for a wrong type), so
its errors are of classes that derive from both:

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


class ExtopsValueError(ValueError, RuntimeError):
    """A bad value or size (also a RuntimeError, as torchvision raises)."""


class ExtopsTypeError(TypeError, RuntimeError):
    """A bad type, dtype or layout (also a RuntimeError, as torchvision raises)."""


def as_runtime_error(error: Exception) -> Exception:
    """`error` as the extops class of its kind, same message; other errors as they are."""
    if isinstance(error, RuntimeError):
        return error
    kind = ExtopsValueError if isinstance(error, ValueError) else ExtopsTypeError
    converted = kind(*error.args)
    converted.__traceback__ = error.__traceback__
    return converted


def call(fn, *args, **kwargs):
    """fn(*args, **kwargs), its ValueError and TypeError re-raised as ExtopsValueError and
    ExtopsTypeError. While torch.compile traces, a plain call: torch wraps what tracing raises in
    exceptions of its own, and Dynamo need not trace the try."""
    if torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as error:
        raise as_runtime_error(error) from None


__all__ = ["ExtopsTypeError", "ExtopsValueError"]
