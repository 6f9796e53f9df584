"""nucleus.SamplingParams and nucleus.sample's params / token_bitmask / stop_token_ids /
mirostat_mu: defaults against the Rust crate's ``SamplingParams::default()``, every extended
parameter against the Rust CLI (``nucleus sample``, the same JSON ``params`` object) token for
token, the bitmask against masking the logits first, typed errors."""

from __future__ import annotations

import json
import math
import os
import subprocess

import numpy as np
import pytest

import nucleus
from nucleus import SamplingParams, _core

RNG = np.random.default_rng(20261204)
CLI = os.path.join(os.path.dirname(__file__), "..", "..", "..", "target", "debug", "nucleus")
needs_cli = pytest.mark.skipif(not os.path.exists(CLI), reason="target/debug/nucleus not built")


def _plain(v):
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def test_defaults_are_the_crates():
    ours = _plain(SamplingParams()._to_dict())
    rust = _plain(dict(_core.default_params()))
    assert ours == rust
    assert len(ours) == 34


def test_values_out_of_range_and_wrong_types():
    for field, value in [("top_p", 2.0), ("top_p", 0.0), ("temperature", -1.0), ("top_k", -2),
                         ("min_keep", 0), ("mirostat", 3), ("typical_p", 0.0), ("n", 0),
                         ("presence_penalty", 2.5), ("dry_base", 0.5),
                         ("allowed_token_ids", [])]:
        with pytest.raises(nucleus.SamplingError) as e:
            SamplingParams(**{field: value})
        assert e.value.kind == "InvalidParams" and e.value.row is None
        assert field in str(e.value), (field, str(e.value))
    for field, value in [("top_k", 1.5), ("top_p", "0.9"), ("temperature", True),
                         ("n", None)]:
        with pytest.raises(TypeError, match=field):
            SamplingParams(**{field: value})
    with pytest.raises(TypeError, match="bad_words"):
        SamplingParams(bad_words=[["a"]])


def test_params_equal_the_keywords():
    x = RNG.normal(size=(6, 300)).astype(np.float32) * 3
    kw = dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
              presence_penalty=0.5, frequency_penalty=0.25)
    out_ids = [[1, 2, 2], [5], [], [7, 7, 7], [0], [299]]
    a = nucleus.sample(x, **kw, seed=11, position=4, output_ids=out_ids)
    b = nucleus.sample(x, params=SamplingParams(**kw, seed=11), position=4, output_ids=out_ids)
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert list(b.seeds) == [11] * 6
    pa, _ = nucleus.distribution(x, **kw, output_ids=out_ids)
    pb, _ = nucleus.distribution(x, params=SamplingParams(**kw), output_ids=out_ids)
    np.testing.assert_array_equal(pa, pb)


EXTENDED = [
    {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2,
     "dry_sequence_breakers": [[3]]},
    {"xtc_threshold": 0.05, "xtc_probability": 1.0, "seed": 5},
    {"typical_p": 0.7, "min_keep": 3},
    {"top_n_sigma": 1.5, "temperature": 0.7},
    {"epsilon_cutoff": 0.003, "eta_cutoff": 0.002},
    {"dynatemp_range": 0.5, "dynatemp_exponent": 1.5},
    {"mirostat": 2, "mirostat_tau": 4.0, "mirostat_eta": 0.2},
    {"mirostat": 1},
    {"logit_bias": {"4": 5.0, "9": -50}, "allowed_token_ids": [1, 4, 9, 16, 25, 36]},
    {"bad_words": [[4], [1, 2]], "min_tokens": 10, "no_repeat_ngram_size": 2},
    {"sequence_bias": [[[2, 3], 4.0], [[7], -2.0]], "repetition_penalty": 1.3},
    {"logprobs_kind": "raw", "temperature": 0.5},
]


