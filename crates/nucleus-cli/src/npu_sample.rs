//! `nucleus top-k-top-p-sample`: nucleus-sampling's
//! [`nucleus_sampling::npu::top_k_top_p_sample`] (the Ascend
//! `torch_npu.npu_top_k_top_p_sample` contract) on calls read from a file or a pipe, one JSON
//! answer per call.
//!
//! # Input
//!
//! JSON lines (`--input FILE`, or stdin: no `--input`, or `--input -`), one whole call each:
//!
//! ```json
//! {"logits": [[1, 3, 2, 3]], "top_k": [2], "top_p": [1.0], "q": [[1, 1, 0.5, 1]], "eps": 1e-8,
//!  "is_need_logits": true, "min_ps": null, "ks_max": 1024, "input_is_logits": true,
//!  "q_indexing": "token_id"}
//! ```
//!
//! `logits` (`[B, V]`, every row the same length), `top_k` (`[B]` integers) and `top_p` (`[B]`)
//! are required; the rest is optional with the spec's defaults ([`CallInput`]). Numbers may be
//! the strings `"-inf"`, `"inf"`, `"nan"` ([`Lenient`]); float values are rounded to f32, and
//! a finite number beyond the f32 range is an `invalid_call` error naming its place. `null` is
//! a field left out; unknown fields are errors. Lines that [`str::trim`] leaves empty are
//! skipped; a UTF-8 byte order mark at the start is ignored.
//!
//! Or `--tensors FILE.safetensors` ([`run_safetensors`]): tensors `logits` (f32, f16 or bf16,
//! `[B, V]`), `top_k` (i32, `[B]`), `top_p` (`[B]`, the dtype of `logits` or f32), optional `q`
//! (f32, `[B, V]`) and `min_ps` (`[B]`, the dtype of `top_p`), one call, with the scalar
//! attributes from `--attrs` (a JSON object, inline or the path of a file: [`AttrsInput`]).
//!
//! # Output
//!
//! One line per call ([`Answer`]):
//!
//! ```json
//! {"logits_select_idx":[1],"logits_top_kp_select":[["-inf",3.0,"-inf",3.0]],"row_errors":[null]}
//! ```
//!
//! `logits_top_kp_select` is `null` without `is_need_logits`; `-inf` is written as the string
//! `"-inf"`. A row that failed has `-1` in `logits_select_idx` and `{"kind", "message"}` in
//! `row_errors` (kinds: `non_finite_logits`, `invalid_probability`, `no_candidates`,
//! `invalid_top_p`, `invalid_min_p`, `invalid_q`); the other rows are computed. A call that
//! is invalid as a whole gets `{"error": {"kind": "...", "message": "..."}}` ([`CallError`]:
//! `invalid_json`, `invalid_call`, `shape_mismatch`, `dtype_mismatch`, `invalid_attribute`),
//! and the next lines are answered all the same.
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
use nucleus_sampling::npu::{
    top_k_top_p_sample, QIndexing, TopKTopPError, TopKTopPRowError, TopKTopPSampleOptions,
    TopKTopPSampleOutput,
};
use nucleus_sampling::{InputKind, LogitValue, LogitsView};
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize, Serializer};

use crate::answer::Reply;
use crate::calls::TensorsError;
use crate::input::{
    copy_i32_tensor, copy_values, read_file, shown, shown_path, words, InputLimit, MaxInputBytes,
};
use crate::sample::input::{Fallible, Lenient, Row};

/// The flags of `nucleus top-k-top-p-sample`.
#[derive(Args, Debug, Clone, Default)]
pub struct NpuSampleArgs {
    /// JSON lines, one call each (default, or `-`: stdin).
    #[arg(long, value_name = "FILE", conflicts_with = "tensors")]
    pub input: Option<PathBuf>,
    /// Instead of JSON lines: a safetensors file holding one call (tensors `logits`, `top_k`,
    /// `top_p`, optional `q` and `min_ps`).
    #[arg(long, value_name = "FILE.safetensors")]
    pub tensors: Option<PathBuf>,
    /// With --tensors: the scalar attributes, a JSON object (the path of a file holding it,
    /// else inline JSON) with `eps`, `is_need_logits`, `top_k_guess`, `ks_max`,
    /// `input_is_logits`, `q_indexing`; default: the spec's defaults.
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

impl From<TopKTopPError> for CallError {
    fn from(e: TopKTopPError) -> Self {
        let kind = match e {
            TopKTopPError::LengthMismatch { .. } | TopKTopPError::QShape { .. } => "shape_mismatch",
            TopKTopPError::DtypeMismatch { .. } => "dtype_mismatch",
            TopKTopPError::InvalidAttribute { .. } => "invalid_attribute",
        };
        Self::new(kind, e.to_string())
    }
}

/// `"token_id"` or `"sorted_rank"` ([`QIndexing`]).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum QIndexingInput {
    /// [`QIndexing::TokenId`].
    TokenId,
    /// [`QIndexing::SortedRank`].
    SortedRank,
}

