//! `nucleus moe-init-routing`: nucleus-moe's [`moe_init_routing`] (the Ascend
//! `torch_npu.npu_moe_init_routing_v2` contract, `spec/moe_routing.md`) on calls read from a
//! file or a pipe, one JSON answer per call.
//!
//! # Input
//!
//! JSON lines (`--input FILE`, or stdin: no `--input`, or `--input -`), one whole call each:
//!
//! ```json
//! {"x": [[1, 10], [2, 20], [3, 30]], "expert_idx": [[2, 0], [1, 2], [0, 1]], "expert_num": 4,
//!  "scale": null, "offset": null, "x_dtype": "f32", "active_num": -1, "expert_capacity": -1,
//!  "drop_pad_mode": 0, "expert_tokens_num_type": 1, "expert_tokens_num_flag": true,
//!  "quant_mode": -1, "active_expert_range": [], "row_idx_type": 0}
//! ```
//!
//! `x` (`[N, H]` rows), `expert_idx` (`[N, K]` rows of i32) and `expert_num` are required;
//! the other attributes have the spec's defaults ([`AttrsInput`]). `x_dtype` (`"f32"`
//! default, `"f16"`, `"bf16"`, `"i8"`) is the element type of `x`: each number is rounded to
//! it (to nearest, ties to even, straight from the JSON number), an `i8` must be an integer in
//! `-128..=127`, and a finite number beyond the type's range is an `invalid_call` error naming
//! its place. `scale` is a list of numbers, or a list of rows (`[1, H]` / `[end - start, H]`
//! smooth scales), flattened row-major; `offset` a list. Numbers may be the strings `"-inf"`,
//! `"inf"`, `"nan"` ([`Lenient`]). `null` is a field left out; unknown fields are errors.
//! Lines that [`str::trim`] leaves empty are skipped; a UTF-8 byte order mark at the start is
//! ignored.
//!
//! Or `--tensors FILE.safetensors` ([`run_safetensors`]): tensors `x` (`[N, H]`, F32, F16,
//! BF16 or I8), `expert_idx` (`[N, K]`, I32, or I64 with values within i32), optional `scale`
//! (F32, rank 1 or 2, flattened) and `offset` (F32, rank 1), one call, with the attributes from
//! `--attrs` (a JSON object, inline or the path of a file; `expert_num` is required).
//!
//! # Output
//!
//! One line per call ([`Answer`]):
//!
//! ```json
//! {"expanded_x":[[1.0,10.0],[3.0,30.0]],"expanded_x_dtype":"f32","expanded_row_idx":[1,0],"expert_tokens":null,"expanded_scale":null,"valid_rows":2}
//! ```
//!
//! `expanded_x` is nested per its shape (`[rows][H]`, or `[E][C][H]` in drop/pad mode), its
//! values in `expanded_x_dtype` (`x_dtype`, or `i8` when quantised); f16 / bf16 values are
//! written as their exact f32 value (the shortest decimal that reads back to it), non-finite
//! ones as `"inf"`, `"-inf"`, `"nan"`. `expert_tokens` is `null` without
//! `expert_tokens_num_flag`, a list for count and cumsum, and `[[expert id, count], ...]` rows
//! (`[E, 2]`) for key-value. `expanded_scale` is `null` when the operator gives none.
//!
//! A call that fails gets `{"error": {"kind": "...", "message": "..."}}` ([`CallError`]):
//! `invalid_json` (not JSON), `invalid_call` (JSON of the wrong shape: a missing, unknown or
//! mistyped field, named by its JSON path; a value not representable in `x_dtype`; a missing
//! or unknown tensor), `dtype` (a safetensors tensor of a dtype not taken), or the operator's
//! [`MoeError::kind`] (`shape`, `attribute`, `combination`, `non_finite`, `index`), with the
//! rule in the message; ragged rows are `shape` errors and a bad attribute value is an
//! `attribute` error here too. The next lines are answered all the same.
//!
//! # Exit status
//!
//! 0 when every call got an answer (an error answer included, `input_too_large` for a line
//! longer than `--max-input-bytes` too, `allocation` for a call whose outputs and working
//! memory cannot be had, checked before the operator runs, and an error answer for inline
//! `--attrs` values outside the operator's range); 1 for an unreadable input file, one larger
//! than `--max-input-bytes`, a file that is not safetensors, a tensor whose copy out of it
//! cannot be held in memory, or a bad `--attrs` file, and when writing fails; 2 for bad flags,
//! an inline `--attrs` that is not a valid object included ([`crate::usage`]).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use half::{bf16, f16};
use nucleus_moe::{
    moe_init_routing, DropPadMode, Element, ExpandedX, ExpertTokensNumType, MoeError,
    MoeInitRoutingAttrs, MoeInitRoutingInput, MoeInitRoutingOutput, QuantMode, RowIdxType,
};
use safetensors::{Dtype, SafeTensors};
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::ser::SerializeSeq;
use serde::{Deserialize, Serialize, Serializer};

use crate::answer::Reply;
use crate::calls::TensorsError;
use crate::input::{
    copy_i32_tensor, copy_values, read_file, shown, shown_path, words, InputLimit, MaxInputBytes,
};
use crate::sample::input::{Fallible, Lenient};
use crate::sample::output::non_finite_name;

