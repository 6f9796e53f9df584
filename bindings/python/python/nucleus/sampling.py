"""FlashInfer's ``flashinfer.sampling`` functions with its names and argument order, computed
by nucleus to nucleus's contract (spec/sampling.md), on NumPy arrays.

The prototypes followed are those of ``flashinfer/sampling.py`` (flashinfer-ai/flashinfer,
version 0.6.18, as recorded in the project's notes/ecosystem-wave2.md, section A.5). The
mapping, where FlashInfer and nucleus differ:

- **Randomness.** ``seed`` and ``offset`` are ints or arrays of length 1 or ``batch``. An array
  of ``batch`` seeds gives row ``i`` its own Philox key ``seed[i]`` at position ``offset[i]``
  (FlashInfer accepts per-row seeds but its kernels read only ``seed[0]``: its open bug,
  PR #4861), so a row's token does not depend on the batch. One seed for the batch gives row
  ``i`` the stream ``(seed, offset, sample index i)``: rows differ, as FlashInfer's
  ``subsequence = row`` makes them. ``generator`` is read through ``generator.initial_seed()``
  when ``seed`` is None (its offset is not advanced: pass ``offset``, as FlashInfer's CUDA-graph
  form asks). With neither, every row draws a seed from the OS.
- **Filters.** top-k keeps exactly k tokens, ties toward the lower id; top-p keeps the shortest
  prefix (by probability, ties toward the lower id) whose mass reaches ``top_p``; min-p keeps
  ``p >= min_p * p_max``. ``filter_apply_order="top_k_first"`` is top-k, then top-p on the
  renormalised survivors (FlashInfer's order); ``"joint"`` is a ValueError (not implemented).
- **Failed rows.** A row with no candidate (all zeros), a NaN or a negative probability gets
  sample -1, and ``valid[i] = False`` with ``return_valid=True`` (FlashInfer's flag for such
  rows); nothing is raised for one row. ``check_nan=True`` raises ValueError on any NaN first,
  as FlashInfer does.
- ``deterministic`` is accepted and has no effect: nucleus is always deterministic.
- ``indices`` (``[B]`` int32 or int64): output row ``i`` samples ``probs[indices[i]]``; the
  samples then have the dtype of ``indices``, else int32, as FlashInfer's.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from . import _core, _errors, _logits_2d, _rows
from ._dlpack import torch_io

__all__ = [
    "top_k_top_p_sampling_from_logits",
    "top_k_top_p_sampling_from_probs",
    "top_p_sampling_from_probs",
    "top_k_sampling_from_probs",
    "min_p_sampling_from_probs",
    "top_k_renorm_probs",
    "top_p_renorm_probs",
    "top_k_mask_logits",
    "chain_speculative_sampling",
]


def _streams(batch: int, seed, offset, generator):
    """FlashInfer's seed / offset / generator as per-row (seed, position, sample index)."""
    if seed is None and generator is not None:
        seed = int(generator.initial_seed())
    if seed is None:
        if offset is not None:
            raise ValueError("offset needs a seed (or a generator)")
        return None, 0, 0
    seeds = np.asarray(seed).reshape(-1)
    offsets = np.asarray(0 if offset is None else offset).reshape(-1)
    if seeds.shape[0] not in (1, batch) or offsets.shape[0] not in (1, batch):
        raise ValueError(f"seed and offset must be ints or arrays of length 1 or {batch}, "
                         f"got lengths {seeds.shape[0]} and {offsets.shape[0]}")
    if seeds.shape[0] == 1 and batch != 1:
        # One stream for the batch: row i is sample i of (seed, offset), as FlashInfer's
        # subsequence = row.
        return seeds[:1].repeat(batch), offsets if offsets.shape[0] == batch else offsets[0], \
            np.arange(batch)
    return seeds, offsets if offsets.shape[0] == batch else offsets[0], 0


def _check_order(filter_apply_order: str) -> None:
    if filter_apply_order == "joint":
        raise ValueError("filter_apply_order='joint' is not implemented: nucleus applies top-k, "
                         "then top-p on the renormalised survivors ('top_k_first')")
    if filter_apply_order != "top_k_first":
        raise ValueError(f"filter_apply_order must be 'top_k_first' or 'joint', "
                         f"got {filter_apply_order!r}")


