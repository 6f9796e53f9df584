//! `nucleus sample`: nucleus-sampling on real logits from a file or a pipe, one JSON answer per
//! row.
//!
//! # Input
//!
//! JSON lines (a file, or stdin: no `--input`, or `--input -`), one row each:
//!
//! ```json
//! {"logits": [1.5, "-inf", 0.2], "params": {"temperature": 0.7, "top_p": 0.9, "seed": 42},
//!  "prompt_ids": [2], "output_ids": [0], "position": 2, "eos_token_ids": [1],
//!  "stop_token_ids": [], "vocab_size": 3}
//! ```
//!
//! - exactly one of `logits` and `probs` (non-negative weights, see
//!   [`nucleus_sampling::InputKind::Probs`]); numbers may be the strings `"-inf"`, `"inf"`,
//!   `"nan"` ([`input::Lenient`]); values are rounded to f32, and a finite number beyond the
//!   f32 range is an `invalid_row` error naming its index ([`input::Row`]).
//! - at most one of `params` ([`input::ParamsInput`]: [`nucleus_sampling::SamplingParams`]
//!   fields by name, all optional and off by default, temperature 1) and `chain` (a list of
//!   [`nucleus_sampling::ProcessorConfig`], ending in `sample` or `greedy`); neither is the
//!   default parameters. A chain is built per row, reset with `prompt_ids`, told each id of
//!   `output_ids` (`accept`), then sampled; it takes logits only.
//! - `prompt_ids`, `output_ids` (default empty): the repetition penalty counts both; the
//!   frequency and presence penalties, bad words and `min_tokens` read `output_ids` only.
//! - `position`: default `prompt_ids.len() + output_ids.len()`, the index of the token being
//!   chosen in the whole sequence (the Philox counter).
//! - `eos_token_ids` and `stop_token_ids`: together they are
//!   [`nucleus_sampling::SampleRequest::stop_token_ids`], banned while `output_ids` is shorter
//!   than `min_tokens`. Each list is checked against `vocab_size` here, before they are
//!   merged, so that a `token_id_out_of_range` error names the list the id is in.
//! - `vocab_size`: default the row length; may be smaller (ids at or above it are padding and
//!   never candidates); 0 or above the row length is an `invalid_row` error.
//!
//! `null` is a field left out. Unknown fields are an error (`invalid_row`), so a misspelt
//! parameter is never ignored; an `invalid_row` message starts with the JSON path of the bad
//! value (`params.n: ...`, `chain[0].sample.n: ...`). Lines that [`str::trim`] leaves empty are
//! skipped and get no answer; a UTF-8 byte order mark at the start of the input is ignored.
//!
//! # Output
//!
//! One line per row, in input order ([`output::Answer`]):
//!
//! ```json
//! {"tokens":[0],"logprobs":[-0.31],"logprobs_kind":"processed","top_logprobs":[[]],"num_candidates":2,"seed":42}
//! ```
//!
//! or `{"error": {"kind": "...", "message": "..."}}` ([`output::RowError`]) for a row that
//! failed; the other rows are answered all the same. `tokens` are the `n` samples (sample
//! indices `0..n` of the row's Philox stream); `logprobs` their log-probabilities of the kind
//! asked for (processed when `logprobs` was not asked); `top_logprobs` one list per sampled
//! token (the same list `n` times, OpenAI's per-token shape; `[]` when not asked); `seed` the
//! seed used, an exact u64; `dist` (with `--dist`) the final distribution over the whole row.
//! A row whose `top_logprobs` would hold more than [`output::MAX_TOP_LOGPROBS`] entries
//! (`n × logprobs`) is an `invalid_params` error instead.
//! `-inf` is written as the string `"-inf"`.
//!
//! # Safetensors
//!
//! [`run_safetensors`] reads the file within `--max-input-bytes`, takes its `[batch, vocab]`
//! tensor named `logits` (f32, f16 or bf16), copies it into a vector of its element type (the
//! file's bytes are not aligned for it; they are freed after the copy) and samples it with one
//! [`sample_batch`] call; rows have no context (position 0). [`answer_safetensors`] does the
//! same on bytes in memory.
//!
//! # Throughput and memory
//!
//! A reader thread reads lines while the rows already read are sampled: rows are taken in
//! blocks of up to [`BLOCK`] lines (as many as have arrived, so an interactive pipe gets its
//! answer at once), sampled in parallel on the rayon pool, written in input order, and stdout is
//! flushed after each block. A line longer than `--max-input-bytes` is answered
//! `input_too_large` without being held ([`crate::input::LineReader`]). An answer larger than
//! [`crate::answer::IN_MEMORY_MAX`] (a `dist` over a large vocabulary) is serialised straight
//! into the output from the distribution's vector, never as a second copy in memory.
//!
//! The sampler allocates inside (its per-thread working memory, the distribution), and a
//! failed allocation there aborts: what a row needs ([`crate::memory::sampler_row_bytes`],
//! [`crate::memory::chain_row_bytes`], 8 bytes per entry for `--dist`) is checked with
//! [`crate::memory::can_allocate`] before it runs, and a row that does not fit is answered
//! with kind `allocation` (the next rows are answered as usual); with `--logits`, the batch's
//! working memory and outputs, and each group's distributions, likewise. A tensor whose copy
//! out of the file cannot be held is a [`RunError::Input`] (exit status 1).

