"""nucleus as a vLLM logits processor: DRY, XTC, mirostat, typical-p and every other nucleus
processor, with nucleus's seeded, batch-invariant draw, per request, inside vLLM.

Written against **vLLM 0.33.0** (``PINNED_VLLM_VERSION``), from these files of
``vllm-project/vllm`` (read with the project's code index; the commit is the stored version):

- ``vllm/v1/worker/gpu/sample/logits_processor/interface.py`` at ``0e0c7af89debec59`` (Model
  Runner V2: ``LogitsProcessor``, ``LogitsProcRequestState``, ``LogitsContext``);
- ``vllm/v1/worker/gpu/sample/logits_processor/loader.py`` at ``05b495e541f161a4`` (entry
  point group ``vllm.logits_processors``, FQCNs ``"module:Class"``, ``ctor(vllm_config,
  LogitsProcRequestState)``, ``validate_params`` failures become ``VLLMValidationError``);
- ``vllm/v1/worker/gpu/buffer_utils.py`` at ``01a3d5aca1dc37d1`` (``StagedWriteTensor.gpu``,
  ``UvaBackedTensor.np``: how ``req_states``' buffers are read);
- ``vllm/v1/sample/logits_processor/interface.py`` at ``18ebdd48dec01ef5`` and
  ``builtin.py`` at ``bf17660a2493b9ce`` (the legacy runner's ``LogitsProcessor``,
  ``BatchUpdate``, ``MoveDirectionality``, ``needs_output_token_ids``, the removed → added →
  moved order of ``process_dict_updates``);
- ``vllm/entrypoints/openai/chat_completion/protocol.py`` (``vllm_xargs``: string, number or
  list values only, copied into ``SamplingParams.extra_args``).

The interface is marked "may change" by vLLM; other versions may need changes here.

Classes
-------
``NucleusLogitsProcessor`` implements Model Runner V2's interface (vLLM's default runner).
``NucleusLegacyLogitsProcessor`` implements the legacy runner's (``VLLM_USE_V2_MODEL_RUNNER=0``;
that runner refuses custom processors under speculative decoding). The entry point names
``NucleusLogitsProcessor``; constructed with the legacy runner's three arguments
``(vllm_config, device, is_pin_memory)`` it returns a ``NucleusLegacyLogitsProcessor``, so an
installed nucleus works under either runner. Registration:

- installed: the entry point ``nucleus = "nucleus.vllm:NucleusLogitsProcessor"`` in the group
  ``vllm.logits_processors`` (bindings/python/pyproject.toml): vLLM loads it in every engine
  of the environment (it declines requests that do not ask for it);
- explicitly: ``LLM(model, logits_processors=[NucleusLogitsProcessor])`` or
  ``vllm serve MODEL --logits-processors nucleus.vllm:NucleusLogitsProcessor``. Prefer this:
  the loader runs ``validate_params`` at admission only for processors named this way
  (``build_custom_logits_processors_params_validator``), so with the entry point alone a bad
  config is logged and the request declined rather than refused with a 400; and the legacy
  runner repairs async scheduling's placeholder output ids (-1) only when processors are
  named, so with the entry point alone the legacy class leaves such rows to vLLM, logged.

``import nucleus`` never imports vLLM; ``import nucleus.vllm`` without vLLM is an ImportError
naming the pinned version (the classes subclass vLLM's, so they exist only with vLLM).

Semantics
---------
A request opts in with ``SamplingParams.extra_args["nucleus"]``:

- a nucleus chain: a list of processor objects ending in a selection, the JSON of ``nucleus
  sample``'s ``chain`` (README "Processor chains"), e.g. ``[{"dry": {"multiplier": 0.8}},
  {"xtc": {"probability": 0.5, "threshold": 0.1}}, {"sample": {"seed": 42}}]``;
- or a dict of :class:`nucleus.SamplingParams` fields (``nucleus sample``'s ``params``
  object), e.g. ``{"temperature": 0.8, "dry_multiplier": 0.8, "seed": 7}``; without its own
  ``seed`` it takes vLLM's ``SamplingParams.seed`` when that is set;
- or either of them as JSON text (what HTTP allows: ``vllm_xargs`` values are strings,
  numbers or lists of them).

``extra_args["nucleus_mode"]`` is ``"sample"`` (the default) or ``"distribution"``. A request
without the ``"nucleus"`` key is declined (``add_request`` returns False) and its rows are
never touched. ``validate_params`` builds the chain once, so a bad config is a ValueError at
admission (vLLM's HTTP 400) naming what is wrong; ``add_request`` never raises (a config that
fails there is logged and the request declined).

For each row of an opted-in request, ``apply``:

- ``"sample"``: makes the row one-hot on nucleus's own draw: every logit ``-inf`` except the
  token the request's chain samples for that row, which becomes ``0.0``. vLLM's later steps
  (temperature, min-p, top-k/top-p, its RNG, greedy, the rejection sampler) can then only pick
  that token, so the chosen tokens are exactly nucleus's (seeded by the chain's seed and the
  position, batch-invariant), DRY, XTC and mirostat included.
- ``"distribution"``: writes ``log(p)`` of the chain's final distribution; vLLM then draws from
  exactly that distribution with its own RNG. Leave vLLM's temperature at 1 and its top-k,
  top-p, min-p and penalties off, or vLLM reshapes the distribution again.

The chain's context for a row: the request's prompt ids and committed output ids (Model
Runner V2: ``req_states.all_token_ids[slot, :total_len]``, ``prompt_len``; legacy: the
``BatchUpdate``'s prompt ids and live output list), plus, for a speculative row with local
position ``j > 0``, the draft tokens fed at the request's rows ``1..j`` (``ctx.input_ids``).
The position passed to nucleus is ``ctx.pos[row] + 1``: the index in the whole sequence of the
token being chosen (legacy: ``len(prompt) + len(output)``).

State: one chain per slot (Model Runner V2) or batch index (legacy). Each step the processor
accepts the newly committed tokens in order. Row 0 is sampled on the slot's chain, and the
speculative row ``j`` on a copy of row ``j - 1``'s chain that has accepted draft ``j``. When
the next step shows which tokens were committed, the chain of the row that predicted the last
of them is kept, so stateful selections (mirostat's ``mu``) update from the distribution the
token was drawn from, as in a plain decode loop. If the committed length shrinks, the chain
is reset and the tokens replayed (mirostat's ``mu`` restarts then). Slots are recycled:
``add_request`` re-initialises.

Rows vLLM's grammar mask set to ``-inf`` stay ``-inf`` (nucleus never picks a ``-inf`` token,
and gives it probability 0). A row nucleus cannot sample (every logit ``-inf``, a NaN) is left
as it was and logged once per request; the rest of the batch goes on.

Cost: nucleus runs on the CPU, one row per Python-level call, with the GIL released inside
nucleus. CPU float32 logits are read and written in place. Logits on a GPU: the opted-in
rows are copied to the host once per step (``rows x vocab`` float32), and written back as
two indexed writes (``"sample"``) or one row copy (``"distribution"``); reading the committed
tokens is one small device-to-host copy per opted-in request per step. Both synchronise the
stream.

Not supported: vLLM's ``logprobs_mode="processed_logprobs"`` reports the one-hot row's
logprobs (0 and -inf) in ``"sample"`` mode (the default ``raw_logprobs`` is unaffected); the
legacy runner gives no prompt ids for prompt-embedding requests (the chain then sees only the
output ids, and positions count from 0).
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import NucleusError, SamplerChain, SamplingParams

PINNED_VLLM_VERSION = "0.33.0"

try:
    from vllm.v1.worker.gpu.sample.logits_processor.interface import (
        LogitsProcessor as _V2LogitsProcessor,
    )
    from vllm.v1.sample.logits_processor.interface import (
        LogitsProcessor as _V1LogitsProcessor,
        MoveDirectionality as _MoveDirectionality,
    )
except ImportError as e:  # pragma: no cover - exercised by the tests with no fake installed
    raise ImportError(
        f"nucleus.vllm is a vLLM logits processor, written against vLLM {PINNED_VLLM_VERSION} "
        "(Model Runner V2's vllm.v1.worker.gpu.sample.logits_processor and the legacy "
        "vllm.v1.sample.logits_processor): install it with "
        f"pip install vllm=={PINNED_VLLM_VERSION} ({e})") from e

try:  # vLLM always has torch; the processor also takes NumPy arrays (tests, tools)
    import torch as _torch
except ImportError:  # pragma: no cover
    _torch = None

__all__ = ["NucleusLogitsProcessor", "NucleusLegacyLogitsProcessor", "PINNED_VLLM_VERSION",
           "parse_extra_args"]

logger = logging.getLogger(__name__)

_MODES = ("sample", "distribution")


# --- per-request configuration --------------------------------------------------------------

class _Config:
    """A request's parsed ``extra_args``: how to build its chain, and the mode."""

    __slots__ = ("kind", "value", "mode")

    def __init__(self, kind: str, value: Any, mode: str):
        self.kind, self.value, self.mode = kind, value, mode

    def build(self) -> SamplerChain:
        if self.kind == "chain":
            return SamplerChain(self.value)
        return SamplerChain.from_params(self.value)