def _select(x: np.ndarray, indices):
    if indices is None:
        return x, np.int32
    idx = np.asarray(indices)
    if idx.ndim != 1 or idx.dtype not in (np.int32, np.int64):
        # The samples take indices' dtype (FlashInfer's rule): it must hold every id and -1.
        raise ValueError(f"indices must be a 1-D int32 or int64 array, got {idx.dtype} "
                         f"{idx.shape}")
    if idx.size and (idx.min() < 0 or idx.max() >= x.shape[0]):
        raise ValueError(f"indices must be in 0..{x.shape[0] - 1}")
    return x[idx], idx.dtype


def _draw(x, kind: str, *, top_k=0, top_p=1.0, min_p=0.0, indices=None, check_nan=False,
          seed=None, offset=None, generator=None, return_valid=False):
    x = _logits_2d(x, kind)
    if check_nan and np.isnan(x.astype(np.float32, copy=False)).any():
        raise ValueError(f"Input {kind} contains NaN.")
    x, out_dtype = _select(x, indices)
    batch, row_len = x.shape
    seeds, position, sample_index = _streams(batch, seed, offset, generator)
    args = _rows(batch, 1.0, top_k, top_p, min_p, 1.0, 0.0, 0.0, seeds, position, sample_index)
    tokens, _, errors = _core.sample(x, x.dtype.name, kind, row_len, *args)[:3]
    samples = tokens.astype(out_dtype)
    if return_valid:
        return samples, np.array([e is None for e in errors], dtype=bool)
    return samples


@torch_io
def top_k_top_p_sampling_from_logits(logits, top_k, top_p, indices=None,
                                     filter_apply_order: str = "top_k_first",
                                     deterministic: bool = True, generator=None,
                                     check_nan: bool = False, seed=None, offset=None):
    """FlashInfer's ``top_k_top_p_sampling_from_logits``: softmax of ``logits`` ``[B, V]``
    (float32, float16 or bfloat16), top-k (``top_k`` int or ``[B]``) then top-p (``top_p``
    float or ``[B]``) on the renormalised survivors, one sample per row: int32 ``[B]``
    (or the dtype of ``indices``), -1 for a failed row. See the module's mapping."""
    _check_order(filter_apply_order)
    return _draw(logits, "logits", top_k=top_k, top_p=top_p, indices=indices,
                 check_nan=check_nan, seed=seed, offset=offset, generator=generator)


@torch_io
def top_k_top_p_sampling_from_probs(probs, top_k, top_p, indices=None,
                                    filter_apply_order: str = "top_k_first",
                                    deterministic: bool = True, generator=None,
                                    check_nan: bool = False, seed=None, offset=None,
                                    return_valid: bool = False):
    """FlashInfer's ``top_k_top_p_sampling_from_probs``: as the logits form, on probabilities
    ``[B, V]`` (non-negative; need not sum to 1). ``return_valid=True`` returns
    ``(samples, valid bool[B])``."""
    _check_order(filter_apply_order)
    return _draw(probs, "probs", top_k=top_k, top_p=top_p, indices=indices, check_nan=check_nan,
                 seed=seed, offset=offset, generator=generator, return_valid=return_valid)


@torch_io
def top_p_sampling_from_probs(probs, top_p, indices=None, deterministic: bool = True,
                              generator=None, check_nan: bool = False, seed=None, offset=None,
                              return_valid: bool = False):
    """FlashInfer's ``top_p_sampling_from_probs``: one sample per row of ``probs`` ``[B, V]``
    from its top-p set (``top_p`` float or ``[B]``)."""
    return _draw(probs, "probs", top_p=top_p, indices=indices, check_nan=check_nan, seed=seed,
                 offset=offset, generator=generator, return_valid=return_valid)


@torch_io
def top_k_sampling_from_probs(probs, top_k, indices=None, deterministic: bool = True,
                              generator=None, check_nan: bool = False, seed=None, offset=None,
                              return_valid: bool = False):
    """FlashInfer's ``top_k_sampling_from_probs``: one sample per row of ``probs`` ``[B, V]``
    from its ``top_k`` (int or ``[B]``) most likely tokens."""
    return _draw(probs, "probs", top_k=top_k, indices=indices, check_nan=check_nan, seed=seed,
                 offset=offset, generator=generator, return_valid=return_valid)


