//! Where the model comes from: an explicit path (a GGUF file or a Hugging Face model folder),
//! `NUCLEUS_MODEL`, or the Hugging Face hub.

use std::path::{Path, PathBuf};

use crate::error::{EngineError, Result};

/// The hub repository of the default model (llama.cpp's CI models).
pub const DEFAULT_REPO: &str = "ggml-org/models";
/// The default model's file in [`DEFAULT_REPO`]: Karpathy's 260K-parameter TinyStories Llama.
pub const DEFAULT_FILE: &str = "tinyllamas/stories260K.gguf";
/// The environment variable naming a model file.
pub const MODEL_ENV: &str = "NUCLEUS_MODEL";

/// Resolves the model: `explicit` if given, else `$NUCLEUS_MODEL` (when set and not empty),
/// else [`DEFAULT_FILE`] from [`DEFAULT_REPO`] through the hf-hub cache (downloading it once).
///
/// A given path (either way, symbolic links followed) must be a regular file (a GGUF file) or a
/// directory (a Hugging Face model folder, for [`crate::load_model`]): not a device
/// (`/dev/zero`), a FIFO or a socket, which a loader could block on or read forever.
///
/// # Errors
/// [`EngineError::ModelNotFound`] when the given path does not exist, cannot be inspected
/// (e.g. permission denied), or is neither a regular file nor a directory; the message starts
/// with the path, as `NUCLEUS_MODEL=PATH` when it came from the environment. Also when no path
/// was given and the hub cannot be reached (offline); the message then says to pass
/// `--model`.
pub fn resolve_model(explicit: Option<&Path>) -> Result<PathBuf> {
    let given = match explicit {
        Some(path) => Some((path.to_path_buf(), false)),
        None => std::env::var_os(MODEL_ENV)
            .filter(|v| !v.is_empty())
            .map(|v| (PathBuf::from(v), true)),
    };
    if let Some((path, from_env)) = given {
        let what = match std::fs::metadata(&path) {
            Ok(m) if m.is_file() || m.is_dir() => return Ok(path),
            Ok(m) => format!(
                "is not a regular file or directory ({}); pass a GGUF file or a Hugging Face \
                 model folder",
                file_kind(&m.file_type())
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => "does not exist".to_string(),
            Err(e) => format!("cannot be inspected: {e}"),
        };
        let shown = if from_env {
            format!("{MODEL_ENV}={}", crate::error::shown_path(&path))
        } else {
            crate::error::shown_path(&path)
        };
        return Err(EngineError::ModelNotFound(format!("{shown}: {what}")));
    }
    let fail = |e: &dyn std::fmt::Display| {
        EngineError::ModelNotFound(format!(
            "no --model given, {MODEL_ENV} is not set, and {DEFAULT_FILE} could not be fetched \
             from the Hugging Face hub repository {DEFAULT_REPO} ({e}); pass --model PATH to a \
             GGUF file or a Hugging Face model folder"
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

/// What a file that is not a regular file is, for messages.
pub(crate) fn file_kind(t: &std::fs::FileType) -> &'static str {
    if t.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    let _ = t;
    "a special file"
}
