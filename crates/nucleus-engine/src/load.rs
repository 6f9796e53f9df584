//! Loading a GGUF file: [`load_gguf`] reads the model ([`LlamaModel`]) and its tokenizer
//! ([`GgufTokenizer`]) from one file, plus the metadata helpers both use.
//!
//! GGUF is llama.cpp's file format: a header, typed key/value metadata (`general.architecture`,
//! `llama.*` hyper-parameters, `tokenizer.ggml.*`), tensor descriptions and aligned tensor data
//! (spec: <https://github.com/ggml-org/ggml/blob/master/docs/gguf.md>). Parsing is candle's
//! (`candle_core::quantized::gguf_file`); what we read from it is checked here, so that a missing
//! key, a wrong type or a truncated file is an [`EngineError`], never a panic.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::Device;

use crate::error::candle_message;
use crate::error::{EngineError, Result};
use crate::model::LlamaModel;
use crate::tokenizer::GgufTokenizer;

/// A model and its tokenizer, both read from one GGUF file by [`load_gguf`].
#[derive(Debug)]
pub struct LoadedModel {
    /// The forward pass and its hyper-parameters.
    pub model: LlamaModel,
    /// The tokenizer from the file's `tokenizer.ggml.*` metadata.
    pub tokenizer: GgufTokenizer,
}

/// Reads a Llama-architecture model and its tokenizer from the GGUF file at `path`, with the
/// weights on `device`.
///
/// Semantics: [`LlamaModel::from_gguf`] for the weights and hyper-parameters,
/// [`GgufTokenizer::from_gguf`] for the tokenizer. The tokenizer may not hold more tokens than the
/// model's vocabulary (the token embedding's rows); fewer is fine (padded vocabularies).
///
/// Errors:
/// - [`EngineError::Io`] when the file cannot be opened;
/// - [`EngineError::InvalidModel`] (naming `path`) when it is not a GGUF file, is truncated or
///   corrupt, lacks a tensor or metadata key, has a tensor of the wrong shape, or has malformed
///   tokenizer metadata;
/// - [`EngineError::Unsupported`] for an architecture other than `llama` or a tokenizer kind
///   other than `llama` / `gpt2`.
pub fn load_gguf(path: &Path, device: &Device) -> Result<LoadedModel> {
    let _span = tracing::debug_span!("load_gguf", path = %path.display()).entered();
    let file = File::open(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut reader = BufReader::new(file);
    let content = read_content(&mut reader, path)?;
    let model = LlamaModel::from_gguf(&content, &mut reader, path, device)?;
    let tokenizer = GgufTokenizer::from_gguf(&content).map_err(|e| match e {
        EngineError::Tokenizer(message) => invalid(path, format!("tokenizer: {message}")),
        other => other,
    })?;
    let n_tokens = tokenizer.tokenizer.get_vocab_size(false);
    let vocab_size = model.config().vocab_size;
    if n_tokens > vocab_size {
        return Err(invalid(
            path,
            format!(
                "the tokenizer has {n_tokens} tokens but the model's vocabulary \
                 (token_embd.weight rows) is {vocab_size}"
            ),
        ));
    }
    Ok(LoadedModel { model, tokenizer })
}

/// Parses the GGUF header and metadata of `reader` (the file at `path`).
///
/// candle's parser checks lengths against the file size, but a few corrupt values still make it
/// panic (e.g. `general.alignment = 0` divides by zero); such a panic is caught and reported as
/// `InvalidModel` like any other parse error.
fn read_content(reader: &mut BufReader<File>, path: &Path) -> Result<gguf_file::Content> {
    let parsed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        gguf_file::Content::read(reader)
    }));
    match parsed {
        Ok(Ok(content)) => Ok(content),
        Ok(Err(e)) => Err(invalid(
            path,
            format!("not a readable GGUF file: {}", candle_message(&e)),
        )),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(invalid(
                path,
                format!("not a readable GGUF file (the parser panicked: {what})"),
            ))
        }
    }
}

/// `InvalidModel` for `path`.
pub(crate) fn invalid(path: &Path, message: impl Into<String>) -> EngineError {
    EngineError::InvalidModel {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// A metadata value as a non-negative integer. `Ok(None)` when the key is absent; `Err` (a
/// message naming the key) when it holds a non-integer or a negative value.
pub(crate) fn md_u64(content: &gguf_file::Content, key: &str) -> Result<Option<u64>, String> {
    let Some(value) = content.metadata.get(key) else {
        return Ok(None);
    };
    value_to_u64(value)
        .map(Some)
        .ok_or_else(|| format!("metadata `{key}` is {value:?}, expected a non-negative integer"))
}

/// A metadata value as `usize` (see [`md_u64`]); values beyond `usize` are an error.
pub(crate) fn md_usize(content: &gguf_file::Content, key: &str) -> Result<Option<usize>, String> {
    md_u64(content, key)?
        .map(|v| usize::try_from(v).map_err(|_| format!("metadata `{key}` = {v} is too large")))
        .transpose()
}

/// A metadata value as `f64` (from F32, F64 or an integer). `Ok(None)` when absent.
pub(crate) fn md_f64(content: &gguf_file::Content, key: &str) -> Result<Option<f64>, String> {
    let Some(value) = content.metadata.get(key) else {
        return Ok(None);
    };
    let v = match value {
        Value::F32(v) => f64::from(*v),
        Value::F64(v) => *v,
        other => match value_to_u64(other) {
            Some(v) => v as f64,
            None => return Err(format!("metadata `{key}` is {value:?}, expected a number")),
        },
    };
    Ok(Some(v))
}

/// A metadata value as a string. `Ok(None)` when absent.
pub(crate) fn md_str<'a>(
    content: &'a gguf_file::Content,
    key: &str,
) -> Result<Option<&'a str>, String> {
    match content.metadata.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(other) => Err(format!(
            "metadata `{key}` is a {:?}, expected a string",
            other.value_type()
        )),
    }
}

/// A metadata value as a bool. `Ok(None)` when absent.
pub(crate) fn md_bool(content: &gguf_file::Content, key: &str) -> Result<Option<bool>, String> {
    match content.metadata.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(format!(
            "metadata `{key}` is a {:?}, expected a bool",
            other.value_type()
        )),
    }
}

/// A metadata value as an array. `Ok(None)` when absent.
pub(crate) fn md_array<'a>(
    content: &'a gguf_file::Content,
    key: &str,
) -> Result<Option<&'a [Value]>, String> {
    match content.metadata.get(key) {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a.as_slice())),
        Some(other) => Err(format!(
            "metadata `{key}` is a {:?}, expected an array",
            other.value_type()
        )),
    }
}

/// An integer value of any GGUF integer type, `None` for other types and negative values.
pub(crate) fn value_to_u64(value: &Value) -> Option<u64> {
    match *value {
        Value::U8(v) => Some(u64::from(v)),
        Value::U16(v) => Some(u64::from(v)),
        Value::U32(v) => Some(u64::from(v)),
        Value::U64(v) => Some(v),
        Value::I8(v) => u64::try_from(v).ok(),
        Value::I16(v) => u64::try_from(v).ok(),
        Value::I32(v) => u64::try_from(v).ok(),
        Value::I64(v) => u64::try_from(v).ok(),
        _ => None,
    }
}
