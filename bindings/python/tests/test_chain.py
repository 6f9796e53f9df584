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
