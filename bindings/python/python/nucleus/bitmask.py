"""XGrammar's token-bitmask functions (``xgrammar.allocate_token_bitmask`` and
``xgrammar.apply_token_bitmask_inplace``) on NumPy arrays, in XGrammar's layout: int32
``[batch, ceil(vocab_size / 32)]``, token ``t`` is bit ``t % 32`` of word ``t // 32``, a set bit
allows it, -1 allows every token. Masks filled by XGrammar or llguidance can be applied here, and
nucleus's by theirs.

Prototypes followed: ``xgrammar/matcher.py`` (mlc-ai/xgrammar): ``allocate_token_bitmask(batch_size,
vocab_size)`` and ``apply_token_bitmask_inplace(logits, bitmask, *, vocab_size=None,
indices=None)``; the CPU kernel ``ApplyTokenBitmaskInplaceCPU`` (cpp/grammar_matcher.cc), where
``indices`` names rows of both the logits and the bitmask. One difference, as llguidance does:
columns at or above ``vocab_size`` (a padded LM head's) become -inf, where XGrammar leaves them.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from . import _core
from ._dlpack import torch_io

__all__ = ["allocate_token_bitmask", "apply_token_bitmask_inplace", "bitmask_words"]


def bitmask_words(vocab_size: int) -> int:
    """``ceil(vocab_size / 32)``: the int32 words of one row's bitmask."""
    if vocab_size < 0:
        raise ValueError(f"vocab_size must be >= 0, got {vocab_size}")
    return (int(vocab_size) + 31) // 32


def allocate_token_bitmask(batch_size: int, vocab_size: int) -> np.ndarray:
    """A bitmask allowing every token: int32 ``[batch_size, ceil(vocab_size / 32)]`` of -1."""
    for name, v in (("batch_size", batch_size), ("vocab_size", vocab_size)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name} must be an integer, got {type(v).__name__}")
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    return np.full((int(batch_size), bitmask_words(vocab_size)), -1, dtype=np.int32)


@torch_io
def apply_token_bitmask_inplace(logits: np.ndarray, bitmask: np.ndarray, *,
                                vocab_size: Optional[int] = None, indices=None) -> None:
    """Set the logits of disallowed tokens to -inf, in place.

    Args:
        logits: float32 ``[B, row_len]`` (or ``[row_len]``), writeable, rows contiguous (any row
            stride). Other dtypes are a TypeError, as XGrammar's CPU kernel.
        bitmask: int32 ``[B', words]`` (or ``[words]``) with ``words >= ceil(vocab_size / 32)``.
        vocab_size: the tokens the mask covers, default ``logits.shape[-1]``; columns at or above
            it become -inf.
        indices: rows to mask (of both arrays, XGrammar's rule), default every row, when
            ``B == B'``.

    Raises:
        TypeError: a dtype other than float32 logits or int32 bitmask.
        ValueError: shapes that do not fit, an index out of range, a read-only array.
    """
    if not isinstance(logits, np.ndarray) or logits.dtype != np.float32:
        raise TypeError("logits must be a float32 numpy.ndarray")
    if not isinstance(bitmask, np.ndarray) or bitmask.dtype != np.int32:
        raise TypeError("bitmask must be an int32 numpy.ndarray")
    if not logits.flags.writeable:
        raise ValueError("logits is read-only: apply_token_bitmask_inplace writes into it")
    for name, a in (("logits", logits), ("bitmask", bitmask)):
        if not a.dtype.isnative:
            raise TypeError(f"{name} has non-native byte order ({a.dtype.str})")
        if not a.flags.aligned:
            raise ValueError(f"{name} is not aligned to its item size")
    x = logits[None, :] if logits.ndim == 1 else logits
    m = bitmask[None, :] if bitmask.ndim == 1 else bitmask
    if x.ndim != 2 or m.ndim != 2:
        raise ValueError(f"logits and bitmask must be 1-D or 2-D, got {logits.shape} and "
                         f"{bitmask.shape}")
    # Rows that share memory would be masked through each other.
    if x.shape[0] > 1 and x.size and x.strides[0] < x.shape[1] * x.itemsize:
        raise ValueError(f"the logits' rows overlap or run backwards (row stride {x.strides[0]} "
                         f"bytes for rows of {x.shape[1] * x.itemsize})")
    if vocab_size is None:
        vocab = x.shape[1]
    else:
        if isinstance(vocab_size, (bool, np.bool_)) or not isinstance(vocab_size,
                                                                      (int, np.integer)):
            raise TypeError(f"vocab_size must be an integer, got {type(vocab_size).__name__}")
        vocab = int(vocab_size)
    if not 0 <= vocab <= x.shape[1]:
        raise ValueError(f"vocab_size {vocab} must be in 0..={x.shape[1]} (the logits' row "
                         "length)")
    if indices is None:
        if x.shape[0] != m.shape[0]:
            raise ValueError(f"without indices the logits ({x.shape[0]} rows) and the bitmask "
                             f"({m.shape[0]} rows) must have the same batch")
        rows = list(range(x.shape[0]))
    else:
        idx = np.asarray(indices)
        if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
            raise ValueError("indices must be a 1-D list or array of integers")
        if idx.size and idx.min() < 0:
            raise ValueError("indices must be >= 0")
        rows = [int(i) for i in idx]
    _core.apply_token_bitmask_inplace_f32(x, m, vocab, rows)
