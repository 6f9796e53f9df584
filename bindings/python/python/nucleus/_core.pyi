# The native module (src/*.rs). Use the functions of `nucleus` (__init__.py and its modules):
# they check and normalise their arguments, then call these. tests/test_stubs.py checks this
# file against the built module with mypy's stubtest.
from typing import Any, Dict, List, Optional, Sequence, Tuple, final

import numpy as np

__version__: str

__all__ = [
    "CompiledGrammar",
    "DlpackOwner",
    "DlpackView",
    "GrammarCompiler",
    "GrammarMatcher",
    "SamplerChain",
    "__version__",
    "apply_token_bitmask_inplace_f32",
    "chain_speculative_verify",
    "default_params",
    "distribution_f32",
    "dlpack_to_numpy",
    "npu_moe_finalize_routing",
    "npu_moe_gating_top_k",
    "npu_moe_gating_top_k_softmax",
    "npu_moe_init_routing_v2",
    "npu_top_k_top_p_sample",
    "sample",
    "validate_params",
]

_Errors = List[Optional[Tuple[str, str]]]

# --- sampling (src/lib.rs, src/params.rs) -------------------------------------------------------

def sample(logits: np.ndarray, dtype: str, kind: str, vocab_size: int, temperature: np.ndarray,
           top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
           repetition_penalty: np.ndarray, presence_penalty: np.ndarray,
           frequency_penalty: np.ndarray, seed: Optional[np.ndarray], position: np.ndarray,
           sample_index: np.ndarray, prompt_ids: Sequence[Sequence[int]],
           output_ids: Sequence[Sequence[int]], params: Optional[List[Dict[str, Any]]] = None,
           stop_token_ids: Optional[Sequence[Sequence[int]]] = None,
           mirostat_mu: Optional[np.ndarray] = None, token_bitmask: Optional[np.ndarray] = None,
           ) -> Tuple[np.ndarray, np.ndarray, _Errors, np.ndarray, np.ndarray, np.ndarray]: ...

def distribution_f32(logits: np.ndarray, kind: str, vocab_size: int, temperature: np.ndarray,
                     top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
                     repetition_penalty: np.ndarray, presence_penalty: np.ndarray,
                     frequency_penalty: np.ndarray, seed: Optional[np.ndarray],
                     position: np.ndarray, sample_index: np.ndarray,
                     prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
                     params: Optional[List[Dict[str, Any]]] = None,
                     stop_token_ids: Optional[Sequence[Sequence[int]]] = None,
                     mirostat_mu: Optional[np.ndarray] = None,
                     token_bitmask: Optional[np.ndarray] = None,
                     ) -> Tuple[np.ndarray, _Errors]: ...

def default_params() -> Dict[str, Any]: ...
def validate_params(d: Dict[str, Any]) -> Optional[Tuple[str, str]]: ...

def apply_token_bitmask_inplace_f32(logits: np.ndarray, bitmask: np.ndarray, vocab_size: int,
                                    rows: Sequence[int]) -> None: ...

def chain_speculative_verify(draft_probs: np.ndarray, draft_token_ids: np.ndarray,
                             target_probs: np.ndarray, seed: Optional[np.ndarray],
                             offset: np.ndarray,
                             ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, _Errors]: ...

@final
class SamplerChain:
    def __new__(cls, config_json: str) -> "SamplerChain": ...
    def clone(self) -> "SamplerChain": ...
    @staticmethod
    def from_params(params: Dict[str, Any]) -> "SamplerChain": ...
    def reset(self, prompt_ids: Sequence[int]) -> None: ...
    def accept(self, token: int) -> None: ...
    @property
    def output_ids(self) -> List[int]: ...
    def sample(self, logits: np.ndarray, position: int, sample_index: int = 0
               ) -> Tuple[int, float]: ...
    def distribution(self, logits: np.ndarray, position: int) -> np.ndarray: ...

# --- DLPack (src/dlpack.rs) ---------------------------------------------------------------------

def dlpack_to_numpy(obj: Any) -> np.ndarray: ...

