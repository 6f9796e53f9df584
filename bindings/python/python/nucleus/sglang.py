"""nucleus as an SGLang sampler backend: every row drawn by nucleus, per-request seeds honoured
(SGLang's FlashInfer backend asserts ``sampling_seed is None``), batch-invariant.

Written against **SGLang 0.5.23** (``PINNED_SGLANG_VERSION``), from
``python/sglang/srt/layers/sampler.py`` of ``sgl-project/sglang``: the stored version with
``register_sampler_backend(backend, factory)``, ``create_sampler`` (a factory must return a
``Sampler`` subclass), ``_BUILT_IN_SAMPLING_BACKENDS = {"flashinfer", "pytorch", "ascend"}``,
``Sampler.forward(logits_output, sampling_info, return_logprob, top_logprobs_nums,
token_ids_logprobs, positions)``, ``Sampler._preprocess_logits`` (custom logit processors, NaN
sanitising), ``Sampler.output_logprob_processor.compute_logprobs(logprobs, top_logprobs_nums,
token_ids_logprobs, batch_next_token_ids).write_output_to(logits_output)`` and
``Sampler._sync_token_ids_across_tp``. The code index did not tie that text to a commit (the
path's listed commit, ``584f55d1ce76e574``, is an older version without the registry), so the
pin is the version the project's notes name as newest on PyPI; older versions that write
logprobs with ``Sampler._attach_logprobs_to_output`` are handled too.

Use
---
``nucleus.sglang.register(name="nucleus")`` calls ``register_sampler_backend``; then launch
with ``--sampling-backend nucleus``. The registration must run in the process that builds the
model runner, before it does: a launcher script that registers at its top level and then
calls SGLang's ``launch_server`` or ``sglang.Engine`` (SGLang's scheduler subprocesses inherit
the registry under ``fork`` and re-run the script's top level under ``spawn``);
examples/sglang_nucleus.py is such a launcher.

Semantics (``NucleusSampler.forward``)
-------------------------------------
- Logits come in with SGLang's penalties, logit bias and grammar mask already applied; the
  parent's ``_preprocess_logits`` (custom logit processors, NaN sanitising) runs first.
- ``sampling_info.is_all_greedy``: ``argmax`` of the logits, as SGLang. Otherwise a row whose
  ``top_k`` is 1 (SGLang turns temperature 0 into temperature 1, top-k 1) is greedy too, by
  ``argmax``; every other row is one :func:`nucleus.sample` draw with the row's temperature,
  top-k (SGLang's ``TOP_K_ALL`` is "off"), top-p and min-p, in nucleus's fixed order
  (temperature, min-p, top-k, top-p: ``spec/sampling.md``), where SGLang's own backends apply
  top-k, top-p, then min-p to the tempered probabilities.
- Seeds: ``sampling_info.sampling_seed[i]`` (the request's ``sampling_seed`` parameter, as
  ``SamplingBatchInfo`` carries it; not checked against a running SGLang) is row i's
  Philox key, and the position is ``positions[i] + 1``: SGLang passes the position of the last
  input token, and nucleus keys a draw by the index of the token being chosen (the same
  convention as ``nucleus.vllm``). A seeded row's token depends on its logits, parameters,
  seed and position only: never on the batch, its order or the other rows. Without
  ``sampling_seed`` each row takes a fresh seed from the OS.
- Returns ``batch_next_token_ids`` (int32 ``[batch]`` on the logits' device), as SGLang.
- ``return_logprob``: the logprobs SGLang's standard path reports, ``log_softmax(logits /
  temperature)`` (``log_softmax(logits)`` when all rows are greedy), written into
  ``logits_output`` by SGLang's own logprob code (``next_token_logprobs`` of the chosen
  tokens, the top logprobs and the requested token ids' logprobs).
- A row nucleus cannot sample (e.g. every logit ``-inf``) falls back to ``argmax``, logged, as
  SGLang's FlashInfer path does on a failed draw.

Cost: the rows are sampled on the CPU (one batched call, the GIL released): logits on a GPU
are copied to the host once per step (``batch x vocab`` float32) and the token ids copied back.

Not supported: SGLang's RL on-policy and soft-thinking paths, the Ascend fused sampling path,
and ``return_sampling_mask`` (those rows are sampled by nucleus, but no sampling mask is
attached).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np

from ._sglang_rows import TOP_K_ALL as _TOP_K_ALL, sglang_rows  # noqa: F401

PINNED_SGLANG_VERSION = "0.5.23"

try:
    import torch
    from sglang.srt.layers import sampler as _sampler_mod
    from sglang.srt.layers.sampler import Sampler as _Sampler
except ImportError as e:  # pragma: no cover - exercised by the tests with no fake installed
    raise ImportError(
        f"nucleus.sglang is an SGLang sampler backend, written against SGLang "
        f"{PINNED_SGLANG_VERSION} (sglang.srt.layers.sampler.register_sampler_backend): "
        f"install it with pip install sglang=={PINNED_SGLANG_VERSION} ({e})") from e

__all__ = ["NucleusSampler", "register", "PINNED_SGLANG_VERSION"]

logger = logging.getLogger(__name__)

def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


class NucleusSampler(_Sampler):
    """SGLang ``Sampler`` whose draws are nucleus's (the module docstring)."""

    def _nucleus_tokens(self, logits: "torch.Tensor", sampling_info, positions) -> torch.Tensor:
        host = logits.detach().float().cpu().contiguous().numpy()
        seed = getattr(sampling_info, "sampling_seed", None)
        ids, failed = sglang_rows(host, _np(sampling_info.temperatures),
                                  _np(sampling_info.top_ks), _np(sampling_info.top_ps),
                                  _np(sampling_info.min_ps),
                                  None if seed is None else _np(seed), _np(positions))
        if failed:
            logger.warning("nucleus: rows %s could not be sampled (%s); argmax instead",
                           [i for i, _ in failed], failed[0][1])
        return torch.from_numpy(ids.astype(np.int32)).to(logits.device)

    def _write_logprobs(self, logits_output, logprobs, top_logprobs_nums, token_ids_logprobs,
                        sampling_info, batch_next_token_ids) -> None:
        processor = getattr(self, "output_logprob_processor", None)
        if processor is not None:
            processor.compute_logprobs(logprobs, top_logprobs_nums, token_ids_logprobs,
                                       batch_next_token_ids).write_output_to(logits_output)
        else:
            self._attach_logprobs_to_output(logits_output, logprobs, top_logprobs_nums,
                                            token_ids_logprobs, sampling_info,
                                            batch_next_token_ids)

    def forward(self, logits_output, sampling_info, return_logprob: bool, top_logprobs_nums,
                token_ids_logprobs, positions):
        logits = logits_output.next_token_logits
        preprocess = getattr(self, "_preprocess_logits", None)
        if preprocess is not None:
            logits = preprocess(logits, sampling_info)
        if sampling_info.is_all_greedy:
            batch_next_token_ids = torch.argmax(logits, -1)
            logprobs = torch.log_softmax(logits, dim=-1) if return_logprob else None
        else:
            batch_next_token_ids = self._nucleus_tokens(logits, sampling_info, positions)
            logprobs = (torch.log_softmax(logits / sampling_info.temperatures, dim=-1)
                        if return_logprob else None)
        if return_logprob:
            self._write_logprobs(logits_output, logprobs, top_logprobs_nums,
                                 token_ids_logprobs, sampling_info, batch_next_token_ids)
        sync = getattr(self, "_sync_token_ids_across_tp", None)
        if sync is not None:
            sync(batch_next_token_ids, sampling_info)
        return batch_next_token_ids


def register(name: str = "nucleus",
             factory: Optional[Callable[[], "_Sampler"]] = None) -> str:
    """Registers the nucleus backend with SGLang (``register_sampler_backend``): launch with
    ``--sampling-backend <name>``. Returns the name."""
    _sampler_mod.register_sampler_backend(name, factory or NucleusSampler)
    return name
