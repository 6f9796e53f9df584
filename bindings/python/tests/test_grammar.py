"""nucleus.GrammarCompiler / GrammarMatcher (XGrammar's names) against llguidance's own Python
package (pinned, requirements-test.txt) on MiniMind's tokenizer: the masks bit for bit at every
step of walks through real JSON Schemas (the shared JSONSchemaBench sample), regular
expressions and Lark grammars, then hand-worked cases, errors and the GIL.

The oracle's tokenizer: llguidance's ``LLTokenizer`` over the token bytes llguidance itself
decodes from the tokenizer.json, with the special tokens the file marks ``"special": true``.
(``LLTokenizer(path)`` marks every added token special, also MiniMind's 15 non-special ones
such as ``<think>``, whose text a grammar then never allows: test_llguidance_path_tokenizer_
differs_only_on_non_special_added_tokens pins that one difference.)
"""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
from pathlib import Path

import llguidance as ll
import llguidance.numpy as lln
import numpy as np
import pytest

import nucleus

# tests -> python -> bindings -> the repository root; the shared folder is beside the root.
SHARED = Path(__file__).resolve().parents[3].parent / "shared"
TOKENIZER = SHARED / "models" / "minimind-tokenizer" / "tokenizer.json"
DATA = SHARED / "data" / "jsonschema-sample"
EOS = [2]  # MiniMind's eos_token, <|im_end|> (tokenizer_config.json)
V = 6400  # MiniMind's ids 0..6399
W = V // 32
VOCAB = json.loads(TOKENIZER.read_text())["model"]["vocab"]  # piece -> id
OPEN_BRACE = VOCAB["{"]


def allowed(row: np.ndarray) -> list:
    """The ids whose bit is set in one int32 bitmask row."""
    bits = np.unpackbits(np.ascontiguousarray(row).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits).tolist()


class _MiniMindTokens:
    """What llguidance.TokenizerWrapper reads: every id's bytes (llguidance's own decoding of
    the tokenizer.json), the ids marked special there, and the Hugging Face tokenizer (inside
    llguidance) for forced text."""

    def __init__(self, path: Path, eos: int, vocab_size: int = V):
        self._hf = ll.LLTokenizer(str(path), eos_token=[eos])
        spec = json.loads(path.read_text())
        self.tokens = [self._hf.decode_bytes([i]) for i in range(self._hf.vocab_size)]
        self.tokens += [b""] * (vocab_size - len(self.tokens))  # padding ids: no bytes
        self.special_token_ids = [a["id"] for a in spec["added_tokens"] if a["special"]]
        self.eos_token_id = eos
        self.bos_token_id = None

    def __call__(self, text):
        return self._hf.tokenize_bytes(text if isinstance(text, bytes) else text.encode())


@pytest.fixture(scope="module")
def tokens():
    return _MiniMindTokens(TOKENIZER, EOS[0])


@pytest.fixture(scope="module")
def oracle(tokens):
    return ll.LLTokenizer(ll.TokenizerWrapper(tokens), eos_token=EOS)


@pytest.fixture(scope="module")
def compiler():
    return nucleus.GrammarCompiler(TOKENIZER, eos_token_ids=EOS)


