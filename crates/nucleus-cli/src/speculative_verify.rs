//! `nucleus speculative-verify`: speculative-decoding verification
//! ([`nucleus_sampling::speculative::verify`]) on requests read from a file or a pipe, one
//! JSON answer per request.
//!
//! # Input
//!
//! JSON lines (`--input FILE`, or stdin: no `--input`, or `--input -`), one request each:
//!
//! ```json
//! {"draft_token_ids": [2, 0], "draft_probs": [[0.1, 0.2, 0.6, 0.1], [0.5, 0.2, 0.2, 0.1]],
//!  "target_logits": [[1, 0, 2, 0], [0.5, 0, 0, 1], [0, 0, 0, 3]],
//!  "params": {"temperature": 0.8, "top_p": 0.95, "seed": 7},
//!  "prompt_ids": [1], "output_ids": [3], "position": 2, "vocab_size": 4}
//! ```
//!
//! - `draft_token_ids` (required, `K >= 0` ids) and, optionally, `draft_probs` (`K` rows of
//!   the draft model's probabilities; left out, the draft is one-hot: n-gram or prompt-lookup
//!   drafts);
//! - exactly one of `target_logits` and `target_probs`: the target model's `K + 1` rows;
//! - at most one of `params` ([`crate::sample::input::ParamsInput`], as `nucleus sample`
//!   reads it) and `chain` (a list of [`nucleus_sampling::ProcessorConfig`], ending in a
//!   selection; logits only). A chain is built per request, reset with `prompt_ids` and told
//!   each id of `output_ids`. The seed is `params.seed` (or the chain selection's `seed`),
//!   drawn from the OS and reported when absent;
//! - `prompt_ids`, `output_ids`, `eos_token_ids`, `stop_token_ids` (default empty) and
//!   `position` (default `prompt_ids.len() + output_ids.len()`, the index of the first draft
//!   token) as in `nucleus sample`;
//! - `vocab_size`: default the row length; every row (draft and target) has the same length
//!   and its first `vocab_size` values are the candidates.
//!
//! Numbers may be the strings `"-inf"`, `"inf"`, `"nan"`; values are rounded to f32, and a
//! finite number beyond the f32 range is an `invalid_row` error naming its place. `null` is a
//! field left out; unknown fields are errors; blank lines are skipped; a UTF-8 byte order mark
//! at the start is ignored.
//!
//! # Output
//!
//! One line per request, in input order:
//!
//! ```json
//! {"accepted":1,"tokens":[2,3],"logprobs":[-0.61,-0.12],"seed":7}
//! ```
//!
//! `accepted` draft tokens were accepted; `tokens` are those and then the residual or bonus
//! token; `logprobs` each emitted token's natural-log probability under the target's
//! processed distribution at its place; `seed` the seed used (an exact u64). A request that
//! fails gets `{"error": {"kind": "...", "message": "..."}}` with the kinds of
//! `nucleus sample` ([`crate::sample::output::RowError`]): `invalid_json`, `invalid_row`,
//! `invalid_params` (a draft row with a negative, NaN or infinite value or a zero sum, a
//! drafted token of draft probability 0, `n != 1`, `logprobs`, mirostat with `params`),
//! `token_id_out_of_range`, `non_finite_logits`, `no_candidates`, `allocation`,
//! `input_too_large` (a line longer than `--max-input-bytes`), ...; the next lines are
//! answered all the same.
//!
//! # Exit status
//!
//! 0 when every request got an answer (an error answer included); 1 for an input file that
//! cannot be opened or read and when writing fails (a closed pipe ends quietly with 0); 2 for
//! bad flags ([`crate::usage`]).

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use nucleus_sampling::speculative::{verify, TargetRows, Verifier, VerifyOutput, VerifyRequest};
use nucleus_sampling::{SampleError, SamplerChain, SamplingParams};
use serde::{Deserialize, Serialize};

use crate::answer::Reply;
use crate::input::{InputLimit, MaxInputBytes};
use crate::sample::input::{ChainInput, Fallible, Object, ParamsInput, Row};
use crate::sample::output::RowError;
use crate::sample::RunError;

/// The flags of `nucleus speculative-verify`.
#[derive(Args, Debug, Clone, Default)]
pub struct SpeculativeVerifyArgs {
    /// JSON lines, one request each (default, or `-`: stdin).
    #[arg(long, value_name = "FILE")]
    pub input: Option<PathBuf>,
    /// `--max-input-bytes`: most bytes of one JSON line.
    #[command(flatten)]
    pub limit: InputLimit,
    /// `--threads`.
    #[command(flatten)]
    pub threads: crate::threads::Threads,
}

/// Lines answered together in one parallel block.
pub const BLOCK: usize = 64;

