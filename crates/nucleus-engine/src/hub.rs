//! Where the model file comes from: an explicit path, `NUCLEUS_MODEL`, or the Hugging Face hub.

use std::path::{Path, PathBuf};

use crate::error::{EngineError, Result};

/// The hub repository of the default model (llama.cpp's CI models).
pub const DEFAULT_REPO: &str = "ggml-org/models";
/// The default model's file in [`DEFAULT_REPO`]: Karpathy's 260K-parameter TinyStories Llama.
pub const DEFAULT_FILE: &str = "tinyllamas/stories260K.gguf";
/// The environment variable naming a model file.
pub const MODEL_ENV: &str = "NUCLEUS_MODEL";

/// Resolves the model file: `explicit` if given, else `$NUCLEUS_MODEL` (when set and not
/// empty), else
/// [`DEFAULT_FILE`] from [`DEFAULT_REPO`] through the hf-hub cache (downloading it once).
///
/// # Errors
/// [`EngineError::ModelNotFound`] when the given path does not exist, or when no path was
/// given and the hub cannot be reached (offline); the message says to pass `--model`.
pub fn resolve_model(explicit: Option<&Path>) -> Result<PathBuf> {
    let given = explicit.map(Path::to_path_buf).or_else(|| {
        std::env::var_os(MODEL_ENV)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    });
    if let Some(path) = given {
        if path.is_file() {
            return Ok(path);
        }
        let what = if path.is_dir() {
            "is a directory, not a GGUF file"
        } else {
            "does not exist"
        };
        return Err(EngineError::ModelNotFound(format!(
            "{} {what}",
            path.display()
        )));
    }
    let fail = |e: &dyn std::fmt::Display| {
        EngineError::ModelNotFound(format!(
            "no --model given, {MODEL_ENV} is not set, and {DEFAULT_FILE} could not be fetched \
             from the Hugging Face hub repository {DEFAULT_REPO} ({e}); pass --model PATH to a \
             GGUF file"
        ))
    };
    let api = hf_hub::api::sync::ApiBuilder::new()
        .with_progress(false)
        .build()
        .map_err(|e| fail(&e))?;
    api.model(DEFAULT_REPO.to_string())
        .get(DEFAULT_FILE)
        .map_err(|e| fail(&e))
}