def walk(compiled, ll_grammar, ll_tok, seed, prefer=(), steps=60, vocab=V):
    """Walks one completion, both matchers in step: at each step the two masks must be equal
    bit for bit, and is_accepting / termination too; the next token is the preferred one
    while allowed, else a random allowed one (EOS now and then where allowed). Every few
    steps a random disallowed token must be refused by both. Returns the steps compared."""
    m = nucleus.GrammarMatcher(compiled)
    lm = ll.LLMatcher(ll_tok, ll_grammar, log_level=0)
    assert not lm.is_error(), lm.get_error()
    rng = np.random.default_rng(seed)
    ours = nucleus.allocate_token_bitmask(1, vocab)
    theirs = lln.allocate_token_bitmask(1, vocab)
    prefer = list(prefer)
    finished = False  # the preferred text was taken to its end: EOS next where allowed
    for step in range(steps):
        need_apply = m.fill_next_token_bitmask(ours)
        lln.fill_next_token_bitmask(lm, theirs)
        if not np.array_equal(ours, theirs):
            diff = allowed(ours[0] ^ theirs[0])
            pytest.fail(f"step {step}: masks differ at ids {diff[:10]} "
                        f"({ll_tok.dbg_tokens(diff[:5])})")
        ids = allowed(ours[0])
        assert need_apply == (len(ids) < vocab)
        assert m.is_accepting() == lm.is_accepting(), step
        assert m.is_terminated() == lm.is_stopped(), step
        assert m.num_committed == step
        assert ids, f"step {step}: nothing allowed"
        if step % 4 == 0 and len(ids) < vocab:
            bad = int(rng.choice(np.setdiff1d(np.arange(vocab), ids)))
            assert lm.validate_tokens([bad]) == 0
            assert m.accept_token(bad) is False
        eos = [e for e in EOS if e in ids]
        if prefer and prefer[0] in ids:
            t = prefer.pop(0)
            finished = not prefer
        elif eos and (finished or step == steps - 1 or rng.random() < 0.05):
            t = eos[0]
        else:
            prefer = []
            t = int(rng.choice(ids))
        assert m.accept_token(t) is True
        assert lm.consume_token(t), lm.get_error()
        if t in EOS:
            assert m.is_terminated() and lm.is_stopped()
            m.fill_next_token_bitmask(ours)
            assert not ours.any()  # after EOS nothing is allowed
            return step + 1
    return steps


# --- bit for bit against llguidance -------------------------------------------------------

SCHEMA_FILES = sorted(DATA.glob("*/*.json"))


def test_the_shared_sample_is_there():
    # The data README's 61 files (49 schemas, 12 with test instances): a missing shared folder
    # fails here rather than skipping the comparison.
    assert len(SCHEMA_FILES) == 61, DATA
    assert len([p for p in SCHEMA_FILES if p.parent.name == "maskbench_with_tests"]) == 12


@pytest.mark.parametrize("path", SCHEMA_FILES, ids=[p.name for p in SCHEMA_FILES])
def test_json_schema_masks_match_llguidance(path, compiler, oracle, tokens):
    doc = json.loads(path.read_text())
    instances = []
    if path.parent.name == "maskbench_with_tests":
        schema = doc["schema"]
        instances = [json.dumps(t["data"]) for t in doc["tests"] if t["valid"]][:2]
    else:
        schema = doc
    text = json.dumps(schema)
    ll_grammar = ll.LLMatcher.grammar_from_json_schema(text)
    ll_error = ll.LLMatcher.validate_grammar(ll_grammar, oracle)
    if ll_error:
        # llguidance refuses it (oneOf, uniqueItems, an unknown format...): so does nucleus,
        # with llguidance's message.
        with pytest.raises(nucleus.GrammarError) as e:
            compiler.compile_json_schema(text, max_whitespace=None)
        assert e.value.kind == "Compile"
        assert ll_error.splitlines()[0][:40] in e.value.message
        return
    compiled = compiler.compile_json_schema(text, max_whitespace=None)
    assert compiled.kind == "json_schema"
    compared = 0
    for seed, instance in enumerate(instances):
        # A valid test instance, token by token (its canonical tokens), then EOS: every one
        # allowed by both (up to 200 steps).
        prefer = tokens(instance)
        n = walk(compiled, ll_grammar, oracle, seed, prefer, steps=200)
        assert n == min(len(prefer) + 1, 200)
    for seed in range(2):
        compared += walk(compiled, ll_grammar, oracle, 10 + seed)
    assert compared >= 8