pub mod input;
pub mod output;
pub mod tensor;

use std::borrow::Cow;
use std::io::{self, BufReader, Read, Write};
use std::path::Path;
use std::process::ExitCode;
use std::sync::mpsc;

use nucleus_sampling::{
    distribution, distribution_from_probs, sample_batch, sample_row, sample_row_from_probs,
    ChainError, LogitValue, LogitsView, ProcessorContext, SampleError, SampleRequest, SamplerChain,
    SamplingParams,
};
use rayon::prelude::*;

use serde::Serialize;

use crate::answer::{ErrorObject, Prepared, Reply};
use crate::input::{read_file, shown_path, Line, LineReader, MaxInputBytes};
use input::{Object, RowInput};
use output::{Answer, RowError};
use tensor::{LogitsData, LogitsTensor, ParamsFile};

/// Most lines sampled together in one parallel block.
pub const BLOCK: usize = 1024;

/// Options shared by every row.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// Add `"dist"`, the full final distribution, to every answer.
    pub dist: bool,
}

/// Why `nucleus sample` (or another JSON-lines command) stopped before answering every row.
#[derive(Debug)]
pub enum RunError {
    /// A flag value outside its domain (inline `--attrs` that is not a valid object): exit
    /// status 2.
    Usage(String),
    /// The input cannot be read or is unusable as a whole (a missing file, one larger than
    /// `--max-input-bytes`, a tensor of the wrong dtype or rank, a params list of the wrong
    /// length): exit status 1.
    Input(String),
    /// Writing the answers failed (a closed stdout is [`io::ErrorKind::BrokenPipe`]).
    Output(io::Error),
}

impl From<io::Error> for RunError {
    fn from(e: io::Error) -> Self {
        RunError::Output(e)
    }
}

/// Why a JSON text is not the value wanted ([`from_json`]).
#[derive(Debug)]
pub(crate) enum JsonError {
    /// Not one JSON value: serde_json's message.
    Syntax(serde_json::Error),
    /// JSON, but not of the wanted shape (a wrong or unknown field, a wrong type): the
    /// message, led by the JSON path of the bad value (`params.n: invalid value: ...`).
    Shape(String),
}

/// Reads `text` as one JSON value of type `T`, telling a text that is not JSON from JSON of the
/// wrong shape, whose message names the path of the bad value.
pub(crate) fn from_json<T: serde::de::DeserializeOwned>(text: &[u8]) -> Result<T, JsonError> {
    let mut de = serde_json::Deserializer::from_slice(text);
    match serde_path_to_error::deserialize::<_, T>(&mut de) {
        Ok(value) => de.end().map(|()| value).map_err(JsonError::Syntax),
        // serde_json stops at the first error, which may be a type error before a syntax
        // error further on (or a syntax-like error in valid JSON, such as a logit_bias key
        // that is not a number): the text is of the wrong shape only if the whole of it is JSON.
        Err(e) => match serde_json::from_slice::<serde::de::IgnoredAny>(text) {
            Ok(_) => Err(JsonError::Shape(path_message(&e))),
            Err(syntax) => Err(JsonError::Syntax(syntax)),
        },
    }
}

/// `path: message` for a value of the wrong shape. The position serde_json adds ("at line 1
/// column 47") is left out when there is a path, which says more; without one (the value at
/// the top is wrong) the message is serde_json's.
fn path_message(e: &serde_path_to_error::Error<serde_json::Error>) -> String {
    let inner = e.inner();
    let full = inner.to_string();
    let unknown =
        |s: &serde_path_to_error::Segment| matches!(s, serde_path_to_error::Segment::Unknown);
    if e.path().iter().all(unknown) {
        return full;
    }
    let position = format!(" at line {} column {}", inner.line(), inner.column());
    let message = full.strip_suffix(&position).unwrap_or(&full);
    format!("{}: {message}", e.path())
}

