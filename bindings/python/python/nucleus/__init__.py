"""nucleus: the decode step of LLM inference, exactly to a written contract, on NumPy arrays.

The sampler of the Rust crate ``nucleus-sampling`` (README.md, "Python"; the contract is
``spec/sampling.md`` in the project's shared folder): per row, temperature, min-p, top-k and
top-p in that fixed order, then one draw from the row's own counter-based Philox4x32-10
stream at ``(seed, position)``, so a row's token depends on its logits, parameters, seed and
position only, never on the batch, its order or the thread count.

Logits are read in place (no copy) when their rows are contiguous: float32, float16 or
``ml_dtypes.bfloat16``, C-contiguous or with a row stride (``big[:, :vocab]``). Every
parameter is a scalar for all rows or an array of one value per row (FlashInfer's
convention). The Rust work runs with the GIL released.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import operator

import numpy as np

from . import _core
from ._dlpack import torch_io

__all__ = [
    "SamplerChain",
    "SamplingParams",
    "allocate_token_bitmask",
    "apply_token_bitmask_inplace",
    "top_k_top_p_sampling_from_logits",
    "top_k_top_p_sampling_from_probs",
    "top_p_sampling_from_probs",
    "top_k_sampling_from_probs",
    "min_p_sampling_from_probs",
    "top_k_renorm_probs",
    "top_p_renorm_probs",
    "top_k_mask_logits",
    "chain_speculative_sampling",
    "NucleusError",
    "SamplingError",
    "GrammarError",
    "GrammarCompiler",
    "CompiledGrammar",
    "GrammarMatcher",
    "SampleResult",
    "sample",
    "distribution",
    "__version__",
]

__version__: str = _core.__version__


class NucleusError(ValueError):
    """The base of nucleus's errors (a ``ValueError``)."""


class SamplingError(NucleusError):
    """One row's sampling error: ``kind`` is the Rust ``SampleError`` variant
    (``NonFiniteLogits``, ``NoCandidates``, ``InvalidParams``, ...), ``row`` the row index
    (``None`` for an error of no row: a ``SamplingParams`` out of range)."""

    def __init__(self, kind: str, message: str, row: Optional[int]):
        super().__init__(message if row is None else f"row {row}: {message}")
        self.kind = kind
        self.message = message
        self.row = row

    def __reduce__(self):  # pickle and copy (errors cross process pools)
        return (type(self), (self.kind, self.message, self.row))


class GrammarError(NucleusError):
    """An error of structured output (``nucleus.GrammarCompiler``, ``nucleus.GrammarMatcher``):
    ``kind`` is the Rust ``nucleus_grammar::GrammarError`` variant (``Tokenizer``,
    ``InvalidSchemaJson``, ``Compile``, ``TooDeep``, ``TokenOutOfRange``, ``TokenRejected``,
    ``Ended``, ``RollbackTooFar``, ``BitmaskTooShort``, ``Matcher``, ...) or, for a bitmask
    argument, ``BitmaskShape`` / ``BitmaskIndex``; ``message`` says what is wrong."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message

    def __reduce__(self):  # pickle and copy, as SamplingError
        return (type(self), (self.kind, self.message))


class SampleResult(NamedTuple):
    """What :func:`sample` returns.

    - ``token_ids``: int64 ``[batch]``, -1 for a row that failed;
    - ``logprobs``: float64 ``[batch]``, the chosen token's natural-log probability under the
      final distribution (0 for greedy), NaN for a row that failed;
    - ``errors``: one entry per row, ``None`` or the row's :class:`SamplingError` (returned,
      not raised: the other rows are sampled);
    - ``seeds``: uint64 ``[batch]``, the seed each row used (its own, or the one drawn from the
      OS when it had none: pass it back to reproduce the draw); 0 for a failed row;
    - ``num_candidates``: int64 ``[batch]``, the tokens with non-zero final probability (1 for
      greedy); 0 for a failed row;
    - ``mirostat_mu``: float64 ``[batch]``, mirostat's ``mu`` after this token (pass it as the
      next step's ``mirostat_mu``); NaN where mirostat is off or the row failed.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    errors: List[Optional[SamplingError]]
    seeds: np.ndarray
    num_candidates: np.ndarray
    mirostat_mu: np.ndarray


