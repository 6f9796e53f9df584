"""nucleus.vllm against a fake of vLLM 0.33.0's logits-processor interfaces (tests/fakes/
vllm_fake.py names the files it follows): the fake engine drives the processor as vLLM's
model runners do (slots from a free list, rows reordered every step, a request removed and
its slot reused, a speculative step, declined requests, a grammar-masked row), and every
token is checked against an independent run of nucleus.SamplerChain / nucleus.sample on the
same chain, prompt and output ids and position. NumPy and (when importable) torch logits."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import subprocess
import sys
import zlib

import numpy as np
import pytest

import nucleus
from fakes import vllm_fake as fake

V = 48
MASKED = np.arange(V) % 3 == 1  # the grammar mask of the masked rows: these ids are banned


# --- fixtures ---------------------------------------------------------------------------------

@pytest.fixture
def nv(monkeypatch):
    """nucleus.vllm imported fresh over the fake vLLM tree; both removed afterwards."""
    for name, mod in fake.modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    sys.modules.pop("nucleus.vllm", None)
    mod = importlib.import_module("nucleus.vllm")
    yield mod
    sys.modules.pop("nucleus.vllm", None)
    if hasattr(nucleus, "vllm"):
        delattr(nucleus, "vllm")


def _numpy_backend():
    return dict(array=lambda a: np.array(a), to_numpy=np.asarray,
                logits=lambda a: np.array(a, dtype=np.float32), back=np.asarray)


def _torch_backend(dtype_name):
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, dtype_name)
    return dict(array=lambda a: torch.from_numpy(np.array(a)), to_numpy=lambda t: t.numpy(),
                logits=lambda a: torch.from_numpy(np.array(a, dtype=np.float32)).to(dtype),
                back=lambda t: t.float().numpy())


@pytest.fixture(params=["numpy", "torch", "torch-float16"])
def backend(request):
    """NumPy arrays; CPU float32 torch (processed in place); float16 torch (the copy path a
    GPU tensor takes: rows copied out, written back with index_fill_/index_copy_)."""
    if request.param == "numpy":
        return _numpy_backend()
    return _torch_backend("float32" if request.param == "torch" else "float16")


# --- the model and the oracle -----------------------------------------------------------------

def model_logits(context) -> np.ndarray:
    """A deterministic 'model': the next-token logits are a function of the context only."""
    key = zlib.crc32(np.asarray(context, dtype=np.int64).tobytes())
    return (np.random.default_rng(key).normal(size=V) * 2.5).astype(np.float32)


def build(config):
    if isinstance(config, str):
        import json
        config = json.loads(config)
    if isinstance(config, list):
        return nucleus.SamplerChain(config)
    return nucleus.SamplerChain.from_params(nucleus.SamplingParams.from_json(config))


def oracle(config, prompt, outputs, row, position, mode="sample"):
    """A fresh chain, reset with the prompt, accepting the outputs, then one draw."""
    chain = build(config)
    chain.reset(prompt)
    for t in outputs:
        chain.accept(t)
    if mode == "sample":
        return chain.sample(row, position=position)[0]
    return np.asarray(chain.distribution(row, position=position))


def oracle_params(fields, prompt, outputs, row, position):
    """nucleus.sample with params= (the fixed path, not a chain)."""
    r = nucleus.sample(row[None, :], params=nucleus.SamplingParams.from_json(fields),
                       prompt_ids=[prompt], output_ids=[outputs], position=position)
    assert r.errors[0] is None
    return int(r.token_ids[0])


def committed_from(tokens, drafts):
    """What the rejection sampler commits when row j's target is one-hot on tokens[j]."""
    out = []
    for j, t in enumerate(tokens):
        out.append(int(t))
        if j < len(drafts) and drafts[j] == t:
            continue
        break
    return out


def one_hot_token(row: np.ndarray) -> int:
    finite = np.flatnonzero(np.isfinite(row))
    assert len(finite) == 1, f"not one-hot: {len(finite)} finite entries"
    assert row[finite[0]] == 0.0 and np.all(np.isneginf(np.delete(row, finite[0])))
    return int(finite[0])


# --- Model Runner V2 --------------------------------------------------------------------------

CHAIN_A = [{"dry": {"multiplier": 0.8, "base": 1.75, "allowed_length": 1}},
           {"xtc": {"threshold": 0.05, "probability": 0.7}},
           {"temperature": {"t": 1.3}}, {"sample": {"seed": 42}}]