@needs_cli
def test_every_extended_parameter_equals_the_cli():
    vocab = 64
    rows, params, outs = [], [], []
    for i, p in enumerate(EXTENDED * 2):
        logits = (RNG.normal(size=vocab) * 2).astype(np.float32)
        output_ids = [int(t) for t in RNG.integers(0, 8, size=6)]
        p = dict(p, seed=1000 + i) if "seed" not in p else p
        rows.append({"logits": [float(v) for v in logits], "params": p, "prompt_ids": [2, 3],
                     "output_ids": output_ids, "position": 8 + i, "eos_token_ids": [0]})
        params.append(SamplingParams.from_json(json.dumps(p)))
        outs.append((logits, output_ids))
    lines = "\n".join(json.dumps(r) for r in rows) + "\n"
    res = subprocess.run([CLI, "sample"], input=lines, capture_output=True, text=True,
                         check=True)
    answers = [json.loads(line) for line in res.stdout.splitlines()]
    x = np.stack([o[0] for o in outs])
    got = nucleus.sample(x, params=params, prompt_ids=[[2, 3]] * len(rows),
                         output_ids=[o[1] for o in outs],
                         position=np.arange(len(rows)) + 8, stop_token_ids=[[0]] * len(rows))
    for i, ans in enumerate(answers):
        assert "error" not in ans, (i, ans)
        assert got.errors[i] is None
        assert int(got.token_ids[i]) == ans["tokens"][0], (i, EXTENDED[i % len(EXTENDED)])
        want_lp = ans["logprobs"][0]
        want_lp = -math.inf if want_lp == "-inf" else want_lp
        assert float(got.logprobs[i]) == want_lp, i
        assert int(got.seeds[i]) == ans["seed"]


def test_mirostat_mu_is_carried_by_the_caller():
    x = (RNG.normal(size=(1, 200)) * 2).astype(np.float32)
    p = SamplingParams(mirostat=2, mirostat_tau=3.0, mirostat_eta=0.25, seed=9)
    first = nucleus.sample(x, params=p, position=0)
    assert math.isfinite(first.mirostat_mu[0])
    # NaN is "no mu yet": the start value 2 * tau, the same as passing nothing.
    same = nucleus.sample(x, params=p, position=0, mirostat_mu=[float("nan")])
    assert same.mirostat_mu[0] == first.mirostat_mu[0]
    start = nucleus.sample(x, params=p, position=0, mirostat_mu=[6.0])
    assert start.mirostat_mu[0] == first.mirostat_mu[0]
    # Mirostat v2's update (Basu et al. 2021; llama.cpp): mu - eta * (surprise - tau), the
    # surprise -log2 p of the token under the truncated distribution it was drawn from.
    surprise = -first.logprobs[0] / math.log(2)
    assert math.isclose(first.mirostat_mu[0], 6.0 - 0.25 * (surprise - 3.0), rel_tol=1e-12)
    second = nucleus.sample(x, params=p, position=1, mirostat_mu=first.mirostat_mu)
    assert second.errors[0] is None
    off = nucleus.sample(x, seed=1)
    assert math.isnan(off.mirostat_mu[0])