/// The flags of `nucleus moe-init-routing`.
#[derive(Args, Debug, Clone, Default)]
pub struct MoeInitRoutingArgs {
    /// JSON lines, one call each (default, or `-`: stdin).
    #[arg(long, value_name = "FILE", conflicts_with = "tensors")]
    pub input: Option<PathBuf>,
    /// Instead of JSON lines: a safetensors file holding one call (tensors `x`, `expert_idx`,
    /// optional `scale` and `offset`); needs --attrs.
    #[arg(long, value_name = "FILE.safetensors", requires = "attrs")]
    pub tensors: Option<PathBuf>,
    /// With --tensors: the attributes, a JSON object (the path of a file holding it, else
    /// inline JSON) with `expert_num` (required), `active_num`, `expert_capacity`,
    /// `drop_pad_mode`, `expert_tokens_num_type`, `expert_tokens_num_flag`, `quant_mode`,
    /// `active_expert_range`, `row_idx_type`.
    // `requires` alone lets `--input F --attrs A` through (clap allows a missing requirement
    // when it conflicts with a present argument), hence the conflict as well.
    #[arg(
        long,
        value_name = "JSON",
        requires = "tensors",
        conflicts_with = "input"
    )]
    pub attrs: Option<String>,
    /// `--max-input-bytes`: most bytes of one JSON line and of a `--tensors` / `--attrs` file.
    #[command(flatten)]
    pub limit: InputLimit,
    /// `--threads`.
    #[command(flatten)]
    pub threads: crate::threads::Threads,
}

/// Lines answered together in one parallel block.
pub const BLOCK: usize = 64;

pub use crate::calls::CallError;

impl From<MoeError> for CallError {
    fn from(e: MoeError) -> Self {
        Self::new(e.kind(), e.to_string())
    }
}

/// The element type of `x` in a JSON call: `"f32"`, `"f16"`, `"bf16"` or `"i8"`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum XDtype {
    /// f32 (the default).
    #[default]
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
    /// Signed 8-bit integers.
    I8,
}

// By hand rather than derived: serde_json reads a derived enum from a number as "expected
// value"; a string is asked for here, so a number is "invalid type: integer `8`, expected a
// string".
impl<'de> Deserialize<'de> for XDtype {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        const NAMES: &[&str] = &["f32", "f16", "bf16", "i8"];
        let name = String::deserialize(deserializer)?;
        match name.as_str() {
            "f32" => Ok(XDtype::F32),
            "f16" => Ok(XDtype::F16),
            "bf16" => Ok(XDtype::Bf16),
            "i8" => Ok(XDtype::I8),
            _ => Err(de::Error::unknown_variant(&name, NAMES)),
        }
    }
}

/// The attributes by their spec names: the fields of a JSON call line besides the tensors, and
/// the object of `--attrs`. Every one but `expert_num` is optional, with the spec's default.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttrsInput {
    /// -1 (default) or 0: all routes; > 0: at most this many rows.
    pub active_num: Option<i64>,
    /// C, drop/pad only (default -1).
    pub expert_capacity: Option<i64>,
    /// E, required.
    pub expert_num: i64,
    /// 0 (default) dropless, 1 drop/pad.
    pub drop_pad_mode: Option<i64>,
    /// 0 (default) cumsum, 1 count, 2 key-value.
    pub expert_tokens_num_type: Option<i64>,
    /// Return `expert_tokens` (default false).
    pub expert_tokens_num_flag: Option<bool>,
    /// -1 (default) none, 0 static int8, 1 dynamic int8.
    pub quant_mode: Option<i64>,
    /// `[]` (default: `[0, E)`) or `[start, end]`.
    pub active_expert_range: Option<Vec<i64>>,
    /// 0 (default) gather, 1 scatter.
    pub row_idx_type: Option<i64>,
}

impl AttrsInput {
    /// The operator's attributes.
    ///
    /// # Errors
    /// `attribute` for an enum attribute outside its values, or an `active_expert_range` that
    /// is neither `[]` nor two numbers.
    pub fn to_attrs(&self) -> Result<MoeInitRoutingAttrs, CallError> {
        let active_expert_range = match self.active_expert_range.as_deref() {
            None | Some([]) => None,
            Some(&[start, end]) => Some([start, end]),
            Some(other) => {
                return Err(CallError::new(
                    "attribute",
                    format!(
                        "attribute active_expert_range = {other:?}: active_expert_range must be [] or [start, end] with 0 <= start < end <= expert_num"
                    ),
                ))
            }
        };
        Ok(MoeInitRoutingAttrs {
            active_num: self.active_num.unwrap_or(-1),
            expert_capacity: self.expert_capacity.unwrap_or(-1),
            expert_num: self.expert_num,
            drop_pad_mode: DropPadMode::try_from(self.drop_pad_mode.unwrap_or(0))?,
            expert_tokens_num_type: ExpertTokensNumType::try_from(
                self.expert_tokens_num_type.unwrap_or(0),
            )?,
            expert_tokens_num_flag: self.expert_tokens_num_flag.unwrap_or(false),
            quant_mode: QuantMode::try_from(self.quant_mode.unwrap_or(-1))?,
            active_expert_range,
            row_idx_type: RowIdxType::try_from(self.row_idx_type.unwrap_or(0))?,
        })
    }
}

