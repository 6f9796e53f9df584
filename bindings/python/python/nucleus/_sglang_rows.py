"""The torch-free core of ``nucleus.sglang``: SGLang's per-row sampling parameters
(``SamplingBatchInfo``: ``temperatures``, ``top_ks``, ``top_ps``, ``min_ps``,
``sampling_seed``) and ``positions`` mapped onto one :func:`nucleus.sample` call, so that
the mapping is tested without SGLang or torch (tests/test_sglang_rows.py)."""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from . import SamplingError, sample

#: sglang.srt.sampling.sampling_params.TOP_K_ALL: "top-k off".
TOP_K_ALL = 1 << 30


def sglang_rows(logits: np.ndarray, temperatures, top_ks, top_ps, min_ps,
                sampling_seed: Optional[np.ndarray], positions
                ) -> Tuple[np.ndarray, List[Tuple[int, SamplingError]]]:
    """The next token of each row, as ``nucleus.sglang.NucleusSampler`` draws it.

    - ``logits``: float32 ``[B, V]`` (SGLang's, penalties and grammar mask applied).
    - ``top_ks[i] == 1`` is a greedy row (SGLang turns temperature 0 into top-k 1): its
      ``argmax`` (ties to the lowest id, as ``torch.argmax``). ``TOP_K_ALL`` is top-k off.
    - Every other row: one :func:`nucleus.sample` draw with its temperature, top-k, top-p and
      min-p; ``sampling_seed[i]`` (int64, taken as its 64-bit pattern) is the Philox key,
      ``None`` a fresh OS seed per row; the position is ``positions[i] + 1`` (SGLang passes the
      last input token's position; nucleus keys the token being chosen).
    - A row nucleus cannot sample falls back to ``argmax`` and is listed in the second return
      value ``[(row, error)]``.

    Returns int64 token ids ``[B]`` and the failed rows.
    """
    batch = int(logits.shape[0])
    temps = np.asarray(temperatures, dtype=np.float64).reshape(-1)
    top_k = np.asarray(top_ks).astype(np.int64).reshape(-1)
    top_p = np.asarray(top_ps, dtype=np.float64).reshape(-1)
    min_p = np.asarray(min_ps, dtype=np.float64).reshape(-1)
    greedy = top_k == 1
    top_k = np.where(top_k >= TOP_K_ALL, 0, top_k)
    seeds = None
    if sampling_seed is not None:
        seeds = np.asarray(sampling_seed).astype(np.int64).reshape(-1).view(np.uint64)
    pos = np.asarray(positions).astype(np.int64).reshape(-1)[:batch] + 1
    result = sample(logits, temperature=temps, top_k=top_k, top_p=top_p, min_p=min_p,
                    seed=seeds, position=pos)
    ids = np.asarray(result.token_ids).astype(np.int64)
    argmax = np.asarray(logits).argmax(axis=-1)
    failed = [(i, err) for i, err in enumerate(result.errors)
              if err is not None and not greedy[i]]
    ids = np.where(greedy | (ids < 0), argmax, ids)
    return ids, failed
