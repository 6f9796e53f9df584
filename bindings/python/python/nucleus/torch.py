"""nucleus for PyTorch users: ``import nucleus.torch as nt``.

Every function of :mod:`nucleus` already takes CPU ``torch.Tensor`` arguments without copying
them and answers torch input with torch tensors (over the results' memory, no copy: see
``nucleus._dlpack``). This module re-exports them all and adds the torch forms of the functions
that have no input array to tell them which library to answer in (llguidance's
``llguidance.numpy`` / ``llguidance.torch`` split):

- :func:`allocate_token_bitmask` returns an int32 ``torch.Tensor``.

Importing this module imports torch.
"""

from __future__ import annotations

import torch

from . import *  # noqa: F401,F403  (the whole nucleus API)
from . import __all__ as _nucleus_all
from . import bitmask as _bitmask

__all__ = list(_nucleus_all)


def allocate_token_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """A bitmask allowing every token: int32 ``[batch_size, ceil(vocab_size / 32)]`` of -1, as
    a CPU ``torch.Tensor`` (``xgrammar.allocate_token_bitmask``'s result type).

    Errors: as :func:`nucleus.allocate_token_bitmask`.
    """
    return torch.from_numpy(_bitmask.allocate_token_bitmask(batch_size, vocab_size))
