"""What an adversarial review of the package found, each pinned: threads sharing one bitmask,
logits array or chain; errors that were dropped or escaped as Python's own; refusals that were
silent."""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import nucleus
import nucleus.npu as npu
from nucleus import SamplingParams

RNG = np.random.default_rng(20261207)
TOKENIZER = (Path(__file__).resolve().parents[3].parent / "shared" / "models"
             / "minimind-tokenizer" / "tokenizer.json")


def test_threads_fill_and_apply_rows_of_one_numpy_bitmask():
    compiler = nucleus.GrammarCompiler(TOKENIZER, eos_token_ids=[2])
    grammar = compiler.compile_json_schema({"type": "object"})
    matchers = [nucleus.GrammarMatcher(grammar) for _ in range(16)]
    for i, m in enumerate(matchers):  # different states: i tokens of '{"a": 1' each
        for t in compiler_tokens(compiler)[: i % 4]:
            assert m.accept_token(t)
    want = nucleus.allocate_token_bitmask(16, compiler.vocab_size)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(want, i)
    got = nucleus.allocate_token_bitmask(16, compiler.vocab_size)
    with ThreadPoolExecutor(8) as ex:
        futures = [ex.submit(matchers[i].fill_next_token_bitmask, got, i)
                   for i in range(16) for _ in range(20)]
        for f in futures:
            f.result()  # no "already borrowed"
    np.testing.assert_array_equal(got, want)
    logits = RNG.normal(size=(16, compiler.vocab_size)).astype(np.float32)
    serial = logits.copy()
    for i in range(16):
        nucleus.apply_token_bitmask_inplace(serial, want, indices=[i])
    with ThreadPoolExecutor(8) as ex:
        for f in [ex.submit(nucleus.apply_token_bitmask_inplace, logits, want, indices=[i])
                  for i in range(16) for _ in range(4)]:
            f.result()
    np.testing.assert_array_equal(logits, serial)


def compiler_tokens(compiler):
    # '{', '"', 'a': ids of MiniMind's tokenizer, found by the grammar itself: the first
    # allowed id of each step's mask.
    m = nucleus.GrammarMatcher(compiler.compile_json_schema({"type": "object"}))
    out = []
    row = nucleus.allocate_token_bitmask(1, compiler.vocab_size)
    for _ in range(3):
        m.fill_next_token_bitmask(row)
        bits = row[0].view(np.uint32)
        t = next(w * 32 + b for w in range(bits.size) for b in range(32) if bits[w] >> b & 1)
        out.append(t)
        assert m.accept_token(t)
    return out


def test_threads_share_one_sampler_chain_taking_turns():
    chain = nucleus.SamplerChain([{"temperature": {"t": 0.9}}, {"sample": {"seed": 3}}])
    chain.reset([1, 2, 3])
    row = RNG.normal(size=500).astype(np.float32)
    want = [chain.sample(row, position=p) for p in range(24)]
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda p: chain.sample(row, position=p), range(24)))
    assert got == want


def test_a_chain_copies_its_state_and_refuses_what_it_cannot_return():
    chain = nucleus.SamplerChain([{"presence_penalty": {"penalty": 1.5}}, {"greedy": {}}])
    chain.reset([])
    chain.accept(4)
    twin = copy.copy(chain)
    deep = copy.deepcopy(chain)
    twin.accept(5)
    assert chain.output_ids == [4] and twin.output_ids == [4, 5] and deep.output_ids == [4]
    row = np.zeros(8, np.float32)
    row[4] = row[5] = 1.0
    assert chain.sample(row, position=1)[0] == 5  # 4 penalised in the original only
    assert twin.sample(row, position=2)[0] not in (4, 5)
    with pytest.raises(ValueError, match="sample_index"):
        nucleus.SamplerChain([{"sample": {"seed": 1, "n": 5}}])
    with pytest.raises(ValueError, match="distribution"):
        nucleus.SamplerChain([{"greedy": {"logprobs": 5}}])
    for bad, err in [(-1, ValueError), (2**64, ValueError), ("3", TypeError), (1.7, TypeError)]:
        with pytest.raises(err, match="position"):
            chain.sample(row, position=bad)
    with pytest.raises(ValueError, match="sample_index"):
        chain.sample(row, position=0, sample_index=-1)


def test_speculative_errors_are_returned_with_return_status():
    b, s, v = 3, 2, 10
    q = RNG.dirichlet(np.ones(v), size=(b, s)).astype(np.float32)
    p = RNG.dirichlet(np.ones(v), size=(b, s + 1)).astype(np.float32)
    ids = RNG.integers(0, v, size=(b, s))
    out, acc, emi, errors = nucleus.chain_speculative_sampling(
        q, ids, p, seed=np.arange(b), offset=2**64 - 1, return_status=True)
    assert (out == -1).all()
    assert all(e is not None and e.kind == "InvalidParams" for e in errors)
    ok = nucleus.chain_speculative_sampling(q, ids, p, seed=np.arange(b), offset=0,
                                            return_status=True)
    assert ok[3] == [None] * b
    with pytest.raises(ValueError, match="one count per row"):
        nucleus.chain_speculative_sampling(q, ids, p, seed=np.arange(b), offset=0,
                                           maybe_output_accepted_token_num=np.zeros((b, b),
                                                                                    np.int32))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        nucleus.chain_speculative_sampling(q, np.full((b, s), 2**64 - 1, np.uint64), p,
                                           seed=np.arange(b), offset=0)


