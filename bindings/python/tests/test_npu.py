"""nucleus.npu against the specs' worked cases (spec/npu_top_k_top_p_sample.md,
spec/moe_routing.md), an independent NumPy reference written here from the specs, and the Rust
CLI (``nucleus top-k-top-p-sample`` / ``moe-init-routing``, JSON lines) on random inputs:
exact equality where the contract is exact. Also: torch_npu's output tuples and dtypes, input
arrays never written, typed errors naming the argument."""

from __future__ import annotations

import json
import math
import os
import subprocess

import ml_dtypes
import numpy as np
import pytest

import nucleus.npu as npu

RNG = np.random.default_rng(20260601)
CLI = os.path.join(os.path.dirname(__file__), "..", "..", "..", "target", "debug", "nucleus")
HAVE_CLI = os.path.exists(CLI)
needs_cli = pytest.mark.skipif(not HAVE_CLI, reason="target/debug/nucleus not built")


def cli(sub: str, calls):
    lines = "\n".join(json.dumps(c) for c in calls) + "\n"
    out = subprocess.run([CLI, sub], input=lines, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in out.stdout.splitlines()]


def num(v):
    return {"-inf": -math.inf, "inf": math.inf, "nan": math.nan}.get(v, v)


# --- npu_top_k_top_p_sample: the spec's worked cases --------------------------------------------

def test_sample_worked_case_top_k_ties():
    x = np.array([[1, 3, 2, 3]], np.float32)
    idx, sel = npu.npu_top_k_top_p_sample(x, np.array([2], np.int32), np.array([1.0], np.float32),
                                          is_need_logits=True)
    assert idx.dtype == np.int64 and idx.tolist() == [1]
    assert sel.dtype == np.float32 and sel.shape == (1, 4)
    assert sel.tolist() == [[-np.inf, 3, -np.inf, 3]]


def test_sample_worked_case_probabilities_exact_boundary():
    p = np.array([[0.25, 0.125, 0.125, 0.5]], np.float32)
    kw = dict(input_is_logits=False, is_need_logits=True)
    idx, sel = npu.npu_top_k_top_p_sample(p, [0], [0.75], **kw)
    assert idx.tolist() == [3]
    # keeps {3, 0, 1}: the mass before id 1 is 0.75, not > 0.75; id 2 (0.875 before) goes.
    assert sel.tolist() == [[0.25, 0.125, 0.0, 0.5]]
    q = np.array([[1, 1, 0.01, 1]], np.float32)
    assert npu.npu_top_k_top_p_sample(p, [0], [0.75], q, **kw)[0].tolist() == [3]
    q = np.array([[1, 0.1, 1, 1]], np.float32)
    assert npu.npu_top_k_top_p_sample(p, [0], [0.75], q, **kw)[0].tolist() == [1]


def test_sample_worked_case_top_k_out_of_range_is_skipped_per_row():
    x = RNG.normal(0, 2, size=(4, 3000)).astype(np.float32)
    top_k = np.array([0, 2000, 5, 1], np.int32)
    top_p = np.array([1.0, 1.0, 1.0, 0.5], np.float32)
    idx, sel = npu.npu_top_k_top_p_sample(x, top_k, top_p, is_need_logits=True)
    assert np.isfinite(sel[0]).all() and np.isfinite(sel[1]).all()  # stage skipped: all kept
    assert np.isfinite(sel[2]).sum() == 5 and np.isfinite(sel[3]).sum() == 1
    assert idx.tolist() == np.argmax(x, axis=1).tolist()
    # each row alone gives the same
    for b in range(4):
        alone = npu.npu_top_k_top_p_sample(x[b:b + 1], top_k[b:b + 1], top_p[b:b + 1],
                                           is_need_logits=True)
        assert alone[0][0] == idx[b] and np.array_equal(alone[1][0], sel[b])


# --- an independent NumPy reference of the spec (f64) ------------------------------------------