GRAMMARS = {
    "regex_phone": ("regex", r"\d{3}-[a-z]+(\.[a-z]{2,3})?"),
    "regex_choice": ("regex", r"(yes|no|maybe)( because [a-z ]{1,20})?"),
    "regex_quoted": ("regex", r'"[^"]*"'),
    "lark_arith": ("lark", 'start: expr\nexpr: term (("+" | "-") term)*\n'
                           'term: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/\n'),
    "lark_json": ("lark", 'start: "Answer: " obj\nobj: %json {"type": "object", "properties": '
                          '{"a": {"type": "integer"}, "b": {"type": "string"}}, '
                          '"required": ["a", "b"]}\n'),
    "lark_ignore": ("lark", 'start: item ("," item)*\nitem: WORD | NUM\nWORD: /[a-z]+/\n'
                            'NUM: /[0-9]+/\n%ignore /[ \\t]+/\n'),
}


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_regex_and_lark_masks_match_llguidance(name, compiler, oracle):
    kind, text = GRAMMARS[name]
    if kind == "regex":
        compiled, ll_grammar = compiler.compile_regex(text), ll.LLMatcher.grammar_from_regex(text)
    else:
        compiled, ll_grammar = compiler.compile_lark(text), ll.LLMatcher.grammar_from_lark(text)
    assert compiled.kind == kind
    assert sum(walk(compiled, ll_grammar, oracle, seed) for seed in range(6)) >= 12


@pytest.mark.parametrize("max_whitespace,options", [
    (0, {"whitespace_flexible": False}),
    (3, {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,3}"}),
])
def test_max_whitespace_is_llguidances_whitespace_option(max_whitespace, options, compiler,
                                                         oracle):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "tags": {"type": "array",
                                                        "items": {"type": "integer"}}},
              "required": ["name", "tags"]}
    compiled = compiler.compile_json_schema(schema, max_whitespace=max_whitespace)
    ll_grammar = ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
    assert sum(walk(compiled, ll_grammar, oracle, seed) for seed in range(6)) >= 12
    # ... and differs from the unbounded grammar: after "{", whitespace of 4+ is allowed there.
    unbounded = compiler.compile_json_schema(schema, max_whitespace=None)
    masks = []
    for g in (compiled, unbounded):
        m = nucleus.GrammarMatcher(g)
        b = nucleus.allocate_token_bitmask(1, V)
        m.fill_next_token_bitmask(b)
        assert allowed(b[0]) == [OPEN_BRACE]  # no whitespace before the value
        assert m.accept_token(OPEN_BRACE)
        m.fill_next_token_bitmask(b)
        masks.append(b.copy())
    assert not np.array_equal(masks[0], masks[1])


def test_a_padded_vocabulary_matches_llguidance():
    vocab = 6410  # a padded LM head: ids 6400..6409 have no bytes
    ours = nucleus.GrammarCompiler(TOKENIZER, eos_token_ids=EOS, vocab_size=vocab)
    assert ours.vocab_size == vocab
    padded = _MiniMindTokens(TOKENIZER, EOS[0], vocab)
    theirs = ll.LLTokenizer(ll.TokenizerWrapper(padded), eos_token=EOS)
    assert theirs.vocab_size == vocab
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "number"}}})
    compiled = ours.compile_json_schema(schema, max_whitespace=None)
    ll_grammar = ll.LLMatcher.grammar_from_json_schema(schema)
    assert sum(walk(compiled, ll_grammar, theirs, s, vocab=vocab) for s in range(4)) >= 8
    m = nucleus.GrammarMatcher(compiled)
    b = np.full((1, 201), -1, np.int32)
    assert m.fill_next_token_bitmask(b) is True
    assert not set(allowed(b[0])) & set(range(6400, 201 * 32))


def test_llguidance_path_tokenizer_differs_only_on_non_special_added_tokens(compiler):
    # MiniMind's added tokens 21..35 (<tool_call>, <think>, <|buffer1|>, ...) are marked
    # "special": false: nucleus allows their text where text may go, LLTokenizer(path) never.
    spec = json.loads(TOKENIZER.read_text())
    non_special = sorted(a["id"] for a in spec["added_tokens"] if not a["special"])
    assert non_special == list(range(21, 36))
    by_path = ll.LLTokenizer(str(TOKENIZER), eos_token=EOS)
    assert all(by_path.is_special_token(t) for t in non_special)
    rx = r'"[^"]*"'
    m = nucleus.GrammarMatcher(compiler.compile_regex(rx))
    lm = ll.LLMatcher(by_path, ll.LLMatcher.grammar_from_regex(rx))
    quote = by_path.tokenize_str('"')
    assert len(quote) == 1
    assert m.accept_token(quote[0]) and lm.consume_token(quote[0])
    ours, theirs = nucleus.allocate_token_bitmask(1, V), lln.allocate_token_bitmask(1, V)
    m.fill_next_token_bitmask(ours)
    lln.fill_next_token_bitmask(lm, theirs)
    only_ours = set(allowed(ours[0])) - set(allowed(theirs[0]))
    assert only_ours == set(non_special)
    assert set(allowed(theirs[0])) <= set(allowed(ours[0]))


