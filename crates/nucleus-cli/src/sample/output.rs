//! What `nucleus sample` writes: one JSON line per row, an answer ([`Answer`]) or an error
//! ([`RowError`]). Non-finite numbers are written as the strings `"-inf"`, `"inf"`, `"nan"`.

use nucleus_sampling::{LogprobsKind, SampleError, SampleOutput};
use serde::{Serialize, Serializer};

/// An f64 that serializes as a JSON number when finite, else as `"-inf"`, `"inf"` or `"nan"`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct JsonF64(f64);

impl Serialize for JsonF64 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match non_finite_name(self.0) {
            None => s.serialize_f64(self.0),
            Some(name) => s.serialize_str(name),
        }
    }
}

/// How the JSON answers spell a non-finite number: `"nan"`, `"inf"` or `"-inf"`; `None` for a
/// finite one (written as a JSON number).
pub(crate) fn non_finite_name(v: f64) -> Option<&'static str> {
    if v.is_finite() {
        None
    } else if v.is_nan() {
        Some("nan")
    } else if v > 0.0 {
        Some("inf")
    } else {
        Some("-inf")
    }
}

/// One entry of a `top_logprobs` list.
#[derive(Clone, Copy, Debug, Serialize)]
struct TopEntry {
    id: u32,
    logprob: JsonF64,
}

/// f64 values written as a JSON list of [`JsonF64`], straight from the slice.
pub(crate) fn f64_list<S: Serializer>(values: &[f64], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(values.iter().map(|&v| JsonF64(v)))
}

fn optional_f64_list<S: Serializer>(values: &Option<Vec<f64>>, s: S) -> Result<S::Ok, S::Error> {
    match values {
        Some(v) => f64_list(v, s),
        None => s.serialize_none(),
    }
}

/// The `top_logprobs` field: the one list of the row's top entries, written once per sampled
/// token (the `n` samples share one distribution) without being copied `n` times.
#[derive(Debug)]
struct Repeated {
    list: Vec<TopEntry>,
    times: usize,
}

impl Serialize for Repeated {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(std::iter::repeat_n(&self.list, self.times))
    }
}

/// The answer for a row that was sampled.
///
/// `tokens` holds the `n` samples in sample order; `logprobs` their log-probabilities of the
/// kind `logprobs_kind` (the asked kind, or `"processed"` when logprobs were not asked);
/// `top_logprobs` one list per sampled token (the same list `n` times: the samples share one
/// distribution), empty lists when not asked; `num_candidates` the tokens with non-zero final
/// probability; `seed` the seed used; `dist`, with `--dist`, the final distribution over the
/// whole row (zeros for removed tokens and for ids at or above `vocab_size`), written straight
/// from the distribution's own vector.
#[derive(Debug, Serialize)]
pub struct Answer {
    tokens: Vec<u32>,
    #[serde(serialize_with = "f64_list")]
    logprobs: Vec<f64>,
    logprobs_kind: &'static str,
    top_logprobs: Repeated,
    num_candidates: usize,
    seed: u64,
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "optional_f64_list"
    )]
    dist: Option<Vec<f64>>,
}

impl Answer {
    /// The answer for a sampled row; `dist` is the final distribution when `--dist` was given.
    pub fn new(output: &SampleOutput, dist: Option<Vec<f64>>) -> Self {
        let tokens: Vec<u32> = output.tokens().collect();
        let (logprobs, kind, top) = match &output.logprobs {
            Some(l) => (
                l.sampled.clone(),
                l.kind,
                l.top
                    .iter()
                    .map(|t| TopEntry {
                        id: t.token_id,
                        logprob: JsonF64(t.logprob),
                    })
                    .collect(),
            ),
            None => (
                std::iter::once(output.logprob)
                    .chain(output.extra_samples.iter().map(|s| s.logprob))
                    .collect(),
                LogprobsKind::Processed,
                Vec::new(),
            ),
        };
        Self {
            top_logprobs: Repeated {
                list: top,
                times: tokens.len(),
            },
            tokens,
            logprobs,
            logprobs_kind: kind.as_str(),
            num_candidates: output.num_candidates,
            seed: output.seed,
            dist,
        }
    }
}

/// The most `top_logprobs` entries one answer may hold: `n × logprobs`, since the list of
/// `logprobs` entries is written once per sampled token. (1024 × 151936 would be 6.7 GB of
/// JSON for one row.)
pub const MAX_TOP_LOGPROBS: usize = 1 << 20;

/// Checks that the answer for `output` holds at most [`MAX_TOP_LOGPROBS`] `top_logprobs`
/// entries.
///
/// # Errors
/// `invalid_params` naming `n`, `logprobs` and the limit.
pub fn check_top_logprobs(output: &SampleOutput) -> Result<(), RowError> {
    let n = 1 + output.extra_samples.len();
    let logprobs = output.logprobs.as_ref().map_or(0, |l| l.top.len());
    let entries = n.saturating_mul(logprobs);
    if entries <= MAX_TOP_LOGPROBS {
        return Ok(());
    }
    Err(RowError {
        kind: "invalid_params",
        message: format!(
            "n × logprobs = {n} × {logprobs} = {entries} top_logprobs entries, more than the \
             limit of {MAX_TOP_LOGPROBS} per row (the list of `logprobs` entries is repeated \
             for each of the `n` tokens): lower n or logprobs"
        ),
    })
}

/// Why a row got no answer: `kind` is a stable snake_case name, `message` says what was wrong.
///
/// Kinds: the [`SampleError`] variants (`non_finite_logits`, `invalid_probability`,
/// `no_candidates`, `invalid_params`, `penalty_overflow`, `seed_unavailable`,
/// `token_id_out_of_range`), `invalid_json` (the line does not parse as JSON) and
/// `invalid_row` (well-formed JSON whose fields are wrong).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowError {
    /// The error's kind.
    pub kind: &'static str,
    /// What was wrong, in words.
    pub message: String,
}

impl RowError {
    /// An `invalid_json` error.
    pub fn invalid_json(message: impl Into<String>) -> Self {
        Self {
            kind: "invalid_json",
            message: message.into(),
        }
    }

    /// An `invalid_row` error.
    pub fn invalid_row(message: impl Into<String>) -> Self {
        Self {
            kind: "invalid_row",
            message: message.into(),
        }
    }
}

impl crate::answer::ErrorAnswer for RowError {
    fn kind(&self) -> &str {
        self.kind
    }
    fn message(&self) -> &str {
        &self.message
    }
}

impl From<SampleError> for RowError {
    fn from(e: SampleError) -> Self {
        let kind = match e {
            SampleError::NonFiniteLogits { .. } => "non_finite_logits",
            SampleError::InvalidProbability { .. } => "invalid_probability",
            SampleError::NoCandidates => "no_candidates",
            SampleError::InvalidBitmask(_) => "invalid_bitmask",
            SampleError::InvalidParams(_) => "invalid_params",
            SampleError::PenaltyOverflow { .. } => "penalty_overflow",
            SampleError::ProcessorOverflow { .. } => "processor_overflow",
            SampleError::SeedUnavailable(_) => "seed_unavailable",
            SampleError::TokenIdOutOfRange { .. } => "token_id_out_of_range",
        };
        Self {
            kind,
            message: e.to_string(),
        }
    }
}

/// One output line (without its newline): the answer, or `{"error": {"kind", "message"}}`.
pub fn line(result: &Result<Answer, RowError>) -> Vec<u8> {
    crate::answer::to_line(&crate::answer::Reply(result.as_ref()))
}
