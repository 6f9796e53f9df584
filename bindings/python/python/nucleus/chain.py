"""``nucleus.SamplerChain``: a processor chain of one sequence, built from the same JSON as
``nucleus sample``'s ``chain`` (README.md, "Processor chains": llama.cpp's order-as-given
processors, Hugging Face's and vLLM's, ending in a selection such as ``{"sample": {"seed": 42}}``
or ``{"greedy": {}}``)."""

from __future__ import annotations

import json
from typing import Sequence, Tuple, Union

import numpy as np

from . import SamplingError, _core, _logits_2d
from ._dlpack import torch_io

__all__ = ["SamplerChain"]


def _row(logits) -> np.ndarray:
    x = _logits_2d(logits)
    if x.shape[0] != 1:
        raise ValueError(f"a chain samples one row: logits must be [vocab], got {np.shape(logits)}")
    row = x[0]
    return np.ascontiguousarray(row, dtype=np.float32)  # float16 / bfloat16 widen exactly


def _token(name: str, t) -> int:
    if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
        raise TypeError(f"{name} must be an integer token id, got {type(t).__name__}")
    if not 0 <= int(t) < 2**32:
        raise ValueError(f"{name} {t} is outside [0, 2**32)")
    return int(t)


def _call(f, *args):
    try:
        return f(*args)
    except ValueError as e:
        # The core raises a row's sampling error as ValueError(kind, message).
        if len(e.args) == 2 and all(isinstance(a, str) for a in e.args):
            kind, message = e.args
            raise SamplingError(kind, message, 0) from None
        raise


class SamplerChain:
    """One sequence's processor chain.

    ``SamplerChain(config)``: ``config`` a list of processor objects (or its JSON text), in
    order, ending in a selection. A bad config is a ValueError naming what is wrong.

    A decode loop: ``reset(prompt_ids)`` once, then per step ``sample(logits, position=...)``
    and ``accept(token)``. The processors keep their state (penalty counts, DRY's history,
    mirostat's ``mu``) between steps, as in llama.cpp's ``llama_sampler_chain``.
    """

    def __init__(self, config: Union[str, Sequence[dict]]):
        text = config if isinstance(config, str) else json.dumps(list(config))
        self._chain = _core.SamplerChain(text)

    def reset(self, prompt_ids: Sequence[int] = ()) -> None:
        """Start a sequence with these prompt ids (the penalties count them)."""
        self._chain.reset([_token("prompt id", t) for t in prompt_ids])

    def accept(self, token: int) -> None:
        """Tell the chain the token the sequence took."""
        self._chain.accept(_token("token", token))

    @property
    def output_ids(self) -> list:
        """The ids accepted since ``reset``."""
        return self._chain.output_ids

    @torch_io
    def sample(self, logits: np.ndarray, *, position: int, sample_index: int = 0
               ) -> Tuple[int, float]:
        """Sample one row (``[vocab]`` float32, float16 or bfloat16) at ``position`` (the
        Philox counter): ``(token, logprob)``. A row that cannot be sampled raises
        :class:`nucleus.SamplingError`."""
        return _call(self._chain.sample, _row(logits), int(position), int(sample_index))

    @torch_io
    def distribution(self, logits: np.ndarray, *, position: int) -> np.ndarray:
        """The final distribution this row would be drawn from: float64 ``[vocab]``."""
        return _call(self._chain.distribution, _row(logits), int(position))