@torch_io
def min_p_sampling_from_probs(probs, min_p, indices=None, deterministic: bool = True,
                              generator=None, check_nan: bool = False, seed=None, offset=None,
                              return_valid: bool = False):
    """FlashInfer's ``min_p_sampling_from_probs``: one sample per row of ``probs`` ``[B, V]``
    among the tokens with ``p >= min_p * p_max`` (``min_p`` float or ``[B]``)."""
    return _draw(probs, "probs", min_p=min_p, indices=indices, check_nan=check_nan, seed=seed,
                 offset=offset, generator=generator, return_valid=return_valid)


def _renorm(probs, top_k=0, top_p=1.0):
    x = _logits_2d(probs, "probs")
    dtype = x.dtype
    x32 = x if dtype.name == "float32" else x.astype(np.float32)
    batch, row_len = x32.shape
    args = _rows(batch, 1.0, top_k, top_p, 0.0, 1.0, 0.0, 0.0, None, 0)
    out, errors = _core.distribution_f32(x32, "probs", row_len, *args)
    # A parameter out of range (top_k < -1, top_p outside (0, 1]) is the caller's argument
    # error: raised. A row with no candidate or a bad probability is NaN (the function
    # returns one array, as FlashInfer's).
    for e in _errors(errors):
        if e is not None and e.kind == "InvalidParams":
            raise e
    return out.reshape(np.shape(probs)).astype(dtype)


@torch_io
def top_k_renorm_probs(probs, top_k):
    """FlashInfer's ``top_k_renorm_probs``: each row of ``probs`` ``[B, V]`` (float32, float16
    or bfloat16) kept to its ``top_k`` (int or ``[B]``) largest (exactly k, ties toward the
    lower id) and renormalised; same dtype. A row that cannot be renormalised (all zeros, a
    NaN) comes back NaN; a ``top_k`` below -1 raises :class:`nucleus.SamplingError`."""
    return _renorm(probs, top_k=top_k)


@torch_io
def top_p_renorm_probs(probs, top_p, is_deterministic: bool = False):
    """FlashInfer's ``top_p_renorm_probs``: each row of ``probs`` ``[B, V]`` kept to its top-p
    set (``top_p`` float or ``[B]``) and renormalised; same dtype (NaN for a row that cannot
    be); a ``top_p`` outside (0, 1] raises :class:`nucleus.SamplingError`."""
    return _renorm(probs, top_p=top_p)


@torch_io
def top_k_mask_logits(logits, top_k):
    """FlashInfer's ``top_k_mask_logits``: a copy of ``logits`` ``[B, V]`` (float32, float16 or
    bfloat16) with every token outside each row's ``top_k`` (int or ``[B]``) largest set to
    ``-inf``: exactly k kept, ties toward the lower id (spec step 9); ``top_k`` 0, -1 or at
    least V keeps the row. A NaN logit is a ValueError naming its row."""
    x = _logits_2d(logits)
    batch, row_len = x.shape
    ks = _rows(batch, 1.0, top_k, 1.0, 0.0, 1.0, 0.0, 0.0, None, 0)[1]
    x32 = x.astype(np.float32)
    bad = np.flatnonzero(np.isnan(x32).any(axis=1))
    if bad.size:
        raise ValueError(f"top_k_mask_logits: row {bad[0]} holds a NaN logit")
    if np.any((ks < -1)):
        raise ValueError("top_k must be -1, 0 (off) or positive")
    # Largest first, ties toward the lower id: a stable sort of the negated values.
    order = np.argsort(-x32, axis=1, kind="stable")
    rank = np.empty_like(order)
    rank[np.arange(batch)[:, None], order] = np.arange(row_len)[None, :]
    k = np.where((ks <= 0) | (ks >= row_len), row_len, ks)
    out = x.copy()
    out[rank >= k[:, None]] = -np.inf
    return out.reshape(np.shape(logits))


