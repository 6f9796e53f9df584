"""PyTorch tensors through DLPack (``nucleus._dlpack``, src/dlpack.rs): every public function
with torch input gives torch output equal, bit for bit, to its NumPy path; imports and exports
share memory (no copy), in-place functions write the caller's tensor and nothing else is
written; CPU only, with typed errors.

Runs when torch is importable (``.ci/run`` does not install it: PyPI's torch is the CUDA
build, about 3 GB); skipped otherwise."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import nucleus  # noqa: E402
import nucleus.npu as npu  # noqa: E402
import nucleus.torch as nt  # noqa: E402
from nucleus import _dlpack  # noqa: E402

RNG = np.random.default_rng(20261205)


def as_numpy(t):
    """An independent NumPy copy of a CPU tensor (bf16 through its bits)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


def same(torch_out, numpy_out):
    """Torch results equal NumPy (or other torch) results, type for type, bit for bit."""
    if isinstance(numpy_out, torch.Tensor):
        numpy_out = as_numpy(numpy_out)
    if isinstance(numpy_out, np.ndarray):
        assert isinstance(torch_out, torch.Tensor), type(torch_out)
        got = as_numpy(torch_out)
        assert got.dtype == numpy_out.dtype and got.shape == numpy_out.shape
        np.testing.assert_array_equal(got.view(np.uint8), numpy_out.view(np.uint8))
    elif isinstance(numpy_out, (tuple, list)):
        assert type(torch_out) is type(numpy_out) and len(torch_out) == len(numpy_out)
        for a, b in zip(torch_out, numpy_out):
            same(a, b)
    elif isinstance(numpy_out, nucleus.SamplingError):
        assert (torch_out.kind, torch_out.row) == (numpy_out.kind, numpy_out.row)
    else:
        assert torch_out == numpy_out


def both(fn, *args, **kwargs):
    """``fn`` on torch arguments and on NumPy copies of them; the results must be the same."""
    conv = lambda v: as_numpy(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
    snapshot = [as_numpy(a) for a in args if isinstance(a, torch.Tensor)]
    t_out = fn(*args, **kwargs)
    n_out = fn(*[conv(a) for a in args], **{k: conv(v) for k, v in kwargs.items()})
    same(t_out, n_out)
    # The inputs were read, never written.
    for before, a in zip(snapshot, [a for a in args if isinstance(a, torch.Tensor)]):
        np.testing.assert_array_equal(as_numpy(a).view(np.uint8), before.view(np.uint8))
    return t_out


# --- the DLPack exchange itself -----------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
          torch.uint8, torch.int8, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES)
def test_import_shares_memory_for_every_dtype_and_layout(dtype):
    base = (torch.randn(6, 40) * 10).to(dtype)
    for t in (base, base[:, :33], base[1::2, 3:], base.t()):
        a = _dlpack.to_numpy(t)
        assert a.ctypes.data == t.data_ptr()
        assert a.shape == tuple(t.shape)
        assert a.strides == tuple(s * t.element_size() for s in t.stride())
        np.testing.assert_array_equal(a.view(np.uint8) if a.dtype.itemsize == 1 else a,
                                      as_numpy(t).view(np.uint8) if a.dtype.itemsize == 1
                                      else as_numpy(t))
    a = _dlpack.to_numpy(base)
    assert a.flags.writeable
    a[0, 0] = a[0, 1]
    assert bool((base[0, 0] == base[0, 1]).item())  # a write through the view reaches the tensor


def test_the_import_keeps_the_tensor_alive_and_the_export_keeps_the_array_alive():
    a = _dlpack.to_numpy(torch.arange(1000, dtype=torch.float32))
    gc.collect()
    junk = [torch.full((1000,), -7.0) for _ in range(50)]  # reuse freed memory, if any
    np.testing.assert_array_equal(a, np.arange(1000, dtype=np.float32))
    del junk
    arr = np.arange(1000, dtype=np.float32)
    t = _dlpack.to_torch(arr)
    assert t.data_ptr() == arr.ctypes.data
    t[0] = 42.0
    assert arr[0] == 42.0  # the export shares memory both ways
    del arr
    gc.collect()
    junk = [np.full(1000, -7.0, np.float32) for _ in range(50)]
    assert t[0].item() == 42.0 and t[999].item() == 999.0