# --- worked cases -------------------------------------------------------------------------

def test_ab_regex_by_hand(compiler):
    # [ab]{2} on MiniMind: the vocabulary has "a" (100), "b" (101) and "ab" (572), not "aa",
    # "ba" or "bb"; so first a, b or ab; after "a" one of a, b; after "ab" only EOS.
    assert (VOCAB["a"], VOCAB["b"], VOCAB["ab"]) == (100, 101, 572)
    assert not {"aa", "ba", "bb"} & set(VOCAB)
    g = compiler.compile_regex("[ab]{2}")
    m = nucleus.GrammarMatcher(g)
    b = nucleus.allocate_token_bitmask(1, V)
    assert m.fill_next_token_bitmask(b) is True
    assert allowed(b[0]) == [100, 101, 572]
    assert not m.is_accepting() and not m.is_terminated()
    assert m.accept_token(100) is True  # "a"
    m.fill_next_token_bitmask(b)
    assert allowed(b[0]) == [100, 101]
    assert m.accept_token(572) is False  # "aab" is too long: refused, nothing changes
    assert m.num_committed == 1
    assert m.accept_token(101) is True  # "ab"
    m.fill_next_token_bitmask(b)
    assert allowed(b[0]) == [2]
    assert m.is_accepting() and m.is_terminated()  # complete; only EOS can follow
    assert m.accept_token(100) is False
    assert m.accept_token(2) is True
    assert m.is_terminated() and m.num_committed == 3
    assert m.fill_next_token_bitmask(b) is True
    assert not b.any()
    assert m.accept_token(2) is False  # terminated: XGrammar refuses every token


def test_eos_handling_with_two_eos_ids():
    c = nucleus.GrammarCompiler(TOKENIZER, eos_token_ids=[2, 0])
    assert c.eos_token_ids == [2, 0]
    m = nucleus.GrammarMatcher(c.compile_regex("a+"))
    assert m.stop_token_ids == [2, 0]
    b = nucleus.allocate_token_bitmask(1, V)
    m.fill_next_token_bitmask(b)
    assert 0 not in allowed(b[0]) and 2 not in allowed(b[0])
    assert m.accept_token(0) is False  # EOS before the text is complete
    assert m.accept_token(100) is True
    m.fill_next_token_bitmask(b)
    ids = allowed(b[0])
    assert {0, 2, 100} <= set(ids) and m.is_accepting() and not m.is_terminated()
    assert m.accept_token(0) is True  # either EOS ends it
    assert m.is_terminated()
    m.rollback()  # re-opens it
    assert not m.is_terminated() and m.num_committed == 1
    m.fill_next_token_bitmask(b)
    assert allowed(b[0]) == ids


def test_rollback_restores_the_exact_masks_and_reset_the_start(compiler):
    schema = {"type": "object", "properties": {"id": {"type": "integer"},
                                               "name": {"type": "string"}},
              "required": ["id", "name"]}
    m = nucleus.GrammarMatcher(compiler.compile_json_schema(schema))
    rng = np.random.default_rng(5)
    b = nucleus.allocate_token_bitmask(1, V)
    masks = []
    for _ in range(12):
        m.fill_next_token_bitmask(b)
        masks.append(b.copy())
        ids = [t for t in allowed(b[0]) if t not in EOS]
        assert m.accept_token(int(rng.choice(ids)))
    assert m.num_committed == 12
    m.rollback(3)
    assert m.num_committed == 9
    m.fill_next_token_bitmask(b)
    assert np.array_equal(b, masks[9])
    for k in range(8, -1, -1):
        m.rollback()
        m.fill_next_token_bitmask(b)
        assert np.array_equal(b, masks[k]), k
    assert m.num_committed == 0
    with pytest.raises(nucleus.GrammarError) as e:
        m.rollback()
    assert e.value.kind == "RollbackTooFar" and "only 0 are committed" in e.value.message
    assert m.accept_token(allowed(masks[0][0])[0])
    m.reset()
    assert m.num_committed == 0
    m.fill_next_token_bitmask(b)
    assert np.array_equal(b, masks[0])