def test_integer_ranges_are_nucleus_errors_not_overflow():
    for field in ("min_tokens", "seed", "logprobs", "no_repeat_ngram_size", "min_keep"):
        with pytest.raises(nucleus.SamplingError, match=field) as e:
            SamplingParams(**{field: -1})
        assert e.value.kind == "InvalidParams"
    with pytest.raises(nucleus.SamplingError, match="seed"):
        SamplingParams(seed=2**64)
    with pytest.raises(TypeError, match="seed"):
        SamplingParams(seed=True)
    p = SamplingParams(top_k=np.int64(5), temperature=np.float32(0.5), seed=np.uint64(7))
    assert (p.top_k, p.temperature, p.seed) == (5, 0.5, 7)
    assert type(p.top_k) is int and type(p.seed) is int
    x = np.zeros((2, 40), np.float32)
    with pytest.raises(ValueError, match="vocab_size"):
        nucleus.apply_token_bitmask_inplace(x, nucleus.allocate_token_bitmask(2, 40),
                                            vocab_size=2**70)
    compiler = nucleus.GrammarCompiler(TOKENIZER, eos_token_ids=[2])
    with pytest.raises(ValueError, match="max_whitespace"):
        compiler.compile_json_schema({"type": "object"}, max_whitespace=2**64)
    with pytest.raises(ValueError, match="ks_max"):
        npu.npu_top_k_top_p_sample(x, np.array([1, 1], np.int32), np.ones(2, np.float32),
                                   ks_max=2**64)


def test_params_keep_their_own_containers():
    bias = {3: 1.0}
    words = [[1, 2]]
    p = SamplingParams(logit_bias=bias, bad_words=words)
    bias[3] = float("nan")  # would be invalid; the object keeps what was validated
    words[0].append(-5)
    assert p.logit_bias == {3: 1.0} and p.bad_words == ((1, 2),)
    with pytest.raises(TypeError, match="SamplingParams or a list"):
        nucleus.sample(x := np.zeros((2, 4), np.float32), params={"temperature": 0.5})
    assert x.shape == (2, 4)
    with pytest.raises(TypeError, match="sequence_bias"):
        SamplingParams.from_json('{"sequence_bias": [[1, 2]]}')


def test_renorm_parameters_out_of_range_raise():
    probs = np.full((2, 8), 1 / 8, np.float32)
    with pytest.raises(nucleus.SamplingError, match="top_k"):
        nucleus.top_k_renorm_probs(probs, -3)
    with pytest.raises(nucleus.SamplingError, match="top_p"):
        nucleus.top_p_renorm_probs(probs, 0.0)
    bad = probs.copy()
    bad[1, 0] = np.nan  # a bad row is NaN, the other row renormalised
    out = nucleus.top_k_renorm_probs(bad, 2)
    assert np.isnan(out[1]).all() and np.isclose(out[0].sum(), 1.0)


def test_messages_name_the_real_problem():
    with pytest.raises(ValueError, match="no entries"):
        nucleus.sample(np.zeros((2, 0), np.float32))
    compiler = nucleus.GrammarCompiler(TOKENIZER, eos_token_ids=[2])
    m = nucleus.GrammarMatcher(compiler.compile_regex("[ab]{2}"))
    words = (compiler.vocab_size + 31) // 32
    shared = np.lib.stride_tricks.as_strided(np.zeros(words, np.int32), (3, words), (0, 4))
    with pytest.raises(nucleus.GrammarError, match="overlap") as e:
        m.fill_next_token_bitmask(shared, 1)
    assert e.value.kind == "BitmaskShape"


def test_finalize_routing_k_must_agree_with_the_scales():
    n, k, h = 3, 2, 4
    rows = RNG.normal(size=(n * k, h)).astype(np.float32)
    idx = np.arange(n * k, dtype=np.int32)
    scales = np.full((n, k), 0.5, np.float32)
    a = npu.npu_moe_finalize_routing(rows, None, None, None, scales, idx, None)
    b = npu.npu_moe_finalize_routing(rows, None, None, None, scales, idx, None, k=2)
    np.testing.assert_array_equal(a, b)
    for bad in (0, 5, -3):
        with pytest.raises(ValueError, match="k = "):
            npu.npu_moe_finalize_routing(rows, None, None, None, scales, idx, None, k=bad)


def test_a_tokenizer_path_that_is_not_a_file_is_refused_before_reading():
    for path in ("/dev/zero", str(TOKENIZER.parent)):
        with pytest.raises(nucleus.GrammarError, match="regular file") as e:
            nucleus.GrammarCompiler(path, eos_token_ids=[2])
        assert e.value.kind == "Tokenizer"
