"""A fake of vLLM's custom-logits-processor interfaces, for ``tests/test_vllm_plugin.py``.

Written from vLLM 0.33.0's interface files as stored in ``vllm-project/vllm`` (the versions
``nucleus.vllm`` pins):

- ``vllm/v1/worker/gpu/sample/logits_processor/interface.py`` at 0e0c7af89debec59:
  ``LogitsProcRequestState`` (``device, max_num_reqs, vocab_size, all_token_ids, prompt_len,
  prefill_len, total_len``, ``from_request_state``), ``LogitsContext`` (``expanded_idx_mapping,
  idx_mapping, idx_mapping_np, expanded_local_pos, input_ids, pos,
  seq_lens_upper_bound_np``), ``LogitsProcessor`` (``__init__(vllm_config, req_states)``,
  ``validate_params``, ``add_request -> bool``, ``apply_staged_writes``, abstract ``apply``);
- ``vllm/v1/worker/gpu/sample/logits_processor/loader.py`` at 05b495e541f161a4: classes must
  subclass the V2 ``LogitsProcessor``, instances are ``ctor(vllm_config,
  LogitsProcRequestState.from_request_state(req_states))``, ``validate_params`` ValueErrors
  become ``VLLMValidationError``;
- ``vllm/v1/worker/gpu/buffer_utils.py`` at 01a3d5aca1dc37d1: ``StagedWriteTensor.gpu`` (the
  device buffer; ``all_token_ids`` and ``total_len``), ``UvaBackedTensor.np`` / ``.cpu``
  (``prompt_len``, ``prefill_len``);
- ``vllm/v1/sample/logits_processor/interface.py`` at 18ebdd48dec01ef5: ``MoveDirectionality``,
  ``BatchUpdate(batch_size, removed, added, moved)`` (process removed, added, moved in that
  order; ``added`` holds ``(index, params, prompt_ids, output_ids)`` with a live output list),
  ``LogitsProcessor`` (``__init__(vllm_config, device, is_pin_memory)``, ``apply(logits)``,
  ``is_argmax_invariant``, ``needs_output_token_ids``, ``update_state``);
- the legacy ``build_logitsprocs`` (``vllm/v1/sample/logits_processor/__init__.py``):
  entry-point classes are constructed as ``ctor(vllm_config, device, is_pin_memory)`` with
  no subclass check.

``SamplingParams`` is reduced to the fields the processors read (``seed``, ``temperature``,
``extra_args``). Tensors are NumPy arrays or torch tensors (``array=``), so the NumPy tests run
without torch.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import types
from typing import Any, Dict, List, Optional, Sequence

import numpy as np


class VLLMValidationError(ValueError):
    """vllm.exceptions.VLLMValidationError (HTTP 400)."""


@dataclasses.dataclass
class SamplingParams:
    temperature: float = 1.0
    seed: Optional[int] = None
    extra_args: Optional[Dict[str, Any]] = None


# --- vllm/v1/worker/gpu/buffer_utils.py --------------------------------------------------------

class StagedWriteTensor:
    """``.gpu`` is the buffer (the device tensor in vLLM)."""

    def __init__(self, gpu):
        self.gpu = gpu


class UvaBackedTensor:
    """``.np`` (and ``.cpu``) are the host source of truth."""

    def __init__(self, np_array, cpu=None):
        self.np = np_array
        self.cpu = np_array if cpu is None else cpu
        self.gpu = self.cpu


# --- vllm/v1/worker/gpu/sample/logits_processor/interface.py -----------------------------------

@dataclasses.dataclass(frozen=True)
class LogitsProcRequestState:
    device: Any
    max_num_reqs: int
    vocab_size: int
    all_token_ids: StagedWriteTensor
    prompt_len: UvaBackedTensor
    prefill_len: UvaBackedTensor
    total_len: StagedWriteTensor

    @classmethod
    def from_request_state(cls, req_states) -> "LogitsProcRequestState":
        return cls(device=req_states.device, max_num_reqs=req_states.max_num_reqs,
                   vocab_size=req_states.vocab_size, all_token_ids=req_states.all_token_ids,
                   prompt_len=req_states.prompt_len, prefill_len=req_states.prefill_len,
                   total_len=req_states.total_len)


@dataclasses.dataclass(frozen=True)
class LogitsContext:
    expanded_idx_mapping: Any
    idx_mapping: Any
    idx_mapping_np: np.ndarray
    expanded_local_pos: Any
    input_ids: Any
    pos: Any
    seq_lens_upper_bound_np: np.ndarray


class V2LogitsProcessor(abc.ABC):
    def __init__(self, vllm_config, req_states: LogitsProcRequestState):  # noqa: B027
        pass

    @classmethod  # noqa: B027
    def validate_params(cls, sampling_params) -> None:
        pass

    def add_request(self, req_idx: int, sampling_params) -> bool:
        return True

    def apply_staged_writes(self) -> None:  # noqa: B027
        pass

    @abc.abstractmethod
    def apply(self, logits, ctx: LogitsContext):
        raise NotImplementedError


# --- vllm/v1/sample/logits_processor/interface.py ----------------------------------------------

class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()
    SWAP = enum.auto()


@dataclasses.dataclass(frozen=True)
class BatchUpdate:
    batch_size: int
    removed: Sequence[int]
    added: Sequence[tuple]
    moved: Sequence[tuple]


class V1LogitsProcessor(abc.ABC):
    @classmethod
    def validate_params(cls, sampling_params):
        return None

    @abc.abstractmethod
    def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def apply(self, logits):
        raise NotImplementedError

    @abc.abstractmethod
    def is_argmax_invariant(self) -> bool:
        raise NotImplementedError

    def needs_output_token_ids(self) -> bool:
        return False

    @abc.abstractmethod
    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        raise NotImplementedError


# --- loaders (loader.py; the legacy build_logitsprocs) -----------------------------------------

def build_custom_logits_processors(vllm_config, req_states, custom_logitsprocs=()):
    """loader.py's ``build_custom_logits_processors`` for class objects."""
    out = []
    for cls in custom_logitsprocs:
        if not (isinstance(cls, type) and issubclass(cls, V2LogitsProcessor)):
            raise ValueError(f"{cls!r} is not a subclass of "
                             "vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor")
        out.append(cls(vllm_config, LogitsProcRequestState.from_request_state(req_states)))
    return out