PARAMS_B = {"temperature": 0.9, "top_p": 0.95, "dry_multiplier": 0.8, "dry_allowed_length": 1,
            "xtc_probability": 0.5, "xtc_threshold": 0.05, "seed": 7}
CHAIN_D = [{"repetition_penalty": {"penalty": 1.3}}, {"presence_penalty": {"penalty": 0.7}},
           {"top_k": {"k": 12}}, {"sample": {"seed": 3}}]
CHAIN_E = [{"frequency_penalty": {"penalty": 0.4}}, {"top_k": {"k": 5}},
           {"sample": {"seed": 99}}]


def test_v2_engine_reorders_removes_reuses_speculates_and_masks(nv, backend):
    eng = fake.V2Engine([nv.NucleusLogitsProcessor], V, backend["array"], backend["to_numpy"])
    configs = {"A": CHAIN_A, "B": PARAMS_B, "C": None, "D": CHAIN_D}
    prompts = {"A": [1, 2, 3, 1, 2], "B": [5, 6], "C": [7, 8, 9], "D": [2, 2, 4, 2]}
    for rid in "ABCD":
        extra = None if configs[rid] is None else {"nucleus": configs[rid]}
        eng.add(rid, prompts[rid], fake.SamplingParams(extra_args=extra))
    rng = np.random.default_rng(5)
    order = list("ABCD")
    checked = 0
    for step in range(7):
        if step == 3:  # B finishes; E takes B's slot (the free list is LIFO)
            slot_b = eng.slot["B"]
            eng.remove("B")
            del configs["B"]
            configs["E"] = CHAIN_E
            prompts["E"] = [9, 9, 1]
            assert eng.add("E", prompts["E"],
                           fake.SamplingParams(extra_args={"nucleus": CHAIN_E})) == slot_b
            order = [r if r != "B" else "E" for r in order]
        order = list(rng.permutation(order))
        drafts = {}
        if step == 4:  # three rows for A: the first draft right, the second wrong
            out_a = eng.tokens["A"][len(prompts["A"]):]
            ctx = eng.tokens["A"]
            x0 = oracle(CHAIN_A, prompts["A"], out_a, model_logits(ctx), len(ctx))
            x1 = oracle(CHAIN_A, prompts["A"], out_a + [x0], model_logits(ctx + [x0]),
                        len(ctx) + 1)
            drafts["A"] = [x0, (x1 + 1) % V]
        rows = eng.layout(order, drafts)
        raw = []
        for rid, j, _, pos in rows:
            ctx = eng.tokens[rid] + drafts.get(rid, [])[:j]
            row = model_logits(ctx)
            if rid == "D" and step in (2, 5):
                row[MASKED] = -np.inf  # vLLM's grammar stage ran before the processors
            raw.append(row)
        raw = np.stack(raw)
        logits = backend["logits"](raw)
        expect_in = backend["back"](logits).copy()  # what the processor saw (float16-rounded)
        out = backend["back"](eng.apply(logits, rows))
        tokens = {}
        for k, (rid, j, _, pos) in enumerate(rows):
            if configs[rid] is None:
                assert np.array_equal(out[k], expect_in[k]), "a declined row was written"
                tokens.setdefault(rid, []).append(int(np.argmax(expect_in[k])))
                continue
            got = one_hot_token(out[k])
            outputs = eng.tokens[rid][len(prompts[rid]):] + drafts.get(rid, [])[:j]
            if isinstance(configs[rid], dict):
                want = oracle_params(configs[rid], prompts[rid], outputs, expect_in[k], pos + 1)
            else:
                want = oracle(configs[rid], prompts[rid], outputs, expect_in[k], pos + 1)
            assert got == want, (step, rid, j)
            if rid == "D" and step in (2, 5):
                assert not MASKED[got] and np.all(np.isneginf(out[k][MASKED]))
            tokens.setdefault(rid, []).append(got)
            checked += 1
        for rid, toks in tokens.items():
            new = committed_from(toks, drafts.get(rid, []))
            if rid == "A" and step == 4:
                assert len(new) == 2  # draft 1 accepted, draft 2 rejected
            eng.commit(rid, new)
    assert checked == 7 * 3 + 2  # three opted-in requests a step, two speculative rows