/// Parses one line into a row: `invalid_json` when it is not JSON, `invalid_row` when it is
/// JSON but not a row (wrong or unknown fields, wrong types), with a message that starts with
/// the JSON path of the bad value (`params.n: ...`, `chain[0].sample.n: ...`).
pub fn parse_row(line: &[u8]) -> Result<RowInput, RowError> {
    parse_line(line)
}

/// Parses one line into a JSON object of type `T` (unknown fields refused by `T`):
/// `invalid_json`, `invalid_row` (led by the JSON path of the bad value) or `allocation` (a
/// list that cannot be held), as [`parse_row`] says.
pub(crate) fn parse_line<T: serde::de::DeserializeOwned>(line: &[u8]) -> Result<T, RowError> {
    // JSON is UTF-8; checked up front because skipping over a string does not check it.
    std::str::from_utf8(line)
        .map_err(|e| RowError::invalid_json(format!("not valid JSON: not UTF-8 ({e})")))?;
    match from_json::<Object<T>>(line) {
        Ok(Object(row)) => Ok(row),
        Err(JsonError::Shape(message)) => Err(RowError {
            kind: input::allocation_kind(&message, "invalid_row"),
            message,
        }),
        Err(JsonError::Syntax(e)) => Err(RowError::invalid_json(format!("not valid JSON: {e}"))),
    }
}

