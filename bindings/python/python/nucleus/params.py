"""``nucleus.SamplingParams``: every parameter of the Rust sampler, named as in vLLM and the OpenAI
API (``nucleus_sampling::SamplingParams``; the contract is spec/sampling.md, "Inputs" and
"Extended processors in the fixed path").

It is what ``nucleus sample``'s ``params`` object holds (:meth:`SamplingParams.from_json` reads
that JSON, :meth:`SamplingParams.to_json` writes it), and ``nucleus.sample(logits,
params=...)`` samples with it, one per row or one for all rows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import SamplingError, _core

__all__ = ["SamplingParams"]

_FLOATS = {
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "dry_multiplier", "dry_base", "dynatemp_range", "dynatemp_exponent",
    "typical_p", "top_n_sigma", "epsilon_cutoff", "eta_cutoff", "xtc_threshold",
    "xtc_probability", "mirostat_tau", "mirostat_eta",
}
_INTS = {
    "top_k", "min_tokens", "n", "dry_allowed_length", "dry_penalty_last_n",
    "no_repeat_ngram_size", "min_keep", "mirostat",
}
_OPTIONAL_INTS = {"seed", "logprobs"}
# The integer fields' representable ranges (the Rust types: u64 / usize, u8 for mirostat, u32
# ids); the ranges the sampler allows within them are checked by the crate's validate().
_INT_RANGES = {
    "seed": (0, 2**64 - 1), "min_tokens": (0, 2**64 - 1), "n": (0, 2**64 - 1),
    "logprobs": (0, 2**64 - 1), "dry_allowed_length": (0, 2**64 - 1),
    "no_repeat_ngram_size": (0, 2**64 - 1), "min_keep": (0, 2**64 - 1), "mirostat": (0, 255),
}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters; every field's default is "off" (temperature 1).

    The fields and their ranges are the Rust crate's (``nucleus_sampling::SamplingParams``);
    the order they act in is fixed (spec/sampling.md, "Order of operations"): hard constraints
    (``allowed_token_ids``, ``bad_words``, ``min_tokens``), ``logit_bias``, ``sequence_bias``,
    repetition, frequency and presence penalties, DRY, ``no_repeat_ngram_size``, temperature
    (or the dynamic temperature), ``min_p``, ``top_k``, ``top_p``, ``typical_p``,
    ``top_n_sigma``, ``epsilon_cutoff``, ``eta_cutoff``, XTC, then the draw; ``mirostat`` 1 or 2
    replaces ``min_p`` through the draw.

    - ``temperature`` >= 0 (below 1e-5: greedy); ``top_k`` (0 or -1 off); ``top_p`` in (0, 1];
      ``min_p`` in [0, 1]; ``repetition_penalty`` > 0 (CTRL; prompt and output ids);
      ``presence_penalty``, ``frequency_penalty`` in [-2, 2] (OpenAI; output ids only).
    - ``logit_bias``: ``{token_id: bias}``, biases clamped to [-100, 100];
      ``allowed_token_ids``: ``None`` or a non-empty list; ``bad_words``: token-id sequences
      (vLLM); ``min_tokens``: EOS and ``stop_token_ids`` banned until this many outputs.
    - ``seed``: the request's Philox key (``None``: drawn from the OS; reported back in
      :attr:`nucleus.SampleResult.seeds`).
    - ``n``, ``logprobs``, ``logprobs_kind`` (``"processed"`` or ``"raw"``): as the CLI's.
      :func:`nucleus.sample` draws one token per row: it refuses ``n > 1`` (draw sample
      ``i`` with ``sample_index=i``) and ``logprobs`` (use :func:`nucleus.distribution`).
    - ``sequence_bias``: ``[(ids, bias), ...]`` (Hugging Face); DRY: ``dry_multiplier`` (0 off),
      ``dry_base``, ``dry_allowed_length``, ``dry_penalty_last_n``, ``dry_sequence_breakers``
      (token-id sequences) (llama.cpp); ``no_repeat_ngram_size`` (Hugging Face);
      ``dynatemp_range``, ``dynatemp_exponent`` (llama.cpp); ``typical_p``; ``top_n_sigma``
      (<= 0 off); ``epsilon_cutoff``, ``eta_cutoff`` (Hugging Face); ``xtc_threshold``,
      ``xtc_probability`` (llama.cpp); ``min_keep`` >= 1; ``mirostat`` 0/1/2,
      ``mirostat_tau``, ``mirostat_eta`` (llama.cpp; ``mu`` carried by the caller through
      ``nucleus.sample``'s ``mirostat_mu``).

    Construction checks every range (the crate's ``SamplingParams::validate``) and raises
    :class:`nucleus.SamplingError` of kind ``InvalidParams`` (``row`` ``None``) naming the
    field;
    a field of the wrong type is a ``TypeError``.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = dataclasses.field(default_factory=dict)
    allowed_token_ids: Optional[Sequence[int]] = None
    bad_words: Sequence[Sequence[int]] = ()
    min_tokens: int = 0
    seed: Optional[int] = None
    n: int = 1
    logprobs: Optional[int] = None
    logprobs_kind: str = "processed"
    sequence_bias: Sequence[Tuple[Sequence[int], float]] = ()
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: Sequence[Sequence[int]] = ()
    no_repeat_ngram_size: int = 0
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    xtc_threshold: float = 0.1
    xtc_probability: float = 0.0
    min_keep: int = 1
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in _INTS or (f.name in _OPTIONAL_INTS and v is not None):
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                    raise TypeError(f"SamplingParams.{f.name} must be an int, got {v!r}")
                v = int(v)  # a NumPy integer is the same integer
                lo, hi = _INT_RANGES.get(f.name, (-2**63, 2**63 - 1))
                if not lo <= v <= hi:
                    raise SamplingError("InvalidParams", f"{f.name} = {v} is outside "
                                        f"[{lo}, {hi}]", None)
            elif f.name in _FLOATS:
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer,
                                                                         np.floating)):
                    raise TypeError(f"SamplingParams.{f.name} must be a number, got {v!r}")
                v = float(v)
            object.__setattr__(self, f.name, v)
        # Own copies of the containers, so that the caller's later changes cannot bypass the
        # checks below (and the object stays as validated).
        try:
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))
            for name in ("bad_words", "dry_sequence_breakers"):
                object.__setattr__(self, name, tuple(tuple(s) for s in getattr(self, name)))
            if self.allowed_token_ids is not None:
                object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
            object.__setattr__(self, "sequence_bias",
                               tuple((tuple(ids), b) for ids, b in self.sequence_bias))
        except (TypeError, ValueError) as e:
            raise TypeError(f"SamplingParams: a sequence field has the wrong shape: {e}") from None
        bad = _core.validate_params(self._to_dict())
        if bad is not None:
            raise SamplingError("InvalidParams", bad[1], None)

    def _to_dict(self) -> Dict[str, Any]:
        """The fields as the native module reads them (``src/params.rs``)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        # Containers become lists and dicts; their items are left as given, so that the native
        # module's typed extraction refuses a string or a float id (TypeError naming the field)
        # rather than converting it.
        try:
            d["logit_bias"] = dict(self.logit_bias)
            for name in ("bad_words", "dry_sequence_breakers"):
                d[name] = [list(seq) for seq in d[name]]
            if d["allowed_token_ids"] is not None:
                d["allowed_token_ids"] = list(d["allowed_token_ids"])
            d["sequence_bias"] = [(list(ids), b) for ids, b in d["sequence_bias"]]
        except (TypeError, ValueError) as e:
            raise TypeError(f"SamplingParams: a sequence field has the wrong shape: {e}") from None
        return d

    # --- JSON: `nucleus sample`'s `params` object -----------------------------------------

    @classmethod
    def from_json(cls, value: Union[str, bytes, Mapping[str, Any]]) -> "SamplingParams":
        """Reads ``nucleus sample``'s ``params`` object (JSON text or an already parsed dict).

        As the CLI: fields by name, all optional; ``null`` is a field left out; numbers may be
        the strings ``"-inf"``, ``"inf"``, ``"nan"``; ``logit_bias`` keys are token ids in
        canonical decimal (``"42"``, not ``"042"``); ``sequence_bias`` is ``[[ids, bias],
        ...]``; ``logprobs_kind`` is ``"raw"`` or ``"processed"``.

        Errors: ``ValueError`` for JSON that is not an object, an unknown field, a bad
        ``logit_bias`` key; ``TypeError`` for a value of the wrong type; SamplingError
        ``InvalidParams`` for a value out of range.
        """
        obj = json.loads(value) if isinstance(value, (str, bytes)) else dict(value)
        if not isinstance(obj, dict):
            raise ValueError(f"params must be a JSON object, got {type(obj).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: Dict[str, Any] = {}
        for k, v in obj.items():
            if k not in names:
                raise ValueError(f"params.{k}: unknown field")
            if v is None:
                continue
            if k in _FLOATS:
                v = _lenient(k, v)
            elif k == "logit_bias":
                if not isinstance(v, dict):
                    raise TypeError("params.logit_bias must be an object of token id -> bias")
                v = {_token_key(key): _lenient(f"logit_bias.{key}", b) for key, b in v.items()}
            elif k == "sequence_bias":
                try:
                    v = [(list(ids), _lenient("sequence_bias", b)) for ids, b in v]
                except (TypeError, ValueError) as e:
                    raise TypeError(f"params.sequence_bias must be [[ids, bias], ...]: {e}"
                                    ) from None
            kwargs[k] = v
        return cls(**kwargs)

    def to_json(self) -> str:
        """This object as ``nucleus sample``'s ``params`` JSON (only the fields that differ
        from the defaults; infinities and NaN as strings)."""
        out: Dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v == _DEFAULTS[f.name] and not (isinstance(v, float) and math.isnan(v)):
                continue
            if f.name in _FLOATS:
                v = _json_float(v)
            elif f.name == "logit_bias":
                v = {str(int(t)): _json_float(b) for t, b in dict(v).items()}
            elif f.name == "sequence_bias":
                v = [[list(ids), _json_float(b)] for ids, b in v]
            elif isinstance(v, tuple):
                v = [list(s) if isinstance(s, (tuple, list)) else s for s in v]
            out[f.name] = v
        return json.dumps(out)


_DEFAULTS = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
             for f in dataclasses.fields(SamplingParams)}


def _lenient(name: str, v) -> float:
    if isinstance(v, str):
        if v in ("-inf", "inf", "nan"):
            return float(v)
        raise TypeError(f"params.{name}: expected a number or \"-inf\", \"inf\", \"nan\", got {v!r}")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"params.{name}: expected a number, got {v!r}")
    return float(v)


def _token_key(key: str) -> int:
    if not re.fullmatch(r"0|[1-9][0-9]*", key) or int(key) >= 2**32:
        raise ValueError(f"params.logit_bias: key {key!r} is not a token id in canonical decimal")
    return int(key)


def _json_float(v: float):
    v = float(v)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v