def test_v2_speculative_decoding_leaves_the_tokens_unchanged_mirostat_included(nv):
    """The tokens committed with drafts (some right, some wrong) equal a plain decode loop
    (sample, accept) of the same chain: mirostat's mu follows the distribution each committed
    token was drawn from."""
    chains = {
        "M": [{"dry": {"multiplier": 0.5, "allowed_length": 1}},
              {"mirostat_v2": {"tau": 3.0, "eta": 0.3, "seed": 5}}],
        "S": [{"temperature": {"t": 0.8}}, {"top_p": {"p": 0.9}}, {"sample": {"seed": 11}}],
    }
    prompts = {"M": [3, 1, 4, 1, 5], "S": [2, 7, 1, 8]}
    n = 14
    reference = {}
    for rid, cfg in chains.items():
        chain = build(cfg)
        chain.reset(prompts[rid])
        ctx = list(prompts[rid])
        for _ in range(n + 4):
            t = chain.sample(model_logits(ctx), position=len(ctx))[0]
            chain.accept(t)
            ctx.append(t)
        reference[rid] = ctx[len(prompts[rid]):]
    np_b = _numpy_backend()
    eng = fake.V2Engine([nv.NucleusLogitsProcessor], V, np_b["array"], np_b["to_numpy"])
    for rid in chains:
        eng.add(rid, prompts[rid], fake.SamplingParams(extra_args={"nucleus": chains[rid]}))
    step = 0
    spec_rows = 0
    while min(len(eng.tokens[r]) - len(prompts[r]) for r in chains) < n:
        drafts = {}
        for rid in chains:
            done = len(eng.tokens[rid]) - len(prompts[rid])
            k = step % 4  # 0 to 3 drafts; the (step % 3)-th draft is wrong
            d = list(reference[rid][done:done + k])
            if step % 3 < len(d):
                d[step % 3] = (d[step % 3] + 5) % V
            drafts[rid] = d
        order = list(chains) if step % 2 else list(reversed(list(chains)))
        rows = eng.layout(order, drafts)
        raw = np.stack([model_logits(eng.tokens[rid] + drafts[rid][:j]) for rid, j, _, _ in rows])
        out = eng.apply(raw.copy(), rows)
        spec_rows += sum(1 for r in rows if r[1] > 0)
        toks = {}
        for k, (rid, j, _, _) in enumerate(rows):
            toks.setdefault(rid, []).append(one_hot_token(out[k]))
        for rid in chains:
            eng.commit(rid, committed_from(toks[rid], drafts[rid]))
        step += 1
    assert spec_rows > 10
    for rid in chains:
        got = eng.tokens[rid][len(prompts[rid]):]
        assert got[:n] == reference[rid][:n], rid


def test_v2_distribution_mode_writes_log_p_exactly(nv, backend):
    cfg = [{"temperature": {"t": 0.7}}, {"top_k": {"k": 10}}, {"sample": {"seed": 1}}]
    text = '[{"temperature": {"t": 0.7}}, {"top_k": {"k": 10}}, {"sample": {"seed": 1}}]'
    eng = fake.V2Engine([nv.NucleusLogitsProcessor], V, backend["array"], backend["to_numpy"])
    # over HTTP vllm_xargs carries strings: the chain as JSON text
    eng.add("P", [4, 4, 2], fake.SamplingParams(
        extra_args={"nucleus": text, "nucleus_mode": "distribution"}))
    eng.add("Q", [1], fake.SamplingParams())
    for step in range(3):
        rows = eng.layout(["Q", "P"] if step % 2 else ["P", "Q"])
        raw = np.stack([model_logits(eng.tokens[r[0]]) for r in rows])
        kp = [r[0] for r in rows].index("P")
        if step == 1:
            raw[kp, MASKED] = -np.inf
        logits = backend["logits"](raw)
        seen = backend["back"](logits).copy()
        out = backend["back"](eng.apply(logits, rows))
        p = oracle(cfg, [4, 4, 2], eng.tokens["P"][3:], seen[kp], rows[kp][3] + 1,
                   mode="distribution")
        with np.errstate(divide="ignore"):
            want32 = np.log(p).astype(np.float32)
        want = backend["back"](backend["logits"](want32))  # stored in the logits' dtype
        assert np.array_equal(out[kp], want)
        assert np.count_nonzero(np.isfinite(out[kp])) == 10
        assert abs(np.exp(out[kp].astype(np.float64)).sum() - 1) < 1e-3
        if step == 1:
            assert np.all(np.isneginf(out[kp][MASKED]))
        kq = 1 - kp
        assert np.array_equal(out[kq], seen[kq])
        eng.commit("P", [int(np.argmax(out[kp]))])
        eng.commit("Q", [int(np.argmax(out[kq]))])


