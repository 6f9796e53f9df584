"""nucleus.SamplerChain: a fixed-order chain equals nucleus.distribution with the same
parameters; state carries between steps; errors are typed."""

from __future__ import annotations

import numpy as np
import pytest

import nucleus

RNG = np.random.default_rng(3)


def test_a_fixed_order_chain_equals_the_fixed_path():
    logits = RNG.normal(0, 2, size=400).astype(np.float32)
    chain = nucleus.SamplerChain([
        {"temperature": {"t": 0.8}}, {"min_p": {"p": 0.02}}, {"top_k": {"k": 40}},
        {"top_p": {"p": 0.9}}, {"sample": {"seed": 11}}])
    chain.reset([1, 2])
    got = chain.distribution(logits, position=5)
    want, _ = nucleus.distribution(logits, temperature=0.8, min_p=0.02, top_k=40, top_p=0.9)
    # The chain's passes and the fixed path's round differently in f32 (spec: within 1e-6).
    assert np.abs(got - want[0]).max() < 1e-6
    assert np.array_equal(got > 0, want[0] > 0)
    token, logprob = chain.sample(logits, position=5)
    same = nucleus.sample(logits, temperature=0.8, min_p=0.02, top_k=40, top_p=0.9, seed=11,
                          position=5)
    assert token == same.token_ids[0]
    assert abs(logprob - same.logprobs[0]) < 1e-6


def test_penalty_state_carries_between_steps():
    # presence 1.0 on every accepted token: after accepting token 0, its logit drops by 1.
    chain = nucleus.SamplerChain('[{"presence_penalty": {"penalty": 1.0}}, {"greedy": {}}]')
    chain.reset([])
    x = np.array([1.5, 1.0, 0.0], np.float32)
    assert chain.sample(x, position=0)[0] == 0
    chain.accept(0)
    assert chain.output_ids == [0]
    assert chain.sample(x, position=1)[0] == 1  # 0.5 < 1.0
    chain.reset([])
    assert chain.output_ids == [] and chain.sample(x, position=0)[0] == 0


def test_chain_errors():
    with pytest.raises(ValueError, match="JSON"):
        nucleus.SamplerChain("[{")
    with pytest.raises(ValueError):
        nucleus.SamplerChain([{"temperature": {"t": 0.8}}])  # no selection
    chain = nucleus.SamplerChain([{"sample": {"seed": 1}}])
    with pytest.raises(nucleus.SamplingError) as e:
        chain.sample(np.array([np.nan, 1.0], np.float32), position=0)
    assert e.value.kind == "NonFiniteLogits"
    with pytest.raises(ValueError, match="outside"):
        chain.accept(-1)
    with pytest.raises(TypeError):
        chain.accept(1.5)
    with pytest.raises(ValueError, match="one row"):
        chain.sample(np.zeros((2, 3), np.float32), position=0)


def test_from_params_equals_sample_with_params_and_carries_state():
    from nucleus import SamplingParams

    p = SamplingParams(temperature=0.8, top_k=30, repetition_penalty=1.3, dry_multiplier=0.8,
                       xtc_probability=0.5, xtc_threshold=0.05, seed=21)
    chain = nucleus.SamplerChain.from_params(p)
    chain.reset([3, 4])
    out = []
    for step in range(6):
        logits = RNG.normal(0, 2, size=200).astype(np.float32)
        tok, lp = chain.sample(logits, position=2 + step)
        want = nucleus.sample(logits, params=p, prompt_ids=[[3, 4]], output_ids=[out],
                              position=2 + step)
        assert tok == want.token_ids[0] and lp == want.logprobs[0], step
        chain.accept(tok)
        out.append(tok)
    with pytest.raises(ValueError, match="n must be 1"):
        nucleus.SamplerChain.from_params(SamplingParams(n=2))
    with pytest.raises(TypeError):
        nucleus.SamplerChain.from_params({"top_k": 3})
