"""chain_speculative_sampling (FlashInfer's name) against the theorem of speculative sampling
(each emitted token is distributed as the target's distribution at its place) and hand-worked
cases."""

from __future__ import annotations

import numpy as np
import pytest

import nucleus

RNG = np.random.default_rng(5)


def test_identical_draft_and_target_accept_everything():
    b, s, v = 4, 3, 50
    p = RNG.dirichlet(np.ones(v), size=(b, s + 1)).astype(np.float32)
    ids = np.stack([[RNG.choice(v, p=p[r, i] / p[r, i].sum()) for i in range(s)]
                    for r in range(b)]).astype(np.int32)
    acc = np.zeros(b, np.int64)
    emi = np.full(b, 10, np.int64)
    out, accepted, emitted = nucleus.chain_speculative_sampling(
        p[:, :s], ids, p, acc, emi, seed=np.arange(b), offset=7)
    assert out.dtype == np.int32 and out.shape == (b, s + 1)
    assert np.array_equal(out[:, :s], ids)  # p/q = 1 >= u: every draft accepted
    assert np.all(out[:, s] >= 0)  # and the bonus token
    assert emitted.tolist() == [s] * b and accepted.tolist() == [s] * b
    assert acc.tolist() == [s] * b and emi.tolist() == [10 + s] * b  # added in place


def test_a_draft_the_target_forbids_is_rejected_and_resampled_from_the_residual():
    v = 4
    draft = np.array([[[0, 0, 1, 0]]], np.float32)  # one-hot on token 2
    target = np.array([[[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]], np.float32)
    for seed in range(20):
        out, accepted, emitted = nucleus.chain_speculative_sampling(
            draft, np.array([[2]]), target, seed=[seed], offset=0)
        assert emitted[0] == 0 and accepted[0] == 0
        assert out[0, 0] in (0, 1) and out[0, 1] == -1  # the residual max(0, p - q) = p


def test_the_first_emitted_token_is_distributed_as_the_target():
    # 20,000 rows; the draft q differs from the target p. Chi-square, 4 degrees of freedom at
    # alpha 1e-6 (critical 33.4): fails once in a million runs for a correct sampler.
    n, v = 20000, 5
    p = np.array([0.35, 0.25, 0.2, 0.15, 0.05], np.float32)
    q = np.array([0.1, 0.1, 0.5, 0.2, 0.1], np.float32)
    draft_ids = RNG.choice(v, size=(n, 1), p=q).astype(np.int32)
    out, accepted, emitted = nucleus.chain_speculative_sampling(
        np.broadcast_to(q, (n, 1, v)), draft_ids, np.broadcast_to(p, (n, 2, v)),
        seed=np.arange(n), offset=0)
    counts = np.bincount(out[:, 0], minlength=v)
    e = n * p / p.sum()
    assert ((counts - e) ** 2 / e).sum() < 33.4, counts
    # The acceptance rate is sum_x min(p, q) (the papers' alpha), within 5 sigma.
    alpha = np.minimum(p, q).sum()
    assert abs(emitted.mean() - alpha) < 5 * np.sqrt(alpha * (1 - alpha) / n)
    # With one draft token the independent count is the emitted count.
    assert np.array_equal(accepted, emitted)


def test_rows_are_their_own_and_errors():
    b, s, v = 6, 4, 30
    q = RNG.dirichlet(np.ones(v), size=(b, s)).astype(np.float32)
    p = RNG.dirichlet(np.ones(v), size=(b, s + 1)).astype(np.float32)
    ids = RNG.integers(0, v, size=(b, s))
    out, acc, emi = nucleus.chain_speculative_sampling(q, ids, p, seed=np.arange(b) + 40,
                                                       offset=np.arange(b))
    for r in range(b):
        o1, a1, e1 = nucleus.chain_speculative_sampling(q[r:r + 1], ids[r:r + 1], p[r:r + 1],
                                                        seed=[40 + r], offset=[r])
        assert np.array_equal(o1[0], out[r]) and a1[0] == acc[r] and e1[0] == emi[r]
        assert acc[r] >= emi[r]
        assert np.all(out[r, emi[r] + 1:] == -1) and np.all(out[r, :emi[r] + 1] >= 0)
    with pytest.raises(ValueError, match="one seed per row"):
        nucleus.chain_speculative_sampling(q, ids, p, seed=1)
    with pytest.raises(ValueError, match="shapes"):
        nucleus.chain_speculative_sampling(q, ids, p[:, :s], seed=np.arange(b))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        nucleus.chain_speculative_sampling(q, ids + v, p, seed=np.arange(b))