/// One JSON line: a whole call.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallInput {
    /// `[N, H]` rows.
    pub x: Fallible<Fallible<Lenient>>,
    /// `[N, K]` rows of expert ids.
    pub expert_idx: Fallible<Fallible<i32>>,
    /// A list, or rows flattened row-major; absent or `null`: none.
    pub scale: Option<Floats>,
    /// A list; absent or `null`: none.
    pub offset: Option<Floats>,
    /// The element type of `x` (default f32).
    pub x_dtype: Option<XDtype>,
    /// See [`AttrsInput`].
    pub active_num: Option<i64>,
    /// See [`AttrsInput`].
    pub expert_capacity: Option<i64>,
    /// See [`AttrsInput`] (required).
    pub expert_num: i64,
    /// See [`AttrsInput`].
    pub drop_pad_mode: Option<i64>,
    /// See [`AttrsInput`].
    pub expert_tokens_num_type: Option<i64>,
    /// See [`AttrsInput`].
    pub expert_tokens_num_flag: Option<bool>,
    /// See [`AttrsInput`].
    pub quant_mode: Option<i64>,
    /// See [`AttrsInput`].
    pub active_expert_range: Option<Vec<i64>>,
    /// See [`AttrsInput`].
    pub row_idx_type: Option<i64>,
}

/// A list of numbers, or a list of rows of numbers, flattened row-major (as f64; rounded to
/// f32 when the call is answered).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Floats {
    /// The values, row-major.
    pub values: Vec<f64>,
    /// In the nested form, the first row whose length differs from row 0's: (row, its
    /// length, row 0's length); a `shape` error when the call is answered.
    pub ragged: Option<(usize, usize, usize)>,
}

/// One element of [`Floats`]: a number or a row.
enum FloatsItem {
    Number(f64),
    Row(Vec<f64>),
}

impl<'de> Deserialize<'de> for FloatsItem {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ItemVisitor;

        impl<'de> Visitor<'de> for ItemVisitor {
            type Value = FloatsItem;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(r#"a number (or "-inf", "inf", "nan") or a list of them"#)
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<FloatsItem, E> {
                Ok(FloatsItem::Number(v as f64))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<FloatsItem, E> {
                Ok(FloatsItem::Number(v as f64))
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> Result<FloatsItem, E> {
                Ok(FloatsItem::Number(v))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<FloatsItem, E> {
                Lenient::deserialize(de::value::StrDeserializer::<E>::new(v))
                    .map(|Lenient(v)| FloatsItem::Number(v))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<FloatsItem, A::Error> {
                let mut row = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(Lenient(v)) = seq.next_element()? {
                    row.push(v);
                }
                Ok(FloatsItem::Row(row))
            }
        }

        deserializer.deserialize_any(ItemVisitor)
    }
}

impl<'de> Deserialize<'de> for Floats {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct FloatsVisitor;

        impl<'de> Visitor<'de> for FloatsVisitor {
            type Value = Floats;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of numbers or a list of rows of numbers")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Floats, A::Error> {
                let mut flat = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                // (is nested, row length) once the first element is seen.
                let mut form: Option<(bool, usize)> = None;
                let mut ragged = None;
                let mut index = 0usize;
                while let Some(item) = seq.next_element::<FloatsItem>()? {
                    match (item, form) {
                        (FloatsItem::Number(v), None | Some((false, _))) => {
                            form = Some((false, 0));
                            flat.push(v);
                        }
                        (FloatsItem::Row(row), None) => {
                            form = Some((true, row.len()));
                            flat.extend(row);
                        }
                        (FloatsItem::Row(row), Some((true, len))) => {
                            if row.len() != len && ragged.is_none() {
                                ragged = Some((index, row.len(), len));
                            }
                            flat.extend(row);
                        }
                        (_, Some((nested, _))) => {
                            return Err(de::Error::custom(format!(
                                "element {index} is {} but element 0 is {}: give a list of numbers or a list of rows",
                                if nested { "a number" } else { "a list" },
                                if nested { "a list" } else { "a number" },
                            )));
                        }
                    }
                    index += 1;
                }
                Ok(Floats {
                    values: flat,
                    ragged,
                })
            }
        }

        deserializer.deserialize_seq(FloatsVisitor)
    }
}

/// `x` in its element type.
#[derive(Clone, Debug, PartialEq)]
pub enum XData {
    /// f32 values.
    F32(Vec<f32>),
    /// f16 values.
    F16(Vec<f16>),
    /// bf16 values.
    Bf16(Vec<bf16>),
    /// i8 values.
    I8(Vec<i8>),
}

/// An f32 written as a JSON number when finite (the shortest decimal that reads back to it),
/// else `"-inf"`, `"inf"` or `"nan"`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct JsonF32(f32);

impl Serialize for JsonF32 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match non_finite_name(f64::from(self.0)) {
            None => s.serialize_f32(self.0),
            Some(name) => s.serialize_str(name),
        }
    }
}