def build_custom_logits_processors_params_validator(custom_logitsprocs):
    classes = list(custom_logitsprocs)

    def validate_params(sampling_params) -> None:
        for cls in classes:
            try:
                cls.validate_params(sampling_params)
            except ValueError as e:
                raise VLLMValidationError(str(e)) from e

    return validate_params


def build_legacy_logitsprocs(vllm_config, device, is_pin_memory, plugin_classes):
    """The legacy ``build_logitsprocs``: entry-point classes, no subclass check."""
    return [ctor(vllm_config, device, is_pin_memory) for ctor in plugin_classes]


def modules() -> Dict[str, types.ModuleType]:
    """The module tree to put into ``sys.modules``."""
    names = ["vllm", "vllm.exceptions", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu",
             "vllm.v1.worker.gpu.buffer_utils", "vllm.v1.worker.gpu.sample",
             "vllm.v1.worker.gpu.sample.logits_processor",
             "vllm.v1.worker.gpu.sample.logits_processor.interface",
             "vllm.v1.worker.gpu.sample.logits_processor.loader",
             "vllm.v1.sample", "vllm.v1.sample.logits_processor",
             "vllm.v1.sample.logits_processor.interface"]
    mods = {n: types.ModuleType(n) for n in names}
    for n in names:
        mods[n].__path__ = []  # packages, so submodule imports resolve through sys.modules
    mods["vllm"].SamplingParams = SamplingParams
    mods["vllm"].__version__ = "0.33.0"
    mods["vllm.exceptions"].VLLMValidationError = VLLMValidationError
    bu = mods["vllm.v1.worker.gpu.buffer_utils"]
    bu.StagedWriteTensor, bu.UvaBackedTensor = StagedWriteTensor, UvaBackedTensor
    for n in ("vllm.v1.worker.gpu.sample.logits_processor",
              "vllm.v1.worker.gpu.sample.logits_processor.interface"):
        m = mods[n]
        m.LogitsProcessor = V2LogitsProcessor
        m.LogitsProcRequestState = LogitsProcRequestState
        m.LogitsContext = LogitsContext
    ld = mods["vllm.v1.worker.gpu.sample.logits_processor.loader"]
    ld.LOGITSPROCS_GROUP = "vllm.logits_processors"
    ld.build_custom_logits_processors = build_custom_logits_processors
    ld.build_custom_logits_processors_params_validator = (
        build_custom_logits_processors_params_validator)
    for n in ("vllm.v1.sample.logits_processor", "vllm.v1.sample.logits_processor.interface"):
        m = mods[n]
        m.LogitsProcessor = V1LogitsProcessor
        m.BatchUpdate = BatchUpdate
        m.MoveDirectionality = MoveDirectionality
    mods["vllm.v1.sample.logits_processor"].LOGITSPROCS_GROUP = "vllm.logits_processors"
    # parent attributes, as a real import would set them
    for n in names:
        if "." in n:
            parent, _, child = n.rpartition(".")
            setattr(mods[parent], child, mods[n])
    return mods