def test_token_bitmask_equals_masking_the_logits_first():
    vocab = 100
    x = RNG.normal(size=(8, vocab)).astype(np.float32)
    mask = nucleus.allocate_token_bitmask(8, vocab)
    allowed = RNG.random(size=(8, vocab)) < 0.3
    allowed[:, 0] = True
    bits = np.zeros((8, 4), dtype=np.uint32)
    for r in range(8):
        for t in np.flatnonzero(allowed[r]):
            bits[r, t // 32] |= np.uint32(1) << np.uint32(t % 32)
    mask[:] = bits.view(np.int32)
    before = x.copy()
    got = nucleus.sample(x, token_bitmask=mask, seed=np.arange(8), top_p=0.8)
    np.testing.assert_array_equal(x, before)  # the logits are never written
    masked = x.copy()
    nucleus.apply_token_bitmask_inplace(masked, mask)
    want = nucleus.sample(masked, seed=np.arange(8), top_p=0.8)
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
    assert all(allowed[r, t] for r, t in enumerate(got.token_ids))
    p, _ = nucleus.distribution(x, token_bitmask=mask)
    assert np.all(p[~allowed] == 0)
    # A row of words too short for the vocabulary is that row's error.
    short = nucleus.sample(x, token_bitmask=mask[:, :3], seed=1)
    assert all(e is not None and e.kind == "InvalidBitmask" for e in short.errors)
    with pytest.raises(TypeError, match="int32"):
        nucleus.sample(x, token_bitmask=mask.astype(np.int64))
    with pytest.raises(ValueError, match="rows"):
        nucleus.sample(x, token_bitmask=mask[:3])


def test_min_tokens_bans_the_stop_ids_until_reached():
    x = np.zeros((2, 5), dtype=np.float32)
    x[:, 4] = 50.0  # 4 is the EOS and by far the most likely
    p = SamplingParams(min_tokens=3, temperature=0.0)
    r = nucleus.sample(x, params=p, output_ids=[[1], [1, 2, 3]], stop_token_ids=[[4], [4]])
    assert r.token_ids[0] != 4 and r.token_ids[1] == 4


def test_params_refusals():
    x = np.zeros((2, 5), dtype=np.float32)
    with pytest.raises(ValueError, match="either params= or top_k="):
        nucleus.sample(x, params=SamplingParams(), top_k=3)
    with pytest.raises(ValueError, match="either params= or seed="):
        nucleus.sample(x, params=SamplingParams(), seed=3)
    with pytest.raises(ValueError, match="sample_index"):
        nucleus.sample(x, params=SamplingParams(n=2))
    with pytest.raises(ValueError, match="distribution"):
        nucleus.sample(x, params=SamplingParams(logprobs=2))
    with pytest.raises(ValueError, match="one per row"):
        nucleus.sample(x, params=[SamplingParams()] * 3)
    with pytest.raises(TypeError, match="params\\[1\\]"):
        nucleus.sample(x, params=[SamplingParams(), {"top_k": 3}])
    # A bad value inside a valid-looking dict never reaches Rust unchecked: SamplingParams is
    # validated at construction, so only in-range parameters exist.
    good = nucleus.sample(x, params=[SamplingParams(seed=1), SamplingParams(seed=2)])
    assert good.errors == [None, None]


def test_json_round_trip_and_refusals():
    p = SamplingParams(temperature=0.7, logit_bias={3: -100.0, 10: 2.5}, bad_words=[[1, 2]],
                       sequence_bias=[([4], 1.0)], seed=2**64 - 1, logprobs_kind="raw")
    text = p.to_json()
    obj = json.loads(text)
    assert obj["logit_bias"] == {"3": -100.0, "10": 2.5}
    assert obj["seed"] == 2**64 - 1
    assert "top_p" not in obj  # defaults left out
    back = SamplingParams.from_json(text)
    assert _plain(back._to_dict()) == _plain(p._to_dict())
    assert SamplingParams.from_json('{"top_k": null}') == SamplingParams()
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams.from_json('{"top_kk": 3}')
    with pytest.raises(ValueError, match="canonical decimal"):
        SamplingParams.from_json('{"logit_bias": {"042": 1}}')
    with pytest.raises(TypeError, match="temperature"):
        SamplingParams.from_json('{"temperature": "hot"}')
    with pytest.raises(ValueError, match="JSON object"):
        SamplingParams.from_json("[1]")
    with pytest.raises(nucleus.SamplingError, match="top_p"):
        SamplingParams.from_json('{"top_p": 1.5}')
    with pytest.raises(nucleus.SamplingError, match="logit_bias"):
        SamplingParams.from_json('{"logit_bias": {"3": "-inf"}}')  # biases must be finite
