"""``nucleus.SamplerChain``: a processor chain of one sequence, built from the same JSON as
``nucleus sample``'s ``chain`` (README.md, "Processor chains": llama.cpp's order-as-given
processors, Hugging Face's and vLLM's, ending in a selection such as ``{"sample": {"seed": 42}}``
or ``{"greedy": {}}``)."""

from __future__ import annotations

import json
import operator
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


def _counter(name: str, value, bits: int) -> int:
    """An integer in [0, 2**bits): the Philox position (64 bits) or sample index (32)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if not 0 <= v < 2**bits:
        raise ValueError(f"{name} {v} is outside [0, 2**{bits})")
    return v


_SELECTIONS = ("sample", "greedy", "mirostat", "mirostat_v2", "adaptive_p")


def _check_selection(config) -> None:
    """One token per call: a selection's ``n > 1`` or ``logprobs`` is refused, as in
    :func:`nucleus.sample` (they are the CLI's; here draw sample i with ``sample_index=i`` and
    read probabilities with ``distribution``)."""
    for entry in config if isinstance(config, list) else []:
        if isinstance(entry, dict) and len(entry) == 1:
            (name, args), = entry.items()
            if name in _SELECTIONS and isinstance(args, dict):
                if args.get("n") not in (None, 1):
                    raise ValueError(f"{name}.n is {args['n']}: SamplerChain.sample draws one "
                                     "token per call; draw sample i with sample_index=i")
                if args.get("logprobs") is not None:
                    raise ValueError(f"{name}.logprobs is set: SamplerChain.sample returns the "
                                     "chosen token's logprob; distribution() gives every "
                                     "token's exact probability")


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

    Threads may share a chain: their calls take turns, each seeing the state the previous
    one left. ``copy.copy`` / ``copy.deepcopy`` give an independent chain with the same state.
    A selection's ``n > 1`` or ``logprobs`` (the CLI's) is a ValueError here: ``sample``
    draws one token per call (sample ``i`` with ``sample_index=i``).
    """

    def __init__(self, config: Union[str, Sequence[dict]]):
        text = config if isinstance(config, str) else json.dumps(list(config))
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None  # the core names the JSON error
        _check_selection(parsed)
        self._chain = _core.SamplerChain(text)

    @classmethod
    def from_params(cls, params) -> "SamplerChain":
        """The chain of a :class:`nucleus.SamplingParams` (the crate's
        ``SamplerChain::from_params``): its processors in the fixed order, then its selection,
        with the request's seed. Its tokens equal :func:`nucleus.sample` with ``params=`` at the
        same positions, prompt and output ids, and it carries what ``sample`` leaves to the
        caller (penalty counts, DRY's history, mirostat's ``mu``) from step to step. As in
        ``sample``, ``n > 1`` and ``logprobs`` are refused."""
        from .params import SamplingParams

        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a nucleus.SamplingParams, got {type(params).__name__}")
        if params.n != 1 or params.logprobs is not None:
            raise ValueError("SamplerChain.sample draws one token per call: n must be 1 and "
                             "logprobs None (use sample_index and distribution)")
        new = object.__new__(cls)
        new._chain = _core.SamplerChain.from_params(params._to_dict())
        return new

    def __copy__(self) -> "SamplerChain":
        """An independent copy with the same state (``copy.copy`` and ``copy.deepcopy``)."""
        new = object.__new__(SamplerChain)
        new._chain = self._chain.clone()
        return new

    def __deepcopy__(self, memo) -> "SamplerChain":
        return self.__copy__()

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
        return _call(self._chain.sample, _row(logits), _counter("position", position, 64),
                     _counter("sample_index", sample_index, 32))

    @torch_io
    def distribution(self, logits: np.ndarray, *, position: int) -> np.ndarray:
        """The final distribution this row would be drawn from: float64 ``[vocab]``."""
        return _call(self._chain.distribution, _row(logits), _counter("position", position, 64))