def reference_sample(row, k, p, q=None, min_p=None, eps=1e-8, logits=True, ks_max=1024):
    """(chosen id, survivor mask) of one row, spec stages 1-5, in f64. Valid away from exact
    boundaries (random data)."""
    v = len(row)
    x = row.astype(np.float64)
    order = np.lexsort((np.arange(v), -x))  # stable descending, ties to the lower id
    w = np.exp(x[order] - x[order[0]]) if logits else x[order]
    n = v
    if 1 <= k <= min(v, min(ks_max, 1024)):
        n = k
    if p <= 0:
        n = 1
    elif p < 1:
        pr = w[:n] / w[:n].sum()
        before = np.cumsum(pr) - pr
        n = max(1, int((before <= p).sum()))  # a prefix: before is non-decreasing
    if min_p is not None and 0 < min_p:
        if min_p >= 1:
            n = 1
        else:
            n = max(1, int((w[:n] >= min_p * w[0]).sum()))
    keep = order[:n]
    if q is None:
        chosen = keep[0]
    else:
        score = w[:n] / (q[keep].astype(np.float64) + eps)
        chosen = keep[int(np.argmax(score))]
    mask = np.zeros(v, bool)
    mask[keep] = True
    return int(chosen), mask


def test_sample_matches_the_numpy_reference_on_random_rows():
    b, v = 24, 700
    x = RNG.normal(0, 3, size=(b, v)).astype(np.float32)
    top_k = RNG.choice([0, 1, 7, 50, 699, 700, 701, 1500], size=b).astype(np.int32)
    top_p = RNG.choice([0.0, 0.3, 0.8, 0.95, 1.0], size=b).astype(np.float32)
    min_ps = RNG.choice([0.0, 0.01, 0.2, 1.0], size=b).astype(np.float32)
    q = RNG.exponential(size=(b, v)).astype(np.float32)
    for qq in (None, q):
        for m in (None, min_ps):
            idx, sel = npu.npu_top_k_top_p_sample(x, top_k, top_p, qq, min_ps=m,
                                                  is_need_logits=True)
            for r in range(b):
                want, mask = reference_sample(x[r], top_k[r], top_p[r],
                                              None if qq is None else qq[r],
                                              None if m is None else m[r])
                assert idx[r] == want, (r, top_k[r], top_p[r])
                assert np.array_equal(np.isfinite(sel[r]), mask), r
                assert np.array_equal(sel[r][mask], x[r][mask])


