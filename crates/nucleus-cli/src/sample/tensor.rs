//! `--logits FILE.safetensors` and `--params FILE.json`: a `[batch, vocab]` logits tensor and
//! the parameters of its rows.

use std::path::Path;

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use super::input::{Object, ParamsInput};

/// The `logits` tensor, copied out of the file into a vector of its own element type (the
/// file's bytes carry no alignment guarantee, so they are never reinterpreted in place).
#[derive(Clone, Debug, PartialEq)]
pub enum LogitsData {
    /// F32 values.
    F32(Vec<f32>),
    /// F16 values.
    F16(Vec<f16>),
    /// BF16 values.
    Bf16(Vec<bf16>),
}

/// A `[batch, vocab]` logits matrix read from a safetensors file.
#[derive(Clone, Debug, PartialEq)]
pub struct LogitsTensor {
    /// Rows.
    pub batch: usize,
    /// Values per row.
    pub vocab: usize,
    /// `batch * vocab` values, row-major.
    pub data: LogitsData,
}

/// Reads the tensor named `logits` from the safetensors file at `path`.
///
/// # Errors
/// A message when the file cannot be read or parsed, has no tensor named `logits`, or that
/// tensor is not of rank 2, or not f32, f16 or bf16.
pub fn read_logits(path: &Path) -> Result<LogitsTensor, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| format!("{} is not a safetensors file: {e}", path.display()))?;
    let tensor = file.tensor("logits").map_err(|_| {
        let mut names = file.names();
        names.sort_unstable();
        format!(
            "{} has no tensor named `logits` (it has: {})",
            path.display(),
            if names.is_empty() {
                "none".to_string()
            } else {
                names.join(", ")
            }
        )
    })?;
    let &[batch, vocab] = tensor.shape() else {
        return Err(format!(
            "tensor `logits` in {} has shape {:?}: expected rank 2, [batch, vocab]",
            path.display(),
            tensor.shape()
        ));
    };
    let raw = tensor.data();
    let width = match tensor.dtype() {
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::BF16 => 2,
        other => {
            return Err(format!(
                "tensor `logits` in {} has dtype {other:?}: expected F32, F16 or BF16",
                path.display()
            ))
        }
    };
    if Some(raw.len()) != batch.checked_mul(vocab).and_then(|n| n.checked_mul(width)) {
        return Err(format!(
            "tensor `logits` in {} holds {} bytes, not the {batch} x {vocab} x {width} its shape needs",
            path.display(),
            raw.len()
        ));
    }
    let halves = || {
        raw.chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    let data = match tensor.dtype() {
        Dtype::F32 => LogitsData::F32(
            raw.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ),
        Dtype::F16 => LogitsData::F16(halves().map(f16::from_bits).collect()),
        _ => LogitsData::Bf16(halves().map(bf16::from_bits).collect()),
    };
    Ok(LogitsTensor { batch, vocab, data })
}

/// The parameters of every row: one object for all rows, or a list of one object per row.
#[derive(Clone, Debug)]
pub enum ParamsFile {
    /// One object, for every row.
    One(Box<ParamsInput>),
    /// One object per row, in row order.
    PerRow(Vec<ParamsInput>),
}

/// Reads `--params FILE.json`.
///
/// # Errors
/// A message when the file cannot be read, is not JSON, or is not an object or a list of
/// objects of [`ParamsInput`] fields.
pub fn read_params(path: &Path) -> Result<ParamsFile, String> {
    let text = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let value: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| format!("{} is not valid JSON: {e}", path.display()))?;
    match value {
        serde_json::Value::Array(items) => items
            .into_iter()
            .enumerate()
            .map(|(i, item)| {
                serde_json::from_value(item)
                    .map(|Object(p)| p)
                    .map_err(|e| format!("{}: params object {i}: {e}", path.display()))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(ParamsFile::PerRow),
        value @ serde_json::Value::Object(_) => serde_json::from_value(value)
            .map(|Object(p)| ParamsFile::One(Box::new(p)))
            .map_err(|e| format!("{}: {e}", path.display())),
        _ => Err(format!(
            "{} must hold a params object or a list of them",
            path.display()
        )),
    }
}
