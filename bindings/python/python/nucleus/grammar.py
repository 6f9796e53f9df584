"""Structured output with XGrammar's names: ``GrammarCompiler``, ``CompiledGrammar`` and
``GrammarMatcher``, on the Rust crate nucleus-grammar (llguidance 1.9: JSON Schema, regular
expressions, Lark grammars).

Prototype followed: ``python/xgrammar/matcher.py`` and ``python/xgrammar/compiler.py`` of
mlc-ai/xgrammar (``GrammarMatcher.fill_next_token_bitmask(bitmask, index=0) -> bool``,
``accept_token(token_id) -> bool``, ``rollback(num_tokens=1)``, ``is_terminated()``,
``reset()``; ``GrammarCompiler.compile_json_schema / compile_regex``) and the C++ behind them
(``cpp/grammar_matcher.cc``: ``AcceptToken`` returns false for an id out of range and after
termination). The masks are llguidance's (``LLMatcher``), bit for bit.

A decode step::

    compiler = nucleus.GrammarCompiler("tokenizer.json", eos_token_ids=[2])
    grammar = compiler.compile_json_schema({"type": "object"})
    matcher = nucleus.GrammarMatcher(grammar)
    bitmask = nucleus.allocate_token_bitmask(1, compiler.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)          # row 0: the allowed ids
    nucleus.apply_token_bitmask_inplace(logits, bitmask)
    token = ...                                       # sample
    matcher.accept_token(token)

Bitmask layout (XGrammar's and llguidance's): int32 ``[batch, ceil(vocab_size / 32)]``, token
``t`` is bit ``t % 32`` of word ``t // 32``, a set bit allows it.

Where nucleus differs from XGrammar (each said again where it applies):

- the grammars are llguidance's: JSON Schema properties are generated in the schema's order,
  and ``compile_lark`` takes llguidance's Lark dialect (there is no EBNF ``compile_grammar``);
- ``compile_json_schema`` bounds whitespace (``max_whitespace``, default 8 characters in a
  row) where XGrammar has ``any_whitespace`` / ``indent`` / ``separators``;
- ``is_terminated()`` is also true before the EOS token once nothing but EOS can follow
  (llguidance's ``is_stopped``, as vLLM's guidance backend maps it); the mask then allows the
  EOS ids only, and after an accepted EOS it is all zero (XGrammar raises there);
- a bitmask row may be wider than ``ceil(vocab_size / 32)`` words (the extra words become 0);
- rollback is not bounded by ``max_rollback_tokens``.
"""

from __future__ import annotations

import json
import operator
import os
from typing import Any, List, Mapping, Optional, Sequence, Union

import numpy as np

from . import GrammarError, _core, _dlpack

__all__ = ["GrammarCompiler", "CompiledGrammar", "GrammarMatcher"]

#: Grammars a compiler keeps by default (nucleus_grammar::GrammarCompiler::DEFAULT_CAPACITY).
DEFAULT_CACHE_SIZE = 1024

#: The default bound on JSON whitespace (nucleus_grammar::DEFAULT_MAX_WHITESPACE).
DEFAULT_MAX_WHITESPACE = 8


def _call(f, *args):
    """``f(*args)``, the core's ``ValueError(kind, message)`` raised as :class:`GrammarError`."""
    try:
        return f(*args)
    except ValueError as e:
        if len(e.args) == 2 and all(isinstance(a, str) for a in e.args):
            kind, message = e.args
            raise GrammarError(kind, message) from None
        raise


