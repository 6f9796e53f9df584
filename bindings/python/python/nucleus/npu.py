"""nucleus.npu: the Ascend operators with torch_npu's signatures, on NumPy arrays (a CPU golden).

An NPU test swaps ``torch_npu.npu_xxx`` for ``nucleus.npu.npu_xxx`` with the same argument
names, defaults and output tuples (NumPy arrays in torch_npu's dtypes: int64 / int32 indices,
float32 / the input's dtype values). The semantics are the project's contracts
(``spec/npu_top_k_top_p_sample.md`` and ``spec/moe_routing.md`` in the shared folder), computed
by the Rust crates ``nucleus-sampling`` (``npu::top_k_top_p_sample``) and ``nucleus-moe``.

Conventions: inputs are read, never written; a torch_npu argument or value that nucleus does not
implement raises ``NotImplementedError`` naming it; a wrong type is a ``TypeError``, a wrong
shape or value a ``ValueError``, both naming the argument. Where torch_npu leaves an output
meaningless (``expert_tokens_num_flag=False``, no ``scale``), nucleus returns ``None`` in its
place; the tuple keeps torch_npu's length. The Rust work runs with the GIL released.

Sources of the prototypes: the torch_npu documentation in the repository Ascend/op-plugin
(``docs/{zh,en}/custom_APIs/torch_npu/torch_npu-<name>.md``), named in each docstring.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from . import SamplingError, _core
from ._dlpack import torch_io

__all__ = [
    "npu_top_k_top_p_sample",
    "npu_moe_init_routing_v2",
    "npu_moe_gating_top_k_softmax",
    "npu_moe_gating_top_k",
    "npu_moe_finalize_routing",
    "npu_moe_token_unpermute",
]

_FLOATS = ("float32", "float16", "bfloat16")


# --- argument checks ----------------------------------------------------------------------------

def _array(name: str, value, dtypes, ndims) -> np.ndarray:
    """``value`` as a NumPy array whose dtype name is in ``dtypes`` and whose rank is in
    ``ndims``; a NumPy array of another dtype is a TypeError (no silent conversion), a Python
    sequence is converted to the first dtype."""
    if isinstance(value, np.ndarray):
        a = value
    elif hasattr(value, "__array__") and not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a numpy.ndarray (torch tensors come in a later "
                        f"release), got {type(value).__name__}")
    else:
        try:
            a = np.asarray(value)
        except Exception as e:  # ragged lists and the like
            raise ValueError(f"{name}: {e}") from None
        if a.dtype.kind in "biuf" and not (a.dtype.kind == "b" and dtypes[0] != "bool"):
            if dtypes[0] == "bool" and a.dtype.kind != "b":
                raise TypeError(f"{name} must be bool, got dtype {a.dtype}")
            if dtypes[0].startswith("int") and a.dtype.kind == "f":
                raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
            a = _cast_checked(name, a, dtypes[0])
    if a.dtype.name not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(dtypes)}, got dtype {a.dtype}")
    if a.ndim not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dimensions, "
                         f"got shape {a.shape}")
    return a


def _cast_checked(name: str, a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype.startswith("int") and a.size:
        info = np.iinfo(dtype)
        if a.min() < info.min or a.max() > info.max:
            raise ValueError(f"{name} holds values outside {dtype}")
    if dtype == "bfloat16":
        import ml_dtypes
        return a.astype(ml_dtypes.bfloat16)
    return a.astype(dtype)


def _int_array(name: str, value, dtype: str, ndims) -> np.ndarray:
    """An integer array of any integer dtype, converted (range-checked) to ``dtype``."""
    a = value if isinstance(value, np.ndarray) else np.asarray(value)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers ({dtype}), got dtype {a.dtype}")
    if a.ndim not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dimensions, "
                         f"got shape {a.shape}")
    if a.dtype.name != dtype:
        a = _cast_checked(name, a, dtype)
    return np.ascontiguousarray(a)


def _float32(name: str, value, ndims) -> np.ndarray:
    """A float32 C-contiguous copy or view of ``value``: float16 / bfloat16 / float32 arrays
    (exact widening) or numbers; float64 is rounded to float32, as the operators read it."""
    a = value if isinstance(value, np.ndarray) else np.asarray(value)
    if a.dtype.kind not in "fiu" and a.dtype.name != "bfloat16":
        raise TypeError(f"{name} must hold floating-point numbers, got dtype {a.dtype}")
    if a.ndim not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dimensions, "
                         f"got shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.float32)


def _int(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not -2**63 <= int(value) < 2**63:
        raise ValueError(f"{name} {int(value)} is outside the 64-bit integers")
    return int(value)


def _bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _float(name: str, value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                     np.floating)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    return float(value)


def _not_implemented(name: str, value, why: str):
    raise NotImplementedError(f"{name}={value!r} is not implemented by nucleus.npu: {why}")


# --- npu_top_k_top_p_sample ---------------------------------------------------------------------


@torch_io
def npu_top_k_top_p_sample(logits, top_k, top_p, q=None, eps=1e-8, is_need_logits=False,
                           top_k_guess=32, min_ps=None, ks_max=1024, input_is_logits=True,
                           post_sample="qSample", generator=None, *, return_status=False,
                           q_indexing="token_id"):
    """Fused top-k -> top-p -> min-p -> exponential sampling (spec/npu_top_k_top_p_sample.md).

    Prototype followed (torch_npu documentation, Ascend/op-plugin
    ``docs/en/custom_APIs/torch_npu/torch_npu-npu_top_k_top_p_sample.md``, and the runtime
    schema ``torch.ops.npu.npu_top_k_top_p_sample.default._schema`` it matches)::

        torch_npu.npu_top_k_top_p_sample(logits, top_k, top_p, q=None, eps=1e-8,
            is_need_logits=False, top_k_guess=32, min_ps=None, ks_max=1024,
            input_is_logits=True, post_sample='qSample', generator=None) -> (Tensor, Tensor)

    The arguments may be given by position in that order (the op-plugin tests call
    ``(logits, top_k, top_p, q, eps, is_need_logits, top_k_guess)``); the newest Chinese page
    (``docs/zh/.../torch_npu-npu_top_k_top_p_sample.md``) lists ``min_ps`` fifth instead, so
    pass ``min_ps`` and everything after ``q`` by keyword to be safe with both.

    Args:
        logits: ``[B, V]`` float32, float16 or ``ml_dtypes.bfloat16``, rows contiguous (any row
            stride), read in place. With ``input_is_logits=False`` the rows are probabilities.
        top_k: int32 (any integer dtype is range-checked) ``[B]`` (or ``[B, 1]``); top-k is on
            for a row iff ``1 <= top_k[b] <= min(V, ks_max)``, else skipped.
        top_p: ``[B]`` (or ``[B, 1]``), the dtype of ``logits`` or float32 (any float is read as
            float32, as the operator does); on iff ``0 < p < 1``, ``p <= 0`` keeps the maximum.
        q: ``None`` (argmax of the survivors) or float32 ``[B, V]``: the exponential race's
            divisors, ``q[b][token id]`` (``q_indexing="sorted_rank"``: by the survivor's rank in
            the row's stable descending order, the op-plugin golden's convention).
        eps: added to ``q`` (finite, >= 0).
        is_need_logits: also compute ``logits_top_kp_select``.
        top_k_guess: accepted; an NPU search strategy that never changes a result.
        min_ps: ``None`` or ``[B]`` like ``top_p``; on iff ``0 < m < 1``, ``m >= 1`` keeps one.
        ks_max: the largest top-k that is on (>= 1; above 1024 acts as 1024; no rounding to 8).
        input_is_logits: rows hold logits (softmax) or probabilities (renormalisation).
        post_sample: ``"qSample"`` (default) or ``None`` / ``"None"`` (q ignored: argmax).
            ``"multiNomial"`` raises NotImplementedError (aclnnMultinomial's random stream is
            not reproduced).
        generator: must be ``None`` (only multiNomial uses it): NotImplementedError otherwise.
        return_status: (nucleus) also return the per-row status.
        q_indexing: (nucleus) ``"token_id"`` (default, the seed's formula) or ``"sorted_rank"``.

    Returns:
        ``(logits_select_idx, logits_top_kp_select)`` as torch_npu: int64 ``[B]`` (-1 for a row
        that failed: NaN / +inf logits, a bad probability, every token masked, NaN top_p /
        min_ps, a NaN or negative ``q`` entry read) and float32 ``[B, V]`` (the row's value
        where the token survived, else -inf, or 0 for probabilities). Without
        ``is_need_logits`` torch_npu returns an unwritten tensor of that size; here a read-only
        ``[B, V]`` broadcast of the fill value (no memory). With ``return_status=True``, a
        third element: a list of ``None`` or :class:`nucleus.SamplingError` per row (``kind``
        ``NonFiniteLogits``, ``InvalidProbability``, ``NoCandidates``, ``InvalidTopP``,
        ``InvalidMinP``, ``InvalidQ``).

    Raises:
        TypeError / ValueError naming the argument (dtype, shape, ``eps``, ``ks_max``);
        NotImplementedError for ``post_sample="multiNomial"`` or a ``generator``.
    """
    if not isinstance(logits, np.ndarray):
        raise TypeError(f"logits must be a numpy.ndarray, got {type(logits).__name__}")
    if logits.dtype.name not in _FLOATS:
        raise TypeError(f"logits must be float32, float16 or bfloat16 (ml_dtypes), got "
                        f"{logits.dtype}")
    if logits.ndim != 2:
        raise ValueError(f"logits must be 2-D [batch, vocab], got shape {logits.shape}")
    batch, vocab = logits.shape
    if post_sample in (None, "None"):
        q = None
    elif post_sample == "multiNomial":
        _not_implemented("post_sample", post_sample,
                         "multinomial sampling with aclnnMultinomial's random stream")
    elif post_sample != "qSample":
        raise ValueError(f"post_sample must be 'qSample', 'multiNomial' or None, got "
                         f"{post_sample!r}")
    if generator is not None:
        _not_implemented("generator", generator, "it only drives multiNomial sampling")
    if q_indexing not in ("token_id", "sorted_rank"):
        raise ValueError(f"q_indexing must be 'token_id' or 'sorted_rank', got {q_indexing!r}")

    def per_row(name, a):
        if a.ndim == 2 and a.shape[1] == 1:
            a = a[:, 0]
        if a.shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},) (one value per logits row), "
                             f"got {a.shape}")
        return np.ascontiguousarray(a)

    top_k_a = per_row("top_k", _int_array("top_k", top_k, "int32", (1, 2)))
    top_p_a = per_row("top_p", _float32("top_p", top_p, (1, 2)))
    min_ps_a = None if min_ps is None else per_row("min_ps", _float32("min_ps", min_ps, (1, 2)))
    q_a = None
    if q is not None:
        q_a = _array("q", q, ("float32",), (2,))
        if q_a.shape != logits.shape:
            raise ValueError(f"q must have the shape of logits {logits.shape}, got {q_a.shape}")
        q_a = np.ascontiguousarray(q_a)
    eps = _float("eps", eps)
    is_need_logits = _bool("is_need_logits", is_need_logits)
    top_k_guess = _int("top_k_guess", top_k_guess)
    ks_max = _int("ks_max", ks_max)
    input_is_logits = _bool("input_is_logits", input_is_logits)
    idx, select, errors = _core.npu_top_k_top_p_sample(
        logits, logits.dtype.name, top_k_a, top_p_a, q_a, min_ps_a, eps, is_need_logits,
        top_k_guess, ks_max, input_is_logits, q_indexing == "sorted_rank")
    fill = np.float32(-np.inf if input_is_logits else 0.0)
    if select is None:
        select = np.broadcast_to(fill, (batch, vocab))
    else:
        select = select.reshape(batch, vocab)
    if return_status:
        status: List[Optional[SamplingError]] = [
            None if e is None else SamplingError(e[0], e[1], i) for i, e in enumerate(errors)]
        return idx, select, status
    return idx, select


# --- npu_moe_init_routing_v2 --------------------------------------------------------------------


@torch_io
def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1,
                            expert_capacity=-1, expert_num=-1, drop_pad_mode=0,
                            expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=-1, active_expert_range=[], row_idx_type=0):
    """MoE token routing (spec/moe_routing.md, ``moe_init_routing``).

    Prototype followed (torch_npu documentation, Ascend/op-plugin
    ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_init_routing_v2.md``)::

        torch_npu.npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None,
            active_num=-1, expert_capacity=-1, expert_num=-1, drop_pad_mode=0,
            expert_tokens_num_type=0, expert_tokens_num_flag=False, quant_mode=-1,
            active_expert_range=[], row_idx_type=0) -> (Tensor, Tensor, Tensor, Tensor)

    (an older page, ``docs/context/torch_npu-npu_moe_init_routing_v2.md``, gives
    ``quant_mode=0``; the newer default -1 is followed.)

    Args:
        x: ``[N, H]`` float32 / float16 / bfloat16 / int8 (copied once if not C-contiguous).
        expert_idx: ``[N, K]`` int32 (any integer dtype, range-checked). Ids outside the active
            range (negative ones, ``>= expert_num``) are invalid routes: legal, not placed.
        scale: float32. quant -1: optional ``[N]`` carried into ``expanded_scale``; quant 0:
            ``[1]``; quant 1: optional ``[end - start, H]`` or ``[1, H]`` smooth scales.
        offset: float32 ``[1]``, quant 0 only.
        active_num: -1 / 0 dropless, > 0 at most this many rows (active mode).
        expert_capacity: C, drop/pad only (``1 <= C <= N``).
        expert_num: E, required here (torch_npu's default -1 names no expert count: a
            ValueError).
        drop_pad_mode: 0 dropless, 1 drop/pad (``expanded_x [E, C, H]``).
        expert_tokens_num_type: 0 cumsum, 1 count, 2 key-value.
        expert_tokens_num_flag: compute ``expert_token_cumsum_or_count``.
        quant_mode: -1 none, 0 static int8, 1 dynamic int8. 2 / 3 (MXFP8, newest pages)
            raise NotImplementedError.
        active_expert_range: ``[]`` (``[0, E)``) or ``[start, end]``.
        row_idx_type: 0 gather, 1 scatter.

    Returns:
        ``(expanded_x, expanded_row_idx, expert_token_cumsum_or_count, expanded_scale)``:
        ``expanded_x`` ``[N*K, H]`` (active: ``[min(active_num, N*K), H]``; drop/pad:
        ``[E, C, H]``) in x's dtype, int8 when quantised, rows past the valid count zeros;
        ``expanded_row_idx`` int32 ``[N*K]`` (gather: -1 for a route not placed; scatter: the
        sorted order, invalid routes last); the int64 counts ``[end - start]`` (cumsum / count)
        or ``[E, 2]`` (key-value), or ``None`` without ``expert_tokens_num_flag``; float32
        ``expanded_scale`` or ``None`` where torch_npu's is meaningless (no ``scale`` with
        quant -1, static quantisation).

    Raises:
        TypeError / ValueError naming the argument or the violated rule;
        NotImplementedError for quant_mode 2 or 3.
    """
    if not isinstance(x, np.ndarray):
        raise TypeError(f"x must be a numpy.ndarray, got {type(x).__name__}")
    if x.dtype.name not in _FLOATS + ("int8",):
        raise TypeError(f"x must be float32, float16, bfloat16 or int8, got {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [N, H], got shape {x.shape}")
    ids = _int_array("expert_idx", expert_idx, "int32", (2,))
    if ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_idx must be [N, K] with N = {x.shape[0]} (the rows of x), "
                         f"got shape {ids.shape}")
    quant_mode = _int("quant_mode", quant_mode)
    if quant_mode in (2, 3):
        _not_implemented("quant_mode", quant_mode, "MXFP8 quantisation")
    expert_num = _int("expert_num", expert_num)
    if expert_num == -1:
        raise ValueError("expert_num is required (torch_npu's default -1 names no expert "
                         "count): pass expert_num=E")
    if active_expert_range is None:
        active_expert_range = []
    rng = list(active_expert_range)
    if len(rng) == 0:
        rng_arg = None
    elif len(rng) == 2:
        rng_arg = [_int("active_expert_range[0]", rng[0]), _int("active_expert_range[1]", rng[1])]
    else:
        raise ValueError(f"active_expert_range must be [] or [start, end], got {rng!r}")
    scale_a = None if scale is None else _array("scale", scale, ("float32",), (1, 2)).ravel()
    offset_a = None if offset is None else _array("offset", offset, ("float32",), (1,))
    if scale_a is not None:
        scale_a = np.ascontiguousarray(scale_a)
    if offset_a is not None:
        offset_a = np.ascontiguousarray(offset_a)
    x_c = np.ascontiguousarray(x)
    flag = _bool("expert_tokens_num_flag", expert_tokens_num_flag)
    tokens_type = _int("expert_tokens_num_type", expert_tokens_num_type)
    ex, shape, row_idx, tokens, exp_scale, _valid = _core.npu_moe_init_routing_v2(
        x_c, x.dtype.name, ids, scale_a, offset_a, _int("active_num", active_num),
        _int("expert_capacity", expert_capacity), expert_num,
        _int("drop_pad_mode", drop_pad_mode), tokens_type, flag, quant_mode, rng_arg,
        _int("row_idx_type", row_idx_type))
    if ex.dtype.name != x.dtype.name and quant_mode == -1:
        ex = ex.view(x.dtype)  # bfloat16 comes back as its raw bits' type
    ex = ex.reshape(shape)
    if tokens is not None and tokens_type == 2:
        tokens = tokens.reshape(expert_num, 2)
    return ex, row_idx, tokens, exp_scale


# --- gating -------------------------------------------------------------------------------------

def _gating_x(x) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"x must be a numpy.ndarray, got {type(x).__name__}")
    if x.dtype.name not in _FLOATS:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.ndim not in (2, 3):
        raise ValueError(f"x must be 2-D [N, E] or 3-D, got shape {x.shape}")
    return x


def _cast_like(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    return w if x.dtype == np.float32 else w.astype(x.dtype)


@torch_io
def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    """Softmax gating then top-k (spec/moe_routing.md, ``moe_gating_top_k_softmax``).

    Prototype followed (torch_npu documentation, Ascend/op-plugin
    ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_gating_top_k_softmax.md``)::

        torch_npu.npu_moe_gating_top_k_softmax(x, finished=None, k=1) -> (Tensor, Tensor, Tensor)

    Args:
        x: ``[N, E]`` or ``[B, S, E]`` float32 / float16 / bfloat16.
        finished: ``None`` or bool ``x.shape[:-1]``: a finished row gets expert id E (an invalid
            route), its weights computed as for any row.
        k: ``1 <= k <= E``.

    Returns:
        ``(y, expert_idx, row_idx)``: ``y`` the k largest softmax probabilities (computed in
        float32, ties to the lower expert id, descending) in x's dtype; ``expert_idx`` int32;
        ``row_idx`` int32 ``arange(N*k).reshape(k, N).T`` (torch_npu's formula), all of shape
        ``x.shape[:-1] + (k,)``.
    """
    x = _gating_x(x)
    k = _int("k", k)
    lead = x.shape[:-1]
    e = x.shape[-1]
    x2 = np.ascontiguousarray(x.reshape(-1, e))
    n = x2.shape[0]
    fin = None
    if finished is not None:
        f = _array("finished", finished, ("bool",), (len(lead),))
        if f.shape != lead:
            raise ValueError(f"finished must have shape {lead}, got {f.shape}")
        fin = np.ascontiguousarray(f.reshape(-1))
    if not 1 <= k <= e:
        raise ValueError(f"k = {k}: must be in 1..={e} (the experts, x.shape[-1])")
    w, ids = _core.npu_moe_gating_top_k_softmax(x2, x.dtype.name, k, False, fin)
    row_idx = np.arange(n * k, dtype=np.int32).reshape(k, n).T
    shape = lead + (k,)
    return (_cast_like(w, x).reshape(shape), ids.reshape(shape),
            np.ascontiguousarray(row_idx).reshape(shape))


@torch_io
def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1,
                         group_count=1, group_select_mode=0, renorm=0, norm_type=0,
                         out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
    """Grouped (DeepSeek-V3) gating (spec/moe_routing.md, ``moe_gating_top_k``).

    Prototype followed (torch_npu documentation, Ascend/op-plugin
    ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_gating_top_k.md``)::

        npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1,
            group_count=1, group_select_mode=0, renorm=0, norm_type=0, out_flag=False,
            routed_scaling_factor=1.0, eps=1e-20) -> (Tensor, Tensor, Tensor)

    As that page's NumPy golden: scores softmax (``norm_type=0``) or sigmoid (1), plus
    ``bias``; groups scored by their max (``group_select_mode=0``) or top-2 sum (1); the best
    ``k_group`` groups kept; top-k of the biased scores; weights the unbiased scores,
    renormalised ``w / (sum(w) + eps)`` when ``norm_type=1`` (sigmoid), times
    ``routed_scaling_factor``.

    Not implemented (NotImplementedError): ``input_ids`` / ``tid2eid`` (hash routing),
    ``renorm != 0`` (torch_npu supports only 0 too), ``out_flag=True`` (``normOut``).

    Returns:
        ``(y, expert_idx, norm_out)``: ``y`` ``[N, k]`` in x's dtype, ``expert_idx`` int32
        ``[N, k]``, ``norm_out`` ``None`` (torch_npu's is only meaningful with ``out_flag``).
    """
    x = _gating_x(x)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [N, E], got shape {x.shape}")
    for name, v in (("input_ids", input_ids), ("tid2eid", tid2eid)):
        if v is not None:
            _not_implemented(name, type(v).__name__, "hash routing")
    if _int("renorm", renorm) != 0:
        _not_implemented("renorm", renorm, "only renorm=0 (norm, then top-k) is defined")
    if _bool("out_flag", out_flag):
        _not_implemented("out_flag", out_flag, "the normOut output")
    norm_type = _int("norm_type", norm_type)
    b = None
    if bias is not None:
        b = _array("bias", bias, (x.dtype.name,), (1,))
        b = np.ascontiguousarray(b, dtype=np.float32)
    w, ids = _core.npu_moe_gating_top_k(
        np.ascontiguousarray(x), x.dtype.name, _int("k", k), b, _int("k_group", k_group),
        _int("group_count", group_count), _int("group_select_mode", group_select_mode),
        norm_type == 1, norm_type, _float("routed_scaling_factor", routed_scaling_factor),
        _float("eps", eps))
    kk = int(k)
    return _cast_like(w, x).reshape(-1, kk), ids.reshape(-1, kk), None


# --- finalize / unpermute -----------------------------------------------------------------------

def _rows_tensor(name: str, a, dtype, ndims=(2,)) -> np.ndarray:
    a = _array(name, a, (dtype,), ndims)
    return np.ascontiguousarray(a)


@torch_io
def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales,
                             expanded_src_to_dst_row, expert_for_source_row, drop_pad_mode=0,
                             k=1):
    """Combines the experts' outputs with skip connections and expert bias (spec/moe_routing.md,
    ``moe_finalize_routing``).

    Prototype followed (torch_npu documentation, Ascend/op-plugin
    ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_finalize_routing.md``)::

        torch_npu.npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales,
            expanded_src_to_dst_row, expert_for_source_row, drop_pad_mode=0, k=1) -> Tensor

    ``out[i] = skip1[i] + skip2[i] + sum_k scales[i,k] * (rows[idx(i,k)] + bias[e(i,k)])``,
    accumulated in float32, rounded once to the dtype of ``expanded_permuted_rows``.
    ``drop_pad_mode`` 0 / 1 index ``expanded_src_to_dst_row[k*N + i]`` (column layout, the
    index of ``npu_moe_init_routing``), 2 / 3 ``[i*K + k]`` (row layout, the gather index of
    ``npu_moe_init_routing_v2``); 1 / 3 take ``expanded_permuted_rows [E, C, H]``. An index of
    -1 contributes nothing, bias included (the spec's rule; torch_npu's NumPy golden adds the
    bias of a -1 route). ``scales`` ``None`` weighs every route 1 with K = ``k``; with
    ``scales`` K is their width, and a ``k`` other than 1 (the default) or K is a ValueError.

    Returns ``out [N, H]`` in the dtype of ``expanded_permuted_rows``.
    """
    rows = expanded_permuted_rows
    if not isinstance(rows, np.ndarray):
        raise TypeError(f"expanded_permuted_rows must be a numpy.ndarray, got "
                        f"{type(rows).__name__}")
    if rows.dtype.name not in _FLOATS:
        raise TypeError(f"expanded_permuted_rows must be float32, float16 or bfloat16, got "
                        f"{rows.dtype}")
    mode = _int("drop_pad_mode", drop_pad_mode)
    if mode not in (0, 1, 2, 3):
        raise ValueError(f"drop_pad_mode = {mode}: must be 0, 1, 2 or 3")
    if rows.ndim != (3 if mode in (1, 3) else 2):
        raise ValueError(f"expanded_permuted_rows must be {'[E, C, H]' if mode in (1, 3) else '[N*K, H]'} "
                         f"with drop_pad_mode={mode}, got shape {rows.shape}")
    dtype = rows.dtype.name
    h = rows.shape[-1]
    rows2 = np.ascontiguousarray(rows.reshape(-1, h))
    idx = _int_array("expanded_src_to_dst_row", expanded_src_to_dst_row, "int32", (1,))
    if scales is not None:
        s = _array("scales", scales, (dtype,), (2,))
        kk = s.shape[1]
        w = np.ascontiguousarray(s, dtype=np.float32).ravel()
        k_arg = _int("k", k)
        if k_arg not in (1, kk):  # 1 is the default: then K is the scales' width
            raise ValueError(f"k = {k_arg} disagrees with scales [N, K] = {list(s.shape)}")
    else:
        kk = _int("k", k)
        w = None
    if kk < 1 or idx.shape[0] % kk:
        raise ValueError(f"expanded_src_to_dst_row has {idx.shape[0]} entries, not N*K with "
                         f"K = {kk}")
    n = idx.shape[0] // kk
    if mode in (0, 1):
        idx = np.ascontiguousarray(idx.reshape(kk, n).T).ravel()
    if w is not None and w.shape[0] != n * kk:
        raise ValueError(f"scales must be [N, K] = [{n}, {kk}], got {scales.shape}")
    eidx = None
    if expert_for_source_row is not None:
        eidx = _int_array("expert_for_source_row", expert_for_source_row, "int32", (2,)).ravel()
    sk1 = None if skip1 is None else _rows_tensor("skip1", skip1, dtype)
    sk2 = None if skip2 is None else _rows_tensor("skip2", skip2, dtype)
    if sk1 is None and sk2 is not None:
        raise ValueError("skip2 must be None when skip1 is None (torch_npu's rule)")
    bs = None if bias is None else _rows_tensor("bias", bias, dtype)
    out = _core.npu_moe_finalize_routing(rows2, dtype, None, idx, kk, w, eidx, sk1, sk2, bs)
    if out.dtype.name != dtype:
        out = out.view(rows.dtype)
    return out.reshape(n, h)


@torch_io
def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
                            restore_shape=None):
    """Combines each token's expert outputs (spec/moe_routing.md, ``moe_token_unpermute``).

    Prototype followed (torch_npu documentation, Ascend/op-plugin
    ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_token_unpermute.md``)::

        torch_npu.npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None,
            padded_mode=False, restore_shape=None) -> Tensor

    ``out[i] = sum_k probs[i, k] * permuted_tokens[sorted_indices[i*K + k]]`` (K = the last
    dimension of ``probs``, 1 without it), accumulated in float32 in slot order and rounded
    once to the dtype of ``permuted_tokens``; an index of -1 contributes nothing (nucleus; the
    gather index of ``npu_moe_init_routing_v2`` is accepted as it is). ``padded_mode=True`` and
    ``restore_shape`` raise NotImplementedError (torch_npu supports only the defaults too).

    Returns ``out [N, H]`` in the dtype of ``permuted_tokens``.
    """
    if _bool("padded_mode", padded_mode):
        _not_implemented("padded_mode", padded_mode, "only padded_mode=False is defined")
    if restore_shape is not None:
        _not_implemented("restore_shape", restore_shape, "only restore_shape=None is defined")
    t = permuted_tokens
    if not isinstance(t, np.ndarray):
        raise TypeError(f"permuted_tokens must be a numpy.ndarray, got {type(t).__name__}")
    if t.dtype.name not in _FLOATS:
        raise TypeError(f"permuted_tokens must be float32, float16 or bfloat16, got {t.dtype}")
    if t.ndim != 2:
        raise ValueError(f"permuted_tokens must be 2-D [N*K, H], got shape {t.shape}")
    idx = _int_array("sorted_indices", sorted_indices, "int32", (1,))
    if probs is not None:
        p = _array("probs", probs, _FLOATS, (2,))
        kk = p.shape[1]
        w = np.ascontiguousarray(p, dtype=np.float32).ravel()
    else:
        kk, w = 1, None
    if idx.shape[0] % kk or (w is not None and w.shape[0] != idx.shape[0]):
        raise ValueError(f"sorted_indices has {idx.shape[0]} entries; probs must be "
                         f"[N, K] with N*K of them")
    n = idx.shape[0] // kk
    out = _core.npu_moe_finalize_routing(np.ascontiguousarray(t), t.dtype.name, None, idx, kk,
                                         w, None, None, None, None)
    if out.dtype.name != t.dtype.name:
        out = out.view(t.dtype)
    return out.reshape(n, t.shape[1])