_LOGIT_DTYPES = ("float32", "float16", "bfloat16")


def _check_array(name: str, a: np.ndarray) -> None:
    """Native byte order and aligned: what Rust reads in place."""
    if not a.dtype.isnative:
        raise TypeError(f"{name} has non-native byte order ({a.dtype.str}); convert it with "
                        f".astype({a.dtype.name!r})")
    if not a.flags.aligned:
        raise ValueError(f"{name} is not aligned to its item size; copy it (np.ascontiguousarray)")


def _logits_2d(logits, name: str = "logits") -> np.ndarray:
    if not isinstance(logits, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(logits).__name__}")
    if logits.dtype.name not in _LOGIT_DTYPES:
        raise TypeError(
            f"{name} must be float32, float16 or bfloat16 (ml_dtypes), got {logits.dtype}; "
            "cast them first (nucleus does not convert behind your back)")
    _check_array(name, logits)
    if logits.ndim == 1:
        x = logits[None, :]
    elif logits.ndim == 2:
        x = logits
    else:
        raise ValueError(f"{name} must be [batch, vocab] or [vocab], got shape {logits.shape}")
    if x.size and x.shape[1] > 1 and x.strides[1] != x.itemsize:
        raise ValueError(f"the {name}' rows must be contiguous (element stride {x.strides[1]} "
                         f"bytes, the item is {x.itemsize})")
    if x.size == 0:
        # An empty batch (NumPy may give it zero strides): a fresh empty array of the shape.
        x = np.empty(x.shape, dtype=x.dtype)
    return x


def _vocab(vocab_size, row_len: int) -> int:
    if row_len == 0:
        raise ValueError("the logits' rows have no entries (shape [batch, 0]): nothing to sample")
    if vocab_size is None:
        return row_len
    if isinstance(vocab_size, (bool, np.bool_)):
        raise TypeError("vocab_size must be an integer, got bool")
    try:
        v = operator.index(vocab_size)
    except TypeError:
        raise TypeError(f"vocab_size must be an integer, got {type(vocab_size).__name__}") from None
    if not 1 <= v <= row_len:
        raise ValueError(f"vocab_size {v} must be in 1..={row_len} (the row length)")
    return v


def _per_row(name: str, value, batch: int, kind: str) -> np.ndarray:
    """``value`` as a C-contiguous array of one value per row: float64 for ``kind`` "float",
    int64 for "int", uint64 for "uint". An integer parameter given a non-integer is refused."""
    if kind != "float" and isinstance(value, (list, tuple)):
        # Python ints up to 2**64 - 1: NumPy would make a mixed list float64 (or object).
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
                   for v in value):
            raise TypeError(f"{name} must hold integers")
        lo, hi = (0, 2**64 - 1) if kind == "uint" else (-2**63, 2**63 - 1)
        if any(not lo <= int(v) <= hi for v in value):
            raise ValueError(f"{name} holds a value outside [{lo}, {hi}]")
        value = np.array([int(v) for v in value], dtype=np.uint64 if kind == "uint" else np.int64)
    elif kind != "float" and isinstance(value, int) and not isinstance(value, bool):
        lo, hi = (0, 2**64 - 1) if kind == "uint" else (-2**63, 2**63 - 1)
        if not lo <= value <= hi:
            raise ValueError(f"{name} {value} is outside [{lo}, {hi}]")
    a = np.asarray(value)
    if a.ndim > 1 or (a.ndim == 1 and a.shape[0] != batch):
        raise ValueError(f"{name} must be a scalar or have shape ({batch},), got shape {a.shape}")
    if kind == "float":
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
            raise TypeError(f"{name} must be a number, got dtype {a.dtype}")
        out = a.astype(np.float64)
    else:
        if not np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_:
            raise TypeError(f"{name} must be an integer, got dtype {a.dtype}")
        if kind == "uint":
            if a.size and np.any(a < 0):
                raise ValueError(f"{name} must be >= 0")
            out = a.astype(np.uint64)
        else:
            if a.dtype == np.uint64 and a.size and np.any(a > np.iinfo(np.int64).max):
                raise ValueError(f"{name} must be below 2**63")
            out = a.astype(np.int64)
    return np.ascontiguousarray(np.broadcast_to(out, (batch,)))