@needs_cli
def test_sample_equals_the_rust_cli_exactly():
    calls, args = [], []
    for t in range(6):
        b, v = 5, int(RNG.integers(2, 400))
        x = (RNG.normal(0, 2, size=(b, v))).astype(np.float32)
        x[0, : v // 3] = -np.inf
        if t == 2:
            x[1, 3] = np.nan  # a failed row
        top_k = RNG.integers(-1, v + 3, size=b).astype(np.int32)
        top_p = RNG.uniform(-0.1, 1.1, size=b).astype(np.float32)
        q = RNG.exponential(size=(b, v)).astype(np.float32) if t % 2 else None
        probs = t == 4
        if probs:
            x = np.abs(RNG.normal(size=(b, v))).astype(np.float32)
        call = {"logits": [[str(e) if not np.isfinite(e) else float(e) for e in r] for r in x],
                "top_k": top_k.tolist(), "top_p": top_p.astype(float).tolist(),
                "is_need_logits": True, "input_is_logits": not probs, "ks_max": 300}
        if q is not None:
            call["q"] = q.astype(float).tolist()
        calls.append(call)
        args.append((x, top_k, top_p, q, probs))
    for (x, top_k, top_p, q, probs), want in zip(args, cli("top-k-top-p-sample", calls)):
        idx, sel, status = npu.npu_top_k_top_p_sample(
            x, top_k, top_p, q, is_need_logits=True, input_is_logits=not probs, ks_max=300,
            return_status=True)
        assert idx.tolist() == want["logits_select_idx"]
        got = [[num(e) for e in r] for r in want["logits_top_kp_select"]]
        assert np.array_equal(sel, np.array(got, np.float32))
        assert [s is None for s in status] == [e is None for e in want["row_errors"]]


def test_half_precision_logits_equal_their_f32_values():
    x = RNG.normal(0, 2, size=(8, 500))
    top_k = RNG.integers(0, 100, size=8).astype(np.int32)
    top_p = np.full(8, 0.9, np.float32)
    q = RNG.exponential(size=(8, 500)).astype(np.float32)
    for dt in (np.float16, ml_dtypes.bfloat16):
        h = x.astype(dt)
        got = npu.npu_top_k_top_p_sample(h, top_k, top_p.astype(dt), q, is_need_logits=True)
        # top_p in the dtype of logits, widened exactly: the same values
        want = npu.npu_top_k_top_p_sample(h.astype(np.float32), top_k,
                                          top_p.astype(dt).astype(np.float32), q,
                                          is_need_logits=True)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        assert got[1].dtype == np.float32


def test_failed_rows_are_minus_one_with_a_status():
    x = np.stack([np.full(6, np.nan, np.float32), np.arange(6, dtype=np.float32),
                  np.full(6, -np.inf, np.float32)])
    idx, sel, status = npu.npu_top_k_top_p_sample(x, [0, 0, 0], [1.0, 1.0, 1.0],
                                                  is_need_logits=True, return_status=True)
    assert idx.tolist() == [-1, 5, -1]
    assert status[0].kind == "NonFiniteLogits" and status[0].row == 0
    assert status[1] is None and status[2].kind == "NoCandidates"
    assert np.all(sel[0] == -np.inf)
    q = np.ones((3, 6), np.float32)
    q[1, 5] = -1.0  # a survivor's q entry negative
    _, _, status = npu.npu_top_k_top_p_sample(x, [0, 0, 0], [1.0, 1.0, 1.0], q,
                                              return_status=True)
    assert status[1].kind == "InvalidQ" and isinstance(status[1], ValueError)


def test_sample_outputs_without_is_need_logits_and_positional_torch_npu_order():
    x = RNG.normal(size=(3, 10)).astype(np.float32)
    q = RNG.exponential(size=(3, 10)).astype(np.float32)
    # op-plugin's tests: (logits, top_k, top_p, q, eps, is_need_logits, top_k_guess)
    idx, sel = npu.npu_top_k_top_p_sample(x, [2, 2, 2], [0.9, 0.9, 0.9], q, 1e-8, False, 32)
    assert idx.dtype == np.int64 and idx.shape == (3,)
    assert sel.shape == (3, 10) and sel.dtype == np.float32 and not sel.flags.writeable
    idx2, _ = npu.npu_top_k_top_p_sample(x, [2, 2, 2], [0.9, 0.9, 0.9], q=q, eps=1e-8,
                                         is_need_logits=True, top_k_guess=-1)
    assert np.array_equal(idx, idx2)  # top_k_guess never changes a result
    # post_sample None ignores q: the argmax
    idx3, _ = npu.npu_top_k_top_p_sample(x, [0, 0, 0], [1.0, 1.0, 1.0], q, post_sample=None)
    assert idx3.tolist() == np.argmax(x, axis=1).tolist()


def test_sample_reads_a_row_stride_in_place_and_never_writes():
    wide = RNG.normal(size=(4, 64)).astype(np.float32)
    view = wide[:, :50]
    before = wide.copy()
    wide.flags.writeable = False
    q = RNG.exponential(size=(4, 50)).astype(np.float32)
    q.flags.writeable = False
    a = npu.npu_top_k_top_p_sample(view, np.array([3, 0, 9, 1], np.int32),
                                   np.array([0.5, 0.9, 1.0, 1.0], np.float32), q,
                                   is_need_logits=True)
    b = npu.npu_top_k_top_p_sample(np.ascontiguousarray(view), [3, 0, 9, 1],
                                   [0.5, 0.9, 1.0, 1.0], q, is_need_logits=True)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert np.array_equal(wide, before)


def test_sample_bad_inputs_are_typed_errors():
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(TypeError, match="logits"):
        npu.npu_top_k_top_p_sample(x.astype(np.float64), [1, 1], [1.0, 1.0])
    with pytest.raises(TypeError, match="logits"):
        npu.npu_top_k_top_p_sample([[0.0, 1.0]], [1], [1.0])
    with pytest.raises(ValueError, match="logits"):
        npu.npu_top_k_top_p_sample(np.zeros(4, np.float32), [1], [1.0])
    with pytest.raises(ValueError, match="top_k"):
        npu.npu_top_k_top_p_sample(x, [1, 1, 1], [1.0, 1.0])
    with pytest.raises(TypeError, match="top_k"):
        npu.npu_top_k_top_p_sample(x, [1.5, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="top_k"):
        npu.npu_top_k_top_p_sample(x, np.array([2**40, 1]), [1.0, 1.0])
    with pytest.raises(ValueError, match="top_p"):
        npu.npu_top_k_top_p_sample(x, [1, 1], [1.0])
    with pytest.raises(ValueError, match="min_ps"):
        npu.npu_top_k_top_p_sample(x, [1, 1], [1.0, 1.0], min_ps=[0.1])
    with pytest.raises(ValueError, match="q"):
        npu.npu_top_k_top_p_sample(x, [1, 1], [1.0, 1.0], np.ones((2, 3), np.float32))
    with pytest.raises(TypeError, match="q"):
        npu.npu_top_k_top_p_sample(x, [1, 1], [1.0, 1.0], np.ones((2, 4), np.float16))
    with pytest.raises(ValueError, match="eps"):
        npu.npu_top_k_top_p_sample(x, [1, 1], [1.0, 1.0], eps=-1.0)
    with pytest.raises(ValueError, match="ks_max"):
        npu.npu_top_k_top_p_sample(x, [1, 1], [1.0, 1.0], ks_max=0)
    with pytest.raises(TypeError, match="is_need_logits"):
        npu.npu_top_k_top_p_sample(x, [1, 1], [1.0, 1.0], is_need_logits=1)
    with pytest.raises(NotImplementedError, match="post_sample"):
        npu.npu_top_k_top_p_sample(x, [1, 1], [1.0, 1.0], post_sample="multiNomial")
    with pytest.raises(NotImplementedError, match="generator"):
        npu.npu_top_k_top_p_sample(x, [1, 1], [1.0, 1.0], generator=object())
    with pytest.raises(ValueError, match="post_sample"):
        npu.npu_top_k_top_p_sample(x, [1, 1], [1.0, 1.0], post_sample="gumbel")


# --- npu_moe_init_routing_v2: the spec's worked cases --------------------------------------------

X3 = np.array([[1, 10], [2, 20], [3, 30]], np.float32)
IDS3 = np.array([[2, 0], [1, 2], [0, 1]], np.int32)


def route(x, ids, **kw):
    return npu.npu_moe_init_routing_v2(x, ids, **kw)


def test_routing_worked_cases_dropless_scatter_keyvalue_active():
    ex, ri, tok, sc = route(X3, IDS3, expert_num=4, expert_tokens_num_type=1,
                            expert_tokens_num_flag=True)
    assert ex.tolist() == [[1, 10], [3, 30], [2, 20], [3, 30], [1, 10], [2, 20]]
    assert ex.dtype == np.float32 and ri.dtype == np.int32 and tok.dtype == np.int64
    assert ri.tolist() == [4, 0, 2, 5, 1, 3] and tok.tolist() == [2, 2, 2, 0] and sc is None
    _, ri, tok, _ = route(X3, IDS3, expert_num=4, row_idx_type=1, expert_tokens_num_type=0,
                          expert_tokens_num_flag=True)
    assert ri.tolist() == [1, 4, 2, 5, 0, 3] and tok.tolist() == [2, 4, 6, 6]
    _, _, tok, sc = route(X3, IDS3, expert_num=4, expert_tokens_num_type=2,
                          expert_tokens_num_flag=True,
                          scale=np.array([0.5, 0.25, 0.125], np.float32))
    assert tok.shape == (4, 2) and tok.tolist() == [[0, 2], [1, 2], [2, 2], [0, 0]]
    assert sc.dtype == np.float32 and sc.tolist() == [0.5, 0.125, 0.25, 0.125, 0.5, 0.25]
    ex, ri, tok, _ = route(X3, IDS3, expert_num=4, active_num=4, expert_tokens_num_type=1,
                           expert_tokens_num_flag=True)
    assert ex.tolist() == [[1, 10], [3, 30], [2, 20], [3, 30]]
    assert ri.tolist() == [4, 0, 2, 5, 1, 3] and tok.tolist() == [2, 2, 2, 0]
    # no flag: torch_npu's third output is meaningless, None here
    assert route(X3, IDS3, expert_num=4)[2] is None


def test_routing_worked_cases_range_droppad_quant_sentinel():
    x = np.array([[1, 1.5], [2, 2.5], [3, 3.5], [4, 4.5]], np.float32)
    ids = np.array([[0, 3], [1, 2], [3, 1], [2, 0]], np.int32)
    ex, ri, tok, _ = route(x, ids, expert_num=4, active_expert_range=[1, 3],
                           expert_tokens_num_type=1, expert_tokens_num_flag=True)
    assert ex[:4].tolist() == [[2, 2.5], [3, 3.5], [2, 2.5], [4, 4.5]]
    assert ri.tolist() == [-1, -1, 0, 2, -1, 1, 3, -1] and tok.tolist() == [2, 2]

    x = np.array([[1, -1], [2, -2], [3, -3], [4, -4]], np.float32)
    ids = np.array([[0, 1], [0, 2], [1, 0], [0, 2]], np.int32)
    ex, ri, tok, sc = route(x, ids, expert_num=4, drop_pad_mode=1, expert_capacity=2,
                            expert_tokens_num_type=1, expert_tokens_num_flag=True,
                            scale=np.array([1, 2, 3, 4], np.float32))
    assert ex.shape == (4, 2, 2)
    assert ex.tolist() == [[[1, -1], [2, -2]], [[1, -1], [3, -3]], [[2, -2], [4, -4]],
                           [[0, 0], [0, 0]]]
    assert ri.tolist() == [0, 2, 1, 4, 3, -1, -1, 5] and tok.tolist() == [4, 2, 2, 0]
    assert sc.tolist() == [1, 2, 1, 3, 2, 4, 0, 0]

    x = np.array([[254, 5, -3], [-127, 62.5, 0.5]], np.float32)
    ex, ri, _, sc = route(x, np.array([[1], [0]]), expert_num=2, quant_mode=1)
    assert ex.dtype == np.int8 and ex.tolist() == [[-127, 62, 0], [127, 2, -2]]
    assert sc.tolist() == [1.0, 2.0] and ri.tolist() == [1, 0]

    x = np.array([[0.25, 1, 100, -70], [-0.75, 0, -1.25, 63]], np.float32)
    ex, _, _, sc = route(x, np.array([[1], [0]]), expert_num=2, quant_mode=0,
                         scale=np.array([2], np.float32), offset=np.array([0.5], np.float32))
    assert ex.dtype == np.int8 and ex.tolist() == [[-1, 0, -2, 126], [1, 2, 127, -128]]
    assert sc is None

    x = np.array([[1], [2]], np.float32)
    ex, ri, tok, _ = route(x, np.array([[0, -1], [2, 0]]), expert_num=3,
                           expert_tokens_num_type=1, expert_tokens_num_flag=True)
    assert ex[:3].tolist() == [[1], [2], [2]] and ri.tolist() == [0, -1, 2, 1]
    assert tok.tolist() == [2, 0, 1]


def reference_routing(x, ids, e, start=0, end=None):
    """Dropless gather routing written from the spec's "Order" and "Outputs"."""
    end = e if end is None else end
    flat = ids.ravel()
    k = ids.shape[1]
    j = np.arange(flat.size)
    inr = (flat >= start) & (flat < end)
    hi = flat >= end
    order = np.concatenate([j[inr][np.argsort(flat[inr], kind="stable")],
                            j[hi][np.argsort(flat[hi], kind="stable")],
                            j[~inr & ~hi]])
    a = int(inr.sum())
    ex = np.zeros((flat.size, x.shape[1]), x.dtype)
    ex[:a] = x[order[:a] // k]
    gather = np.full(flat.size, -1, np.int32)
    gather[order[:a]] = np.arange(a)
    counts = np.bincount(flat[inr] - start, minlength=end - start)
    return ex, gather, order.astype(np.int32), counts


def test_routing_matches_the_numpy_reference_on_random_inputs():
    for _ in range(10):
        n, k, h, e = int(RNG.integers(1, 40)), int(RNG.integers(1, 5)), 3, int(RNG.integers(2, 12))
        x = RNG.normal(size=(n, h)).astype(np.float32)
        ids = RNG.integers(-2, e + 2, size=(n, k)).astype(np.int32)
        start = int(RNG.integers(0, e - 1))
        end = int(RNG.integers(start + 1, e + 1))
        ex, gather, order, counts = reference_routing(x, ids, e, start, end)
        got = route(x, ids, expert_num=e, active_expert_range=[start, end],
                    expert_tokens_num_type=1, expert_tokens_num_flag=True)
        assert np.array_equal(got[0], ex) and np.array_equal(got[1], gather)
        assert np.array_equal(got[2], counts)
        sc = route(x, ids, expert_num=e, active_expert_range=[start, end], row_idx_type=1)[1]
        assert np.array_equal(sc, order)


@needs_cli
def test_routing_equals_the_rust_cli_exactly():
    calls, args = [], []
    modes = [dict(), dict(row_idx_type=1, expert_tokens_num_type=0),
             dict(expert_tokens_num_type=2), dict(active_num=5), dict(quant_mode=1),
             dict(drop_pad_mode=1, expert_capacity=2), dict(active_expert_range=[1, 4])]
    for m in modes:
        for dt, name in ((np.float32, "f32"), (ml_dtypes.bfloat16, "bf16"), (np.float16, "f16")):
            n, k, h, e = 7, 2, 3, 5
            x = RNG.normal(0, 3, size=(n, h)).astype(dt)
            ids = RNG.integers(-1, e + 1, size=(n, k)).astype(np.int32)
            if m.get("drop_pad_mode") == 1:
                ids = RNG.integers(0, e, size=(n, k)).astype(np.int32)
                m = dict(m, expert_tokens_num_type=1)
            kw = dict(m, expert_num=e, expert_tokens_num_flag=True)
            calls.append(dict(kw, x=x.astype(np.float64).tolist(), expert_idx=ids.tolist(),
                              x_dtype=name))
            args.append((x, ids, kw))
    for (x, ids, kw), want in zip(args, cli("moe-init-routing", calls)):
        assert "error" not in want, want
        ex, ri, tok, sc = route(x, ids, **kw)
        # the CLI writes the shortest decimal that reads back to the value in its dtype
        wx = np.array(want["expanded_x"], np.float64).astype(ex.dtype)
        assert np.array_equal(ex, wx), kw
        assert ex.dtype == (np.int8 if kw.get("quant_mode") == 1 else x.dtype)
        assert ri.tolist() == want["expanded_row_idx"]
        assert np.array(tok).tolist() == want["expert_tokens"]
        if want["expanded_scale"] is None:
            assert sc is None
        else:
            assert np.array_equal(sc, np.array(want["expanded_scale"], np.float32))


def test_routing_input_never_written_and_bad_inputs_typed():
    x = RNG.normal(size=(4, 3)).astype(np.float32)
    ids = RNG.integers(0, 4, size=(4, 2)).astype(np.int32)
    xb, ib = x.copy(), ids.copy()
    x.flags.writeable = False
    ids.flags.writeable = False
    route(x, ids, expert_num=4, quant_mode=1)
    assert np.array_equal(x, xb) and np.array_equal(ids, ib)
    with pytest.raises(NotImplementedError, match="quant_mode"):
        route(x, ids, expert_num=4, quant_mode=2)
    with pytest.raises(ValueError, match="expert_num"):
        route(x, ids)
    with pytest.raises(ValueError, match="quant_mode"):
        route(x, ids, expert_num=4, quant_mode=7)
    with pytest.raises(ValueError, match="drop_pad_mode"):
        route(x, ids, expert_num=4, drop_pad_mode=3)
    with pytest.raises(ValueError, match="expert_capacity"):
        route(x, ids, expert_num=4, drop_pad_mode=1, expert_capacity=0,
              expert_tokens_num_type=1)
    with pytest.raises(ValueError, match="active_expert_range"):
        route(x, ids, expert_num=4, active_expert_range=[3, 1])
    with pytest.raises(ValueError, match="active_expert_range"):
        route(x, ids, expert_num=4, active_expert_range=[1])
    with pytest.raises(TypeError, match="x must"):
        route(x.astype(np.float64), ids, expert_num=4)
    with pytest.raises(TypeError, match="expert_idx"):
        route(x, ids.astype(np.float32), expert_num=4)
    with pytest.raises(ValueError, match="expert_idx"):
        route(x, ids[:3], expert_num=4)
    with pytest.raises(TypeError, match="scale"):
        route(x, ids, expert_num=4, scale=np.ones(4, np.float64))
    with pytest.raises(ValueError, match="scale"):
        route(x, ids, expert_num=4, scale=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="i8|int8|quant"):
        route(x.astype(np.int8), ids, expert_num=4, quant_mode=1)


# --- gating, finalize, unpermute ------------------------------------------------------------------

def test_gating_softmax_worked_case_and_outputs():
    x = np.array([[0, np.log(3), np.log(2), -np.inf]], np.float32)
    y, ids, row_idx = npu.npu_moe_gating_top_k_softmax(x, k=2)
    assert ids.tolist() == [[1, 2]] and ids.dtype == np.int32
    assert np.allclose(y, [[0.5, 1 / 3]], atol=1e-7) and y.dtype == np.float32
    assert row_idx.tolist() == [[0, 1]] and row_idx.dtype == np.int32
    # 3-D input, finished rows, row_idx = arange(N*k).reshape(k, N).T
    x = RNG.normal(size=(2, 3, 6)).astype(np.float16)
    fin = np.array([[False, True, False], [False, False, True]])
    y, ids, row_idx = npu.npu_moe_gating_top_k_softmax(x, fin, k=2)
    assert y.shape == ids.shape == row_idx.shape == (2, 3, 2) and y.dtype == np.float16
    assert row_idx.reshape(6, 2).tolist() == np.arange(12).reshape(2, 6).T.tolist()
    assert np.all(ids[fin] == 6)
    p = np.exp(x.astype(np.float32))
    p /= p.sum(-1, keepdims=True)
    want = np.argsort(-p, axis=-1, kind="stable")[..., :2]
    assert np.array_equal(ids[~fin], want[~fin])


def test_gating_grouped_matches_the_torch_npu_numpy_golden():
    # The golden of torch_npu's documentation page, restated: sigmoid + bias, top-2-sum groups,
    # renormalised because norm_type is 1.
    x = RNG.uniform(-2, 2, (8, 64)).astype(np.float32)
    bias = RNG.uniform(-2, 2, (64,)).astype(np.float32)
    k, k_group, groups = 6, 4, 8
    s = 1 / (1 + np.exp(-x.astype(np.float64)))
    b = (s + bias).reshape(8, groups, -1)
    gs = np.sort(b, axis=-1)[..., -2:].sum(-1)
    top_g = np.argsort(-gs, axis=-1, kind="stable")[:, :k_group]
    mask = np.ones((8, groups), bool)
    mask[np.arange(8)[:, None], top_g] = False
    bb = np.where(mask[..., None], -np.inf, b).reshape(8, -1)
    want_ids = np.argsort(-bb, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(s, want_ids, 1)
    w = w / (w.sum(-1, keepdims=True) + 1e-20) * 2.5
    y, ids, norm_out = npu.npu_moe_gating_top_k(x, k, bias=bias, k_group=k_group,
                                                group_count=groups, group_select_mode=1,
                                                norm_type=1, routed_scaling_factor=2.5)
    assert np.array_equal(ids, want_ids) and np.allclose(y, w, atol=1e-6) and norm_out is None
    with pytest.raises(NotImplementedError, match="out_flag"):
        npu.npu_moe_gating_top_k(x, k, out_flag=True)
    with pytest.raises(NotImplementedError, match="input_ids"):
        npu.npu_moe_gating_top_k(x, k, input_ids=np.zeros(8, np.int32))
    with pytest.raises(NotImplementedError, match="renorm"):
        npu.npu_moe_gating_top_k(x, k, renorm=1)


def test_unpermute_worked_case_and_torch_npu_example():
    ex, ri, _, _ = route(X3, IDS3, expert_num=4)
    w = np.array([[0.5, 0.5], [0.25, 0.75], [1, 0]], np.float32)
    out = npu.npu_moe_token_unpermute(ex, ri, probs=w)
    assert out.tolist() == [[1, 10], [2, 20], [3, 30]] and out.dtype == np.float32
    # the example of torch_npu's page
    t = np.array([[1, 1], [2, 2], [3, 3], [4, 4]] * 2, np.float16)
    s = np.array([0, 4, 5, 1, 2, 6, 7, 3], np.int32)
    out = npu.npu_moe_token_unpermute(t, s, probs=np.full((4, 2), 0.5, np.float16))
    assert out.dtype == np.float16 and out.tolist() == [[1, 1], [2, 2], [3, 3], [4, 4]]
    assert npu.npu_moe_token_unpermute(t[:4], np.arange(4)).tolist() == t[:4].tolist()
    with pytest.raises(NotImplementedError, match="padded_mode"):
        npu.npu_moe_token_unpermute(t, s, padded_mode=True)


def reference_finalize(rows, skip1, skip2, bias, scales, idx, experts, mode):
    """torch_npu's page golden, with the spec's rule that a -1 route adds nothing."""
    k = scales.shape[1]
    n = idx.size // k
    rows = rows.reshape(-1, rows.shape[-1]).astype(np.float64)
    out = skip1.astype(np.float64) + skip2
    for i in range(n):
        for j in range(k):
            v = idx[j * n + i] if mode in (0, 1) else idx[i * k + j]
            if v != -1:
                out[i] += scales[i, j] * (rows[v] + bias[experts[i, j]])
    return out


def test_finalize_matches_the_reference_in_every_layout():
    n, k, h, e = 6, 3, 4, 5
    for mode in (0, 1, 2, 3):
        c = 4
        rows = RNG.normal(size=(e, c, h) if mode in (1, 3) else (n * k, h)).astype(np.float32)
        total = e * c if mode in (1, 3) else n * k
        idx = RNG.permutation(total)[: n * k].astype(np.int32)
        if mode in (1, 3):
            idx[:3] = -1
        skip1, skip2 = (RNG.normal(size=(n, h)).astype(np.float32) for _ in range(2))
        bias = RNG.normal(size=(e, h)).astype(np.float32)
        scales = RNG.normal(size=(n, k)).astype(np.float32)
        experts = RNG.integers(0, e, size=(n, k)).astype(np.int32)
        out = npu.npu_moe_finalize_routing(rows, skip1, skip2, bias, scales, idx, experts,
                                           drop_pad_mode=mode)
        want = reference_finalize(rows, skip1, skip2, bias, scales, idx, experts, mode)
        assert out.shape == (n, h) and out.dtype == np.float32
        assert np.abs(out - want).max() < 1e-5, mode
    with pytest.raises(ValueError, match="skip2"):
        npu.npu_moe_finalize_routing(rows, None, skip2, None, scales, idx, None, 3)
    with pytest.raises(ValueError, match="drop_pad_mode"):
        npu.npu_moe_finalize_routing(rows, None, None, None, scales, idx, None, 7)


def test_moe_layer_routed_equals_naive():
    # spec "The MoE layer": gating -> init_routing -> per-expert MLP -> unpermute
    t, h, e, k, inter = 16, 8, 4, 2, 6
    x = RNG.normal(size=(t, h)).astype(np.float32)
    wg = RNG.normal(size=(e, h)).astype(np.float32)
    experts = [tuple(RNG.normal(size=s).astype(np.float32) for s in ((inter, h), (inter, h),
                                                                      (h, inter)))
               for _ in range(e)]

    def mlp(i, v):
        g, u, d = experts[i]
        a = v @ g.T
        return ((a / (1 + np.exp(-a))) * (v @ u.T)) @ d.T

    w, ids, _ = npu.npu_moe_gating_top_k_softmax(x @ wg.T, k=k)
    w = w / (w.sum(-1, keepdims=True) + 1e-20)
    naive = np.zeros_like(x)
    for i in range(t):
        for j in range(k):
            naive[i] += w[i, j] * mlp(ids[i, j], x[i])
    ex, ri, tok, _ = route(x, ids, expert_num=e, expert_tokens_num_type=1,
                           expert_tokens_num_flag=True)
    out_rows = np.zeros_like(ex)
    start = 0
    for i, c in enumerate(tok):
        out_rows[start:start + c] = mlp(i, ex[start:start + c])
        start += c
    y = npu.npu_moe_token_unpermute(out_rows, ri, probs=w)
    # float32 rounding: the per-row and the batched matmuls may take different BLAS kernels, so
    # the bound is relative to the values (~20 here); a routing error would be O(1).
    assert np.abs(y - naive).max() <= 1e-5 * max(1.0, float(np.abs(naive).max()))
