# The native module (src/lib.rs). Use the functions of `nucleus` (__init__.py): they check and
# normalise their arguments, then call these.
from typing import List, Optional, Tuple

import numpy as np

__version__: str

_Errors = List[Optional[Tuple[str, str]]]

def sample(logits: np.ndarray, dtype: str, vocab_size: int, temperature: np.ndarray,
           top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
           repetition_penalty: np.ndarray, presence_penalty: np.ndarray,
           frequency_penalty: np.ndarray, seed: Optional[np.ndarray],
           position: np.ndarray) -> Tuple[np.ndarray, np.ndarray, _Errors]: ...

def distribution_f32(logits: np.ndarray, vocab_size: int, temperature: np.ndarray,
                     top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
                     repetition_penalty: np.ndarray, presence_penalty: np.ndarray,
                     frequency_penalty: np.ndarray, seed: Optional[np.ndarray],
                     position: np.ndarray) -> Tuple[np.ndarray, _Errors]: ...