def _integer(name: str, value) -> int:
    """``value`` as a Python int; a bool, float or other type is a TypeError."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None


def _eos_ids(eos_token_ids) -> List[int]:
    ids = [eos_token_ids] if not isinstance(eos_token_ids, (list, tuple, np.ndarray)) else list(
        eos_token_ids)
    out = []
    for t in ids:
        t = _integer("eos_token_ids", t)
        if not 0 <= t < 2**32:
            raise GrammarError("TokenOutOfRange", f"EOS token id {t} is outside [0, 2**32)")
        out.append(t)
    return out


def _vocab_size(vocab_size) -> Optional[int]:
    if vocab_size is None:
        return None
    v = _integer("vocab_size", vocab_size)
    if v < 0:
        raise ValueError(f"vocab_size must be >= 0, got {v}")
    return v


def _cache_size(cache_size) -> int:
    c = _integer("cache_size", cache_size)
    if c < 1:
        raise ValueError(f"cache_size must be >= 1, got {c}")
    return c


def _bitmask_rows(bitmask) -> np.ndarray:
    """The bitmask as the 2-D int32 NumPy array that is written in place.

    A PyTorch CPU tensor (or any DLPack producer) is written through a NumPy view of its
    memory (``nucleus._dlpack.to_numpy``: DLPack, no copy; a tensor on another device is a
    ``ValueError`` naming it: XGrammar fills CPU bitmasks only). A 1-D bitmask is one row
    (``[None, :]``, a view).
    """
    if _dlpack._is_dlpack(bitmask):
        bitmask = _dlpack.to_numpy(bitmask)
    if not isinstance(bitmask, np.ndarray):
        raise TypeError(f"bitmask must be an int32 numpy.ndarray or CPU torch.Tensor, got "
                        f"{type(bitmask).__name__}")
    if bitmask.dtype != np.int32:
        raise TypeError(f"bitmask must be int32 (XGrammar's bitmask dtype), got {bitmask.dtype}")
    if not bitmask.dtype.isnative:
        raise TypeError(f"bitmask has non-native byte order ({bitmask.dtype.str})")
    if bitmask.ndim == 1:
        bitmask = bitmask[None, :]
    if bitmask.ndim != 2:
        raise GrammarError("BitmaskShape", f"bitmask must be [batch, words] or [words], got "
                                           f"shape {bitmask.shape}")
    if not bitmask.flags.writeable:
        raise GrammarError("BitmaskShape", "bitmask is read-only: fill_next_token_bitmask "
                                           "writes into it")
    if not bitmask.flags.aligned:
        raise GrammarError("BitmaskShape", "bitmask is not aligned to 4 bytes; copy it "
                                           "(np.ascontiguousarray)")
    if bitmask.shape[1] > 1 and bitmask.strides[1] != 4:
        raise GrammarError("BitmaskShape", f"the bitmask's rows must be contiguous (word stride "
                                           f"{bitmask.strides[1]} bytes, an int32 is 4)")
    return bitmask


class CompiledGrammar:
    """A compiled grammar, made by :class:`GrammarCompiler`; shared by every
    :class:`GrammarMatcher` made from it (each matcher has its own state).

    Attributes
    ----------
    kind : str
        ``"json_schema"``, ``"regex"`` or ``"lark"``.
    warnings : list of str
        llguidance's warnings about the grammar (e.g. a JSON Schema keyword it ignores).
    vocab_size : int
        The vocabulary size the grammar was compiled for.
    """

    def __init__(self, handle: "_core.CompiledGrammar"):
        if not isinstance(handle, _core.CompiledGrammar):
            raise TypeError("a CompiledGrammar is made by GrammarCompiler.compile_*")
        self._handle = handle

    @property
    def kind(self) -> str:
        """``"json_schema"``, ``"regex"`` or ``"lark"``."""
        return self._handle.kind

    @property
    def warnings(self) -> List[str]:
        """llguidance's warnings about the grammar."""
        return self._handle.warnings

    @property
    def vocab_size(self) -> int:
        """The vocabulary size the grammar was compiled for."""
        return self._handle.vocab_size

    @property
    def eos_token_ids(self) -> List[int]:
        """The EOS ids of the compiler."""
        return self._handle.eos_token_ids

    def __repr__(self) -> str:
        return f"CompiledGrammar(kind={self.kind!r}, warnings={len(self.warnings)})"