def test_v2_params_form_takes_vllms_seed_and_a_shrunk_history_replays(nv):
    np_b = _numpy_backend()
    eng = fake.V2Engine([nv.NucleusLogitsProcessor], V, np_b["array"], np_b["to_numpy"])
    fields = {"temperature": 1.1, "top_k": 20, "repetition_penalty": 1.2}
    eng.add("R", [3, 5, 3], fake.SamplingParams(seed=123, extra_args={"nucleus": fields}))
    seeded = dict(fields, seed=123)
    for step in range(5):
        if step == 3:  # the committed history shrinks (two tokens dropped): reset and replay
            eng.tokens["R"] = eng.tokens["R"][:-2]
            eng._write(eng.slot["R"])
        rows = eng.layout(["R"])
        raw = model_logits(eng.tokens["R"])[None, :]
        got = one_hot_token(eng.apply(raw.copy(), rows)[0])
        assert got == oracle_params(seeded, [3, 5, 3], eng.tokens["R"][3:], raw[0],
                                    len(eng.tokens["R"]))
        eng.commit("R", [got])


def test_v2_bad_configs_are_refused_at_admission(nv):
    validate = fake.build_custom_logits_processors_params_validator(
        [nv.NucleusLogitsProcessor])
    bad = [
        ({"nucleus": [{"temperature": {"t": 0.8}}]}, "selection"),
        ({"nucleus": "[{"}, "not valid JSON"),
        ({"nucleus": 5}, "a chain"),
        ({"nucleus": [{"no_such_processor": {}}]}, "no_such_processor"),
        ({"nucleus": [{"top_k": {"k": 1.5}}, {"sample": {}}]}, r"extra_args\['nucleus'\]"),
        ({"nucleus": {"bogus": 1}}, "unknown field"),
        ({"nucleus": {"top_p": 2.0}}, "top_p"),
        ({"nucleus": [{"sample": {"n": 2}}]}, "n is 2"),
        ({"nucleus": [{"sample": {}}], "nucleus_mode": "fast"}, "nucleus_mode"),
        ({"nucleus_mode": "distribution"}, "nucleus_mode"),
    ]
    for extra, match in bad:
        with pytest.raises(fake.VLLMValidationError, match=match):
            validate(fake.SamplingParams(extra_args=extra))
    validate(fake.SamplingParams())  # no key: nothing to check
    validate(fake.SamplingParams(extra_args={"other": 1}))
    validate(fake.SamplingParams(extra_args={"nucleus": [{"sample": {"seed": 1}}]}))


def test_v2_add_request_never_raises_and_unsampleable_rows_are_left(nv, caplog):
    np_b = _numpy_backend()
    eng = fake.V2Engine([nv.NucleusLogitsProcessor], V, np_b["array"], np_b["to_numpy"])
    proc = eng.procs[0]
    # a bad config that skipped validation: declined, logged, the row untouched
    eng.states.free_indices.pop()  # slot 7 by hand, as the model runner would
    with caplog.at_level(logging.ERROR, logger="nucleus.vllm"):
        assert proc.add_request(7, fake.SamplingParams(extra_args={"nucleus": 5})) is False
    assert "declined" in caplog.text
    assert proc.add_request(6, fake.SamplingParams()) is False
    eng.add("G", [1, 2], fake.SamplingParams(extra_args={"nucleus": [{"sample": {"seed": 2}}]}))
    eng.add("H", [3], fake.SamplingParams(extra_args={"nucleus": [{"greedy": {}}]}))
    caplog.clear()
    for step in range(2):
        rows = eng.layout(["G", "H"])
        raw = np.stack([model_logits(eng.tokens["G"]), model_logits(eng.tokens["H"])])
        raw[0] = -np.inf  # nothing to sample in G's row
        with caplog.at_level(logging.WARNING, logger="nucleus.vllm"):
            out = eng.apply(raw.copy(), rows)
        assert np.all(np.isneginf(out[0]))
        assert one_hot_token(out[1]) == int(np.argmax(raw[1]))
        eng.commit("H", [int(np.argmax(raw[1]))])
    assert caplog.text.count("could not be sampled") == 1  # once per request