def _ids(name: str, value, batch: int) -> list:
    """``value`` (None, or one sequence of token ids per row) as lists of ints in [0, 2**32)."""
    if value is None:
        return []
    rows = list(value)
    if len(rows) != batch:
        raise ValueError(f"{name} must have one sequence of ids per row ({batch}), got {len(rows)}")
    out = []
    for i, r in enumerate(rows):
        a = np.asarray(r)
        if a.size == 0:
            out.append([])
            continue
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"{name}[{i}] must be a 1-D sequence of integer token ids")
        if a.min() < 0 or a.max() > np.iinfo(np.uint32).max:
            raise ValueError(f"{name}[{i}] holds an id outside [0, 2**32)")
        out.append(a.astype(np.int64).tolist())
    return out


def _rows(batch, temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
          frequency_penalty, seed, position, sample_index=0, prompt_ids=None, output_ids=None):
    index = _per_row("sample_index", sample_index, batch, "uint")
    if index.size and index.max() > np.iinfo(np.uint32).max:
        raise ValueError("sample_index must be below 2**32")
    return (
        _per_row("temperature", temperature, batch, "float"),
        _per_row("top_k", top_k, batch, "int"),
        _per_row("top_p", top_p, batch, "float"),
        _per_row("min_p", min_p, batch, "float"),
        _per_row("repetition_penalty", repetition_penalty, batch, "float"),
        _per_row("presence_penalty", presence_penalty, batch, "float"),
        _per_row("frequency_penalty", frequency_penalty, batch, "float"),
        None if seed is None else _per_row("seed", seed, batch, "uint"),
        _per_row("position", position, batch, "uint"),
        index.astype(np.uint32),
        _ids("prompt_ids", prompt_ids, batch),
        _ids("output_ids", output_ids, batch),
    )


_KEYWORD_DEFAULTS = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                         presence_penalty=0.0, frequency_penalty=0.0, seed=None)


def _extras(batch, params, stop_token_ids, mirostat_mu, token_bitmask, keywords) -> dict:
    """The optional inputs of ``_core.sample`` / ``_core.distribution_f32``, checked."""
    out = {}
    if params is not None:
        for name, value in keywords.items():
            default = _KEYWORD_DEFAULTS[name]
            if not (value is default or (isinstance(value, (int, float)) and value == default
                                         and not isinstance(value, bool))):
                raise ValueError(f"pass either params= or {name}=, not both (the keyword "
                                 "parameters are the fields of SamplingParams)")
        if isinstance(params, SamplingParams):
            rows = [params] * batch
        elif isinstance(params, (list, tuple)):
            rows = list(params)
        else:
            raise TypeError(f"params must be a nucleus.SamplingParams or a list of one per row, "
                            f"got {type(params).__name__}")
        if len(rows) != batch:
            raise ValueError(f"params must be one SamplingParams or one per row ({batch}), "
                             f"got {len(rows)}")
        for i, p in enumerate(rows):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params[{i}] must be a nucleus.SamplingParams, got "
                                f"{type(p).__name__}")
            if p.n != 1:
                raise ValueError(f"params[{i}].n is {p.n}: nucleus.sample draws one token per "
                                 "row; draw sample i with sample_index=i")
            if p.logprobs is not None:
                raise ValueError(f"params[{i}].logprobs is set: nucleus.sample returns the "
                                 "chosen tokens' logprobs; nucleus.distribution gives every "
                                 "token's exact probability")
        out["params"] = [p._to_dict() for p in rows]
    if stop_token_ids is not None:
        out["stop_token_ids"] = _ids("stop_token_ids", stop_token_ids, batch)
    if mirostat_mu is not None:
        out["mirostat_mu"] = _per_row("mirostat_mu", mirostat_mu, batch, "float")
    if token_bitmask is not None:
        m = token_bitmask
        if not isinstance(m, np.ndarray) or m.dtype != np.int32 or m.ndim != 2:
            raise TypeError("token_bitmask must be an int32 numpy array [batch, words] "
                            "(nucleus.allocate_token_bitmask)")
        _check_array("token_bitmask", m)
        out["token_bitmask"] = m
    return out