/// The values of `expanded_x` in the operator's own element type, as its output vector (no
/// copy is made for the answer: f16 and bf16 values are widened exactly to f32 as they are
/// written).
#[derive(Debug)]
enum Values {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
    I8(Vec<i8>),
}

impl Values {
    /// The operator's `Vec<T>` as the variant of its type, moved (not copied).
    fn of<T: Element>(values: Vec<T>) -> Self {
        let any: Box<dyn std::any::Any> = Box::new(values);
        let any = match any.downcast::<Vec<f32>>() {
            Ok(v) => return Values::F32(*v),
            Err(any) => any,
        };
        let any = match any.downcast::<Vec<f16>>() {
            Ok(v) => return Values::F16(*v),
            Err(any) => any,
        };
        let any = match any.downcast::<Vec<bf16>>() {
            Ok(v) => return Values::Bf16(*v),
            Err(any) => any,
        };
        match any.downcast::<Vec<i8>>() {
            Ok(v) => Values::I8(*v),
            // `Element` is implemented for these four types only.
            Err(_) => Values::I8(Vec::new()),
        }
    }

    /// Writes the `len` values from `offset` as a JSON list.
    fn serialize_run<S: Serializer>(
        &self,
        offset: usize,
        len: usize,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        let range = offset..offset + len;
        match self {
            Values::F32(v) => s.collect_seq(v[range].iter().map(|&e| JsonF32(e))),
            Values::F16(v) => s.collect_seq(v[range].iter().map(|&e| JsonF32(e.to_f32()))),
            Values::Bf16(v) => s.collect_seq(v[range].iter().map(|&e| JsonF32(e.to_f32()))),
            Values::I8(v) => s.collect_seq(&v[range]),
        }
    }
}

/// A flat row-major slice written as nested lists of `shape` (at least one dimension).
struct Nested<'a> {
    values: &'a Values,
    offset: usize,
    shape: &'a [usize],
}

impl Serialize for Nested<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.shape {
            [] => self.values.serialize_run(self.offset, 1, s),
            &[len] => self.values.serialize_run(self.offset, len, s),
            [len, inner @ ..] => {
                let stride: usize = inner.iter().product();
                let mut seq = s.serialize_seq(Some(*len))?;
                for i in 0..*len {
                    seq.serialize_element(&Nested {
                        values: self.values,
                        offset: self.offset + i * stride,
                        shape: inner,
                    })?;
                }
                seq.end()
            }
        }
    }
}

/// `expanded_x`, nested per its shape.
#[derive(Debug)]
struct ExpandedXOut {
    values: Values,
    shape: Vec<usize>,
}

impl Serialize for ExpandedXOut {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        Nested {
            values: &self.values,
            offset: 0,
            shape: &self.shape,
        }
        .serialize(s)
    }
}

/// `expert_tokens`: a list (count, cumsum) or `[expert id, count]` rows (key-value).
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum ExpertTokensOut {
    List(Vec<i64>),
    Pairs(Vec<[i64; 2]>),
}

/// f32 values written as a JSON list of [`JsonF32`] (or `null`), straight from the vector.
fn optional_f32_list<S: Serializer>(values: &Option<Vec<f32>>, s: S) -> Result<S::Ok, S::Error> {
    match values {
        Some(v) => s.collect_seq(v.iter().map(|&e| JsonF32(e))),
        None => s.serialize_none(),
    }
}

/// The answer to one call. It holds the operator's output vectors themselves, written as
/// they are serialised: a large `expanded_x` is never copied (answers above
/// [`crate::answer::IN_MEMORY_MAX`] bytes are written straight into the output).
#[derive(Debug, Serialize)]
pub struct Answer {
    expanded_x: ExpandedXOut,
    expanded_x_dtype: &'static str,
    expanded_row_idx: Vec<i32>,
    expert_tokens: Option<ExpertTokensOut>,
    #[serde(serialize_with = "optional_f32_list")]
    expanded_scale: Option<Vec<f32>>,
    valid_rows: usize,
}

impl Answer {
    /// The answer for an operator output (`key_value`: `expert_tokens` is `[E, 2]`).
    fn new<T: Element>(out: MoeInitRoutingOutput<T>, key_value: bool) -> Self {
        let expanded_x_dtype = out.expanded_x.dtype().name();
        let values = match out.expanded_x {
            ExpandedX::Unquantized(v) => Values::of(v),
            ExpandedX::Int8(v) => Values::I8(v),
        };
        Self {
            expanded_x: ExpandedXOut {
                values,
                shape: out.expanded_x_shape,
            },
            expanded_x_dtype,
            expanded_row_idx: out.expanded_row_idx,
            expert_tokens: out.expert_tokens.map(|t| {
                if key_value {
                    ExpertTokensOut::Pairs(t.chunks_exact(2).map(|p| [p[0], p[1]]).collect())
                } else {
                    ExpertTokensOut::List(t)
                }
            }),
            expanded_scale: out.expanded_scale,
            valid_rows: out.valid_rows,
        }
    }
}

