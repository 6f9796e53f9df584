"""allocate_token_bitmask and apply_token_bitmask_inplace in XGrammar's int32 layout, against a
NumPy oracle that unpacks the bits (bit t % 32 of word t // 32, set = allowed)."""

from __future__ import annotations

import numpy as np
import pytest

import nucleus

RNG = np.random.default_rng(99)


def allowed(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """The bool [B, vocab] mask the bits say."""
    words = bitmask.astype(np.int64) & 0xFFFFFFFF
    bits = (words[:, :, None] >> np.arange(32)[None, None, :]) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].astype(bool)


def test_allocate_allows_everything():
    m = nucleus.allocate_token_bitmask(3, 100)
    assert m.dtype == np.int32 and m.shape == (3, 4) and np.all(m == -1)
    x = RNG.normal(size=(3, 100)).astype(np.float32)
    before = x.copy()
    nucleus.apply_token_bitmask_inplace(x, m)
    assert np.array_equal(x, before)


def test_random_masks_match_the_oracle_with_padding_and_indices():
    vocab, row = 1000, 1024  # a padded row: columns 1000.. are -inf afterwards
    m = RNG.integers(-2**31, 2**31, size=(6, nucleus.bitmask.bitmask_words(vocab)),
                     dtype=np.int64).astype(np.int32)
    x = RNG.normal(size=(6, row)).astype(np.float32)
    want = x.copy()
    ok = allowed(m, vocab)
    want[:, :vocab][~ok] = -np.inf
    want[:, vocab:] = -np.inf
    got = x.copy()
    nucleus.apply_token_bitmask_inplace(got, m, vocab_size=vocab)
    assert np.array_equal(got, want)
    # indices: only those rows (of both arrays), the others untouched.
    got = x.copy()
    nucleus.apply_token_bitmask_inplace(got, m, vocab_size=vocab, indices=[4, 1])
    for r in range(6):
        assert np.array_equal(got[r], want[r] if r in (1, 4) else x[r]), r
    # A strided view is written in place.
    wide = np.zeros((6, 2048), np.float32)
    wide[:, :row] = x
    nucleus.apply_token_bitmask_inplace(wide[:, :row], m, vocab_size=vocab)
    assert np.array_equal(wide[:, :row], want) and np.all(wide[:, row:] == 0)


def test_the_sampler_never_draws_a_masked_token():
    vocab = 64
    m = np.zeros((1, 2), np.int32)
    m[0, 0] = 1 << 5  # only token 5 ...
    m[0, 1] = 1 << 3  # ... and token 35
    x = np.zeros((500, vocab), np.float32)
    masks = np.repeat(m, 500, axis=0)
    nucleus.apply_token_bitmask_inplace(x, masks)
    s = nucleus.sample(x, seed=np.arange(500)).token_ids
    assert set(s.tolist()) == {5, 35}


def test_bitmask_errors():
    x = np.zeros((2, 64), np.float32)
    m = nucleus.allocate_token_bitmask(2, 64)
    with pytest.raises(TypeError, match="float32"):
        nucleus.apply_token_bitmask_inplace(x.astype(np.float16), m)
    with pytest.raises(TypeError, match="int32"):
        nucleus.apply_token_bitmask_inplace(x, m.astype(np.int64))
    with pytest.raises(ValueError, match="same batch"):
        nucleus.apply_token_bitmask_inplace(x, m[:1])
    with pytest.raises(ValueError, match="outside"):
        nucleus.apply_token_bitmask_inplace(x, m, indices=[2])
    with pytest.raises(ValueError, match="bitmask words"):
        nucleus.apply_token_bitmask_inplace(x, m[:, :1])
    ro = x.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        nucleus.apply_token_bitmask_inplace(ro, m)
    # A failed call writes nothing.
    y = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError):
        nucleus.apply_token_bitmask_inplace(y, np.zeros((2, 2), np.int32), indices=[0, 5])
    assert np.all(y == 1)


def test_review_findings_bitmask():
    x = np.zeros(16, np.float32)
    overlapping = np.lib.stride_tricks.as_strided(x, shape=(3, 16), strides=(0, 4),
                                                  writeable=True)
    with pytest.raises(ValueError, match="overlap"):
        nucleus.apply_token_bitmask_inplace(overlapping, np.zeros((3, 1), np.int32))
    assert np.all(x == 0)
    with pytest.raises(TypeError, match="vocab_size must be an integer"):
        nucleus.apply_token_bitmask_inplace(np.zeros((1, 8), np.float32),
                                            np.zeros((1, 1), np.int32), vocab_size=5.9)
    with pytest.raises(TypeError, match="batch_size must be an integer"):
        nucleus.allocate_token_bitmask(2.5, 10)