def test_a_rejected_token_changes_nothing(compiler):
    m = nucleus.GrammarMatcher(compiler.compile_regex(r"\d{3}"))
    b = nucleus.allocate_token_bitmask(1, V)
    m.fill_next_token_bitmask(b)
    before = b.copy()
    a = VOCAB["a"]
    assert a not in allowed(before[0])
    assert m.accept_token(a) is False
    assert m.accept_token(V) is False and m.accept_token(-1) is False  # out of range: XGrammar
    assert m.num_committed == 0 and not m.is_terminated()
    m.fill_next_token_bitmask(b)
    assert np.array_equal(b, before)
    with pytest.raises(nucleus.GrammarError) as e:
        m.commit(a)
    assert e.value.kind == "TokenRejected"
    assert '"a"' in e.value.message and f"token {a}" in e.value.message
    assert m.validate_tokens([a]) == 0


def test_the_fill_writes_only_its_row_and_zeroes_extra_words(compiler):
    m = nucleus.GrammarMatcher(compiler.compile_regex("[ab]{2}"))
    b = np.full((3, W + 3), 0x5A5A5A5A, np.int32)
    m.fill_next_token_bitmask(b, 1)
    assert np.all(b[[0, 2]] == 0x5A5A5A5A)
    assert allowed(b[1]) == [100, 101, 572] and not b[1, W:].any()
    # A row of a strided batch (big[:, :W]) and a 1-D row are written in place.
    big = np.full((2, W + 8), 7, np.int32)
    m.fill_next_token_bitmask(big[:, :W], 1)
    assert allowed(big[1, :W]) == [100, 101, 572] and np.all(big[1, W:] == 7)
    assert np.all(big[0] == 7)
    one = np.zeros(W, np.int32)
    m.fill_next_token_bitmask(one)
    assert allowed(one) == [100, 101, 572]


def test_a_dlpack_bitmask_is_written_through_it(compiler):
    # Any DLPack producer (torch.Tensor in tests/test_torch.py): here nucleus's own export of a
    # NumPy array, so the write must go through the shared memory to reach `a`.
    a = np.zeros((2, W), np.int32)
    t = nucleus._core.DlpackView(a, "int32")
    m = nucleus.GrammarMatcher(compiler.compile_regex("[ab]{2}"))
    assert m.fill_next_token_bitmask(t, index=1) is True
    assert allowed(a[1]) == [100, 101, 572] and not a[0].any()