/// The first id of the row's context (`fields` in order: here `prompt_ids`, `output_ids`,
/// `eos_token_ids`, `stop_token_ids`; `speculative-verify` adds `draft_token_ids`) that is
/// not below `vocab_size`, as a `token_id_out_of_range` error naming its own field. The sampler sees eos and stop ids as
/// one list and would name both `stop_token_ids`, so they are checked here, before merging.
pub(crate) fn check_context_ids(
    fields: &[(&'static str, &[u32])],
    vocab_size: usize,
) -> Result<(), RowError> {
    for &(field, ids) in fields {
        if let Some(&token_id) = ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(SampleError::TokenIdOutOfRange {
                field,
                token_id,
                vocab_size,
            }
            .into());
        }
    }
    Ok(())
}

/// Samples one row, and computes its distribution when `options.dist` is set.
///
/// # Errors
/// `invalid_row` when the fields do not make a row (both or neither of `logits` and `probs`,
/// both `params` and `chain`, a bad `vocab_size`, a chain with probabilities); otherwise the
/// sampler's error for the row.
pub fn answer_row(row: RowInput, options: &Options) -> Result<Answer, RowError> {
    let (values, probs) = match (row.logits, row.probs) {
        (Some(l), None) => (
            l.check_range("logits").map_err(RowError::invalid_row)?,
            false,
        ),
        (None, Some(p)) => (p.check_range("probs").map_err(RowError::invalid_row)?, true),
        (Some(_), Some(_)) => {
            return Err(RowError::invalid_row(
                "both `logits` and `probs` given: give one of them",
            ))
        }
        (None, None) => {
            return Err(RowError::invalid_row(
                "neither `logits` nor `probs` given: give one of them",
            ))
        }
    };
    if values.is_empty() {
        return Err(RowError::invalid_row(format!(
            "the `{}` row is empty",
            if probs { "probs" } else { "logits" }
        )));
    }
    let vocab_size = row.vocab_size.unwrap_or(values.len());
    if vocab_size == 0 || vocab_size > values.len() {
        return Err(RowError::invalid_row(format!(
            "vocab_size {vocab_size} must be in 1..={} (the row length)",
            values.len()
        )));
    }
    let candidates = &values[..vocab_size];
    let prompt_ids = row.prompt_ids.unwrap_or_default().0;
    let output_ids = row.output_ids.unwrap_or_default().0;
    let position = row
        .position
        .unwrap_or((prompt_ids.len() + output_ids.len()) as u64);
    let eos_ids = row.eos_token_ids.unwrap_or_default().0;
    let stop_token_ids = row.stop_token_ids.unwrap_or_default().0;
    let context_ids = [
        ("prompt_ids", &prompt_ids[..]),
        ("output_ids", &output_ids[..]),
        ("eos_token_ids", &eos_ids[..]),
        ("stop_token_ids", &stop_token_ids[..]),
    ];
    let mut stop_ids = eos_ids.clone();
    stop_ids.extend_from_slice(&stop_token_ids);

    let params = match (row.params, row.chain) {
        (Some(_), Some(_)) => {
            return Err(RowError::invalid_row(
                "both `params` and `chain` given: give at most one of them",
            ))
        }
        (None, Some(chain)) => {
            if probs {
                return Err(RowError::invalid_row(
                    "a `chain` row takes `logits`, not `probs` (processors act on logits)",
                ));
            }
            let need = crate::memory::chain_row_bytes(vocab_size, &chain);
            let mut chain = SamplerChain::from_config(&chain).map_err(chain_error)?;
            check_context_ids(&context_ids, vocab_size)?;
            check_room(
                need.zip(dist_bytes(options, vocab_size, values.len()))
                    .and_then(|(a, b)| a.checked_add(b)),
            )?;
            // The penalties learn the sequence from reset and accept, not from the context.
            chain.reset(&prompt_ids);
            for &token in &output_ids {
                chain.accept(token);
            }
            let ctx = ProcessorContext::new(&prompt_ids, &output_ids, position)
                .with_stop_token_ids(&stop_ids);
            let sampled = chain.sample(candidates, &ctx, 0)?;
            output::check_top_logprobs(&sampled)?;
            let dist = match options.dist {
                true => Some(chain.distribution(candidates, &ctx)?),
                false => None,
            };
            return Ok(Answer::new(&sampled, dist.map(|d| pad(d, values.len()))));
        }
        (Some(Object(p)), None) => p.to_params(),
        (None, None) => SamplingParams::default(),
    };
    // The sampler checks the parameters before the ids; so does this path.
    params.validate().map_err(SampleError::InvalidParams)?;
    check_context_ids(&context_ids, vocab_size)?;
    check_room(
        crate::memory::sampler_row_bytes(vocab_size, &params, false)
            .zip(dist_bytes(options, vocab_size, values.len()))
            .and_then(|(a, b)| a.checked_add(b)),
    )?;
    let request = SampleRequest::new(&params, &prompt_ids, &output_ids, position)
        .with_stop_token_ids(&stop_ids);
    let (sampled, dist) = if probs {
        let sampled = sample_row_from_probs(candidates, &request)?;
        output::check_top_logprobs(&sampled)?;
        let dist = match options.dist {
            true => Some(distribution_from_probs(candidates, &request)?),
            false => None,
        };
        (sampled, dist)
    } else {
        let sampled = sample_row(candidates, &request)?;
        output::check_top_logprobs(&sampled)?;
        let dist = match options.dist {
            true => Some(distribution(candidates, &request)?),
            false => None,
        };
        (sampled, dist)
    };
    Ok(Answer::new(&sampled, dist.map(|d| pad(d, values.len()))))
}

/// A chain that cannot be built: a parameter out of range is `invalid_params` (as on the
/// `params` path); a chain without a final selection step is `invalid_row`.
pub(crate) fn chain_error(e: ChainError) -> RowError {
    let kind = match e {
        ChainError::InvalidParams { .. } => "invalid_params",
        ChainError::NoSelection | ChainError::SelectionNotLast { .. } => "invalid_row",
    };
    RowError {
        kind,
        message: e.to_string(),
    }
}

/// A distribution over the candidate ids, extended with zeros to the whole row (its room
/// reserved exactly: [`dist_bytes`] counts it; `resize` alone may double the vector).
fn pad(mut dist: Vec<f64>, row_len: usize) -> Vec<f64> {
    dist.reserve_exact(row_len.saturating_sub(dist.len()));
    dist.resize(row_len, 0.0);
    dist
}

/// The bytes of a row's `--dist` (none without it): 8 per candidate, and while it is padded
/// to the row length ([`pad`]) the padded copy too.
fn dist_bytes(options: &Options, vocab_size: usize, row_len: usize) -> Option<usize> {
    if !options.dist {
        return Some(0);
    }
    let padded = if vocab_size < row_len { row_len } else { 0 };
    vocab_size.checked_add(padded)?.checked_mul(8)
}

/// Checks that the working memory and outputs of a row's sampling, `bytes` (before the
/// margin), can be had ([`crate::memory::can_allocate`]) before the sampler, which allocates
/// inside and would abort, runs.
///
/// # Errors
/// `allocation`, with the bytes.
fn check_room(bytes: Option<usize>) -> Result<(), RowError> {
    let bytes = bytes.map(crate::memory::with_margin);
    if crate::memory::can_allocate_checked(bytes) {
        return Ok(());
    }
    Err(RowError {
        kind: "allocation",
        message: crate::memory::refusal(
            "sampling the row (the sampler's working memory and the answer's values)",
            bytes,
        ),
    })
}

/// One input line answered: the row's answer, or its error.
pub fn answer(line: &[u8], options: &Options) -> Result<Answer, RowError> {
    parse_row(line).and_then(|row| answer_row(row, options))
}

/// The answer line (without newline) for one input line, as the command writes it.
pub fn answer_line(line: &[u8], options: &Options) -> Vec<u8> {
    crate::answer::to_line(&Reply(answer(line, options)))
}

/// Whether a line holds nothing but whitespace, as [`str::trim`] sees it (Unicode
/// White_Space: also `\v`, `\f`, U+00A0, U+2003, ...). Such lines get no answer.
fn is_blank(line: &[u8]) -> bool {
    std::str::from_utf8(line).is_ok_and(|l| l.trim().is_empty())
}

/// Answers every line of `input` (JSON lines) on `out`, in input order, one line per
/// non-blank input line; see the module docs. Reading happens on a thread of its own, so
/// sampling a block overlaps reading the next one; `out` is flushed after every block. A line
/// longer than `limit` is answered with an `input_too_large` error.
///
/// # Errors
/// [`RunError::Input`] when reading fails (the lines before the failure are answered first);
/// [`RunError::Output`] when writing fails.
pub fn run_jsonl(
    input: Box<dyn Read + Send>,
    out: &mut dyn Write,
    options: &Options,
    limit: MaxInputBytes,
) -> Result<(), RunError> {
    stream_lines(input, out, BLOCK, limit, |line| {
        Reply(answer(line, options))
    })
}

pub use crate::input::open_input;

/// Runs a JSON-lines command (`sample`, `top-k-top-p-sample`, `moe-init-routing`) on stdout
/// and returns its exit status: `tensors` runs on a safetensors file when one was given, else
/// `jsonl` on `--input` (or stdin). 0 when every call got an answer (an error answer
/// included); 1 for an unreadable or unusable input (after the answers already written are
/// flushed) and when writing fails (a closed pipe, as in `| head`, ends quietly with 0); 2 for
/// a bad flag value ([`RunError::Usage`]).
pub fn run_command(
    tensors_path: Option<&Path>,
    input: Option<&Path>,
    tensors: impl FnOnce(&Path, &mut dyn Write) -> Result<(), RunError>,
    jsonl: impl FnOnce(Box<dyn Read + Send>, &mut dyn Write) -> Result<(), RunError>,
) -> ExitCode {
    let stdout = io::stdout();
    let mut out = io::BufWriter::with_capacity(1 << 20, stdout.lock());
    let result = match (tensors_path, input) {
        (Some(path), _) => tensors(path, &mut out),
        (None, Some(path)) => match open_input(path) {
            Ok(input) => jsonl(input, &mut out),
            Err(e) => Err(RunError::Input(format!(
                "cannot open {}: {e}",
                shown_path(path)
            ))),
        },
        (None, None) => jsonl(Box::new(io::stdin()), &mut out),
    };
    let result = match result {
        // Answers already written stay valid; make sure they are out before the error.
        Err(e @ (RunError::Input(_) | RunError::Usage(_))) => {
            out.flush().map_err(RunError::Output).and(Err(e))
        }
        other => other,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(RunError::Usage(message)) => {
            crate::report::error(&message);
            ExitCode::from(crate::usage::USAGE_STATUS)
        }
        Err(RunError::Input(message)) => {
            crate::report::error(&message);
            ExitCode::FAILURE
        }
        Err(RunError::Output(e)) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(RunError::Output(e)) => {
            crate::report::error(&format!("writing the output: {e}"));
            ExitCode::FAILURE
        }
    }
}

/// One item of the stream: a line to answer, or a line the reader could not take.
enum Item {
    Text(Vec<u8>),
    TooLarge,
    Unallocatable(usize),
}

/// The raw bytes of the lines read but not yet answered, bounded so that a run of large lines
/// cannot pile up in the queue: the reader waits while more than `max(limit, 64 MiB)` bytes
/// are queued (a single line always goes through).
struct Budget {
    queued: std::sync::Mutex<usize>,
    room: std::sync::Condvar,
    max: usize,
}

impl Budget {
    fn take(&self, n: usize) {
        let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
        while *queued > 0 && queued.saturating_add(n) > self.max {
            queued = self.room.wait(queued).unwrap_or_else(|e| e.into_inner());
        }
        *queued += n;
    }

    fn give_back(&self, n: usize) {
        let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
        *queued = queued.saturating_sub(n);
        self.room.notify_all();
    }
}

/// The JSON-lines loop shared by `nucleus sample`, `nucleus top-k-top-p-sample` and `nucleus
/// moe-init-routing`: reads the non-blank lines of `input` on a thread of its own
/// ([`LineReader`]: a leading byte-order mark and line endings removed, at most `limit` bytes
/// a line), answers them with `answer` in blocks of up to `block_len` in parallel (as many as
/// have arrived), writes one answer line each in input order and flushes after each block.
///
/// A line longer than `limit` is answered `{"error": {"kind": "input_too_large", ...}}` in its
/// place as soon as its byte `limit + 1` is read, and its other bytes are skipped without being
/// held; one whose memory cannot be had is answered with kind `allocation`. Answers larger
/// than [`crate::answer::IN_MEMORY_MAX`] are serialised straight into `out`.
///
/// # Errors
/// [`RunError::Input`] when reading fails (earlier lines are answered first);
/// [`RunError::Output`] when writing fails.
pub(crate) fn stream_lines<A: Serialize + Send>(
    input: Box<dyn Read + Send>,
    out: &mut dyn Write,
    block_len: usize,
    limit: MaxInputBytes,
    answer: impl Fn(&[u8]) -> A + Sync,
) -> Result<(), RunError> {
    let (tx, rx) = mpsc::sync_channel::<io::Result<Item>>(2 * block_len);
    let budget = std::sync::Arc::new(Budget {
        queued: std::sync::Mutex::new(0),
        room: std::sync::Condvar::new(),
        max: limit.bytes().max(64 << 20),
    });
    let reader_budget = std::sync::Arc::clone(&budget);
    // Joined when the input ends; not when writing fails (stdout closed): the main thread
    // then returns while this one may still wait for input, and the process exit ends it.
    let reader = std::thread::spawn(move || {
        let mut lines = LineReader::new(BufReader::with_capacity(1 << 20, input), limit);
        loop {
            let item = match lines.next_line() {
                Ok(None) => return,
                Ok(Some(Line::Text(line))) if is_blank(&line) => continue,
                Ok(Some(Line::Text(mut line))) => {
                    // Without its `\r`, so error positions read "line 1 column N".
                    while line.last() == Some(&b'\r') {
                        line.pop();
                    }
                    reader_budget.take(line.len());
                    Ok(Item::Text(line))
                }
                Ok(Some(Line::TooLarge)) => Ok(Item::TooLarge),
                Ok(Some(Line::Unallocatable { read })) => Ok(Item::Unallocatable(read)),
                Err(e) => Err(e),
            };
            let failed = item.is_err();
            if tx.send(item).is_err() || failed {
                return;
            }
        }
    });

    let mut block: Vec<Item> = Vec::with_capacity(block_len);
    let mut failure = None;
    while failure.is_none() {
        // Wait for one line, then take whatever else has already arrived, up to `block_len`.
        block.clear();
        match rx.recv() {
            Ok(Ok(item)) => block.push(item),
            Ok(Err(e)) => failure = Some(e),
            Err(mpsc::RecvError) => break,
        }
        while failure.is_none() && !block.is_empty() && block.len() < block_len {
            match rx.try_recv() {
                Ok(Ok(item)) => block.push(item),
                Ok(Err(e)) => failure = Some(e),
                Err(_) => break,
            }
        }
        let answers: Vec<Prepared<StreamAnswer<A>>> = block
            .par_iter()
            .map(|item| {
                Prepared::new(match item {
                    Item::Text(line) => StreamAnswer::Answer(answer(line)),
                    Item::TooLarge => StreamAnswer::Error(ErrorObject {
                        kind: "input_too_large",
                        message: crate::input::too_large_message(limit),
                    }),
                    Item::Unallocatable(read) => StreamAnswer::Error(ErrorObject {
                        kind: "allocation",
                        message: crate::input::unallocatable_message(*read),
                    }),
                })
            })
            .collect();
        let queued: usize = block
            .iter()
            .map(|item| match item {
                Item::Text(line) => line.len(),
                _ => 0,
            })
            .sum();
        block.clear();
        budget.give_back(queued);
        for answer in &answers {
            answer.write(out)?;
        }
        out.flush()?;
    }
    // The input ended (or failed) and the reader sent its last item: it has returned.
    let _ = reader.join();
    match failure {
        Some(e) => Err(RunError::Input(format!("cannot read the input: {e}"))),
        None => Ok(()),
    }
}

/// An answer of the streaming loop: the command's own, or one for a line it could not take.
enum StreamAnswer<A> {
    Answer(A),
    Error(ErrorObject),
}

impl<A: Serialize> Serialize for StreamAnswer<A> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            StreamAnswer::Answer(a) => a.serialize(s),
            StreamAnswer::Error(e) => Reply::<(), &ErrorObject>(Err(e)).serialize(s),
        }
    }
}