def test_bfloat16_and_strided_exports_are_exact_and_zero_copy():
    x = RNG.normal(size=(4, 10)).astype(ml_dtypes.bfloat16)
    t = _dlpack.to_torch(x)
    assert t.dtype == torch.bfloat16 and t.data_ptr() == x.ctypes.data
    np.testing.assert_array_equal(t.view(torch.int16).numpy(), x.view(np.int16))
    big = np.arange(60, dtype=np.float32).reshape(6, 10)
    v = big[::2, 1:7]
    tv = _dlpack.to_torch(v)
    assert tv.data_ptr() == v.ctypes.data and tv.stride() == (20, 1)
    np.testing.assert_array_equal(tv.numpy(), v)
    with pytest.raises(ValueError, match="byte order"):
        _dlpack.to_torch(np.arange(3, dtype=">f4"))


def test_device_dtype_and_view_errors_are_typed():
    with pytest.raises(ValueError, match="CPU"):
        nucleus.sample(torch.zeros(2, 5, device="meta"))
    with pytest.raises(ValueError, match="element type"):
        _dlpack.to_numpy(torch.zeros(2, 3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="conj"):
        nucleus.sample(torch.zeros(2, 3, dtype=torch.complex64).conj())
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        nucleus.sample(torch.zeros(2, 5, dtype=torch.int32))
    # A tensor that requires grad is read through detach(): the same memory.
    w = torch.randn(3, 8, requires_grad=True)
    assert torch.equal(nucleus.sample(w, seed=1).token_ids,
                       nucleus.sample(w.detach().clone(), seed=1).token_ids)


# --- every public function: torch in, torch out, equal to NumPy ---------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sample_and_distribution(dtype):
    logits = (torch.randn(8, 300) * 3).to(dtype)
    big = torch.randn(8, 320).to(dtype)
    big[:, :300] = logits
    r = both(nucleus.sample, logits, temperature=0.8, top_k=torch.tensor([0, 5] * 4),
             top_p=torch.full((8,), 0.9), min_p=0.01, seed=torch.arange(8), position=3)
    assert r.token_ids.dtype == torch.int64 and r.logprobs.dtype == torch.float64
    assert r.seeds.dtype == torch.uint64
    view = big[:, :300]  # a row stride, read in place
    same(nucleus.sample(view, seed=np.arange(8)), nucleus.sample(logits, seed=np.arange(8)))
    p, errors = both(nucleus.distribution, logits, top_k=20, output_ids=[[1, 2]] * 8,
                     repetition_penalty=1.3)
    assert p.dtype == torch.float64 and errors == [None] * 8
    mask = nt.allocate_token_bitmask(8, 300)
    mask[:, 0] = 0
    r = both(nucleus.sample, logits, token_bitmask=mask, seed=torch.arange(8))
    assert bool((r.token_ids >= 32).all())
    both(nucleus.sample, logits, params=nucleus.SamplingParams(typical_p=0.8, seed=3))


def test_flashinfer_functions():
    b, v = 6, 50
    logits = torch.randn(b, v)
    probs = torch.softmax(logits, -1)
    k = torch.tensor([0, 3, 10, 50, 1, 7], dtype=torch.int32)
    p = torch.tensor([0.9, 0.5, 1.0, 0.3, 0.8, 0.95])
    s = dict(seed=list(range(b)), offset=4)
    out = both(nucleus.top_k_top_p_sampling_from_logits, logits, k, p, **s)
    assert out.dtype == torch.int32
    both(nucleus.top_k_top_p_sampling_from_probs, probs, k, p, **s)
    both(nucleus.top_p_sampling_from_probs, probs, p, **s)
    both(nucleus.top_k_sampling_from_probs, probs, k, **s)
    both(nucleus.min_p_sampling_from_probs, probs, torch.full((b,), 0.1), **s)
    both(nucleus.top_k_renorm_probs, probs, k)
    both(nucleus.top_p_renorm_probs, probs, p)
    both(nucleus.top_k_mask_logits, logits.to(torch.bfloat16), 5)
    idx = torch.tensor([5, 0, 0, 2], dtype=torch.int64)
    out = both(nucleus.top_k_top_p_sampling_from_logits, logits, 5, 0.9, idx, **dict(
        seed=[1, 2, 3, 4], offset=0))
    assert out.dtype == torch.int64
    gen = torch.Generator().manual_seed(1234)
    both(nucleus.top_p_sampling_from_probs, probs, 0.9, generator=gen)
    q = torch.softmax(torch.randn(3, 2, v), -1)
    t = torch.softmax(torch.randn(3, 3, v), -1)
    ids = torch.randint(0, v, (3, 2), dtype=torch.int32)
    out, acc, emi = both(nucleus.chain_speculative_sampling, q, ids, t, seed=[1, 2, 3], offset=0)
    assert out.shape == (3, 3) and isinstance(acc, torch.Tensor)


def test_bitmask_in_place_on_a_tensor_and_on_a_view():
    v = 70
    logits = torch.randn(4, 80)
    before = logits.clone()
    mask = nt.allocate_token_bitmask(4, v)
    assert mask.dtype == torch.int32 and tuple(mask.shape) == (4, 3)
    assert bool((mask == -1).all())
    mask[1, 0] = 0  # row 1: ids 0..31 banned
    view = logits[:, :v]  # a padded LM head's first 70 columns, in place
    assert nucleus.apply_token_bitmask_inplace(view, mask) is None
    assert bool(torch.isinf(logits[1, :32]).all()) and bool((logits[1, 32:v] == before[1, 32:v]).all())
    assert torch.equal(logits[:, v:], before[:, v:])  # beyond the view: untouched
    assert torch.equal(logits[0, :v], before[0, :v])
    np_logits = as_numpy(before)
    nucleus.apply_token_bitmask_inplace(np_logits[:, :v], as_numpy(mask))
    np.testing.assert_array_equal(as_numpy(logits), np_logits)


def test_sampler_chain_on_torch_rows():
    chain = nucleus.SamplerChain([{"temperature": {"t": 0.7}}, {"top_k": {"k": 20}},
                                  {"sample": {"seed": 5}}])
    row = torch.randn(100)
    chain.reset([1, 2])
    tok = chain.sample(row, position=2)
    chain.reset([1, 2])
    assert chain.sample(as_numpy(row), position=2) == tok
    d = chain.distribution(row, position=2)
    assert isinstance(d, torch.Tensor) and d.dtype == torch.float64
    np.testing.assert_array_equal(d.numpy(), chain.distribution(as_numpy(row), position=2))


def test_npu_operators_return_torch_npu_tuples_on_torch_input():
    logits = torch.randn(4, 64).to(torch.bfloat16)
    k = torch.tensor([5, 10, 64, 1], dtype=torch.int32)
    p = torch.tensor([0.9, 0.5, 1.0, 0.7]).to(torch.bfloat16)
    q = torch.rand(4, 64)
    idx, sel = both(npu.npu_top_k_top_p_sample, logits, k, p, q, is_need_logits=True)
    assert idx.dtype == torch.int64 and sel.dtype == torch.float32
    x = torch.randn(6, 8)
    expert_idx = torch.randint(0, 4, (6, 2), dtype=torch.int32)
    outs = both(npu.npu_moe_init_routing_v2, x, expert_idx, expert_num=4,
                expert_tokens_num_type=1, expert_tokens_num_flag=True)
    assert isinstance(outs[0], torch.Tensor) and outs[1].dtype == torch.int32
    gating = torch.randn(6, 4)
    w, ids, rows = both(npu.npu_moe_gating_top_k_softmax, gating, k=2)
    assert ids.dtype == torch.int32
    both(npu.npu_moe_gating_top_k, torch.randn(6, 8), 2)
    expanded, row_idx = outs[0], outs[1]
    both(npu.npu_moe_token_unpermute, expanded, row_idx, probs=w)


def test_grammar_matcher_fills_a_torch_bitmask_in_place():
    from pathlib import Path

    tokenizer = (Path(__file__).resolve().parents[3].parent / "shared" / "models"
                 / "minimind-tokenizer" / "tokenizer.json")
    compiler = nucleus.GrammarCompiler(tokenizer, eos_token_ids=[2])
    grammar = compiler.compile_json_schema({"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]})
    m_t, m_n = nucleus.GrammarMatcher(grammar), nucleus.GrammarMatcher(grammar)
    t = nt.allocate_token_bitmask(3, compiler.vocab_size)
    a = nucleus.allocate_token_bitmask(3, compiler.vocab_size)
    ptr = t.data_ptr()
    assert m_t.fill_next_token_bitmask(t, index=2) == m_n.fill_next_token_bitmask(a, index=2)
    assert t.data_ptr() == ptr  # written in place, not replaced
    np.testing.assert_array_equal(t.numpy(), a)
    assert bool((t[:2] == -1).all())  # the other rows untouched


def test_sparse_and_expanded_tensors_are_refused_with_nucleus_errors():
    with pytest.raises(ValueError, match="dense"):
        nucleus.sample(torch.zeros(2, 10).to_sparse())
    row = torch.full((1, 8), -1, dtype=torch.int32)
    logits = torch.zeros(1, 256)
    with pytest.raises(ValueError, match="overlap"):
        nucleus.apply_token_bitmask_inplace(logits.expand(3, 256), row.expand(3, 8))