def _call_args(batch, temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
               frequency_penalty, seed, position, sample_index, prompt_ids, output_ids,
               token_bitmask, params, stop_token_ids, mirostat_mu):
    """The positional and keyword arguments of ``_core.sample`` / ``_core.distribution_f32``
    after the logits and vocabulary size: :func:`sample`'s and :func:`distribution`'s
    keywords, checked."""
    args = _rows(batch, temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                 frequency_penalty, seed, position, sample_index, prompt_ids, output_ids)
    extra = _extras(batch, params, stop_token_ids, mirostat_mu, token_bitmask,
                    dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                         repetition_penalty=repetition_penalty,
                         presence_penalty=presence_penalty,
                         frequency_penalty=frequency_penalty, seed=seed))
    return args, extra


def _errors(raw) -> List[Optional[SamplingError]]:
    return [None if e is None else SamplingError(e[0], e[1], i) for i, e in enumerate(raw)]


@torch_io
def sample(logits: np.ndarray, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
           repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
           seed=None, position=0, prompt_ids=None, output_ids=None,
           token_bitmask=None, params=None, stop_token_ids=None, mirostat_mu=None,
           sample_index=0, vocab_size: Optional[int] = None) -> SampleResult:
    """Sample one token per row of ``logits``.

    Args:
        logits: ``[batch, row_len]`` (or ``[row_len]``: one row) float32, float16 or
            ``ml_dtypes.bfloat16``; rows contiguous, any row stride; read, never written.
        temperature: float, scalar or ``[batch]``; below 1e-5 is greedy (spec step 6).
        top_k: int, scalar or ``[batch]``; 0 or -1 is off, larger than the vocabulary is off.
        top_p: float in (0, 1], scalar or ``[batch]``; 1 is off.
        min_p: float in [0, 1], scalar or ``[batch]``; 0 is off.
        repetition_penalty, presence_penalty, frequency_penalty: floats, scalar or
            ``[batch]`` (spec step 5: repetition over prompt and output ids, each distinct id
            once, ``l > 0 ? l / r : l * r``; frequency and presence over output ids only).
        seed: int in [0, 2**64), scalar or ``[batch]``: each row's Philox key. ``None``: each row
            draws a seed from the OS (not reproducible).
        position: int >= 0, scalar or ``[batch]``: each row's Philox position counter (the index
            of the token being chosen in its sequence).
        prompt_ids, output_ids: ``None`` or one sequence of token ids per row (below
            ``vocab_size``): what the penalties count.
        token_bitmask: ``None`` or int32 ``[batch, >= ceil(vocab_size / 32)]`` in XGrammar's
            layout (token ``t`` is bit ``t % 32`` of word ``t // 32``, set = allowed; -1 allows
            all), e.g. filled by :class:`nucleus.GrammarMatcher`, XGrammar or llguidance:
            applied at spec step 3 to the sampler's copy of the row, never to ``logits``.
        params: ``None``, one :class:`nucleus.SamplingParams` for every row, or a sequence of
            one per row: every parameter of the sampler (DRY, XTC, mirostat, typical-p, ...).
            With ``params`` the keywords from ``temperature`` to ``frequency_penalty`` and
            ``seed`` must be left at their defaults (the seed is ``params.seed``), and
            ``params.n`` must be 1 and ``params.logprobs`` ``None`` (one token per row: draw
            sample ``i`` of a row with ``sample_index=i``; exact probabilities come from
            :func:`distribution`).
        stop_token_ids: ``None`` or one sequence per row: the EOS and stop ids that
            ``min_tokens`` bans while ``len(output_ids) < min_tokens``.
        mirostat_mu: ``None`` or float ``[batch]``: mirostat's ``mu`` from the previous step
            (:attr:`SampleResult.mirostat_mu`); NaN or ``None``: the start value ``2 * tau``.
        sample_index: int in [0, 2**32), scalar or ``[batch]``: the Philox counter's third
            word, which of a row's samples this is (spec "Random streams").
        vocab_size: the candidate ids per row, default ``row_len``; ids at or above it are
            padding and never chosen.

    Returns:
        :class:`SampleResult` ``(token_ids int64[batch], logprobs float64[batch], errors,
        seeds, num_candidates, mirostat_mu)``.

    Raises:
        TypeError: logits not a NumPy array of a supported dtype, a parameter of the wrong type.
        ValueError: a shape that does not fit (a parameter array of another length, rows that
            are not contiguous, ``vocab_size`` outside ``1..=row_len``). A bad parameter *value*
            (``top_p = 2``) is a per-row :class:`SamplingError` of kind ``InvalidParams``.
    """
    x = _logits_2d(logits)
    batch, row_len = x.shape
    vocab = _vocab(vocab_size, row_len)
    args, extra = _call_args(batch, temperature, top_k, top_p, min_p, repetition_penalty,
                             presence_penalty, frequency_penalty, seed, position, sample_index,
                             prompt_ids, output_ids, token_bitmask, params, stop_token_ids,
                             mirostat_mu)
    out = _core.sample(x, x.dtype.name, "logits", vocab, *args, **extra)
    tokens, logprobs, errors, seeds, candidates, mu = out
    return SampleResult(tokens, logprobs, _errors(errors), seeds, candidates, mu)