/// The scalar attributes, every one optional (the spec's defaults): the fields of a JSON call
/// line besides the tensors, and the object of `--attrs`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttrsInput {
    /// Added to `q` (default 1e-8).
    pub eps: Option<Lenient>,
    /// Return `logits_top_kp_select` (default false).
    pub is_need_logits: Option<bool>,
    /// Accepted for compatibility (default 32); no effect.
    pub top_k_guess: Option<i64>,
    /// The largest top-k that is on (default 1024).
    pub ks_max: Option<i64>,
    /// Logits (default true) or probabilities.
    pub input_is_logits: Option<bool>,
    /// How `q` is indexed (default `"token_id"`).
    pub q_indexing: Option<QIndexingInput>,
}

impl AttrsInput {
    /// The options and the input kind these attributes spell.
    pub fn to_options(&self) -> (TopKTopPSampleOptions, InputKind) {
        let d = TopKTopPSampleOptions::default();
        let options = TopKTopPSampleOptions {
            eps: self.eps.map_or(d.eps, |Lenient(e)| e),
            is_need_logits: self.is_need_logits.unwrap_or(d.is_need_logits),
            top_k_guess: self.top_k_guess.unwrap_or(d.top_k_guess),
            ks_max: self.ks_max.unwrap_or(d.ks_max),
            q_indexing: match self.q_indexing {
                None => d.q_indexing,
                Some(QIndexingInput::TokenId) => QIndexing::TokenId,
                Some(QIndexingInput::SortedRank) => QIndexing::SortedRank,
            },
        };
        let kind = match self.input_is_logits {
            Some(false) => InputKind::Probs,
            _ => InputKind::Logits,
        };
        (options, kind)
    }
}

/// One JSON line: a whole call.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallInput {
    /// `[B, V]`: the rows (logits, or probabilities with `input_is_logits: false`).
    pub logits: Fallible<Row>,
    /// `[B]` integers.
    pub top_k: Fallible<i32>,
    /// `[B]`.
    pub top_p: Fallible<Lenient>,
    /// `[B, V]` or absent.
    pub q: Option<Fallible<Row>>,
    /// `[B]` or absent.
    pub min_ps: Option<Fallible<Lenient>>,
    /// See [`AttrsInput`].
    pub eps: Option<Lenient>,
    /// See [`AttrsInput`].
    pub is_need_logits: Option<bool>,
    /// See [`AttrsInput`].
    pub top_k_guess: Option<i64>,
    /// See [`AttrsInput`].
    pub ks_max: Option<i64>,
    /// See [`AttrsInput`].
    pub input_is_logits: Option<bool>,
    /// See [`AttrsInput`].
    pub q_indexing: Option<QIndexingInput>,
}

/// An f32 written as a JSON number when finite, else `"-inf"`, `"inf"` or `"nan"`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct JsonF32(f32);

impl Serialize for JsonF32 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match crate::sample::output::non_finite_name(f64::from(self.0)) {
            None => s.serialize_f32(self.0),
            Some(name) => s.serialize_str(name),
        }
    }
}

/// A row's error in an answer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RowErrorOut {
    /// `non_finite_logits`, `invalid_probability`, `no_candidates`, `invalid_top_p`,
    /// `invalid_min_p` or `invalid_q`.
    pub kind: &'static str,
    /// The library's message.
    pub message: String,
}

impl From<&TopKTopPRowError> for RowErrorOut {
    fn from(e: &TopKTopPRowError) -> Self {
        let kind = match e {
            TopKTopPRowError::NonFiniteLogits { .. } => "non_finite_logits",
            TopKTopPRowError::InvalidProbability { .. } => "invalid_probability",
            TopKTopPRowError::NoCandidates => "no_candidates",
            TopKTopPRowError::InvalidTopP => "invalid_top_p",
            TopKTopPRowError::InvalidMinP => "invalid_min_p",
            TopKTopPRowError::InvalidQ { .. } => "invalid_q",
        };
        Self {
            kind,
            message: e.to_string(),
        }
    }
}

