"""PyTorch tensors and any DLPack producer, without copies (the ``dlpark`` crate, src/dlpack.rs).

Every public function of nucleus that takes arrays goes through :func:`torch_io`:

- an argument that is not a NumPy array but speaks DLPack (``__dlpack__``: a ``torch.Tensor``,
  a JAX or CuPy array on the CPU) is imported as a NumPy array over the same memory
  (``_core.dlpack_to_numpy``: no copy; writes by in-place functions reach the tensor);
- when any argument was a ``torch.Tensor``, every NumPy array in the result (alone, in a
  tuple or NamedTuple, in a list) is exported back as a ``torch.Tensor`` over the same memory
  (``_core.DlpackView`` then ``torch.from_dlpack``: no copy; bfloat16 included). Other
  producers get NumPy results.

So NumPy in gives NumPy out and torch in gives torch out (llguidance's numpy/torch split);
functions with no input array return NumPy, and ``nucleus.torch`` has their torch forms.
Only CPU tensors are accepted: a CUDA tensor is a ``ValueError`` naming its device, never a
silent copy. A tensor that requires grad is read through ``detach()`` (same memory).
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

import numpy as np

from . import _core

F = TypeVar("F", bound=Callable[..., Any])


def is_torch(x: Any) -> bool:
    """Whether ``x`` is a ``torch.Tensor`` (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_dlpack(x: Any) -> bool:
    return (not isinstance(x, (np.ndarray, np.generic, str, bytes))
            and hasattr(type(x), "__dlpack__"))


def to_numpy(x: Any) -> np.ndarray:
    """A NumPy array over ``x``'s memory (``x``: any CPU DLPack producer); no copy."""
    if is_torch(x):
        if x.layout != sys.modules["torch"].strided:
            raise ValueError(f"nucleus reads dense tensors: this one is {x.layout}; call "
                             ".to_dense() first")
        if x.device.type != "cpu":
            raise ValueError(f"nucleus runs on the CPU: the tensor is on {x.device}; move it "
                             "to the CPU first (.cpu())")
        if x.requires_grad:
            x = x.detach()
        if x.is_conj() or x.is_neg():
            raise ValueError("a conjugate or negative-bit torch view has no plain memory "
                             "layout; call .resolve_conj() / .resolve_neg() first")
    return _core.dlpack_to_numpy(x)


def to_torch(a: np.ndarray):
    """A ``torch.Tensor`` over the NumPy array ``a``'s memory; no copy."""
    import torch

    if not a.dtype.isnative:
        raise ValueError(f"cannot export a non-native byte order array ({a.dtype.str})")
    return torch.from_dlpack(_core.DlpackView(a, a.dtype.name))


def _outputs(out: Any) -> Any:
    if isinstance(out, np.ndarray):
        return to_torch(out)
    if isinstance(out, tuple):
        items = [_outputs(v) for v in out]
        return type(out)._make(items) if hasattr(out, "_make") else tuple(items)
    if isinstance(out, list):
        return [_outputs(v) for v in out]
    return out


def torch_io(fn: F) -> F:
    """Wraps ``fn`` (a function on NumPy arrays) to take DLPack producers and, for torch
    input, to give torch output, as the module docs say."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        torch_in = False

        def convert(v):
            nonlocal torch_in
            if _is_dlpack(v):
                torch_in = torch_in or is_torch(v)
                return to_numpy(v)
            return v

        args = tuple(convert(a) for a in args)
        kwargs = {k: convert(v) for k, v in kwargs.items()}
        out = fn(*args, **kwargs)
        return _outputs(out) if torch_in else out

    return wrapper  # type: ignore[return-value]