class GrammarCompiler:
    """Compiles grammars for one tokenizer and caches them (XGrammar's ``GrammarCompiler``).

    Building one reads the tokenizer and builds llguidance's token trie and slicer (tenths of
    a second at a 32k vocabulary, with the GIL released): make one per model and share it
    between threads.

    Parameters
    ----------
    tokenizer : str or os.PathLike
        Path of a Hugging Face ``tokenizer.json`` (byte-level BPE such as GPT-2's, Qwen's or
        MiniMind's, or byte-fallback SentencePiece with the Llama decoder).
    eos_token_ids : int or sequence of int
        The ids that end a generation (at least one), e.g. ``<|im_end|>``: llguidance detects
        only a few EOS names by itself, so they are given explicitly. XGrammar takes them from
        its ``TokenizerInfo`` (``stop_token_ids``).
    vocab_size : int, optional
        Ids of a logits row (the model's LM head), at least the tokenizer's largest id + 1,
        which is the default. Ids past the tokenizer's are never allowed.
    cache_size : int, default 1024
        Compiled grammars kept (least recently used dropped first).

    Raises
    ------
    GrammarError
        ``Tokenizer`` (the file cannot be read or parsed, an unsupported decoder),
        ``VocabTooSmall``, ``NoEosToken``, ``TokenOutOfRange`` (an EOS id at or above the
        vocabulary size), ``TokenTooLong``.
    TypeError
        ``tokenizer`` not a path, an id or size not an integer.
    """

    def __init__(self, tokenizer: Union[str, "os.PathLike[str]"], *,
                 eos_token_ids: Union[int, Sequence[int]], vocab_size: Optional[int] = None,
                 cache_size: int = DEFAULT_CACHE_SIZE):
        try:
            path = os.fsdecode(os.fspath(tokenizer))
        except TypeError:
            raise TypeError(f"tokenizer must be the path of a tokenizer.json (str or "
                            f"os.PathLike), got {type(tokenizer).__name__}; for its text use "
                            f"GrammarCompiler.from_json_str") from None
        self._handle = _call(_core.GrammarCompiler.from_file, path, _eos_ids(eos_token_ids),
                             _vocab_size(vocab_size), _cache_size(cache_size))

    @classmethod
    def from_json_str(cls, text: str, *, eos_token_ids: Union[int, Sequence[int]],
                      vocab_size: Optional[int] = None,
                      cache_size: int = DEFAULT_CACHE_SIZE) -> "GrammarCompiler":
        """A compiler for a ``tokenizer.json`` given as text; arguments and errors as the
        constructor's."""
        if not isinstance(text, str):
            raise TypeError(f"text must be the tokenizer.json text (str), got "
                            f"{type(text).__name__}")
        self = cls.__new__(cls)
        self._handle = _call(_core.GrammarCompiler.from_json_str, text, _eos_ids(eos_token_ids),
                             _vocab_size(vocab_size), _cache_size(cache_size))
        return self

    @property
    def vocab_size(self) -> int:
        """Ids of a logits row: a bitmask row needs ``ceil(vocab_size / 32)`` words."""
        return self._handle.vocab_size

    @property
    def eos_token_ids(self) -> List[int]:
        """The EOS ids, as given."""
        return self._handle.eos_token_ids

    @property
    def compilations(self) -> int:
        """Compilations run so far (cache misses)."""
        return self._handle.compilations

    def clear_cache(self) -> None:
        """Empty the cache (grammars already compiled stay valid)."""
        self._handle.clear_cache()

    def _compile(self, kind: str, text: str, max_whitespace: Optional[int]) -> CompiledGrammar:
        return CompiledGrammar(_call(self._handle.compile, kind, text, max_whitespace))

    def compile_json_schema(self, schema: Union[str, Mapping[str, Any], Any], *,
                            max_whitespace: Optional[int] = DEFAULT_MAX_WHITESPACE
                            ) -> CompiledGrammar:
        """Compile a JSON Schema: the output is JSON that the schema accepts, with object
        properties in the schema's order (llguidance's rule).

        Parameters
        ----------
        schema : str, dict or pydantic model class
            The schema as JSON text, as a dict (serialised with ``json.dumps``, key order
            kept), or a class with ``model_json_schema()`` (pydantic 2, as XGrammar takes).
        max_whitespace : int or None, default 8
            The most whitespace characters allowed in a row between two JSON tokens; 0 allows
            none (compact JSON), ``None`` leaves it unbounded (llguidance's default). A schema
            whose top-level ``x-guidance`` sets ``whitespace_pattern`` or
            ``whitespace_flexible`` keeps its own setting.

        Returns
        -------
        CompiledGrammar

        Raises
        ------
        GrammarError
            ``InvalidSchemaJson`` (text that is not JSON), ``TooDeep``, ``Compile``
            (llguidance's message: an unsupported keyword, a schema no text matches).
        """
        if hasattr(schema, "model_json_schema") and callable(schema.model_json_schema):
            schema = schema.model_json_schema()
        if isinstance(schema, Mapping):
            text = json.dumps(schema)
        elif isinstance(schema, str):
            text = schema
        else:
            raise TypeError(f"schema must be JSON text (str) or a dict, got "
                            f"{type(schema).__name__}")
        if max_whitespace is not None:
            max_whitespace = _integer("max_whitespace", max_whitespace)
            if not 0 <= max_whitespace < 2**32:
                raise ValueError(f"max_whitespace must be in [0, 2**32) or None, got "
                                 f"{max_whitespace}")
        return self._compile("json_schema", text, max_whitespace)

    def compile_regex(self, pattern: str) -> CompiledGrammar:
        """Compile a regular expression (Rust ``regex`` syntax) that the whole output must
        match.

        Raises
        ------
        GrammarError
            ``Compile`` with llguidance's message for a bad pattern.
        """
        if not isinstance(pattern, str):
            raise TypeError(f"pattern must be a str, got {type(pattern).__name__}")
        return self._compile("regex", pattern, None)

    def compile_lark(self, grammar: str) -> CompiledGrammar:
        """Compile a Lark grammar in llguidance's dialect (``start: ...``, regex terminals,
        ``%ignore``, ``%json {...}`` for an embedded JSON Schema).

        Raises
        ------
        GrammarError
            ``Compile`` (a syntax error, with its line) or ``TooDeep``.
        """
        if not isinstance(grammar, str):
            raise TypeError(f"grammar must be a str, got {type(grammar).__name__}")
        return self._compile("lark", grammar, None)

    def __repr__(self) -> str:
        return (f"GrammarCompiler(vocab_size={self.vocab_size}, "
                f"eos_token_ids={self.eos_token_ids})")