@final
class DlpackView:
    def __new__(cls, array: np.ndarray, dtype_name: str) -> "DlpackView": ...
    def __dlpack__(self, *, stream: Any = None, max_version: Optional[Tuple[int, int]] = None,
                   dl_device: Optional[Tuple[int, int]] = None,
                   copy: Optional[bool] = None) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...

@final
class DlpackOwner: ...

# --- the Ascend operators (src/npu.rs) ----------------------------------------------------------

def npu_top_k_top_p_sample(logits: np.ndarray, dtype: str, top_k: np.ndarray, top_p: np.ndarray,
                           q: Optional[np.ndarray], min_ps: Optional[np.ndarray], eps: float,
                           is_need_logits: bool, top_k_guess: int, ks_max: int,
                           input_is_logits: bool, q_sorted_rank: bool,
                           ) -> Tuple[np.ndarray, Optional[np.ndarray], _Errors]: ...

def npu_moe_init_routing_v2(x: np.ndarray, dtype: str, expert_idx: np.ndarray,
                            scale: Optional[np.ndarray], offset: Optional[np.ndarray],
                            active_num: int, expert_capacity: int, expert_num: int,
                            drop_pad_mode: int, expert_tokens_num_type: int,
                            expert_tokens_num_flag: bool, quant_mode: int,
                            active_expert_range: Optional[Tuple[int, int]], row_idx_type: int,
                            ) -> Tuple[np.ndarray, List[int], np.ndarray, Optional[np.ndarray],
                                       Optional[np.ndarray], int]: ...

def npu_moe_gating_top_k_softmax(x: np.ndarray, dtype: str, k: int, renorm: bool,
                                 finished: Optional[np.ndarray],
                                 ) -> Tuple[np.ndarray, np.ndarray]: ...

def npu_moe_gating_top_k(x: np.ndarray, dtype: str, k: int, bias: Optional[np.ndarray],
                         k_group: int, group_count: int, group_select_mode: int, renorm: bool,
                         norm_type: int, routed_scaling_factor: float, eps: float,
                         ) -> Tuple[np.ndarray, np.ndarray]: ...

def npu_moe_finalize_routing(expert_out: np.ndarray, dtype: str, valid_rows: Optional[int],
                             expanded_row_idx: np.ndarray, k: int, weights: Optional[np.ndarray],
                             expert_idx: Optional[np.ndarray], skip1: Optional[np.ndarray],
                             skip2: Optional[np.ndarray], bias: Optional[np.ndarray],
                             ) -> np.ndarray: ...

# --- structured output (src/grammar.rs; nucleus/grammar.py) -------------------------------------

@final
class GrammarCompiler:
    @staticmethod
    def from_file(path: str, eos_token_ids: Sequence[int], vocab_size: Optional[int],
                  cache_size: int) -> "GrammarCompiler": ...
    @staticmethod
    def from_json_str(json: str, eos_token_ids: Sequence[int], vocab_size: Optional[int],
                      cache_size: int) -> "GrammarCompiler": ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> List[int]: ...
    @property
    def compilations(self) -> int: ...
    @property
    def cached_grammars(self) -> int: ...
    def clear_cache(self) -> None: ...
    def compile(self, kind: str, text: str, max_whitespace: Optional[int]
                ) -> "CompiledGrammar": ...

@final
class CompiledGrammar:
    @property
    def kind(self) -> str: ...
    @property
    def warnings(self) -> List[str]: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> List[int]: ...

@final
class GrammarMatcher:
    def __new__(cls, compiled: CompiledGrammar) -> "GrammarMatcher": ...
    def fill_next_token_bitmask(self, bitmask: np.ndarray, index: int) -> bool: ...
    def commit(self, token: int) -> None: ...
    def validate_tokens(self, tokens: Sequence[int]) -> int: ...
    def rollback(self, num_tokens: int) -> None: ...
    def reset(self) -> None: ...
    def may_end(self) -> bool: ...
    def is_ended(self) -> bool: ...
    @property
    def num_committed(self) -> int: ...
    @property
    def error(self) -> Optional[str]: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> List[int]: ...