@torch_io
def chain_speculative_sampling(draft_probs, draft_token_ids, target_probs,
                               maybe_output_accepted_token_num=None,
                               maybe_output_emitted_draft_token_num=None,
                               deterministic: bool = True, generator=None, seed=None, offset=None,
                               *, return_status: bool = False):
    """FlashInfer's ``chain_speculative_sampling``: verify each row's ``S`` drafted tokens
    against the target's ``S + 1`` rows, exactly (Leviathan et al. 2023; Chen et al. 2023;
    nucleus_sampling::speculative).

    Args:
        draft_probs: float32 ``[B, S, V]``: the draft model's distributions.
        draft_token_ids: int32 or int64 ``[B, S]``: the drafted tokens.
        target_probs: float32 ``[B, S + 1, V]``: the target model's distributions.
        maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num: ``None`` or
            integer ``[B]`` arrays, to which the counts are *added* in place, as FlashInfer does.
        seed, offset: one Philox key per row (``[B]``, or an int when ``B == 1``) and the
            position of each row's first draft token (an int or ``[B]``); every draw is keyed by
            ``(seed, position)``, so rows need seeds of their own. ``None``: each row draws a
            seed from the OS. ``generator``: read through ``initial_seed()`` (``B == 1`` only).
        deterministic: no effect (nucleus always is).
        return_status: nucleus's addition (FlashInfer's tuple has no slot for it): also return
            one ``None`` or :class:`nucleus.SamplingError` per row, saying why a row failed
            (bad probabilities, a draft id outside the vocabulary, ``offset + S`` past
            ``2**64 - 1``).

    Returns:
        ``(output_token_ids int32 [B, S + 1], accepted_num int32 [B], emitted_num int32 [B])``:
        the emitted tokens (the accepted drafts, then the residual or bonus token), -1 after
        them; per row the drafted tokens that pass their own acceptance test ``p/q >= u``
        (FlashInfer's acceptance-rate metric, counted as if each were considered alone), and
        the drafted tokens emitted (not the bonus token). A row that fails is all -1 with
        counts 0; ``return_status=True`` adds a fourth element, the per-row errors.
    """
    for name, a in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or not a.dtype.isnative:
            raise TypeError(f"{name} must be a float32 numpy.ndarray (native byte order)")
    for name, a in (("maybe_output_accepted_token_num", maybe_output_accepted_token_num),
                    ("maybe_output_emitted_draft_token_num",
                     maybe_output_emitted_draft_token_num)):
        if a is not None and not (isinstance(a, np.ndarray)
                                  and np.issubdtype(a.dtype, np.integer)):
            raise TypeError(f"{name} must be None or an integer numpy.ndarray")
        if a is not None and a.shape != (np.shape(draft_probs)[0],):
            raise ValueError(f"{name} must have shape ({np.shape(draft_probs)[0]},): one "
                             f"count per row, got {a.shape}")
    d = np.ascontiguousarray(draft_probs)
    t = np.ascontiguousarray(target_probs)
    ids = np.asarray(draft_token_ids)
    if d.ndim != 3 or t.ndim != 3 or ids.ndim != 2:
        raise ValueError("draft_probs must be [B, S, V], target_probs [B, S + 1, V] and "
                         "draft_token_ids [B, S]")
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"draft_token_ids must be integers, got {ids.dtype}")
    if ids.dtype == np.uint64 and ids.size and ids.max() > np.iinfo(np.int64).max:
        raise ValueError(f"draft_token_ids holds {int(ids.max())}, outside the vocabulary")
    batch = d.shape[0]
    if seed is None and generator is not None:
        seed = int(generator.initial_seed())
    if seed is None and offset is not None:
        raise ValueError("offset needs a seed (or a generator)")
    seeds = None
    if seed is not None:
        seeds = np.asarray(seed).reshape(-1)
        if seeds.shape[0] != batch:
            raise ValueError(
                f"chain_speculative_sampling needs one seed per row ({batch}), got "
                f"{seeds.shape[0]}: its draws are keyed by (seed, position), so rows sharing a "
                "seed and an offset would share their uniforms")
        seeds = _rows(batch, 1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, seeds, 0)[7]
    offsets = _rows(batch, 1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, None, 0 if offset is None else
                    np.asarray(offset).reshape(-1) if np.ndim(offset) else offset)[8]
    out, accepted, emitted, errs = _core.chain_speculative_verify(
        d, np.ascontiguousarray(ids, dtype=np.int64), t, seeds, offsets)
    s = d.shape[1]
    if maybe_output_accepted_token_num is not None:
        maybe_output_accepted_token_num += accepted.astype(maybe_output_accepted_token_num.dtype)
    if maybe_output_emitted_draft_token_num is not None:
        maybe_output_emitted_draft_token_num += emitted.astype(
            maybe_output_emitted_draft_token_num.dtype)
    if return_status:
        return out.reshape(batch, s + 1), accepted, emitted, _errors(errs)
    return out.reshape(batch, s + 1), accepted, emitted