class GrammarMatcher:
    """One request's position in a compiled grammar (XGrammar's ``GrammarMatcher``).

    Per step: :meth:`fill_next_token_bitmask`, mask the logits
    (``nucleus.apply_token_bitmask_inplace``), sample, :meth:`accept_token`. The EOS ids are
    allowed exactly when the text so far is complete (:meth:`is_accepting`); accepting one
    terminates the matcher; :meth:`rollback` undoes tokens, an accepted EOS included.

    Parameters
    ----------
    compiled_grammar : CompiledGrammar
    override_stop_tokens : None
        XGrammar's; nucleus takes the EOS ids from the compiler (anything else is a
        NotImplementedError).
    terminate_without_stop_token : bool, default False
        XGrammar's; only False (True is a NotImplementedError).
    max_rollback_tokens : int, default -1
        Accepted for XGrammar's signature and ignored: rollback reaches back to the start.
    """

    def __init__(self, compiled_grammar: CompiledGrammar, *,
                 override_stop_tokens: Optional[Union[int, List[int]]] = None,
                 terminate_without_stop_token: bool = False,
                 max_rollback_tokens: int = -1):
        if not isinstance(compiled_grammar, CompiledGrammar):
            raise TypeError("compiled_grammar must be a CompiledGrammar (GrammarCompiler."
                            "compile_json_schema, compile_regex or compile_lark)")
        if override_stop_tokens is not None:
            raise NotImplementedError("override_stop_tokens: give the EOS ids to "
                                      "GrammarCompiler(eos_token_ids=...)")
        if terminate_without_stop_token:
            raise NotImplementedError("terminate_without_stop_token=True is not supported")
        _integer("max_rollback_tokens", max_rollback_tokens)
        self._grammar = compiled_grammar
        self._handle = _core.GrammarMatcher(compiled_grammar._handle)
        self._vocab_size = compiled_grammar.vocab_size

    @property
    def compiled_grammar(self) -> CompiledGrammar:
        """The grammar this matcher follows."""
        return self._grammar

    @property
    def vocab_size(self) -> int:
        """Bits of a bitmask row in use."""
        return self._vocab_size

    @property
    def stop_token_ids(self) -> List[int]:
        """The EOS ids (XGrammar's name)."""
        return self._handle.eos_token_ids

    @property
    def num_committed(self) -> int:
        """Tokens accepted so far, an accepted EOS included: the most :meth:`rollback` can
        undo."""
        return self._handle.num_committed

    def fill_next_token_bitmask(self, bitmask, index: int = 0) -> bool:
        """Write the tokens allowed next into row ``index`` of ``bitmask``, in place.

        Does not change the matcher's state. Only row ``index`` is written (its every word);
        the other rows are neither read nor written.

        Parameters
        ----------
        bitmask : numpy.ndarray or torch.Tensor
            int32 ``[batch, words]`` (or ``[words]`` with ``index`` 0), writeable, each row's
            words contiguous (any row stride), ``words >= ceil(vocab_size / 32)``
            (``nucleus.allocate_token_bitmask``). A CPU ``torch.Tensor`` is written through
            ``.numpy()`` (shared memory). Bit ``t % 32`` of word ``t // 32`` is set when token
            ``t`` is allowed; bits at or above ``vocab_size`` and extra words are set to 0
            (XGrammar requires exactly ``ceil(vocab_size / 32)`` words).
        index : int, default 0
            The row to fill.

        Returns
        -------
        bool
            Whether the row needs applying: False only when it allows every id below
            ``vocab_size`` (XGrammar's ``need_apply``).

        Raises
        ------
        TypeError
            ``bitmask`` not int32 (XGrammar raises ValueError), not an array, or ``index``
            not an integer.
        GrammarError
            ``BitmaskShape`` (not 1-D/2-D, read-only, words not contiguous, misaligned),
            ``BitmaskIndex`` (``index`` outside the rows), ``BitmaskTooShort``, ``Matcher``
            (llguidance failed; the row is then all zero).
        """
        rows = _bitmask_rows(bitmask)
        i = _integer("index", index)
        if not 0 <= i < rows.shape[0]:
            raise GrammarError("BitmaskIndex", f"index {i} is out of range: the bitmask has "
                                               f"{rows.shape[0]} rows")
        return _call(self._handle.fill_next_token_bitmask, rows, i)

    def accept_token(self, token_id: int) -> bool:
        """Accept one token and advance the grammar.

        As XGrammar's ``AcceptToken`` (cpp/grammar_matcher.cc), the token is refused with
        False, and nothing changes, when the grammar does not allow it here, when the matcher
        has terminated (an EOS was accepted), or when ``token_id`` is out of range
        (``< 0`` or ``>= vocab_size``; XGrammar logs a warning and returns false there).
        :meth:`commit` raises instead, saying why.

        Parameters
        ----------
        token_id : int

        Returns
        -------
        bool
            Whether the token was accepted.

        Raises
        ------
        TypeError
            ``token_id`` not an integer.
        GrammarError
            ``Matcher``: llguidance failed earlier (the matcher is unusable).
        """
        t = _integer("token_id", token_id)
        if not 0 <= t < self._vocab_size:
            return False
        try:
            _call(self._handle.commit, t)
        except GrammarError as e:
            if e.kind in ("TokenRejected", "Ended", "TokenOutOfRange"):
                return False
            raise
        return True

    def commit(self, token_id: int) -> None:
        """Accept one token, or raise why not (nucleus's strict :meth:`accept_token`).

        Raises
        ------
        GrammarError
            ``TokenOutOfRange`` (``token_id < 0`` or ``>= vocab_size``), ``TokenRejected``
            (naming the token and its text; nothing changed), ``Ended`` (an EOS was
            accepted), ``Matcher``.
        TypeError
            ``token_id`` not an integer.
        """
        t = _integer("token_id", token_id)
        if not 0 <= t < 2**32:
            raise GrammarError("TokenOutOfRange", f"token id {t} is out of range: the "
                                                  f"vocabulary has {self._vocab_size} ids")
        _call(self._handle.commit, t)

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids``, from the start, the grammar accepts in a row from here
        (an EOS counts where it is allowed); commits nothing. An id out of range stops the
        count."""
        ids = []
        for t in token_ids:
            t = _integer("token_ids", t)
            if not 0 <= t < self._vocab_size:
                break
            ids.append(t)
        return self._handle.validate_tokens(ids)

    def rollback(self, num_tokens: int = 1) -> None:
        """Undo the last ``num_tokens`` accepted tokens (an accepted EOS included).

        Raises
        ------
        GrammarError
            ``RollbackTooFar`` when ``num_tokens > num_committed`` (nothing is undone).
        ValueError
            ``num_tokens < 0``.
        """
        n = _integer("num_tokens", num_tokens)
        if n < 0:
            raise ValueError(f"num_tokens must be >= 0, got {n}")
        _call(self._handle.rollback, n)

    def reset(self) -> None:
        """Back to the grammar's start state."""
        self._handle.reset()

    def is_terminated(self) -> bool:
        """Whether the matcher takes no more text: an EOS was accepted, or the text is
        complete and nothing can extend it, so that only EOS is allowed (llguidance's
        ``is_stopped``; XGrammar says True only after the EOS)."""
        return self._handle.is_ended()

    def is_accepting(self) -> bool:
        """Whether the text so far is a complete match, so EOS is allowed (llguidance's
        ``is_accepting``); True after an accepted EOS."""
        return self._handle.may_end()

    @property
    def error(self) -> Optional[str]:
        """llguidance's message when the matcher failed (a ``Matcher`` error), else None."""
        return self._handle.error

    def __repr__(self) -> str:
        return (f"GrammarMatcher(kind={self._grammar.kind!r}, num_committed="
                f"{self.num_committed}, terminated={self.is_terminated()})")