/// One output line (without its newline).
pub fn line(result: &Result<Answer, CallError>) -> Vec<u8> {
    crate::calls::line(result)
}

/// Parses one JSON line into a call: `invalid_json` when it is not JSON, `invalid_call` when it
/// is JSON of the wrong shape (the message starts with the JSON path of the bad value).
pub fn parse_call(text: &[u8]) -> Result<CallInput, CallError> {
    crate::calls::parse_call(text)
}

/// `[N, W]` rows as one row-major vector and W (0 without rows); ragged rows are a `shape`
/// error naming `field`.
fn flatten<V: Copy>(field: &str, rows: &[Fallible<V>]) -> Result<(Vec<V>, usize), CallError> {
    let width = rows.first().map_or(0, |r| r.0.len());
    let mut flat = reserved(field, rows.len().saturating_mul(width))?;
    for (i, Fallible(row)) in rows.iter().enumerate() {
        if row.len() != width {
            return Err(CallError::new(
                "shape",
                format!(
                    "{field}: row {i} has {} values, but row 0 has {width}: {field} must be [N, {}]",
                    row.len(),
                    if field == "x" { "H" } else { "K" }
                ),
            ));
        }
        flat.extend_from_slice(row);
    }
    Ok((flat, width))
}

/// An empty vector with room for `len` elements, reserved fallibly.
///
/// # Errors
/// `allocation`, naming `field`, when the memory cannot be had.
fn reserved<T>(field: &str, len: usize) -> Result<Vec<T>, CallError> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        CallError::new(
            "allocation",
            format!("{field}: {len} values could not be held in memory"),
        )
    })?;
    Ok(v)
}

/// The values of `iter` (`len` of them, each or an error) in a vector reserved fallibly.
///
/// # Errors
/// The first element's error, or `allocation` naming `field`.
fn try_collect<T>(
    field: &str,
    len: usize,
    iter: impl Iterator<Item = Result<T, CallError>>,
) -> Result<Vec<T>, CallError> {
    let mut v = reserved(field, len)?;
    for item in iter {
        v.push(item?);
    }
    Ok(v)
}

/// `v` rounded (to nearest, ties to even) to a binary format with `p` significand bits and
/// smallest normal exponent `emin`, subnormals included, without a range limit (the caller's
/// conversion turns a value past the format's largest into infinity). The result is exactly
/// representable in that format, and in f32 for f16 and bf16, so the narrowing after it is
/// exact. (half's `from_f64` goes through f32 or truncates, which rounds twice.)
fn round_to(v: f64, p: i32, emin: i32) -> f64 {
    if !v.is_finite() || v == 0.0 {
        return v;
    }
    let exponent = (((v.to_bits() >> 52) & 0x7ff) as i32 - 1023).max(emin);
    // The spacing of the format's values at v's binade: a normal f64 power of two.
    let quantum = f64::from_bits(((exponent - (p - 1) + 1023) as u64) << 52);
    (v / quantum).round_ties_even() * quantum
}

/// `x`'s values rounded to `dtype`; `invalid_call` for a finite value beyond the type's range
/// or (i8) a value that is not an integer in `-128..=127`.
fn x_values(values: &[Lenient], width: usize, dtype: XDtype) -> Result<XData, CallError> {
    let place = |i: usize| format!("x[{}][{}]", i / width.max(1), i % width.max(1));
    let beyond = |i: usize, v: f64, ty: &str, range: &str| {
        CallError::invalid_call(format!(
            "{} = {v:e} is outside the {ty} range (about ±{range})",
            place(i)
        ))
    };
    macro_rules! floats {
        ($variant:ident, $convert:expr, $ty:literal, $range:literal) => {
            try_collect(
                "x",
                values.len(),
                values.iter().enumerate().map(|(i, &Lenient(v))| {
                    let r = $convert(v);
                    if v.is_finite() && r.is_infinite() {
                        Err(beyond(i, v, $ty, $range))
                    } else {
                        Ok(r)
                    }
                }),
            )
            .map(XData::$variant)
        };
    }
    match dtype {
        XDtype::F32 => floats!(F32, |v: f64| v as f32, "f32", "3.4e38"),
        XDtype::F16 => floats!(
            F16,
            |v| f16::from_f32(round_to(v, 11, -14) as f32),
            "f16",
            "65504"
        ),
        XDtype::Bf16 => floats!(
            Bf16,
            |v| bf16::from_f32(round_to(v, 8, -126) as f32),
            "bf16",
            "3.39e38"
        ),
        XDtype::I8 => try_collect(
            "x",
            values.len(),
            values.iter().enumerate().map(|(i, &Lenient(v))| {
                if v.fract() == 0.0 && (-128.0..=127.0).contains(&v) {
                    Ok(v as i8)
                } else {
                    Err(CallError::invalid_call(format!(
                        "{} = {v} is not an i8 (x_dtype \"i8\" takes integers in -128..=127)",
                        place(i)
                    )))
                }
            }),
        )
        .map(XData::I8),
    }
}