# --- a Model Runner V2 driver --------------------------------------------------------------------

class RequestStates:
    """The model runner's RequestState, reduced to what LogitsProcRequestState wraps."""

    def __init__(self, max_num_reqs: int, max_model_len: int, vocab_size: int, array):
        self.device = "cpu"
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.array = array
        self.all_token_ids = StagedWriteTensor(array(np.zeros((max_num_reqs, max_model_len),
                                                              dtype=np.int32)))
        plen = np.zeros(max_num_reqs, dtype=np.int32)
        self.prompt_len = UvaBackedTensor(plen)
        self.prefill_len = UvaBackedTensor(np.zeros(max_num_reqs, dtype=np.int32))
        self.total_len = StagedWriteTensor(array(np.zeros(max_num_reqs, dtype=np.int32)))
        self.free_indices = list(range(max_num_reqs))


class V2Engine:
    """Drives V2 processors the way the model runner does: slots from a free list (LIFO, so a
    freed slot is the next one taken), one logits row per request or one per draft token,
    committed tokens written to ``all_token_ids`` / ``total_len`` after each step.

    ``array`` turns a NumPy array into the tensor type under test (NumPy or torch)."""

    def __init__(self, processors_classes, vocab_size: int, array, to_numpy,
                 max_num_reqs: int = 8, max_model_len: int = 256):
        self.states = RequestStates(max_num_reqs, max_model_len, vocab_size, array)
        self.procs = build_custom_logits_processors(None, self.states, processors_classes)
        self.validate = build_custom_logits_processors_params_validator(processors_classes)
        self.array, self.to_numpy = array, to_numpy
        self.slot: Dict[str, int] = {}
        self.tokens: Dict[str, List[int]] = {}
        self.prompt: Dict[str, List[int]] = {}

    def add(self, req_id: str, prompt: List[int], params: SamplingParams) -> int:
        self.validate(params)
        s = self.states
        slot = s.free_indices.pop()
        self.slot[req_id] = slot
        self.tokens[req_id] = list(prompt)
        self.prompt[req_id] = list(prompt)
        s.prompt_len.np[slot] = len(prompt)
        s.prefill_len.np[slot] = len(prompt)
        self._write(slot)
        for p in self.procs:
            p.add_request(slot, params)
        return slot

    def remove(self, req_id: str) -> None:
        slot = self.slot.pop(req_id)
        self.tokens.pop(req_id)
        self.states.free_indices.append(slot)

    def _write(self, slot: int) -> None:
        """The model runner's post-step writes, in place (the processors hold the buffers)."""
        toks = [t for rid, t in self.tokens.items() if self.slot[rid] == slot][0]
        self.states.all_token_ids.gpu[slot, :len(toks)] = self.array(
            np.array(toks, dtype=np.int32))
        self.states.total_len.gpu[slot] = len(toks)

    def layout(self, order: List[str], drafts: Optional[Dict[str, List[int]]] = None):
        """The rows of a step: ``[(req_id, local_pos, fed_token, pos)]``."""
        drafts = drafts or {}
        rows = []
        for rid in order:
            toks = self.tokens[rid]
            d = drafts.get(rid, [])
            rows.append((rid, 0, toks[-1], len(toks) - 1))
            for j, t in enumerate(d, start=1):
                rows.append((rid, j, t, len(toks) - 1 + j))
        return rows

    def context(self, rows) -> LogitsContext:
        order = list(dict.fromkeys(r[0] for r in rows))
        slots = np.array([self.slot[r[0]] for r in rows], dtype=np.int32)
        idx = np.array([self.slot[r] for r in order], dtype=np.int32)
        a = self.array
        return LogitsContext(
            expanded_idx_mapping=a(slots), idx_mapping=a(idx), idx_mapping_np=idx.astype(np.intp),
            expanded_local_pos=a(np.array([r[1] for r in rows], dtype=np.int32)),
            input_ids=a(np.array([r[2] for r in rows], dtype=np.int32)),
            pos=a(np.array([r[3] for r in rows], dtype=np.int64)),
            seq_lens_upper_bound_np=np.array([len(self.tokens[r]) + 4 for r in order]))

    def apply(self, logits, rows):
        for p in self.procs:
            p.apply_staged_writes()
        ctx = self.context(rows)
        for p in self.procs:
            logits = p.apply(logits, ctx)
        return logits

    def commit(self, req_id: str, new_tokens: List[int]) -> None:
        self.tokens[req_id].extend(int(t) for t in new_tokens)
        self._write(self.slot[req_id])