/// The params of every row of a `batch`-row tensor from `--params` (default parameters
/// without it).
///
/// # Errors
/// A list whose length is not the batch.
fn row_params(params: Option<&ParamsFile>, batch: usize) -> Result<Vec<SamplingParams>, String> {
    match params {
        None => Ok(vec![SamplingParams::default(); batch]),
        Some(ParamsFile::One(p)) => Ok(vec![p.to_params(); batch]),
        Some(ParamsFile::PerRow(list)) => {
            if list.len() != batch {
                let plural = |n: usize, word: &str| match n {
                    1 => format!("1 {word}"),
                    n => format!("{n} {word}s"),
                };
                return Err(format!(
                    "--params holds {} for {} of logits: give one object, or one per row",
                    plural(list.len(), "object"),
                    plural(batch, "row")
                ));
            }
            Ok(list.iter().map(|p| p.to_params()).collect())
        }
    }
}

/// Samples every row of the `logits` tensor of a safetensors file with [`sample_batch`] and
/// writes one answer line per row.
///
/// Parameters come from `params` (one object for every row, or a list of one per row; default
/// parameters without it). Rows have no context: empty prompt and output ids, position 0. Both
/// files are read within `limit` ([`crate::input::read_file`]); the file's bytes are freed once
/// the tensor is copied out of them.
///
/// # Errors
/// [`RunError::Input`] for an unreadable file or one larger than `limit`, no tensor named
/// `logits`, a tensor not of rank 2 or not f32 / f16 / bf16, an unreadable params file, or a
/// params list whose length is not the batch; [`RunError::Output`] when writing fails.
pub fn run_safetensors(
    logits: &Path,
    params: Option<&Path>,
    out: &mut dyn Write,
    options: &Options,
    limit: MaxInputBytes,
) -> Result<(), RunError> {
    let params = params
        .map(|p| {
            let bytes = read_file("--params", p, limit).map_err(|e| e.to_string())?;
            tensor::params_from_bytes(&bytes).map_err(|e| format!("{}: {e}", shown_path(p)))
        })
        .transpose()
        .map_err(RunError::Input)?;
    let name = shown_path(logits);
    let bytes = read_file("--logits", logits, limit).map_err(|e| RunError::Input(e.to_string()))?;
    let tensor =
        tensor::logits_from_bytes(&bytes).map_err(|e| RunError::Input(format!("{name}: {e}")))?;
    drop(bytes);
    answer_tensor(&tensor, params.as_ref(), out, options).map_err(|e| e.in_file(&name))
}