/// `logits_top_kp_select`: the operator's flat `[B, V]` output written as B rows, straight
/// from its vector.
#[derive(Debug)]
struct Rows {
    values: Vec<f32>,
    vocab: usize,
}

impl Serialize for Rows {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.values.chunks(self.vocab.max(1)).map(RowOut))
    }
}

/// One row of [`Rows`].
struct RowOut<'a>(&'a [f32]);

impl Serialize for RowOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|&v| JsonF32(v)))
    }
}

/// The answer to one call.
#[derive(Debug, Serialize)]
pub struct Answer {
    logits_select_idx: Vec<i64>,
    logits_top_kp_select: Option<Rows>,
    row_errors: Vec<Option<RowErrorOut>>,
}

impl Answer {
    /// The answer for an output of `vocab` ids per row.
    pub fn new(out: TopKTopPSampleOutput, vocab: usize) -> Self {
        Self {
            logits_top_kp_select: out
                .logits_top_kp_select
                .map(|values| Rows { values, vocab }),
            row_errors: out
                .row_status
                .iter()
                .map(|s| s.as_ref().err().map(RowErrorOut::from))
                .collect(),
            logits_select_idx: out.logits_select_idx,
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

/// `[B, V]` rows as one row-major vector, every value within the f32 range.
fn matrix(
    field: &str,
    rows: Vec<Row>,
    want: Option<(usize, usize)>,
) -> Result<Vec<f32>, CallError> {
    let shape_error = |m: String| CallError::new("shape_mismatch", m);
    if let Some((batch, _)) = want {
        if rows.len() != batch {
            return Err(shape_error(format!(
                "`{field}` has {} rows for {batch} logits rows",
                rows.len()
            )));
        }
    }
    let vocab = match want {
        Some((_, v)) => v,
        None => rows.first().map_or(0, |r| r.values.len()),
    };
    let mut flat = Vec::new();
    rows.len()
        .checked_mul(vocab)
        .and_then(|n| flat.try_reserve_exact(n).ok())
        .ok_or_else(|| {
            CallError::new(
                "allocation",
                format!(
                    "`{field}` [{}, {vocab}] could not be held in memory as one matrix",
                    rows.len()
                ),
            )
        })?;
    for (b, row) in rows.into_iter().enumerate() {
        let values = row
            .check_range(&format!("{field}[{b}]"))
            .map_err(CallError::invalid_call)?;
        if values.len() != vocab {
            return Err(shape_error(format!(
                "`{field}[{b}]` has {} values, but {} has {vocab}: `{field}` must be [batch, vocab]",
                values.len(),
                if want.is_some() {
                    "each logits row"
                } else {
                    "row 0"
                }
            )));
        }
        flat.extend_from_slice(&values);
    }
    Ok(flat)
}

/// A list of f32 values, every finite value within the f32 range.
fn floats(field: &str, list: &[Lenient]) -> Result<Vec<f32>, CallError> {
    list.iter()
        .enumerate()
        .map(|(i, &Lenient(v))| {
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

/// Checks that what the operator allocates inside for a `[batch, vocab]` call (its
/// `logits_top_kp_select` and working memory: [`crate::memory::npu_call_bytes`], with a
/// margin) can be had, before it runs: it would abort on a failed allocation.
///
/// # Errors
/// `allocation`, with the bytes.
fn check_room(
    (batch, vocab): (usize, usize),
    mut rows: impl Iterator<Item = (i32, f32, Option<f32>)>,
    options: &TopKTopPSampleOptions,
    widened: bool,
) -> Result<(), CallError> {
    let row_scratch = rows.try_fold(0usize, |most, (k, p, min_p)| {
        crate::memory::npu_row_bytes(vocab, k, p, min_p, options.ks_max).map(|b| b.max(most))
    });
    let bytes = row_scratch
        .and_then(|r| {
            crate::memory::npu_call_bytes(batch, vocab, options.is_need_logits, widened, r)
        })
        .map(crate::memory::with_margin);
    if crate::memory::can_allocate_checked(bytes) {
        return Ok(());
    }
    let what = format!(
        "the call on [{batch}, {vocab}] ({}the operator's working memory)",
        if options.is_need_logits {
            "logits_top_kp_select and "
        } else {
            ""
        }
    );
    Err(CallError::new(
        "allocation",
        crate::memory::refusal(&what, bytes),
    ))
}

/// Answers one parsed call.
///
/// # Errors
/// `invalid_call` (no rows, empty rows, values beyond f32), `shape_mismatch` (ragged rows, a
/// `q` of another shape, per-row lists of another length), `invalid_attribute` (`eps`,
/// `ks_max`).
pub fn answer_call(call: CallInput) -> Result<Answer, CallError> {
    let (options, kind) = AttrsInput {
        eps: call.eps,
        is_need_logits: call.is_need_logits,
        top_k_guess: call.top_k_guess,
        ks_max: call.ks_max,
        input_is_logits: call.input_is_logits,
        q_indexing: call.q_indexing,
    }
    .to_options();
    let batch = call.logits.0.len();
    if batch == 0 {
        return Err(CallError::invalid_call(
            "`logits` has no rows: give [batch, vocab] with batch >= 1",
        ));
    }
    let data = matrix("logits", call.logits.0, None)?;
    let vocab = data.len() / batch;
    if vocab == 0 {
        return Err(CallError::invalid_call(
            "the `logits` rows are empty: at least one token is needed",
        ));
    }
    let q = call
        .q
        .map(|q| matrix("q", q.0, Some((batch, vocab))))
        .transpose()?;
    let top_p = floats("top_p", &call.top_p.0)?;
    let min_ps = call
        .min_ps
        .as_ref()
        .map(|m| floats("min_ps", &m.0))
        .transpose()?;
    let view = LogitsView::dense(&data, batch, vocab)
        .map_err(|e| CallError::new("shape_mismatch", e.to_string()))?
        .with_kind(kind);
    let rows = (0..batch).map(|b| {
        (
            call.top_k.0.get(b).copied().unwrap_or(0),
            top_p.get(b).copied().unwrap_or(1.0),
            min_ps.as_ref().and_then(|m| m.get(b).copied()),
        )
    });
    check_room((batch, vocab), rows, &options, false)?;
    let out = top_k_top_p_sample(
        &view,
        &call.top_k.0,
        &top_p,
        q.as_deref(),
        min_ps.as_deref(),
        &options,
    )?;
    Ok(Answer::new(out, vocab))
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
/// `ks_max: invalid type: ...`), [`RunError::Input`] for a bad file.
pub fn read_attrs(text: &str, limit: MaxInputBytes) -> Result<AttrsInput, RunError> {
    crate::calls::read_attrs(text, limit)
}

/// A float tensor's values in its own element type.
enum Floats {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl Floats {
    /// Value `i` as f32 (`None` past the end).
    fn get_f32(&self, i: usize) -> Option<f32> {
        match self {
            Floats::F32(v) => v.get(i).copied(),
            Floats::F16(v) => v.get(i).map(|x| x.to_f32()),
            Floats::Bf16(v) => v.get(i).map(|x| x.to_f32()),
        }
    }

    fn dtype(&self) -> &'static str {
        match self {
            Floats::F32(_) => "F32",
            Floats::F16(_) => "F16",
            Floats::Bf16(_) => "BF16",
        }
    }
}

const TENSOR_NAMES: [&str; 5] = ["logits", "top_k", "top_p", "q", "min_ps"];

/// The tensors of one call, checked for rank and dtype.
struct Tensors {
    batch: usize,
    vocab: usize,
    logits: Floats,
    top_k: Vec<i32>,
    top_p: Floats,
    q: Option<Vec<f32>>,
    min_ps: Option<Floats>,
}

/// A float tensor's values, copied into a vector reserved first.
fn read_floats(
    name: &str,
    t: &safetensors::tensor::TensorView<'_>,
) -> Result<Floats, TensorsError> {
    let raw = t.data();
    let halves = || words::<2>(raw).map(u16::from_le_bytes);
    let copy = |width: usize| raw.len() / width;
    let memory = TensorsError::Memory;
    match t.dtype() {
        Dtype::F32 => Ok(Floats::F32(
            copy_values(name, copy(4), words::<4>(raw).map(f32::from_le_bytes)).map_err(memory)?,
        )),
        Dtype::F16 => Ok(Floats::F16(
            copy_values(name, copy(2), halves().map(f16::from_bits)).map_err(memory)?,
        )),
        Dtype::BF16 => Ok(Floats::Bf16(
            copy_values(name, copy(2), halves().map(bf16::from_bits)).map_err(memory)?,
        )),
        other => Err(CallError::new(
            "dtype_mismatch",
            format!("tensor `{name}` is {other:?}: expected F32, F16 or BF16"),
        )
        .into()),
    }
}

fn rank_error(name: &str, shape: &[usize], want: &str) -> CallError {
    CallError::new(
        "shape_mismatch",
        format!("tensor `{name}` has shape {shape:?}: expected {want}"),
    )
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
            "unknown tensor `{}`: the tensors are logits, top_k, top_p, q and min_ps",
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
    let logits = require("logits")?;
    let &[batch, vocab] = logits.shape() else {
        return Err(rank_error("logits", logits.shape(), "rank 2, [batch, vocab]").into());
    };
    if batch == 0 || vocab == 0 {
        return Err(CallError::invalid_call(format!(
            "tensor `logits` has shape [{batch}, {vocab}]: at least one row and one column are needed"
        ))
        .into());
    }
    let logits_values = read_floats("logits", &logits)?;
    let top_k = require("top_k")?;
    if top_k.shape().len() != 1 {
        return Err(rank_error("top_k", top_k.shape(), "rank 1, [batch]").into());
    }
    // I64 is PyTorch's default integer type.
    let top_k_values = copy_i32_tensor("top_k", top_k.dtype(), top_k.data(), |i, v| {
        CallError::invalid_call(format!(
            "tensor `top_k` (I64) holds {v} at index {i}: top_k values must fit in i32"
        ))
    })
    .ok_or_else(|| {
        CallError::new(
            "dtype_mismatch",
            format!("tensor `top_k` is {:?}: expected I32 or I64", top_k.dtype()),
        )
    })??;
    let top_p = require("top_p")?;
    if top_p.shape().len() != 1 {
        return Err(rank_error("top_p", top_p.shape(), "rank 1, [batch]").into());
    }
    // The operator takes `top_p` in the dtype of the logits or in f32.
    if top_p.dtype() != logits.dtype() && top_p.dtype() != Dtype::F32 {
        let accepted = match logits_values.dtype() {
            "F32" => "F32 (the dtype of `logits`)".to_string(),
            other => format!("{other} (the dtype of `logits`) or F32"),
        };
        return Err(CallError::new(
            "dtype_mismatch",
            format!("tensor `top_p` is {:?}: expected {accepted}", top_p.dtype()),
        )
        .into());
    }
    let top_p_values = read_floats("top_p", &top_p)?;
    let q = match get("q") {
        None => None,
        Some(q) => {
            if q.shape() != [batch, vocab] {
                return Err(rank_error("q", q.shape(), &format!("[{batch}, {vocab}]")).into());
            }
            if q.dtype() != Dtype::F32 {
                return Err(CallError::new(
                    "dtype_mismatch",
                    format!("tensor `q` is {:?}: expected F32", q.dtype()),
                )
                .into());
            }
            Some(
                copy_values(
                    "q",
                    q.data().len() / 4,
                    words::<4>(q.data()).map(f32::from_le_bytes),
                )
                .map_err(TensorsError::Memory)?,
            )
        }
    };
    let min_ps = match get("min_ps") {
        None => None,
        Some(m) => {
            if m.shape().len() != 1 {
                return Err(rank_error("min_ps", m.shape(), "rank 1, [batch]").into());
            }
            if m.dtype() != top_p.dtype() {
                return Err(CallError::new(
                    "dtype_mismatch",
                    format!(
                        "tensor `min_ps` is {:?}: expected {}, the dtype of `top_p`",
                        m.dtype(),
                        top_p_values.dtype()
                    ),
                )
                .into());
            }
            Some(read_floats("min_ps", &m)?)
        }
    };
    Ok(Tensors {
        batch,
        vocab,
        logits: logits_values,
        top_k: top_k_values,
        top_p: top_p_values,
        q,
        min_ps,
    })
}

/// Runs the operator with logits of type `T`, dispatching on the type of `top_p` / `min_ps`.
fn call_typed<T: LogitValue>(
    data: &[T],
    t: &Tensors,
    kind: InputKind,
    options: &TopKTopPSampleOptions,
) -> Result<TopKTopPSampleOutput, CallError> {
    let view = LogitsView::dense(data, t.batch, t.vocab)
        .map_err(|e| CallError::new("shape_mismatch", e.to_string()))?
        .with_kind(kind);
    let rows = (0..t.batch).map(|b| {
        (
            t.top_k.get(b).copied().unwrap_or(0),
            t.top_p.get_f32(b).unwrap_or(1.0),
            t.min_ps.as_ref().and_then(|m| m.get_f32(b)),
        )
    });
    check_room(
        (t.batch, t.vocab),
        rows,
        options,
        T::as_f32(&data[..0]).is_none(),
    )?;
    let q = t.q.as_deref();
    let out = match (&t.top_p, &t.min_ps) {
        (Floats::F32(p), None) => top_k_top_p_sample(&view, &t.top_k, p, q, None, options),
        (Floats::F16(p), None) => top_k_top_p_sample(&view, &t.top_k, p, q, None, options),
        (Floats::Bf16(p), None) => top_k_top_p_sample(&view, &t.top_k, p, q, None, options),
        (Floats::F32(p), Some(Floats::F32(m))) => {
            top_k_top_p_sample(&view, &t.top_k, p, q, Some(m), options)
        }
        (Floats::F16(p), Some(Floats::F16(m))) => {
            top_k_top_p_sample(&view, &t.top_k, p, q, Some(m), options)
        }
        (Floats::Bf16(p), Some(Floats::Bf16(m))) => {
            top_k_top_p_sample(&view, &t.top_k, p, q, Some(m), options)
        }
        // Excluded when the tensors were read.
        (_, Some(_)) => {
            return Err(CallError::new(
                "dtype_mismatch",
                "`min_ps` and `top_p` must share one dtype",
            ))
        }
    }?;
    Ok(out)
}

/// Answers the call held by a safetensors file's bytes.
///
/// # Errors
/// A message when the bytes are not a safetensors file or a tensor's copy cannot be held in
/// memory; a call error (wrong, missing or unknown tensors, ranks, dtypes) is an answer.
pub fn answer_safetensors(
    bytes: &[u8],
    attrs: &AttrsInput,
) -> Result<Result<Answer, CallError>, String> {
    let file = SafeTensors::deserialize(bytes).map_err(|e| crate::input::not_safetensors(&e))?;
    let (options, kind) = attrs.to_options();
    let t = match tensors(&file) {
        Ok(t) => t,
        Err(TensorsError::Call(e)) => return Ok(Err(e)),
        Err(TensorsError::Memory(m)) => return Err(m),
    };
    let out = match &t.logits {
        Floats::F32(d) => call_typed(d, &t, kind, &options),
        Floats::F16(d) => call_typed(d, &t, kind, &options),
        Floats::Bf16(d) => call_typed(d, &t, kind, &options),
    };
    Ok(out.map(|out| Answer::new(out, t.vocab)))
}

/// `--tensors FILE [--attrs JSON]`: one call, one answer line. The file is read within
/// `limit` ([`read_file`]), then answered by [`answer_safetensors`].
///
/// # Errors
/// [`RunError::Usage`] for a bad inline `--attrs`; [`RunError::Input`] for an unreadable file,
/// one larger than `limit`, a file that is not safetensors, or a bad `--attrs` file;
/// [`RunError::Output`] when writing fails.
pub fn run_safetensors(
    path: &Path,
    attrs: Option<&str>,
    out: &mut dyn Write,
    limit: MaxInputBytes,
) -> Result<(), RunError> {
    let attrs = attrs
        .map(|a| read_attrs(a, limit))
        .transpose()?
        .unwrap_or_default();
    let bytes = read_file("--tensors", path, limit).map_err(|e| RunError::Input(e.to_string()))?;
    let answer = answer_safetensors(&bytes, &attrs)
        .map_err(|e| RunError::Input(format!("{}: {e}", shown_path(path))))?;
    drop(bytes);
    crate::answer::Prepared::new(Reply(answer)).write(out)?;
    out.flush()?;
    Ok(())
}

/// Runs `nucleus top-k-top-p-sample` and returns its exit status: 0 when every call got an
/// answer, 1 for an unusable input and when writing fails (a closed pipe ends quietly with 0),
/// 2 for a bad inline `--attrs`.
pub fn command(args: &NpuSampleArgs) -> ExitCode {
    let limit = args.limit.max_input_bytes;
    crate::sample::run_command(
        args.tensors.as_deref(),
        args.input.as_deref(),
        |path, out| run_safetensors(path, args.attrs.as_deref(), out, limit),
        |input, out| run_jsonl(input, out, limit),
    )
}