def parse_extra_args(sampling_params) -> Optional[_Config]:
    """The nucleus configuration of a vLLM ``SamplingParams`` (None: the request does not opt
    in). Builds the chain once, so every error surfaces here as a ValueError naming the key."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    if not isinstance(extra, dict):
        return None
    if "nucleus" not in extra:
        if "nucleus_mode" in extra:
            raise ValueError("extra_args['nucleus_mode'] is set but extra_args['nucleus'] is "
                             "not: give the nucleus chain (a list) or SamplingParams fields "
                             "(an object)")
        return None
    mode = extra.get("nucleus_mode", "sample")
    if mode not in _MODES:
        raise ValueError(f"extra_args['nucleus_mode'] must be 'sample' or 'distribution', "
                         f"got {mode!r}")
    value = extra["nucleus"]
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"extra_args['nucleus'] is not valid JSON: {e}") from None
    try:
        if isinstance(value, list):
            config = _Config("chain", value, mode)
        elif isinstance(value, dict):
            fields = dict(value)
            seed = getattr(sampling_params, "seed", None)
            if fields.get("seed") is None and seed is not None:
                fields["seed"] = int(seed) % 2**64
            config = _Config("params", SamplingParams.from_json(fields), mode)
        else:
            raise ValueError(f"must be a chain (a list of processor objects ending in a "
                             f"selection) or an object of nucleus.SamplingParams fields, got "
                             f"{type(value).__name__}")
        config.build()
    except (ValueError, TypeError) as e:
        raise ValueError(f"extra_args['nucleus']: {e}") from None
    return config


def _try_config(sampling_params, where: str) -> Optional[_Config]:
    try:
        return parse_extra_args(sampling_params)
    except ValueError as e:  # validate_params refuses these at admission; never crash here
        logger.error("nucleus: %s: request declined: %s", where, e)
        return None


# --- tensors and arrays -----------------------------------------------------------------------

def _is_torch(x) -> bool:
    return _torch is not None and isinstance(x, _torch.Tensor)


def _host(x) -> np.ndarray:
    """A NumPy array of ``x`` (a torch tensor on any device, or an array)."""
    if _is_torch(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


class _Rows:
    """The logits rows nucleus reads and writes: in place for CPU float32 (NumPy or torch),
    else one host copy of the selected rows, written back at :meth:`finish`."""

    def __init__(self, logits, rows: List[int]):
        self.logits = logits
        self.rows = rows
        self.index = {r: i for i, r in enumerate(rows)}
        self.onehot: Dict[int, int] = {}
        self.dense: Dict[int, np.ndarray] = {}
        inplace = False
        if isinstance(logits, np.ndarray):
            inplace = logits.dtype == np.float32
        elif _is_torch(logits):
            inplace = (logits.device.type == "cpu" and logits.dtype == _torch.float32
                       and not logits.requires_grad)
        else:
            raise TypeError(f"logits must be a torch.Tensor or a numpy.ndarray, got "
                            f"{type(logits).__name__}")
        self.inplace = inplace
        if inplace:
            self.view = logits if isinstance(logits, np.ndarray) else logits.numpy()
        elif isinstance(logits, np.ndarray):
            self.view = logits[rows].astype(np.float32)
        else:
            idx = _torch.as_tensor(rows, dtype=_torch.long, device=logits.device)
            self.view = logits.index_select(0, idx).float().cpu().numpy()

    def row(self, r: int) -> np.ndarray:
        return self.view[r] if self.inplace else self.view[self.index[r]]

    def set_onehot(self, r: int, token: int) -> None:
        if self.inplace:
            v = self.view[r]
            v[:] = -np.inf
            v[token] = 0.0
        else:
            self.onehot[r] = token

    def set_dense(self, r: int, values: np.ndarray) -> None:
        if self.inplace:
            self.view[r][:] = values
        else:
            self.dense[r] = values

    def finish(self) -> None:
        if self.inplace:
            return
        x = self.logits
        if isinstance(x, np.ndarray):
            for r, t in self.onehot.items():
                x[r] = -np.inf
                x[r, t] = 0
            for r, v in self.dense.items():
                x[r] = v.astype(x.dtype)
            return
        if self.onehot:
            rows = _torch.as_tensor(list(self.onehot), dtype=_torch.long, device=x.device)
            toks = _torch.as_tensor(list(self.onehot.values()), dtype=_torch.long,
                                    device=x.device)
            x.index_fill_(0, rows, float("-inf"))
            x[rows, toks] = 0.0
        if self.dense:
            rows = _torch.as_tensor(list(self.dense), dtype=_torch.long, device=x.device)
            vals = _torch.from_numpy(np.stack(list(self.dense.values()))).to(
                device=x.device, dtype=x.dtype)
            x.index_copy_(0, rows, vals)


# --- one request's chain ----------------------------------------------------------------------

class _Request:
    """A request's chain, the tokens it has accepted, and last step's row chains."""

    def __init__(self, config: _Config, name: str):
        self.config = config
        self.name = name
        self.chain = config.build()
        self.prompt: Optional[List[int]] = None   # set at the first sync
        self.accepted = 0                         # output tokens the chain has accepted
        # drafts fed before a row (tuple) -> the chain that sampled that row last step
        self.pending: Dict[Tuple[int, ...], SamplerChain] = {}
        self.warned = False

    def start(self, prompt: List[int], outputs: List[int]) -> None:
        self.prompt = list(prompt)
        self.chain.reset(self.prompt)
        for t in outputs:
            self.chain.accept(t)
        self.accepted = len(outputs)
        self.pending = {}

    def commit(self, new: List[int]) -> None:
        """The output tokens committed since the last sync, in order."""
        if not new:
            return
        best: Tuple[int, ...] = ()
        for drafts in self.pending:
            if len(best) < len(drafts) < len(new) and tuple(new[:len(drafts)]) == drafts:
                best = drafts
        if best in self.pending:   # the chain that drew the row after the accepted drafts
            chain, rest = self.pending[best], new[len(best):]
        else:
            chain, rest = self.chain, new
        for t in rest:
            chain.accept(t)
        self.chain = chain
        self.accepted += len(new)
        self.pending = {}

    def warn(self, what: str) -> None:
        if not self.warned:
            self.warned = True
            logger.warning("nucleus: %s: %s; its rows are left as vLLM gave them (logged once "
                           "per request)", self.name, what)

    def run_rows(self, rows: "_Rows", items: List[Tuple[int, int, Optional[int]]]) -> None:
        """Sample (or take the distribution of) this request's rows this step: ``items`` are
        ``(row, position, draft)`` in local order, ``draft`` the token fed at the row (None
        for row 0)."""
        chain = self.chain
        drafts: Tuple[int, ...] = ()
        self.pending = {}
        for k, (r, position, draft) in enumerate(items):
            if k > 0:
                chain = copy.copy(chain)
                try:
                    chain.accept(int(draft))
                except (ValueError, TypeError) as e:
                    self.warn(f"draft token {draft!r} refused ({e})")
                    return
                drafts = drafts + (int(draft),)
            row = rows.row(r)
            try:
                if self.config.mode == "sample":
                    token, _ = chain.sample(row, position=position)
                    rows.set_onehot(r, int(token))
                else:
                    p = np.asarray(chain.distribution(row, position=position), dtype=np.float64)
                    with np.errstate(divide="ignore"):
                        rows.set_dense(r, np.log(p).astype(np.float32))
            except (NucleusError, ValueError) as e:
                self.warn(f"row {r} at position {position} could not be sampled ({e})")
                continue
            self.pending[drafts] = chain


# --- Model Runner V2 --------------------------------------------------------------------------

class NucleusLogitsProcessor(_V2LogitsProcessor):
    """vLLM Model Runner V2 logits processor running each opted-in request's nucleus chain
    (the module docstring has the semantics). Constructed with the legacy runner's
    ``(vllm_config, device, is_pin_memory)``, it returns a :class:`NucleusLegacyLogitsProcessor`.
    """

    def __new__(cls, *args, **kwargs):
        if cls is NucleusLogitsProcessor and (len(args) + len(kwargs) == 3
                                              or "is_pin_memory" in kwargs):
            return NucleusLegacyLogitsProcessor(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, vllm_config, req_states):
        super().__init__(vllm_config, req_states)
        self.req_states = req_states
        self.vocab_size = int(getattr(req_states, "vocab_size", 0) or 0)
        self._reqs: Dict[int, _Request] = {}

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """Refuses a bad ``extra_args["nucleus"]`` at admission (ValueError)."""
        parse_extra_args(sampling_params)

    def add_request(self, req_idx: int, sampling_params) -> bool:
        self._reqs.pop(req_idx, None)
        config = _try_config(sampling_params, f"slot {req_idx}")
        if config is None:
            return False
        self._reqs[req_idx] = _Request(config, f"slot {req_idx}")
        return True

    def apply_staged_writes(self) -> None:
        """Nothing to stage: nucleus keeps its state on the host."""

    def _sync(self, slot: int, req: _Request, total_len: int) -> None:
        rs = self.req_states
        if req.prompt is None:
            plen = int(_host(rs.prompt_len.np if hasattr(rs.prompt_len, "np")
                             else rs.prompt_len)[slot])
            toks = _host(rs.all_token_ids.gpu[slot, :total_len]).astype(np.int64).tolist()
            req.start(toks[:plen], toks[plen:])
            return
        known = len(req.prompt) + req.accepted
        if total_len < known:
            toks = _host(rs.all_token_ids.gpu[slot, :total_len]).astype(np.int64).tolist()
            plen = len(req.prompt)
            req.start(toks[:plen], toks[plen:])
            return
        if total_len > known:
            new = _host(rs.all_token_ids.gpu[slot, known:total_len]).astype(np.int64).tolist()
            req.commit(new)

    def apply(self, logits, ctx):
        if not self._reqs:
            return logits
        slots = _host(ctx.expanded_idx_mapping).astype(np.int64)
        mine = [r for r, s in enumerate(slots.tolist()) if s in self._reqs]
        if not mine:
            return logits
        local = _host(ctx.expanded_local_pos).astype(np.int64)
        fed = _host(ctx.input_ids).astype(np.int64)
        pos = _host(ctx.pos).astype(np.int64)
        total = _host(self.req_states.total_len.gpu).astype(np.int64)
        groups: Dict[int, List[Tuple[int, int]]] = {}
        for r in mine:
            groups.setdefault(int(slots[r]), []).append((int(local[r]), r))
        rows = _Rows(logits, mine)
        for slot, members in groups.items():
            req = self._reqs[slot]
            self._sync(slot, req, int(total[slot]))
            members.sort()
            items = [(r, int(pos[r]) + 1, None if j == 0 else int(fed[r])) for j, r in members]
            req.run_rows(rows, items)
        rows.finish()
        return logits


# --- legacy runner ----------------------------------------------------------------------------

class _LegacyEntry:
    __slots__ = ("req", "prompt", "output")

    def __init__(self, req: _Request, prompt: Optional[List[int]], output: List[int]):
        self.req, self.prompt, self.output = req, prompt, output


class NucleusLegacyLogitsProcessor(_V1LogitsProcessor):
    """The same processor for vLLM's legacy runner (``VLLM_USE_V2_MODEL_RUNNER=0``):
    ``update_state(BatchUpdate)`` then ``apply(logits)`` with one row per batch index."""

    def __init__(self, vllm_config, device, is_pin_memory: bool):
        self.device = device
        self._entries: Dict[int, _LegacyEntry] = {}

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        parse_extra_args(sampling_params)

    def is_argmax_invariant(self) -> bool:
        """False: the processor decides the token, greedy requests included."""
        return False

    def needs_output_token_ids(self) -> bool:
        """True: the chain reads the real output ids (not async scheduling's placeholders)."""
        return bool(self._entries)

    def update_state(self, batch_update) -> None:
        if batch_update is None:
            return
        e = self._entries
        for index in batch_update.removed:
            e.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            e.pop(index, None)
            config = _try_config(params, f"batch index {index}")
            if config is not None:
                prompt = None if prompt_ids is None else list(prompt_ids)
                e[index] = _LegacyEntry(_Request(config, f"batch index {index}"), prompt,
                                        output_ids)
        for a, b, direction in batch_update.moved:
            ea, eb = e.pop(a, None), e.pop(b, None)
            if ea is not None:
                e[b] = ea
            if eb is not None and direction == _MoveDirectionality.SWAP:
                e[a] = eb

    def apply(self, logits):
        if not self._entries:
            return logits
        n = int(logits.shape[0])
        mine = sorted(i for i in self._entries if i < n)
        if not mine:
            return logits
        rows = _Rows(logits, mine)
        for i in mine:
            entry = self._entries[i]
            req = entry.req
            out = [int(t) for t in entry.output]
            if any(t < 0 for t in out):
                req.warn("output ids hold placeholders (-1)")
                continue
            if req.prompt is None:
                if entry.prompt is None:
                    req.warn("vLLM gave no prompt ids (prompt embeddings): the chain sees the "
                             "output ids only")
                req.start(entry.prompt or [], out)
            elif len(out) < req.accepted:
                req.start(req.prompt, out)
            else:
                req.commit(out[req.accepted:])
            req.run_rows(rows, [(i, len(req.prompt) + len(out), None)])
        rows.finish()
        return logits