/// `scale` / `offset` as f32: ragged rows are a `shape` error, a finite value beyond the f32
/// range is `invalid_call`.
fn f32_values(field: &str, floats: &Floats) -> Result<Vec<f32>, CallError> {
    if let Some((row, len, first)) = floats.ragged {
        return Err(CallError::new(
            "shape",
            format!(
                "{field}: row {row} has {len} values, but row 0 has {first}: the rows of {field} must be of one length"
            ),
        ));
    }
    floats
        .values
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let r = v as f32;
            if v.is_finite() && r.is_infinite() {
                Err(CallError::invalid_call(format!(
                    "{field}[{i}] = {v:e} is outside the f32 range (about ±3.4e38)"
                )))
            } else {
                Ok(r)
            }
        })
        .collect()
}

/// The tensors of one call, in their element types.
struct Tensors {
    x: XData,
    num_rows: usize,
    hidden_size: usize,
    expert_idx: Vec<i32>,
    k: usize,
    scale: Option<Vec<f32>>,
    offset: Option<Vec<f32>>,
}

impl Tensors {
    /// Runs the operator and builds the answer.
    fn answer(&self, attrs: &MoeInitRoutingAttrs) -> Result<Answer, CallError> {
        fn typed<T: Element>(
            t: &Tensors,
            x: &[T],
            attrs: &MoeInitRoutingAttrs,
        ) -> Result<Answer, CallError> {
            let input = MoeInitRoutingInput {
                x,
                num_rows: t.num_rows,
                hidden_size: t.hidden_size,
                expert_idx: &t.expert_idx,
                k: t.k,
                scale: t.scale.as_deref(),
                offset: t.offset.as_deref(),
            };
            check_room::<T>(t, attrs)?;
            let out = moe_init_routing(&input, attrs)?;
            Ok(Answer::new(
                out,
                attrs.expert_tokens_num_type == ExpertTokensNumType::KeyValue,
            ))
        }
        match &self.x {
            XData::F32(x) => typed(self, x, attrs),
            XData::F16(x) => typed(self, x, attrs),
            XData::Bf16(x) => typed(self, x, attrs),
            XData::I8(x) => typed(self, x, attrs),
        }
    }
}

/// Checks, before the operator runs, that its `expanded_x` and what it allocates besides
/// ([`crate::memory::moe_scratch_bytes`]: the routes' sort, the row indices and scales, an
/// int8 copy of `x`), with a margin, can be had together: the operator reserves `expanded_x`
/// fallibly, but aborts on a failure after it. When `expanded_x` alone cannot be had (or the
/// attributes do not give its size), the operator's own error answers the call.
///
/// # Errors
/// `allocation`, with the bytes.
fn check_room<T: Element>(t: &Tensors, attrs: &MoeInitRoutingAttrs) -> Result<(), CallError> {
    let Some(routes) = t.num_rows.checked_mul(t.k) else {
        return Ok(());
    };
    let (rows, shape) = match attrs.drop_pad_mode {
        DropPadMode::DropPad => {
            let (e, c) = (attrs.expert_num, attrs.expert_capacity);
            if !(1..=10240).contains(&e) || c < 1 || c > t.num_rows as i64 {
                return Ok(());
            }
            let (e, c) = (e as usize, c as usize);
            (e * c, format!("[{e}, {c}, {}]", t.hidden_size))
        }
        DropPadMode::Dropless => {
            let rows = match usize::try_from(attrs.active_num) {
                Ok(a) if a > 0 => a.min(routes),
                _ => routes,
            };
            (rows, format!("[{rows}, {}]", t.hidden_size))
        }
    };
    let elem = match attrs.quant_mode {
        QuantMode::None => std::mem::size_of::<T>(),
        _ => 1,
    };
    let Some(expanded) = rows
        .checked_mul(t.hidden_size)
        .and_then(|n| n.checked_mul(elem))
    else {
        return Ok(());
    };
    let bytes = crate::memory::moe_scratch_bytes(t.num_rows, t.hidden_size, t.k, rows)
        .and_then(|s| s.checked_add(expanded))
        .map(crate::memory::with_margin);
    if crate::memory::can_allocate_checked(bytes) || !crate::memory::can_allocate(expanded) {
        return Ok(());
    }
    Err(CallError::new(
        "allocation",
        crate::memory::refusal(
            &format!(
                "the call (expanded_x {shape}, {expanded} bytes, and the operator's working memory)"
            ),
            bytes,
        ),
    ))
}