def test_all_allowed_needs_no_apply():
    # A vocabulary of one byte token each, every one allowed by a regex of any bytes: only
    # XGrammar's need_apply=False case, the all-ones row. MiniMind's special tokens are never
    # text, so a real tokenizer never gets there; a two-token vocabulary does.
    text = json.dumps({
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": 1, "content": "<|e|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                                              "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {"a": 0}, "merges": []}})
    c = nucleus.GrammarCompiler.from_json_str(text, eos_token_ids=[1])
    assert c.vocab_size == 2
    m = nucleus.GrammarMatcher(c.compile_regex("a*"))
    b = nucleus.allocate_token_bitmask(1, 2)
    assert m.fill_next_token_bitmask(b) is False  # "a" and EOS: every id
    assert allowed(b[0]) == [0, 1]
    m2 = nucleus.GrammarMatcher(c.compile_regex("a+"))
    assert m2.fill_next_token_bitmask(b) is True and allowed(b[0]) == [0]


def test_compiler_caches_and_properties(compiler):
    c = nucleus.GrammarCompiler(TOKENIZER, eos_token_ids=2, cache_size=2)
    assert c.vocab_size == V and c.eos_token_ids == [2]
    g1 = c.compile_regex("x+")
    c.compile_regex("x+")
    assert c.compilations == 1
    c.compile_json_schema({"type": "integer"})
    c.compile_json_schema('{"type": "integer"}', max_whitespace=None)  # another key
    assert c.compilations == 3
    assert g1.warnings == [] and g1.vocab_size == V
    same = nucleus.GrammarCompiler.from_json_str(TOKENIZER.read_text(), eos_token_ids=[2])
    a, b = nucleus.allocate_token_bitmask(1, V), nucleus.allocate_token_bitmask(1, V)
    nucleus.GrammarMatcher(g1).fill_next_token_bitmask(a)
    nucleus.GrammarMatcher(same.compile_regex("x+")).fill_next_token_bitmask(b)
    assert np.array_equal(a, b)
    assert nucleus.GrammarCompiler(Path(os.path.relpath(TOKENIZER)), eos_token_ids=[2])


# --- errors -------------------------------------------------------------------------------

def _raises(kind, f, *args, **kw):
    with pytest.raises(nucleus.GrammarError) as e:
        f(*args, **kw)
    assert e.value.kind == kind, (e.value.kind, e.value.message)
    assert isinstance(e.value, nucleus.NucleusError) and isinstance(e.value, ValueError)
    return e.value.message


def test_grammar_errors(compiler):
    msg = _raises("InvalidSchemaJson", compiler.compile_json_schema, '{"type": ')
    assert "not valid JSON" in msg and "line 1 column" in msg
    msg = _raises("Compile", compiler.compile_json_schema,
                  {"type": "array", "uniqueItems": True})
    assert "Unimplemented keys" in msg and "uniqueItems" in msg
    msg = _raises("Compile", compiler.compile_regex, "(ab")
    assert "regular expression does not compile" in msg and "unclosed group" in msg
    msg = _raises("Compile", compiler.compile_lark, "start: foo\n")
    assert "Lark grammar does not compile" in msg and "foo" in msg
    deep = '{"type": "array", "items": ' * 1200 + "{}" + "}" * 1200
    msg = _raises("TooDeep", compiler.compile_json_schema, deep)
    assert "nests too deeply" in msg and "the limit is 1000" in msg
    with pytest.raises(TypeError, match="schema"):
        compiler.compile_json_schema(3)
    with pytest.raises(ValueError, match="max_whitespace"):
        compiler.compile_json_schema("{}", max_whitespace=-1)
    with pytest.raises(TypeError, match="max_whitespace"):
        compiler.compile_json_schema("{}", max_whitespace=2.0)


def test_tokenizer_errors(tmp_path):
    msg = _raises("Tokenizer", nucleus.GrammarCompiler, tmp_path / "missing.json",
                  eos_token_ids=[2])
    assert "missing.json" in msg and "No such file" in msg
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "tokenizer.json" in _raises("Tokenizer", nucleus.GrammarCompiler, bad,
                                       eos_token_ids=[2])
    _raises("Tokenizer", nucleus.GrammarCompiler.from_json_str, "[]", eos_token_ids=[2])
    _raises("NoEosToken", nucleus.GrammarCompiler, TOKENIZER, eos_token_ids=[])
    msg = _raises("TokenOutOfRange", nucleus.GrammarCompiler, TOKENIZER, eos_token_ids=[V])
    assert f"token id {V}" in msg
    msg = _raises("VocabTooSmall", nucleus.GrammarCompiler, TOKENIZER, eos_token_ids=[2],
                  vocab_size=100)
    assert "6400" in msg
    with pytest.raises(TypeError, match="tokenizer"):
        nucleus.GrammarCompiler(3, eos_token_ids=[2])
    with pytest.raises(TypeError, match="eos_token_ids"):
        nucleus.GrammarCompiler(TOKENIZER, eos_token_ids=[2.0])


def test_bitmask_and_token_errors(compiler):
    m = nucleus.GrammarMatcher(compiler.compile_regex("[ab]{2}"))
    with pytest.raises(TypeError, match="int32"):
        m.fill_next_token_bitmask(np.zeros((1, W), np.int64))
    with pytest.raises(TypeError, match="int32"):
        m.fill_next_token_bitmask(np.zeros((1, W), np.uint32))
    with pytest.raises(TypeError, match="numpy"):
        m.fill_next_token_bitmask([[0] * W])
    _raises("BitmaskShape", m.fill_next_token_bitmask, np.zeros((1, 1, W), np.int32))
    narrow = np.full((2, W - 1), 9, np.int32)
    msg = _raises("BitmaskTooShort", m.fill_next_token_bitmask, narrow, 1)
    assert f"{W - 1} words" in msg and f"at least {W}" in msg
    assert np.all(narrow == 9)  # nothing written
    wide = np.full((2, 2 * W), 9, np.int32)
    msg = _raises("BitmaskShape", m.fill_next_token_bitmask, wide[:, ::2])
    assert "contiguous" in msg and np.all(wide == 9)
    ro = np.zeros((1, W), np.int32)
    ro.flags.writeable = False
    assert "read-only" in _raises("BitmaskShape", m.fill_next_token_bitmask, ro)
    rows = np.full((2, W), 9, np.int32)
    assert "2 rows" in _raises("BitmaskIndex", m.fill_next_token_bitmask, rows, 2)
    _raises("BitmaskIndex", m.fill_next_token_bitmask, rows, -1)
    assert np.all(rows == 9)
    with pytest.raises(TypeError, match="index"):
        m.fill_next_token_bitmask(rows, 0.0)
    msg = _raises("TokenOutOfRange", m.commit, V)
    assert f"token id {V} is out of range" in msg and f"{V} ids" in msg
    _raises("TokenOutOfRange", m.commit, -1)
    _raises("TokenOutOfRange", m.commit, 2**40)
    with pytest.raises(TypeError, match="token_id"):
        m.accept_token(100.0)
    with pytest.raises(TypeError, match="token_id"):
        m.accept_token(True)
    with pytest.raises(ValueError, match="num_tokens"):
        m.rollback(-1)
    assert m.num_committed == 0
    assert m.commit(572) is None
    _raises("Ended", lambda: (m.commit(2), m.commit(2)))
    with pytest.raises(TypeError, match="CompiledGrammar"):
        nucleus.GrammarMatcher("[ab]{2}")
    with pytest.raises(NotImplementedError, match="override_stop_tokens"):
        nucleus.GrammarMatcher(compiler.compile_regex("a"), override_stop_tokens=[0])


def test_grammar_error_pickles():
    e = nucleus.GrammarError("Compile", "regular expression does not compile: x")
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is nucleus.GrammarError
    assert (e2.kind, e2.message, str(e2)) == (e.kind, e.message, e.message)


def test_threads_sharing_one_matcher_take_turns(compiler):
    m = nucleus.GrammarMatcher(compiler.compile_json_schema({"type": "object"}))
    want = nucleus.allocate_token_bitmask(1, V)
    m.fill_next_token_bitmask(want)
    bad = []

    def fill(row):
        b = nucleus.allocate_token_bitmask(2, V)
        for _ in range(300):
            m.fill_next_token_bitmask(b, row)
            if not np.array_equal(b[row], want[0]):
                bad.append(row)

    threads = [threading.Thread(target=fill, args=(i % 2,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []


# --- the GIL ------------------------------------------------------------------------------

def test_another_thread_runs_while_grammars_compile():
    schema = {"type": "object",
              "properties": {f"field_{i}": {"type": ["string", "integer", "null"]}
                             for i in range(1500)}}
    ticks = 0
    done = threading.Event()

    def count():
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            time.sleep(0)

    t = threading.Thread(target=count)
    t.start()
    time.sleep(0.01)
    start_ticks = ticks
    start = time.perf_counter()
    c = nucleus.GrammarCompiler(TOKENIZER, eos_token_ids=EOS)
    g = c.compile_json_schema(schema, max_whitespace=None)
    elapsed = time.perf_counter() - start
    during = ticks - start_ticks
    done.set()
    t.join()
    assert g.kind == "json_schema"
    # Holding the GIL would let the counter advance only at the switch interval's edges.
    assert elapsed > 0.05, elapsed
    assert during > 100, (during, elapsed)