/// [`run_safetensors`] on a safetensors file's bytes in memory (the same code after the
/// files are read): writes one answer line per row of its `logits` tensor to `out`.
///
/// # Errors
/// As [`run_safetensors`], the messages without a file name.
pub fn answer_safetensors(
    bytes: &[u8],
    params: Option<&ParamsFile>,
    out: &mut dyn Write,
    options: &Options,
) -> Result<(), RunError> {
    let tensor = tensor::logits_from_bytes(bytes).map_err(RunError::Input)?;
    answer_tensor(&tensor, params, out, options)
}

impl RunError {
    /// An input error's message led by the file's name.
    fn in_file(self, name: &str) -> Self {
        match self {
            RunError::Input(m) if !m.starts_with("--params") => {
                RunError::Input(format!("{name}: {m}"))
            }
            other => other,
        }
    }
}

/// The answers for every row of `tensor`, written to `out`.
fn answer_tensor(
    tensor: &LogitsTensor,
    params: Option<&ParamsFile>,
    out: &mut dyn Write,
    options: &Options,
) -> Result<(), RunError> {
    let params = row_params(params, tensor.batch).map_err(RunError::Input)?;
    let (batch, vocab) = (tensor.batch, tensor.vocab);
    let row = |i: usize| i * vocab..(i + 1) * vocab;
    let shape = (batch, vocab);
    match &tensor.data {
        LogitsData::F32(data) => write_tensor_answers(data, shape, &params, options, out, |i| {
            Cow::Borrowed(&data[row(i)])
        }),
        LogitsData::F16(data) => write_tensor_answers(data, shape, &params, options, out, |i| {
            Cow::Owned(data[row(i)].iter().map(|v| v.to_f32()).collect())
        }),
        LogitsData::Bf16(data) => write_tensor_answers(data, shape, &params, options, out, |i| {
            Cow::Owned(data[row(i)].iter().map(|v| v.to_f32()).collect())
        }),
    }
}