/// Answers one parsed call.
///
/// # Errors
/// `attribute` (an attribute value), `shape` (ragged rows), `invalid_call` (a value not
/// representable in its type), and the operator's errors.
pub fn answer_call(call: CallInput) -> Result<Answer, CallError> {
    let attrs = AttrsInput {
        active_num: call.active_num,
        expert_capacity: call.expert_capacity,
        expert_num: call.expert_num,
        drop_pad_mode: call.drop_pad_mode,
        expert_tokens_num_type: call.expert_tokens_num_type,
        expert_tokens_num_flag: call.expert_tokens_num_flag,
        quant_mode: call.quant_mode,
        active_expert_range: call.active_expert_range,
        row_idx_type: call.row_idx_type,
    }
    .to_attrs()?;
    if call.x.0.is_empty() {
        return Err(CallError::new(
            "shape",
            "x has no rows: a JSON call needs N >= 1 to know H (an N = 0 call can be made with --tensors)",
        ));
    }
    if call.x.0.len() != call.expert_idx.0.len() {
        return Err(rows_error(call.x.0.len(), call.expert_idx.0.len()));
    }
    let num_rows = call.x.0.len();
    let (x, hidden_size) = flatten("x", &call.x.0)?;
    // Freed before the operator runs: only the typed `x` is kept.
    drop(call.x);
    let x = x_values(&x, hidden_size, call.x_dtype.unwrap_or_default())?;
    let (expert_idx, k) = flatten("expert_idx", &call.expert_idx.0)?;
    drop(call.expert_idx);
    let tensors = Tensors {
        x,
        num_rows,
        hidden_size,
        expert_idx,
        k,
        scale: call.scale.map(|s| f32_values("scale", &s)).transpose()?,
        offset: call.offset.map(|s| f32_values("offset", &s)).transpose()?,
    };
    tensors.answer(&attrs)
}

/// One input line answered: the call's answer, or its error.
pub fn answer(text: &[u8]) -> Result<Answer, CallError> {
    parse_call(text).and_then(answer_call)
}

/// The answer line (without newline) for one input line, as the command writes it.
pub fn answer_line(text: &[u8]) -> Vec<u8> {
    crate::answer::to_line(&Reply(answer(text)))
}

/// Why the command stopped before answering every call (`nucleus sample`'s type: a bad
/// inline `--attrs` is exit status 2, an input that cannot be read or used 1, a failed write
/// `Output`).
pub use crate::sample::RunError;

/// Answers every non-blank line of `input` on `out`, in input order; lines are read on a thread
/// of their own, answered in blocks of up to [`BLOCK`] in parallel (as many as have arrived),
/// and `out` is flushed after each block. A line longer than `limit` is answered with an
/// `input_too_large` error.
///
/// # Errors
/// [`RunError::Input`] when reading fails (earlier lines are answered first);
/// [`RunError::Output`] when writing fails.
pub fn run_jsonl(
    input: Box<dyn Read + Send>,
    out: &mut dyn Write,
    limit: MaxInputBytes,
) -> Result<(), RunError> {
    crate::sample::stream_lines(input, out, BLOCK, limit, |text| Reply(answer(text)))
}

/// Reads `--attrs`: the path of an existing file holding a JSON object (within `limit`), else
/// the object itself.
///
/// # Errors
/// [`RunError::Usage`] for inline text that is not a valid object (naming the bad field:
/// `active_num: invalid type: ...`, `missing field `expert_num``), [`RunError::Input`] for a
/// bad file.
pub fn read_attrs(text: &str, limit: MaxInputBytes) -> Result<AttrsInput, RunError> {
    crate::calls::read_attrs(text, limit)
}

const TENSOR_NAMES: [&str; 4] = ["x", "expert_idx", "scale", "offset"];

/// `x [N, H]` and `expert_idx [N, K]` with different N.
fn rows_error(x_rows: usize, idx_rows: usize) -> CallError {
    CallError::new(
        "shape",
        format!("x has {x_rows} rows but expert_idx has {idx_rows}: both must have N rows (x [N, H], expert_idx [N, K])"),
    )
}

fn rank_error(name: &str, shape: &[usize], want: &str) -> CallError {
    CallError::new(
        "shape",
        format!("tensor `{name}` has shape {shape:?}: expected {want}"),
    )
}

fn dtype_error(name: &str, dtype: Dtype, want: &str) -> CallError {
    CallError::new(
        "dtype",
        format!("tensor `{name}` is {dtype:?}: expected {want}"),
    )
}

/// An F32 tensor's values (any rank: flattened), copied into a vector reserved first.
fn f32_tensor(
    name: &str,
    t: &safetensors::tensor::TensorView<'_>,
) -> Result<Vec<f32>, TensorsError> {
    if t.dtype() != Dtype::F32 {
        return Err(dtype_error(name, t.dtype(), "F32").into());
    }
    copy_values(
        name,
        t.data().len() / 4,
        words::<4>(t.data()).map(f32::from_le_bytes),
    )
    .map_err(TensorsError::Memory)
}

