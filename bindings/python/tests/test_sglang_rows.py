"""The torch-free core of the SGLang backend (nucleus._sglang_rows, which NucleusSampler calls
on the host copy of SGLang's logits): SGLang's parameter conventions mapped onto
nucleus.sample. Runs without SGLang and without torch (CI); tests/test_sglang_backend.py drives
the whole backend through a fake of SGLang when torch is there."""

from __future__ import annotations

import numpy as np

import nucleus
from nucleus._sglang_rows import TOP_K_ALL, sglang_rows

RNG = np.random.default_rng(20261208)
B, V = 6, 80
TEMPS = np.array([[0.7], [1.0], [1.0], [1.3], [0.9], [1.0]], np.float32)  # SGLang's [B, 1]
TOP_KS = np.array([TOP_K_ALL, 20, 1, 8, TOP_K_ALL, 3], np.int32)          # row 2 greedy
TOP_PS = np.array([1.0, 0.9, 1.0, 1.0, 0.8, 1.0], np.float32)
MIN_PS = np.array([0.0, 0.0, 0.0, 0.05, 0.1, 0.0], np.float32)
SEEDS = np.array([1, 2, 3, -4, 2**62, 6], np.int64)                       # int64, as SGLang
POS = np.array([10, 11, 12, 40, 7, 300], np.int64)


def test_rows_equal_nucleus_sample_at_the_next_position():
    x = RNG.normal(size=(B, V)).astype(np.float32) * 2
    ids, failed = sglang_rows(x, TEMPS, TOP_KS, TOP_PS, MIN_PS, SEEDS, POS)
    assert failed == [] and ids.dtype == np.int64
    want = nucleus.sample(x, temperature=TEMPS.reshape(-1).astype(np.float64),
                          top_k=np.where(TOP_KS >= TOP_K_ALL, 0, TOP_KS),
                          top_p=TOP_PS.astype(np.float64), min_p=MIN_PS.astype(np.float64),
                          seed=SEEDS.view(np.uint64), position=POS + 1)
    for i in range(B):
        if i == 2:
            assert ids[i] == x[i].argmax()  # greedy by argmax
        else:
            assert ids[i] == want.token_ids[i], i
    # The position is the next one: keyed at POS, the draws differ somewhere.
    at_pos = nucleus.sample(x, temperature=1.0, seed=SEEDS.view(np.uint64), position=POS)
    at_next = nucleus.sample(x, temperature=1.0, seed=SEEDS.view(np.uint64), position=POS + 1)
    plain, _ = sglang_rows(x, np.ones((B, 1)), np.full(B, TOP_K_ALL), np.ones(B), np.zeros(B),
                           SEEDS, POS)
    np.testing.assert_array_equal(plain, at_next.token_ids)
    assert not np.array_equal(at_pos.token_ids, at_next.token_ids)


def test_seeded_rows_do_not_depend_on_the_batch():
    x = RNG.normal(size=(B, V)).astype(np.float32)
    full, _ = sglang_rows(x, TEMPS, TOP_KS, TOP_PS, MIN_PS, SEEDS, POS)
    order = np.array([4, 0, 5])
    part, _ = sglang_rows(x[order], TEMPS[order], TOP_KS[order], TOP_PS[order], MIN_PS[order],
                          SEEDS[order], POS[order])
    np.testing.assert_array_equal(part, full[order])


def test_unseeded_rows_sample_within_their_candidates_and_failures_fall_back():
    x = np.full((2, V), -np.inf, np.float32)
    x[0, [5, 9]] = 0.0
    ids, failed = sglang_rows(x, np.ones((2, 1)), np.full(2, TOP_K_ALL), np.ones(2),
                              np.zeros(2), None, np.zeros(2, np.int64))
    assert ids[0] in (5, 9)
    assert [i for i, _ in failed] == [1] and failed[0][1].kind == "NoCandidates"
    assert ids[1] == 0  # argmax of an all -inf row: index 0, as SGLang's fallback
