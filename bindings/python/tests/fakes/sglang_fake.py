"""A fake of SGLang's sampler-backend registry, for ``tests/test_sglang_backend.py``.

Written from ``python/sglang/srt/layers/sampler.py`` of ``sgl-project/sglang`` (SGLang 0.5.23,
the version ``nucleus.sglang`` pins; the stored version with the registry):
``_CUSTOM_SAMPLER_FACTORIES``, ``_BUILT_IN_SAMPLING_BACKENDS``, ``register_sampler_backend``
(adds the name to ``sglang.srt.server_args.SAMPLING_BACKEND_CHOICES``), ``create_sampler``
(a factory must return a ``Sampler``), ``Sampler._preprocess_logits`` (custom logit processors,
then NaN sanitising), ``Sampler.output_logprob_processor.compute_logprobs(logprobs,
top_logprobs_nums, token_ids_logprobs, batch_next_token_ids).write_output_to(logits_output)``
(``next_token_logprobs``, ``next_token_top_logprobs_val/idx``,
``next_token_token_ids_logprobs_val/idx``) and ``Sampler._sync_token_ids_across_tp``; and the
fields of ``SamplingBatchInfo`` (``python/sglang/srt/sampling/sampling_batch_info.py``) and
``LogitsProcessorOutput`` the sampler reads and writes. TP groups and server args are left out.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable, Dict, List, Optional

import torch

TOP_K_ALL = 1 << 30


@dataclasses.dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor
    next_token_logprobs: Optional[torch.Tensor] = None
    next_token_top_logprobs_val: Optional[list] = None
    next_token_top_logprobs_idx: Optional[list] = None
    next_token_token_ids_logprobs_val: Optional[list] = None
    next_token_token_ids_logprobs_idx: Optional[list] = None


@dataclasses.dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor          # [B, 1] float
    top_ps: torch.Tensor                # [B]
    top_ks: torch.Tensor                # [B] int32 (TOP_K_ALL: off; greedy rows: 1)
    min_ps: torch.Tensor                # [B]
    is_all_greedy: bool
    need_top_p_sampling: bool
    need_top_k_sampling: bool
    need_min_p_sampling: bool
    sampling_seed: Optional[torch.Tensor] = None   # [B] int64
    has_custom_logit_processor: bool = False
    grammars: Optional[list] = None
    device: str = "cpu"


class _LogprobResult:
    def __init__(self, logprobs, top, token_ids, ids):
        self.values = (logprobs, top, token_ids, ids)

    def write_output_to(self, out: LogitsProcessorOutput) -> None:
        logprobs, top, token_ids, ids = self.values
        if any(k > 0 for k in top):
            ret = logprobs.topk(max(top), dim=1)
            out.next_token_top_logprobs_val = [ret.values[i, :k].tolist()
                                               for i, k in enumerate(top)]
            out.next_token_top_logprobs_idx = [ret.indices[i, :k].tolist()
                                               for i, k in enumerate(top)]
        if any(t is not None for t in token_ids):
            out.next_token_token_ids_logprobs_val = [
                [] if t is None else logprobs[i, t].tolist() for i, t in enumerate(token_ids)]
            out.next_token_token_ids_logprobs_idx = [[] if t is None else list(t)
                                                     for t in token_ids]
        out.next_token_logprobs = logprobs[torch.arange(len(ids)), ids.long()]


class OutputLogprobProcessor:
    def compute_logprobs(self, logprobs, top_logprobs_nums, token_ids_logprobs,
                         batch_next_token_ids):
        return _LogprobResult(logprobs, top_logprobs_nums, token_ids_logprobs,
                              batch_next_token_ids)


class Sampler(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.output_logprob_processor = OutputLogprobProcessor()
        self.synced = 0

    def _preprocess_logits(self, logits, sampling_info):
        return torch.where(torch.isnan(logits), torch.full_like(logits, -1e5), logits)

    def _sync_token_ids_across_tp(self, batch_next_token_ids, sampling_info):
        self.synced += 1

    def forward(self, logits_output, sampling_info, return_logprob, top_logprobs_nums,
                token_ids_logprobs, positions):
        raise NotImplementedError("the fake's built-in backends are not under test")


_CUSTOM_SAMPLER_FACTORIES: Dict[str, Callable[[], Sampler]] = {}
_BUILT_IN_SAMPLING_BACKENDS = {"flashinfer", "pytorch", "ascend"}
SAMPLING_BACKEND_CHOICES = {"flashinfer", "pytorch", "ascend"}


def register_sampler_backend(backend: str, factory: Callable[[], Sampler]) -> None:
    if not backend:
        raise ValueError("backend must be a non-empty string")
    SAMPLING_BACKEND_CHOICES.add(backend)
    _CUSTOM_SAMPLER_FACTORIES[backend] = factory


def create_sampler(backend: Optional[str] = None) -> Sampler:
    if backend in _CUSTOM_SAMPLER_FACTORIES:
        sampler = _CUSTOM_SAMPLER_FACTORIES[backend]()
        if not isinstance(sampler, Sampler):
            raise TypeError(f"Custom sampler factory for backend '{backend}' must return a "
                            "Sampler")
        return sampler
    if backend is None or backend in _BUILT_IN_SAMPLING_BACKENDS:
        return Sampler()
    raise ValueError(f"Unknown sampling backend '{backend}'. Register it via "
                     "register_sampler_backend().")


def modules() -> Dict[str, types.ModuleType]:
    names = ["sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.sampler",
             "sglang.srt.server_args", "sglang.srt.sampling",
             "sglang.srt.sampling.sampling_batch_info", "sglang.srt.sampling.sampling_params"]
    mods = {n: types.ModuleType(n) for n in names}
    for m in mods.values():
        m.__path__ = []
    _CUSTOM_SAMPLER_FACTORIES.clear()
    SAMPLING_BACKEND_CHOICES.intersection_update(_BUILT_IN_SAMPLING_BACKENDS)
    s = mods["sglang.srt.layers.sampler"]
    for name in ("Sampler", "register_sampler_backend", "create_sampler",
                 "_CUSTOM_SAMPLER_FACTORIES", "_BUILT_IN_SAMPLING_BACKENDS"):
        setattr(s, name, globals()[name])
    mods["sglang.srt.server_args"].SAMPLING_BACKEND_CHOICES = SAMPLING_BACKEND_CHOICES
    mods["sglang.srt.sampling.sampling_batch_info"].SamplingBatchInfo = SamplingBatchInfo
    mods["sglang.srt.sampling.sampling_params"].TOP_K_ALL = TOP_K_ALL
    for n in names:
        if "." in n:
            parent, _, child = n.rpartition(".")
            setattr(mods[parent], child, mods[n])
    return mods


def batch_info(temperature: List[float], top_k: List[int], top_p: List[float],
               min_p: List[float], seeds: Optional[List[int]]) -> SamplingBatchInfo:
    """SamplingBatchInfo as SGLang builds it: temperature 0 becomes temperature 1, top-k 1."""
    greedy = [t < 1e-5 for t in temperature]
    temps = [1.0 if g else t for g, t in zip(greedy, temperature)]
    ks = [1 if g else (TOP_K_ALL if k <= 0 else k) for g, k in zip(greedy, top_k)]
    return SamplingBatchInfo(
        temperatures=torch.tensor(temps, dtype=torch.float32).view(-1, 1),
        top_ps=torch.tensor(top_p, dtype=torch.float32),
        top_ks=torch.tensor(ks, dtype=torch.int32),
        min_ps=torch.tensor(min_p, dtype=torch.float32),
        # sampling_batch_info.py: all(r.sampling_params.top_k <= 1), not the temperatures
        is_all_greedy=all(k <= 1 for k in ks),
        need_top_p_sampling=any(p < 1 for p in top_p),
        need_top_k_sampling=any(k != TOP_K_ALL for k in ks),
        need_min_p_sampling=any(p > 0 for p in min_p),
        sampling_seed=None if seeds is None else torch.tensor(seeds, dtype=torch.int64))