/// Collects and checks the tensors of `file`, each copied out of the file's bytes into a
/// vector reserved first.
///
/// # Errors
/// [`TensorsError::Call`] for a wrong, missing or unknown tensor (an answer);
/// [`TensorsError::Memory`] for a copy that cannot be held in memory.
fn tensors(file: &SafeTensors<'_>) -> Result<Tensors, TensorsError> {
    let mut names = file.names();
    names.sort_unstable();
    if let Some(unknown) = names.iter().find(|n| !TENSOR_NAMES.contains(n)) {
        return Err(CallError::invalid_call(format!(
            "unknown tensor `{}`: the tensors are x, expert_idx, scale and offset",
            shown(unknown)
        ))
        .into());
    }
    let get = |name: &str| file.tensor(name).ok();
    let require = |name: &str| {
        get(name).ok_or_else(|| {
            CallError::invalid_call(format!("no tensor named `{name}` (it is required)"))
        })
    };
    let x = require("x")?;
    let &[num_rows, hidden_size] = x.shape() else {
        return Err(rank_error("x", x.shape(), "rank 2, [N, H]").into());
    };
    let raw = x.data();
    let halves = || words::<2>(raw).map(u16::from_le_bytes);
    let memory = TensorsError::Memory;
    let x_data = match x.dtype() {
        Dtype::F32 => XData::F32(
            copy_values("x", raw.len() / 4, words::<4>(raw).map(f32::from_le_bytes))
                .map_err(memory)?,
        ),
        Dtype::F16 => XData::F16(
            copy_values("x", raw.len() / 2, halves().map(f16::from_bits)).map_err(memory)?,
        ),
        Dtype::BF16 => XData::Bf16(
            copy_values("x", raw.len() / 2, halves().map(bf16::from_bits)).map_err(memory)?,
        ),
        Dtype::I8 => {
            XData::I8(copy_values("x", raw.len(), raw.iter().map(|&b| b as i8)).map_err(memory)?)
        }
        other => return Err(dtype_error("x", other, "F32, F16, BF16 or I8").into()),
    };
    let idx = require("expert_idx")?;
    let &[idx_rows, k] = idx.shape() else {
        return Err(rank_error("expert_idx", idx.shape(), "rank 2, [N, K]").into());
    };
    if idx_rows != num_rows {
        return Err(rows_error(num_rows, idx_rows).into());
    }
    let expert_idx = copy_i32_tensor("expert_idx", idx.dtype(), idx.data(), |i, v| {
        CallError::invalid_call(format!(
            "tensor `expert_idx` (I64) holds {v} at flat position {i}: expert ids must fit in i32"
        ))
    })
    .ok_or_else(|| dtype_error("expert_idx", idx.dtype(), "I32 (or I64)"))??;
    let scale = match get("scale") {
        None => None,
        Some(s) => {
            if !(1..=2).contains(&s.shape().len()) {
                return Err(rank_error("scale", s.shape(), "rank 1 or 2").into());
            }
            Some(f32_tensor("scale", &s)?)
        }
    };
    let offset = match get("offset") {
        None => None,
        Some(o) => {
            if o.shape().len() != 1 {
                return Err(rank_error("offset", o.shape(), "rank 1, [1]").into());
            }
            Some(f32_tensor("offset", &o)?)
        }
    };
    Ok(Tensors {
        x: x_data,
        num_rows,
        hidden_size,
        expert_idx,
        k,
        scale,
        offset,
    })
}

/// Answers the call held by a safetensors file's bytes.
///
/// # Errors
/// A message when the bytes are not a safetensors file or a tensor's copy cannot be held in
/// memory; a call error (wrong, missing or unknown tensors, ranks, dtypes, the operator's
/// errors) is an answer.
pub fn answer_safetensors(
    bytes: &[u8],
    attrs: &AttrsInput,
) -> Result<Result<Answer, CallError>, String> {
    let file = SafeTensors::deserialize(bytes).map_err(|e| crate::input::not_safetensors(&e))?;
    let attrs = match attrs.to_attrs() {
        Ok(a) => a,
        Err(e) => return Ok(Err(e)),
    };
    match tensors(&file) {
        Ok(t) => Ok(t.answer(&attrs)),
        Err(TensorsError::Call(e)) => Ok(Err(e)),
        Err(TensorsError::Memory(m)) => Err(m),
    }
}

/// `--tensors FILE --attrs JSON`: one call, one answer line. The file is read within `limit`
/// ([`read_file`]), then answered by [`answer_safetensors`] and its bytes freed before the
/// answer is written.
///
/// # Errors
/// [`RunError::Usage`] for a bad inline `--attrs` (not JSON, a missing `expert_num`, an
/// unknown or mistyped field); [`RunError::Input`] for an unreadable file, one larger than
/// `limit`, a file that is not safetensors, or a bad `--attrs` file; [`RunError::Output`] when
/// writing fails.
pub fn run_safetensors(
    path: &Path,
    attrs: &str,
    out: &mut dyn Write,
    limit: MaxInputBytes,
) -> Result<(), RunError> {
    let attrs = read_attrs(attrs, limit)?;
    let bytes = read_file("--tensors", path, limit).map_err(|e| RunError::Input(e.to_string()))?;
    let answer = answer_safetensors(&bytes, &attrs)
        .map_err(|e| RunError::Input(format!("{}: {e}", shown_path(path))))?;
    drop(bytes);
    crate::answer::Prepared::new(Reply(answer)).write(out)?;
    out.flush()?;
    Ok(())
}

/// Runs `nucleus moe-init-routing` and returns its exit status: 0 when every call got an
/// answer, 1 for an unusable input and when writing fails (a closed pipe ends quietly with 0),
/// 2 for a bad inline `--attrs`.
pub fn command(args: &MoeInitRoutingArgs) -> ExitCode {
    let limit = args.limit.max_input_bytes;
    crate::sample::run_command(
        args.tensors.as_deref(),
        args.input.as_deref(),
        |path, out| run_safetensors(path, args.attrs.as_deref().unwrap_or("{}"), out, limit),
        |input, out| run_jsonl(input, out, limit),
    )
}
