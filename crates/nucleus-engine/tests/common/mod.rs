//! Shared helpers of the nucleus-engine integration tests.
#![allow(dead_code)]

pub mod hf;
pub mod raw;

use std::path::{Path, PathBuf};

/// The stories260K GGUF in the shared data directory (`../shared/models/` next to the repo),
/// else the default model through the Hugging Face hub cache ([`nucleus_engine::hub`]).
///
/// # Panics
/// When neither is there: the model tests never skip.
pub fn stories260k() -> PathBuf {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/stories260K.gguf");
    if path.is_file() {
        return path;
    }
    match nucleus_engine::hub::resolve_model(None) {
        Ok(cached) => cached,
        Err(e) => panic!("test model {} not found, and {e}", path.display()),
    }
}

/// A fresh path in the system temp directory, unique to this process and `tag`.
pub fn temp_path(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!(
        "nucleus-engine-test-{}-{n}-{tag}",
        std::process::id()
    ))
}

/// Removes a file when dropped (temp files of a test, also on panic).
pub struct TempFile(pub PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The index of the largest value (first of equals).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if v.total_cmp(&values[best]).is_gt() {
            best = i;
        }
    }
    best as u32
}

/// Largest absolute elementwise difference.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Copies the GGUF file `src` to `dst`, letting `edit_metadata` change the metadata (sorted by
/// key) and `map_tensor` replace or drop (`None`) each tensor. Tensors keep their file order.
pub fn rewrite_gguf(
    src: &Path,
    dst: &Path,
    edit_metadata: impl FnOnce(&mut Vec<(String, candle_core::quantized::gguf_file::Value)>),
    map_tensor: impl Fn(
        &str,
        candle_core::quantized::QTensor,
    ) -> anyhow::Result<Option<candle_core::quantized::QTensor>>,
) -> anyhow::Result<()> {
    use candle_core::quantized::gguf_file;
    let mut reader = std::io::BufReader::new(std::fs::File::open(src)?);
    let content = gguf_file::Content::read(&mut reader)?;
    let mut metadata: Vec<(String, gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    metadata.sort_by(|a, b| a.0.cmp(&b.0));
    edit_metadata(&mut metadata);
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort_by_key(|n| content.tensor_infos[*n].offset);
    let mut tensors = Vec::new();
    for name in names {
        let t = content.tensor(&mut reader, name, &candle_core::Device::Cpu)?;
        if let Some(t) = map_tensor(name, t)? {
            tensors.push((name.clone(), t));
        }
    }
    let md: Vec<(&str, &gguf_file::Value)> =
        metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &candle_core::quantized::QTensor)> =
        tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::io::BufWriter::new(std::fs::File::create(dst)?);
    gguf_file::write(&mut out, &md, &ts)?;
    use std::io::Write;
    out.flush()?;
    Ok(())
}

/// Sets (or adds) metadata key `key`.
pub fn set_metadata(
    metadata: &mut Vec<(String, candle_core::quantized::gguf_file::Value)>,
    key: &str,
    value: candle_core::quantized::gguf_file::Value,
) {
    match metadata.iter_mut().find(|(k, _)| k == key) {
        Some(entry) => entry.1 = value,
        None => metadata.push((key.to_string(), value)),
    }
}
