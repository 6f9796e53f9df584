//! `--logits FILE.safetensors` and `--params FILE.json`: a `[batch, vocab]` logits tensor and
//! the parameters of its rows.

use std::fmt;

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};
use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use super::input::{Object, ParamsInput};
use super::{from_json, JsonError};
use crate::input::{copy_values, shown};

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

/// Most tensor names listed in the error for a file without a `logits` tensor.
const NAMES_SHOWN: usize = 16;

/// Reads the tensor named `logits` from a safetensors file's bytes (`nucleus sample --logits`
/// reads the file, then calls this).
///
/// # Errors
/// A message (without the file name) when the bytes are not a safetensors file, have no
/// tensor named `logits`, or that tensor is not of rank 2, has no columns, or is not f32, f16
/// or bf16, or when its copy cannot be held in memory.
pub fn logits_from_bytes(bytes: &[u8]) -> Result<LogitsTensor, String> {
    let file = SafeTensors::deserialize(bytes).map_err(|e| crate::input::not_safetensors(&e))?;
    let tensor = file.tensor("logits").map_err(|_| {
        let mut names = file.names();
        names.sort_unstable();
        let mut listed: Vec<String> = names.iter().take(NAMES_SHOWN).map(|n| shown(n)).collect();
        if names.len() > NAMES_SHOWN {
            listed.push(format!("and {} more", names.len() - NAMES_SHOWN));
        }
        format!(
            "no tensor named `logits` (it has: {})",
            if listed.is_empty() {
                "none".to_string()
            } else {
                listed.join(", ")
            }
        )
    })?;
    let &[batch, vocab] = tensor.shape() else {
        return Err(format!(
            "tensor `logits` has shape {:?}: expected rank 2, [batch, vocab]",
            tensor.shape()
        ));
    };
    if vocab == 0 {
        return Err("the logits tensor has 0 columns: at least one token is needed".to_string());
    }
    let raw = tensor.data();
    let width = match tensor.dtype() {
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::BF16 => 2,
        other => {
            return Err(format!(
                "tensor `logits` has dtype {other:?}: expected F32, F16 or BF16"
            ))
        }
    };
    if Some(raw.len()) != batch.checked_mul(vocab).and_then(|n| n.checked_mul(width)) {
        return Err(format!(
            "tensor `logits` holds {} bytes, not the {batch} x {vocab} x {width} its shape needs",
            raw.len()
        ));
    }
    let halves = || {
        raw.chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    // Reserved first: a copy the machine cannot hold is a message, not an abort.
    let len = batch * vocab;
    let data = match tensor.dtype() {
        Dtype::F32 => LogitsData::F32(copy_values(
            "logits",
            len,
            raw.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        )?),
        Dtype::F16 => LogitsData::F16(copy_values("logits", len, halves().map(f16::from_bits))?),
        _ => LogitsData::Bf16(copy_values("logits", len, halves().map(bf16::from_bits))?),
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

impl<'de> Deserialize<'de> for ParamsFile {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct FileVisitor;

        impl<'de> Visitor<'de> for FileVisitor {
            type Value = ParamsFile;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a params object or a list of them")
            }

            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<ParamsFile, A::Error> {
                ParamsInput::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(|p| ParamsFile::One(Box::new(p)))
            }

            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<ParamsFile, A::Error> {
                let mut list = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(Object(p)) = seq.next_element::<Object<ParamsInput>>()? {
                    list.push(p);
                }
                Ok(ParamsFile::PerRow(list))
            }
        }

        deserializer.deserialize_any(FileVisitor)
    }
}

/// Reads the bytes of `--params FILE.json`. The text is read as it is written (not through a
/// JSON value, which would keep only the last of two equal `logit_bias` keys); a wrong field is
/// named by its JSON path (`[2].seed: ...` for the third object of a list).
///
/// # Errors
/// A message (without the file name) when the bytes are not JSON, or not an object or a list
/// of objects of [`ParamsInput`] fields.
pub fn params_from_bytes(text: &[u8]) -> Result<ParamsFile, String> {
    from_json::<ParamsFile>(text).map_err(|e| match e {
        JsonError::Syntax(e) => format!("not valid JSON: {e}"),
        JsonError::Shape(message) => message,
    })
}
