//! `--model M` of every command that reads a model: a path, a hub id, or a GGUF in a hub
//! repository, resolved by [`nucleus_engine::hub::resolve`] with the Hugging Face environment
//! ([`nucleus_engine::HubEnv::from_env`]: `HF_HOME`, `HF_HUB_CACHE`, `HF_ENDPOINT`,
//! `HF_HUB_OFFLINE`, `HF_TOKEN`).

use std::path::PathBuf;

use anyhow::Result;

/// Resolves `--model` (None: `$NUCLEUS_MODEL`, else the default model from the hub); a
/// download shows its progress on stderr unless `--quiet`.
///
/// # Errors
/// [`nucleus_engine::EngineError::ModelNotFound`] when the spec names nothing that can be found.
/// A spec that is not an existing path (a hub id) is followed by a note naming the file or
/// folder it resolved to (`--model o/r:Q4_K_M: /cache/.../r-Q4_K_M.gguf`).
pub fn resolve(spec: Option<&str>) -> Result<PathBuf> {
    let env = nucleus_engine::HubEnv::from_env();
    let path = nucleus_engine::hub::resolve(spec, &env, !crate::report::is_quiet())?;
    if let Some(spec) = spec.filter(|s| !std::path::Path::new(s).exists()) {
        crate::report::note(&format!(
            "--model {spec}: {}",
            crate::input::shown_path(&path)
        ));
    }
    Ok(path)
}

/// `--kv-cache-dtype f16|f32` of `generate`, `chat`, `serve` and `bench generate`: the element
/// type of the KV caches ([`nucleus_engine::KvCacheDtype`]; f16 by default, as llama.cpp's
/// `--cache-type-k/v`).
///
/// # Errors
/// Anything but `f16` or `f32` (clap prints the message and exits 2).
pub fn parse_kv_cache_dtype(s: &str) -> std::result::Result<nucleus_engine::KvCacheDtype, String> {
    s.parse()
}