@torch_io
def distribution(logits: np.ndarray, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                 repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                 seed=None, position=0, prompt_ids=None, output_ids=None,
                 token_bitmask=None, params=None, stop_token_ids=None, mirostat_mu=None,
                 sample_index=0, vocab_size: Optional[int] = None):
    """The exact final distribution :func:`sample` draws each row's token from.

    Arguments as :func:`sample` (float16 and bfloat16 logits are widened to float32, which is
    exact). Returns ``(probs, errors)``: ``probs`` float64 ``[batch, row_len]`` (0 at padding
    ids and removed tokens; one-hot for greedy; NaN for a row that failed) and one
    ``None`` or :class:`SamplingError` per row.
    """
    x = _logits_2d(logits)
    if x.dtype.name != "float32":
        x = x.astype(np.float32)
    batch, row_len = x.shape
    vocab = _vocab(vocab_size, row_len)
    args, extra = _call_args(batch, temperature, top_k, top_p, min_p, repetition_penalty,
                             presence_penalty, frequency_penalty, seed, position, sample_index,
                             prompt_ids, output_ids, token_bitmask, params, stop_token_ids,
                             mirostat_mu)
    probs, errors = _core.distribution_f32(x, "logits", vocab, *args, **extra)
    return probs.reshape(batch, row_len), _errors(errors)


from .sampling import (  # noqa: E402  (FlashInfer's names; they use the helpers above)
    chain_speculative_sampling,
    min_p_sampling_from_probs,
    top_k_mask_logits,
    top_k_renorm_probs,
    top_k_sampling_from_probs,
    top_k_top_p_sampling_from_logits,
    top_k_top_p_sampling_from_probs,
    top_p_renorm_probs,
    top_p_sampling_from_probs,
)
from .bitmask import allocate_token_bitmask, apply_token_bitmask_inplace  # noqa: E402
from .chain import SamplerChain  # noqa: E402
from .params import SamplingParams  # noqa: E402
from .grammar import CompiledGrammar, GrammarCompiler, GrammarMatcher  # noqa: E402
from . import npu  # noqa: E402,F401  (nucleus.npu, the Ascend operators)
