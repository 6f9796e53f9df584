//! `--model M` of every command that reads a model: a path, a hub id, or a GGUF in a hub
//! repository, resolved by [`nucleus_engine::hub`].

use std::path::PathBuf;

use anyhow::Result;

/// Resolves `--model` (None: `$NUCLEUS_MODEL`, else the default model from the hub).
///
/// # Errors
/// [`nucleus_engine::EngineError::ModelNotFound`] when the spec names nothing that can be found.
pub fn resolve(spec: Option<&str>) -> Result<PathBuf> {
    Ok(nucleus_engine::hub::resolve_model(
        spec.map(std::path::Path::new),
    )?)
}
