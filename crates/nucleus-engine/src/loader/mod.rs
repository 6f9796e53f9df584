//! Loaders: from a file or folder to a model behind [`crate::CausalLm`], its tokenizer and what
//! was ignored. Models know nothing of files; each loader maps its format's names and
//! hyper-parameters onto a [`crate::Transformer`] and its [`crate::ModelConfig`].
//!
//! | format | families | loader |
//! |---|---|---|
//! | GGUF file | arch `llama` (Llama 1/2/3, TinyStories, …), `qwen2`, `qwen3`; f32 / f16 / bf16 / ggml-quantized | [`load_gguf`] |
//! | Hugging Face folder | `model_type` `llama` (Llama 2, 3, 3.1, 3.2), `qwen2` (Qwen2, Qwen2.5), `qwen3` (dense Qwen3); safetensors f32 / f16 / bf16 | [`load_hf_folder`] |
//!
//! [`load_model`] picks the loader from the path.

pub mod gguf;
pub(crate) mod gguf_model;
pub mod hf;

use std::path::Path;

use candle_core::Device;

use crate::error::{EngineError, Result};
use crate::models::CausalLm;
use crate::tokenizer::ModelTokenizer;

pub use gguf::{load_gguf, load_gguf_from, load_gguf_tokenizer};
pub use hf::{load_hf_folder, load_hf_tokenizer, load_tokenizer_json, SUPPORTED_MODEL_TYPES};

/// A model, its tokenizer and the warnings of its loading, from [`load_model`],
/// [`load_gguf`] or [`load_hf_folder`].
#[derive(Debug)]
pub struct LoadedModel {
    /// The forward pass and its hyper-parameters (BOS and EOS ids included).
    pub model: Box<dyn CausalLm>,
    /// The tokenizer, with the same BOS and EOS ids.
    pub tokenizer: ModelTokenizer,
    /// What was wrong with the files but ignored, one message each, for the caller to show (the
    /// library prints nothing): GGUF special token ids outside the vocabulary other than BOS and
    /// EOS, which llama.cpp also ignores with a warning (see
    /// [`ModelTokenizer::from_gguf`]); checkpoint tensors a Hugging Face model does not use.
    pub warnings: Vec<String>,
}

/// Loads a model from `path` onto `device`: a directory is a Hugging Face model folder
/// ([`load_hf_folder`]), a file a GGUF file ([`load_gguf`]).
///
/// # Errors
/// As the loader's; [`EngineError::Io`] when `path` cannot be inspected.
pub fn load_model(path: &Path, device: &Device) -> Result<LoadedModel> {
    let meta = std::fs::metadata(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    if meta.is_dir() {
        load_hf_folder(path, device)
    } else {
        load_gguf(path, device)
    }
}

/// Loads the tokenizer alone from `path`, without weights: a directory is a Hugging Face model
/// folder ([`load_hf_tokenizer`]; a folder without config.json, a tokenizer-only folder, is read
/// as its `tokenizer.json` is), a file whose name ends in `.json` a `tokenizer.json`
/// ([`load_tokenizer_json`], with the configuration files beside it), any other file a GGUF
/// file whose metadata is read ([`load_gguf_tokenizer`]; vocab-only files without tensors load).
///
/// # Errors
/// [`EngineError::Io`] naming `path` when it cannot be inspected; otherwise as the loader's,
/// each naming the file.
pub fn load_tokenizer(path: &Path) -> Result<ModelTokenizer> {
    let meta = std::fs::metadata(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    if meta.is_dir() {
        if path.join("config.json").exists() {
            Ok(load_hf_tokenizer(path)?.0)
        } else {
            load_tokenizer_json(&path.join("tokenizer.json"))
        }
    } else if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("json"))
    {
        load_tokenizer_json(path)
    } else {
        load_gguf_tokenizer(path)
    }
}
