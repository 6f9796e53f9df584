"""The FlashInfer-named functions (nucleus.sampling) against an f64 oracle on probabilities
written from spec/sampling.md, the spec's probability worked cases, and FlashInfer's calling
conventions (indices, return_valid, check_nan, seed/offset, filter_apply_order)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import nucleus

RNG = np.random.default_rng(7)


def probs_oracle(p, top_k=0, top_p=1.0, min_p=0.0):
    """spec/sampling.md steps 8-10 on a probability row, in f64."""
    p = np.asarray(p, dtype=np.float64)
    p = p / p.sum()
    v = len(p)
    keep = p > 0
    if min_p > 0:
        keep &= p >= min_p * p.max()
    if 0 < top_k < v:
        order = sorted(np.flatnonzero(keep), key=lambda i: (-p[i], i))
        kk = np.zeros(v, bool)
        kk[order[:top_k]] = True
        keep &= kk
    if top_p < 1:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        order = sorted(np.flatnonzero(keep), key=lambda i: (-q[i], i))
        mass, chosen = 0.0, []
        for i in order:
            chosen.append(i)
            mass += q[i]
            if mass >= top_p:
                break
        pk = np.zeros(v, bool)
        pk[chosen] = True
        keep &= pk
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def test_the_spec_probability_cases():
    p = np.array([[0.4, 0.3, 0.2, 0.1]], np.float32)
    assert np.allclose(nucleus.top_k_renorm_probs(p, 2), [[4 / 7, 3 / 7, 0, 0]], atol=1e-7)
    assert np.allclose(nucleus.top_p_renorm_probs(p, 0.8), [[4 / 9, 3 / 9, 2 / 9, 0]], atol=1e-7)
    q = np.array([[0.25, 0.125, 0.125, 0.5]], np.float32)  # an exact hit takes no more
    assert np.array_equal(nucleus.top_p_renorm_probs(q, 0.75), np.array([[1 / 3, 0, 0, 2 / 3]],
                                                                       np.float32))
    # top_k 2 then top_p 0.5: only token 0 (4/7 >= 0.5 after renormalising).
    many = np.repeat(p, 200, axis=0)
    s = nucleus.top_k_top_p_sampling_from_probs(many, 2, 0.5, seed=np.arange(200))
    assert s.dtype == np.int32 and np.all(s == 0)


@pytest.mark.parametrize("k, top_p", [(0, 0.9), (5, 1.0), (20, 0.7), (3, 0.5)])
def test_renorm_matches_the_oracle(k, top_p):
    p = RNG.dirichlet(np.full(200, 0.3), size=5).astype(np.float32)
    got_k = nucleus.top_k_renorm_probs(p, k)
    got_p = nucleus.top_p_renorm_probs(p, top_p)
    assert got_k.dtype == np.float32 and got_k.shape == p.shape
    for row, gk, gp in zip(p, got_k, got_p):
        assert np.abs(gk - probs_oracle(row, top_k=k)).max() < 1e-6
        assert np.abs(gp - probs_oracle(row, top_p=top_p)).max() < 1e-6
    # Same dtype out for half precision.
    assert nucleus.top_k_renorm_probs(p.astype(ml_dtypes.bfloat16), 5).dtype == ml_dtypes.bfloat16


def test_draws_follow_the_filtered_distribution():
    # 30,000 rows of one distribution, a seed each: chi-square at alpha 1e-6 (a correct sampler
    # fails once in a million runs; fixed seeds, so never flaky). Degrees of freedom = support - 1.
    base = np.array([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.05], np.float32)
    n = 30000
    x = np.repeat(base[None, :], n, axis=0)
    crit = {2: 27.6, 3: 30.7, 4: 33.4}  # chi2.ppf(1 - 1e-6, df)
    for fn, kw, want in [
        (nucleus.top_k_sampling_from_probs, dict(top_k=4), probs_oracle(base, top_k=4)),
        (nucleus.top_p_sampling_from_probs, dict(top_p=0.6), probs_oracle(base, top_p=0.6)),
        (nucleus.min_p_sampling_from_probs, dict(min_p=0.4), probs_oracle(base, min_p=0.4)),
    ]:
        s = fn(x, seed=np.arange(n), **kw)
        counts = np.bincount(s, minlength=7)
        support = want > 0
        assert np.all(counts[~support] == 0), (fn.__name__, counts)
        e = n * want[support]
        chi2 = ((counts[support] - e) ** 2 / e).sum()
        assert chi2 < crit[int(support.sum()) - 1], (fn.__name__, chi2, counts, e)


def test_logits_form_equals_probs_form_of_the_softmax():
    logits = RNG.normal(0, 2, size=(32, 500)).astype(np.float32)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = (probs / probs.sum(axis=1, keepdims=True)).astype(np.float32)
    a = nucleus.top_k_top_p_sampling_from_logits(logits, 50, 0.9, seed=np.arange(32), offset=3)
    b = nucleus.top_k_top_p_sampling_from_probs(probs, 50, 0.9, seed=np.arange(32), offset=3)
    # The same draws where the two rows' distributions agree to within f32 rounding.
    assert (a == b).mean() > 0.9
    # And the logits form is nucleus.sample with those filters at temperature 1.
    c = nucleus.sample(logits, top_k=50, top_p=0.9, seed=np.arange(32), position=3).token_ids
    assert np.array_equal(a, c.astype(np.int32))


def test_seeds_offsets_indices_and_valid():
    p = RNG.dirichlet(np.ones(100), size=8).astype(np.float32)
    # Per-row seeds: a row's sample is its own, whatever the batch.
    full = nucleus.top_p_sampling_from_probs(p, 0.9, seed=np.arange(100, 108), offset=5)
    for i in range(8):
        alone = nucleus.top_p_sampling_from_probs(p[i:i + 1], 0.9, seed=[100 + i], offset=[5])
        assert alone[0] == full[i]
    # One seed for the batch: reproducible, and rows are distinct streams.
    same = np.repeat(p[:1], 64, axis=0)
    one = nucleus.top_p_sampling_from_probs(same, 1.0, seed=9, offset=0)
    assert np.array_equal(one, nucleus.top_p_sampling_from_probs(same, 1.0, seed=9, offset=0))
    assert len(set(one.tolist())) > 10
    # indices pick the rows; the samples take their dtype.
    idx = np.array([3, 3, 0], np.int64)
    s = nucleus.top_k_sampling_from_probs(p, 10, indices=idx, seed=np.array([1, 1, 2]))
    assert s.dtype == np.int64 and s[0] == s[1]
    assert s[2] == nucleus.top_k_sampling_from_probs(p[:1], 10, seed=[2])[0]
    # A row with no candidate: -1 and valid False; the others sample.
    bad = p.copy()
    bad[2] = 0
    s, valid = nucleus.top_p_sampling_from_probs(bad, 0.9, seed=np.arange(8), return_valid=True)
    assert valid.dtype == np.bool_ and valid.tolist() == [True, True, False] + [True] * 5
    assert s[2] == -1 and np.all(s[valid] >= 0)
    # A generator is read through initial_seed().
    class Gen:
        def initial_seed(self):
            return 100

    g = nucleus.top_p_sampling_from_probs(p[:1], 0.9, generator=Gen(), offset=5)
    assert g[0] == full[0]


def test_flashinfer_errors():
    p = np.full((2, 4), 0.25, np.float32)
    with pytest.raises(ValueError, match="joint"):
        nucleus.top_k_top_p_sampling_from_probs(p, 2, 0.9, filter_apply_order="joint")
    with pytest.raises(ValueError, match="top_k_first"):
        nucleus.top_k_top_p_sampling_from_logits(p, 2, 0.9, filter_apply_order="bogus")
    p[1, 1] = np.nan
    with pytest.raises(ValueError, match="contains NaN"):
        nucleus.top_p_sampling_from_probs(p, 0.9, check_nan=True)
    with pytest.raises(ValueError, match="length 1 or 2"):
        nucleus.top_p_sampling_from_probs(p, 0.9, seed=[1, 2, 3])
    with pytest.raises(ValueError, match="offset needs a seed"):
        nucleus.top_p_sampling_from_probs(p, 0.9, offset=3)


def test_top_k_mask_logits():
    x = np.array([[1, 2, 2, 2, 3]], np.float32)
    m = nucleus.top_k_mask_logits(x, 3)
    assert np.array_equal(np.isfinite(m[0]), [False, True, True, False, True])
    assert np.array_equal(m[0][np.isfinite(m[0])], [2, 2, 3])
    logits = RNG.normal(size=(6, 300)).astype(np.float16)
    ks = np.array([1, 5, 0, 300, 1000, 17])
    m = nucleus.top_k_mask_logits(logits, ks)
    assert m.dtype == np.float16
    probs, _ = nucleus.distribution(logits, top_k=ks)
    assert np.array_equal(np.isfinite(m), probs > 0)
    assert np.array_equal(m[np.isfinite(m)], logits[np.isfinite(m)])
    with pytest.raises(ValueError, match="row 0 holds a NaN"):
        nucleus.top_k_mask_logits(np.array([[np.nan, 1]], np.float32), 1)


def test_review_findings_flashinfer():
    p = np.zeros((1, 40000), np.float32)
    p[0, 39999] = 1
    # Samples take the dtype of indices: only int32 and int64 can hold every id and -1.
    for dt in (np.int16, np.uint8, np.uint32):
        with pytest.raises(ValueError, match="int32 or int64"):
            nucleus.top_k_sampling_from_probs(p, 1, indices=np.array([0], dt), seed=1)
    assert nucleus.top_k_sampling_from_probs(p, 1, indices=np.array([0], np.int32),
                                             seed=[1])[0] == 39999
    # 1-D in, 1-D out; the argument is named in errors.
    assert nucleus.top_k_renorm_probs(np.array([0.5, 0.3, 0.2], np.float32), 2).shape == (3,)
    assert nucleus.top_k_mask_logits(np.array([1, 2, 3], np.float32), 2).shape == (3,)
    with pytest.raises(TypeError, match="probs must be float32"):
        nucleus.top_k_top_p_sampling_from_probs(np.zeros((1, 3)), 1, 0.5)
    with pytest.raises(TypeError, match="draft_probs must be a float32"):
        nucleus.chain_speculative_sampling(np.zeros((1, 1, 3)), np.zeros((1, 1), np.int32),
                                           np.zeros((1, 2, 3), np.float32), seed=[1])
