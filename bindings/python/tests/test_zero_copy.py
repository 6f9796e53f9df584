"""Memory: every public function that is not in place takes read-only input arrays (so nothing
writes to them) and gives the same results as on writable copies; the in-place ones write the
caller's array, only where they say, and refuse a read-only one; inputs with a row stride are
read in place."""

from __future__ import annotations

import numpy as np
import pytest

import nucleus
import nucleus.npu as npu

RNG = np.random.default_rng(20261206)


def ro(a):
    a = np.array(a)
    a.flags.writeable = False
    return a


def equal(x, y):
    if isinstance(x, np.ndarray):
        np.testing.assert_array_equal(x, y)
    elif isinstance(x, (tuple, list)):
        assert len(x) == len(y)
        for a, b in zip(x, y):
            equal(a, b)
    elif isinstance(x, nucleus.NucleusError):
        assert (x.kind, str(x)) == (y.kind, str(y))
    else:
        assert x == y


B, V = 5, 40
LOGITS = RNG.normal(size=(B, V)).astype(np.float32)
PROBS = (np.exp(LOGITS) / np.exp(LOGITS).sum(-1, keepdims=True)).astype(np.float32)
K = np.array([0, 3, 10, 40, 1], dtype=np.int32)
P = np.array([0.9, 0.5, 1.0, 0.3, 0.8])
SEEDS = np.arange(B, dtype=np.uint64)
MASK = nucleus.allocate_token_bitmask(B, V)
MASK[1, 0] = 0x0F0F0F0F

CALLS = {
    "sample": lambda a: nucleus.sample(a["logits"], top_k=a["k"], top_p=a["p"], seed=a["seeds"],
                                       token_bitmask=a["mask"]),
    "distribution": lambda a: nucleus.distribution(a["logits"], top_k=a["k"], top_p=a["p"]),
    "top_k_top_p_sampling_from_logits": lambda a: nucleus.top_k_top_p_sampling_from_logits(
        a["logits"], a["k"], a["p"], seed=a["seeds"], offset=1),
    "top_k_top_p_sampling_from_probs": lambda a: nucleus.top_k_top_p_sampling_from_probs(
        a["probs"], a["k"], a["p"], seed=a["seeds"], offset=1),
    "top_p_sampling_from_probs": lambda a: nucleus.top_p_sampling_from_probs(
        a["probs"], a["p"], seed=a["seeds"]),
    "top_k_sampling_from_probs": lambda a: nucleus.top_k_sampling_from_probs(
        a["probs"], a["k"], seed=a["seeds"]),
    "min_p_sampling_from_probs": lambda a: nucleus.min_p_sampling_from_probs(
        a["probs"], a["p"] / 4, seed=a["seeds"]),
    "top_k_renorm_probs": lambda a: nucleus.top_k_renorm_probs(a["probs"], a["k"]),
    "top_p_renorm_probs": lambda a: nucleus.top_p_renorm_probs(a["probs"], a["p"]),
    "top_k_mask_logits": lambda a: nucleus.top_k_mask_logits(a["logits"], a["k"]),
    "chain_speculative_sampling": lambda a: nucleus.chain_speculative_sampling(
        a["probs"][:, None, :], a["k"][:, None] % V, np.repeat(a["probs"][:, None, :], 2, 1),
        seed=a["seeds"], offset=0),
    "npu_top_k_top_p_sample": lambda a: npu.npu_top_k_top_p_sample(
        a["logits"], np.maximum(a["k"], 1), a["p"].astype(np.float32),
        np.full((B, V), 0.5, np.float32), is_need_logits=True),
    "npu_moe_init_routing_v2": lambda a: npu.npu_moe_init_routing_v2(
        a["logits"][:, :8], a["k"][:, None] % 4, expert_num=4, expert_tokens_num_type=1,
        expert_tokens_num_flag=True),
    "npu_moe_gating_top_k_softmax": lambda a: npu.npu_moe_gating_top_k_softmax(
        a["logits"][:, :8], k=2),
    "npu_moe_gating_top_k": lambda a: npu.npu_moe_gating_top_k(a["logits"][:, :8], 2),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_read_only_inputs_give_the_same_results(name):
    writable = dict(logits=LOGITS.copy(), probs=PROBS.copy(), k=K.copy(), p=P.copy(),
                    seeds=SEEDS.copy(), mask=MASK.copy())
    readonly = {k: ro(v) for k, v in writable.items()}
    want = CALLS[name](writable)
    got = CALLS[name](readonly)
    equal(got, want)
    for k, v in writable.items():  # the writable inputs were not written either
        np.testing.assert_array_equal(v, readonly[k])


def test_the_in_place_function_writes_only_what_it_says():
    big = RNG.normal(size=(B + 2, V + 8)).astype(np.float32)
    before = big.copy()
    view = big[1:B + 1, :V]  # a row stride, written in place
    nucleus.apply_token_bitmask_inplace(view, MASK, indices=[1, 3])
    assert np.shares_memory(view, big)
    changed = big != before
    rows, cols = np.nonzero(changed)
    assert set(rows) <= {2}  # only row 1 of the view (row 3's mask allows everything)
    assert all(c < 32 and not (0x0F0F0F0F >> c) & 1 for c in cols)
    assert np.isneginf(big[changed]).all()
    with pytest.raises(ValueError, match="read-only"):
        nucleus.apply_token_bitmask_inplace(ro(LOGITS), MASK)


def test_strided_logits_are_read_in_place():
    big = RNG.normal(size=(B, V + 24)).astype(np.float32)
    view = big[:, :V]
    assert np.shares_memory(nucleus._logits_2d(view), big)  # no copy before the Rust call
    equal(nucleus.sample(view, seed=SEEDS), nucleus.sample(np.ascontiguousarray(view),
                                                           seed=SEEDS))