/// With `--dist`, rows are answered in groups whose distributions take about this many bytes
/// (at least one row), so that a large batch never holds every row's distribution at once.
const DIST_GROUP_BYTES: usize = 64 << 20;

/// The bytes [`sample_batch`] may allocate for `params` (one per row) on rows of `vocab`
/// values: each working thread's scratch, at the largest any row needs
/// ([`crate::memory::sampler_row_bytes`]), and every row's output (its samples and top
/// logprobs); without margin.
fn batch_bytes(params: &[SamplingParams], vocab: usize, widened: bool) -> Option<usize> {
    let threads = rayon::current_num_threads().min(params.len()).max(1);
    let mut scratch = 0usize;
    let mut outputs = 0usize;
    for p in params {
        scratch = scratch.max(crate::memory::sampler_row_bytes(vocab, p, widened)?);
        let top = p.logprobs.map_or(0, |t| t.min(vocab));
        let row = top.checked_mul(24)?.checked_add(p.n.checked_mul(16)?)?;
        outputs = outputs.checked_add(row.checked_add(128)?)?;
    }
    scratch.checked_mul(threads)?.checked_add(outputs)
}

/// Samples a dense `[batch, vocab]` matrix with one [`sample_batch`] call and writes one answer
/// per row (with `--dist`, distributions computed a group of rows at a time, in parallel).
///
/// The sampler allocates inside: its working memory and outputs ([`batch_bytes`]), and each
/// group's distributions, are checked first ([`crate::memory::can_allocate`]); rows whose
/// memory cannot be had are answered with kind `allocation`.
fn write_tensor_answers<'a, T: LogitValue>(
    data: &'a [T],
    (batch, vocab): (usize, usize),
    params: &[SamplingParams],
    options: &Options,
    out: &mut dyn Write,
    row_f32: impl Fn(usize) -> Cow<'a, [f32]> + Sync,
) -> Result<(), RunError> {
    let shape_error = |e: nucleus_sampling::ShapeError| RunError::Input(e.to_string());
    let view = LogitsView::dense(data, batch, vocab).map_err(shape_error)?;
    let widened = T::as_f32(&data[..0]).is_none();
    let room = |bytes: Option<usize>, what: &str| {
        let bytes = bytes.map(crate::memory::with_margin);
        match crate::memory::can_allocate_checked(bytes) {
            true => Ok(()),
            false => Err(RowError {
                kind: "allocation",
                message: crate::memory::refusal(what, bytes),
            }),
        }
    };
    if let Err(e) = room(
        batch_bytes(params, vocab, widened),
        &format!(
            "sampling the [{batch}, {vocab}] tensor (the sampler's working memory and outputs)"
        ),
    ) {
        for _ in 0..batch {
            Prepared::new(Reply::<Answer, _>(Err(&e))).write(out)?;
        }
        out.flush()?;
        return Ok(());
    }
    let requests: Vec<SampleRequest<'_>> = params
        .iter()
        .map(|p| SampleRequest::new(p, &[], &[], 0))
        .collect();
    let results = sample_batch(&view, &requests).map_err(shape_error)?;
    let group = match options.dist {
        true => (DIST_GROUP_BYTES / vocab.saturating_mul(8).max(1)).max(1),
        false => BLOCK,
    };
    // A group's distributions (8 bytes per entry) and a 16-bit row's f32 copy (4).
    let per_dist = if widened { 12 } else { 8 };
    let mut results = results.into_iter().enumerate();
    loop {
        let rows: Vec<_> = results.by_ref().take(group).collect();
        if rows.is_empty() {
            break;
        }
        let dists = match options.dist {
            true => room(
                rows.len()
                    .checked_mul(vocab)
                    .and_then(|n| n.checked_mul(per_dist)),
                &format!("the --dist of {} row(s) of {vocab}", rows.len()),
            ),
            false => Ok(()),
        };
        let answers: Vec<Prepared<Reply<Answer, RowError>>> = rows
            .into_par_iter()
            .map(|(i, result)| {
                if let Err(e) = &dists {
                    return Prepared::new(Reply(Err(e.clone())));
                }
                Prepared::new(Reply(result.map_err(RowError::from).and_then(|sampled| {
                    output::check_top_logprobs(&sampled)?;
                    let dist = match options.dist {
                        true => Some(distribution(&row_f32(i), &requests[i])?),
                        false => None,
                    };
                    Ok(Answer::new(&sampled, dist))
                })))
            })
            .collect();
        for answer in &answers {
            answer.write(out)?;
        }
    }
    out.flush()?;
    Ok(())
}