/// One line of JSON input (module doc).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerifyInput {
    /// The `K` drafted token ids.
    pub draft_token_ids: Option<Fallible<u32>>,
    /// The draft model's `K` rows, or none for a one-hot draft.
    pub draft_probs: Option<Fallible<Row>>,
    /// The target model's `K + 1` rows of logits.
    pub target_logits: Option<Fallible<Row>>,
    /// The target model's `K + 1` rows of probabilities, instead of logits.
    pub target_probs: Option<Fallible<Row>>,
    /// Sampling parameters.
    pub params: Option<Object<ParamsInput>>,
    /// A processor chain, instead of `params`.
    pub chain: Option<ChainInput>,
    /// Prompt token ids.
    pub prompt_ids: Option<Fallible<u32>>,
    /// Token ids generated before the draft.
    pub output_ids: Option<Fallible<u32>>,
    /// Index in the whole sequence of the first draft token.
    pub position: Option<u64>,
    /// EOS token ids (banned while fewer than `min_tokens` ids were generated).
    pub eos_token_ids: Option<Fallible<u32>>,
    /// Stop token ids (as `eos_token_ids`).
    pub stop_token_ids: Option<Fallible<u32>>,
    /// Candidate ids: the first `vocab_size` values of each row.
    pub vocab_size: Option<usize>,
}

/// The answer for a verified request ([`VerifyOutput`] as JSON).
#[derive(Debug, Serialize)]
pub struct Answer {
    accepted: usize,
    tokens: Vec<u32>,
    #[serde(serialize_with = "crate::sample::output::f64_list")]
    logprobs: Vec<f64>,
    seed: u64,
}

impl From<VerifyOutput> for Answer {
    fn from(out: VerifyOutput) -> Self {
        Self {
            accepted: out.accepted,
            tokens: out.tokens,
            logprobs: out.logprobs,
            seed: out.seed,
        }
    }
}

/// Parses one line: `invalid_json` when it is not JSON, `invalid_row` when its fields are
/// wrong (the message led by the JSON path of the bad value), `allocation` when a list cannot
/// be held.
pub fn parse_request(line: &[u8]) -> Result<VerifyInput, RowError> {
    crate::sample::parse_line(line)
}

/// The rows of `field` as one row-major buffer of their first `vocab_size` values: `rows`
/// rows, each of length `len`.
fn flatten(
    field: &str,
    matrix: Vec<Row>,
    rows: usize,
    len: usize,
    vocab_size: usize,
) -> Result<Vec<f32>, RowError> {
    if matrix.len() != rows {
        return Err(RowError::invalid_row(format!(
            "`{field}` has {} rows: it needs {rows} ({})",
            matrix.len(),
            if field == "draft_probs" {
                "one per draft token"
            } else {
                "one per draft token and one for the bonus token"
            }
        )));
    }
    let mut out = Vec::new();
    check_room(rows.checked_mul(vocab_size).and_then(|n| n.checked_mul(4)))?;
    out.reserve_exact(rows * vocab_size);
    for (i, row) in matrix.into_iter().enumerate() {
        let values = row
            .check_range(&format!("{field}[{i}]"))
            .map_err(RowError::invalid_row)?;
        if values.len() != len {
            return Err(RowError::invalid_row(format!(
                "`{field}[{i}]` has {} values, the rows have {len}: every row the same length",
                values.len()
            )));
        }
        out.extend_from_slice(&values[..vocab_size]);
    }
    Ok(out)
}

/// Refuses work whose memory cannot be had, as an `allocation` answer.
fn check_room(bytes: Option<usize>) -> Result<(), RowError> {
    let bytes = bytes.map(crate::memory::with_margin);
    if crate::memory::can_allocate_checked(bytes) {
        return Ok(());
    }
    Err(RowError {
        kind: "allocation",
        message: crate::memory::refusal(
            "verifying the draft (the rows and the target's distributions)",
            bytes,
        ),
    })
}

