//! Repetition avoidance: DRY (llama.cpp) and no-repeat-n-gram (Hugging Face).