# --- the legacy runner ------------------------------------------------------------------------

def test_legacy_runner_batch_updates(nv, backend):
    procs = fake.build_legacy_logitsprocs(None, "cpu", False, [nv.NucleusLogitsProcessor])
    proc = procs[0]
    assert isinstance(proc, nv.NucleusLegacyLogitsProcessor)
    assert isinstance(proc, fake.V1LogitsProcessor)
    assert proc.is_argmax_invariant() is False
    cfg = {"X": CHAIN_A, "Y": CHAIN_D, "Z": None, "W": CHAIN_E}
    prompts = {"X": [1, 2, 1], "Y": [4, 4], "Z": [6], "W": [2, 3, 2, 3]}
    outputs = {rid: [] for rid in cfg}
    batch = ["X", "Y", "Z"]

    def added(i, rid):
        extra = None if cfg[rid] is None else {"nucleus": cfg[rid]}
        return (i, fake.SamplingParams(extra_args=extra), prompts[rid], outputs[rid])

    proc.update_state(fake.BatchUpdate(3, [], [added(i, r) for i, r in enumerate(batch)], []))
    assert proc.needs_output_token_ids() is True
    U, S = fake.MoveDirectionality.UNIDIRECTIONAL, fake.MoveDirectionality.SWAP
    for step in range(6):
        if step == 2:  # Y leaves; the batch condenses: Z moves down into its index
            batch = ["X", "Z"]
            proc.update_state(fake.BatchUpdate(2, [1], [], [(2, 1, U)]))
        elif step == 3:  # W joins at index 2
            batch = ["X", "Z", "W"]
            proc.update_state(fake.BatchUpdate(3, [], [added(2, "W")], []))
        elif step == 4:  # the persistent batch swaps 0 and 2
            batch = ["W", "Z", "X"]
            proc.update_state(fake.BatchUpdate(3, [], [], [(0, 2, S)]))
        else:
            proc.update_state(None)
        raw = np.stack([model_logits(prompts[r] + outputs[r]) for r in batch])
        logits = backend["logits"](raw)
        seen = backend["back"](logits).copy()
        out = backend["back"](proc.apply(logits))
        for i, rid in enumerate(batch):
            if cfg[rid] is None:
                assert np.array_equal(out[i], seen[i])
                outputs[rid].append(int(np.argmax(seen[i])))
                continue
            got = one_hot_token(out[i])
            assert got == oracle(cfg[rid], prompts[rid], outputs[rid], seen[i],
                                 len(prompts[rid]) + len(outputs[rid])), (step, rid)
            outputs[rid].append(got)  # the live list the BatchUpdate handed over


# --- registration and imports -----------------------------------------------------------------

def test_the_v2_loader_accepts_the_class_and_the_entry_point_is_installed(nv):
    np_b = _numpy_backend()
    states = fake.RequestStates(2, 8, V, np_b["array"])
    (proc,) = fake.build_custom_logits_processors(None, states, [nv.NucleusLogitsProcessor])
    assert type(proc) is nv.NucleusLogitsProcessor
    eps = importlib.metadata.entry_points(group="vllm.logits_processors")
    ours = [ep for ep in eps if ep.name == "nucleus"]
    assert [ep.value for ep in ours] == ["nucleus.vllm:NucleusLogitsProcessor"]
    assert ours[0].load() is nv.NucleusLogitsProcessor
    assert nv.PINNED_VLLM_VERSION == "0.33.0"


def test_import_without_vllm_names_the_pinned_version(monkeypatch):
    sys.modules.pop("nucleus.vllm", None)
    monkeypatch.setitem(sys.modules, "vllm", None)  # vLLM absent, whatever is installed
    with pytest.raises(ImportError, match=r"vllm==0\.33\.0"):
        importlib.import_module("nucleus.vllm")
    sys.modules.pop("nucleus.vllm", None)
    code = "import sys, nucleus; assert 'vllm' not in sys.modules and 'sglang' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_reload_over_a_new_fake(nv):
    first = nv.NucleusLogitsProcessor
    again = importlib.reload(nv)
    assert again.NucleusLogitsProcessor is not first
    assert issubclass(again.NucleusLogitsProcessor, fake.V2LogitsProcessor)