/// Verifies one parsed request.
///
/// # Errors
/// `invalid_row` when the fields do not make a request (no `draft_token_ids`, both or neither
/// of `target_logits` and `target_probs`, both `params` and `chain`, a chain with
/// probabilities, rows of the wrong count or length, a bad `vocab_size`); `allocation` when
/// the memory cannot be had; otherwise the verifier's error.
pub fn answer_request(request: VerifyInput) -> Result<Answer, RowError> {
    let draft = request
        .draft_token_ids
        .ok_or_else(|| RowError::invalid_row("`draft_token_ids` is required (K ids, maybe none)"))?
        .0;
    let k = draft.len();
    let (target, probs) = match (request.target_logits, request.target_probs) {
        (Some(t), None) => (t.0, false),
        (None, Some(t)) => (t.0, true),
        (Some(_), Some(_)) => {
            return Err(RowError::invalid_row(
                "both `target_logits` and `target_probs` given: give one of them",
            ))
        }
        (None, None) => {
            return Err(RowError::invalid_row(
                "neither `target_logits` nor `target_probs` given: give one of them",
            ))
        }
    };
    let len = target.first().map_or(0, |r| r.values.len());
    if len == 0 {
        return Err(RowError::invalid_row(
            "the target rows are empty: give K + 1 rows of vocab_size values",
        ));
    }
    let vocab_size = request.vocab_size.unwrap_or(len);
    if vocab_size == 0 || vocab_size > len {
        return Err(RowError::invalid_row(format!(
            "vocab_size {vocab_size} must be in 1..={len} (the row length)"
        )));
    }
    let field = if probs {
        "target_probs"
    } else {
        "target_logits"
    };
    let rows = flatten(field, target, k + 1, len, vocab_size)?;
    let draft_probs = match request.draft_probs {
        Some(q) => Some(flatten("draft_probs", q.0, k, len, vocab_size)?),
        None => None,
    };
    let prompt_ids = request.prompt_ids.unwrap_or_default().0;
    let output_ids = request.output_ids.unwrap_or_default().0;
    let position = request
        .position
        .unwrap_or((prompt_ids.len() + output_ids.len()) as u64);
    let eos_ids = request.eos_token_ids.unwrap_or_default().0;
    let stop_token_ids = request.stop_token_ids.unwrap_or_default().0;
    let ids = [
        ("prompt_ids", &prompt_ids[..]),
        ("output_ids", &output_ids[..]),
        ("eos_token_ids", &eos_ids[..]),
        ("stop_token_ids", &stop_token_ids[..]),
        ("draft_token_ids", &draft[..]),
    ];
    let mut stop_ids = eos_ids.clone();
    stop_ids.extend_from_slice(&stop_token_ids);
    // The target's distribution, a residual and a draft row in f64 at once.
    let distributions = vocab_size.checked_mul(24);
    let (params, chain) = match (request.params, request.chain) {
        (Some(_), Some(_)) => {
            return Err(RowError::invalid_row(
                "both `params` and `chain` given: give at most one of them",
            ))
        }
        (None, Some(config)) => {
            if probs {
                return Err(RowError::invalid_row(
                    "a `chain` request takes `target_logits`, not `target_probs` (processors \
                     act on logits)",
                ));
            }
            let need = crate::memory::chain_row_bytes(vocab_size, &config);
            let mut chain =
                SamplerChain::from_config(&config).map_err(crate::sample::chain_error)?;
            crate::sample::check_context_ids(&ids, vocab_size)?;
            check_room(need.zip(distributions).and_then(|(a, b)| a.checked_add(b)))?;
            chain.reset(&prompt_ids);
            for &token in &output_ids {
                chain.accept(token);
            }
            (SamplingParams::default(), Some(chain))
        }
        (Some(Object(p)), None) => (p.to_params(), None),
        (None, None) => (SamplingParams::default(), None),
    };
    if chain.is_none() {
        params.validate().map_err(SampleError::InvalidParams)?;
        crate::sample::check_context_ids(&ids, vocab_size)?;
        check_room(
            crate::memory::sampler_row_bytes(vocab_size, &params, false)
                .zip(distributions)
                .and_then(|(a, b)| a.checked_add(b)),
        )?;
    }
    let verifier = match &chain {
        Some(c) => Verifier::Chain(c),
        None => Verifier::Params(&params),
    };
    let target = if probs {
        TargetRows::Probs(&rows)
    } else {
        TargetRows::Logits(&rows)
    };
    let req = VerifyRequest {
        verifier,
        prompt_ids: &prompt_ids,
        output_ids: &output_ids,
        stop_token_ids: &stop_ids,
        position,
        draft_token_ids: &draft,
        draft_probs: draft_probs.as_deref(),
        target,
        vocab_size,
    };
    Ok(verify(&req)?.into())
}

/// One input line answered: the request's answer, or its error.
pub fn answer(line: &[u8]) -> Result<Answer, RowError> {
    parse_request(line).and_then(answer_request)
}

/// The answer line (without newline) for one input line, as the command writes it.
pub fn answer_line(line: &[u8]) -> Vec<u8> {
    crate::answer::to_line(&Reply(answer(line)))
}

/// Answers every non-blank line of `input` on `out`, in input order, in parallel blocks of up
/// to [`BLOCK`] lines ([`crate::sample::stream_lines`]); a line longer than `limit` is
/// answered `input_too_large`.
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

/// Runs `nucleus speculative-verify` and returns its exit status (module doc).
pub fn command(args: &SpeculativeVerifyArgs) -> ExitCode {
    let limit = args.limit.max_input_bytes;
    crate::sample::run_command(
        None,
        args.input.as_deref(),
        |_, _| {
            Err(RunError::Usage(
                "no tensor input for speculative-verify".into(),
            ))
        },
        |input, out| run_jsonl(input, out, limit),
    )
}
