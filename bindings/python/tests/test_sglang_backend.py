"""nucleus.sglang against a fake of SGLang 0.5.23's sampler-backend registry (tests/fakes/
sglang_fake.py names the file it follows): the registered backend's tokens equal
nucleus.sample with the same temperatures, top-k, top-p, min-p, seeds and positions (+1);
seeded rows reproduce across batch compositions and orders; unseeded rows sample; greedy rows
are argmax; logprobs are written as SGLang's Sampler writes them. Needs torch (SGLang's
tensors), skipped without it."""

from __future__ import annotations

import importlib
import logging
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import nucleus  # noqa: E402
from fakes import sglang_fake as fake  # noqa: E402

V = 64
RNG = np.random.default_rng(11)


@pytest.fixture
def ns(monkeypatch):
    for name, mod in fake.modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    sys.modules.pop("nucleus.sglang", None)
    mod = importlib.import_module("nucleus.sglang")
    yield mod
    sys.modules.pop("nucleus.sglang", None)
    if hasattr(nucleus, "sglang"):
        delattr(nucleus, "sglang")


# One row each: temperature, top_k (<= 0: off), top_p, min_p, seed, position.
ROWS = [
    (0.7, 0, 1.0, 0.0, 1, 10),
    (1.0, 20, 0.9, 0.0, 2, 11),
    (0.0, 0, 1.0, 0.0, 3, 12),      # greedy
    (1.3, 8, 1.0, 0.05, 4, 40),
    (0.9, 0, 0.8, 0.1, 5, 7),
    (1.0, 3, 1.0, 0.0, 6, 300),
]


def run(ns, logits, rows, seeded=True, return_logprob=False, top=None):
    sampler = fake.create_sampler("nucleus")
    info = fake.batch_info([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                           [r[3] for r in rows], [r[4] for r in rows] if seeded else None)
    out = fake.LogitsProcessorOutput(next_token_logits=torch.from_numpy(logits.copy()))
    positions = torch.tensor([r[5] for r in rows], dtype=torch.int64)
    ids = sampler(out, info, return_logprob, top or [0] * len(rows),
                  [None] * len(rows), positions)
    # as SGLang's Sampler: torch.argmax's int64 when every row is greedy, else int32
    assert ids.dtype == (torch.int64 if info.is_all_greedy else torch.int32)
    assert ids.shape == (len(rows),)
    assert sampler.synced == 1
    return ids.numpy().astype(np.int64), out, info


def oracle(logits, rows):
    """nucleus.sample directly; greedy rows (temperature 0) by argmax as SGLang does."""
    t = np.array([1.0 if r[0] == 0 else r[0] for r in rows])
    k = np.array([max(r[1], 0) for r in rows])
    res = nucleus.sample(logits, temperature=t, top_k=k, top_p=np.array([r[2] for r in rows]),
                         min_p=np.array([r[3] for r in rows]),
                         seed=np.array([r[4] for r in rows], dtype=np.uint64),
                         position=np.array([r[5] + 1 for r in rows]))
    want = np.asarray(res.token_ids).copy()
    for i, r in enumerate(rows):
        if r[0] == 0:
            want[i] = int(np.argmax(logits[i]))
    return want


def test_register_and_create(ns):
    assert ns.register() == "nucleus"
    assert "nucleus" in fake.SAMPLING_BACKEND_CHOICES
    s = fake.create_sampler("nucleus")
    assert isinstance(s, ns.NucleusSampler) and isinstance(s, fake.Sampler)
    assert ns.PINNED_SGLANG_VERSION == "0.5.23"


def test_tokens_equal_nucleus_sample_and_are_batch_invariant(ns):
    ns.register()
    logits = (RNG.normal(size=(len(ROWS), V)) * 2).astype(np.float32)
    logits[3, ::2] = -np.inf  # a grammar mask: these ids never come out
    got, _, _ = run(ns, logits, ROWS)
    want = oracle(logits, ROWS)
    assert np.array_equal(got, want)
    assert got[2] == np.argmax(logits[2]) and got[3] % 2 == 1
    # other orders and compositions: each seeded row keeps its token
    for trial in range(3):
        idx = RNG.permutation(len(ROWS))[: 2 + trial]
        sub, _, _ = run(ns, logits[idx], [ROWS[i] for i in idx])
        assert np.array_equal(sub, want[idx])
    # the position is part of the key: another position, another stream
    moved = [r[:5] + (r[5] + 1000,) for r in ROWS]
    assert np.array_equal(run(ns, logits, moved)[0], oracle(logits, moved))


def test_unseeded_rows_sample_within_their_candidates(ns):
    ns.register()
    logits = (RNG.normal(size=(len(ROWS), V)) * 2).astype(np.float32)
    for _ in range(3):
        got, _, _ = run(ns, logits, ROWS, seeded=False)
        assert got[2] == np.argmax(logits[2])
        assert got[5] in np.argsort(-logits[5])[:3]  # top_k 3
        assert np.all((got >= 0) & (got < V))


def test_all_greedy_and_logprobs(ns):
    ns.register()
    logits = (RNG.normal(size=(3, V)) * 2).astype(np.float32)
    rows = [(0.0, 0, 1.0, 0.0, 1, 5)] * 3
    got, out, _ = run(ns, logits, rows, return_logprob=True, top=[2, 0, 1])
    assert np.array_equal(got, logits.argmax(1))
    lp = torch.log_softmax(torch.from_numpy(logits), dim=-1)
    assert torch.equal(out.next_token_logprobs, lp[torch.arange(3), torch.from_numpy(got)])
    assert out.next_token_top_logprobs_idx == [list(np.argsort(-logits[0])[:2]), [],
                                               [int(np.argmax(logits[2]))]]
    # a mixed batch: SGLang's standard path reports log_softmax(logits / T)
    logits = (RNG.normal(size=(len(ROWS), V)) * 2).astype(np.float32)
    got, out, info = run(ns, logits, ROWS, return_logprob=True)
    lp = torch.log_softmax(torch.from_numpy(logits) / info.temperatures, dim=-1)
    assert torch.equal(out.next_token_logprobs,
                       lp[torch.arange(len(ROWS)), torch.from_numpy(got)])


def test_a_row_nucleus_cannot_sample_falls_back_to_argmax(ns, caplog):
    ns.register()
    logits = (RNG.normal(size=(len(ROWS), V)) * 2).astype(np.float32)
    logits[1] = -np.inf
    with caplog.at_level(logging.WARNING, logger="nucleus.sglang"):
        got, _, _ = run(ns, logits, ROWS)
    assert "could not be sampled" in caplog.text and got[1] == 0
    want = oracle(np.delete(logits, 1, axis=0), ROWS[:1] + ROWS[2:])
    assert np.array_equal(np.delete(got, 1), want)


def test_import_without_sglang_names_the_pinned_version(monkeypatch):
    sys.modules.pop("nucleus.sglang", None)
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match=r"sglang==0\.5\.23"):
        importlib.import_module("nucleus.sglang")
    sys.modules.pop("nucleus.sglang", None)
